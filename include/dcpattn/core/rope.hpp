// SPDX-License-Identifier: Apache-2.0
// Rotary position embedding (RoPE) of a pair and of a row, in the two pair layouts in use.
#pragma once

#include <cuda/std/cmath>

#include "dcpattn/config.hpp"
#include "dcpattn/core/numeric.hpp"

DCPATTN_NAMESPACE_BEGIN

/// How the d rotary dims of a head form d/2 pairs.
enum class RopeStyle {
  interleaved,  ///< GPT-J / DeepSeek MLA: pair i = (x[2i], x[2i+1])
  neox,         ///< GPT-NeoX: pair i = (x[i], x[i + d/2])
};

/// Indices of pair i in a row of d rotary dims.
struct RopePairIndex {
  int first;
  int second;
};
constexpr DCPATTN_HOST_DEVICE RopePairIndex rope_pair_index(RopeStyle style, int i,
                                                            int d) noexcept {
  return style == RopeStyle::interleaved ? RopePairIndex{2 * i, 2 * i + 1}
                                         : RopePairIndex{i, i + d / 2};
}

/// Rotates (x0, x1) by the angle whose cosine and sine are given:
/// (x0 cos - x1 sin, x0 sin + x1 cos).
struct RopePair {
  float x0;
  float x1;
};
constexpr DCPATTN_HOST_DEVICE RopePair rope_pair(float x0, float x1, float cos_v,
                                                 float sin_v) noexcept {
  return {x0 * cos_v - x1 * sin_v, x0 * sin_v + x1 * cos_v};
}

/// cos and sin of pair i at position pos for plain RoPE: angle = pos * base^(-2i/d).
/// Models with YaRN or other scaling supply their own cos/sin cache instead.
struct RopeCosSin {
  float cos_v;
  float sin_v;
};
DCPATTN_HOST_DEVICE RopeCosSin rope_cos_sin(long long pos, int i, int d, float base) noexcept {
  const double inv_freq = cuda::std::pow(double(base), -2.0 * double(i) / double(d));
  const double angle = double(pos) * inv_freq;
  return {float(cuda::std::cos(angle)), float(cuda::std::sin(angle))};
}

/// Applies RoPE in place to one row of d rotary dims. cos_row, sin_row: (d/2,) for this position
/// (one row of a cos/sin cache). x: float or bfloat16.
template <class T>
DCPATTN_HOST_DEVICE void rope_row(T* x, const float* cos_row, const float* sin_row, int d,
                                  RopeStyle style) noexcept {
  for (int i = 0; i < d / 2; ++i) {
    const RopePairIndex idx = rope_pair_index(style, i, d);
    const RopePair r = rope_pair(to_float(x[idx.first]), to_float(x[idx.second]), cos_row[i],
                                 sin_row[i]);
    x[idx.first] = from_float<T>(r.x0);
    x[idx.second] = from_float<T>(r.x1);
  }
}

DCPATTN_NAMESPACE_END
