// SPDX-License-Identifier: Apache-2.0
// Reads typed values off a libFuzzer input; past the end every read returns zero bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace dcpattn::fuzz {

class Input {
 public:
  Input(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  template <class T>
  T take() {
    T v{};
    unsigned char buf[sizeof(T)] = {};
    for (std::size_t i = 0; i < sizeof(T); ++i) buf[i] = at_ < size_ ? data_[at_++] : 0;
    std::memcpy(&v, buf, sizeof(T));
    return v;
  }
  /// An integer in [lo, hi].
  long long range(long long lo, long long hi) {
    const auto u = take<std::uint32_t>();
    return lo + static_cast<long long>(u % static_cast<std::uint64_t>(hi - lo + 1));
  }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t at_ = 0;
};

/// Reports a violated property and crashes, which libFuzzer records with the input.
[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "dcpattn fuzz property violated: %s\n", what);
  std::abort();
}

}  // namespace dcpattn::fuzz

#define DCPATTN_FUZZ_CHECK(cond) \
  do {                           \
    if (!(cond)) ::dcpattn::fuzz::fail(#cond); \
  } while (0)
