// SPDX-License-Identifier: Apache-2.0
// RMSNorm and LayerNorm rows against long double references written here (two-pass variance),
// for float and bfloat16 storage, out of place and in place.
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

#include "dcpattn/core/norm.hpp"
#include "dcpattn/core/numeric.hpp"

namespace {

using dcpattn::bfloat16;
using dcpattn::test::store;
using dcpattn::test::value;

constexpr long double kEps = 0x1p-24L;   // unit roundoff of fp32
constexpr long double kEpsBf = 0x1p-8L;  // unit roundoff of bfloat16 (8 significant bits)
constexpr int kSizes[] = {1, 7, 512, 1536};

template <class T>
constexpr long double out_roundoff() {
  return std::is_same_v<T, bfloat16> ? kEpsBf : 0.0L;
}
template <class T>
const char* type_name() {
  return std::is_same_v<T, bfloat16> ? "bf16" : "f32";
}

/// First-order a-priori bound of recursive fp32 summation of terms t_k: each addition rounds
/// its partial sum s_k (relative eps), each term is itself a rounded product (relative eps).
long double summation_bound(const std::vector<long double>& terms) {
  long double partial = 0.0L, bound = 0.0L;
  for (std::size_t k = 0; k < terms.size(); ++k) {
    partial += terms[k];
    bound += kEps * (std::fabs(terms[k]) + (k > 0 ? std::fabs(partial) : 0.0L));
  }
  return bound;
}

struct Row {
  std::vector<float> x, w, b;
};

/// Random row: values offset + uniform(-spread, spread), weights around 1, biases small.
Row random_row(std::mt19937_64& rng, int n, float offset, float spread) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  Row r;
  for (int i = 0; i < n; ++i) {
    r.x.push_back(offset + spread * u(rng));
    r.w.push_back(1.0f + 0.5f * u(rng));
    r.b.push_back(0.25f * u(rng));
  }
  return r;
}

template <class TIn, class TW, class TOut>
void check_rms(const Row& row, float eps) {
  const int n = int(row.x.size());
  std::vector<TIn> x;
  std::vector<TW> w;
  for (int i = 0; i < n; ++i) {
    x.push_back(store<TIn>(row.x[i]));
    w.push_back(store<TW>(row.w[i]));
  }
  std::vector<TOut> out(x.size());
  dcpattn::rms_norm_row(x.data(), w.data(), out.data(), n, eps);

  // Reference: scale = 1 / sqrt(mean(x^2) + eps), out = x scale w, on the stored inputs.
  std::vector<long double> sq;
  long double ss = 0.0L;
  for (const auto& v : x) {
    sq.push_back(value(v) * value(v));
    ss += sq.back();
  }
  const long double ms = ss / n;
  const long double scale = 1.0L / std::sqrt(ms + (long double)eps);
  // Relative error of the fp32 sum of squares, halved by the square root, plus ~6 roundings
  // (division by n, + eps, sqrt, reciprocal, two products); a factor 1.5 covers second-order
  // terms. A bfloat16 output adds its own rounding (relative 2^-8).
  const long double rel_sum = ss > 0 ? summation_bound(sq) / ss : 0.0L;
  const long double rel = 1.5L * (rel_sum / 2 + 6 * kEps);
  std::int64_t bad = 0;
  std::string first;
  for (int i = 0; i < n; ++i) {
    const long double want = value(x[std::size_t(i)]) * scale * value(w[std::size_t(i)]);
    const long double got = value(out[std::size_t(i)]);
    const long double tol = std::fabs(want) * (rel + out_roundoff<TOut>() * (1 + rel)) + 1e-30L;
    if (!(std::fabs(got - want) <= tol) && bad++ == 0) {
      std::ostringstream os;
      os << "i = " << i << ": got " << (double)got << ", want " << (double)want << ", tol "
         << (double)tol;
      first = os.str();
    }
  }
  INFO("rms_norm_row<" << type_name<TIn>() << ", " << type_name<TW>() << ", " << type_name<TOut>()
                       << ">, n = " << n << ", eps = " << eps << ": " << bad
                       << " mismatches; first " << first);
  CHECK(bad == 0);

  if constexpr (std::is_same_v<TIn, TOut>) {
    // In place (out aliases x): the same values as out of place, to the bit.
    std::vector<TIn> inplace = x;
    dcpattn::rms_norm_row(inplace.data(), w.data(), inplace.data(), n, eps);
    bool same = true;
    for (int i = 0; i < n; ++i)
      same = same && std::memcmp(&inplace[std::size_t(i)], &out[std::size_t(i)], sizeof(TOut)) == 0;
    CHECK(same);
  }
}

template <class TIn, class TW, class TOut>
void check_layer(const Row& row, float eps, bool with_bias) {
  const int n = int(row.x.size());
  std::vector<TIn> x;
  std::vector<TW> w, b;
  for (int i = 0; i < n; ++i) {
    x.push_back(store<TIn>(row.x[i]));
    w.push_back(store<TW>(row.w[i]));
    b.push_back(store<TW>(row.b[i]));
  }
  std::vector<TOut> out(x.size());
  if (with_bias) {
    dcpattn::layer_norm_row(x.data(), w.data(), b.data(), out.data(), n, eps);
  } else {
    dcpattn::layer_norm_row(x.data(), w.data(), nullptr, out.data(), n, eps);
  }

  // Reference: two-pass mean and biased variance in long double.
  std::vector<long double> xs, sq;
  long double s = 0.0L;
  for (const auto& v : x) {
    xs.push_back(value(v));
    sq.push_back(value(v) * value(v));
    s += value(v);
  }
  const long double mean = s / n;
  long double var = 0.0L, e2 = 0.0L;
  for (const auto& v : x) {
    var += (value(v) - mean) * (value(v) - mean);
    e2 += value(v) * value(v);
  }
  var /= n;
  e2 /= n;
  const long double inv_std = 1.0L / std::sqrt(var + (long double)eps);

  // The library uses the one-pass form var = E[x^2] - mean^2 in fp32. First-order error bounds:
  //   mean:  summation bound / n + one rounding;
  //   E[x^2]: summation bound / n + one rounding;
  //   var:   |dE2| + 2 |mean| |dmean| + roundings of mean^2 and of the subtraction;
  //   inv_std: half the relative error of var + eps, plus sqrt, reciprocal and the + eps;
  // and each output element adds |x - mean| inv_std |w| times its relative error, the absolute
  // error of the mean, and a few roundings. Factor 2: second-order terms.
  const long double dmean = summation_bound(xs) / n + kEps * std::fabs(mean);
  const long double de2 = summation_bound(sq) / n + kEps * e2;
  const long double dvar = de2 + 2 * std::fabs(mean) * dmean + kEps * (mean * mean + e2);
  const long double rel_inv = dvar / (2 * (var + eps)) + 4 * kEps;
  std::int64_t bad = 0;
  std::string first;
  for (int i = 0; i < n; ++i) {
    const long double xi = xs[std::size_t(i)], wi = value(w[std::size_t(i)]);
    const long double bi = with_bias ? value(b[std::size_t(i)]) : 0.0L;
    const long double want = (xi - mean) * inv_std * wi + bi;
    const long double got = value(out[std::size_t(i)]);
    const long double err_f =
        2 * (std::fabs(wi) * inv_std * (dmean + std::fabs(xi - mean) * (rel_inv + 4 * kEps)) +
             2 * kEps * (std::fabs(want) + std::fabs(bi)));
    const long double tol = err_f + out_roundoff<TOut>() * (std::fabs(want) + err_f) + 1e-30L;
    if (!(std::fabs(got - want) <= tol) && bad++ == 0) {
      std::ostringstream os;
      os << "i = " << i << ": got " << (double)got << ", want " << (double)want << ", tol "
         << (double)tol;
      first = os.str();
    }
  }
  INFO("layer_norm_row<" << type_name<TIn>() << ", " << type_name<TW>() << ", " << type_name<TOut>()
                         << ">, n = " << n << ", eps = " << eps
                         << (with_bias ? ", bias" : ", no bias") << ": " << bad
                         << " mismatches; first " << first);
  CHECK(bad == 0);

  if constexpr (std::is_same_v<TIn, TOut>) {
    std::vector<TIn> inplace = x;
    if (with_bias) {
      dcpattn::layer_norm_row(inplace.data(), w.data(), b.data(), inplace.data(), n, eps);
    } else {
      dcpattn::layer_norm_row(inplace.data(), w.data(), nullptr, inplace.data(), n, eps);
    }
    bool same = true;
    for (int i = 0; i < n; ++i)
      same = same && std::memcmp(&inplace[std::size_t(i)], &out[std::size_t(i)], sizeof(TOut)) == 0;
    CHECK(same);
  }
}

/// Input regimes: ordinary activations, a row whose mean square is comparable to eps (so eps
/// placement matters), large values, and a shifted row (nonzero mean).
struct Regime {
  float offset, spread, eps;
};
constexpr Regime kRegimes[] = {
    {0.0f, 2.0f, 1e-6f}, {0.0f, 3e-3f, 1e-5f}, {0.0f, 300.0f, 1e-6f}, {0.5f, 1.0f, 1e-5f}};

}  // namespace

TEST_CASE("rms_norm_row: agrees with a long double reference", "[norm]") {
  std::mt19937_64 rng(31);
  for (int n : kSizes)
    for (const Regime& g : kRegimes)
      for (int trial = 0; trial < 3; ++trial) {
        const Row row = random_row(rng, n, g.offset, g.spread);
        check_rms<float, float, float>(row, g.eps);
        check_rms<bfloat16, bfloat16, bfloat16>(row, g.eps);
        check_rms<bfloat16, float, float>(row, g.eps);
        check_rms<float, bfloat16, bfloat16>(row, g.eps);
      }
}

TEST_CASE("rms_norm_row: exact small cases", "[norm]") {
  // x = (3, 4): mean square 12.5; with eps = 0 the scale is 1 / sqrt(12.5).
  const float x[2] = {3.0f, 4.0f}, w[2] = {1.0f, 2.0f};
  float out[2];
  dcpattn::rms_norm_row(x, w, out, 2, 0.0f);
  CHECK(std::fabs(out[0] - 3.0L / std::sqrt(12.5L)) <= 4 * kEps);
  CHECK(std::fabs(out[1] - 8.0L / std::sqrt(12.5L)) <= 8 * kEps);
  // An all-zero row with eps > 0 gives zeros, not NaN.
  const float z[4] = {0, 0, 0, 0}, ones[4] = {1, 1, 1, 1};
  float zo[4] = {9, 9, 9, 9};
  dcpattn::rms_norm_row(z, ones, zo, 4, 1e-6f);
  for (float v : zo) CHECK(v == 0.0f);
  CHECK(std::fabs(dcpattn::rms_norm_scale(8.0f, 2, 0.0f) - 0.5L) <= 2 * kEps);
}

TEST_CASE("layer_norm_row: agrees with a long double reference", "[norm]") {
  std::mt19937_64 rng(32);
  for (int n : kSizes)
    for (const Regime& g : kRegimes)
      for (int trial = 0; trial < 3; ++trial) {
        const Row row = random_row(rng, n, g.offset, g.spread);
        for (bool with_bias : {true, false}) {
          check_layer<float, float, float>(row, g.eps, with_bias);
          check_layer<bfloat16, bfloat16, bfloat16>(row, g.eps, with_bias);
          check_layer<bfloat16, float, float>(row, g.eps, with_bias);
        }
      }
}

TEST_CASE("layer_norm_row: exact small cases", "[norm]") {
  SECTION("one value normalizes to the bias") {
    const float x[1] = {123.0f}, w[1] = {2.0f}, b[1] = {0.75f};
    float out[1];
    dcpattn::layer_norm_row(x, w, b, out, 1, 1e-5f);
    CHECK(out[0] == 0.75f);
    dcpattn::layer_norm_row(x, w, nullptr, out, 1, 1e-5f);
    CHECK(out[0] == 0.0f);
  }
  SECTION("a constant row gives the bias, not NaN") {
    std::vector<float> x(64, 3.0f), w(64, 1.5f), b(64, -0.5f), out(64);
    dcpattn::layer_norm_row(x.data(), w.data(), b.data(), out.data(), 64, 1e-5f);
    for (float v : out) CHECK(v == -0.5f);
  }
  SECTION("(1, 2, 3, 4): mean 2.5, variance 1.25") {
    const float x[4] = {1, 2, 3, 4}, w[4] = {1, 1, 1, 1};
    float out[4];
    dcpattn::layer_norm_row(x, w, nullptr, out, 4, 0.0f);
    for (int i = 0; i < 4; ++i)
      CHECK(std::fabs(out[i] - (x[i] - 2.5L) / std::sqrt(1.25L)) <= 8 * kEps);
    // squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5
    CHECK(std::fabs(dcpattn::layer_norm_inv_std(5.0f, 4, 0.0f) - 1.0L / std::sqrt(1.25L)) <= 4 * kEps);
  }
  SECTION("a large mean with a small spread keeps its digits (two-pass variance)") {
    // x = 1e4 + {-1, 0, 1, 0}: E[x^2] - mean^2 in fp32 would cancel to garbage
    const float x[4] = {9999.0f, 10000.0f, 10001.0f, 10000.0f}, w[4] = {1, 1, 1, 1};
    float out[4];
    dcpattn::layer_norm_row(x, w, nullptr, out, 4, 0.0f);
    const long double sd = std::sqrt(0.5L);
    for (int i = 0; i < 4; ++i) CHECK(std::fabs(out[i] - (x[i] - 10000.0L) / sd) <= 1e-5L);
  }
}
