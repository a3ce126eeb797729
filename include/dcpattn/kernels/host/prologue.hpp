// SPDX-License-Identifier: Apache-2.0
// Host reference of the fused MLA prologue: query RMSNorm, KV RMSNorm + RoPE + cache write,
// indexer-key LayerNorm + RoPE + fp8 cache write, and the top-k buffer reset.
//
// The DCP rule it exists for (DESIGN.md, "Fused prologue"): the query RMSNorm runs for EVERY row,
// also on a rank that stores none of the batch's tokens; only the cache writes are skipped where
// slot_mapping[t] < 0. (Returning early on a negative slot before normalizing the query made
// non-owner ranks attend with unnormalized queries.)
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "dcpattn/config.hpp"
#include "dcpattn/core/fp8_cache.hpp"
#include "dcpattn/core/norm.hpp"
#include "dcpattn/core/numeric.hpp"
#include "dcpattn/core/rope.hpp"
#include "dcpattn/core/tensor.hpp"
#include "dcpattn/error.hpp"
#include "dcpattn/kernels/cache_layout.hpp"

DCPATTN_NAMESPACE_BEGIN

/// Query LoRA rank of the reference models (DeepSeek-V3.2, GLM-5): the width of q_c.
inline constexpr int kMlaQLoraRank = 1536;
/// Width of one indexer key.
inline constexpr int kIndexerHeadDim = IndexerKCacheLayout::head_dim;  // 128

/// Arguments of the fused prologue of one batch of T rows (tokens).
///
/// @tparam KvCacheView mla_cache_out_view_t<CacheFormat::bf16> (num_slots, 576) or
///                     mla_cache_out_view_t<CacheFormat::fp8_ds_mla> (num_slots, 656)
/// Optional parts are disabled by leaving their view default-constructed (null data handle).
template <class KvCacheView>
struct PrologueArgs {
  /// (T, 1536) compressed queries (output of q_a_proj).
  TensorView<const bfloat16, 2> q_c;
  /// (T, 1536) RMSNorm(q_c) * q_norm_weight, rounded to bf16; may alias q_c.
  TensorView<bfloat16, 2> q_c_out;
  /// (1536,) query RMSNorm weight.
  TensorView<const bfloat16, 1> q_norm_weight;
  /// (T, 512) compressed KV latent (before its RMSNorm).
  TensorView<const bfloat16, 2> kv_c;
  /// (512,) KV RMSNorm weight.
  TensorView<const bfloat16, 1> kv_norm_weight;
  /// (T, 64) key RoPE part, not yet rotated.
  TensorView<const bfloat16, 2> k_pe;
  /// (T,) position of each row, the row of cos_sin_cache used for its RoPE.
  TensorView<const std::int64_t, 1> positions;
  /// (max_position, 64): 32 cosines then 32 sines per position (pair i uses column i and 32 + i).
  TensorView<const float, 2> cos_sin_cache;
  /// Pair layout of the KV RoPE. [optional] (default: interleaved, DeepSeek MLA)
  RopeStyle kv_rope_style = RopeStyle::interleaved;
  /// (T,) cache slot of each row on this rank; -1 when another rank stores the token.
  TensorView<const std::int64_t, 1> slot_mapping;
  /// The MLA cache written at slot_mapping[t] >= 0: (normalized latent, rotated k_pe).
  KvCacheView kv_cache;

  /// [optional] (T, 128) indexer keys (before their LayerNorm); null disables the indexer part.
  TensorView<const bfloat16, 2> index_k;
  /// (128,) indexer-key LayerNorm weight (needed with index_k).
  TensorView<const bfloat16, 1> index_k_norm_weight;
  /// [optional] (128,) indexer-key LayerNorm bias (default: none).
  TensorView<const bfloat16, 1> index_k_norm_bias;
  /// Pair layout of the indexer RoPE, applied to dims [0, 64). [optional] (default: neox)
  RopeStyle index_rope_style = RopeStyle::neox;
  /// (num_pages, page_size * 132) paged fp8 indexer-key cache (IndexerKCacheLayout), same slot
  /// numbering as kv_cache (needed with index_k).
  TensorView<std::uint8_t, 2> index_k_cache;

  /// [optional] (T, k) top-k buffer of the sparse attention; every row is reset to -1.
  TensorView<std::int32_t, 2> topk_indices;

  /// RMSNorm epsilon (query and KV). [optional] (default: 1e-6)
  float rms_norm_eps = 1e-6f;
  /// Indexer LayerNorm epsilon. [optional] (default: 1e-6)
  float layer_norm_eps = 1e-6f;

  /// [optional] CUDA prologue: a word in device memory (nullptr: none) into which the kernel ORs
  /// input_error_slot / input_error_position (input_errors.hpp) for rows it skipped because of a
  /// bad value: a slot_mapping entry < -1 or >= the cache's slots or without an indexer page, or
  /// a position outside the cos/sin table on a row with a slot. Such a row writes nothing (it is
  /// treated as another rank's). The caller zeroes the word before the launch and reads it
  /// after. Duplicate slots are not detected on the GPU. The host prologue throws instead and
  /// leaves the word alone.
  std::uint32_t* error_flags = nullptr;
};

namespace host {
namespace detail {

inline std::string shape_str(std::int64_t a, std::int64_t b) {
  std::string s(1, '(');  // appended, not "(" + ...: GCC 12 -Wrestrict false positive
  s += std::to_string(a);
  s += ", ";
  s += std::to_string(b);
  s += ')';
  return s;
}

template <class V>
void require_2d(const V& v, std::int64_t rows, std::int64_t cols, const char* name) {
  DCPATTN_REQUIRE(v.extent(0) == rows && v.extent(1) == cols,
                  std::string(name) + " must be " + shape_str(rows, cols) + ", got " +
                      shape_str(v.extent(0), v.extent(1)));
}
template <class V>
void require_1d(const V& v, std::int64_t n, const char* name) {
  DCPATTN_REQUIRE(v.extent(0) == n, std::string(name) + " must have " + std::to_string(n) +
                                        " entries, got " + std::to_string(v.extent(0)));
}

/// The checks that read only extents (no tensor data): shared with the CUDA launcher.
template <class KvCacheView>
void validate_prologue_extents(const PrologueArgs<KvCacheView>& a) {
  const std::int64_t T = a.q_c.extent(0);
  require_2d(a.q_c, T, kMlaQLoraRank, "q_c");
  require_2d(a.q_c_out, T, kMlaQLoraRank, "q_c_out");
  require_1d(a.q_norm_weight, kMlaQLoraRank, "q_norm_weight");
  require_2d(a.kv_c, T, kMlaLatentDim, "kv_c");
  require_1d(a.kv_norm_weight, kMlaLatentDim, "kv_norm_weight");
  require_2d(a.k_pe, T, kMlaRopeDim, "k_pe");
  require_1d(a.positions, T, "positions");
  require_1d(a.slot_mapping, T, "slot_mapping");
  DCPATTN_REQUIRE(a.cos_sin_cache.extent(1) == kMlaRopeDim,
                  "cos_sin_cache must have " + std::to_string(kMlaRopeDim) +
                      " columns (32 cos, 32 sin), got " +
                      std::to_string(a.cos_sin_cache.extent(1)));
  validate_mla_cache(a.kv_cache, "kv_cache");
  DCPATTN_REQUIRE(a.rms_norm_eps >= 0.0f, "rms_norm_eps must be >= 0");
  DCPATTN_REQUIRE(a.layer_norm_eps >= 0.0f, "layer_norm_eps must be >= 0");

  const bool indexer = a.index_k.data_handle() != nullptr;
  if (indexer) {
    require_2d(a.index_k, T, kIndexerHeadDim, "index_k");
    require_1d(a.index_k_norm_weight, kIndexerHeadDim, "index_k_norm_weight");
    DCPATTN_REQUIRE(a.index_k_norm_weight.data_handle() != nullptr,
                    "index_k_norm_weight is required with index_k");
    if (a.index_k_norm_bias.data_handle() != nullptr)
      require_1d(a.index_k_norm_bias, kIndexerHeadDim, "index_k_norm_bias");
    DCPATTN_REQUIRE(a.index_k_cache.data_handle() != nullptr,
                    "index_k_cache is required with index_k");
    DCPATTN_REQUIRE(a.index_k_cache.extent(1) > 0 &&
                        a.index_k_cache.extent(1) % IndexerKCacheLayout::bytes_per_token == 0,
                    "index_k_cache must have page_size * " +
                        std::to_string(IndexerKCacheLayout::bytes_per_token) +
                        " bytes per page, got " + std::to_string(a.index_k_cache.extent(1)));
  }
  if (a.topk_indices.data_handle() != nullptr)
    DCPATTN_REQUIRE(a.topk_indices.extent(0) == T, "topk_indices must have " + std::to_string(T) +
                                                       " rows, got " +
                                                       std::to_string(a.topk_indices.extent(0)));
}

template <class KvCacheView>
void validate_prologue(const PrologueArgs<KvCacheView>& a) {
  validate_prologue_extents(a);
  const std::int64_t T = a.q_c.extent(0);
  const bool indexer = a.index_k.data_handle() != nullptr;
  const std::int64_t index_page_size =
      indexer ? IndexerKCacheLayout::page_size(a.index_k_cache.extent(1)) : 0;
  const std::int64_t num_slots = a.kv_cache.extent(0);
  for (std::int64_t t = 0; t < T; ++t) {
    const std::int64_t slot = a.slot_mapping(t);
    if (slot == -1) continue;
    DCPATTN_REQUIRE(slot >= 0 && slot < num_slots,
                    "slot_mapping[" + std::to_string(t) + "] = " + std::to_string(slot) +
                        " is outside [-1, num_slots of kv_cache = " + std::to_string(num_slots) +
                        ")");
    if (indexer) {
      DCPATTN_REQUIRE(slot / index_page_size < a.index_k_cache.extent(0),
                      "slot_mapping[" + std::to_string(t) + "] = " + std::to_string(slot) +
                          " is beyond index_k_cache (" + std::to_string(a.index_k_cache.extent(0)) +
                          " pages of " + std::to_string(index_page_size) + " tokens)");
    }
    const std::int64_t pos = a.positions(t);
    DCPATTN_REQUIRE(pos >= 0 && pos < a.cos_sin_cache.extent(0),
                    "positions[" + std::to_string(t) + "] = " + std::to_string(pos) +
                        " is outside cos_sin_cache (max_position = " +
                        std::to_string(a.cos_sin_cache.extent(0)) + ")");
  }
  // Two rows writing one slot would leave the entry to whichever runs last (on the GPU: a race).
  std::vector<std::pair<std::int64_t, std::int64_t>> written;  // (slot, row)
  for (std::int64_t t = 0; t < T; ++t)
    if (a.slot_mapping(t) >= 0) written.emplace_back(a.slot_mapping(t), t);
  std::sort(written.begin(), written.end());
  for (std::size_t i = 1; i < written.size(); ++i)
    DCPATTN_REQUIRE(written[i].first != written[i - 1].first,
                    "slot_mapping[" + std::to_string(written[i - 1].second) + "] and slot_mapping[" +
                        std::to_string(written[i].second) + "] are both " +
                        std::to_string(written[i].first) + ": each slot is written by one row");
}

/// Row `pos` of the cos/sin cache as two contiguous halves.
inline void load_cos_sin(TensorView<const float, 2> cache, std::int64_t pos, float* cos_row,
                         float* sin_row) {
  constexpr int half = kMlaRopeDim / 2;
  for (int i = 0; i < half; ++i) {
    cos_row[i] = cache(pos, std::int64_t(i));
    sin_row[i] = cache(pos, std::int64_t(half + i));
  }
}

}  // namespace detail

/// Fused prologue of one batch (host reference). Per row t:
///   - q_c_out[t] = RMSNorm(q_c[t]) * q_norm_weight, for EVERY row (slot or not);
///   - where slot_mapping[t] >= 0: latent = bf16(RMSNorm(kv_c[t]) * kv_norm_weight),
///     rope = bf16(RoPE(k_pe[t], positions[t], kv_rope_style)), stored at that slot of kv_cache
///     (bf16: the 576 values; fp8_ds_mla: DsMlaFp8Entry::encode of the bf16 latent and rope);
///   - where slot_mapping[t] >= 0 and the indexer is enabled: key = bf16(LayerNorm(index_k[t]))
///     with dims [0, 64) rotated (index_rope_style) and rounded to bf16, quantized to 128 e4m3
///     values with one fp32 scale (amax / 448) at that slot of index_k_cache;
///   - topk_indices[t, :] = -1 when the buffer is given.
/// Norms accumulate in fp32; intermediates are rounded to bf16 where the model holds bf16 tensors.
/// Slots of other rows are never touched. Throws dcpattn::Error naming the parameter (extents,
/// a slot_mapping entry outside [-1, num_slots) or beyond index_k_cache, a position outside
/// cos_sin_cache) before writing anything.
template <class KvCacheView>
void fused_prologue(const PrologueArgs<KvCacheView>& a) {
  detail::validate_prologue(a);
  constexpr CacheFormat format = mla_cache_format_v<KvCacheView>;
  constexpr int half = kMlaRopeDim / 2;
  const std::int64_t T = a.q_c.extent(0);
  const bool indexer = a.index_k.data_handle() != nullptr;
  const bool has_bias = a.index_k_norm_bias.data_handle() != nullptr;

  float qbuf[kMlaQLoraRank], qw[kMlaQLoraRank];
  float kv[kMlaLatentDim], kvw[kMlaLatentDim];
  bfloat16 latent[kMlaLatentDim], rope[kMlaRopeDim];
  float ik[kIndexerHeadDim], ikw[kIndexerHeadDim], ikb[kIndexerHeadDim];
  bfloat16 ikey[kIndexerHeadDim];
  float cos_row[half], sin_row[half];
  for (int i = 0; i < kMlaQLoraRank; ++i) qw[i] = to_float(a.q_norm_weight(std::int64_t(i)));
  for (int i = 0; i < kMlaLatentDim; ++i) kvw[i] = to_float(a.kv_norm_weight(std::int64_t(i)));
  if (indexer) {
    for (int i = 0; i < kIndexerHeadDim; ++i) {
      ikw[i] = to_float(a.index_k_norm_weight(std::int64_t(i)));
      ikb[i] = has_bias ? to_float(a.index_k_norm_bias(std::int64_t(i))) : 0.0f;
    }
  }

  for (std::int64_t t = 0; t < T; ++t) {
    // Query RMSNorm first and unconditionally (read fully before writing: q_c_out may alias q_c).
    for (int i = 0; i < kMlaQLoraRank; ++i) qbuf[i] = to_float(a.q_c(t, std::int64_t(i)));
    rms_norm_row(qbuf, qw, qbuf, kMlaQLoraRank, a.rms_norm_eps);
    for (int i = 0; i < kMlaQLoraRank; ++i)
      a.q_c_out(t, std::int64_t(i)) = bfloat16::from_float(qbuf[i]);

    if (a.topk_indices.data_handle() != nullptr)
      for (std::int64_t k = 0; k < a.topk_indices.extent(1); ++k) a.topk_indices(t, k) = -1;

    const std::int64_t slot = a.slot_mapping(t);
    if (slot < 0) continue;  // another rank stores this token; only the cache writes are skipped

    detail::load_cos_sin(a.cos_sin_cache, a.positions(t), cos_row, sin_row);
    for (int i = 0; i < kMlaLatentDim; ++i) kv[i] = to_float(a.kv_c(t, std::int64_t(i)));
    rms_norm_row(kv, kvw, latent, kMlaLatentDim, a.rms_norm_eps);
    for (int i = 0; i < kMlaRopeDim; ++i) rope[i] = a.k_pe(t, std::int64_t(i));
    rope_row(rope, cos_row, sin_row, kMlaRopeDim, a.kv_rope_style);
    if constexpr (format == CacheFormat::bf16) {
      for (int i = 0; i < kMlaLatentDim; ++i) a.kv_cache(slot, std::int64_t(i)) = latent[i];
      for (int i = 0; i < kMlaRopeDim; ++i)
        a.kv_cache(slot, std::int64_t(kMlaLatentDim + i)) = rope[i];
    } else {
      DsMlaFp8Entry::encode(latent, rope, &a.kv_cache(slot, std::int64_t(0)));
    }

    if (indexer) {
      for (int i = 0; i < kIndexerHeadDim; ++i) ik[i] = to_float(a.index_k(t, std::int64_t(i)));
      layer_norm_row(ik, ikw, has_bias ? ikb : nullptr, ikey, kIndexerHeadDim, a.layer_norm_eps);
      rope_row(ikey, cos_row, sin_row, kMlaRopeDim, a.index_rope_style);
      indexer_k_store(a.index_k_cache, slot, ikey);
    }
  }
}

}  // namespace host

DCPATTN_NAMESPACE_END
