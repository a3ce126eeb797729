// SPDX-License-Identifier: Apache-2.0
// CUDA fused MLA prologue: query RMSNorm of every row, KV RMSNorm + RoPE + MLA cache write (bf16 or
// fp8 ds_mla entry), indexer-key LayerNorm + RoPE + fp8 cache write, and the top-k buffer reset, in
// one stream-ordered launch (no allocation, no host synchronization: CUDA-graph capturable).
//
// The DCP rule (DESIGN.md, "Fused prologue"): the query RMSNorm runs for EVERY row. The query role
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
// The sums are deterministic (fixed order): the same inputs give the same bytes on every run.
// Bitwise statements assume IEEE division and square root (nvcc's default; not --use_fast_math).
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
#include "dcpattn/kernels/host/prologue.hpp"

DCPATTN_NAMESPACE_BEGIN

namespace cuda_kernels {
namespace detail::prologue {

// ---- launch shape ----
// One 96-thread block (3 warps) works on one row at a time in one of three roles (blockIdx.x %
// number of roles), walking rows blockIdx.x / roles, + row_blocks, ...:
//   role 0 (query):  3 warps x 32 lanes x 2 chunks of 8 bf16 = the 1536 values of q_c[t], two
//                    rows per iteration (four 16-byte loads in flight per thread); block
//                    reduction of each sum of squares (warp shuffles, then 3 partials, 1 barrier).
//   role 1 (kv):     warp 0: the 512-value latent, 2 chunks of 8 per lane (RMSNorm by a warp
//                    shuffle reduction, then the bf16 store or fp8 quantization in groups of 128 =
//                    16 lanes); warp 1: k_pe (lanes 0-7, 8 values each, RoPE); warp 2: the indexer
//                    key (lanes 0-15, 8 values each: LayerNorm, RoPE on lanes 0-7, fp8). No block
//                    barrier: the three warps of a kv block are independent.
//   role 2 (top-k):  the block writes -1 over the row, 16 bytes per store.
// A chunk of 8 bf16 is one 16-byte load or store wherever the view allows it (unit inner stride,
// 16-byte aligned base and row stride); other views take an element-wise path.
inline constexpr int kThreads = 96;
inline constexpr int kWarps = kThreads / 32;
inline constexpr int kChunk = 8;                                  // bf16 per 16 bytes
inline constexpr int kQChunksPerThread = kMlaQLoraRank / kChunk / kThreads;  // 2
inline constexpr int kQRowsPerIteration = 2;  // query rows a block loads before one reduction
// Blocks per role launched for a large batch: this many times what the GPU holds at once, so the
// block scheduler balances the roles' different lengths (a block walks rows until the batch ends).
inline constexpr int kWaves = 8;
// Register cap through __launch_bounds__: 10 blocks of 96 threads per SM leave 64 registers per
// thread, what the query role needs without spilling (a cap for 11 blocks spills; without a cap
// ptxas takes 72, i.e. 9 blocks per SM).
inline constexpr int kMinBlocksPerSm = 10;

static_assert(kMlaQLoraRank == kQChunksPerThread * kThreads * kChunk,
              "dcpattn: the query role assumes 1536 = 2 chunks x 96 threads x 8");
static_assert(kMlaLatentDim == 2 * 32 * kChunk, "dcpattn: the latent is 2 chunks per lane of a warp");
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
  const bool rows_ok =
      v.extent(0) == 1 || (r.row_stride * std::int64_t(sizeof(T))) % 16 == 0;
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

  int roles = 2;  // 3 with a top-k buffer
  Rows<std::int32_t> topk;
  std::int64_t topk_k = 0;

  float rms_eps = 1e-6f;
  float ln_eps = 1e-6f;
};
static_assert(sizeof(Params<CacheFormat::bf16>) <= 4096 && sizeof(Params<CacheFormat::fp8_ds_mla>) <= 4096,
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
DCPATTN_DEVICE std::uint32_t pack_bf16x2(float lo, float hi) {
  return std::uint32_t(bfloat16::from_float(lo).bits) |
         (std::uint32_t(bfloat16::from_float(hi).bits) << 16);
}
DCPATTN_DEVICE uint4 pack_bf16x8(const float (&f)[8]) {
  return make_uint4(pack_bf16x2(f[0], f[1]), pack_bf16x2(f[2], f[3]), pack_bf16x2(f[4], f[5]),
                    pack_bf16x2(f[6], f[7]));
}

/// Chunk of 8 values of a streamed (read-once) row, starting at column c0 (a multiple of 8).
DCPATTN_DEVICE void load_row8(const Rows<const bfloat16>& m, std::int64_t row, int c0,
                              float (&f)[8]) {
  const bfloat16* p = m.data + row * m.row_stride;
  if (m.vec) {
    unpack_bf16x8(__ldcs(reinterpret_cast<const uint4*>(p + c0)), f);
  } else {
#pragma unroll
    for (int k = 0; k < 8; ++k) f[k] = p[std::int64_t(c0 + k) * m.col_stride].to_float();
  }
}
/// Chunk of 8 values of a weight vector (read by every block: through the read-only cache).
/// An absent vector (null) reads as zeros.
DCPATTN_DEVICE void load_weight8(const Vec1<const bfloat16>& w, int c0, float (&f)[8]) {
  if (w.data == nullptr) {
#pragma unroll
    for (int k = 0; k < 8; ++k) f[k] = 0.0f;
  } else if (w.vec) {
    unpack_bf16x8(__ldg(reinterpret_cast<const uint4*>(w.data + c0)), f);
  } else {
#pragma unroll
    for (int k = 0; k < 8; ++k) f[k] = w.data[std::int64_t(c0 + k) * w.stride].to_float();
  }
}
/// Stores 8 values, rounded to bf16, at columns [c0, c0 + 8) of row `row`.
DCPATTN_DEVICE void store_row8(const Rows<bfloat16>& m, std::int64_t row, int c0,
                               const float (&f)[8]) {
  bfloat16* p = m.data + row * m.row_stride;
  if (m.vec) {
    *reinterpret_cast<uint4*>(p + c0) = pack_bf16x8(f);
  } else {
#pragma unroll
    for (int k = 0; k < 8; ++k) p[std::int64_t(c0 + k) * m.col_stride] = bfloat16::from_float(f[k]);
  }
}
/// Stores `n` bytes (4, 8 or 16, given as words) at byte column c0 of a byte row; `vec` rows take
/// one store (c0 must then be aligned to n), others byte by byte.
template <int N>
DCPATTN_DEVICE void store_bytes(const Rows<std::uint8_t>& m, std::uint8_t* row_ptr, std::int64_t c0,
                                const std::uint32_t (&words)[N / 4]) {
  static_assert(N == 4 || N == 8 || N == 16);
  if (m.vec) {
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
template <int N>
DCPATTN_DEVICE void load_cos_sin(const Rows<const float>& cs, std::int64_t pos, int i0,
                                 float (&c)[N], float (&s)[N]) {
  constexpr int half = kMlaRopeDim / 2;
  const float* row = cs.data + pos * cs.row_stride;
  if (cs.vec) {
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

/// The cosines and sines lane `lane` (< 8) needs for rope64_bf16 at position `pos`: pairs 4l ..
/// 4l + 3 (interleaved, c[0..3]) or 8(l % 4) .. 8(l % 4) + 7 (neox). Split from the rotation so
/// that the loads go out together with the row's own loads.
DCPATTN_DEVICE void load_rope_cos_sin(int lane, RopeStyle style, const Rows<const float>& cs,
                                      std::int64_t pos, float (&c)[8], float (&s)[8]) {
  if (style == RopeStyle::interleaved) {
    float c4[4], s4[4];
    load_cos_sin<4>(cs, pos, 4 * lane, c4, s4);
#pragma unroll
    for (int k = 0; k < 4; ++k) c[k] = c4[k], s[k] = s4[k], c[k + 4] = s[k + 4] = 0.0f;
  } else {
    load_cos_sin<8>(cs, pos, 8 * (lane & 3), c, s);
  }
}

/// RoPE of 64 dims held by lanes 0-7 of a warp, lane l holding dims [8l, 8l + 8) in x (values of
/// bf16), with the cosines and sines of load_rope_cos_sin. Rotated values are rounded to bf16, as
/// the host's rope_row on a bf16 row. Lanes >= 8 keep x. Must be called by the whole warp (the
/// neox pairing exchanges values with lane ^ 4).
DCPATTN_DEVICE void rope64_bf16(float (&x)[8], int lane, RopeStyle style, const float (&c)[8],
                                const float (&s)[8]) {
  if (style == RopeStyle::interleaved) {
    // Pair i = (2i, 2i + 1): lane l holds pairs 4l .. 4l + 3 entirely.
    if (lane < 8) {
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const RopePair r = rope_pair_rn(x[2 * m], x[2 * m + 1], c[m], s[m]);
        x[2 * m] = round_to_bf16(r.x0);
        x[2 * m + 1] = round_to_bf16(r.x1);
      }
    }
  } else {
    // Pair i = (i, i + 32): lane l < 4 holds the first members of pairs 8l .. 8l + 7, lane l + 4
    // the second members of the same pairs.
    float other[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) other[k] = __shfl_xor_sync(kFullMask, x[k], 4);
    if (lane < 8) {
      const bool first = lane < 4;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const RopePair r = first ? rope_pair_rn(x[k], other[k], c[k], s[k])
                                 : rope_pair_rn(other[k], x[k], c[k], s[k]);
        x[k] = round_to_bf16(first ? r.x0 : r.x1);
      }
    }
  }
}

/// e4m3 codes of 8 values divided by `scale` (IEEE division, as the host), packed little-endian.
DCPATTN_DEVICE void encode_fp8x8(const float (&y)[8], float scale, std::uint32_t (&w)[2]) {
  w[0] = w[1] = 0;
#pragma unroll
  for (int k = 0; k < 8; ++k)
    w[k / 4] |= std::uint32_t(fp8_e4m3::encode(__fdiv_rn(y[k], scale))) << (8 * (k % 4));
}

/// Slot and position of row `row` if its cache entries are to be written: 0 <= slot < num_slots,
/// within the indexer cache when the indexer is on, and 0 <= position < max_position. A row
/// failing any of these (slot -1: another rank's token; anything else: an invalid value, which the
/// host reference refuses and this kernel cannot report without a synchronization) writes neither
/// cache and reads nothing at its slot or through its position.
template <CacheFormat F>
DCPATTN_DEVICE bool writable_row(const Params<F>& p, std::int64_t row, std::int64_t& slot,
                                 std::int64_t& pos) {
  // Both loads in flight together: positions[row] is always readable (row < T), only its value
  // is subject to the slot.
  slot = p.slots.data[row * p.slots.stride];
  pos = p.positions.data[row * p.positions.stride];
  if (slot < 0 || slot >= p.num_slots) return false;
  if (p.indexer && slot / p.index_page_size >= p.index_pages) return false;
  return pos >= 0 && pos < p.max_position;
}

// ---- roles ----

/// q_c_out[t] = bf16(q_c[t] * rms_norm_scale * q_norm_weight) for every row t, slot or no slot.
/// Two rows per iteration (t and t + row_step), so that each thread has four 16-byte loads in
/// flight. In place (q_c_out == q_c) is safe: each thread writes only the elements it has read.
template <CacheFormat F>
__device__ void query_role(const Params<F>& p, std::int64_t first_row, std::int64_t row_step) {
  constexpr int R = kQRowsPerIteration;
  __shared__ float partial[2][R][kWarps];  // double-buffered: one barrier per iteration
  const int tid = int(threadIdx.x);
  const int warp = tid / 32, lane = tid % 32;
  // Weights stay packed (bf16 pairs) across rows: 8 registers instead of 16.
  std::uint32_t w[kQChunksPerThread][4];
#pragma unroll
  for (int j = 0; j < kQChunksPerThread; ++j) {
    float f[8];
    load_weight8(p.q_w, (tid + j * kThreads) * kChunk, f);
#pragma unroll
    for (int k = 0; k < 4; ++k) w[j][k] = pack_bf16x2(f[2 * k], f[2 * k + 1]);  // exact: bf16 values
  }

  int parity = 0;
  for (std::int64_t row0 = first_row; row0 < p.num_rows; row0 += R * row_step, parity ^= 1) {
    float x[R][kQChunksPerThread][8];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const std::int64_t row = row0 + r * row_step;
#pragma unroll
      for (int j = 0; j < kQChunksPerThread; ++j) {
        if (row < p.num_rows) {
          load_row8(p.q_c, row, (tid + j * kThreads) * kChunk, x[r][j]);
        } else {
#pragma unroll
          for (int k = 0; k < 8; ++k) x[r][j][k] = 0.0f;
        }
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float ss = 0.0f;
#pragma unroll
      for (int j = 0; j < kQChunksPerThread; ++j)
#pragma unroll
        for (int k = 0; k < 8; ++k) ss = fmaf(x[r][j][k], x[r][j][k], ss);
      ss = warp_sum<32>(ss);
      if (lane == 0) partial[parity][r][warp] = ss;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const std::int64_t row = row0 + r * row_step;
      if (row >= p.num_rows) break;
      float total = partial[parity][r][0];
#pragma unroll
      for (int k = 1; k < kWarps; ++k) total += partial[parity][r][k];
      const float scale = rms_norm_scale(total, kMlaQLoraRank, p.rms_eps);
#pragma unroll
      for (int j = 0; j < kQChunksPerThread; ++j) {
        float wf[8];
        unpack_bf16x8(make_uint4(w[j][0], w[j][1], w[j][2], w[j][3]), wf);
#pragma unroll
        for (int k = 0; k < 8; ++k) x[r][j][k] = __fmul_rn(__fmul_rn(x[r][j][k], scale), wf[k]);
        store_row8(p.q_out, row, (tid + j * kThreads) * kChunk, x[r][j]);
      }
    }
  }
}

/// Warp 0 of the kv role: latent = bf16(RMSNorm(kv_c[t]) * kv_norm_weight) into the cache entry,
/// as 512 bf16 or as 4 groups of 128 e4m3 codes with their fp32 scales (amax / 448).
/// Lane l holds chunks l and l + 32 (dims [8l, 8l + 8) and [256 + 8l, ...)): fp8 group g is held by
/// 16 lanes, groups 0 and 2 by lanes 0-15, 1 and 3 by lanes 16-31.
template <CacheFormat F>
__device__ void latent_warp(const Params<F>& p, int lane, std::int64_t first_row,
                            std::int64_t row_step) {
  float w[2][8];
#pragma unroll
  for (int j = 0; j < 2; ++j) load_weight8(p.kv_w, (lane + 32 * j) * kChunk, w[j]);
  for (std::int64_t row = first_row; row < p.num_rows; row += row_step) {
    std::int64_t slot, pos;
    if (!writable_row(p, row, slot, pos)) continue;  // uniform across the warp
    float x[2][8];
#pragma unroll
    for (int j = 0; j < 2; ++j) load_row8(p.kv_c, row, (lane + 32 * j) * kChunk, x[j]);
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int k = 0; k < 8; ++k) ss = fmaf(x[j][k], x[j][k], ss);
    ss = warp_sum<32>(ss);
    const float scale = rms_norm_scale(ss, kMlaLatentDim, p.rms_eps);
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int k = 0; k < 8; ++k)
        x[j][k] = round_to_bf16(__fmul_rn(__fmul_rn(x[j][k], scale), w[j][k]));

    if constexpr (F == CacheFormat::bf16) {
#pragma unroll
      for (int j = 0; j < 2; ++j) store_row8(p.kv_cache, slot, (lane + 32 * j) * kChunk, x[j]);
    } else {
      std::uint8_t* entry = p.kv_cache.data + slot * p.kv_cache.row_stride;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        float amax = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const float a = fabsf(x[j][k]);
          amax = a > amax ? a : amax;
        }
        amax = warp_max<16>(amax);
        const float gscale = fp8_group_scale(amax);
        std::uint32_t codes[2];
        encode_fp8x8(x[j], gscale, codes);
        store_bytes<8>(p.kv_cache, entry, std::int64_t(lane + 32 * j) * kChunk, codes);
        if ((lane & 15) == 0) {
          const int g = 2 * j + lane / 16;
          const std::uint32_t bits[1] = {cuda::std::bit_cast<std::uint32_t>(gscale)};
          store_bytes<4>(p.kv_cache, entry, DsMlaFp8Entry::scales_offset + 4 * g, bits);
        }
      }
    }
  }
}

/// Warp 1 of the kv role: rope = bf16(RoPE(k_pe[t], positions[t], kv_rope_style)) into cache
/// columns [512, 576) (bf16) or bytes [528, 656) of the fp8 entry. Lanes 0-7, 8 values each.
template <CacheFormat F>
__device__ void kpe_warp(const Params<F>& p, int lane, std::int64_t first_row,
                         std::int64_t row_step) {
  for (std::int64_t row = first_row; row < p.num_rows; row += row_step) {
    std::int64_t slot, pos;
    if (!writable_row(p, row, slot, pos)) continue;
    float x[8] = {}, cos_v[8] = {}, sin_v[8] = {};
    if (lane < 8) {
      load_row8(p.k_pe, row, lane * kChunk, x);
      load_rope_cos_sin(lane, p.kv_rope_style, p.cos_sin, pos, cos_v, sin_v);
    }
    rope64_bf16(x, lane, p.kv_rope_style, cos_v, sin_v);
    if (lane < 8) {
      if constexpr (F == CacheFormat::bf16) {
        store_row8(p.kv_cache, slot, kMlaLatentDim + lane * kChunk, x);
      } else {
        const uint4 v = pack_bf16x8(x);
        const std::uint32_t words[4] = {v.x, v.y, v.z, v.w};
        std::uint8_t* entry = p.kv_cache.data + slot * p.kv_cache.row_stride;
        store_bytes<16>(p.kv_cache, entry, DsMlaFp8Entry::rope_offset + 16 * lane, words);
      }
    }
  }
}

/// Warp 2 of the kv role: key = bf16(LayerNorm(index_k[t])) (two passes: mean, then the squared
/// deviations, as the host), dims [0, 64) rotated (index_rope_style) and rounded to bf16, then 128
/// e4m3 codes with one fp32 scale (amax / 448) at the slot's place in its page. Lanes 0-15, 8
/// values each; lanes 16-31 carry zeros through the (16-lane) reductions.
template <CacheFormat F>
__device__ void indexer_warp(const Params<F>& p, int lane, std::int64_t first_row,
                             std::int64_t row_step) {
  if (!p.indexer) return;
  const int c0 = (lane & 15) * kChunk;
  for (std::int64_t row = first_row; row < p.num_rows; row += row_step) {
    std::int64_t slot, pos;
    if (!writable_row(p, row, slot, pos)) continue;
    float x[8] = {}, cos_v[8] = {}, sin_v[8] = {};
    if (lane < 16) load_row8(p.index_k, row, c0, x);
    if (lane < 8) load_rope_cos_sin(lane, p.index_rope_style, p.cos_sin, pos, cos_v, sin_v);
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) sum += x[k];
    sum = warp_sum<16>(sum);
    const float mean = __fdiv_rn(sum, float(kIndexerHeadDim));
    float m2 = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float d = __fsub_rn(x[k], mean);
      m2 = fmaf(d, d, m2);
    }
    m2 = warp_sum<16>(m2);
    const float inv_std = layer_norm_inv_std(m2, kIndexerHeadDim, p.ln_eps);
    // The weights are re-read per row (L1 hits) rather than held in registers across rows.
    float w[8], b[8];
    load_weight8(p.ik_w, c0, w);
    load_weight8(p.ik_b, c0, b);
#pragma unroll
    for (int k = 0; k < 8; ++k)
      x[k] = round_to_bf16(
          __fadd_rn(__fmul_rn(__fmul_rn(__fsub_rn(x[k], mean), inv_std), w[k]), b[k]));
    rope64_bf16(x, lane, p.index_rope_style, cos_v, sin_v);

    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float a = fabsf(x[k]);
      amax = a > amax ? a : amax;
    }
    amax = warp_max<16>(amax);
    const float scale = fp8_group_scale(amax);
    if (lane < 16) {
      const std::int64_t ps = p.index_page_size;
      std::uint8_t* page = p.index_cache.data + (slot / ps) * p.index_cache.row_stride;
      const std::int64_t in_page = slot % ps;
      std::uint32_t codes[2];
      encode_fp8x8(x, scale, codes);
      store_bytes<8>(p.index_cache, page, IndexerKCacheLayout::value_offset(in_page, c0), codes);
      if (lane == 0) {
        const std::uint32_t bits[1] = {cuda::std::bit_cast<std::uint32_t>(scale)};
        store_bytes<4>(p.index_cache, page, IndexerKCacheLayout::scale_offset(ps, in_page), bits);
      }
    }
  }
}

/// topk_indices[t, :] = -1.
template <CacheFormat F>
__device__ void topk_role(const Params<F>& p, std::int64_t first_row, std::int64_t row_step) {
  const int tid = int(threadIdx.x);
  const std::int64_t k_total = p.topk_k;
  for (std::int64_t row = first_row; row < p.num_rows; row += row_step) {
    std::int32_t* r = p.topk.data + row * p.topk.row_stride;
    if (p.topk.vec) {
      const std::int64_t n4 = k_total / 4;
      for (std::int64_t j = tid; j < n4; j += kThreads)
        reinterpret_cast<int4*>(r)[j] = make_int4(-1, -1, -1, -1);
      for (std::int64_t j = 4 * n4 + tid; j < k_total; j += kThreads) r[j] = -1;
    } else {
      for (std::int64_t j = tid; j < k_total; j += kThreads) r[j * p.topk.col_stride] = -1;
    }
  }
}

template <CacheFormat F>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm) fused_prologue_kernel(const __grid_constant__ Params<F> p) {
  const int role = int(blockIdx.x % unsigned(p.roles));
  const std::int64_t first_row = blockIdx.x / unsigned(p.roles);
  const std::int64_t row_step = gridDim.x / unsigned(p.roles);
  if (role == 0) {
    query_role(p, first_row, row_step);
  } else if (role == 1) {
    const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
    if (warp == 0)
      latent_warp(p, lane, first_row, row_step);
    else if (warp == 1)
      kpe_warp(p, lane, first_row, row_step);
    else
      indexer_warp(p, lane, first_row, row_step);
  } else {
    topk_role(p, first_row, row_step);
  }
}

#endif  // DCPATTN_IS_CUDA_COMPILER

// ---- host side ----

/// The extent checks of host::detail::validate_prologue, i.e. everything that can be checked
/// without reading device memory (slot and position VALUES are left to the kernel, which skips a
/// row's cache writes when they are out of range), plus non-null data for the required views.
template <class KvCacheView>
void validate_extents(const PrologueArgs<KvCacheView>& a) {
  using host::detail::require_1d;
  using host::detail::require_2d;
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
    p.roles = 3;
    p.topk = rows_of<std::int32_t>(a.topk_indices);
    p.topk_k = a.topk_indices.extent(1);
  }
  p.rms_eps = a.rms_norm_eps;
  p.ln_eps = a.layer_norm_eps;
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
  const d::Params<format> params = d::make_params<format>(args);

  int device = 0, sms = 0;
  DCPATTN_CUDA_CHECK(cudaGetDevice(&device));
  DCPATTN_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  // Rows per block: 1 while the batch is small (T = 64 decode: every row gets its own blocks), up
  // to T / (kWaves x resident blocks) for large batches. Residency is taken from the register cap
  // (at least kMinBlocksPerSm blocks per SM) rather than queried: no runtime call that a graph
  // capture could object to.
  const std::int64_t resident = std::int64_t(sms) * d::kMinBlocksPerSm;
  const std::int64_t row_blocks =
      std::min<std::int64_t>(T, std::max<std::int64_t>(1, d::kWaves * resident / params.roles));
  const dim3 grid(unsigned(row_blocks * params.roles));
  d::fused_prologue_kernel<format><<<grid, d::kThreads, 0, stream>>>(params);
  DCPATTN_CUDA_CHECK(cudaGetLastError());
}

#endif  // __CUDACC__

}  // namespace cuda_kernels

DCPATTN_NAMESPACE_END
