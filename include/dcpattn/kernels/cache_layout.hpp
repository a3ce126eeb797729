// SPDX-License-Identifier: Apache-2.0
// Cache formats shared by the host reference kernels and the CUDA kernels: the MLA KV cache (bf16
// or the 656-byte fp8 "ds_mla" entry) and the paged fp8 indexer-key cache of sparse (DSA)
// attention.
// Everything here is host-compilable; the per-element accessors are host+device.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>

#include <cuda/std/bit>
#include <cuda/std/mdspan>

#include "dcpattn/config.hpp"
#include "dcpattn/core/fp8_cache.hpp"
#include "dcpattn/core/numeric.hpp"
#include "dcpattn/core/tensor.hpp"
#include "dcpattn/error.hpp"

DCPATTN_NAMESPACE_BEGIN

/// MLA head dimensions (DeepSeek-V2/V3/V3.2, GLM-5): a key is the normalized latent (512) followed
/// by the rotated RoPE part (64); the value is the latent alone.
inline constexpr int kMlaLatentDim = 512;
inline constexpr int kMlaRopeDim = 64;
inline constexpr int kMlaQkDim = kMlaLatentDim + kMlaRopeDim;  // 576
inline constexpr int kMlaVDim = kMlaLatentDim;                 // 512

/// Storage format of the MLA KV cache.
enum class CacheFormat {
  bf16,        ///< (num_slots, 576) bfloat16: [0, 512) normalized latent, [512, 576) rotated RoPE
  fp8_ds_mla,  ///< (num_slots, 656) bytes: one DsMlaFp8Entry per slot
};

/// Width of one cache row (slot) in elements of the format's storage type: 576 bf16 or 656 bytes.
constexpr DCPATTN_HOST_DEVICE int mla_cache_row_width(CacheFormat f) noexcept {
  return f == CacheFormat::bf16 ? kMlaQkDim : DsMlaFp8Entry::bytes;
}

/// Storage element of a cache format: bfloat16 or std::uint8_t.
template <CacheFormat F>
using mla_cache_element_t = std::conditional_t<F == CacheFormat::bf16, bfloat16, std::uint8_t>;

/// Read-only view of an MLA cache, what the attention kernels take:
///   bf16:       TensorView<const bfloat16, 2>     (num_slots, 576)
///   fp8_ds_mla: TensorView<const std::uint8_t, 2> (num_slots, 656)
template <CacheFormat F>
using mla_cache_view_t = TensorView<const mla_cache_element_t<F>, 2>;
/// Writable view of an MLA cache, what the fused prologue takes (same shapes).
template <CacheFormat F>
using mla_cache_out_view_t = TensorView<mla_cache_element_t<F>, 2>;

namespace detail {
template <class>
inline constexpr bool dependent_false_v = false;
}  // namespace detail

/// Maps a cache view type to its CacheFormat. Specialized for rank-2 mdspans of (const) bfloat16
/// and (const) std::uint8_t with any layout; any other type fails to compile with a message.
template <class View>
struct MlaCacheTraits {
  static_assert(
      detail::dependent_false_v<View>,
      "dcpattn: unsupported MLA cache view. Use TensorView<const bfloat16, 2> "
      "(num_slots, 576) for CacheFormat::bf16 or TensorView<const std::uint8_t, 2> "
      "(num_slots, 656) for CacheFormat::fp8_ds_mla (see dcpattn/kernels/cache_layout.hpp)");
};
template <class T, class E, class L, class A>
requires(E::rank() == 2 &&
         std::is_same_v<std::remove_const_t<T>,
                        bfloat16>) struct MlaCacheTraits<cuda::std::mdspan<T, E, L, A>> {
  static constexpr CacheFormat format = CacheFormat::bf16;
};
template <class T, class E, class L, class A>
requires(E::rank() == 2 &&
         std::is_same_v<std::remove_const_t<T>,
                        std::uint8_t>) struct MlaCacheTraits<cuda::std::mdspan<T, E, L, A>> {
  static constexpr CacheFormat format = CacheFormat::fp8_ds_mla;
};

/// The CacheFormat of a cache view type.
template <class View>
inline constexpr CacheFormat mla_cache_format_v = MlaCacheTraits<View>::format;

/// Key dim i (0 <= i < 576) of the token stored at `slot` of a bf16 MLA cache, as float.
template <class T, class E, class L, class A>
requires std::is_same_v<std::remove_const_t<T>, bfloat16> DCPATTN_HOST_DEVICE float mla_key(
    const cuda::std::mdspan<T, E, L, A>& cache, std::int64_t slot, int i) noexcept {
  return cache(slot, std::int64_t(i)).to_float();
}
/// Key dim i (0 <= i < 576) of the token stored at `slot` of an fp8 ds_mla cache: the dequantized
/// latent for i < 512, the bf16 RoPE value after. The entry must be contiguous (stride(1) == 1).
template <class T, class E, class L, class A>
requires std::is_same_v<std::remove_const_t<T>, std::uint8_t> DCPATTN_HOST_DEVICE float mla_key(
    const cuda::std::mdspan<T, E, L, A>& cache, std::int64_t slot, int i) noexcept {
  return DsMlaFp8Entry::key(&cache(slot, std::int64_t(0)), i);
}
/// Value dim i (0 <= i < 512) of the token at `slot`: the latent, i.e. key dim i.
template <class View>
DCPATTN_HOST_DEVICE float mla_value(const View& cache, std::int64_t slot, int i) noexcept {
  return mla_key(cache, slot, i);
}

/// Checks that `cache` has the row width of its format (and, for fp8, contiguous entries).
/// Throws dcpattn::Error naming `name` otherwise.
template <class View>
void validate_mla_cache(const View& cache, const char* name) {
  constexpr CacheFormat f = mla_cache_format_v<View>;
  const int width = mla_cache_row_width(f);
  DCPATTN_REQUIRE(cache.extent(1) == width,
                  std::string(name) + " must have " + std::to_string(width) +
                      " elements per slot for its format, got " + std::to_string(cache.extent(1)));
  if constexpr (f == CacheFormat::fp8_ds_mla) {
    DCPATTN_REQUIRE(cache.extent(0) == 0 || cache.stride(1) == 1,
                    std::string(name) +
                        " (fp8_ds_mla) must store each 656-byte entry contiguously "
                        "(stride(1) == 1), got stride " +
                        std::to_string(cache.stride(1)));
  }
}

/// Paged fp8 cache of the DSA indexer keys (one 128-dim key per token), as a byte tensor
/// TensorView<std::uint8_t, 2> (num_pages, page_size * 132). Inside a page (one row):
///   bytes [0, page_size * 128)                page_size keys of 128 e4m3 values, slot-major
///                                             (in-page slot s at bytes [s * 128, s * 128 + 128))
///   bytes [page_size * 128, page_size * 132)  page_size fp32 scales (little-endian), one per
///                                             token, i.e. one per 128 values
/// Slot `slot` lives in page slot / page_size at in-page slot slot % page_size, the same slot
/// numbering as the MLA cache (one slot_mapping serves both). A dequantized value is
/// e4m3(byte) * scale, the scale being amax / 448 of the quantized key (fp8_group_scale).
struct IndexerKCacheLayout {
  static constexpr int head_dim = 128;
  static constexpr int bytes_per_token = head_dim + 4;  // 132

  /// Tokens per page of a cache whose pages are `page_bytes` wide (page_bytes / 132).
  static constexpr DCPATTN_HOST_DEVICE std::int64_t page_size(std::int64_t page_bytes) noexcept {
    return page_bytes / bytes_per_token;
  }
  /// Byte offset within a page of value i of in-page slot s.
  static constexpr DCPATTN_HOST_DEVICE std::int64_t value_offset(std::int64_t s, int i) noexcept {
    return s * head_dim + i;
  }
  /// Byte offset within a page of the fp32 scale of in-page slot s, for a page of `page_size`.
  static constexpr DCPATTN_HOST_DEVICE std::int64_t scale_offset(std::int64_t page_size,
                                                                 std::int64_t s) noexcept {
    return page_size * head_dim + s * 4;
  }
};

namespace detail {
template <class View>
DCPATTN_HOST_DEVICE std::int64_t indexer_page_size(const View& cache) noexcept {
  return IndexerKCacheLayout::page_size(cache.extent(1));
}
}  // namespace detail

/// Raw e4m3 byte of value i (0 <= i < 128) of the indexer key at `slot`.
template <class View>
DCPATTN_HOST_DEVICE std::uint8_t indexer_k_fp8(const View& cache, std::int64_t slot,
                                               int i) noexcept {
  const std::int64_t b = detail::indexer_page_size(cache);
  return cache(slot / b, IndexerKCacheLayout::value_offset(slot % b, i));
}
/// fp32 scale of the indexer key at `slot`.
template <class View>
DCPATTN_HOST_DEVICE float indexer_k_scale(const View& cache, std::int64_t slot) noexcept {
  const std::int64_t b = detail::indexer_page_size(cache);
  const std::int64_t page = slot / b;
  const std::int64_t off = IndexerKCacheLayout::scale_offset(b, slot % b);
  std::uint32_t u = 0;
  for (int k = 0; k < 4; ++k) u |= std::uint32_t(cache(page, off + k)) << (8 * k);
  return cuda::std::bit_cast<float>(u);
}
/// Dequantized value i (0 <= i < 128) of the indexer key at `slot`.
template <class View>
DCPATTN_HOST_DEVICE float indexer_k_value(const View& cache, std::int64_t slot, int i) noexcept {
  return fp8_e4m3::decode(indexer_k_fp8(cache, slot, i)) * indexer_k_scale(cache, slot);
}
/// Quantizes one 128-dim key (float or bfloat16, contiguous) into `slot` of a writable indexer
/// cache: 128 e4m3 values and one fp32 scale. Returns the scale.
template <class View, class T>
DCPATTN_HOST_DEVICE float indexer_k_store(const View& cache, std::int64_t slot,
                                          const T* key) noexcept {
  const std::int64_t b = detail::indexer_page_size(cache);
  const std::int64_t page = slot / b;
  const std::int64_t s = slot % b;
  std::uint8_t q[IndexerKCacheLayout::head_dim];
  const float scale = quantize_fp8_group(key, IndexerKCacheLayout::head_dim, q);
  for (int i = 0; i < IndexerKCacheLayout::head_dim; ++i)
    cache(page, IndexerKCacheLayout::value_offset(s, i)) = q[i];
  const std::uint32_t u = cuda::std::bit_cast<std::uint32_t>(scale);
  const std::int64_t off = IndexerKCacheLayout::scale_offset(b, s);
  for (int k = 0; k < 4; ++k) cache(page, off + k) = std::uint8_t(u >> (8 * k));
  return scale;
}

DCPATTN_NAMESPACE_END
