// SPDX-License-Identifier: Apache-2.0
// Attention kernel policies: dense paged and sparse (top-k) MLA decode, per cache format.
#pragma once

#include <concepts>
#include <cstdint>
#include <string>

#include <cuda/std/limits>

#include "dcpattn/config.hpp"
#include "dcpattn/core/lse.hpp"
#include "dcpattn/core/numeric.hpp"
#include "dcpattn/core/tensor.hpp"
#include "dcpattn/error.hpp"
#include "dcpattn/kernels/cache_layout.hpp"
#include "dcpattn/kernels/input_errors.hpp"

DCPATTN_NAMESPACE_BEGIN

/// Runtime parameters of the MLA decode kernels. softmax_scale and num_valid_rows have no usable
/// default: left unset they are refused, so a forgotten field cannot silently zero a batch.
struct MlaDecodeParams {
  /// Multiplies q . k before the softmax (1/sqrt(192) for DeepSeek, times any YaRN factor).
  float softmax_scale = cuda::std::numeric_limits<float>::quiet_NaN();
  /// Tokens per page of the local paged cache; a positive multiple of `interleave`.
  int page_size = 64;
  /// I: local tokens per split block; split j of a row takes its local positions p with
  /// (p / I) mod S == j. >= 1. Deterministic mode and the sparse kernel: the ownership's
  /// interleave (the contract). Fast mode, dense: any divisor of page_size; DcpAttention passes
  /// page_size, so that a split reads whole pages (the CUDA kernel then copies whole 64-token
  /// tiles with the tensor memory accelerator when pages are a multiple of 64 tokens).
  int interleave = 1;
  /// S: local splits per row, a power of two >= 1 (V / N in deterministic mode).
  int num_splits = 1;
  /// Rows t >= num_valid_rows are padding (CUDA-graph batch padding): they get the neutral state
  /// and nothing of them is read. In [0, tokens].
  int num_valid_rows = -1;
  /// Optional word in the kernels' memory (nullptr: none). The CUDA kernels cannot throw on
  /// data-dependent bad input without a host synchronization: they skip it (never reading or
  /// writing outside the views) and OR its input_error_* bit (input_errors.hpp) into this word;
  /// the caller zeroes the word before the call and reads it after
  /// (DcpAttention::check_input_errors). The host kernels throw instead and leave it alone.
  std::uint32_t* error_flags = nullptr;
  /// Fast mode's option (DcpAttention sets it with PartialDtype::bf16): the CUDA kernels of more
  /// than 16 heads on compute capability 9.x (the 64-head warpgroup kernels) then round each
  /// split's 512 values to bf16 in scratch (num_splits > 1; the lse stays fp32), and the merge
  /// reads half the bytes. The merged lse is the fp32-state call's bit for bit; o is within bf16
  /// rounding of it, not bitwise. Elsewhere (16 heads or fewer, the mma.sync kernel, the host
  /// kernels) it changes nothing; at 16 heads the bf16 writes were slower (docs/performance.md,
  /// run 21). H200, dense bf16 1 x 32K, 128 heads: 39.2 -> 36.2 us.
  bool bf16_split_states = false;
  /// Sparse, fast mode (DcpAttention sets it there): split j of a row takes the entries of the
  /// row's top-k list in mla_list_range(K, j, S) (the j-th of S runs of ceil(K / S) entries),
  /// instead of the positions p with (p / I) mod S == j. Each split then scans K / S entries of
  /// the list instead of all K: at small batch the scan, not the products, bounded a split
  /// (H200, sparse bf16 top-2048, 128 heads, batch 1: docs/performance.md, run 25). The row's
  /// state is the same up to rounding. Not for deterministic mode, where split j is a virtual
  /// shard (the numerical contract). The dense kernels ignore it.
  bool split_topk_list = false;
};

/// Entries [begin, end) of a top-k list of `k` entries that split j of `num_splits` scans under
/// MlaDecodeParams::split_topk_list: runs of ceil(k / S), the last ones shorter or empty.
struct MlaListRange {
  std::int64_t begin;
  std::int64_t end;
};
/// The length of those runs, ceil(k / S): list entry e belongs to split e / mla_list_run(k, S).
constexpr DCPATTN_HOST_DEVICE std::int64_t mla_list_run(std::int64_t k, int num_splits) noexcept {
  return (k + num_splits - 1) / num_splits;
}
constexpr DCPATTN_HOST_DEVICE MlaListRange mla_list_range(std::int64_t k, int j,
                                                          int num_splits) noexcept {
  const std::int64_t chunk = mla_list_run(k, num_splits);
  const std::int64_t begin = std::int64_t(j) * chunk < k ? std::int64_t(j) * chunk : k;
  return {begin, begin + chunk < k ? begin + chunk : k};
}

/// Number of tokens of split j among the first `local_length` local positions.
constexpr DCPATTN_HOST_DEVICE std::int64_t mla_split_length(std::int64_t local_length, int j,
                                                            int num_splits,
                                                            int interleave) noexcept {
  const std::int64_t span = std::int64_t(num_splits) * interleave;
  const std::int64_t tail = local_length % span - std::int64_t(j) * interleave;
  const std::int64_t clamped = tail < 0 ? 0 : (tail > interleave ? interleave : tail);
  return (local_length / span) * interleave + clamped;
}
/// Local position of the k-th token (ascending) of split j, in k's integer type (std::int64_t;
/// the CUDA kernels use std::uint32_t where every local position is below 2^31).
template <class Index>
constexpr DCPATTN_HOST_DEVICE Index mla_split_position(Index k, int j, int num_splits,
                                                       int interleave) noexcept {
  const Index il = Index(interleave);
  return ((k / il) * Index(num_splits) + Index(j)) * il + k % il;
}
/// Split of local position p.
constexpr DCPATTN_HOST_DEVICE int mla_split_of(std::int64_t p, int num_splits,
                                               int interleave) noexcept {
  return int((p / interleave) % num_splits);
}

namespace detail {
/// The argument checks every MLA decode implementation shares; they read only extents and
/// parameters (never device data), so the host and the CUDA launchers both run them before any
/// work. Throws dcpattn::Error naming the parameter.
template <class QView, class CacheView>
void validate_mla_extents(const QView& q, const CacheView& cache,
                          TensorView<const std::int32_t, 1> row_request, const MlaDecodeParams& p,
                          TensorView<float, 3> o, TensorView<float, 2> lse) {
  static_assert(QView::rank() == 3, "dcpattn: q must be a rank-3 view (tokens, heads, 576)");
  validate_mla_cache(cache, "cache");
  const std::int64_t t = q.extent(0);
  const std::int64_t h = q.extent(1);
  auto s = [](std::int64_t v) { return std::to_string(v); };
  DCPATTN_REQUIRE(q.extent(2) == kMlaQkDim,
                  "q must have head dim " + s(kMlaQkDim) + ", got " + s(q.extent(2)));
  DCPATTN_REQUIRE(h >= 1, "q must have at least one head, got " + s(h));
  DCPATTN_REQUIRE(o.extent(0) == t && o.extent(1) == h && o.extent(2) == kMlaVDim,
                  "o must be (" + s(t) + ", " + s(h) + ", " + s(kMlaVDim) + ") like q, got (" +
                      s(o.extent(0)) + ", " + s(o.extent(1)) + ", " + s(o.extent(2)) + ")");
  DCPATTN_REQUIRE(lse.extent(0) == t && lse.extent(1) == h,
                  "lse must be (" + s(t) + ", " + s(h) + ") like q, got (" + s(lse.extent(0)) +
                      ", " + s(lse.extent(1)) + ")");
  DCPATTN_REQUIRE(p.num_valid_rows >= 0 && p.num_valid_rows <= t,
                  "num_valid_rows (" + s(p.num_valid_rows) + ") must be set, in [0, tokens = " +
                      s(t) + "]");
  DCPATTN_REQUIRE(row_request.extent(0) == t, "row_request has " + s(row_request.extent(0)) +
                                                  " rows, but q has " + s(t) + " tokens");
  DCPATTN_REQUIRE(p.interleave >= 1, "interleave (" + s(p.interleave) + ") must be >= 1");
  DCPATTN_REQUIRE(p.page_size >= 1 && p.page_size % p.interleave == 0,
                  "page_size (" + s(p.page_size) + ") must be a positive multiple of interleave (" +
                      s(p.interleave) + ")");
  DCPATTN_REQUIRE(is_power_of_two(p.num_splits),
                  "num_splits (" + s(p.num_splits) + ") must be a power of two >= 1");
  DCPATTN_REQUIRE(p.softmax_scale - p.softmax_scale == 0.0f,  // finite
                  "softmax_scale must be set to a finite value, got " +
                      std::to_string(p.softmax_scale));
}

/// The extra checks of sparse decode (extents and the ownership; no data reads).
template <class QView, class Ownership>
void validate_mla_sparse_extents(const QView& q, TensorView<const std::int32_t, 2> topk,
                                 TensorView<const std::int64_t, 1> row_bound, const Ownership& own,
                                 int rank, const MlaDecodeParams& p) {
  auto s = [](std::int64_t v) { return std::to_string(v); };
  DCPATTN_REQUIRE(rank >= 0 && rank < own.group_size(),
                  "rank (" + s(rank) + ") must be in [0, group_size = " + s(own.group_size()) + ")");
  if constexpr (requires { own.interleave(); }) {
    DCPATTN_REQUIRE(int(own.interleave()) == p.interleave,
                    "interleave (" + s(p.interleave) + ") must equal the ownership's interleave (" +
                        s(own.interleave()) + ")");
  }
  DCPATTN_REQUIRE(topk.extent(0) == q.extent(0), "topk_indices has " + s(topk.extent(0)) +
                                                     " rows, but q has " + s(q.extent(0)) +
                                                     " tokens");
  DCPATTN_REQUIRE(topk.extent(1) <= (std::int64_t(1) << 30),
                  "topk_indices has " + s(topk.extent(1)) + " entries a row; at most 2^30");
  DCPATTN_REQUIRE(row_bound.extent(0) == q.extent(0), "row_bound has " + s(row_bound.extent(0)) +
                                                          " rows, but q has " + s(q.extent(0)) +
                                                          " tokens");
}
}  // namespace detail

/// Requirements on an attention kernel policy K:
///   - K::is_sparse        bool: reads a top-k index list per row instead of the causal prefix
///   - K::cache_format     CacheFormat
///   - typename K::cache_view, typename K::lse_base (lse_base_e or lse_base_2 of what it returns)
/// The execution space provides the implementation (mla_decode_dense / mla_decode_sparse), so a
/// kernel policy is a stateless tag.
template <class K>
concept AttentionKernel = std::is_empty_v<K> && requires {
  { K::is_sparse } -> std::convertible_to<bool>;
  { K::cache_format } -> std::convertible_to<CacheFormat>;
  typename K::cache_view;
  typename K::lse_base;
};

#define DCPATTN_ATTENTION_KERNEL_MESSAGE                                                     \
  "dcpattn: the kernel policy does not satisfy AttentionKernel: it must be an empty type with " \
  "is_sparse, cache_format, cache_view and lse_base (see dcpattn/kernels/mla_kernel.hpp)"

/// Dense paged MLA decode: each row attends to every token of its causal prefix this rank owns.
template <CacheFormat F>
struct DenseMla {
  static constexpr bool is_sparse = false;
  static constexpr CacheFormat cache_format = F;
  using cache_view = mla_cache_view_t<F>;  // (num_slots, 576) bf16 or (num_slots, 656) bytes
  using lse_base = lse_base_e;
};

/// Sparse (DSA top-k) MLA decode: each row attends to the listed global positions this rank owns.
template <CacheFormat F>
struct SparseMla {
  static constexpr bool is_sparse = true;
  static constexpr CacheFormat cache_format = F;
  using cache_view = mla_cache_view_t<F>;  // (num_slots, 576) bf16 or (num_slots, 656) bytes
  using lse_base = lse_base_e;
};

static_assert(AttentionKernel<DenseMla<CacheFormat::bf16>>, DCPATTN_ATTENTION_KERNEL_MESSAGE);
static_assert(AttentionKernel<DenseMla<CacheFormat::fp8_ds_mla>>, DCPATTN_ATTENTION_KERNEL_MESSAGE);
static_assert(AttentionKernel<SparseMla<CacheFormat::bf16>>, DCPATTN_ATTENTION_KERNEL_MESSAGE);
static_assert(AttentionKernel<SparseMla<CacheFormat::fp8_ds_mla>>, DCPATTN_ATTENTION_KERNEL_MESSAGE);

DCPATTN_NAMESPACE_END
