// SPDX-License-Identifier: Apache-2.0
// Log-sum-exp (LSE) partial attention states and their merge.
//
// A partial state of one (token, head) is (o, lse): o (Dv,) is the softmax-weighted value average
// over some key set S and lse = log(sum_{s in S} exp(score_s)), in NATURAL log. The empty key set
// is the neutral element (o = 0, lse = -inf). Merging states of disjoint key sets A and B gives the
// state of A u B:  L = log(exp(lse_a) + exp(lse_b)),  o = exp(lse_a - L) o_a + exp(lse_b - L) o_b.
//
// Robustness rules (DESIGN.md): an lse of +inf or NaN is treated as -inf (a kernel's empty row);
// merging only neutral states gives the neutral state, never NaN; the o of a state whose weight is
// zero is never read, so garbage (even NaN) in an empty partial cannot leak into the result.
#pragma once

#include <cstdint>

#include <cuda/std/bit>
#include <cuda/std/cmath>
#include <cuda/std/limits>

#include "dcpattn/config.hpp"

DCPATTN_NAMESPACE_BEGIN

/// Tag: the LSE values are natural logarithms (dcpattn's own convention).
struct lse_base_e {};
/// Tag: the LSE values are base-2 logarithms (FlashInfer and some FlashMLA builds), converted on
/// input by multiplying with ln 2.
struct lse_base_2 {};

inline constexpr float lse_neg_inf = -cuda::std::numeric_limits<float>::infinity();

namespace detail {
/// ln 2 rounded to float: base-2 LSE to natural log, and log(x) from log2(x) on the device.
inline constexpr float kLn2 = 0.693147180559945309417232121458176568f;
}  // namespace detail

/// Maps a foreign LSE value to dcpattn's convention: natural log, with +inf and NaN (kernels' ways
/// of marking an empty row) turned into -inf.
constexpr DCPATTN_HOST_DEVICE float sanitize_lse(float lse, lse_base_e = {}) noexcept {
  // lse < +inf is false for NaN and +inf; finite values and -inf pass unchanged.
  return (lse < cuda::std::numeric_limits<float>::infinity()) ? lse : lse_neg_inf;
}
constexpr DCPATTN_HOST_DEVICE float sanitize_lse(float lse, lse_base_2) noexcept {
  return sanitize_lse(lse) * detail::kLn2;  // -inf * ln2 stays -inf
}

namespace detail {
// Explicitly rounded float operations. Deterministic mode needs every kernel that merges states
// (the split merge after attention, the rank merge in the combine) to produce the same bits from
// the same inputs; nvcc may otherwise contract a multiply and an add into one FMA in one kernel
// and not in another. On the host these are the plain operations.
DCPATTN_HOST_DEVICE float add_rn(float a, float b) noexcept {
#if DCPATTN_IN_DEVICE_CODE
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
DCPATTN_HOST_DEVICE float sub_rn(float a, float b) noexcept {
#if DCPATTN_IN_DEVICE_CODE
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
DCPATTN_HOST_DEVICE float mul_rn(float a, float b) noexcept {
#if DCPATTN_IN_DEVICE_CODE
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// The merges' arithmetic on the device (every device merge, deterministic tree and fast N-way
// alike; fast_exp also gives the 16-head fp8 MLA decode kernel's softmax weights, whose f16
// rounding, 2^-11, dwarfs its error). On the device exp(x) is one ex2.approx of x log2(e) and 1 / s
// one rcp.approx: relative errors of about 2^-22 (plus |x| 2^-24 from the product), far below the
// bf16 output's 2^-8, and about 15 dependent instructions shorter than expf and an IEEE division,
// which is what a batch-1 merge waits on.
// Subnormal results flush to 0 (weights under 1e-38). exp(0) = 1, exp(-inf) = +0 and 1 / 1 = 1
// stay exact. On the host the libm exp and an IEEE division.
/// 2^x as fast_exp computes it on the device: one ex2.approx (relative error about 2^-22;
/// 2^-inf = +0, subnormal results flushed to 0), for callers that keep their exponents in base 2
/// (the 64-head MLA decode kernel's scores). On the host the libm exp2.
DCPATTN_HOST_DEVICE float fast_exp2(float x) noexcept {
#if DCPATTN_IN_DEVICE_CODE
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return cuda::std::exp2(x);
#endif
}
DCPATTN_HOST_DEVICE float fast_exp(float x) noexcept {
#if DCPATTN_IN_DEVICE_CODE
  return fast_exp2(__fmul_rn(x, 1.44269504088896340736f));
#else
  return cuda::std::exp(x);
#endif
}
/// log(x) as the device's tree merge evaluates it: one lg2.approx (absolute error about 2^-22 on
/// the merge's sums, which lie in [1, 2]) times ln 2; log(1) = 0 stays exact. On the host the libm
/// log.
DCPATTN_HOST_DEVICE float fast_log(float x) noexcept {
#if DCPATTN_IN_DEVICE_CODE
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return __fmul_rn(y, kLn2);
#else
  return cuda::std::log(x);
#endif
}
DCPATTN_HOST_DEVICE float fast_inverse(float s) noexcept {
#if DCPATTN_IN_DEVICE_CODE
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(s));
  return y;
#else
  return 1.0f / s;
#endif
}
}  // namespace detail

/// Result of merging two LSE values: the merged lse and the weight of each input
/// (exp(lse_x - lse), exactly 0 for an empty input).
struct MergeWeights {
  float lse;
  float w_a;
  float w_b;
};

/// Merges two sanitized natural-log LSE values. Symmetric by construction: swapping a and b swaps
/// w_a and w_b and leaves lse bit-identical (max and float addition are commutative). Finite inputs
/// of any magnitude (|lse| ~ 1e4 included) neither overflow nor produce NaN.
///
/// This is deterministic mode's tree step, so every device kernel that merges states (the
/// attention kernel's split merge, the combine's rank merge) evaluates it with this one function.
/// On the device exp and log are the hardware approximations (detail::fast_exp, detail::fast_log:
/// relative errors of about 2^-22, a few instructions instead of the dependent chains of expf and
/// logf that a batch-1 merge waits on); on the host they are libm's. Each side is bitwise the same
/// for every DCP size; the two sides agree to fp32 rounding (docs/semantics.md).
///
/// Straight-line code: the general case is evaluated for every input (an empty side gives NaN or
/// 0 there, never a trap) and the empty cases are selected afterwards, so that the independent
/// merges of one tree level can overlap (merge_row_kernel evaluates a tree's weights before its
/// element merges; with early returns here its device code ran the merges one after the other).
DCPATTN_HOST_DEVICE MergeWeights merge_lse(float lse_a, float lse_b) noexcept {
  const float m = lse_a > lse_b ? lse_a : lse_b;
  const float ea = detail::fast_exp(detail::sub_rn(lse_a, m));
  const float eb = detail::fast_exp(detail::sub_rn(lse_b, m));
  const float lse = detail::add_rn(m, detail::fast_log(detail::add_rn(ea, eb)));
  const float wa = detail::fast_exp(detail::sub_rn(lse_a, lse));
  const float wb = detail::fast_exp(detail::sub_rn(lse_b, lse));
  // Both empty: the neutral element. One side empty: the other passes through exactly (m + log(1)
  // would turn lse = -0 into +0) with weight 1.
  const bool a_empty = lse_a == lse_neg_inf, b_empty = lse_b == lse_neg_inf;
  return {a_empty ? lse_b : (b_empty ? lse_a : lse), a_empty ? 0.0f : (b_empty ? 1.0f : wa),
          b_empty ? 0.0f : (a_empty ? 1.0f : wb)};
}

/// w * o where a zero weight means "this input is empty": the result is 0 even for o = inf or NaN.
DCPATTN_HOST_DEVICE float weighted(float w, float o) noexcept {
  return w != 0.0f ? detail::mul_rn(w, o) : 0.0f;
}

/// Merges state b into state a in place: (o_a, lse_a) <- (o_a, lse_a) (+) (o_b, lse_b).
/// o_a, o_b: (dv,) contiguous fp32; lse values natural log, already sanitized.
DCPATTN_HOST_DEVICE void merge_state_into(float* o_a, float& lse_a, const float* o_b, float lse_b,
                                          int dv) noexcept {
  const MergeWeights w = merge_lse(lse_a, lse_b);
  for (int i = 0; i < dv; ++i) {
    const float ta = weighted(w.w_a, o_a[i]);
    const float tb = weighted(w.w_b, o_b[i]);
    // A zero-weight side contributes nothing, not even the +0 that would turn o = -0 into +0:
    // merging with an empty state leaves the other state bit-identical.
    o_a[i] = w.w_b == 0.0f ? ta : (w.w_a == 0.0f ? tb : detail::add_rn(ta, tb));
  }
  lse_a = w.lse;
}

/// The two numbers an N-way merge is built from: the largest input `max` and
/// sum = sum_i exp(lse_i - max), accumulated in index order (deterministic). max = -inf: every
/// input is empty (sum is then 0).
struct LseSum {
  float max;
  float sum;
};

/// LseSum of n sanitized natural-log values lse_at(0) .. lse_at(n - 1); kFast: the exponentials
/// are detail::fast_exp (fast mode's merge, fast_sum_n), else cuda::std::exp.
template <bool kFast = false, class LseAt>
DCPATTN_HOST_DEVICE LseSum lse_sum_n(LseAt&& lse_at, int n) noexcept {
  float m = lse_neg_inf;
  for (int i = 0; i < n; ++i) {
    const float x = lse_at(i);
    m = x > m ? x : m;
  }
  if (m == lse_neg_inf) return {lse_neg_inf, 0.0f};
  float sum = 0.0f;
  for (int i = 0; i < n; ++i) {
    const float d = detail::sub_rn(lse_at(i), m);
    sum = detail::add_rn(sum, kFast ? detail::fast_exp(d) : cuda::std::exp(d));
  }
  return {m, sum};
}

/// The merged LSE of an LseSum: max + log(sum), -inf when every input is empty.
DCPATTN_HOST_DEVICE float lse_of(LseSum s) noexcept {
  return s.max == lse_neg_inf ? lse_neg_inf : detail::add_rn(s.max, cuda::std::log(s.sum));
}

/// LSE of n sanitized natural-log values, accumulated in index order (deterministic).
/// n = 0 or all-empty inputs give -inf.
template <class LseAt>
DCPATTN_HOST_DEVICE float merge_lse_n(LseAt&& lse_at, int n) noexcept {
  return lse_of(lse_sum_n(lse_at, n));
}

/// Weight of an input with LSE `lse` in a merge whose total LSE is `total` (0 when either is
/// empty).
DCPATTN_HOST_DEVICE float merge_weight(float lse, float total) noexcept {
  return total == lse_neg_inf ? 0.0f : cuda::std::exp(detail::sub_rn(lse, total));
}

/// The LseSum of fast mode's N-way merge: lse_sum_n with fast_exp (see detail::fast_exp).
template <class LseAt>
DCPATTN_HOST_DEVICE LseSum fast_sum_n(LseAt&& lse_at, int n) noexcept {
  return lse_sum_n<true>(lse_at, n);
}

/// Weight of an input with LSE `lse` in fast mode's N-way merge `s` (from fast_sum_n):
/// fast_exp(lse - max) * fast_inverse(sum), exactly 0 for an empty input or an all-empty merge,
/// exactly 1 for the only live input. The same value as merge_weight(lse, lse_of(s)) up to
/// rounding, without the log and the second exp on the way: every weight needs only its own exp,
/// which the sum has already computed, and one multiplication by the shared inverse.
DCPATTN_HOST_DEVICE float fast_weight(float lse, LseSum s) noexcept {
  if (s.max == lse_neg_inf || lse == lse_neg_inf) return 0.0f;
  return detail::mul_rn(detail::fast_exp(detail::sub_rn(lse, s.max)), detail::fast_inverse(s.sum));
}

/// The fixed binary merge tree of deterministic mode. `count` (a power of two) states indexed
/// v = 0..count-1 are merged level by level, highest index bit first: at the level of bit b every
/// v < 2^b absorbs v + 2^b. The result lands in state 0. Because the tree depends only on the state
/// indices, a group that first merges the high bits locally and the low bits after an exchange gets
/// the same bits as a single process merging everything.
///
/// `state(v)` must return something with members `float* o` and `float& lse` (or `float* lse`)
/// addressing state v; see TreeStateRef.
struct TreeStateRef {
  float* o;
  float* lse;
};

template <class StateAt>
DCPATTN_HOST_DEVICE void tree_merge(StateAt&& state, int count, int dv) noexcept {
  for (int half = count >> 1; half >= 1; half >>= 1) {
    for (int v = 0; v < half; ++v) {
      TreeStateRef a = state(v);
      TreeStateRef b = state(v + half);
      merge_state_into(a.o, *a.lse, b.o, *b.lse, dv);
    }
  }
}

/// True when x is a power of two (x >= 1).
constexpr DCPATTN_HOST_DEVICE bool is_power_of_two(std::int64_t x) noexcept {
  return x >= 1 && (x & (x - 1)) == 0;
}

DCPATTN_NAMESPACE_END
