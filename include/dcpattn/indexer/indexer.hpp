// SPDX-License-Identifier: Apache-2.0
// The DSA lightning indexer (DeepSeek-V3.2, GLM-5): per query row, a score for every earlier key,
// and the exact top-k of those scores over a DCP group (dcpattn/indexer/distributed_topk.hpp).
//
// Score of query row t and key s (s below the row's causal bound):
//     score(t, s) = sum over indexer heads j of w[t, j] * ReLU(q[t, j, :] . k[s, :])
// with q (T, H, 128) in bf16, or fp8 e4m3 with one fp32 scale per (t, j), weights w (T, H) fp32,
// and k the fp8 key the fused prologue wrote to the paged indexer cache (128 e4m3 values and one
// fp32 scale per token, IndexerKCacheLayout).
//
// Arithmetic, fixed so that a score depends only on q[t], w[t] (and q's scales) and the stored
// bytes of key s, never on N, the rank, or where s sits in a shard:
//   d_j   = sum_{i = 0..127} qv[j, i] * kv[i]     fp32, i ascending; qv, kv the raw bf16 / e4m3
//                                                 values (scales not applied)
//   x_j   = (d_j * k_scale) * q_scale[j]          q_scale = 1 for bf16 q (an exact no-op)
//   r_j   = x_j > 0 ? x_j : 0                     ReLU; a NaN x_j gives 0
//   score = fma(w_j, r_j, score), j = 0..H-1      starting from 0
// Each product qv * kv is exact in fp32 (at most 8 + 4 significant bits, barring underflow below
// 2^-126), so fused and unfused multiply-adds agree and only the order of the sums matters. The
// CUDA kernel forms d_j with tensor-core MMAs (another summation order; its scores differ from the
// host's by at most the fp32 rounding of those sums, ~2^-24 * 128 * sum_j |w_j| sum_i |q k| *
// scales) and the rest exactly as above; where the d_j are exact (e.g. small-integer data), host
// and GPU scores are bitwise equal.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include <cuda/std/cmath>
#include <cuda/std/span>

#include "dcpattn/comm/communicator.hpp"
#include "dcpattn/config.hpp"
#include "dcpattn/core/numeric.hpp"
#include "dcpattn/core/tensor.hpp"
#include "dcpattn/error.hpp"
#include "dcpattn/indexer/distributed_topk.hpp"
#include "dcpattn/kernels/cache_layout.hpp"
#include "dcpattn/ownership/slot_ownership.hpp"

DCPATTN_NAMESPACE_BEGIN

/// Indexer heads of the reference models (DeepSeek-V3.2: 64).
inline constexpr int kIndexerNumHeads = 64;
/// Width of an indexer query head and key.
inline constexpr int kIndexerDim = IndexerKCacheLayout::head_dim;  // 128

/// Sizes of the indexer of one DCP rank; what the workspace is planned from.
struct IndexerConfig {
  int num_heads = kIndexerNumHeads;  ///< H, indexer heads (64 for DeepSeek-V3.2)
  int topk = kIndexerMaxTopk;        ///< k >= 1 (<= 2048 on the GPU)
  int max_tokens = 256;              ///< largest T (query rows) of one call
  std::int64_t max_context_len = 0;  ///< largest causal bound (global tokens) of any row
};

/// Empty status when the configuration is usable, else a message naming the parameter.
inline Status indexer_can_implement(const IndexerConfig& c) {
  auto s = [](auto v) { return std::to_string(v); };
  if (c.num_heads < 1) return Status::failure("num_heads (" + s(c.num_heads) + ") must be >= 1");
  if (c.topk < 1) return Status::failure("topk (" + s(c.topk) + ") must be >= 1");
  if (c.max_tokens < 1) return Status::failure("max_tokens (" + s(c.max_tokens) + ") must be >= 1");
  if (c.max_context_len < 0 || c.max_context_len > std::int64_t(0x7fffffff))
    return Status::failure("max_context_len (" + s(c.max_context_len) + ") must be in [0, 2^31)");
  return Status::success();
}

/// The most keys any rank of `own`'s group holds for a row of bound `max_context_len`: the
/// columns of the scores buffer.
template <class Ownership>
std::int64_t indexer_max_local_keys(const IndexerConfig& c, const Ownership& own) {
  static_assert(SlotOwnership<Ownership>, DCPATTN_SLOT_OWNERSHIP_MESSAGE);
  std::int64_t m = 0;
  for (int r = 0; r < own.group_size(); ++r) {
    const std::int64_t n = own.local_length(c.max_context_len, r);
    m = n > m ? n : m;
  }
  return m;
}

namespace detail {
struct IndexerTopkLayout {
  std::size_t scores = 0;  ///< (max_tokens, max_local_keys) fp32
  std::size_t topk = 0;    ///< distributed top-k workspace
  std::size_t total = 0;
};
template <class Ownership>
IndexerTopkLayout indexer_topk_layout(const IndexerConfig& c, const Ownership& own) {
  IndexerTopkLayout l{};
  const std::size_t t = std::size_t(c.max_tokens > 0 ? c.max_tokens : 0);
  l.topk = align_workspace(t * std::size_t(indexer_max_local_keys(c, own)) * sizeof(float));
  l.total = l.topk + distributed_topk_workspace_bytes(c.max_tokens, c.topk, own.group_size());
  return l;
}
}  // namespace detail

/// Workspace bytes of indexer_topk (host or CUDA): the (max_tokens, max_local_keys) fp32 scores
/// and the distributed top-k's candidate lists.
template <class Ownership>
std::size_t indexer_topk_workspace_bytes(const IndexerConfig& c, const Ownership& own) {
  return detail::indexer_topk_layout(c, own).total;
}

/// Inputs of the indexer scoring of one batch of T query rows on one rank.
///
/// @tparam QElem bfloat16 (bf16 queries) or std::uint8_t (fp8 e4m3 query bytes, with q_scale)
template <class QElem>
struct IndexerArgs {
  static_assert(std::is_same_v<QElem, bfloat16> || std::is_same_v<QElem, std::uint8_t>,
                "dcpattn: indexer queries are bfloat16 or fp8 e4m3 bytes (std::uint8_t)");
  static constexpr bool fp8_queries = std::is_same_v<QElem, std::uint8_t>;

  /// (T, H, 128) indexer queries, any strides.
  TensorView<const QElem, 3> q;
  /// (T, H) fp32 dequantization scale of each fp8 query head (q = e4m3(byte) * q_scale).
  /// [optional] (default: none; required for fp8 queries, unused for bf16)
  TensorView<const float, 2> q_scale{};
  /// (T, H) fp32 head weights w[t, j] (any constant factors, e.g. softmax scale, folded in).
  TensorView<const float, 2> weights;
  /// (num_pages, page_size * 132) paged fp8 indexer-key cache of this rank (IndexerKCacheLayout),
  /// as written by the fused prologue. Its page size is page_bytes / 132.
  TensorView<const std::uint8_t, 2> k_cache;
  /// (num_requests, max_pages) LOCAL page ids of each request on this rank (the MLA cache's
  /// block table; local position p is in-page slot p % page_size of page block_table[req][p /
  /// page_size]).
  TensorView<const std::int32_t, 2> block_table;
  /// (T,) request of each row.
  TensorView<const std::int32_t, 1> row_request;
  /// (T,) global causal bound of each row: it scores positions [0, bound).
  TensorView<const std::int64_t, 1> row_bound;
  /// Rows t >= num_valid_rows are padding (CUDA-graph batches): nothing of them is read, and their
  /// top-k rows are all -1. Must be set, in [0, T].
  int num_valid_rows = -1;
};

/// The head term of the score: acc + w * ReLU((dot * k_scale) * q_scale), as one fma. Shared by
/// the host reference and the CUDA kernel so that both round identically.
/// @param dot raw dot product of one query head with one key (scales not applied)
DCPATTN_HOST_DEVICE float indexer_accumulate_head(float acc, float dot, float k_scale,
                                                  float q_scale, float w) noexcept {
  const float x = (dot * k_scale) * q_scale;
  const float r = x > 0.0f ? x : 0.0f;
  return cuda::std::fma(w, r, acc);
}

/// Raw value of a query element: the bf16 value, or the decoded e4m3 value (scale not applied).
DCPATTN_HOST_DEVICE float indexer_q_value(bfloat16 x) noexcept {
  return x.to_float();
}
DCPATTN_HOST_DEVICE float indexer_q_value(std::uint8_t x) noexcept {
  return fp8_e4m3::decode(x);
}

/// Score of one key for one query row, with the arithmetic of the file comment.
/// @param q       (heads, 128) raw query values of the row, contiguous
/// @param q_scale (heads,) per-head query scale (all 1 for bf16 queries)
/// @param w       (heads,) head weights
/// @param k       (128,) raw e4m3 values of the key (decoded, scale not applied)
/// @param k_scale the key's fp32 scale
DCPATTN_HOST_DEVICE float indexer_score(const float* q, const float* q_scale, const float* w,
                                        int heads, const float* k, float k_scale) noexcept {
  float score = 0.0f;
  for (int j = 0; j < heads; ++j) {
    const float* qj = q + j * kIndexerDim;
    float dot = 0.0f;
    for (int i = 0; i < kIndexerDim; ++i) dot += qj[i] * k[i];
    score = indexer_accumulate_head(score, dot, k_scale, q_scale[j], w[j]);
  }
  return score;
}

namespace detail {

inline std::string idx_str(std::int64_t v) {
  return std::to_string(v);
}

/// Extent checks shared by the host and CUDA scoring (no data is read).
template <class QElem>
void validate_indexer_shapes(const IndexerArgs<QElem>& a, TensorView<float, 2> scores) {
  const std::int64_t t = a.q.extent(0);
  const std::int64_t h = a.q.extent(1);
  DCPATTN_REQUIRE(h >= 1 && a.q.extent(2) == kIndexerDim,
                  "q must be (T, H >= 1, " + idx_str(kIndexerDim) + "), got (" + idx_str(t) + ", " +
                      idx_str(h) + ", " + idx_str(a.q.extent(2)) + ")");
  DCPATTN_REQUIRE(a.weights.extent(0) == t && a.weights.extent(1) == h,
                  "weights must be (T, H) = (" + idx_str(t) + ", " + idx_str(h) + "), got (" +
                      idx_str(a.weights.extent(0)) + ", " + idx_str(a.weights.extent(1)) + ")");
  if constexpr (IndexerArgs<QElem>::fp8_queries) {
    DCPATTN_REQUIRE(a.q_scale.data_handle() != nullptr || t == 0,
                    "q_scale is required with fp8 queries");
    DCPATTN_REQUIRE(a.q_scale.extent(0) == t && a.q_scale.extent(1) == h,
                    "q_scale must be (T, H) = (" + idx_str(t) + ", " + idx_str(h) + "), got (" +
                        idx_str(a.q_scale.extent(0)) + ", " + idx_str(a.q_scale.extent(1)) + ")");
  }
  DCPATTN_REQUIRE(
      a.k_cache.extent(1) > 0 && a.k_cache.extent(1) % IndexerKCacheLayout::bytes_per_token == 0,
      "k_cache must have page_size * " + idx_str(IndexerKCacheLayout::bytes_per_token) +
          " bytes per page, got " + idx_str(a.k_cache.extent(1)));
  DCPATTN_REQUIRE(
      a.row_request.extent(0) == t,
      "row_request has " + idx_str(a.row_request.extent(0)) + " rows, q has " + idx_str(t));
  DCPATTN_REQUIRE(a.row_bound.extent(0) == t,
                  "row_bound has " + idx_str(a.row_bound.extent(0)) + " rows, q has " + idx_str(t));
  DCPATTN_REQUIRE(a.num_valid_rows >= 0 && a.num_valid_rows <= t,
                  "num_valid_rows (" + idx_str(a.num_valid_rows) +
                      ") must be set, in [0, T = " + idx_str(t) + "]");
  DCPATTN_REQUIRE(scores.extent(0) == t,
                  "scores has " + idx_str(scores.extent(0)) + " rows, q has " + idx_str(t));
}

}  // namespace detail

namespace host {

/// Indexer scores of this rank's keys (host reference).
///
/// For every valid row t and every local position p < own.local_length(row_bound[t], rank):
/// scores(t, p) = score(t, key at p) with the arithmetic of the file comment. Other entries of
/// `scores` (columns past a row's local length, padding rows) are not written; nothing of a
/// padding row is read.
///
/// @tparam Ownership SlotOwnership model (RoundRobinOwnership)
/// @param scores (T, C) fp32 output, C >= the largest local length of a valid row
/// Throws dcpattn::Error naming the parameter, before writing, on bad extents, a negative bound,
/// a request outside block_table, a local length beyond C, or a page outside block_table or
/// k_cache.
template <class QElem, class Ownership>
void indexer_scores(const Ownership& own, int rank, const IndexerArgs<QElem>& a,
                    TensorView<float, 2> scores) {
  static_assert(SlotOwnership<Ownership>, DCPATTN_SLOT_OWNERSHIP_MESSAGE);
  using dcpattn::detail::idx_str;
  dcpattn::detail::validate_indexer_shapes(a, scores);
  DCPATTN_REQUIRE(rank >= 0 && rank < own.group_size(),
                  "rank (" + idx_str(rank) +
                      ") must be in [0, group_size = " + idx_str(own.group_size()) + ")");
  const std::int64_t page_size = IndexerKCacheLayout::page_size(a.k_cache.extent(1));
  for (std::int64_t t = 0; t < a.num_valid_rows; ++t) {
    const std::int64_t bound = a.row_bound(t);
    DCPATTN_REQUIRE(bound >= 0,
                    "row_bound[" + idx_str(t) + "] = " + idx_str(bound) + " is negative");
    const std::int64_t n = own.local_length(bound, rank);
    DCPATTN_REQUIRE(n <= scores.extent(1), "row " + idx_str(t) + " has " + idx_str(n) +
                                               " local keys, more than the " +
                                               idx_str(scores.extent(1)) + " columns of scores");
    if (n == 0) continue;
    const std::int32_t req = a.row_request(t);
    DCPATTN_REQUIRE(req >= 0 && req < a.block_table.extent(0),
                    "row_request[" + idx_str(t) + "] = " + idx_str(req) +
                        " is not a request of block_table (num_requests = " +
                        idx_str(a.block_table.extent(0)) + ")");
    const std::int64_t pages = (n + page_size - 1) / page_size;
    DCPATTN_REQUIRE(pages <= a.block_table.extent(1),
                    "row " + idx_str(t) + " needs " + idx_str(pages) + " local pages, beyond " +
                        "block_table's max_pages (" + idx_str(a.block_table.extent(1)) + ")");
    for (std::int64_t i = 0; i < pages; ++i) {
      const std::int64_t page = a.block_table(req, i);
      DCPATTN_REQUIRE(page >= 0 && page < a.k_cache.extent(0),
                      "block_table[" + idx_str(req) + "][" + idx_str(i) + "] = " + idx_str(page) +
                          " is outside k_cache (" + idx_str(a.k_cache.extent(0)) + " pages)");
    }
  }

  const int heads = int(a.q.extent(1));
  const std::size_t h = static_cast<std::size_t>(heads);
  std::vector<float> q(h * kIndexerDim), qs(h), w(h);
  float k[kIndexerDim];
  for (std::int64_t t = 0; t < a.num_valid_rows; ++t) {
    const std::int64_t n = own.local_length(a.row_bound(t), rank);
    if (n == 0) continue;
    for (int j = 0; j < heads; ++j) {
      for (int i = 0; i < kIndexerDim; ++i)
        q[std::size_t(j) * kIndexerDim + std::size_t(i)] =
            indexer_q_value(a.q(t, std::int64_t(j), std::int64_t(i)));
      if constexpr (IndexerArgs<QElem>::fp8_queries)
        qs[std::size_t(j)] = a.q_scale(t, std::int64_t(j));
      else
        qs[std::size_t(j)] = 1.0f;
      w[std::size_t(j)] = a.weights(t, std::int64_t(j));
    }
    const std::int32_t req = a.row_request(t);
    for (std::int64_t p = 0; p < n; ++p) {
      const std::int64_t slot =
          std::int64_t(a.block_table(req, p / page_size)) * page_size + p % page_size;
      for (int i = 0; i < kIndexerDim; ++i)
        k[i] = fp8_e4m3::decode(indexer_k_fp8(a.k_cache, slot, i));
      scores(t, p) =
          indexer_score(q.data(), qs.data(), w.data(), heads, k, indexer_k_scale(a.k_cache, slot));
    }
  }
}

/// One indexer step on one rank (host reference): indexer_scores into the workspace, then the
/// exact distributed top-k (host::distributed_topk). Every rank of the group calls it with the
/// same T and num_valid_rows; all obtain the same `topk_indices`: per valid row the k best
/// positions of [0, row_bound) (score descending, position ascending; NaN scores as -inf), in
/// ascending order, -1 padded; padding rows all -1.
///
/// @param config       sizes the workspace: T <= max_tokens, every bound <= max_context_len,
///                     topk_indices (T, config.topk)
/// @param workspace    >= indexer_topk_workspace_bytes(config, own) bytes of host memory
template <class Comm, class Ownership, class QElem>
void indexer_topk(Comm& comm, const Ownership& own, const IndexerConfig& config,
                  const IndexerArgs<QElem>& a, TensorView<std::int32_t, 2> topk_indices,
                  cuda::std::span<std::byte> workspace, typename Comm::stream_type stream = {}) {
  static_assert(Communicator<Comm>, DCPATTN_COMMUNICATOR_MESSAGE);
  using dcpattn::detail::idx_str;
  indexer_can_implement(config).throw_if_failed("indexer_topk");
  const std::int64_t t = a.q.extent(0);
  DCPATTN_REQUIRE(t <= config.max_tokens, "q has " + idx_str(t) + " rows, more than " +
                                              "config.max_tokens (" + idx_str(config.max_tokens) +
                                              ")");
  DCPATTN_REQUIRE(topk_indices.extent(1) == config.topk,
                  "topk_indices has " + idx_str(topk_indices.extent(1)) +
                      " columns, config.topk is " + idx_str(config.topk));
  const auto layout = dcpattn::detail::indexer_topk_layout(config, own);
  DCPATTN_REQUIRE(workspace.size() >= layout.total, "workspace has " +
                                                        idx_str(std::int64_t(workspace.size())) +
                                                        " bytes, indexer_topk_workspace_bytes is " +
                                                        idx_str(std::int64_t(layout.total)));
  for (std::int64_t r = 0; r < a.num_valid_rows; ++r)
    DCPATTN_REQUIRE(a.row_bound(r) <= config.max_context_len,
                    "row_bound[" + idx_str(r) + "] = " + idx_str(a.row_bound(r)) +
                        " exceeds config.max_context_len (" + idx_str(config.max_context_len) +
                        ")");
  const std::int64_t columns = indexer_max_local_keys(config, own);
  auto scores = make_view(reinterpret_cast<float*>(workspace.data() + layout.scores), {t, columns});
  indexer_scores(own, comm.rank(), a, scores);
  distributed_topk(
      comm, own, make_view(static_cast<const float*>(scores.data_handle()), {t, columns}),
      a.row_bound, a.num_valid_rows, topk_indices, workspace.subspan(layout.topk), stream);
}

}  // namespace host

DCPATTN_NAMESPACE_END
