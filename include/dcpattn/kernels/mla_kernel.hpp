// SPDX-License-Identifier: Apache-2.0
// Attention kernel policies: dense paged and sparse (top-k) MLA decode, per cache format.
#pragma once

#include <concepts>
#include <cstdint>

#include <cuda/std/limits>

#include "dcpattn/config.hpp"
#include "dcpattn/core/lse.hpp"
#include "dcpattn/core/numeric.hpp"
#include "dcpattn/core/tensor.hpp"
#include "dcpattn/kernels/cache_layout.hpp"

DCPATTN_NAMESPACE_BEGIN

/// Runtime parameters of the MLA decode kernels. softmax_scale and num_valid_rows have no usable
/// default: left unset they are refused, so a forgotten field cannot silently zero a batch.
struct MlaDecodeParams {
  /// Multiplies q . k before the softmax (1/sqrt(192) for DeepSeek, times any YaRN factor).
  float softmax_scale = cuda::std::numeric_limits<float>::quiet_NaN();
  /// Tokens per page of the local paged cache; a positive multiple of `interleave`.
  int page_size = 64;
  /// I: local tokens per split block (the ownership's interleave). >= 1.
  int interleave = 1;
  /// S: local splits per row, a power of two >= 1 (V / N in deterministic mode).
  int num_splits = 1;
  /// Rows t >= num_valid_rows are padding (CUDA-graph batch padding): they get the neutral state
  /// and nothing of them is read. In [0, tokens].
  int num_valid_rows = -1;
};

/// Number of tokens of split j among the first `local_length` local positions.
constexpr DCPATTN_HOST_DEVICE std::int64_t mla_split_length(std::int64_t local_length, int j,
                                                            int num_splits,
                                                            int interleave) noexcept {
  const std::int64_t span = std::int64_t(num_splits) * interleave;
  const std::int64_t tail = local_length % span - std::int64_t(j) * interleave;
  const std::int64_t clamped = tail < 0 ? 0 : (tail > interleave ? interleave : tail);
  return (local_length / span) * interleave + clamped;
}
/// Local position of the k-th token (ascending) of split j.
constexpr DCPATTN_HOST_DEVICE std::int64_t mla_split_position(std::int64_t k, int j, int num_splits,
                                                              int interleave) noexcept {
  return ((k / interleave) * num_splits + j) * interleave + k % interleave;
}
/// Split of local position p.
constexpr DCPATTN_HOST_DEVICE int mla_split_of(std::int64_t p, int num_splits,
                                               int interleave) noexcept {
  return int((p / interleave) % num_splits);
}

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
