// SPDX-License-Identifier: Apache-2.0
// Host reference MLA decode kernels (dense paged and sparse top-k) over the local KV shard of one
// DCP rank. Scalar fp32 code; it fixes the arithmetic order that the deterministic mode relies on.
//
// Local splits. A rank stores its tokens densely at local positions p = 0, 1, ... (ascending global
// position). A row of the local shard is cut into S = num_splits splits, round-robin over local
// blocks of I = interleave tokens: p belongs to split j = (p / I) mod S. The k-th token of split j
// is p = ((k / I) S + j) I + k mod I, and a local length Lloc holds
// (Lloc / (S I)) I + clamp(Lloc mod (S I) - j I, 0, I) tokens of split j. With round-robin
// ownership over N ranks and V virtual shards, S = V / N makes split j of rank r exactly virtual
// shard v = j N + r, walked in ascending position: the split states, and hence the merged output,
// do not depend on N.
//
// Each split gives a partial state in fp32 by an exact two-pass softmax over its keys in split
// order: s = softmax_scale * (q . k) with the dot product accumulated sequentially over the 576
// dims; m = max s; l = sum exp(s - m) and u = sum exp(s - m) v accumulated in key order;
// o = u / l, lse = m + log(l) (natural log). An empty split is the neutral state (o = 0,
// lse = -inf). The S states of a (row, head) are merged with dcpattn::tree_merge (highest split
// bit first), and the merged fp32 state is written.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <cuda/std/limits>

#include "dcpattn/config.hpp"
#include "dcpattn/core/lse.hpp"
#include "dcpattn/core/numeric.hpp"
#include "dcpattn/core/tensor.hpp"
#include "dcpattn/error.hpp"
#include "dcpattn/kernels/cache_layout.hpp"
#include "dcpattn/kernels/mla_kernel.hpp"
#include "dcpattn/ownership/slot_ownership.hpp"

DCPATTN_NAMESPACE_BEGIN

namespace host {
namespace detail {

inline void require_rows(std::int64_t rows, std::int64_t tokens, const char* name) {
  DCPATTN_REQUIRE(rows == tokens, std::string(name) + " has " + std::to_string(rows) +
                                      " rows, but q has " + std::to_string(tokens) + " tokens");
}

template <class QView, class CacheView>
void validate_mla_common(const QView& q, const CacheView& cache, const MlaDecodeParams& p,
                         TensorView<const std::int32_t, 2> block_table,
                         TensorView<const std::int32_t, 1> row_request, TensorView<float, 3> o,
                         TensorView<float, 2> lse) {
  dcpattn::detail::validate_mla_extents(q, cache, row_request, p, o, lse);
  for (std::int64_t r = 0; r < p.num_valid_rows; ++r) {
    const std::int32_t req = row_request(r);
    DCPATTN_REQUIRE(req >= 0 && req < block_table.extent(0),
                    "row_request[" + std::to_string(r) + "] = " + std::to_string(req) +
                        " is not a request of block_table (num_requests = " +
                        std::to_string(block_table.extent(0)) + ")");
  }
}

/// Checks the page of local position `pos` of request `req` (row `row`) and returns its slot.
template <class CacheView>
std::int64_t checked_slot(const CacheView& cache, TensorView<const std::int32_t, 2> block_table,
                          std::int64_t row, std::int32_t req, std::int64_t pos, int page_size) {
  const std::int64_t page_index = pos / page_size;
  DCPATTN_REQUIRE(page_index < block_table.extent(1),
                  "row " + std::to_string(row) + " needs local page index " +
                      std::to_string(page_index) + " (local position " + std::to_string(pos) +
                      ") beyond block_table's max_pages (" + std::to_string(block_table.extent(1)) +
                      ")");
  const std::int64_t page = block_table(req, page_index);
  const std::int64_t slot = page * page_size + pos % page_size;
  DCPATTN_REQUIRE(page >= 0 && slot < cache.extent(0),
                  "block_table[" + std::to_string(req) + "][" + std::to_string(page_index) +
                      "] = " + std::to_string(page) + " addresses slot " + std::to_string(slot) +
                      " outside the cache (num_slots = " + std::to_string(cache.extent(0)) + ")");
  return slot;
}

/// Scratch of one row: its queries and the scores of one split, all heads.
struct RowScratch {
  std::vector<float> q;       // (H, 576)
  std::vector<float> scores;  // (H, n) of the current split
  std::vector<float> m;       // (H,)
  std::vector<float> l;       // (H,)
  std::vector<float> key;     // (576,)
  std::vector<float> o;       // (S, H, 512) split states
  std::vector<float> lse;     // (S, H)
};

/// Partial state of every head over one split whose slots are given in key order, written to
/// state j of the scratch (two-pass softmax; see the file comment).
template <class CacheView>
void split_state(const CacheView& cache, const std::vector<std::int64_t>& slots, int j, int heads,
                 float softmax_scale, RowScratch& s) {
  const std::size_t n = slots.size();
  float* o_j = s.o.data() + std::size_t(j) * heads * kMlaVDim;
  float* lse_j = s.lse.data() + std::size_t(j) * heads;
  for (std::size_t i = 0; i < std::size_t(heads) * kMlaVDim; ++i) o_j[i] = 0.0f;
  if (n == 0) {
    for (int h = 0; h < heads; ++h) lse_j[h] = lse_neg_inf;
    return;
  }
  s.scores.resize(std::size_t(heads) * n);
  // Pass 1: scores and their maximum.
  for (int h = 0; h < heads; ++h) s.m[h] = lse_neg_inf;
  for (std::size_t k = 0; k < n; ++k) {
    for (int d = 0; d < kMlaQkDim; ++d) s.key[d] = mla_key(cache, slots[k], d);
    for (int h = 0; h < heads; ++h) {
      const float* qh = s.q.data() + std::size_t(h) * kMlaQkDim;
      float dot = 0.0f;
      for (int d = 0; d < kMlaQkDim; ++d) dot += qh[d] * s.key[d];
      const float sc = softmax_scale * dot;
      s.scores[std::size_t(h) * n + k] = sc;
      s.m[h] = sc > s.m[h] ? sc : s.m[h];
    }
  }
  // Pass 2: exp-weighted sums in key order.
  for (int h = 0; h < heads; ++h) s.l[h] = 0.0f;
  for (std::size_t k = 0; k < n; ++k) {
    for (int d = 0; d < kMlaVDim; ++d) s.key[d] = mla_value(cache, slots[k], d);
    for (int h = 0; h < heads; ++h) {
      const float e = std::exp(s.scores[std::size_t(h) * n + k] - s.m[h]);
      s.l[h] += e;
      float* oh = o_j + std::size_t(h) * kMlaVDim;
      for (int d = 0; d < kMlaVDim; ++d) oh[d] += e * s.key[d];
    }
  }
  for (int h = 0; h < heads; ++h) {
    float* oh = o_j + std::size_t(h) * kMlaVDim;
    for (int d = 0; d < kMlaVDim; ++d) oh[d] = oh[d] / s.l[h];
    lse_j[h] = s.m[h] + std::log(s.l[h]);
  }
}

/// Loads the queries of row t into the scratch and sizes it for S splits.
template <class QView>
void load_row(const QView& q, std::int64_t t, int heads, int num_splits, RowScratch& s) {
  s.q.resize(std::size_t(heads) * kMlaQkDim);
  s.m.resize(heads);
  s.l.resize(heads);
  s.key.resize(kMlaQkDim);
  s.o.resize(std::size_t(num_splits) * heads * kMlaVDim);
  s.lse.resize(std::size_t(num_splits) * heads);
  for (int h = 0; h < heads; ++h)
    for (int d = 0; d < kMlaQkDim; ++d)
      s.q[std::size_t(h) * kMlaQkDim + d] = to_float(q(t, std::int64_t(h), std::int64_t(d)));
}

/// State v of head h in the (S, H, 512) / (S, H) split buffers, for tree_merge. A functor rather
/// than a lambda so it stays callable from tree_merge's host+device body under nvcc.
struct SplitStateAt {
  float* o;
  float* lse;
  int heads;
  int h;
  DCPATTN_HOST_DEVICE TreeStateRef operator()(int v) const noexcept {
    return TreeStateRef{o + (std::size_t(v) * heads + h) * kMlaVDim,
                        lse + std::size_t(v) * heads + h};
  }
};

/// Tree-merges the S split states of each head of row t and writes the result.
inline void merge_and_store(std::int64_t t, int heads, int num_splits, RowScratch& s,
                            TensorView<float, 3> o, TensorView<float, 2> lse) {
  for (int h = 0; h < heads; ++h) {
    tree_merge(SplitStateAt{s.o.data(), s.lse.data(), heads, h}, num_splits, kMlaVDim);
    const float* merged = s.o.data() + std::size_t(h) * kMlaVDim;
    for (int d = 0; d < kMlaVDim; ++d) o(t, std::int64_t(h), std::int64_t(d)) = merged[d];
    lse(t, std::int64_t(h)) = s.lse[std::size_t(h)];
  }
}

inline void store_neutral(std::int64_t t, TensorView<float, 3> o, TensorView<float, 2> lse) {
  for (std::int64_t h = 0; h < o.extent(1); ++h) {
    for (std::int64_t d = 0; d < o.extent(2); ++d) o(t, h, d) = 0.0f;
    lse(t, h) = lse_neg_inf;
  }
}

}  // namespace detail

/// Dense paged MLA decode over THIS rank's local KV shard; writes the merged local partial state.
///
/// @tparam QView     rank-3 mdspan of bfloat16 (or float), any layout; only q(t, h, d) and the
///                   extents are used (the query gather hands a rank-major view)
/// @tparam CacheView mla_cache_view_t<CacheFormat::bf16> (num_slots, 576) or
///                   mla_cache_view_t<CacheFormat::fp8_ds_mla> (num_slots, 656)
/// @param q                (tokens, heads, 576) queries: latent-absorbed part then RoPE part
/// @param cache            the local paged MLA cache
/// @param block_table      (num_requests, max_pages) LOCAL page ids of each request
/// @param row_request      (tokens,) request of each row
/// @param row_local_length (tokens,) how many of this rank's tokens the row attends: the local
///                         length of the row's own global causal bound (local positions
///                         [0, row_local_length[t]))
/// @param p                softmax scale, page size, interleave, splits, valid rows
/// @param o                (tokens, heads, 512) fp32 output: softmax-weighted value average
/// @param lse              (tokens, heads) fp32 output: natural-log sum of exp(scores)
/// A row with no local token, and every padding row t >= p.num_valid_rows, gets the neutral state
/// (o = 0, lse = -inf); nothing of a padding row (q, row_request, row_local_length) is read.
/// Throws dcpattn::Error naming the parameter on bad extents or parameters, before writing.
template <class QView, class CacheView>
void mla_decode_dense(const QView& q, const CacheView& cache,
                      TensorView<const std::int32_t, 2> block_table,
                      TensorView<const std::int32_t, 1> row_request,
                      TensorView<const std::int64_t, 1> row_local_length, const MlaDecodeParams& p,
                      TensorView<float, 3> o, TensorView<float, 2> lse) {
  detail::validate_mla_common(q, cache, p, block_table, row_request, o, lse);
  detail::require_rows(row_local_length.extent(0), q.extent(0), "row_local_length");
  for (std::int64_t t = 0; t < p.num_valid_rows; ++t) {
    const std::int64_t len = row_local_length(t);
    DCPATTN_REQUIRE(len >= 0, "row_local_length[" + std::to_string(t) +
                                  "] = " + std::to_string(len) + " is negative");
    // Every page the row touches: the first position of each page and the last position.
    const std::int32_t req = row_request(t);
    for (std::int64_t pos = 0; pos < len; pos += p.page_size) {
      const std::int64_t last = pos + p.page_size - 1 < len ? pos + p.page_size - 1 : len - 1;
      detail::checked_slot(cache, block_table, t, req, last, p.page_size);
    }
  }

  const std::int64_t tokens = q.extent(0);
  const int heads = int(q.extent(1));
  const int S = p.num_splits;
  const int I = p.interleave;
  detail::RowScratch s;
  std::vector<std::int64_t> slots;
  for (std::int64_t t = 0; t < tokens; ++t) {
    if (t >= p.num_valid_rows) {
      detail::store_neutral(t, o, lse);
      continue;
    }
    const std::int32_t req = row_request(t);
    const std::int64_t len = row_local_length(t);
    detail::load_row(q, t, heads, S, s);
    for (int j = 0; j < S; ++j) {
      const std::int64_t n = mla_split_length(len, j, S, I);
      slots.resize(std::size_t(n));
      for (std::int64_t k = 0; k < n; ++k) {
        const std::int64_t pos = mla_split_position(k, j, S, I);
        slots[std::size_t(k)] =
            std::int64_t(block_table(req, pos / p.page_size)) * p.page_size + pos % p.page_size;
      }
      detail::split_state(cache, slots, j, heads, p.softmax_scale, s);
    }
    detail::merge_and_store(t, heads, S, s, o, lse);
  }
}

/// Sparse (top-k, DSA) MLA decode over THIS rank's local KV shard; writes the merged local state.
///
/// Each row lists GLOBAL token positions (any order, -1 = none, duplicates attended as listed).
/// The rank keeps the positions g it owns (own.owner(g) == rank), at local position
/// p = own.local_position(g), split j = (p / I) mod S, slot
/// block_table[row_request[t]][p / page_size] * page_size + p mod page_size; within a split, keys
/// are taken in list order.
///
/// @tparam Ownership a SlotOwnership model (e.g. RoundRobinOwnership); when it has interleave(),
///                   it must equal p.interleave
/// @param topk      (tokens, k) global positions, -1 = none
/// @param row_bound (tokens,) global causal bound of each row: listed positions must be < bound
/// @param own, rank the ownership policy and this rank's index in [0, own.group_size())
/// Other parameters, outputs and the neutral state as for mla_decode_dense (o (tokens, heads, 512)
/// fp32, lse (tokens, heads) natural log; a row listing nothing this rank owns gets o = 0,
/// lse = -inf). Throws dcpattn::Error before writing on bad input; a listed position >= bound or
/// < -1 is reported naming topk_indices with its row and value.
template <class QView, class CacheView, class Ownership>
void mla_decode_sparse(const QView& q, const CacheView& cache,
                       TensorView<const std::int32_t, 2> block_table,
                       TensorView<const std::int32_t, 1> row_request,
                       TensorView<const std::int32_t, 2> topk,
                       TensorView<const std::int64_t, 1> row_bound, const Ownership& own, int rank,
                       const MlaDecodeParams& p, TensorView<float, 3> o, TensorView<float, 2> lse) {
  static_assert(SlotOwnership<Ownership>, DCPATTN_SLOT_OWNERSHIP_MESSAGE);
  detail::validate_mla_common(q, cache, p, block_table, row_request, o, lse);
  dcpattn::detail::validate_mla_sparse_extents(q, topk, row_bound, own, rank, p);
  for (std::int64_t t = 0; t < p.num_valid_rows; ++t) {
    const std::int64_t bound = row_bound(t);
    DCPATTN_REQUIRE(bound >= 0, "row_bound[" + std::to_string(t) + "] = " + std::to_string(bound) +
                                    " is negative");
    const std::int32_t req = row_request(t);
    for (std::int64_t k = 0; k < topk.extent(1); ++k) {
      const std::int64_t g = topk(t, k);
      DCPATTN_REQUIRE(g >= -1 && g < bound,
                      "topk_indices[row " + std::to_string(t) + "][" + std::to_string(k) +
                          "] = " + std::to_string(g) +
                          " is outside [-1, row_bound = " + std::to_string(bound) + ")");
      if (g < 0 || own.owner(g) != rank) continue;
      detail::checked_slot(cache, block_table, t, req, std::int64_t(own.local_position(g)),
                           p.page_size);
    }
  }

  const std::int64_t tokens = q.extent(0);
  const int heads = int(q.extent(1));
  const int S = p.num_splits;
  const int I = p.interleave;
  detail::RowScratch s;
  std::vector<std::vector<std::int64_t>> split_slots(static_cast<std::size_t>(S));
  for (std::int64_t t = 0; t < tokens; ++t) {
    if (t >= p.num_valid_rows) {
      detail::store_neutral(t, o, lse);
      continue;
    }
    const std::int32_t req = row_request(t);
    for (auto& v : split_slots) v.clear();
    const std::int64_t run = mla_list_run(topk.extent(1), S);  // split_topk_list's runs
    for (std::int64_t k = 0; k < topk.extent(1); ++k) {
      const std::int64_t g = topk(t, k);
      if (g < 0 || own.owner(g) != rank) continue;
      const std::int64_t pos = own.local_position(g);
      const int j = p.split_topk_list ? int(k / run) : mla_split_of(pos, S, I);
      split_slots[std::size_t(j)].push_back(
          std::int64_t(block_table(req, pos / p.page_size)) * p.page_size + pos % p.page_size);
    }
    detail::load_row(q, t, heads, S, s);
    for (int j = 0; j < S; ++j)
      detail::split_state(cache, split_slots[std::size_t(j)], j, heads, p.softmax_scale, s);
    detail::merge_and_store(t, heads, S, s, o, lse);
  }
}

}  // namespace host

DCPATTN_NAMESPACE_END
