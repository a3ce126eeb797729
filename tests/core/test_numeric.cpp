// SPDX-License-Identifier: Apache-2.0
// bfloat16 and fp8 e4m3 conversions against references written here from the format definitions:
// bfloat16 rounding via long double arithmetic and nearbyint, e4m3 decoding from (sign, exponent,
// mantissa) with bias 7, and e4m3 encoding by a brute-force search for the nearest code.
#include <bit>
#include <cfenv>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "support/catch.hpp"

#include "dcpattn/core/numeric.hpp"

namespace {

using dcpattn::bfloat16;
using dcpattn::fp8_e4m3;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

std::uint32_t bits(float f) {
  return std::bit_cast<std::uint32_t>(f);
}
float from_bits(std::uint32_t u) {
  return std::bit_cast<float>(u);
}

/// Reference bfloat16 rounding of a finite float, in long double: bfloat16 keeps 8 significant
/// bits and float's exponent range, so the spacing of bfloat16 values around |f| in [2^(e-1), 2^e)
/// is 2^(e-8), and 2^-133 throughout the subnormal range (e <= -125). nearbyintl rounds the scaled
/// value to an integer, ties to even (the default rounding mode). Values that round to 2^128 or
/// beyond overflow to infinity.
float ref_bf16_round(float f) {
  const long double x = f;
  if (x == 0.0L) return f;  // keeps the sign of zero
  int e = 0;
  (void)std::frexp(x, &e);  // |x| = m 2^e, m in [0.5, 1)
  const int q = std::max(e, -125) - 8;
  const long double r = std::nearbyint(std::ldexp(x, -q));
  const long double y = std::ldexp(r, q);
  if (std::fabs(y) >= 0x1p128L) return std::signbit(f) ? -kInf : kInf;
  return float(y);  // exact: y has at most 8 significant bits
}

/// Value of e4m3 code b from the definition: sign bit 7, exponent bits 6..3 (bias 7), mantissa
/// bits 2..0; exponent 0 is subnormal (m 2^-9); S.1111.111 is NaN; no infinities.
float ref_e4m3_decode(int b) {
  const int s = (b >> 7) & 1, e = (b >> 3) & 0xf, m = b & 0x7;
  if (e == 0xf && m == 0x7) return kNaN;
  const long double mag =
      e == 0 ? std::ldexp((long double)m, -9) : std::ldexp(1.0L + m / 8.0L, e - 7);
  return float(s ? -mag : mag);
}

/// Brute-force round to nearest even over all finite e4m3 codes of the value's sign, saturating
/// beyond 448. "Even" is the code whose mantissa LSB (bit 0) is 0.
std::uint8_t ref_e4m3_encode(float f) {
  if (std::isnan(f)) return 0x7f;
  const int sign = std::signbit(f) ? 0x80 : 0;
  const long double a = std::fabs((long double)f);
  int best = 0;
  long double best_d = std::numeric_limits<long double>::infinity();
  for (int c = 0; c <= 0x7e; ++c) {
    const long double d = std::fabs((long double)ref_e4m3_decode(c) - a);
    if (d < best_d || (d == best_d && (c & 1) == 0)) {
      best = c;
      best_d = d;
    }
  }
  return std::uint8_t(sign | best);
}

}  // namespace

TEST_CASE("bfloat16: round to nearest even over float bit patterns", "[numeric][bf16]") {
  REQUIRE(std::fegetround() == FE_TONEAREST);
  std::int64_t checked = 0, mismatches = 0;
  std::string first;
  auto check = [&](std::uint32_t u) {
    const float f = from_bits(u);
    if (std::isnan(f)) return;
    const bfloat16 got = bfloat16::from_float(f);
    const float want = ref_bf16_round(f);
    ++checked;
    if (bits(got.to_float()) != bits(want) || (got.bits != (bits(want) >> 16))) {
      if (mismatches++ == 0) {
        std::ostringstream os;
        os << std::hex << "0x" << u << " -> 0x" << got.bits << ", expected 0x"
           << (bits(want) >> 16);
        first = os.str();
      }
    }
  };
  // Every upper half (sign, exponent, 7 mantissa bits), with the lower halves that decide the
  // rounding: exact, just below / at / just above the tie, and the extremes.
  const std::uint32_t lows[] = {0x0000, 0x0001, 0x3fff, 0x7ffe, 0x7fff,
                                0x8000, 0x8001, 0xbfff, 0xfffe, 0xffff};
  for (std::uint32_t hi = 0; hi < 0x10000; ++hi)
    for (std::uint32_t lo : lows) check((hi << 16) | lo);
  // A dense stride over all 2^32 patterns, and random ones.
  for (std::uint64_t u = 0; u < (std::uint64_t(1) << 32); u += 997) check(std::uint32_t(u));
  std::mt19937 rng(11);
  for (int k = 0; k < 1000000; ++k) check(std::uint32_t(rng()));
  INFO(mismatches << " of " << checked << " patterns differ; first: " << first);
  CHECK(mismatches == 0);
  CHECK(checked > 5000000);
}

TEST_CASE("bfloat16: special values", "[numeric][bf16]") {
  SECTION("NaN stays NaN, including signaling NaNs whose payload sits in the low bits") {
    for (std::uint32_t u : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu,
                            0x7f80ffffu, 0x7fbfffffu}) {
      CAPTURE(u);
      const bfloat16 b = bfloat16::from_float(from_bits(u));
      CHECK((b.bits & 0x7f80u) == 0x7f80u);
      CHECK((b.bits & 0x007fu) != 0u);
      CHECK(std::isnan(b.to_float()));
      CHECK((b.bits & 0x8000u) == ((u >> 16) & 0x8000u));  // sign kept
    }
  }
  SECTION("infinities and signed zeros are kept") {
    CHECK(bfloat16::from_float(kInf).bits == 0x7f80u);
    CHECK(bfloat16::from_float(-kInf).bits == 0xff80u);
    CHECK(bfloat16::from_float(0.0f).bits == 0x0000u);
    CHECK(bfloat16::from_float(-0.0f).bits == 0x8000u);
    CHECK(std::signbit(bfloat16::from_float(-0.0f).to_float()));
  }
  SECTION("overflow and underflow") {
    // Largest bfloat16: 0x7f7f = (2 - 2^-7) 2^127. Halfway to 2^128 rounds to even: infinity.
    CHECK(bfloat16::from_float(std::numeric_limits<float>::max()).bits == 0x7f80u);
    CHECK(bfloat16::from_float(from_bits(0x7f7f7fffu)).bits == 0x7f7fu);
    CHECK(bfloat16::from_float(from_bits(0x7f7f8000u)).bits == 0x7f80u);
    // Smallest subnormal float rounds to zero; half the smallest bfloat16 subnormal ties to 0.
    CHECK(bfloat16::from_float(from_bits(0x00000001u)).bits == 0x0000u);
    CHECK(bfloat16::from_float(from_bits(0x00008000u)).bits == 0x0000u);
    CHECK(bfloat16::from_float(from_bits(0x00008001u)).bits == 0x0001u);
    CHECK(bfloat16::from_float(from_bits(0x80018000u)).bits == 0x8002u);  // tie to even, negative
  }
  SECTION("ties go to the even neighbour") {
    CHECK(bfloat16::from_float(1.0f + 0x1p-8f).bits == 0x3f80u);             // 1 + half ulp -> 1
    CHECK(bfloat16::from_float(1.0f + 3 * 0x1p-8f).bits == 0x3f82u);         // -> 1 + 2 ulp
    CHECK(bfloat16::from_float(1.0f + 0x1p-8f + 0x1p-23f).bits == 0x3f81u);  // above the tie
  }
  SECTION("every bfloat16 value converts back to itself") {
    for (std::uint32_t b = 0; b < 0x10000; ++b) {
      const float f = bfloat16{std::uint16_t(b)}.to_float();
      if (std::isnan(f)) continue;
      REQUIRE(bits(f) == (b << 16));
      REQUIRE(bfloat16::from_float(f).bits == b);
      REQUIRE(bits(dcpattn::round_to_bf16(f)) == bits(f));
    }
  }
  SECTION("usable in constant expressions") {
    static_assert(bfloat16::from_float(1.0f).bits == 0x3f80);
    static_assert(bfloat16{0x4049}.to_float() == 3.140625f);
    static_assert(dcpattn::from_float<bfloat16>(-2.0f).bits == 0xc000);
    CHECK(dcpattn::to_float(bfloat16{0xc000}) == -2.0f);
    CHECK(dcpattn::from_float<float>(1.5f) == 1.5f);
  }
}

TEST_CASE("fp8 e4m3: decode of all 256 codes", "[numeric][fp8]") {
  for (int b = 0; b < 256; ++b) {
    CAPTURE(b);
    const float got = fp8_e4m3::decode(std::uint8_t(b));
    const float want = ref_e4m3_decode(b);
    if (std::isnan(want)) {
      CHECK(std::isnan(got));
      CHECK((b & 0x7f) == 0x7f);
    } else {
      CHECK(bits(got) == bits(want));  // sign of zero included
    }
  }
  CHECK(fp8_e4m3::decode(0x7e) == 448.0f);
  CHECK(fp8_e4m3::decode(0xfe) == -448.0f);
  CHECK(fp8_e4m3::max_finite == 448.0f);
  CHECK(fp8_e4m3::decode(0x01) == 0x1p-9f);  // smallest subnormal
  CHECK(fp8_e4m3::decode(0x07) == 7 * 0x1p-9f);
  CHECK(fp8_e4m3::decode(0x08) == 0x1p-6f);  // smallest normal
  CHECK(fp8_e4m3::decode(0x38) == 1.0f);
  CHECK(bits(fp8_e4m3::decode(0x80)) == bits(-0.0f));
  int nans = 0;
  for (int b = 0; b < 256; ++b) nans += std::isnan(fp8_e4m3::decode(std::uint8_t(b))) ? 1 : 0;
  CHECK(nans == 2);  // 0x7f and 0xff only: e4m3fn has no infinities
}

TEST_CASE("fp8 e4m3: encode", "[numeric][fp8]") {
  SECTION("encode(decode(b)) == b for every non-NaN code") {
    for (int b = 0; b < 256; ++b) {
      if ((b & 0x7f) == 0x7f) continue;
      CAPTURE(b);
      CHECK(int(fp8_e4m3::encode(ref_e4m3_decode(b))) == b);
    }
  }
  SECTION("midpoints between adjacent codes round to the even code") {
    for (int sign : {0, 0x80}) {
      for (int c = 0; c < 0x7e; ++c) {  // pairs (c, c + 1) up to (0x7d, 0x7e) = (416, 448)
        const float lo = ref_e4m3_decode(sign | c), hi = ref_e4m3_decode(sign | (c + 1));
        const float mid = (lo + hi) / 2;  // exact: few significant bits
        REQUIRE((long double)mid == ((long double)lo + hi) / 2);
        const int even = (c & 1) == 0 ? c : c + 1;
        CAPTURE(sign, c, mid);
        CHECK(int(fp8_e4m3::encode(mid)) == (sign | even));
        // Just off the midpoint, the nearer code wins whatever its parity.
        const float toward_lo = std::nextafter(mid, lo), toward_hi = std::nextafter(mid, hi);
        CHECK(int(fp8_e4m3::encode(toward_lo)) == (sign | c));
        CHECK(int(fp8_e4m3::encode(toward_hi)) == (sign | (c + 1)));
      }
    }
  }
  SECTION("saturation beyond 448 and for infinities; NaN encodes to 0x7f") {
    for (float f : {448.0f, 448.5f, 463.9f, 464.0f, 465.0f, 480.0f, 1e4f, 3.4e38f, kInf}) {
      CAPTURE(f);
      CHECK(int(fp8_e4m3::encode(f)) == 0x7e);
      CHECK(int(fp8_e4m3::encode(-f)) == 0xfe);
    }
    CHECK(int(fp8_e4m3::encode(kNaN)) == 0x7f);
    CHECK(int(fp8_e4m3::encode(-kNaN)) == 0x7f);
    CHECK(int(fp8_e4m3::encode(from_bits(0x7f800001u))) == 0x7f);
  }
  SECTION("zeros and underflow") {
    CHECK(int(fp8_e4m3::encode(0.0f)) == 0x00);
    CHECK(int(fp8_e4m3::encode(-0.0f)) == 0x80);
    CHECK(int(fp8_e4m3::encode(0x1p-10f)) == 0x00);  // half the smallest subnormal: tie to 0
    CHECK(int(fp8_e4m3::encode(std::nextafter(0x1p-10f, 1.0f))) == 0x01);
    CHECK(int(fp8_e4m3::encode(-std::nextafter(0x1p-10f, 1.0f))) == 0x81);
    CHECK(int(fp8_e4m3::encode(1e-30f)) == 0x00);
    CHECK(int(fp8_e4m3::encode(-1e-30f)) == 0x80);
    CHECK(int(fp8_e4m3::encode(from_bits(0x00000001u))) == 0x00);  // float subnormal
  }
  SECTION("random values against a brute-force nearest-code search") {
    std::mt19937 rng(12);
    std::int64_t mismatches = 0;
    float first = 0.0f;
    for (int k = 0; k < 120000; ++k) {
      float f;
      switch (k % 3) {
        case 0:
          f = std::uniform_real_distribution<float>(-500.0f, 500.0f)(rng);
          break;
        case 1:
          f = std::uniform_real_distribution<float>(-0.05f, 0.05f)(rng);
          break;
        default: {  // log-uniform magnitudes over the whole e4m3 range and beyond
          const float e = std::uniform_real_distribution<float>(-12.0f, 10.0f)(rng);
          f = std::exp2(e) * ((rng() & 1) ? -1.0f : 1.0f);
        }
      }
      if (fp8_e4m3::encode(f) != ref_e4m3_encode(f) && mismatches++ == 0) first = f;
    }
    INFO(mismatches << " mismatches, first at " << first);
    CHECK(mismatches == 0);
  }
  SECTION("usable in constant expressions") {
    static_assert(fp8_e4m3::encode(448.0f) == 0x7e);
    static_assert(fp8_e4m3::encode(-1.0f) == 0xb8);
    static_assert(fp8_e4m3::decode(0x38) == 1.0f);
    CHECK(true);
  }
}
