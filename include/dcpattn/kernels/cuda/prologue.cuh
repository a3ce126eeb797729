// SPDX-License-Identifier: Apache-2.0
// CUDA fused MLA prologue: query RMSNorm of every row, KV RMSNorm + RoPE + MLA cache write (bf16 or
// fp8 ds_mla entry), indexer-key LayerNorm + RoPE + fp8 cache write, and the top-k buffer reset, in
// one stream-ordered launch (no allocation, no host synchronization: CUDA-graph capturable).
//
// The DCP rule (DESIGN.md, "Fused prologue"): the query RMSNorm runs for EVERY row. The query part
// of this kernel never reads slot_mapping at all, so a rank that stores none of the batch's tokens
// (every slot -1) still normalizes all its queries; only the cache writes depend on the slot.
//
// Semantics are those of host::fused_prologue (dcpattn/kernels/host/prologue.hpp), with the same
// bf16 roundings of the intermediates. Differences from the host, all from the order of fp32 sums:
//   - q_c_out and the bf16 latent: bitwise equal to the host or 1 bf16 ulp apart (the RMSNorm sum
//     of squares is a tree here, sequential there; the scale differs by a few fp32 ulps, which can
//     move a bf16 rounding by one step, never two);
//   - RoPE of k_pe (cache columns [512, 576), or the 64 bf16 of an fp8 entry): bitwise equal (no
//     reduction; every product and sum is rounded separately, as the host evaluates rope_pair);
//   - fp8 ds_mla latent: codes equal or adjacent, each group's scale bitwise equal unless the
//     group's largest latent differs by one bf16 ulp (then relative difference <= 2^-7);
//   - indexer key: LayerNorm outputs within 1 bf16 ulp, then rotated and quantized as on the host;
//     a 1-ulp difference before RoPE can move a rotated value by 2^-7 of its pair's magnitude.
// The sums are deterministic (fixed order, independent of the launch shape): the same inputs give
// the same bytes on every run and for every batch size.
// Bitwise statements assume IEEE division and square root (nvcc's default; not --use_fast_math).
//
// Conversions: float -> bf16 and float -> e4m3 use the hardware conversions (cvt.rn.bf16x2.f32,
// cvt.rn.satfinite.e4m3x2.f32: round to nearest even, subnormals kept, e4m3 saturating to +-448),
// which give bfloat16::from_float and fp8_e4m3::encode bit for bit on every non-NaN input. A chunk
// of 8 values holding a NaN takes the library routines instead, so NaN encodings are the
// library's too (tests/kernels/cuda/test_prologue.cu checks all 2^32 inputs on the device).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include <cuda_runtime.h>

#include <cuda/std/bit>

#include "dcpattn/config.hpp"
#include "dcpattn/core/fp8_cache.hpp"
#include "dcpattn/core/norm.hpp"
#include "dcpattn/core/numeric.hpp"
#include "dcpattn/core/rope.hpp"
#include "dcpattn/error.hpp"
#include "dcpattn/kernels/cache_layout.hpp"
#include "dcpattn/kernels/cuda/convert.cuh"
#include "dcpattn/kernels/cuda/device.cuh"
#include "dcpattn/kernels/host/prologue.hpp"
#include "dcpattn/kernels/input_errors.hpp"

DCPATTN_NAMESPACE_BEGIN

namespace cuda_kernels {
namespace detail::prologue {

// ---- launch shape ----
// Every warp works on whole rows, independently of the other warps (no block barrier, no shared
// memory), so every part of every row is spread evenly over all the SMs. Large batches (`split`
// false): one warp per row, in blocks of kLargeBlockWarps warps, as many blocks as the rows need;
// per row the warp
//   - issues the 6 loads of 16 bytes per lane of q_c[t] (1536 values) and of its weights, then
//     the loads of the slot and the position and, when the row owns a writable slot, its
//     kv_c / k_pe / index_k chunks, their weights and the cos/sin values: about 20 loads of 16
//     bytes per lane in flight together,
//   - resets the top-k row (16-byte stores across the warp: 16 per lane at k = 2048),
//   - finishes the query RMSNorm (warp shuffles only) and stores q_c_out[t],
//   - finishes the latent (all 32 lanes: chunks lane and lane + 32), k_pe (lanes 0-7) and the
//     indexer key (lanes 16-31) and stores the cache entries.
// Small batches (`split` true: three tasks per row still fit the resident warps): one warp per
// (row, part), part 0 = query + top-k, part 1 = the latent, part 2 = k_pe and the indexer key, so
// that a decode step spreads over three times as many warps and its latency chain is shorter;
// blocks shrink so that they spread over the SMs.
// A chunk of 8 bf16 is one 16-byte load or store wherever the view allows it (unit inner stride,
// 16-byte aligned base and row stride); other views take an element-wise path. The kernel is
// compiled twice: V = true when every view allows 16-byte accesses (no element-wise code at all),
// V = false for any other views.
inline constexpr int kBlockWarps = 8;
inline constexpr int kThreads = 32 * kBlockWarps;
inline constexpr int kChunk = 8;                              // bf16 per 16 bytes
inline constexpr int kQChunks = kMlaQLoraRank / kChunk / 32;  // 6 chunks per lane
// The query sum of squares is kept as 3 partial sums per lane, each over the chunks (lane + 32m,
// lane + 32(m + 3)), m = 0, 1, 2, reduced across the warp and added in the order m = 0, 1, 2: one
// fixed tree for every launch shape.
inline constexpr int kQPartials = 3;
// Register cap through __launch_bounds__: 2 blocks of 256 threads per SM leave 128 registers per
// thread, what the whole-row loop needs without spilling (it holds a row's query chunks, its kv
// chunks and cos/sin values, and the query weights at once; caps of 96 and 80 registers spill
// and measured 5 to 25% slower). 16 warps per SM, each with up to 13 x 512 bytes of loads in
// flight, cover the memory latency several times over.
inline constexpr int kMinBlocksPerSm = 2;
// Warps per block of the large-batch grid (one row per warp; see fused_prologue).
inline constexpr int kLargeBlockWarps = 4;

static_assert(kMlaQLoraRank == kQChunks * 32 * kChunk && kQChunks == 2 * kQPartials,
              "dcpattn: the query part assumes 1536 = 6 chunks x 32 lanes x 8");
static_assert(kMlaLatentDim == 2 * 32 * kChunk,
              "dcpattn: the latent is 2 chunks per lane of a warp");
static_assert(kMlaRopeDim == 8 * kChunk, "dcpattn: the RoPE part is 8 lanes x 8 values");
static_assert(kIndexerHeadDim == 16 * kChunk, "dcpattn: an indexer key is 16 lanes x 8 values");
static_assert(DsMlaFp8Entry::group_size == 16 * kChunk,
              "dcpattn: an fp8 group of the ds_mla entry is 16 lanes x 8 values");
static_assert(DsMlaFp8Entry::rope_offset % 16 == 0 && DsMlaFp8Entry::bytes % 16 == 0,
              "dcpattn: the ds_mla entry's RoPE part must be 16-byte aligned");

// ---- views as the kernel sees them ----

inline bool aligned16(const void* p) noexcept {
  return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0;
}

/// A rank-2 view flattened to a pointer and element strides. `vec`: rows may be accessed 16 bytes
/// at a time (unit inner stride, 16-byte aligned base and row stride).
template <class T>
struct Rows {
  T* data = nullptr;
  std::int64_t row_stride = 0;
  std::int64_t col_stride = 1;
  bool vec = false;
};
/// A rank-1 view: pointer, element stride, `vec` as above. data == nullptr: absent (zeros).
template <class T>
struct Vec1 {
  T* data = nullptr;
  std::int64_t stride = 1;
  bool vec = false;
};

template <class T, class View>
Rows<T> rows_of(const View& v) {
  Rows<T> r;
  r.data = v.data_handle();
  if (v.extent(0) == 0 || v.extent(1) == 0) return r;
  r.row_stride = v.stride(0);
  r.col_stride = v.stride(1);
  const bool rows_ok = v.extent(0) == 1 || (r.row_stride * std::int64_t(sizeof(T))) % 16 == 0;
  r.vec = r.col_stride == 1 && aligned16(r.data) && rows_ok;
  return r;
}
template <class T, class View>
Vec1<T> vec_of(const View& v) {
  Vec1<T> r;
  r.data = v.data_handle();
  if (v.extent(0) == 0) return r;
  r.stride = v.stride(0);
  r.vec = r.stride == 1 && aligned16(r.data);
  return r;
}

/// Everything the kernel reads, by value (a __grid_constant__ parameter).
template <CacheFormat F>
struct Params {
  using CacheElement = mla_cache_element_t<F>;
  std::int64_t num_rows = 0;
  Rows<const bfloat16> q_c;
  Rows<bfloat16> q_out;
  Vec1<const bfloat16> q_w;
  Rows<const bfloat16> kv_c;
  Vec1<const bfloat16> kv_w;
  Rows<const bfloat16> k_pe;
  Vec1<const std::int64_t> positions;
  Vec1<const std::int64_t> slots;
  Rows<const float> cos_sin;
  std::int64_t max_position = 0;
  Rows<CacheElement> kv_cache;
  std::int64_t num_slots = 0;
  RopeStyle kv_rope_style = RopeStyle::interleaved;

  bool indexer = false;
  Rows<const bfloat16> index_k;
  Vec1<const bfloat16> ik_w;
  Vec1<const bfloat16> ik_b;  // data == nullptr: no bias (adds 0, as the host does)
  RopeStyle index_rope_style = RopeStyle::neox;
  Rows<std::uint8_t> index_cache;
  std::int64_t index_pages = 0;
  std::int64_t index_page_size = 1;

  Rows<std::int32_t> topk;
  std::int64_t topk_k = 0;  // 0: no top-k buffer

  bool split = false;  // one warp per (row, part) instead of one warp per row (see launch shape)

  float rms_eps = 1e-6f;
  float ln_eps = 1e-6f;

  std::uint32_t* error_flags = nullptr;  // PrologueArgs::error_flags
};
static_assert(sizeof(Params<CacheFormat::bf16>) <= 4096 &&
                  sizeof(Params<CacheFormat::fp8_ds_mla>) <= 4096,
              "dcpattn: the prologue's kernel parameters must fit the classic 4 KB limit");

// ---- device helpers ----
#if DCPATTN_IS_CUDA_COMPILER

inline constexpr unsigned kFullMask = 0xffffffffu;

/// Element 2k of a 16-byte chunk is the low half of word k (little-endian).
DCPATTN_DEVICE void unpack_bf16x8(uint4 v, float (&f)[8]) {
  const std::uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    f[2 * k] = cuda::std::bit_cast<float>(w[k] << 16);
    f[2 * k + 1] = cuda::std::bit_cast<float>(w[k] & 0xffff0000u);
  }
}

/// True when one of the 8 values is a NaN (then the library conversions run: see the file comment).
DCPATTN_DEVICE bool any_nan8(const float (&f)[8]) {
  bool nan = false;
#pragma unroll
  for (int k = 0; k < 8; ++k) nan |= f[k] != f[k];
  return nan;
}

/// fp8_e4m3::encode(lo) | fp8_e4m3::encode(hi) << 8 for non-NaN lo and hi (round to nearest even,
/// subnormals kept, magnitudes from 448 up, infinities included, saturating to +-448).
DCPATTN_DEVICE std::uint32_t cvt_e4m3x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));  // first: high byte
  return r;
#else
  return std::uint32_t(fp8_e4m3::encode(lo)) | (std::uint32_t(fp8_e4m3::encode(hi)) << 8);
#endif
}

/// The library path of pack_bf16x8 (chunks holding a NaN), out of line (keeps the hot loop
/// compact). A template only for its linkage (a header may be compiled with -rdc into many units).
template <int = 0>
__device__ __noinline__ uint4 pack_bf16x8_library(float f0, float f1, float f2, float f3, float f4,
                                                  float f5, float f6, float f7) {
  const float f[8] = {f0, f1, f2, f3, f4, f5, f6, f7};
  std::uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k)
    w[k] = std::uint32_t(bfloat16::from_float(f[2 * k]).bits) |
           (std::uint32_t(bfloat16::from_float(f[2 * k + 1]).bits) << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

/// bf16 bits of 8 values (bfloat16::from_float of each), packed as unpack_bf16x8 reads them.
DCPATTN_DEVICE uint4 pack_bf16x8(const float (&f)[8]) {
  if (any_nan8(f)) return pack_bf16x8_library<>(f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7]);
  return make_uint4(cvt_bf16x2(f[0], f[1]), cvt_bf16x2(f[2], f[3]), cvt_bf16x2(f[4], f[5]),
                    cvt_bf16x2(f[6], f[7]));
}

/// Rounds 8 values to bf16 in place (round_to_bf16 of each).
DCPATTN_DEVICE void round_bf16x8(float (&f)[8]) {
  unpack_bf16x8(pack_bf16x8(f), f);
}

/// The library path of encode_e4m3x8 (chunks holding a NaN), out of line, as pack_bf16x8_library.
template <int = 0>
__device__ __noinline__ uint2 encode_e4m3x8_library(float q0, float q1, float q2, float q3,
                                                    float q4, float q5, float q6, float q7) {
  const float q[8] = {q0, q1, q2, q3, q4, q5, q6, q7};
  std::uint32_t w[2] = {0u, 0u};
#pragma unroll
  for (int k = 0; k < 8; ++k) w[k / 4] |= std::uint32_t(fp8_e4m3::encode(q[k])) << (8 * (k % 4));
  return make_uint2(w[0], w[1]);
}

/// fp8_e4m3::encode of 8 values, packed little-endian (value k in byte k % 4 of word k / 4).
DCPATTN_DEVICE void encode_e4m3x8(const float (&q)[8], std::uint32_t (&w)[2]) {
  if (any_nan8(q)) {
    const uint2 r = encode_e4m3x8_library<>(q[0], q[1], q[2], q[3], q[4], q[5], q[6], q[7]);
    w[0] = r.x;
    w[1] = r.y;
    return;
  }
#pragma unroll
  for (int h = 0; h < 2; ++h)
    w[h] = cvt_e4m3x2(q[4 * h], q[4 * h + 1]) | (cvt_e4m3x2(q[4 * h + 2], q[4 * h + 3]) << 16);
}

/// e4m3 codes of 8 values divided by `scale` (IEEE division, as the host), packed little-endian.
DCPATTN_DEVICE void encode_fp8x8(const float (&y)[8], float scale, std::uint32_t (&w)[2]) {
  float q[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) q[k] = __fdiv_rn(y[k], scale);
  encode_e4m3x8(q, w);
}

/// Raw bf16 bits of elements c0, c0 + stride, ..., c0 + 7 stride of p (the element-wise path).
DCPATTN_DEVICE uint4 gather_chunk(const bfloat16* p, std::int64_t stride, int c0) {
  std::uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k)
    w[k] = std::uint32_t(p[std::int64_t(c0 + 2 * k) * stride].bits) |
           (std::uint32_t(p[std::int64_t(c0 + 2 * k + 1) * stride].bits) << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}
/// Raw bf16 bits of columns [c0, c0 + 8) (c0 a multiple of 8) of row `row` of a streamed
/// (read-once) input. V: the view is known to be `vec`.
template <bool V>
DCPATTN_DEVICE uint4 load_chunk(const Rows<const bfloat16>& m, std::int64_t row, int c0) {
  const bfloat16* p = m.data + row * m.row_stride;
  if (V || m.vec) return __ldcs(reinterpret_cast<const uint4*>(p + c0));
  return gather_chunk(p, m.col_stride, c0);
}
/// Raw bf16 bits of entries [c0, c0 + 8) of a weight vector (read by every warp: through the
/// read-only cache). kOptional: an absent vector (null) reads as +0; the others are never null.
template <bool V, bool kOptional = false>
DCPATTN_DEVICE uint4 load_weight_chunk(const Vec1<const bfloat16>& v, int c0) {
  if (kOptional && v.data == nullptr) return make_uint4(0u, 0u, 0u, 0u);
  if (V || v.vec) return __ldg(reinterpret_cast<const uint4*>(v.data + c0));
  return gather_chunk(v.data, v.stride, c0);
}
/// Stores 8 bf16 (raw bits, as pack_bf16x8 makes them) at columns [c0, c0 + 8) of row `row`.
template <bool V>
DCPATTN_DEVICE void store_chunk(const Rows<bfloat16>& m, std::int64_t row, int c0, uint4 v) {
  bfloat16* p = m.data + row * m.row_stride;
  if (V || m.vec) {
    *reinterpret_cast<uint4*>(p + c0) = v;
  } else {
    const std::uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 8; ++k)
      p[std::int64_t(c0 + k) * m.col_stride] = bfloat16{std::uint16_t(w[k / 2] >> (16 * (k % 2)))};
  }
}
/// Stores `n` bytes (4, 8 or 16, given as words) at byte column c0 of a byte row; `vec` rows take
/// one store (c0 must then be aligned to n), others byte by byte.
template <bool V, int N>
DCPATTN_DEVICE void store_bytes(const Rows<std::uint8_t>& m, std::uint8_t* row_ptr, std::int64_t c0,
                                const std::uint32_t (&words)[N / 4]) {
  static_assert(N == 4 || N == 8 || N == 16);
  if (V || m.vec) {
    if constexpr (N == 16) {
      *reinterpret_cast<uint4*>(row_ptr + c0) = make_uint4(words[0], words[1], words[2], words[3]);
    } else if constexpr (N == 8) {
      *reinterpret_cast<uint2*>(row_ptr + c0) = make_uint2(words[0], words[1]);
    } else {
      *reinterpret_cast<std::uint32_t*>(row_ptr + c0) = words[0];
    }
  } else {
#pragma unroll
    for (int b = 0; b < N; ++b)
      row_ptr[(c0 + b) * m.col_stride] = std::uint8_t(words[b / 4] >> (8 * (b % 4)));
  }
}

template <int kWidth>
DCPATTN_DEVICE float warp_sum(float v) {
#pragma unroll
  for (int m = kWidth / 2; m > 0; m /= 2) v += __shfl_xor_sync(kFullMask, v, m);
  return v;  // xor butterfly: every lane of a kWidth group ends with the same bits
}
template <int kWidth>
DCPATTN_DEVICE float warp_max(float v) {
#pragma unroll
  for (int m = kWidth / 2; m > 0; m /= 2) {
    const float o = __shfl_xor_sync(kFullMask, v, m);
    v = o > v ? o : v;  // the host's comparison: exact and order-free for non-NaN values
  }
  return v;
}

/// (x0 cos - x1 sin, x0 sin + x1 cos) with every operation rounded on its own, as the host
/// evaluates rope_pair (nvcc would otherwise contract into FMAs and differ in the last bit).
DCPATTN_DEVICE RopePair rope_pair_rn(float x0, float x1, float c, float s) {
  return {__fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s)),
          __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c))};
}

/// `n` cosines (columns [i0, i0 + n)) and sines (columns [32 + i0, ...)) of row `pos`.
template <bool V, int N>
DCPATTN_DEVICE void load_cos_sin(const Rows<const float>& cs, std::int64_t pos, int i0,
                                 float (&c)[N], float (&s)[N]) {
  constexpr int half = kMlaRopeDim / 2;
  const float* row = cs.data + pos * cs.row_stride;
  if (V || cs.vec) {
#pragma unroll
    for (int k = 0; k < N; k += 4) {
      const float4 cv = __ldg(reinterpret_cast<const float4*>(row + i0 + k));
      const float4 sv = __ldg(reinterpret_cast<const float4*>(row + half + i0 + k));
      c[k] = cv.x, c[k + 1] = cv.y, c[k + 2] = cv.z, c[k + 3] = cv.w;
      s[k] = sv.x, s[k + 1] = sv.y, s[k + 2] = sv.z, s[k + 3] = sv.w;
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) {
      c[k] = __ldg(row + std::int64_t(i0 + k) * cs.col_stride);
      s[k] = __ldg(row + std::int64_t(half + i0 + k) * cs.col_stride);
    }
  }
}

/// The cosines and sines that sub-lane `sub` (< 8) of a group of 8 lanes holding 64 rotary dims
/// (sub-lane l: dims [8l, 8l + 8)) needs at position `pos`: pairs 4l .. 4l + 3 (interleaved,
/// c[0..3]) or 8(l % 4) .. 8(l % 4) + 7 (neox).
template <bool V>
DCPATTN_DEVICE void load_rope_cos_sin(int sub, RopeStyle style, const Rows<const float>& cs,
                                      std::int64_t pos, float (&c)[8], float (&s)[8]) {
  if (style == RopeStyle::interleaved) {
    float c4[4], s4[4];
    load_cos_sin<V, 4>(cs, pos, 4 * sub, c4, s4);
#pragma unroll
    for (int k = 0; k < 4; ++k) c[k] = c4[k], s[k] = s4[k], c[k + 4] = s[k + 4] = 0.0f;
  } else {
    load_cos_sin<V, 8>(cs, pos, 8 * (sub & 3), c, s);
  }
}

/// RoPE of 64 dims held by a group of 8 lanes, sub-lane `sub` = lane % 8 holding dims
/// [8 sub, 8 sub + 8) in x (values of bf16), with the cosines and sines of load_rope_cos_sin;
/// lanes with `rotate` false keep x. Rotated values are NOT yet rounded to bf16 (the caller
/// rounds the chunk). Must be called by the whole warp: with `exchange` (some group of the warp
/// is neox) the neox pairing swaps values with lane ^ 4, inside the group.
DCPATTN_DEVICE void rope64(float (&x)[8], bool rotate, int sub, RopeStyle style, bool exchange,
                           const float (&c)[8], const float (&s)[8]) {
  float other[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) other[k] = 0.0f;
  if (exchange) {
#pragma unroll
    for (int k = 0; k < 8; ++k) other[k] = __shfl_xor_sync(kFullMask, x[k], 4);
  }
  if (!rotate) return;
  if (style == RopeStyle::interleaved) {
    // Pair i = (2i, 2i + 1): sub-lane l holds pairs 4l .. 4l + 3 entirely.
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const RopePair r = rope_pair_rn(x[2 * m], x[2 * m + 1], c[m], s[m]);
      x[2 * m] = r.x0;
      x[2 * m + 1] = r.x1;
    }
  } else {
    // Pair i = (i, i + 32): sub-lane l < 4 holds the first members of pairs 8l .. 8l + 7, sub-lane
    // l + 4 the second members of the same pairs.
    const bool first = sub < 4;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const RopePair r = first ? rope_pair_rn(x[k], other[k], c[k], s[k])
                               : rope_pair_rn(other[k], x[k], c[k], s[k]);
      x[k] = first ? r.x0 : r.x1;
    }
  }
}

/// Whether row `row`'s cache entries are to be written, from its slot and position: 0 <= slot <
/// num_slots, within the indexer cache when the indexer is on, and 0 <= position < max_position.
/// A row failing any of these (slot -1: another rank's token; anything else: an invalid value,
/// which the host reference refuses and this kernel cannot report without a synchronization)
/// writes neither cache and reads nothing at its slot or through its position.
/// With the indexer, also the slot's page of the indexer cache and its place in the page.
template <CacheFormat F>
DCPATTN_DEVICE bool writable(const Params<F>& p, std::int64_t slot, std::int64_t pos,
                             std::int64_t& page, std::int64_t& in_page) {
  page = in_page = 0;
  if (slot < 0 || slot >= p.num_slots || pos < 0 || pos >= p.max_position) return false;
  if (p.indexer) {
    const std::int64_t ps = p.index_page_size;  // >= 1
    if (((slot | ps) >> 32) == 0) {  // 32-bit division where it suffices (always, in practice)
      const std::uint32_t q = std::uint32_t(slot) / std::uint32_t(ps);
      page = q;
      in_page = std::int64_t(std::uint32_t(slot) - q * std::uint32_t(ps));
    } else {
      page = slot / ps;
      in_page = slot - page * ps;
    }
    if (page >= p.index_pages) return false;
  }
  return true;
}
/// The input_error_* bit of a row that `writable` refused although its slot is not -1: which
/// value was bad.
template <CacheFormat F>
DCPATTN_DEVICE std::uint32_t refusal_bit(const Params<F>& p, std::int64_t slot, std::int64_t pos) {
  if (slot < 0 || slot >= p.num_slots) return input_error_slot;
  if (pos < 0 || pos >= p.max_position) return input_error_position;
  return input_error_slot;  // the slot's indexer page does not exist
}
template <CacheFormat F>
DCPATTN_DEVICE std::int64_t slot_of(const Params<F>& p, std::int64_t row) {
  return p.slots.data[row * p.slots.stride];
}
template <CacheFormat F>
DCPATTN_DEVICE std::int64_t position_of(const Params<F>& p, std::int64_t row) {
  return p.positions.data[row * p.positions.stride];  // readable for every row < T
}

// ---- the parts of a row ----

/// q_c[t] as lane `lane` holds it: chunks lane + 32m, m = 0..5 (raw bf16 bits), and the same
/// chunks of q_norm_weight.
struct QueryRow {
  uint4 v[kQChunks];
  uint4 w[kQChunks];
};

template <CacheFormat F, bool V>
DCPATTN_DEVICE void query_load(const Params<F>& p, std::int64_t row, int lane, QueryRow& q) {
#pragma unroll
  for (int m = 0; m < kQChunks; ++m) q.v[m] = load_chunk<V>(p.q_c, row, (lane + 32 * m) * kChunk);
  // The weights (L1 hits after the first rows) go out with the row: loaded later, at the
  // reduction, they were one more latency on every row's path (measured on the H200: bf16 cache
  // 4-7% faster at T = 4096 and 32768).
#pragma unroll
  for (int m = 0; m < kQChunks; ++m) q.w[m] = load_weight_chunk<V>(p.q_w, (lane + 32 * m) * kChunk);
}

/// q_c_out[t] = bf16(q_c[t] * rms_norm_scale * q_norm_weight). In place (q_c_out == q_c) is safe:
/// the lane writes only the chunks it has read, after the reduction that needed all of them.
template <CacheFormat F, bool V>
DCPATTN_DEVICE void query_finish(const Params<F>& p, std::int64_t row, int lane,
                                 const QueryRow& q) {
  float ss[kQPartials];
#pragma unroll
  for (int m = 0; m < kQPartials; ++m) {
    ss[m] = 0.0f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float f[8];
      unpack_bf16x8(q.v[m + kQPartials * h], f);
#pragma unroll
      for (int k = 0; k < 8; ++k) ss[m] = fmaf(f[k], f[k], ss[m]);
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2)
#pragma unroll
    for (int m = 0; m < kQPartials; ++m) ss[m] += __shfl_xor_sync(kFullMask, ss[m], off);
  float total = ss[0];
#pragma unroll
  for (int m = 1; m < kQPartials; ++m) total += ss[m];
  const float scale = rms_norm_scale(total, kMlaQLoraRank, p.rms_eps);
#pragma unroll
  for (int m = 0; m < kQChunks; ++m) {
    const int c0 = (lane + 32 * m) * kChunk;
    float x[8], w[8];
    unpack_bf16x8(q.v[m], x);
    unpack_bf16x8(q.w[m], w);
#pragma unroll
    for (int k = 0; k < 8; ++k) x[k] = __fmul_rn(__fmul_rn(x[k], scale), w[k]);
    store_chunk<V>(p.q_out, row, c0, pack_bf16x8(x));
  }
}

/// topk_indices[t, :] = -1, spread over the warp.
template <CacheFormat F, bool V>
DCPATTN_DEVICE void topk_reset(const Params<F>& p, std::int64_t row, int lane) {
  const std::int64_t k_total = p.topk_k;
  if (k_total == 0) return;
  std::int32_t* r = p.topk.data + row * p.topk.row_stride;
  if (V || p.topk.vec) {
    const std::int64_t n4 = k_total / 4;
    int4* r4 = reinterpret_cast<int4*>(r);
#pragma unroll 4
    for (std::int64_t j = lane; j < n4; j += 32) r4[j] = make_int4(-1, -1, -1, -1);
    if (lane < k_total - 4 * n4) r[4 * n4 + lane] = -1;
  } else {
    for (std::int64_t j = lane; j < k_total; j += 32) r[j * p.topk.col_stride] = -1;
  }
}

/// What lane `lane` reads for the cache entries of a row: the latent chunks lane and lane + 32,
/// one chunk of k_pe (lanes 0-7) or of the indexer key (lanes 16-31; lanes 8-15 hold zeros), the
/// cosines and sines of the lanes that rotate (0-7: k_pe, 16-23: indexer dims [0, 64)), and the
/// normalization weights of its chunks.
struct KvRow {
  uint4 w_latent[2];       // kv_norm_weight chunks lane and lane + 32
  uint4 w_index, b_index;  // index_k_norm weight and bias, chunk lane - 16 (lanes 16-31)
  uint4 latent[2];
  uint4 aux;
  float c[8];
  float s[8];
};

/// `latent`, `aux` (uniform across the warp): which of the two halves of kv_finish will run.
template <CacheFormat F, bool V>
DCPATTN_DEVICE void kv_load(const Params<F>& p, std::int64_t row, std::int64_t pos, bool latent,
                            bool aux, int lane, KvRow& d) {
  d.latent[0] = d.latent[1] = d.aux = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
  for (int k = 0; k < 8; ++k) d.c[k] = d.s[k] = 0.0f;
  d.w_latent[0] = d.w_latent[1] = d.w_index = d.b_index = make_uint4(0u, 0u, 0u, 0u);
  // The weights go out with the row's chunks, as the query's do (measured on the H200: fp8 cache
  // with the indexer 2% faster at T = 4096).
  if (latent) {
#pragma unroll
    for (int j = 0; j < 2; ++j) d.latent[j] = load_chunk<V>(p.kv_c, row, (lane + 32 * j) * kChunk);
#pragma unroll
    for (int j = 0; j < 2; ++j)
      d.w_latent[j] = load_weight_chunk<V>(p.kv_w, (lane + 32 * j) * kChunk);
  }
  if (aux && p.indexer && lane >= 16) {
    d.w_index = load_weight_chunk<V>(p.ik_w, (lane & 15) * kChunk);
    d.b_index = load_weight_chunk<V, true>(p.ik_b, (lane & 15) * kChunk);
  }
  if (!aux) return;
  if (lane < 8) {
    d.aux = load_chunk<V>(p.k_pe, row, lane * kChunk);
    load_rope_cos_sin<V>(lane, p.kv_rope_style, p.cos_sin, pos, d.c, d.s);
  } else if (lane >= 16 && p.indexer) {
    d.aux = load_chunk<V>(p.index_k, row, (lane - 16) * kChunk);
    if (lane < 24) load_rope_cos_sin<V>(lane - 16, p.index_rope_style, p.cos_sin, pos, d.c, d.s);
  }
}

/// The cache entries of a row with a writable slot:
///   latent = bf16(RMSNorm(kv_c[t]) * kv_norm_weight): 512 bf16, or 4 groups of 128 e4m3 codes
///     with their fp32 scales (amax / 448); lane l holds dims [8l, 8l + 8) and [256 + 8l, ...),
///     so fp8 group g is held by 16 lanes: groups 0 and 2 by lanes 0-15, 1 and 3 by lanes 16-31;
///   rope = bf16(RoPE(k_pe[t], positions[t], kv_rope_style)) (lanes 0-7) into cache columns
///     [512, 576) (bf16) or bytes [528, 656) of the fp8 entry;
///   with the indexer (lanes 16-31): key = bf16(LayerNorm(index_k[t])) (two passes: mean, then the
///     squared deviations, as the host), dims [0, 64) rotated (index_rope_style) and rounded to
///     bf16, then 128 e4m3 codes with one fp32 scale (amax / 448) at the slot's place in its page.
/// The 16-lane reductions (xor 8, 4, 2, 1) stay inside lanes 0-15 and inside lanes 16-31.
/// `latent`: the latent part; `aux`: the k_pe and indexer part (both uniform across the warp).
template <CacheFormat F, bool V>
DCPATTN_DEVICE void kv_finish(const Params<F>& p, std::int64_t slot, std::int64_t page,
                              std::int64_t in_page, bool latent, bool aux, int lane,
                              const KvRow& d) {
  const int sub = lane & 15;  // chunk of the aux row
  const uint4* w_latent = d.w_latent;
  const uint4 w_index = d.w_index, b_index = d.b_index;
  // Latent (all lanes).
  if (latent) {
    float x[2][8];
#pragma unroll
    for (int j = 0; j < 2; ++j) unpack_bf16x8(d.latent[j], x[j]);
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int k = 0; k < 8; ++k) ss = fmaf(x[j][k], x[j][k], ss);
    ss = warp_sum<32>(ss);
    const float scale = rms_norm_scale(ss, kMlaLatentDim, p.rms_eps);
    uint4 bits[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float w[8];
      unpack_bf16x8(w_latent[j], w);
#pragma unroll
      for (int k = 0; k < 8; ++k) x[j][k] = __fmul_rn(__fmul_rn(x[j][k], scale), w[k]);
      bits[j] = pack_bf16x8(x[j]);
    }
    if constexpr (F == CacheFormat::bf16) {
#pragma unroll
      for (int j = 0; j < 2; ++j)
        store_chunk<V>(p.kv_cache, slot, (lane + 32 * j) * kChunk, bits[j]);
    } else {
      std::uint8_t* entry = p.kv_cache.data + slot * p.kv_cache.row_stride;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        float y[8];
        unpack_bf16x8(bits[j], y);  // the bf16 latent
        float amax = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const float a = fabsf(y[k]);
          amax = a > amax ? a : amax;
        }
        amax = warp_max<16>(amax);
        const float gscale = fp8_group_scale(amax);
        std::uint32_t codes[2];
        encode_fp8x8(y, gscale, codes);
        store_bytes<V, 8>(p.kv_cache, entry, std::int64_t(lane + 32 * j) * kChunk, codes);
        if ((lane & 15) == 0) {
          const int g = 2 * j + lane / 16;
          const std::uint32_t sbits[1] = {cuda::std::bit_cast<std::uint32_t>(gscale)};
          store_bytes<V, 4>(p.kv_cache, entry, DsMlaFp8Entry::scales_offset + 4 * g, sbits);
        }
      }
    }
  }

  // k_pe (lanes 0-7) and the indexer key (lanes 16-31).
  if (!aux) return;
  float x[8];
  unpack_bf16x8(d.aux, x);
  if (p.indexer) {
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) sum += x[k];
    sum = warp_sum<16>(sum);
    const float mean = __fdiv_rn(sum, float(kIndexerHeadDim));
    float m2 = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float dv = __fsub_rn(x[k], mean);
      m2 = fmaf(dv, dv, m2);
    }
    m2 = warp_sum<16>(m2);
    const float inv_std = layer_norm_inv_std(m2, kIndexerHeadDim, p.ln_eps);
    if (lane >= 16) {
      float w[8], b[8];
      unpack_bf16x8(w_index, w);
      unpack_bf16x8(b_index, b);
#pragma unroll
      for (int k = 0; k < 8; ++k)
        x[k] = __fadd_rn(__fmul_rn(__fmul_rn(__fsub_rn(x[k], mean), inv_std), w[k]), b[k]);
      round_bf16x8(x);
    }
  }
  const bool exchange =
      p.kv_rope_style == RopeStyle::neox || (p.indexer && p.index_rope_style == RopeStyle::neox);
  const bool rotate = lane < 8 || (p.indexer && lane >= 16 && lane < 24);
  rope64(x, rotate, lane & 7, lane < 16 ? p.kv_rope_style : p.index_rope_style, exchange, d.c, d.s);
  const uint4 xb = pack_bf16x8(x);  // the rotated values rounded; the others unchanged (exact)
  if (lane < 8) {
    if constexpr (F == CacheFormat::bf16) {
      store_chunk<V>(p.kv_cache, slot, kMlaLatentDim + lane * kChunk, xb);
    } else {
      const std::uint32_t words[4] = {xb.x, xb.y, xb.z, xb.w};
      std::uint8_t* entry = p.kv_cache.data + slot * p.kv_cache.row_stride;
      store_bytes<V, 16>(p.kv_cache, entry, DsMlaFp8Entry::rope_offset + 16 * lane, words);
    }
  }
  if (p.indexer) {
    unpack_bf16x8(xb, x);
    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float a = fabsf(x[k]);
      amax = a > amax ? a : amax;
    }
    amax = warp_max<16>(amax);
    if (lane >= 16) {
      const float scale = fp8_group_scale(amax);
      std::uint8_t* page_ptr = p.index_cache.data + page * p.index_cache.row_stride;
      std::uint32_t codes[2];
      encode_fp8x8(x, scale, codes);
      store_bytes<V, 8>(p.index_cache, page_ptr,
                        IndexerKCacheLayout::value_offset(in_page, sub * kChunk), codes);
      if (lane == 16) {
        const std::uint32_t bits[1] = {cuda::std::bit_cast<std::uint32_t>(scale)};
        store_bytes<V, 4>(p.index_cache, page_ptr,
                          IndexerKCacheLayout::scale_offset(p.index_page_size, in_page), bits);
      }
    }
  }
}

template <CacheFormat F, bool V>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    fused_prologue_kernel(const __grid_constant__ Params<F> p) {
  const int lane = int(threadIdx.x) & 31;
  const int block_warps = int(blockDim.x) / 32;
  // One task per warp: row t (every part), or with `split` task 3t (query + top-k of row t),
  // 3t + 1 (its latent) and 3t + 2 (its k_pe and indexer key). The grid covers every task.
  const std::int64_t tasks = p.split ? 3 * p.num_rows : p.num_rows;
  const std::int64_t task = std::int64_t(blockIdx.x) * block_warps + int(threadIdx.x) / 32;
  if (task >= tasks) return;
  const std::int64_t row = p.split ? task / 3 : task;
  const int part = int(task - (p.split ? 3 * row : row));  // 0 without `split`
  // The query chunks need nothing from the slot: their loads go out first, together with the
  // slot's and the position's, rather than one memory round trip later behind the branches on
  // the slot (and the error flag's atomic, which the compiler does not move loads across).
  const bool query = part == 0;
  QueryRow q;
  if (query) query_load<F, V>(p, row, lane, q);
  // All uniform across the warp (every lane loads the same slot and position).
  const std::int64_t slot = slot_of(p, row);
  const std::int64_t pos = position_of(p, row);
  std::int64_t page, in_page;
  const bool kv = (!p.split || part != 0) && writable(p, slot, pos, page, in_page);
  // A refused row with a slot other than -1 had a bad value: recorded once per row.
  if (!kv && slot != -1 && (!p.split || part == 1) && p.error_flags != nullptr && lane == 0)
    atomicOr(p.error_flags, refusal_bit(p, slot, pos));
  const bool latent = kv && (!p.split || part == 1);
  const bool aux = kv && (!p.split || part == 2);

  KvRow d;
  if (kv) kv_load<F, V>(p, row, pos, latent, aux, lane, d);
  if (query) {
    topk_reset<F, V>(p, row, lane);
    query_finish<F, V>(p, row, lane, q);
  }
  if (kv) kv_finish<F, V>(p, slot, page, in_page, latent, aux, lane, d);
}

#endif  // DCPATTN_IS_CUDA_COMPILER

// ---- host side ----

/// host::detail::validate_prologue_extents, i.e. everything that can be checked without reading
/// device memory (slot and position VALUES are left to the kernel, which skips a
/// row's cache writes when they are out of range), plus non-null data for the required views.
template <class KvCacheView>
void validate_extents(const PrologueArgs<KvCacheView>& a) {
  host::detail::validate_prologue_extents(a);
  const std::int64_t T = a.q_c.extent(0);
  const bool indexer = a.index_k.data_handle() != nullptr;
  if (T > 0) {
    auto require_data = [](const void* p, const char* name) {
      DCPATTN_REQUIRE(p != nullptr, std::string(name) + " has no data (null pointer)");
    };
    require_data(a.q_c.data_handle(), "q_c");
    require_data(a.q_c_out.data_handle(), "q_c_out");
    require_data(a.q_norm_weight.data_handle(), "q_norm_weight");
    require_data(a.kv_c.data_handle(), "kv_c");
    require_data(a.kv_norm_weight.data_handle(), "kv_norm_weight");
    require_data(a.k_pe.data_handle(), "k_pe");
    require_data(a.positions.data_handle(), "positions");
    require_data(a.slot_mapping.data_handle(), "slot_mapping");
    if (a.kv_cache.extent(0) > 0) require_data(a.kv_cache.data_handle(), "kv_cache");
    if (a.cos_sin_cache.extent(0) > 0) require_data(a.cos_sin_cache.data_handle(), "cos_sin_cache");
  }
}

/// True when every view the kernel touches allows 16-byte accesses (Rows::vec, Vec1::vec; views
/// that are absent or that nothing can be read from or written to do not count): then the kernel
/// without the element-wise paths runs.
template <CacheFormat F>
bool all_vec(const Params<F>& p) {
  bool v = p.q_c.vec && p.q_out.vec && p.q_w.vec && p.kv_c.vec && p.kv_w.vec && p.k_pe.vec &&
           (p.cos_sin.vec || p.max_position == 0) && (p.kv_cache.vec || p.num_slots == 0);
  if (p.indexer)
    v = v && p.index_k.vec && p.ik_w.vec && (p.ik_b.data == nullptr || p.ik_b.vec) &&
        (p.index_cache.vec || p.index_pages == 0);
  if (p.topk_k > 0) v = v && p.topk.vec;
  return v;
}

template <CacheFormat F, class KvCacheView>
Params<F> make_params(const PrologueArgs<KvCacheView>& a) {
  Params<F> p;
  p.num_rows = a.q_c.extent(0);
  p.q_c = rows_of<const bfloat16>(a.q_c);
  p.q_out = rows_of<bfloat16>(a.q_c_out);
  p.q_w = vec_of<const bfloat16>(a.q_norm_weight);
  p.kv_c = rows_of<const bfloat16>(a.kv_c);
  p.kv_w = vec_of<const bfloat16>(a.kv_norm_weight);
  p.k_pe = rows_of<const bfloat16>(a.k_pe);
  p.positions = vec_of<const std::int64_t>(a.positions);
  p.slots = vec_of<const std::int64_t>(a.slot_mapping);
  p.cos_sin = rows_of<const float>(a.cos_sin_cache);
  p.max_position = a.cos_sin_cache.extent(0);
  p.kv_cache = rows_of<mla_cache_element_t<F>>(a.kv_cache);
  p.num_slots = a.kv_cache.extent(0);
  p.kv_rope_style = a.kv_rope_style;
  p.indexer = a.index_k.data_handle() != nullptr;
  if (p.indexer) {
    p.index_k = rows_of<const bfloat16>(a.index_k);
    p.ik_w = vec_of<const bfloat16>(a.index_k_norm_weight);
    if (a.index_k_norm_bias.data_handle() != nullptr)
      p.ik_b = vec_of<const bfloat16>(a.index_k_norm_bias);
    p.index_rope_style = a.index_rope_style;
    p.index_cache = rows_of<std::uint8_t>(a.index_k_cache);
    p.index_pages = a.index_k_cache.extent(0);
    p.index_page_size = IndexerKCacheLayout::page_size(a.index_k_cache.extent(1));
  }
  if (a.topk_indices.data_handle() != nullptr && a.topk_indices.extent(1) > 0) {
    p.topk = rows_of<std::int32_t>(a.topk_indices);
    p.topk_k = a.topk_indices.extent(1);
  }
  p.rms_eps = a.rms_norm_eps;
  p.ln_eps = a.layer_norm_eps;
  p.error_flags = a.error_flags;
  return p;
}

}  // namespace detail::prologue

#if defined(__CUDACC__)  // the launch syntax needs nvcc

/// Fused prologue of one batch of T rows on `stream` (CUDA). Same arguments and results as
/// host::fused_prologue (see PrologueArgs); every view is DEVICE memory. Per row t:
///   - q_c_out[t] = bf16(RMSNorm(q_c[t]) * q_norm_weight), for EVERY row (slot or not);
///   - where 0 <= slot_mapping[t] < num_slots: the MLA cache entry (normalized latent, rotated
///     k_pe; bf16 or fp8 ds_mla) and, with index_k, the fp8 indexer key at that slot;
///   - topk_indices[t, :] = -1 when the buffer is given.
/// Rounding: see the file comment (q and bf16 latent within 1 bf16 ulp of the host, k_pe RoPE
/// bitwise, fp8 codes equal or adjacent).
///
/// Values that the host refuses but this function cannot see without a synchronization are
/// handled in the kernel: a row whose slot is outside [-1, num_slots), beyond index_k_cache (with
/// the indexer), or whose position is outside cos_sin_cache writes neither cache (exactly like a
/// row of another rank) and reads nothing at that slot or position; its query row and top-k row
/// are still written. Extents are checked here and refused with dcpattn::Error naming the
/// parameter, before anything is enqueued.
///
/// One kernel launch, no allocation, no host synchronization: capturable in a CUDA graph.
/// q_c_out may alias q_c. Views of any strides are accepted; rows with unit inner stride and
/// 16-byte aligned starts are moved 16 bytes per access, others element by element.
///
/// @tparam KvCacheView mla_cache_out_view_t<CacheFormat::bf16> (num_slots, 576) or
///                     mla_cache_out_view_t<CacheFormat::fp8_ds_mla> (num_slots, 656)
template <class KvCacheView>
void fused_prologue(const PrologueArgs<KvCacheView>& args, cudaStream_t stream) {
  namespace d = detail::prologue;
  constexpr CacheFormat format = mla_cache_format_v<KvCacheView>;
  static_assert(!std::is_const_v<typename KvCacheView::element_type>,
                "dcpattn: the fused prologue writes kv_cache: pass a mutable view "
                "(mla_cache_out_view_t<format>)");
  d::validate_extents(args);
  const std::int64_t T = args.q_c.extent(0);
  if (T == 0) return;
  d::Params<format> params = d::make_params<format>(args);

  const int sms = detail::device_sm_count();
  // Residency is taken from the register cap (at least kMinBlocksPerSm blocks of kThreads per SM)
  // rather than queried: no runtime call that a graph capture could object to.
  const std::int64_t resident_blocks = std::int64_t(sms) * d::kMinBlocksPerSm;
  const std::int64_t resident_warps = resident_blocks * d::kBlockWarps;
  // Three warps per row while they all fit at once (decode), else one warp per row.
  params.split = 3 * T <= resident_warps;
  const std::int64_t tasks = params.split ? 3 * T : T;
  // Small batches: fewer warps per block, so that the blocks spread over all the SMs, and a grid
  // that holds every task at once. Large batches: a block of kLargeBlockWarps warps per
  // kLargeBlockWarps rows, as many blocks as rows need; the block scheduler then gives a finished
  // block's SM the next rows, which balances rows of unequal cost (rows without a slot write no
  // cache entry). Measured on the H200 against the persistent grid this replaced: equal at
  // T = 4096 (fp8 cache with the indexer, bf16) and 6% faster where a quarter of the rows own a
  // slot, 6 to 10% faster at T = 32768.
  std::int64_t block_warps = 0, blocks = 0;
  if (params.split) {
    block_warps = std::clamp<std::int64_t>((tasks + sms - 1) / sms, 1, d::kBlockWarps);
    blocks = (tasks + block_warps - 1) / block_warps;
  } else {
    block_warps = d::kLargeBlockWarps;
    blocks = (tasks + block_warps - 1) / block_warps;
  }
  const dim3 grid{unsigned(blocks)}, block{unsigned(32 * block_warps)};
  if (d::all_vec(params))
    d::fused_prologue_kernel<format, true><<<grid, block, 0, stream>>>(params);
  else
    d::fused_prologue_kernel<format, false><<<grid, block, 0, stream>>>(params);
  DCPATTN_CUDA_CHECK(cudaGetLastError());
}

#endif  // __CUDACC__

}  // namespace cuda_kernels

DCPATTN_NAMESPACE_END
