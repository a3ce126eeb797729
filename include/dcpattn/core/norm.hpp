// SPDX-License-Identifier: Apache-2.0
// RMSNorm and LayerNorm of one row, split into a reduction and an elementwise step so a CUDA kernel
// can reduce across lanes and reuse the same formulas. All arithmetic is fp32.
#pragma once

#include <cuda/std/cmath>
#include <cuda/std/type_traits>

#include "dcpattn/config.hpp"
#include "dcpattn/core/numeric.hpp"

DCPATTN_NAMESPACE_BEGIN

/// 1 / sqrt(sum_sq / n + eps): the RMSNorm scale of a row of n values whose squares sum to sum_sq.
DCPATTN_HOST_DEVICE float rms_norm_scale(float sum_sq, int n, float eps) noexcept {
  return 1.0f / cuda::std::sqrt(sum_sq / float(n) + eps);
}

/// RMSNorm of one row: out[i] = x[i] * rms_norm_scale(sum x^2) * weight[i].
/// x, weight, out: (n,) of float or bfloat16; out may alias x. Accumulation is sequential in i.
template <class TIn, class TW, class TOut>
DCPATTN_HOST_DEVICE void rms_norm_row(const TIn* x, const TW* weight, TOut* out, int n,
                                      float eps) noexcept {
  float sum_sq = 0.0f;
  for (int i = 0; i < n; ++i) {
    const float v = to_float(x[i]);
    sum_sq += v * v;
  }
  const float scale = rms_norm_scale(sum_sq, n, eps);
  for (int i = 0; i < n; ++i) out[i] = from_float<TOut>(to_float(x[i]) * scale * to_float(weight[i]));
}

/// 1 / sqrt(var + eps) of a row of n values whose squared deviations from their mean sum to m2.
/// LayerNorm is computed in two passes (mean, then m2): the one-pass E[x^2] - mean^2 loses every
/// digit when |mean| is much larger than the spread.
DCPATTN_HOST_DEVICE float layer_norm_inv_std(float m2, int n, float eps) noexcept {
  return 1.0f / cuda::std::sqrt(m2 / float(n) + eps);
}

/// LayerNorm of one row: out[i] = (x[i] - mean) * inv_std * weight[i] + bias[i]; bias may be null
/// (a plain `nullptr` is accepted: the bias does not take part in deducing TW).
/// x, weight, bias, out: (n,); out may alias x.
template <class TIn, class TW, class TOut>
DCPATTN_HOST_DEVICE void layer_norm_row(const TIn* x, const TW* weight,
                                        const cuda::std::type_identity_t<TW>* bias, TOut* out,
                                        int n, float eps) noexcept {
  float sum = 0.0f;
  for (int i = 0; i < n; ++i) sum += to_float(x[i]);
  const float mean = sum / float(n);
  float m2 = 0.0f;
  for (int i = 0; i < n; ++i) {
    const float d = to_float(x[i]) - mean;
    m2 += d * d;
  }
  const float inv_std = layer_norm_inv_std(m2, n, eps);
  for (int i = 0; i < n; ++i) {
    const float b = bias ? to_float(bias[i]) : 0.0f;
    out[i] = from_float<TOut>((to_float(x[i]) - mean) * inv_std * to_float(weight[i]) + b);
  }
}

DCPATTN_NAMESPACE_END
