// SPDX-License-Identifier: Apache-2.0
// The 656-byte fp8 "ds_mla" cache entry and fp8 group quantization: layout, scales, and round
// trips against bounds derived from the e4m3 format.
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "support/catch.hpp"
#include "support/numeric_ref.hpp"

#include "dcpattn/core/fp8_cache.hpp"
#include "dcpattn/core/numeric.hpp"

namespace {

using dcpattn::bfloat16;
using dcpattn::test::store;
using dcpattn::test::value;
using dcpattn::DsMlaFp8Entry;

constexpr long double kEps = 0x1p-24L;  // unit roundoff of fp32


/// e4m3 value of a code, from the format: bias 7, 3 mantissa bits, subnormals m 2^-9, S.1111.111
/// NaN.
long double e4m3_value(int b) {
  const int s = (b >> 7) & 1, e = (b >> 3) & 0xf, m = b & 0x7;
  if (e == 0xf && m == 0x7) return std::numeric_limits<long double>::quiet_NaN();
  const long double mag =
      e == 0 ? std::ldexp((long double)m, -9) : std::ldexp(1.0L + m / 8.0L, e - 7);
  return s ? -mag : mag;
}

/// Error bound of quantizing x with scale s and decoding (decode(code) * s):
///   y = x / s is rounded to fp32 (relative eps), then to e4m3. With |y| <= 448, in the normal
///   range an e4m3 binade [2^e, 2^(e+1)) has spacing 2^(e-3), so rounding to nearest moves y by at
///   most half of that, 2^(e-4) <= 2^-4 |y|; in the subnormal range (|y| < 2^-6) the spacing is
///   2^-9, so at most 2^-10. Multiplying back by s adds one more fp32 rounding. Hence
///   |decode * s - x| <= (2^-4 + 3 eps) |x| + 2^-10 s. Since |x| <= amax = 448 s, this is also
///   within 2^-4 amax + 2^-10 s, the "2^-4 of the group scale range" bound.
long double fp8_bound(long double x, long double s) {
  return (0x1p-4L + 3 * kEps) * std::fabs(x) + 0x1p-10L * s;
}

/// A 512-value latent with four differently scaled groups (one all zero) and a 64-value RoPE row
/// of bfloat16-representable values.
struct Input {
  std::vector<float> latent, rope;
};
Input random_input(std::mt19937_64& rng, int zero_group) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const float group_scale[DsMlaFp8Entry::num_groups] = {1.0f, 1000.0f, 1e-4f, 37.0f};
  Input in;
  for (int g = 0; g < DsMlaFp8Entry::num_groups; ++g)
    for (int i = 0; i < DsMlaFp8Entry::group_size; ++i)
      in.latent.push_back(g == zero_group ? 0.0f : group_scale[g] * u(rng));
  // An outlier in group 1: the other values then land at or below 448 * 1000 / 3e7 ~ 0.015, in
  // e4m3's subnormal range.
  if (zero_group != 1) in.latent[DsMlaFp8Entry::group_size + 5] = 3e7f;
  // Exact zeros and signed zeros inside a non-zero group.
  if (zero_group != 0) {
    in.latent[3] = 0.0f;
    in.latent[4] = -0.0f;
  }
  for (int i = 0; i < DsMlaFp8Entry::rope_dim; ++i) {
    // Random finite bfloat16 bit patterns of moderate exponent, as floats (exactly representable).
    std::uint16_t b;
    do {
      b = std::uint16_t(rng());
    } while (((b >> 7) & 0xff) < 100 || ((b >> 7) & 0xff) > 150);
    const std::uint32_t u32 = std::uint32_t(b) << 16;
    float f;
    std::memcpy(&f, &u32, sizeof f);
    in.rope.push_back(f);
  }
  return in;
}

template <class TL, class TR>
void check_entry(const Input& in) {
  std::vector<TL> latent;
  std::vector<TR> rope;
  for (float v : in.latent) latent.push_back(store<TL>(v));
  for (float v : in.rope) rope.push_back(store<TR>(v));
  std::vector<std::uint8_t> entry(DsMlaFp8Entry::bytes, 0xcd);
  DsMlaFp8Entry::encode(latent.data(), rope.data(), entry.data());

  std::int64_t bad = 0;
  std::string first;
  auto fail = [&](const auto&... what) {
    if (bad++ == 0) {
      std::ostringstream os;
      (os << ... << what);
      first = os.str();
    }
  };
  for (int g = 0; g < DsMlaFp8Entry::num_groups; ++g) {
    float amax = 0.0f;
    for (int i = 0; i < DsMlaFp8Entry::group_size; ++i)
      amax = std::max(amax, float(std::fabs(value(latent[std::size_t(g * 128 + i)]))));
    // The scale is amax / 448 (one fp32 division), or 1 for an all-zero group.
    const float want_scale = amax > 0.0f ? amax / 448.0f : 1.0f;
    const float got_scale = DsMlaFp8Entry::scale(entry.data(), g);
    if (std::bit_cast<std::uint32_t>(got_scale) != std::bit_cast<std::uint32_t>(want_scale))
      fail("group ", g, ": scale ", got_scale, ", expected ", want_scale);
    // Stored little-endian at byte 512 + 4 g.
    std::uint32_t stored = 0;
    for (int k = 0; k < 4; ++k)
      stored |= std::uint32_t(entry[std::size_t(512 + 4 * g + k)]) << (8 * k);
    if (stored != std::bit_cast<std::uint32_t>(want_scale)) fail("group ", g, ": scale bytes");

    for (int i = 0; i < DsMlaFp8Entry::group_size; ++i) {
      const int j = g * DsMlaFp8Entry::group_size + i;
      const long double x = value(latent[std::size_t(j)]);
      const float got = DsMlaFp8Entry::latent(entry.data(), j);
      if (!std::isfinite(got)) fail("latent ", j, " is not finite");
      if (!(std::fabs(got - x) <= fp8_bound(x, want_scale)))
        fail("latent ", j, ": ", got, " vs ", (double)x, ", bound ",
             (double)fp8_bound(x, want_scale));
      // The byte is the e4m3 code, and scaled by the group's scale it gives the latent value.
      if (std::fabs(e4m3_value(entry[std::size_t(j)]) * want_scale - got) > kEps * std::fabs(got))
        fail("latent ", j, ": byte ", int(entry[std::size_t(j)]), " does not decode to it");
      if (x == 0.0L && got != 0.0f) fail("latent ", j, ": zero decodes to ", got);
      if (amax == 0.0f && (entry[std::size_t(j)] & 0x7f) != 0)
        fail("latent ", j, ": zero group holds code ", int(entry[std::size_t(j)]));
      const float key = DsMlaFp8Entry::key(entry.data(), j);
      if (std::bit_cast<std::uint32_t>(key) != std::bit_cast<std::uint32_t>(got))
        fail("key ", j, " != latent ", j);
    }
  }
  for (int i = 0; i < DsMlaFp8Entry::rope_dim; ++i) {
    const long double x = value(rope[std::size_t(i)]);
    const float got = DsMlaFp8Entry::rope(entry.data(), i);
    // Inputs are bfloat16-representable, so the bf16 RoPE part is exact.
    if ((long double)got != x) fail("rope ", i, ": ", got, " vs ", (double)x);
    const std::uint16_t b =
        std::uint16_t(entry[std::size_t(528 + 2 * i)] | (entry[std::size_t(528 + 2 * i + 1)] << 8));
    const std::uint32_t xb = std::bit_cast<std::uint32_t>(float(x));
    if (b != (xb >> 16)) fail("rope ", i, ": bytes ", b, " are not the bf16 bits (little-endian)");
    const float key = DsMlaFp8Entry::key(entry.data(), DsMlaFp8Entry::latent_dim + i);
    if (std::bit_cast<std::uint32_t>(key) != std::bit_cast<std::uint32_t>(got))
      fail("key ", 512 + i, " != rope ", i);
  }
  INFO(bad << " mismatches; first: " << first);
  CHECK(bad == 0);
}

}  // namespace

TEST_CASE("ds_mla fp8 entry: layout constants", "[fp8_cache]") {
  static_assert(DsMlaFp8Entry::bytes == 656);
  CHECK(DsMlaFp8Entry::bytes == 512 + 4 * 4 + 64 * 2);
  CHECK(DsMlaFp8Entry::latent_dim == 512);
  CHECK(DsMlaFp8Entry::rope_dim == 64);
  CHECK(DsMlaFp8Entry::group_size == 128);
  CHECK(DsMlaFp8Entry::num_groups == 4);
  CHECK(DsMlaFp8Entry::scales_offset == 512);
  CHECK(DsMlaFp8Entry::rope_offset == 528);
}

TEST_CASE("ds_mla fp8 entry: encode then read back", "[fp8_cache]") {
  std::mt19937_64 rng(51);
  for (int trial = 0; trial < 40; ++trial) {
    const Input in = random_input(rng, trial % 5);  // zero group 0..3, or none (4)
    CAPTURE(trial);
    check_entry<float, float>(in);
    check_entry<bfloat16, bfloat16>(in);
    check_entry<float, bfloat16>(in);
    check_entry<bfloat16, float>(in);
  }
}

TEST_CASE("ds_mla fp8 entry: an all-zero group gets scale 1 and decodes to zeros", "[fp8_cache]") {
  std::vector<float> latent(512, 0.0f), rope(64, 0.0f);
  for (int i = 128; i < 256; ++i) latent[std::size_t(i)] = float(i - 192) * 0.5f;  // group 1 only
  std::vector<std::uint8_t> entry(DsMlaFp8Entry::bytes, 0xff);
  DsMlaFp8Entry::encode(latent.data(), rope.data(), entry.data());
  for (int g : {0, 2, 3}) {
    CAPTURE(g);
    CHECK(DsMlaFp8Entry::scale(entry.data(), g) == 1.0f);
    for (int i = 0; i < 128; ++i) CHECK(DsMlaFp8Entry::latent(entry.data(), g * 128 + i) == 0.0f);
  }
  CHECK(DsMlaFp8Entry::scale(entry.data(), 1) == 32.0f / 448.0f);
  for (int i = 0; i < 64; ++i) CHECK(DsMlaFp8Entry::rope(entry.data(), i) == 0.0f);
}

TEST_CASE("ds_mla fp8 entry: RoPE values that are not bf16 round to nearest bf16", "[fp8_cache]") {
  std::mt19937_64 rng(52);
  std::uniform_real_distribution<float> u(-10.0f, 10.0f);
  std::vector<float> latent(512, 1.0f), rope(64);
  for (auto& v : rope) v = u(rng);
  std::vector<std::uint8_t> entry(DsMlaFp8Entry::bytes);
  DsMlaFp8Entry::encode(latent.data(), rope.data(), entry.data());
  for (int i = 0; i < 64; ++i) {
    const long double x = rope[std::size_t(i)];
    const long double got = DsMlaFp8Entry::rope(entry.data(), i);
    CAPTURE(i);
    CHECK(std::fabs(got - x) <= 0x1p-8L * std::fabs(x));  // bf16 unit roundoff
  }
}

TEST_CASE("fp8 group scale and quantize_fp8_group", "[fp8_cache]") {
  SECTION("scale") {
    CHECK(dcpattn::fp8_group_scale(448.0f) == 1.0f);
    CHECK(dcpattn::fp8_group_scale(896.0f) == 2.0f);
    CHECK(dcpattn::fp8_group_scale(0.0f) == 1.0f);
    CHECK(dcpattn::fp8_group_scale(std::numeric_limits<float>::infinity()) == 1.0f);
    CHECK(dcpattn::fp8_group_scale(std::numeric_limits<float>::quiet_NaN()) == 1.0f);
    CHECK(dcpattn::fp8_group_scale(1.0f) == 1.0f / 448.0f);
  }
  SECTION("codes decode back; each code is the nearest e4m3 value") {
    std::mt19937_64 rng(53);
    for (int n : {1, 37, 128}) {
      for (float range : {1e-3f, 1.0f, 5e3f}) {
        std::uniform_real_distribution<float> u(-range, range);
        std::vector<float> x(static_cast<std::size_t>(n));
        for (auto& v : x) v = u(rng);
        std::vector<std::uint8_t> q(static_cast<std::size_t>(n), 0xaa);
        const float s = dcpattn::quantize_fp8_group(x.data(), n, q.data());
        float amax = 0.0f;
        for (float v : x) amax = std::max(amax, std::fabs(v));
        CAPTURE(n, range);
        CHECK(s == amax / 448.0f);
        for (int i = 0; i < n; ++i) {
          const long double xi = x[std::size_t(i)];
          const int code = q[std::size_t(i)];
          CAPTURE(i, xi, code);
          CHECK((code & 0x7f) != 0x7f);  // never NaN
          CHECK(std::fabs(e4m3_value(code) * s - xi) <= fp8_bound(xi, s));
          // Nearest: no other code of the same sign is closer to x / s.
          const long double y = (long double)(x[std::size_t(i)] / s);
          const long double d = std::fabs(e4m3_value(code) - y);
          bool nearest = true;
          for (int c = 0; c <= 0x7e; ++c) {
            const long double v = (y < 0 ? -1 : 1) * e4m3_value(c);
            nearest = nearest && std::fabs(v - y) >= d;
          }
          CHECK(nearest);
        }
      }
    }
    // bfloat16 input.
    std::vector<bfloat16> xb;
    for (int i = 0; i < 128; ++i) xb.push_back(bfloat16::from_float(float(i - 64) / 8.0f));
    std::vector<std::uint8_t> q(128);
    const float s = dcpattn::quantize_fp8_group(xb.data(), 128, q.data());
    CHECK(s == 8.0f / 448.0f);
    for (int i = 0; i < 128; ++i) {
      const long double xi = float(i - 64) / 8.0f;
      CHECK(std::fabs(e4m3_value(q[std::size_t(i)]) * s - xi) <= fp8_bound(xi, s));
    }
  }
}
