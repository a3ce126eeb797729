// SPDX-License-Identifier: Apache-2.0
// fp8 e4m3 group quantization with fp32 scales, and the 656-byte "ds_mla" MLA cache entry.
#pragma once

#include <cstdint>
#include <cstring>

#include <cuda/std/bit>
#include <cuda/std/cmath>

#include "dcpattn/config.hpp"
#include "dcpattn/core/numeric.hpp"

DCPATTN_NAMESPACE_BEGIN

/// Scale of an fp8 group whose largest magnitude is amax: amax / 448, so the group fills the e4m3
/// range; 1 for an all-zero (or non-finite) group so decoding never divides by zero.
DCPATTN_HOST_DEVICE float fp8_group_scale(float amax) noexcept {
  return (amax > 0.0f && amax < cuda::std::numeric_limits<float>::infinity())
             ? amax / fp8_e4m3::max_finite
             : 1.0f;
}

/// Quantizes one group: q[i] = e4m3(x[i] / scale). Returns the scale. x: (n,) float or bfloat16.
template <class T>
DCPATTN_HOST_DEVICE float quantize_fp8_group(const T* x, int n, std::uint8_t* q) noexcept {
  float amax = 0.0f;
  for (int i = 0; i < n; ++i) {
    const float a = cuda::std::fabs(to_float(x[i]));
    amax = a > amax ? a : amax;
  }
  const float scale = fp8_group_scale(amax);
  for (int i = 0; i < n; ++i) q[i] = fp8_e4m3::encode(to_float(x[i]) / scale);
  return scale;
}

/// The 656-byte fp8 MLA cache entry of one token ("fp8_ds_mla"):
///   bytes [0, 512)    512 e4m3 values of the normalized latent (kv_lora_rank dims), in 4 groups
///   bytes [512, 528)  4 fp32 scales, one per group of 128 values
///   bytes [528, 656)  64 bf16 values of the rotated RoPE part (kept in bf16: RoPE dims are
///                     sensitive to quantization)
/// The attention kernel reads key = (dequantized latent, rope) (576 dims) and value = latent.
struct DsMlaFp8Entry {
  static constexpr int latent_dim = 512;
  static constexpr int rope_dim = 64;
  static constexpr int group_size = 128;
  static constexpr int num_groups = latent_dim / group_size;
  static constexpr int scales_offset = latent_dim;
  static constexpr int rope_offset = scales_offset + num_groups * 4;
  static constexpr int bytes = rope_offset + rope_dim * 2;

  /// Writes one entry. latent: (512,), rope: (64,), float or bfloat16. entry: 656 bytes.
  template <class TL, class TR>
  static DCPATTN_HOST_DEVICE void encode(const TL* latent, const TR* rope,
                                         std::uint8_t* entry) noexcept {
    for (int g = 0; g < num_groups; ++g) {
      const float scale = quantize_fp8_group(latent + g * group_size, group_size,
                                             entry + g * group_size);
      store_u32(entry + scales_offset + 4 * g, cuda::std::bit_cast<std::uint32_t>(scale));
    }
    for (int i = 0; i < rope_dim; ++i) {
      const std::uint16_t b = bfloat16::from_float(to_float(rope[i])).bits;
      entry[rope_offset + 2 * i] = std::uint8_t(b & 0xff);
      entry[rope_offset + 2 * i + 1] = std::uint8_t(b >> 8);
    }
  }

  /// Scale of group g of an entry.
  static DCPATTN_HOST_DEVICE float scale(const std::uint8_t* entry, int g) noexcept {
    return cuda::std::bit_cast<float>(load_u32(entry + scales_offset + 4 * g));
  }
  /// Dequantized latent value i (0 <= i < 512).
  static DCPATTN_HOST_DEVICE float latent(const std::uint8_t* entry, int i) noexcept {
    return fp8_e4m3::decode(entry[i]) * scale(entry, i / group_size);
  }
  /// RoPE value i (0 <= i < 64).
  static DCPATTN_HOST_DEVICE float rope(const std::uint8_t* entry, int i) noexcept {
    const std::uint16_t b =
        std::uint16_t(entry[rope_offset + 2 * i] | (entry[rope_offset + 2 * i + 1] << 8));
    return bfloat16{b}.to_float();
  }
  /// Key dim i of the 576-dim key: latent for i < 512, rope after.
  static DCPATTN_HOST_DEVICE float key(const std::uint8_t* entry, int i) noexcept {
    return i < latent_dim ? latent(entry, i) : rope(entry, i - latent_dim);
  }

 private:
  // Byte-wise little-endian access: entries are only 16-byte aligned as a whole and the scales
  // sit at byte 512 of a 656-byte stride, so no wider alignment is assumed here.
  static DCPATTN_HOST_DEVICE void store_u32(std::uint8_t* p, std::uint32_t v) noexcept {
    for (int k = 0; k < 4; ++k) p[k] = std::uint8_t(v >> (8 * k));
  }
  static DCPATTN_HOST_DEVICE std::uint32_t load_u32(const std::uint8_t* p) noexcept {
    return std::uint32_t(p[0]) | (std::uint32_t(p[1]) << 8) | (std::uint32_t(p[2]) << 16) |
           (std::uint32_t(p[3]) << 24);
  }
};
static_assert(DsMlaFp8Entry::bytes == 656, "the ds_mla fp8 cache entry is 656 bytes");

DCPATTN_NAMESPACE_END
