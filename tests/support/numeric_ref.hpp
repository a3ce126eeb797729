// SPDX-License-Identifier: Apache-2.0
// Reference conversions for the core tests, written independently of the library's own.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "dcpattn/core/numeric.hpp"

namespace dcpattn::test {

/// The exact value of a stored element, decoded from its bits (not through the library).
inline long double value(float f) { return f; }
inline long double value(bfloat16 b) {
  const std::uint32_t u = std::uint32_t(b.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

/// A float stored as T (float, or bfloat16 rounded by the library under test).
template <class T>
T store(float f) {
  if constexpr (std::is_same_v<T, bfloat16>) {
    return bfloat16::from_float(f);
  } else {
    return f;
  }
}

}  // namespace dcpattn::test
