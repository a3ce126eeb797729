// SPDX-License-Identifier: Apache-2.0
// LSE merge against a long double reference written here, plus the bitwise properties the DCP
// combine relies on: commutativity, the neutral element, and the fixed merge tree whose result does
// not depend on how the states are split across ranks.
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "support/catch.hpp"

#include "dcpattn/core/lse.hpp"

namespace {

using dcpattn::lse_neg_inf;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr long double kEps = 0x1p-24L;  // unit roundoff of fp32

std::uint32_t bits(float f) {
  return std::bit_cast<std::uint32_t>(f);
}

/// Reference merge of two natural-log LSE values in long double. Empty inputs (-inf) have weight 0.
struct RefMerge {
  long double lse, w_a, w_b;
};
RefMerge ref_merge(float a, float b) {
  if (std::isinf(a) && std::isinf(b)) return {-INFINITY, 0.0L, 0.0L};  // both -inf (sanitized)
  const long double la = a, lb = b;
  long double sum = 0.0L;
  if (!std::isinf(a)) sum += std::exp(la - std::max(la, lb));
  if (!std::isinf(b)) sum += std::exp(lb - std::max(la, lb));
  const long double l = std::max(la, lb) + std::log(sum);
  return {l, std::isinf(a) ? 0.0L : std::exp(la - l), std::isinf(b) ? 0.0L : std::exp(lb - l)};
}

/// Reference log-sum-exp of n values (-inf entries are empty) in long double.
long double ref_lse_n(const std::vector<float>& x) {
  long double m = -INFINITY;
  for (float v : x)
    if (!std::isinf(v)) m = std::max(m, (long double)v);
  if (std::isinf(m)) return -INFINITY;
  long double s = 0.0L;
  for (float v : x)
    if (!std::isinf(v)) s += std::exp((long double)v - m);
  return m + std::log(s);
}

/// Absolute error allowed on an fp32 LSE of magnitude |ref| computed from k exponentials: each
/// expf/logf is within ~1 ulp (so the sum and its log carry ~(k + 2) eps absolutely), and the
/// final m + log(sum) rounds at the scale of |ref|; a factor of 2 covers the remaining roundings.
long double lse_tol(long double ref, int k = 2) {
  return kEps * (2.0L * (k + 2) + 2.0L * std::fabs(ref));
}

/// Random LSE values covering what kernels hand to the combine: ordinary scores, huge magnitudes
/// (|lse| up to 1e4, where a naive exp() overflows), close pairs, and the empty-row markers.
class LseSource {
 public:
  explicit LseSource(std::uint64_t seed) : rng_(seed) {}
  float raw() {
    switch (std::uniform_int_distribution<int>(0, 9)(rng_)) {
      case 0:
        return -kInf;
      case 1:
        return kInf;
      case 2:
        return kNaN;
      case 3:
        return std::uniform_real_distribution<float>(-1e4f, 1e4f)(rng_);
      case 4:
        return std::uniform_int_distribution<int>(0, 1)(rng_) ? 1e4f : -1e4f;
      case 5:
        return std::uniform_int_distribution<int>(0, 1)(rng_) ? 0.0f : -0.0f;
      default:
        return std::uniform_real_distribution<float>(-30.0f, 30.0f)(rng_);
    }
  }
  /// A pair, sometimes of nearly equal values (cancellation in lse_a - lse_b).
  std::pair<float, float> pair() {
    const float a = raw();
    if (std::uniform_int_distribution<int>(0, 4)(rng_) == 0 && std::isfinite(a)) {
      const float d = std::uniform_real_distribution<float>(-1e-3f, 1e-3f)(rng_);
      return {a, a + d};
    }
    return {a, raw()};
  }
  float finite(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(rng_); }
  std::mt19937_64& rng() { return rng_; }

 private:
  std::mt19937_64 rng_;
};

/// A set of partial states (count states of dv values), some empty with garbage o.
struct States {
  int count, dv;
  std::vector<float> o, lse;
  float* o_of(int v) { return o.data() + std::size_t(v) * dv; }
};

States random_states(LseSource& src, int count, int dv, float lse_lo, float lse_hi,
                     bool with_empties) {
  States s{count, dv, std::vector<float>(std::size_t(count) * dv), std::vector<float>(count)};
  std::uniform_real_distribution<float> val(-4.0f, 4.0f);
  for (int v = 0; v < count; ++v) {
    const bool empty = with_empties && std::uniform_int_distribution<int>(0, 3)(src.rng()) == 0;
    if (empty) {
      // An empty row as a foreign kernel might hand it over: lse = -inf, +inf or NaN, o garbage.
      const float marks[] = {-kInf, kInf, kNaN};
      s.lse[v] = dcpattn::sanitize_lse(marks[std::uniform_int_distribution<int>(0, 2)(src.rng())]);
      for (int i = 0; i < dv; ++i) s.o_of(v)[i] = (i % 2) ? kNaN : kInf;
    } else {
      s.lse[v] = src.finite(lse_lo, lse_hi);
      for (int i = 0; i < dv; ++i) s.o_of(v)[i] = val(src.rng());
    }
  }
  return s;
}

/// Long double reference of merging all states: (o, lse) of the union of their key sets.
void ref_merge_all(const States& s, std::vector<long double>& o, long double& lse) {
  lse = ref_lse_n(s.lse);
  o.assign(std::size_t(s.dv), 0.0L);
  if (std::isinf(lse)) return;
  for (int v = 0; v < s.count; ++v) {
    if (std::isinf(s.lse[v])) continue;
    const long double w = std::exp((long double)s.lse[v] - lse);
    for (int i = 0; i < s.dv; ++i) o[i] += w * s.o[std::size_t(v) * s.dv + i];
  }
}

void run_tree(States& s, int count) {
  dcpattn::tree_merge(
      [&](int v) {
        return dcpattn::TreeStateRef{s.o_of(v), &s.lse[v]};
      },
      count, s.dv);
}

}  // namespace

TEST_CASE("sanitize_lse: empty-row markers become -inf, base 2 is converted", "[lse]") {
  SECTION("natural log") {
    CHECK(dcpattn::sanitize_lse(kInf) == -kInf);
    CHECK(std::isinf(dcpattn::sanitize_lse(kNaN)));
    CHECK(dcpattn::sanitize_lse(kNaN) < 0.0f);
    CHECK(dcpattn::sanitize_lse(-kNaN) == -kInf);
    CHECK(dcpattn::sanitize_lse(std::bit_cast<float>(0x7f800001u)) == -kInf);  // signaling NaN
    CHECK(dcpattn::sanitize_lse(-kInf) == -kInf);
    for (float x : {0.0f, -0.0f, 1.5f, -1e4f, 1e4f, 3.4e38f, -3.4e38f, 1e-45f})
      CHECK(bits(dcpattn::sanitize_lse(x)) == bits(x));
    CHECK(bits(dcpattn::sanitize_lse(1.0f, dcpattn::lse_base_e{})) == bits(1.0f));
  }
  SECTION("base 2") {
    // Multiplying by fl(ln 2) and rounding the product: at most ~1 ulp (2^-23 relative) from the
    // exact x ln 2. A log2/ln mixup (factor 1.44 or 0.69 off) fails by many orders of magnitude.
    const long double ln2 = 0.693147180559945309417232121458176568L;
    LseSource src(7);
    for (int k = 0; k < 20000; ++k) {
      const float x = k < 10000 ? src.finite(-1e4f, 1e4f) : src.finite(-50.0f, 50.0f);
      const long double want = (long double)x * ln2;
      const float got = dcpattn::sanitize_lse(x, dcpattn::lse_base_2{});
      INFO("x = " << x);
      REQUIRE(std::fabs(got - want) <= 2.0L * kEps * std::fabs(want));
    }
    CHECK(dcpattn::sanitize_lse(1.0f, dcpattn::lse_base_2{}) == float(ln2));
    CHECK(dcpattn::sanitize_lse(0.0f, dcpattn::lse_base_2{}) == 0.0f);
    CHECK(dcpattn::sanitize_lse(-kInf, dcpattn::lse_base_2{}) == -kInf);
    CHECK(dcpattn::sanitize_lse(kInf, dcpattn::lse_base_2{}) == -kInf);
    CHECK(dcpattn::sanitize_lse(kNaN, dcpattn::lse_base_2{}) == -kInf);
  }
}

TEST_CASE("merge_lse: agrees with a long double reference", "[lse]") {
  LseSource src(1);
  int checked = 0;
  for (int k = 0; k < 200000; ++k) {
    const auto [ra, rb] = src.pair();
    const float a = dcpattn::sanitize_lse(ra), b = dcpattn::sanitize_lse(rb);
    const auto w = dcpattn::merge_lse(a, b);
    const RefMerge ref = ref_merge(a, b);
    INFO("raw (" << ra << ", " << rb << ") -> (" << a << ", " << b << "): lse " << w.lse << " vs "
                 << (double)ref.lse << ", w_a " << w.w_a << " vs " << (double)ref.w_a << ", w_b "
                 << w.w_b << " vs " << (double)ref.w_b);
    REQUIRE(!std::isnan(w.lse));
    REQUIRE(!std::isnan(w.w_a));
    REQUIRE(!std::isnan(w.w_b));
    if (std::isinf(ref.lse)) {
      // Both empty: exactly the neutral element.
      REQUIRE(w.lse == -kInf);
      REQUIRE(bits(w.w_a) == bits(0.0f));
      REQUIRE(bits(w.w_b) == bits(0.0f));
      continue;
    }
    REQUIRE(std::isfinite(w.lse));
    REQUIRE(std::fabs(w.lse - ref.lse) <= lse_tol(ref.lse));
    // A weight is exp(lse_x - lse): its relative error is the absolute error of the exponent,
    // i.e. the lse tolerance plus the rounding of the subtraction (eps |lse_x - lse|), plus ~1 ulp
    // of expf; below 2^-126 fp32 is subnormal, hence the absolute floor.
    for (int side = 0; side < 2; ++side) {
      const float x = side ? b : a;
      const float got = side ? w.w_b : w.w_a;
      const long double want = side ? ref.w_b : ref.w_a;
      REQUIRE(got >= 0.0f);
      REQUIRE(got <= 1.0f);
      if (std::isinf(x)) {
        REQUIRE(bits(got) == bits(0.0f));  // an empty input has weight exactly 0
        continue;
      }
      const long double rel =
          lse_tol(ref.lse) + kEps * (4.0L + std::fabs((long double)x - ref.lse));
      REQUIRE(std::fabs(got - want) <= want * rel + 0x1p-140L);
    }
    ++checked;
  }
  CHECK(checked > 100000);
}

TEST_CASE("merge_lse: exact cases", "[lse]") {
  SECTION("both empty") {
    for (float a : {-kInf, kInf, kNaN})
      for (float b : {-kInf, kInf, kNaN}) {
        const auto w = dcpattn::merge_lse(dcpattn::sanitize_lse(a), dcpattn::sanitize_lse(b));
        CHECK(w.lse == -kInf);
        CHECK(bits(w.w_a) == bits(0.0f));
        CHECK(bits(w.w_b) == bits(0.0f));
      }
  }
  SECTION("one side empty: the other passes through exactly with weight 1") {
    for (float x : {0.0f, -3.5f, 17.25f, 1e4f, -1e4f, 3e38f, -3e38f})
      for (float e : {-kInf, kInf, kNaN}) {
        CAPTURE(x, e);
        const float s = dcpattn::sanitize_lse(e);
        const auto w1 = dcpattn::merge_lse(x, s);
        CHECK(w1.lse == x);
        CHECK(w1.w_a == 1.0f);
        CHECK(bits(w1.w_b) == bits(0.0f));
        const auto w2 = dcpattn::merge_lse(s, x);
        CHECK(w2.lse == x);
        CHECK(bits(w2.w_a) == bits(0.0f));
        CHECK(w2.w_b == 1.0f);
      }
  }
  SECTION("equal inputs add ln 2") {
    for (float x : {0.0f, 1.0f, -7.0f, 1e4f, -1e4f}) {
      const auto w = dcpattn::merge_lse(x, x);
      CHECK(std::fabs(w.lse - ((long double)x + std::log(2.0L))) <= lse_tol(x));
      CHECK(w.w_a == w.w_b);
      // w = exp(x - lse): relative error lse_tol plus the subtraction and expf (~5 eps).
      CHECK(std::fabs(w.w_a - 0.5L) <= 0.5L * (lse_tol(x) + 5.0L * kEps));
    }
  }
  SECTION("largest finite magnitudes neither overflow nor produce NaN") {
    const float big = std::numeric_limits<float>::max();
    const auto w = dcpattn::merge_lse(big, -big);
    CHECK(w.lse == big);
    CHECK(w.w_a == 1.0f);
    CHECK(w.w_b == 0.0f);
    const auto w2 = dcpattn::merge_lse(-big, -big);
    CHECK(std::isfinite(w2.lse));
    CHECK(!std::isnan(w2.w_a));
  }
}

TEST_CASE("merge_lse: commutative to the bit", "[lse]") {
  LseSource src(2);
  for (int k = 0; k < 200000; ++k) {
    const auto [ra, rb] = src.pair();
    const float a = dcpattn::sanitize_lse(ra), b = dcpattn::sanitize_lse(rb);
    const auto ab = dcpattn::merge_lse(a, b);
    const auto ba = dcpattn::merge_lse(b, a);
    INFO("(" << a << ", " << b << ")");
    REQUIRE(bits(ab.lse) == bits(ba.lse));
    REQUIRE(bits(ab.w_a) == bits(ba.w_b));
    REQUIRE(bits(ab.w_b) == bits(ba.w_a));
  }
}

TEST_CASE("merge_state_into: agrees with a long double reference", "[lse]") {
  LseSource src(3);
  constexpr int dv = 16;
  std::uniform_real_distribution<float> val(-8.0f, 8.0f);
  for (int k = 0; k < 20000; ++k) {
    const float a = k % 2 ? src.finite(-1e4f, 1e4f) : src.finite(-30.0f, 30.0f);
    const float b = k % 3 ? a + src.finite(-20.0f, 20.0f) : src.finite(-1e4f, 1e4f);
    float oa[dv], ob[dv], oa0[dv];
    for (int i = 0; i < dv; ++i) {
      oa0[i] = oa[i] = val(src.rng());
      ob[i] = val(src.rng());
    }
    float lse = a;
    dcpattn::merge_state_into(oa, lse, ob, b, dv);
    const RefMerge ref = ref_merge(a, b);
    INFO("lse_a " << a << ", lse_b " << b);
    REQUIRE(std::fabs(lse - ref.lse) <= lse_tol(ref.lse));
    // o = w_a o_a + w_b o_b: each term carries its weight's relative error (as in the merge_lse
    // test: lse_tol plus eps (|lse_x - lse| + 4)) and two roundings (product, sum).
    const long double rel_a = lse_tol(ref.lse) + kEps * (6.0L + std::fabs(a - ref.lse));
    const long double rel_b = lse_tol(ref.lse) + kEps * (6.0L + std::fabs(b - ref.lse));
    for (int i = 0; i < dv; ++i) {
      const long double want = ref.w_a * oa0[i] + ref.w_b * ob[i];
      const long double tol =
          ref.w_a * std::fabs(oa0[i]) * rel_a + ref.w_b * std::fabs(ob[i]) * rel_b + 0x1p-140L;
      REQUIRE(std::isfinite(oa[i]));
      REQUIRE(std::fabs(oa[i] - want) <= tol);
    }
  }
}

TEST_CASE("merge_state_into: the empty state is neutral, bit for bit", "[lse]") {
  constexpr int dv = 8;
  const float garbage[] = {kNaN, kInf, -kInf, -kNaN, 1e30f, -0.0f, 5.0f, kNaN};
  const float values[] = {1.0f, -0.0f, 0.0f, -2.5f, 3e-39f /* subnormal */, 1e30f, -7.0f, 0.125f};
  int cases = 0;
  for (float empty_mark : {-kInf, kInf, kNaN}) {
    const float empty = dcpattn::sanitize_lse(empty_mark);
    for (float lse_x : {0.0f, -0.0f, -1e4f, 1e4f, 12.5f, -3e38f}) {
      CAPTURE(empty_mark, lse_x);
      {  // an empty state (garbage o) merged into a state
        float o[dv], g[dv];
        std::memcpy(o, values, sizeof o);
        std::memcpy(g, garbage, sizeof g);
        float lse = lse_x;
        dcpattn::merge_state_into(o, lse, g, empty, dv);
        CHECK(bits(lse) == bits(lse_x));
        for (int i = 0; i < dv; ++i) {
          CAPTURE(i);
          CHECK(bits(o[i]) == bits(values[i]));
        }
      }
      {  // a state merged into an empty state (garbage o)
        float o[dv];
        std::memcpy(o, garbage, sizeof o);
        float lse = empty;
        dcpattn::merge_state_into(o, lse, values, lse_x, dv);
        CHECK(bits(lse) == bits(lse_x));
        for (int i = 0; i < dv; ++i) {
          CAPTURE(i);
          CHECK(bits(o[i]) == bits(values[i]));
        }
      }
      ++cases;
    }
    for (float other_mark : {-kInf, kInf, kNaN}) {  // two empty states: the neutral element
      CAPTURE(empty_mark, other_mark);
      float o[dv], g[dv];
      std::memcpy(o, garbage, sizeof o);
      std::memcpy(g, garbage, sizeof g);
      float lse = empty;
      dcpattn::merge_state_into(o, lse, g, dcpattn::sanitize_lse(other_mark), dv);
      CHECK(lse == -kInf);
      for (int i = 0; i < dv; ++i) {
        CAPTURE(i);
        CHECK(bits(o[i]) == bits(0.0f));
      }
    }
  }
  CHECK(cases == 18);
}

/// Case k of n sanitized LSE values for the N-way merge tests; k % 4 selects the kind: 0 all empty
/// (from -inf, +inf or NaN inputs), 1 mixed (any float, sanitized), 2 small magnitudes, 3 near
/// +-1e4.
static std::vector<float> lse_case(LseSource& src, int n, int k) {
  std::vector<float> x(static_cast<std::size_t>(n));
  const int mode = k % 4;
  for (auto& v : x) {
    if (mode == 0)
      v = dcpattn::sanitize_lse(k % 8 == 0 ? kNaN : (k % 8 == 4 ? kInf : -kInf));
    else if (mode == 1)
      v = dcpattn::sanitize_lse(src.raw());
    else if (mode == 2)
      v = src.finite(-30.0f, 30.0f);
    else
      v = (k % 8 == 3 ? 1e4f : -1e4f) + src.finite(-40.0f, 40.0f);
  }
  return x;
}

TEST_CASE("merge_lse_n and merge_weight: agree with a long double reference", "[lse]") {
  LseSource src(4);
  for (int n = 0; n <= 16; ++n) {
    for (int k = 0; k < 2000; ++k) {
      const std::vector<float> x = lse_case(src, n, k);
      const int mode = k % 4;
      const float got = dcpattn::merge_lse_n([&](int i) { return x[std::size_t(i)]; }, n);
      const long double want = ref_lse_n(x);
      INFO("n = " << n << ", mode " << mode << ", got " << got << ", want " << (double)want);
      REQUIRE(!std::isnan(got));
      if (std::isinf(want)) {
        REQUIRE(got == -kInf);
        for (float v : x) REQUIRE(bits(dcpattn::merge_weight(v, got)) == bits(0.0f));
        continue;
      }
      REQUIRE(std::fabs(got - want) <= lse_tol(want, n));
      long double wsum = 0.0L;
      for (float v : x) {
        const float w = dcpattn::merge_weight(v, got);
        REQUIRE(w >= 0.0f);
        if (std::isinf(v)) REQUIRE(bits(w) == bits(0.0f));
        wsum += w;
      }
      // The weights sum to 1 up to: the lse error (a relative error common to every weight), the
      // per-weight error eps (|x - lse| + 2) with w |x - lse| <= 1/e, and n roundings of the sum.
      REQUIRE(std::fabs(wsum - 1.0L) <= lse_tol(want, n) + kEps * (3.0L * n + 2.0L));
    }
  }
  CHECK(dcpattn::merge_lse_n([](int) { return 0.0f; }, 0) == -kInf);
  CHECK(dcpattn::merge_weight(-kInf, -kInf) == 0.0f);
  CHECK(dcpattn::merge_weight(3.0f, -kInf) == 0.0f);
  CHECK(dcpattn::merge_weight(3.0f, 3.0f) == 1.0f);
}

TEST_CASE("fast_sum_n and fast_weight: the fast merge's weights agree with a long double reference",
          "[lse]") {
  LseSource src(6);
  int live_cases = 0;
  for (int n = 0; n <= 16; ++n) {
    for (int k = 0; k < 2000; ++k) {
      const std::vector<float> x = lse_case(src, n, k);
      const int mode = k % 4;
      auto at = [&](int i) { return x[std::size_t(i)]; };
      const dcpattn::LseSum s = dcpattn::fast_sum_n(at, n);
      // on the host fast_sum_n is lse_sum_n, and lse_of(lse_sum_n) is merge_lse_n, bit for bit
      REQUIRE(bits(dcpattn::lse_of(s)) == bits(dcpattn::merge_lse_n(at, n)));
      const long double want_lse = ref_lse_n(x);
      INFO("n = " << n << ", mode " << mode);
      if (std::isinf(want_lse)) {
        REQUIRE(s.max == -kInf);
        for (float v : x) REQUIRE(bits(dcpattn::fast_weight(v, s)) == bits(0.0f));
        continue;
      }
      ++live_cases;
      long double wsum = 0.0L;
      for (float v : x) {
        const float w = dcpattn::fast_weight(v, s);
        if (std::isinf(v)) {
          REQUIRE(bits(w) == bits(0.0f));
          continue;
        }
        // exp(v - L) in long double; fast_weight rounds exp(v - max) (|v - max| + 2 roundings),
        // the sum (n roundings of terms <= 1 and 1 term equal to 1), its inverse and the product;
        // weights under fp32's normal range lose relative precision (absolute error <= 2^-148).
        // (The host evaluation; the device's approximations are checked against it by the CUDA
        // combine tests.)
        const long double want = std::exp((long double)v - want_lse);
        const long double err = std::fabs((long double)w - want);
        REQUIRE(err <=
                want * kEps * (std::fabs((long double)v - s.max) + 2.0L * n + 6.0L) + 0x1p-148L);
        wsum += w;
      }
      REQUIRE(std::fabs(wsum - 1.0L) <= kEps * (3.0L * n + 6.0L));
    }
  }
  CHECK(live_cases > 20000);
  // a lone live input has weight exactly 1, empty ones exactly 0
  const std::vector<float> one = {-kInf, 2.5f, -kInf};
  const dcpattn::LseSum s1 = dcpattn::fast_sum_n([&](int i) { return one[std::size_t(i)]; }, 3);
  CHECK(dcpattn::fast_weight(2.5f, s1) == 1.0f);
  CHECK(bits(dcpattn::fast_weight(-kInf, s1)) == bits(0.0f));
  CHECK(dcpattn::lse_of(s1) == 2.5f);
}

TEST_CASE("tree_merge: agrees with a long double reference of the full merge", "[lse][tree]") {
  LseSource src(5);
  constexpr int dv = 8;
  for (int count : {1, 2, 4, 8, 16}) {
    const int levels = std::countr_zero(unsigned(count));
    for (int k = 0; k < 400; ++k) {
      const int mode = k % 4;  // lse ranges: moderate, around +1e4, around -1e4, all over
      const float lo = mode == 0   ? -30.0f
                       : mode == 1 ? 1e4f - 40.0f
                       : mode == 2 ? -1e4f - 40.0f
                                   : -1e4f;
      const float hi = mode == 0   ? 30.0f
                       : mode == 1 ? 1e4f + 40.0f
                       : mode == 2 ? -1e4f + 40.0f
                                   : 1e4f;
      States s = random_states(src, count, dv, lo, hi, /*with_empties=*/k % 3 != 0);
      std::vector<long double> ref_o;
      long double ref_lse;
      ref_merge_all(s, ref_o, ref_lse);
      run_tree(s, count);
      INFO("count " << count << ", trial " << k << ", lse " << s.lse[0] << " vs "
                    << (double)ref_lse);
      REQUIRE(!std::isnan(s.lse[0]));
      if (std::isinf(ref_lse)) {
        REQUIRE(s.lse[0] == -kInf);
        // One state is not merged at all (the tree is the identity); any merge of empty states
        // gives the neutral element, whatever garbage their o held.
        if (count > 1)
          for (int i = 0; i < dv; ++i) REQUIRE(bits(s.o[std::size_t(i)]) == bits(0.0f));
        continue;
      }
      // Each of the `levels` merges on the path to state 0 adds at most one lse_tol at the
      // scale of the running lse, and rescales o with weights of that relative accuracy.
      long double max_abs = std::fabs(ref_lse);
      for (float v : s.lse) max_abs = std::max(max_abs, (long double)std::fabs(v));
      const long double tol_l = (levels + 1) * lse_tol(max_abs);
      // Per merge, a term w o carries its weight's relative error lse_tol + eps (|d| + 4), where
      // w |d| <= 1/e, plus two roundings; summed over the count terms (|o| <= 4) and compounded
      // over the levels.
      const long double tol_o = (levels + 1) * (lse_tol(max_abs) + kEps * (count + 8.0L));
      REQUIRE(std::fabs(s.lse[0] - ref_lse) <= tol_l);
      for (int i = 0; i < dv; ++i) {
        // Values are in [-4, 4]; the merged o is a convex combination, so 4 bounds its terms.
        REQUIRE(std::isfinite(s.o[std::size_t(i)]));
        REQUIRE(std::fabs(s.o[std::size_t(i)] - ref_o[std::size_t(i)]) <= tol_o * 4.0L);
      }
    }
  }
}

TEST_CASE("tree_merge: splitting the states across N ranks gives the same bits",
          "[lse][tree][invariance]") {
  // DESIGN.md "DCP invariance": with state v = j N + r held by rank r, a rank first merges its own
  // states (the high bits j) with the same tree, then the N rank results are merged by the tree
  // over r. The result must be bit-identical to one process merging all states, for every N.
  LseSource src(6);
  constexpr int dv = 8;
  int compared = 0;
  for (int count : {1, 2, 4, 8, 16}) {
    for (int k = 0; k < 300; ++k) {
      const int mode = k % 3;
      const float lo = mode == 0 ? -30.0f : mode == 1 ? -1e4f : 1e4f - 60.0f;
      const float hi = mode == 0 ? 30.0f : mode == 1 ? 1e4f : 1e4f + 60.0f;
      const States init = random_states(src, count, dv, lo, hi, /*with_empties=*/k % 2 == 0);
      States direct = init;
      run_tree(direct, count);
      REQUIRE(!std::isnan(direct.lse[0]));
      for (int n = 1; n <= count; n *= 2) {
        States split = init;
        const int per_rank = count / n;
        for (int r = 0; r < n; ++r)  // on rank r: its states j N + r, merged over j
          dcpattn::tree_merge(
              [&](int j) {
                const int v = j * n + r;
                return dcpattn::TreeStateRef{split.o_of(v), &split.lse[std::size_t(v)]};
              },
              per_rank, dv);
        // After the exchange: rank r's result (in state 0 N + r = r) merged over r.
        std::vector<float> rank_o(static_cast<std::size_t>(n * dv));
        std::vector<float> rank_lse(static_cast<std::size_t>(n));
        for (int r = 0; r < n; ++r) {
          std::memcpy(rank_o.data() + std::size_t(r) * dv, split.o_of(r), sizeof(float) * dv);
          rank_lse[std::size_t(r)] = split.lse[std::size_t(r)];
        }
        dcpattn::tree_merge(
            [&](int r) {
              return dcpattn::TreeStateRef{rank_o.data() + std::size_t(r) * dv,
                                           &rank_lse[std::size_t(r)]};
            },
            n, dv);
        INFO("count " << count << ", N " << n << ", trial " << k);
        REQUIRE(bits(rank_lse[0]) == bits(direct.lse[0]));
        for (int i = 0; i < dv; ++i)
          REQUIRE(bits(rank_o[std::size_t(i)]) == bits(direct.o[std::size_t(i)]));
        if (count > 1 || !std::isinf(init.lse[0]))  // a lone empty state keeps its garbage o
          for (int i = 0; i < dv; ++i) REQUIRE(!std::isnan(rank_o[std::size_t(i)]));
        ++compared;
      }
    }
  }
  CHECK(compared > 0);
}

TEST_CASE("tree_merge: one state is left as it is", "[lse][tree]") {
  float o[3] = {1.0f, -0.0f, 2.5f};
  float lse = 4.0f;
  dcpattn::tree_merge([&](int) { return dcpattn::TreeStateRef{o, &lse}; }, 1, 3);
  CHECK(bits(o[0]) == bits(1.0f));
  CHECK(bits(o[1]) == bits(-0.0f));
  CHECK(bits(o[2]) == bits(2.5f));
  CHECK(bits(lse) == bits(4.0f));
}

TEST_CASE("tree_merge: the order is fixed, highest index bit first", "[lse][tree]") {
  // Four states with distinct lse; the documented order is (0 <- 2, 1 <- 3), then 0 <- 1. Compute
  // that order by hand with merge_state_into and compare bits with tree_merge.
  LseSource src(8);
  for (int k = 0; k < 200; ++k) {
    States s = random_states(src, 4, 4, -30.0f, 30.0f, false);
    States manual = s;
    auto merge = [&](int a, int b) {
      dcpattn::merge_state_into(manual.o_of(a), manual.lse[std::size_t(a)], manual.o_of(b),
                                manual.lse[std::size_t(b)], manual.dv);
    };
    merge(0, 2);
    merge(1, 3);
    merge(0, 1);
    run_tree(s, 4);
    REQUIRE(bits(s.lse[0]) == bits(manual.lse[0]));
    for (int i = 0; i < 4; ++i)
      REQUIRE(bits(s.o[std::size_t(i)]) == bits(manual.o[std::size_t(i)]));
  }
}
