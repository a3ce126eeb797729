// SPDX-License-Identifier: Apache-2.0
// RoPE against a rotation written here: pair layouts (interleaved and NeoX), the cos/sin of plain
// RoPE, inversion by the opposite angle, and norm preservation.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "support/catch.hpp"
#include "support/numeric_ref.hpp"

#include "dcpattn/core/numeric.hpp"
#include "dcpattn/core/rope.hpp"

namespace {

using dcpattn::bfloat16;
using dcpattn::test::store;
using dcpattn::test::value;
using dcpattn::RopeStyle;

constexpr long double kEps = 0x1p-24L;   // unit roundoff of fp32
constexpr long double kEpsBf = 0x1p-8L;  // unit roundoff of bfloat16
constexpr int kD = 64;                   // qk_rope_head_dim of the reference models


/// The pairs of a row of d rotary dims, written out for each layout.
void pairs_of(RopeStyle style, int d, std::vector<int>& first, std::vector<int>& second) {
  first.clear();
  second.clear();
  for (int i = 0; i < d / 2; ++i) {
    if (style == RopeStyle::interleaved) {  // (x0, x1), (x2, x3), ...
      first.push_back(2 * i);
      second.push_back(2 * i + 1);
    } else {  // NeoX: first half with second half
      first.push_back(i);
      second.push_back(d / 2 + i);
    }
  }
}

/// Plain rotation of a row by the per-pair angles given as (cos, sin), in long double.
std::vector<long double> ref_rotate(const std::vector<long double>& x, RopeStyle style,
                                    const std::vector<float>& c, const std::vector<float>& s) {
  std::vector<int> f, g;
  pairs_of(style, int(x.size()), f, g);
  std::vector<long double> y = x;
  for (std::size_t i = 0; i < f.size(); ++i) {
    const long double a = x[std::size_t(f[i])], b = x[std::size_t(g[i])];
    y[std::size_t(f[i])] = a * c[i] - b * s[i];
    y[std::size_t(g[i])] = a * s[i] + b * c[i];
  }
  return y;
}

template <class T>
void check_row(std::mt19937_64& rng, RopeStyle style, long long pos, float base) {
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  std::vector<T> x;
  std::vector<long double> x0;
  for (int i = 0; i < kD; ++i) {
    x.push_back(store<T>(u(rng)));
    x0.push_back(value(x.back()));
  }
  std::vector<float> c, s;
  for (int i = 0; i < kD / 2; ++i) {
    const auto cs = dcpattn::rope_cos_sin(pos, i, kD, base);
    c.push_back(cs.cos_v);
    s.push_back(cs.sin_v);
  }
  const std::vector<long double> want = ref_rotate(x0, style, c, s);
  dcpattn::rope_row(x.data(), c.data(), s.data(), kD, style);

  std::vector<int> f, g;
  pairs_of(style, kD, f, g);
  std::int64_t bad = 0;
  std::string first;
  for (int i = 0; i < kD / 2; ++i) {
    // Two products and a sum in fp32: at most ~2 eps of |a c| + |b s| each; a bfloat16 row adds
    // the rounding of the stored result (relative 2^-8).
    const long double a = x0[std::size_t(f[i])], b = x0[std::size_t(g[i])];
    const long double scale =
        std::fabs(a * c[i]) + std::fabs(b * s[i]) + std::fabs(a * s[i]) + std::fabs(b * c[i]);
    for (int k : {f[i], g[i]}) {
      const long double w = want[std::size_t(k)];
      const long double tol =
          3 * kEps * scale +
          (std::is_same_v<T, bfloat16> ? kEpsBf * (std::fabs(w) + 3 * kEps * scale) : 0.0L);
      const long double got = value(x[std::size_t(k)]);
      if (!(std::fabs(got - w) <= tol) && bad++ == 0) {
        std::ostringstream os;
        os << "dim " << k << ": got " << (double)got << ", want " << (double)w;
        first = os.str();
      }
    }
  }
  INFO((style == RopeStyle::interleaved ? "interleaved" : "neox")
       << (std::is_same_v<T, bfloat16> ? " bf16" : " f32") << ", pos " << pos << ", base " << base
       << ": " << bad << " mismatches; first " << first);
  CHECK(bad == 0);
}

}  // namespace

TEST_CASE("rope_pair: a plain rotation", "[rope]") {
  std::mt19937_64 rng(41);
  std::uniform_real_distribution<float> u(-5.0f, 5.0f);
  std::uniform_real_distribution<double> ang(-10.0, 10.0);
  for (int k = 0; k < 10000; ++k) {
    const float x0 = u(rng), x1 = u(rng);
    const double t = ang(rng);
    const float c = float(std::cos(t)), s = float(std::sin(t));
    const auto r = dcpattn::rope_pair(x0, x1, c, s);
    const long double w0 = (long double)x0 * c - (long double)x1 * s;
    const long double w1 = (long double)x0 * s + (long double)x1 * c;
    // Two rounded products and one rounded sum: <= 2 eps (|x0 c| + |x1 s|) (first order).
    const long double scale = std::fabs((long double)x0) + std::fabs((long double)x1);
    INFO("x = (" << x0 << ", " << x1 << "), angle " << t);
    REQUIRE(std::fabs(r.x0 - w0) <= 3 * kEps * scale);
    REQUIRE(std::fabs(r.x1 - w1) <= 3 * kEps * scale);
  }
  // Quarter turns are exact: (x0, x1) -> (-x1, x0).
  const auto q = dcpattn::rope_pair(2.0f, 3.0f, 0.0f, 1.0f);
  CHECK(q.x0 == -3.0f);
  CHECK(q.x1 == 2.0f);
  static_assert(dcpattn::rope_pair(1.0f, 0.0f, 1.0f, 0.0f).x0 == 1.0f);
}

TEST_CASE("rope_pair_index: the two layouts", "[rope]") {
  for (int i = 0; i < kD / 2; ++i) {
    const auto a = dcpattn::rope_pair_index(RopeStyle::interleaved, i, kD);
    CHECK(a.first == 2 * i);
    CHECK(a.second == 2 * i + 1);
    const auto b = dcpattn::rope_pair_index(RopeStyle::neox, i, kD);
    CHECK(b.first == i);
    CHECK(b.second == i + kD / 2);
  }
}

TEST_CASE("rope_cos_sin: angle = pos * base^(-2i/d)", "[rope]") {
  for (long long pos : {0LL, 1LL, 7LL, 4095LL, 163839LL}) {
    for (float base : {10000.0f, 50000.0f}) {
      for (int i = 0; i < kD / 2; ++i) {
        const long double angle =
            (long double)pos * std::pow((long double)base, -2.0L * i / (long double)kD);
        const auto cs = dcpattn::rope_cos_sin(pos, i, kD, base);
        // fp32 rounding of cos/sin (eps) plus the double-precision angle error, which grows with
        // the angle (|angle| 2^-52 or so, at most ~1e-10 here).
        const long double tol = 2 * kEps + angle * 0x1p-50L;
        CAPTURE(pos, base, i);
        CHECK(std::fabs(cs.cos_v - std::cos(angle)) <= tol);
        CHECK(std::fabs(cs.sin_v - std::sin(angle)) <= tol);
      }
    }
  }
  const auto zero = dcpattn::rope_cos_sin(0, 5, kD, 10000.0f);
  CHECK(zero.cos_v == 1.0f);
  CHECK(zero.sin_v == 0.0f);
  // Pair 0 turns by exactly pos radians.
  const auto p0 = dcpattn::rope_cos_sin(3, 0, kD, 10000.0f);
  CHECK(std::fabs(p0.cos_v - std::cos(3.0L)) <= 2 * kEps);
  CHECK(std::fabs(p0.sin_v - std::sin(3.0L)) <= 2 * kEps);
}

TEST_CASE("rope_row: both layouts against a plain rotation", "[rope]") {
  std::mt19937_64 rng(42);
  for (RopeStyle style : {RopeStyle::interleaved, RopeStyle::neox})
    for (long long pos : {0LL, 1LL, 2LL, 17LL, 1000LL, 65535LL, 163839LL})
      for (float base : {10000.0f, 1e6f}) {
        check_row<float>(rng, style, pos, base);
        check_row<bfloat16>(rng, style, pos, base);
      }
}

TEST_CASE("rope_row: the layouts are really different", "[rope]") {
  // The same row rotated in the two layouts differs (a layout mixup cannot pass the test above by
  // accident): with pos = 1, pair 1 turns by base^(-2/d) in both, but on different dims.
  std::vector<float> a(kD), b(kD), c(kD / 2), s(kD / 2);
  for (int i = 0; i < kD; ++i) a[std::size_t(i)] = b[std::size_t(i)] = float(i + 1);
  for (int i = 0; i < kD / 2; ++i) {
    const auto cs = dcpattn::rope_cos_sin(1, i, kD, 10000.0f);
    c[std::size_t(i)] = cs.cos_v;
    s[std::size_t(i)] = cs.sin_v;
  }
  dcpattn::rope_row(a.data(), c.data(), s.data(), kD, RopeStyle::interleaved);
  dcpattn::rope_row(b.data(), c.data(), s.data(), kD, RopeStyle::neox);
  int differ = 0;
  for (int i = 0; i < kD; ++i) differ += a[std::size_t(i)] != b[std::size_t(i)] ? 1 : 0;
  CHECK(differ > kD / 2);
}

TEST_CASE("rope_row: rotating back recovers the input; pair norms are preserved", "[rope]") {
  std::mt19937_64 rng(43);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  for (RopeStyle style : {RopeStyle::interleaved, RopeStyle::neox}) {
    std::vector<int> f, g;
    pairs_of(style, kD, f, g);
    for (long long pos : {1LL, 100LL, 12345LL, 163839LL}) {
      std::vector<float> x(kD), c(kD / 2), s(kD / 2), neg_s(kD / 2);
      for (auto& v : x) v = u(rng);
      const std::vector<float> x0 = x;
      for (int i = 0; i < kD / 2; ++i) {
        const auto cs = dcpattn::rope_cos_sin(pos, i, kD, 10000.0f);
        c[std::size_t(i)] = cs.cos_v;
        s[std::size_t(i)] = cs.sin_v;
        neg_s[std::size_t(i)] = -cs.sin_v;
      }
      dcpattn::rope_row(x.data(), c.data(), s.data(), kD, style);
      const std::vector<float> rotated = x;
      dcpattn::rope_row(x.data(), c.data(), neg_s.data(), kD, style);
      CAPTURE(pos, style == RopeStyle::neox);
      for (int i = 0; i < kD / 2; ++i) {
        const std::size_t a = std::size_t(f[std::size_t(i)]), b = std::size_t(g[std::size_t(i)]);
        const long double r0 = std::hypot((long double)x0[a], (long double)x0[b]);
        const long double r1 = std::hypot((long double)rotated[a], (long double)rotated[b]);
        // cos^2 + sin^2 of rounded fp32 values is 1 within ~2 eps; each rotation adds ~3 eps
        // of the pair's magnitude per coordinate.
        CHECK(std::fabs(r1 - r0) <= 8 * kEps * r0 + 1e-30L);
        // Back-rotation: (R(-t) R(t)) = identity up to the same roundings, twice.
        CHECK(std::fabs(x[a] - x0[a]) <= 16 * kEps * r0);
        CHECK(std::fabs(x[b] - x0[b]) <= 16 * kEps * r0);
      }
      // A real rotation happened.
      float moved = 0.0f;
      for (int i = 0; i < kD; ++i)
        moved = std::max(moved, std::fabs(rotated[std::size_t(i)] - x0[std::size_t(i)]));
      CHECK(moved > 0.1f);
    }
  }
}
