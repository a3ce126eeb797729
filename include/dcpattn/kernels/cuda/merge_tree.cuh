// SPDX-License-Identifier: Apache-2.0
// Deterministic mode's fixed merge tree (dcpattn::tree_merge, dcpattn/core/lse.hpp) on the
// device, for the kernels that merge states in registers: the CUDA combine's row kernel (states
// of ranks) and the MLA decode's split merge (states of splits). Both must give the bits of the
// host's in-place tree merge, so both take the arithmetic from here:
//   - merge_element: one element of merge_state_into, the same operations, no contraction;
//   - tree_weights: the S - 1 nodes' weights (merge_lse) level by level, in tree_merge's order;
//   - tree_merge_column: one column's element merges, node by node in the same order.
// The tree pairs state k with state k + S / 2 first (highest index bit first), so node k of level
// `level` merges nodes k and k + (S >> (level + 1)) of the level above; nodes are numbered level
// by level (tree_node). When every weight is non-zero (the usual case: no empty state, no weight
// underflowed) an element is w_a o_a + w_b o_b, which is merge_element's value bit for bit
// without its zero tests (tree_merge_column's Plain).
#pragma once

#include <cuda_runtime.h>

#include "dcpattn/config.hpp"
#include "dcpattn/core/lse.hpp"

DCPATTN_NAMESPACE_BEGIN

namespace cuda_kernels::detail {

/// weighted(w, o) of dcpattn/core/lse.hpp with an explicitly rounded product.
DCPATTN_DEVICE float weighted_rn(float w, float o) {
  return w != 0.0f ? __fmul_rn(w, o) : 0.0f;
}

/// One element of merge_state_into (dcpattn/core/lse.hpp): the same operations, no contraction.
DCPATTN_DEVICE float merge_element(float oa, float ob, float wa, float wb) {
  const float ta = weighted_rn(wa, oa);
  const float tb = weighted_rn(wb, ob);
  return wb == 0.0f ? ta : (wa == 0.0f ? tb : __fadd_rn(ta, tb));
}

/// Index of node k of level `level` in the tree of S leaves numbered level by level (S / 2 nodes
/// at level 0, S / 4 at level 1, ..., the root S - 2).
template <int S>
DCPATTN_HOST_DEVICE constexpr int tree_node(int level, int k) {
  return S - (S >> level) + k;
}

/// The weights {w_a, w_b} of the tree's S - 1 nodes from the S sanitized lse values `l`, merged in
/// place (l[0] ends as the root's lse), level by level as tree_merge. Returns whether every weight
/// is non-zero.
template <int S>
DCPATTN_DEVICE bool tree_weights(float (&l)[S], float2 (&w)[S - 1]) {
  static_assert(S >= 2 && (S & (S - 1)) == 0, "dcpattn: tree_weights: S, a power of two >= 2");
  bool plain = true;
#pragma unroll
  for (int level = 0, half = S / 2; half >= 1; half >>= 1, ++level) {
#pragma unroll
    for (int k = 0; k < half; ++k) {
      const MergeWeights mw = merge_lse(l[k], l[k + half]);
      w[tree_node<S>(level, k)] = make_float2(mw.w_a, mw.w_b);
      plain = plain && mw.w_a != 0.0f && mw.w_b != 0.0f;
      l[k] = mw.lse;
    }
  }
  return plain;
}

/// The element merges of one column from level `Level` (pairs k, k + Half) down to the root: v[k]
/// is state k's value, the result ends in v[0]. Unrolled at compile time, so every index of v is
/// a constant and v stays in registers (a loop over the levels left v in local memory for S >=
/// 16). `w(node)`: that node's {w_a, w_b}. `Plain`: every weight is non-zero (tree_weights'
/// result), so each element is w_a o_a + w_b o_b, three instructions instead of about eight.
template <bool Plain, int Half, int Level, int S, class W>
DCPATTN_DEVICE void tree_merge_levels(float (&v)[S], const W& w) {
  if constexpr (Half >= 1) {
#pragma unroll
    for (int k = 0; k < Half; ++k) {
      const float2 wk = w(tree_node<S>(Level, k));
      v[k] = Plain ? __fadd_rn(__fmul_rn(wk.x, v[k]), __fmul_rn(wk.y, v[k + Half]))
                   : merge_element(v[k], v[k + Half], wk.x, wk.y);
    }
    tree_merge_levels<Plain, Half / 2, Level + 1>(v, w);
  }
}

/// The whole tree's element merges of one column (see tree_merge_levels); returns v[0].
template <bool Plain, int S, class W>
DCPATTN_DEVICE float tree_merge_column(float (&v)[S], const W& w) {
  tree_merge_levels<Plain, S / 2, 0>(v, w);
  return v[0];
}

}  // namespace cuda_kernels::detail

DCPATTN_NAMESPACE_END
