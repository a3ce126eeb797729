// SPDX-License-Identifier: Apache-2.0
// CUDA kernels of the combine steps (packing partial states for the exchange, merging the received
// states, the all-gather/reduce-scatter rescale) and of the small per-forward steps around the
// attention kernel (query pack, per-row local lengths, LSE sanitizing, fp32 -> output rounding).
//
// Each launcher computes what its host counterpart in dcpattn/kernels/host/combine.hpp (or
// dcpattn/exec/host.hpp) computes, with the same fp32 operations in the same order: the shared
// DCPATTN_HOST_DEVICE functions of dcpattn/core/lse.hpp for every LSE merge and weight, and
// explicitly rounded products and sums (__fmul_rn, __fadd_rn) for the element updates, so the
// compiler cannot contract a product and a sum into an FMA. A result therefore equals the host
// function's bit for bit wherever no exp/log is involved (copies, sanitizing, conversions, empty
// or single-state merges); elsewhere the two differ only by the ulp-level gap between the CUDA
// math library's expf/logf and the host libm's. Every CUDA kernel of dcpattn shares the same
// expf/logf, so device results are bitwise reproducible and DCP-invariant among themselves.
//
// Kernel design (memory-bound; one pass over the data): a warp owns one 128-column segment of one
// (token, head) row, one 4-column group per lane (16-byte fp32 / 8-byte bf16 vectors); Dv = 512
// is 4 segments. Blocks are 1 warp for small launches (T = 1, H_local = 16 still spreads over 64
// SMs) and 4 warps from 2048 segments on. LSE merges of a row are computed once per warp with
// shuffles and reused for all its columns. The o of a state whose weight is zero is never loaded.
//
// Every launcher is stream-ordered: no allocation, no host synchronization (CUDA-graph safe).
// Argument checks throw dcpattn::Error before anything is enqueued.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include <cuda/std/bit>
#include <cuda_runtime.h>

#include "dcpattn/config.hpp"
#include "dcpattn/core/lse.hpp"
#include "dcpattn/core/numeric.hpp"
#include "dcpattn/core/tensor.hpp"
#include "dcpattn/error.hpp"
#include "dcpattn/kernels/host/combine.hpp"
#include "dcpattn/op/config.hpp"

DCPATTN_NAMESPACE_BEGIN

namespace cuda_kernels {
namespace detail {

inline constexpr unsigned kFullMask = 0xffffffffu;
inline constexpr int kWarpSize = 32;
/// Columns per lane (one 16-byte fp32 vector).
inline constexpr int kLaneColumns = 4;
/// Columns per warp: one segment of a row.
inline constexpr int kSegmentColumns = kWarpSize * kLaneColumns;
/// Largest group size of the deterministic (register tree) merge.
inline constexpr int kMaxTreeStates = 32;
/// Threads per block of the flat (one element or vector per thread) kernels.
inline constexpr int kFlatBlock = 128;

/// A rank-3 strided view reduced to what a kernel needs. `vec`: stride(2) == 1 and the other
/// strides and the base pointer allow 4-element vector access.
template <class T>
struct Strided3 {
  T* ptr;
  std::int64_t s0, s1, s2;
  bool vec;

  DCPATTN_DEVICE T* at(std::int64_t i0, std::int64_t i1, std::int64_t i2) const {
    return ptr + i0 * s0 + i1 * s1 + i2 * s2;
  }
};

/// A rank-2 strided view (null ptr = absent).
template <class T>
struct Strided2 {
  T* ptr;
  std::int64_t s0, s1;

  DCPATTN_DEVICE T& operator()(std::int64_t i0, std::int64_t i1) const {
    return ptr[i0 * s0 + i1 * s1];
  }
};

inline bool aligned_to(const void* p, std::size_t bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
}

/// Whether a view allows vectors of `v` elements along its last dimension.
template <class View>
bool vectorizable(const View& x, int v) {
  constexpr std::size_t r = View::rank();
  if (x.stride(r - 1) != 1 && x.extent(r - 1) > 1) return false;
  if (x.extent(r - 1) % v != 0) return false;
  for (std::size_t i = 0; i + 1 < r; ++i)
    if (x.extent(i) > 1 && x.stride(i) % v != 0) return false;
  return aligned_to(x.data_handle(), v * sizeof(typename View::element_type));
}

template <class T>
Strided3<T> strided(const TensorView<T, 3>& v) {
  return {v.data_handle(), v.stride(0), v.stride(1), v.stride(2), vectorizable(v, kLaneColumns)};
}
template <class T>
Strided2<T> strided(const TensorView<T, 2>& v) {
  if (v.data_handle() == nullptr) return {nullptr, 0, 0};
  return {v.data_handle(), v.stride(0), v.stride(1)};
}

/// Raises the last launch error (a bad configuration), if any.
inline void check_launch(const char* kernel) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw Error(std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e),
                std::string("launch of ") + kernel);
}

/// Grid of `warps` warps: 1-warp blocks for small launches, so few rows still spread over many
/// SMs; 4-warp blocks otherwise (1-warp blocks would cap residency at 32 warps per SM).
struct WarpGrid {
  dim3 grid;
  dim3 block;
};
inline WarpGrid warp_grid(std::int64_t warps) {
  const std::int64_t per_block = warps >= 2048 ? 4 : 1;
  return {dim3(unsigned((warps + per_block - 1) / per_block)), dim3(unsigned(per_block * kWarpSize))};
}
inline dim3 flat_grid(std::int64_t items) {
  return dim3(unsigned((items + kFlatBlock - 1) / kFlatBlock));
}

DCPATTN_DEVICE std::int64_t global_warp() {
  return (std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
}
DCPATTN_DEVICE std::int64_t global_thread() {
  return std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
}

/// Four consecutive values as fp32.
struct Vec4 {
  float v[4];
};
DCPATTN_DEVICE Vec4 zero4() { return Vec4{{0.0f, 0.0f, 0.0f, 0.0f}}; }

/// Loads 4 consecutive elements (float or bfloat16) starting at p (vector load when aligned).
DCPATTN_DEVICE Vec4 load4_contiguous(const float* p) {
  const float4 x = *reinterpret_cast<const float4*>(p);
  return Vec4{{x.x, x.y, x.z, x.w}};
}
DCPATTN_DEVICE Vec4 load4_contiguous(const bfloat16* p) {
  const uint2 x = *reinterpret_cast<const uint2*>(p);
  return Vec4{{bfloat16{std::uint16_t(x.x & 0xffffu)}.to_float(),
               bfloat16{std::uint16_t(x.x >> 16)}.to_float(),
               bfloat16{std::uint16_t(x.y & 0xffffu)}.to_float(),
               bfloat16{std::uint16_t(x.y >> 16)}.to_float()}};
}
/// Stores 4 values rounded to T at p, contiguous (vector store; p aligned to 4 elements).
DCPATTN_DEVICE void store4_contiguous(float* p, const Vec4& a) {
  *reinterpret_cast<float4*>(p) = make_float4(a.v[0], a.v[1], a.v[2], a.v[3]);
}
DCPATTN_DEVICE void store4_contiguous(bfloat16* p, const Vec4& a) {
  const std::uint32_t b0 = bfloat16::from_float(a.v[0]).bits, b1 = bfloat16::from_float(a.v[1]).bits;
  const std::uint32_t b2 = bfloat16::from_float(a.v[2]).bits, b3 = bfloat16::from_float(a.v[3]).bits;
  *reinterpret_cast<uint2*>(p) = make_uint2(b0 | (b1 << 16), b2 | (b3 << 16));
}

/// Elements (i0, i1, c .. c + 3) of a strided view.
template <class T>
DCPATTN_DEVICE Vec4 load4(const Strided3<const T>& x, std::int64_t i0, std::int64_t i1,
                          std::int64_t c) {
  if (x.vec) return load4_contiguous(x.at(i0, i1, c));
  Vec4 r;
#pragma unroll
  for (int k = 0; k < 4; ++k) r.v[k] = to_float(*x.at(i0, i1, c + k));
  return r;
}
template <class T>
DCPATTN_DEVICE void store4(const Strided3<T>& x, std::int64_t i0, std::int64_t i1, std::int64_t c,
                           const Vec4& a) {
  if (x.vec) {
    store4_contiguous(x.at(i0, i1, c), a);
    return;
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) *x.at(i0, i1, c + k) = from_float<T>(a.v[k]);
}

/// weighted(w, o) of dcpattn/core/lse.hpp with an explicitly rounded product.
DCPATTN_DEVICE float weighted_rn(float w, float o) { return w != 0.0f ? __fmul_rn(w, o) : 0.0f; }

/// One element of merge_state_into (dcpattn/core/lse.hpp), same operations, no contraction.
DCPATTN_DEVICE float merge_element(float oa, float ob, float wa, float wb) {
  const float ta = weighted_rn(wa, oa);
  const float tb = weighted_rn(wb, ob);
  return wb == 0.0f ? ta : (wa == 0.0f ? tb : __fadd_rn(ta, tb));
}

/// merge_lse_n (dcpattn/core/lse.hpp) evaluated by a whole warp, the same value on every lane:
/// the maximum (order-free for sanitized inputs), then the exponentials in parallel, summed
/// sequentially in index order as on the host. Needs all 32 lanes.
template <class LseAt>
DCPATTN_DEVICE float warp_merge_lse_n(const LseAt& lse_at, int n, int lane) {
  float m = lse_neg_inf;
  for (int r = lane; r < n; r += kWarpSize) {
    const float x = lse_at(r);
    m = x > m ? x : m;
  }
#pragma unroll
  for (int off = kWarpSize / 2; off >= 1; off >>= 1) {
    const float y = __shfl_xor_sync(kFullMask, m, off);
    m = y > m ? y : m;
  }
  if (m == lse_neg_inf) return lse_neg_inf;
  float sum = 0.0f;
  for (int c0 = 0; c0 < n; c0 += kWarpSize) {
    const int r = c0 + lane;
    const float e = r < n ? cuda::std::exp(lse_at(r) - m) : 0.0f;
    const int count = n - c0 < kWarpSize ? n - c0 : kWarpSize;
    for (int j = 0; j < count; ++j) sum = __fadd_rn(sum, __shfl_sync(kFullMask, e, j));
  }
  return m + cuda::std::log(sum);
}

// ---------------------------------------------------------------------------------------------
// Kernels

/// Query pack: dst (contiguous) = src (strided), V elements per thread (V = 1: scalar path).
template <class T, int V>
__global__ void pack_kernel(Strided3<const T> src, T* __restrict__ dst, std::int64_t e1,
                            std::int64_t e2, std::int64_t total_vectors) {
  const std::int64_t i = global_thread();
  if (i >= total_vectors) return;
  const std::int64_t per_row = e2 / V;
  const std::int64_t c = (i % per_row) * V;
  const std::int64_t b = (i / per_row) % e1;
  const std::int64_t a = i / (per_row * e1);
  if constexpr (V == 1) {
    dst[i] = *src.at(a, b, c);
  } else {
    static_assert(sizeof(T) * V == 16, "dcpattn: pack vectors are 16 bytes");
    reinterpret_cast<uint4*>(dst)[i] = *reinterpret_cast<const uint4*>(src.at(a, b, c));
  }
}

template <class Ownership>
__global__ void row_local_lengths_kernel(Ownership own, int rank, const std::int64_t* bound,
                                         std::int64_t bound_stride, int num_valid_rows,
                                         std::int64_t* out, std::int64_t rows) {
  const std::int64_t t = global_thread();
  if (t >= rows) return;
  out[t] = t < num_valid_rows ? std::int64_t(own.local_length(bound[t * bound_stride], rank)) : 0;
}

template <class Base>
__global__ void sanitize_lse_rows_kernel(Strided2<const float> lse, std::int64_t heads,
                                         int num_valid_rows, float* __restrict__ dst,
                                         std::int64_t total) {
  const std::int64_t i = global_thread();
  if (i >= total) return;
  const std::int64_t t = i / heads, h = i % heads;
  dst[i] = t < num_valid_rows ? sanitize_lse(lse(t, h), Base{}) : lse_neg_inf;
}

/// out (strided, OutT) = src contiguous fp32, 4 elements per thread.
template <class OutT>
__global__ void convert_rows_kernel(const float* __restrict__ src, Strided3<OutT> out,
                                    std::int64_t e1, std::int64_t e2, std::int64_t total_vectors) {
  const std::int64_t i = global_thread();
  if (i >= total_vectors) return;
  const std::int64_t per_row = e2 / kLaneColumns;
  const std::int64_t c = (i % per_row) * kLaneColumns;
  const std::int64_t b = (i / per_row) % e1;
  const std::int64_t a = i / (per_row * e1);
  store4(out, a, b, c, load4_contiguous(src + i * kLaneColumns));
}
/// Scalar fallback of convert_rows for a last dimension that is not a multiple of 4.
template <class OutT>
__global__ void convert_rows_scalar_kernel(const float* __restrict__ src, Strided3<OutT> out,
                                           std::int64_t e1, std::int64_t e2, std::int64_t total) {
  const std::int64_t i = global_thread();
  if (i >= total) return;
  const std::int64_t c = i % e2, b = (i / e2) % e1, a = i / (e2 * e1);
  *out.at(a, b, c) = from_float<OutT>(src[i]);
}

/// Arguments shared by the warp-per-segment combine kernels.
struct SegmentGrid {
  std::int64_t rows;   ///< (token, head) rows covered
  int segments;        ///< segments per row: ceil(dv / 128)
  int dv;
  std::int64_t total;  ///< rows * segments = warps
};

/// combine_pack_a2a: one warp per (t, h, segment) of the local partial (all H heads).
template <class Base, class PartT>
__global__ void pack_a2a_kernel(Strided3<const float> o, Strided2<const float> lse,
                                int num_valid_rows, int heads, int heads_local, SegmentGrid g,
                                std::byte* __restrict__ send, std::size_t chunk_bytes,
                                std::size_t lse_offset) {
  const std::int64_t w = global_warp();
  if (w >= g.total) return;
  const int lane = int(threadIdx.x % kWarpSize);
  const std::int64_t row = w / g.segments;
  const int seg = int(w % g.segments);
  const std::int64_t t = row / heads;
  const int h = int(row % heads);
  const int d = h / heads_local, hh = h % heads_local;
  const float l = t < num_valid_rows ? sanitize_lse(lse(t, h), Base{}) : lse_neg_inf;
  std::byte* chunk = send + std::size_t(d) * chunk_bytes;
  const std::int64_t out_row = t * heads_local + hh;
  if (seg == 0 && lane == 0) reinterpret_cast<float*>(chunk + lse_offset)[out_row] = l;
  const std::int64_t col = std::int64_t(seg) * kSegmentColumns + lane * kLaneColumns;
  if (col >= g.dv) return;
  // An empty state travels as o = 0; its o (padding garbage, an empty row's NaN) is not read.
  const Vec4 v = l == lse_neg_inf ? zero4() : load4(o, t, h, col);
  store4_contiguous(reinterpret_cast<PartT*>(chunk) + out_row * g.dv + col, v);
}

/// Loads rank r's o of (row, col) from the received chunks.
template <class PartT>
DCPATTN_DEVICE Vec4 load_state(const std::byte* recv, std::size_t chunk_bytes, int r,
                               std::int64_t row, int dv, std::int64_t col) {
  return load4_contiguous(reinterpret_cast<const PartT*>(recv + std::size_t(r) * chunk_bytes) +
                          row * dv + col);
}
DCPATTN_DEVICE float load_state_lse(const std::byte* recv, std::size_t chunk_bytes,
                                    std::size_t lse_offset, int r, std::int64_t row) {
  return reinterpret_cast<const float*>(recv + std::size_t(r) * chunk_bytes + lse_offset)[row];
}

/// Deterministic combine_merge_a2a for n <= MaxN states (n a power of two): tree_merge over the
/// rank index, one warp per (t, h_local, segment). Lane v computes the lse merges of state v
/// (level by level, highest bit first) and keeps their weights; every lane then replays the tree
/// on its 4 columns with the weights broadcast by shuffles.
template <class OutT, class PartT, int MaxN>
__global__ void merge_a2a_tree_kernel(const std::byte* __restrict__ recv, std::size_t chunk_bytes,
                                      std::size_t lse_offset, int n, int heads_local,
                                      SegmentGrid g, Strided3<OutT> out, Strided2<float> out_lse) {
  static_assert(MaxN >= 2 && MaxN <= kMaxTreeStates && (MaxN & (MaxN - 1)) == 0);
  constexpr int kLevels = int(cuda::std::bit_width(unsigned(MaxN))) - 1;
  const std::int64_t w = global_warp();
  if (w >= g.total) return;  // whole warps only: the shuffles below need all 32 lanes
  const int lane = int(threadIdx.x % kWarpSize);
  const std::int64_t row = w / g.segments;
  const int seg = int(w % g.segments);

  const float my_lse =
      lane < n ? load_state_lse(recv, chunk_bytes, lse_offset, lane, row) : lse_neg_inf;
  float wa[kLevels], wb[kLevels];
  float cur = my_lse;
#pragma unroll
  for (int li = kLevels - 1; li >= 0; --li) {
    const int half = 1 << li;
    wa[li] = 0.0f;
    wb[li] = 0.0f;
    if (half < n) {
      const float other = __shfl_down_sync(kFullMask, cur, half);
      if (lane < half) {
        const MergeWeights mw = merge_lse(cur, other);
        wa[li] = mw.w_a;
        wb[li] = mw.w_b;
        cur = mw.lse;
      }
    }
  }
  const float merged = __shfl_sync(kFullMask, cur, 0);

  const std::int64_t col = std::int64_t(seg) * kSegmentColumns + lane * kLaneColumns;
  const bool active = col < g.dv;
  Vec4 s[MaxN];
#pragma unroll
  for (int r = 0; r < MaxN; ++r) {
    const float lr = __shfl_sync(kFullMask, my_lse, r);
    s[r] = zero4();
    // An empty state's o is never read: the tree gives it weight 0 at every level.
    if (r < n && active && lr != lse_neg_inf)
      s[r] = load_state<PartT>(recv, chunk_bytes, r, row, g.dv, col);
  }
  // Constant trip counts everywhere, so the loops unroll fully and s[], wa[], wb[] stay in
  // registers.
#pragma unroll
  for (int li = kLevels - 1; li >= 0; --li) {
    const int half = 1 << li;
    if (half < n) {
#pragma unroll
      for (int v = 0; v < MaxN / 2; ++v) {
        if (v < half) {
          const float a = __shfl_sync(kFullMask, wa[li], v);
          const float b = __shfl_sync(kFullMask, wb[li], v);
#pragma unroll
          for (int k = 0; k < 4; ++k)
            s[v].v[k] = merge_element(s[v].v[k], s[v + half].v[k], a, b);
        }
      }
    }
  }
  const std::int64_t t = row / heads_local;
  const int hh = int(row % heads_local);
  if (active) store4(out, t, hh, col, s[0]);
  if (out_lse.ptr != nullptr && seg == 0 && lane == 0) out_lse(t, hh) = merged;
}

/// Deterministic n = 1: the output is the one received state, rounded to OutT (0 when empty).
/// (Fast mode with n = 1 runs the general kernel: its 0 + 1 * o turns o = -0 into +0, as the
/// host does.)
template <class OutT, class PartT>
__global__ void merge_a2a_single_kernel(const std::byte* __restrict__ recv, std::size_t lse_offset,
                                        int heads_local, SegmentGrid g, Strided3<OutT> out,
                                        Strided2<float> out_lse) {
  const std::int64_t w = global_warp();
  if (w >= g.total) return;
  const int lane = int(threadIdx.x % kWarpSize);
  const std::int64_t row = w / g.segments;
  const int seg = int(w % g.segments);
  const float l = load_state_lse(recv, 0, lse_offset, 0, row);
  const std::int64_t t = row / heads_local;
  const int hh = int(row % heads_local);
  if (out_lse.ptr != nullptr && seg == 0 && lane == 0) out_lse(t, hh) = l;
  const std::int64_t col = std::int64_t(seg) * kSegmentColumns + lane * kLaneColumns;
  if (col >= g.dv) return;
  store4(out, t, hh, col, l == lse_neg_inf ? zero4() : load_state<PartT>(recv, 0, 0, row, g.dv, col));
}

/// Fast-mode combine_merge_a2a, any n: one N-way log-sum-exp per row, then the weighted sum over
/// the states in rank order (as the host), 8 state loads in flight per lane.
template <class OutT, class PartT>
__global__ void merge_a2a_sum_kernel(const std::byte* __restrict__ recv, std::size_t chunk_bytes,
                                     std::size_t lse_offset, int n, int heads_local, SegmentGrid g,
                                     Strided3<OutT> out, Strided2<float> out_lse) {
  constexpr int kBatch = 8;
  const std::int64_t w = global_warp();
  if (w >= g.total) return;  // whole warps only
  const int lane = int(threadIdx.x % kWarpSize);
  const std::int64_t row = w / g.segments;
  const int seg = int(w % g.segments);
  auto lse_at = [&](int r) { return load_state_lse(recv, chunk_bytes, lse_offset, r, row); };
  const float merged = warp_merge_lse_n(lse_at, n, lane);

  const std::int64_t col = std::int64_t(seg) * kSegmentColumns + lane * kLaneColumns;
  const bool active = col < g.dv;
  Vec4 acc = zero4();
  for (int c0 = 0; c0 < n; c0 += kWarpSize) {
    const int count = n - c0 < kWarpSize ? n - c0 : kWarpSize;
    const float my_w = lane < count ? merge_weight(lse_at(c0 + lane), merged) : 0.0f;
    for (int j0 = 0; j0 < count; j0 += kBatch) {
      Vec4 v[kBatch];
      float wv[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        wv[j] = __shfl_sync(kFullMask, my_w, j0 + j);  // j0 + j < 32
        v[j] = zero4();
        if (j0 + j < count && active && wv[j] != 0.0f)
          v[j] = load_state<PartT>(recv, chunk_bytes, c0 + j0 + j, row, g.dv, col);
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        if (j0 + j < count) {
#pragma unroll
          for (int k = 0; k < 4; ++k) acc.v[k] = __fadd_rn(acc.v[k], weighted_rn(wv[j], v[j].v[k]));
        }
      }
    }
  }
  const std::int64_t t = row / heads_local;
  const int hh = int(row % heads_local);
  if (active) store4(out, t, hh, col, acc);
  if (out_lse.ptr != nullptr && seg == 0 && lane == 0) out_lse(t, hh) = merged;
}

/// combine_rescale_agrs: one warp per (t, h, segment) of all H heads. (A template only so that
/// the header can be included by several translation units.)
template <int Unused = 0>
__global__ void rescale_agrs_kernel(Strided3<const float> o, const float* __restrict__ lse_all,
                                    int rank, int n, int heads, int heads_local, std::int64_t tokens,
                                    SegmentGrid g, float* __restrict__ packed, bool packed_vec,
                                    Strided2<float> out_lse) {
  const std::int64_t w = global_warp();
  if (w >= g.total) return;  // whole warps only
  const int lane = int(threadIdx.x % kWarpSize);
  const std::int64_t row = w / g.segments;  // t * heads + h
  const int seg = int(w % g.segments);
  const std::int64_t plane = tokens * heads;
  auto lse_at = [&](int r) { return lse_all[std::int64_t(r) * plane + row]; };
  const float total = warp_merge_lse_n(lse_at, n, lane);
  const float wt = merge_weight(lse_at(rank), total);
  const std::int64_t t = row / heads;
  const int h = int(row % heads);
  const int d = h / heads_local, hh = h % heads_local;
  if (d == rank && out_lse.ptr != nullptr && seg == 0 && lane == 0) out_lse(t, hh) = total;
  const std::int64_t col = std::int64_t(seg) * kSegmentColumns + lane * kLaneColumns;
  if (col >= g.dv) return;
  Vec4 v = zero4();  // weight 0: o is not read
  if (wt != 0.0f) {
    v = load4(o, t, h, col);
#pragma unroll
    for (int k = 0; k < 4; ++k) v.v[k] = weighted_rn(wt, v.v[k]);
  }
  float* dst = packed + ((std::int64_t(d) * tokens + t) * heads_local + hh) * g.dv + col;
  if (packed_vec) {
    store4_contiguous(dst, v);
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) dst[k] = v.v[k];
  }
}

inline SegmentGrid segment_grid(std::int64_t rows, std::int64_t dv) {
  SegmentGrid g{};
  g.rows = rows;
  g.dv = int(dv);
  g.segments = int((dv + kSegmentColumns - 1) / kSegmentColumns);
  g.total = rows * g.segments;
  return g;
}

inline void require_dv(std::int64_t dv, const char* step) {
  DCPATTN_REQUIRE(dv > 0 && dv % kLaneColumns == 0,
                  std::string(step) + ": head_dim_v (" + std::to_string(dv) +
                      ") must be a positive multiple of 4 for the CUDA combine kernels");
}
inline void require_aligned16(const void* p, const char* name, const char* step) {
  DCPATTN_REQUIRE(aligned_to(p, 16), std::string(step) + ": " + name +
                                         " must be 16-byte aligned (the operator workspace is "
                                         "256-byte aligned)");
}

}  // namespace detail

// -----------------------------------------------------------------------------------------------
// Launchers. Shapes: T tokens, H heads of the group, H_local = H / N, Dv value head dim (a
// multiple of 4; MLA: 512). LSE values are natural log unless a Base tag says otherwise.

/// Copies a strided (T, H, D) view into contiguous row-major `dst` (16-byte vectors when the
/// view's last dimension is contiguous and aligned, scalar otherwise). Bitwise a copy.
template <class T>
void pack(TensorView<const T, 3> src, T* dst, cudaStream_t stream) {
  const std::int64_t e0 = src.extent(0), e1 = src.extent(1), e2 = src.extent(2);
  const std::int64_t total = e0 * e1 * e2;
  if (total == 0) return;
  constexpr int kV = int(16 / sizeof(T));
  const detail::Strided3<const T> s{src.data_handle(), src.stride(0), src.stride(1), src.stride(2),
                                    false};
  if constexpr (16 % sizeof(T) == 0 && kV > 1) {
    if (detail::vectorizable(src, kV) && detail::aligned_to(dst, 16)) {
      detail::pack_kernel<T, kV><<<detail::flat_grid(total / kV), detail::kFlatBlock, 0, stream>>>(
          s, dst, e1, e2, total / kV);
      detail::check_launch("pack_kernel");
      return;
    }
  }
  detail::pack_kernel<T, 1><<<detail::flat_grid(total), detail::kFlatBlock, 0, stream>>>(s, dst, e1,
                                                                                      e2, total);
  detail::check_launch("pack_kernel");
}

/// out (T) = own.local_length(bound[t], rank) for t < num_valid_rows, 0 for padding rows (whose
/// bound is not read). `own` is passed to the kernel by value (trivially copyable, its members
/// DCPATTN_HOST_DEVICE).
template <class Ownership>
void row_local_lengths(const Ownership& own, int rank, TensorView<const std::int64_t, 1> bound,
                       int num_valid_rows, std::int64_t* out, cudaStream_t stream) {
  static_assert(std::is_trivially_copyable_v<Ownership>,
                "dcpattn: an ownership policy must be trivially copyable to reach a kernel");
  const std::int64_t rows = bound.extent(0);
  if (rows == 0) return;
  detail::row_local_lengths_kernel<<<detail::flat_grid(rows), detail::kFlatBlock, 0, stream>>>(
      own, rank, bound.data_handle(), bound.stride(0), num_valid_rows, out, rows);
  detail::check_launch("row_local_lengths_kernel");
}

/// dst (T, H) contiguous = sanitize_lse(lse(t, h), Base) for t < num_valid_rows, -inf on padding.
/// Bitwise the host's.
template <class Base>
void sanitize_lse_rows(TensorView<const float, 2> lse, int num_valid_rows, float* dst,
                       cudaStream_t stream) {
  const std::int64_t total = lse.extent(0) * lse.extent(1);
  if (total == 0) return;
  detail::sanitize_lse_rows_kernel<Base><<<detail::flat_grid(total), detail::kFlatBlock, 0, stream>>>(
      detail::strided(lse), lse.extent(1), num_valid_rows, dst, total);
  detail::check_launch("sanitize_lse_rows_kernel");
}

/// out (T, H_local, Dv) = src (T, H_local, Dv) contiguous fp32 rounded to OutT (float or
/// bfloat16, round to nearest even). Bitwise the host's.
template <class OutT>
void convert_rows(const float* src, TensorView<OutT, 3> out, cudaStream_t stream) {
  const std::int64_t e1 = out.extent(1), e2 = out.extent(2);
  const std::int64_t total = out.extent(0) * e1 * e2;
  if (total == 0) return;
  const detail::Strided3<OutT> o = detail::strided(out);
  if (e2 % detail::kLaneColumns == 0 && detail::aligned_to(src, 16)) {
    const std::int64_t vectors = total / detail::kLaneColumns;
    detail::convert_rows_kernel<OutT><<<detail::flat_grid(vectors), detail::kFlatBlock, 0, stream>>>(
        src, o, e1, e2, vectors);
  } else {
    detail::convert_rows_scalar_kernel<OutT>
        <<<detail::flat_grid(total), detail::kFlatBlock, 0, stream>>>(src, o, e1, e2, total);
  }
  detail::check_launch("convert_rows_kernel");
}

/// Packs the local partial state for the all-to-all, as host::combine_pack_a2a: o (T, H, Dv) fp32,
/// lse (T, H) in base Base. Rows t >= num_valid_rows and states whose lse is -inf, +inf or NaN go
/// out as the neutral element (o = 0, lse = -inf) without their o being read. send: group_size
/// chunks of layout.bytes, 16-byte aligned. Bitwise the host's.
template <class Base>
void combine_pack_a2a(TensorView<const float, 3> o, TensorView<const float, 2> lse,
                      int num_valid_rows, int group_size, PartialDtype dtype,
                      const ::dcpattn::detail::A2aChunkLayout& layout, std::byte* send,
                      cudaStream_t stream) {
  const std::int64_t t = o.extent(0), h = o.extent(1), dv = o.extent(2);
  if (t * h == 0) return;
  detail::require_dv(dv, "combine_pack_a2a");
  detail::require_aligned16(send, "send", "combine_pack_a2a");
  DCPATTN_REQUIRE(group_size >= 1 && h % group_size == 0,
                  "combine_pack_a2a: group_size (" + std::to_string(group_size) +
                      ") must divide the head count (" + std::to_string(h) + ")");
  const detail::SegmentGrid g = detail::segment_grid(t * h, dv);
  const detail::WarpGrid lg = detail::warp_grid(g.total);
  const int hl = int(h / group_size);
  if (dtype == PartialDtype::fp32) {
    detail::pack_a2a_kernel<Base, float><<<lg.grid, lg.block, 0, stream>>>(
        detail::strided(o), detail::strided(lse), num_valid_rows, int(h), hl, g, send,
        layout.bytes, layout.lse_offset);
  } else {
    detail::pack_a2a_kernel<Base, bfloat16><<<lg.grid, lg.block, 0, stream>>>(
        detail::strided(o), detail::strided(lse), num_valid_rows, int(h), hl, g, send,
        layout.bytes, layout.lse_offset);
  }
  detail::check_launch("pack_a2a_kernel");
}

/// Merges the N received chunks into out (T, H_local, Dv) of OutT and out_lse (T, H_local)
/// (natural log; skipped when its data handle is null), as host::combine_merge_a2a.
/// Deterministic mode: tree_merge over the rank index (N a power of two, at most 32); fast mode:
/// one N-way log-sum-exp and the weighted sum in rank order (any N). recv: 16-byte aligned.
template <class OutT>
void combine_merge_a2a(const std::byte* recv, int group_size, DcpMode mode, PartialDtype dtype,
                       const ::dcpattn::detail::A2aChunkLayout& layout, TensorView<OutT, 3> out,
                       TensorView<float, 2> out_lse, cudaStream_t stream) {
  const std::int64_t t = out.extent(0), hl = out.extent(1), dv = out.extent(2);
  if (t * hl == 0) return;
  detail::require_dv(dv, "combine_merge_a2a");
  detail::require_aligned16(recv, "recv", "combine_merge_a2a");
  DCPATTN_REQUIRE(group_size >= 1, "combine_merge_a2a: group_size (" +
                                       std::to_string(group_size) + ") must be >= 1");
  if (mode == DcpMode::deterministic)
    DCPATTN_REQUIRE(is_power_of_two(group_size) && group_size <= detail::kMaxTreeStates,
                    "combine_merge_a2a: deterministic mode needs a power-of-two group_size of at "
                    "most " + std::to_string(detail::kMaxTreeStates) + " on CUDA, got " +
                        std::to_string(group_size));
  const detail::SegmentGrid g = detail::segment_grid(t * hl, dv);
  const detail::WarpGrid lg = detail::warp_grid(g.total);
  const auto o = detail::strided(out);
  const auto l = detail::strided(out_lse);
  const int n = group_size, h = int(hl);
  auto launch = [&](auto part) {
    using PartT = decltype(part);
    if (mode == DcpMode::deterministic && n == 1) {
      detail::merge_a2a_single_kernel<OutT, PartT>
          <<<lg.grid, lg.block, 0, stream>>>(recv, layout.lse_offset, h, g, o, l);
    } else if (mode == DcpMode::fast) {
      detail::merge_a2a_sum_kernel<OutT, PartT>
          <<<lg.grid, lg.block, 0, stream>>>(recv, layout.bytes, layout.lse_offset, n, h, g, o, l);
    } else if (n == 2) {
      detail::merge_a2a_tree_kernel<OutT, PartT, 2>
          <<<lg.grid, lg.block, 0, stream>>>(recv, layout.bytes, layout.lse_offset, n, h, g, o, l);
    } else if (n <= 8) {
      detail::merge_a2a_tree_kernel<OutT, PartT, 8>
          <<<lg.grid, lg.block, 0, stream>>>(recv, layout.bytes, layout.lse_offset, n, h, g, o, l);
    } else if (n == 16) {
      detail::merge_a2a_tree_kernel<OutT, PartT, 16>
          <<<lg.grid, lg.block, 0, stream>>>(recv, layout.bytes, layout.lse_offset, n, h, g, o, l);
    } else {
      detail::merge_a2a_tree_kernel<OutT, PartT, 32>
          <<<lg.grid, lg.block, 0, stream>>>(recv, layout.bytes, layout.lse_offset, n, h, g, o, l);
    }
  };
  if (dtype == PartialDtype::fp32)
    launch(float{});
  else
    launch(bfloat16{});
  detail::check_launch("combine_merge_a2a kernel");
}

/// The all-gather/reduce-scatter combiner's local step, as host::combine_rescale_agrs: lse_all
/// (N, T, H) sanitized natural-log LSE of every rank, o (T, H, Dv) this rank's partial; writes
/// packed (N, T, H_local, Dv) fp32 = exp(lse_mine - L) o, destination-major, and this rank's
/// total LSE into out_lse (T, H_local) when non-null. packed: 16-byte vector stores when it is
/// 16-byte aligned (the combiner's scratch places it after T * H * (N + 1) floats, which need not
/// be), scalar stores otherwise.
inline void combine_rescale_agrs(TensorView<const float, 3> o, const float* lse_all, int rank,
                                 int group_size, float* packed, TensorView<float, 2> out_lse,
                                 cudaStream_t stream) {
  const std::int64_t t = o.extent(0), h = o.extent(1), dv = o.extent(2);
  if (t * h == 0) return;
  detail::require_dv(dv, "combine_rescale_agrs");
  DCPATTN_REQUIRE(group_size >= 1 && h % group_size == 0 && rank >= 0 && rank < group_size,
                  "combine_rescale_agrs: group_size (" + std::to_string(group_size) +
                      ") must divide the head count (" + std::to_string(h) + ") and rank (" +
                      std::to_string(rank) + ") lie in [0, group_size)");
  const detail::SegmentGrid g = detail::segment_grid(t * h, dv);
  const detail::WarpGrid lg = detail::warp_grid(g.total);
  detail::rescale_agrs_kernel<><<<lg.grid, lg.block, 0, stream>>>(
      detail::strided(o), lse_all, rank, group_size, int(h), int(h / group_size), t, g, packed,
      detail::aligned_to(packed, 16), detail::strided(out_lse));
  detail::check_launch("rescale_agrs_kernel");
}

}  // namespace cuda_kernels

DCPATTN_NAMESPACE_END
