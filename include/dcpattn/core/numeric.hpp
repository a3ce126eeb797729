// SPDX-License-Identifier: Apache-2.0
// Storage types and conversions shared by host and device code: bfloat16 and fp8 e4m3.
// All conversions are bit-exact, round to nearest even, and usable in constant expressions.
#pragma once

#include <cstdint>

#include <cuda/std/bit>
#include <cuda/std/cmath>
#include <cuda/std/limits>

#include "dcpattn/config.hpp"

DCPATTN_NAMESPACE_BEGIN

/// bfloat16 storage (1 sign, 8 exponent, 7 mantissa bits). Layout-compatible with __nv_bfloat16 so
/// device code may reinterpret buffers; arithmetic is always done in float.
struct bfloat16 {
  std::uint16_t bits = 0;

  /// Rounds to nearest even; NaN stays NaN (quiet), infinities and signed zeros are kept.
  static constexpr DCPATTN_HOST_DEVICE bfloat16 from_float(float f) noexcept {
    const std::uint32_t u = cuda::std::bit_cast<std::uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return bfloat16{std::uint16_t((u >> 16) | 0x0040u)};
    const std::uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
    return bfloat16{std::uint16_t((u + rounding) >> 16)};
  }
  constexpr DCPATTN_HOST_DEVICE float to_float() const noexcept {
    return cuda::std::bit_cast<float>(std::uint32_t(bits) << 16);
  }
  friend constexpr DCPATTN_HOST_DEVICE bool operator==(bfloat16 a, bfloat16 b) noexcept {
    return a.bits == b.bits;  // bitwise: the comparison the invariance tests need
  }
};
static_assert(sizeof(bfloat16) == 2);

/// Rounds a float to the nearest bfloat16 and back.
constexpr DCPATTN_HOST_DEVICE float round_to_bf16(float f) noexcept {
  return bfloat16::from_float(f).to_float();
}

/// Converts a stored element to float (identity for float).
constexpr DCPATTN_HOST_DEVICE float to_float(float x) noexcept { return x; }
constexpr DCPATTN_HOST_DEVICE float to_float(bfloat16 x) noexcept { return x.to_float(); }

/// Converts a float to a storage type T (float or bfloat16).
template <class T>
constexpr DCPATTN_HOST_DEVICE T from_float(float x) noexcept {
  if constexpr (cuda::std::is_same_v<T, bfloat16>) {
    return bfloat16::from_float(x);
  } else {
    return static_cast<T>(x);
  }
}

/// fp8 e4m3 "fn" format (OCP FP8 E4M3, as __nv_fp8_e4m3): bias 7, no infinities, NaN = S.1111.111,
/// largest finite magnitude 448, smallest subnormal 2^-9.
struct fp8_e4m3 {
  static constexpr float max_finite = 448.0f;

  /// Encodes with round to nearest even. Magnitudes beyond 448 (infinities included) saturate to
  /// +-448 (the convention of quantized KV caches); NaN encodes as 0x7f.
  static constexpr DCPATTN_HOST_DEVICE std::uint8_t encode(float f) noexcept {
    const std::uint32_t u = cuda::std::bit_cast<std::uint32_t>(f);
    const std::uint8_t sign = std::uint8_t((u >> 24) & 0x80u);
    const std::uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return 0x7f;
    // 448 = 1.75 * 2^8 = 0x43e00000. Anything at or above 448 + half an ulp (464) saturates;
    // between 448 and 464 rounds down to 448 anyway, so saturate from 448 upward.
    if (a >= 0x43e00000u) return std::uint8_t(sign | 0x7e);
    const int exp = int(a >> 23) - 127;  // unbiased float exponent
    if (exp >= -6) {
      // Normal e4m3: keep 3 mantissa bits, round the 20 dropped bits to nearest even.
      const std::uint32_t mant = a & 0x7fffffu;
      std::uint32_t q = (std::uint32_t(exp + 7) << 3) | (mant >> 20);
      const std::uint32_t rest = mant & 0xfffffu;
      if (rest > 0x80000u || (rest == 0x80000u && (q & 1u))) ++q;  // may carry into the exponent
      return std::uint8_t(sign | q);
    }
    // Subnormal e4m3 (or underflow to zero): value = m * 2^-9 with m in [0, 8).
    const float af = cuda::std::bit_cast<float>(a);
    const float scaled = af * 512.0f;  // exact: power-of-two scaling of a float
    std::uint32_t m = std::uint32_t(scaled);
    const float frac = scaled - float(m);
    if (frac > 0.5f || (frac == 0.5f && (m & 1u))) ++m;  // m == 8 becomes the smallest normal
    return std::uint8_t(sign | m);
  }

  /// Decodes exactly (every e4m3 value is a float).
  static constexpr DCPATTN_HOST_DEVICE float decode(std::uint8_t b) noexcept {
    const std::uint32_t sign = std::uint32_t(b & 0x80u) << 24;
    const std::uint32_t e = (b >> 3) & 0xfu;
    const std::uint32_t m = b & 0x7u;
    if (e == 0xfu && m == 0x7u) return cuda::std::numeric_limits<float>::quiet_NaN();
    if (e == 0) {
      const float v = float(m) * (1.0f / 512.0f);
      return sign ? -v : v;
    }
    return cuda::std::bit_cast<float>(sign | ((e + 120u) << 23) | (m << 20));
  }
};

DCPATTN_NAMESPACE_END
