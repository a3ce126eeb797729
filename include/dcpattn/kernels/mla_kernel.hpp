// SPDX-License-Identifier: Apache-2.0
// Attention kernel policies: dense paged and sparse (top-k) MLA decode, per cache format.
#pragma once

#include <concepts>
#include <cstdint>

#include "dcpattn/config.hpp"
#include "dcpattn/core/lse.hpp"
#include "dcpattn/core/numeric.hpp"
#include "dcpattn/core/tensor.hpp"
#include "dcpattn/kernels/cache_layout.hpp"

DCPATTN_NAMESPACE_BEGIN

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
