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
// Kernel design (memory-bound; one pass over the data). The combine kernels (pack, merges, rescale)
// give each warp one (token, head) row, or one segment of it where the row's states would not fit
// the registers: every lane holds C vectors of V columns per state, columns lane * V + 32 V c
// (c < C), so each load instruction of the warp covers 32 V consecutive columns. Vectors are 16
// bytes (4 fp32, 8 bf16), 8 bytes for bf16 where Dv is not a multiple of 8 or where 16 or 32
// states must fit. With Dv = 512 a warp moves the whole row for N <= 4 (per state and lane 4
// fp32 or 2 bf16 vectors) and for the fast merge of more bf16 states, half of it for more fp32
// states and for the tree of 8 bf16 states, a quarter for a tree of 16 or 32 states. The loads
// of all the states of a row segment are issued before the first of them is used; the LSE merges
// of a row are computed once per warp with shuffles. Blocks are 1 warp for small launches (T = 1,
// H_local = 16 still spreads over several SMs) and 4 warps from 2048 warps on.
//
// Small merges, and fast merges of any size. A decode step's merge is small (T * H_local rows: 8
// at T = 1, H = 16, N = 2) and then latency-bound: few warps, one per SM, nothing to hide a warp's
// dependent chain of instructions between its loads and its stores, so the kernel takes about as
// long as that chain (measured on the H200: the warp-per-row kernels spent 0.8 us more than a copy
// of the same bytes at T = 1, whatever their launch shape). merge_row_kernel therefore gives each
// row a CTA and each thread V columns of every state; every thread evaluates the weights itself
// from its own loads of the n lse values (no shuffle, no barrier), so the chain is the weight
// arithmetic plus V columns. Which kernel serves a merge (row_kernel_serves, measured on the
// bench_combine shapes): the fast merge of up to kRowKernelMaxStates states at every size (its
// weights need one approximate exp each and one shared approximate reciprocal; with a vector per
// state and thread it also keeps more loads in flight than the warp kernel and was faster from
// T = 1 to T = 8192); the tree of 2 and of 4 states at every size; the tree of 8 states up to
// kRowKernelMaxTree8Rows rows. Deeper trees, and larger 8-state ones, keep the warp kernel,
// whose lanes share the 2^k - 1 weight merges (two approximate exps, an approximate log and two
// more exps per node) that every thread of the row kernel would repeat. Both kernels give the
// same bits.
//
// Loads of an empty state's o. A state whose lse is -inf has weight 0: its o never reaches the
// result (weighted() gives 0 for any o, NaN included). The warp merge kernels and the rescale in
// launches of more than kSpeculativeMaxWarps warps (bandwidth-bound) load an o only after its lse
// has arrived and only for a state whose lse is not -inf, so an empty state's bytes are not
// moved; the other resident warps hide that round trip. Smaller launches (latency-bound, about
// one wave) load every state's o together with the lse values and then drop the empty ones: one
// dependent memory round trip less per call. Both give the same bits. merge_row_kernel and the
// pack always load speculatively (the pack measured faster so at every size).
//
// Every launcher is stream-ordered: no allocation, no host synchronization (CUDA-graph safe), and
// no CUDA call but the launch itself (grids follow from the problem size; no device query).
// Argument checks throw dcpattn::Error before anything is enqueued.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include <cuda_runtime.h>
#include <cuda/std/bit>

#include "dcpattn/config.hpp"
#include "dcpattn/core/lse.hpp"
#include "dcpattn/core/numeric.hpp"
#include "dcpattn/core/tensor.hpp"
#include "dcpattn/error.hpp"
#include "dcpattn/kernels/cuda/convert.cuh"
#include "dcpattn/kernels/cuda/merge_tree.cuh"
#include "dcpattn/kernels/host/combine.hpp"
#include "dcpattn/op/config.hpp"

DCPATTN_NAMESPACE_BEGIN

namespace cuda_kernels {
namespace detail {

inline constexpr unsigned kFullMask = 0xffffffffu;
inline constexpr int kWarpSize = 32;
/// Columns of one fp32 vector (16 bytes); Dv must be a multiple of it.
inline constexpr int kLaneColumns = 4;
/// Largest group size of the deterministic (register tree) merge.
inline constexpr int kMaxTreeStates = 32;
/// States per batch of the fast merge's warp kernel (merge_sum_kernel).
inline constexpr int kMaxSumBatch = 8;
/// Threads per block of the flat (one element or vector per thread) kernels.
inline constexpr int kFlatBlock = 128;
/// Threads per block of the warp-per-row kernels in large launches.
inline constexpr int kRowBlock = 128;
/// Launches of the warp merge kernels and the rescale of at most this many warps load the o of
/// every state speculatively, together with the lse values (see "Loads of an empty state's o"
/// above); 0 turns speculative loads off there.
inline constexpr std::int64_t kSpeculativeMaxWarps = 8192;
/// Most states merge_row_kernel takes (its registers hold every state's columns).
inline constexpr int kRowKernelMaxStates = 8;
/// Most rows of a merge of the 8-state tree that merge_row_kernel serves.
inline constexpr std::int64_t kRowKernelMaxTree8Rows = 64;

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

/// Enqueues kernel<<<grid, block, 0, stream>>>(args...) and raises its launch error (a bad
/// configuration), if any. The launch is the only CUDA call: nothing else runs on the host path.
template <class... Params, class... Args>
void combine_launch(const char* name, void (*kernel)(Params...), dim3 grid, dim3 block,
                    cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  config.attrs = nullptr;
  config.numAttrs = 0;
  const cudaError_t e = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // reported here; a later launch must not report it again
    throw Error(std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e),
                std::string("launch of ") + name);
  }
}

/// Grid of `warps` warps: 1-warp blocks for small launches, so few rows still spread over many
/// SMs; 4-warp blocks otherwise (1-warp blocks would cap residency at 32 warps per SM).
struct WarpGrid {
  dim3 grid;
  dim3 block;
};
inline WarpGrid warp_grid(std::int64_t warps) {
  const std::int64_t per_block = warps >= 2048 ? kRowBlock / kWarpSize : 1;
  return {dim3(unsigned((warps + per_block - 1) / per_block)),
          dim3(unsigned(per_block * kWarpSize))};
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

/// Loads 4 consecutive fp32 values starting at p (16-byte aligned).
DCPATTN_DEVICE Vec4 load4_contiguous(const float* p) {
  const float4 x = *reinterpret_cast<const float4*>(p);
  return Vec4{{x.x, x.y, x.z, x.w}};
}

/// Two values rounded to bfloat16 (round to nearest even, as bfloat16::from_float), packed: one
/// hardware conversion (cvt_bf16x2, equal to from_float on non-NaN values); a NaN takes
/// from_float, whose NaN encoding differs from the hardware's.
DCPATTN_DEVICE std::uint32_t pack_bf16x2(float lo, float hi) {
  if (lo != lo || hi != hi)
    return std::uint32_t(bfloat16::from_float(lo).bits) |
           (std::uint32_t(bfloat16::from_float(hi).bits) << 16);
  return cvt_bf16x2(lo, hi);
}

/// Stores V values rounded to T at p, contiguous: one vector store (p aligned to the vector: 16
/// bytes, 8 for 4 bf16), two 16-byte stores for 8 fp32 values.
DCPATTN_DEVICE void store_vec(float* p, const float (&a)[4]) {
  *reinterpret_cast<float4*>(p) = make_float4(a[0], a[1], a[2], a[3]);
}
DCPATTN_DEVICE void store_vec(float* p, const float (&a)[8]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(a[0], a[1], a[2], a[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(a[4], a[5], a[6], a[7]);
}
DCPATTN_DEVICE void store_vec(bfloat16* p, const float (&a)[4]) {
  *reinterpret_cast<uint2*>(p) = make_uint2(pack_bf16x2(a[0], a[1]), pack_bf16x2(a[2], a[3]));
}
DCPATTN_DEVICE void store_vec(bfloat16* p, const float (&a)[8]) {
  *reinterpret_cast<uint4*>(p) = make_uint4(pack_bf16x2(a[0], a[1]), pack_bf16x2(a[2], a[3]),
                                            pack_bf16x2(a[4], a[5]), pack_bf16x2(a[6], a[7]));
}

/// Elements (i0, i1, c .. c + V - 1) of a strided view := a rounded to T (vector stores when the
/// view's `vec` says the vector fits, element by element otherwise).
template <class T, int V>
DCPATTN_DEVICE void store_cols(const Strided3<T>& x, std::int64_t i0, std::int64_t i1,
                               std::int64_t c, const float (&a)[V]) {
  if (x.vec) {
    store_vec(x.at(i0, i1, c), a);
    return;
  }
#pragma unroll
  for (int k = 0; k < V; ++k) *x.at(i0, i1, c + k) = from_float<T>(a[k]);
}
template <class T>
DCPATTN_DEVICE void store4(const Strided3<T>& x, std::int64_t i0, std::int64_t i1, std::int64_t c,
                           const Vec4& a) {
  store_cols<T, 4>(x, i0, i1, c, a.v);
}

/// Loads that the compilers issue where they stand. ptxas moves a load behind the code that does
/// not need it where it can: in the fast row kernel the o of a state is used only where its weight
/// is nonzero, and its load went into that branch or after the weights' exponentials, one memory
/// round trip after the lse loads. A PTX volatile load is neither made conditional nor moved
/// across another one. It is a relaxed load at system scope (no L1 allocation), which costs some
/// bandwidth: merge_row_kernel takes these for its fast merge of 4 and 8 states only (see there).
DCPATTN_DEVICE uint4 load16_now(const void* p) {
  uint4 r;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}
DCPATTN_DEVICE uint2 load8_now(const void* p) {
  uint2 r;
  asm volatile("ld.volatile.global.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
  return r;
}
DCPATTN_DEVICE float load_float_now(const float* p) {
  float r;
  asm volatile("ld.volatile.global.f32 %0, [%1];" : "=f"(r) : "l"(p));
  return r;
}

/// V consecutive elements of T as loaded: one 16-byte vector (4 fp32, 8 bf16) or one 8-byte
/// vector (4 bf16). zero() is the o of an unloaded state (+0 in every column).
template <class T, int V>
struct RawVec;
template <>
struct RawVec<float, 4> {
  float4 x;
  DCPATTN_DEVICE void zero() { x = make_float4(0.0f, 0.0f, 0.0f, 0.0f); }
  DCPATTN_DEVICE void load(const float* p) { x = *reinterpret_cast<const float4*>(p); }
  DCPATTN_DEVICE void load_now(const float* p) {
    const uint4 u = load16_now(p);
    x = make_float4(__uint_as_float(u.x), __uint_as_float(u.y), __uint_as_float(u.z),
                    __uint_as_float(u.w));
  }
  DCPATTN_DEVICE void unpack(float (&f)[4]) const {
    f[0] = x.x;
    f[1] = x.y;
    f[2] = x.z;
    f[3] = x.w;
  }
};
template <>
struct RawVec<bfloat16, 8> {
  uint4 x;
  DCPATTN_DEVICE void zero() { x = make_uint4(0u, 0u, 0u, 0u); }
  DCPATTN_DEVICE void load(const bfloat16* p) { x = *reinterpret_cast<const uint4*>(p); }
  DCPATTN_DEVICE void load_now(const bfloat16* p) { x = load16_now(p); }
  DCPATTN_DEVICE void unpack(float (&f)[8]) const {
    f[0] = bf16_lo(x.x);
    f[1] = bf16_hi(x.x);
    f[2] = bf16_lo(x.y);
    f[3] = bf16_hi(x.y);
    f[4] = bf16_lo(x.z);
    f[5] = bf16_hi(x.z);
    f[6] = bf16_lo(x.w);
    f[7] = bf16_hi(x.w);
  }
};
template <>
struct RawVec<bfloat16, 4> {
  uint2 x;
  DCPATTN_DEVICE void zero() { x = make_uint2(0u, 0u); }
  DCPATTN_DEVICE void load(const bfloat16* p) { x = *reinterpret_cast<const uint2*>(p); }
  DCPATTN_DEVICE void load_now(const bfloat16* p) { x = load8_now(p); }
  DCPATTN_DEVICE void unpack(float (&f)[4]) const {
    f[0] = bf16_lo(x.x);
    f[1] = bf16_hi(x.x);
    f[2] = bf16_lo(x.y);
    f[3] = bf16_hi(x.y);
  }
};

/// Loads fp32 elements (i0, i1, c .. c + 3) of a strided view (one 16-byte load when `vec`).
DCPATTN_DEVICE void load_cols(RawVec<float, 4>& r, const Strided3<const float>& x, std::int64_t i0,
                              std::int64_t i1, std::int64_t c) {
  if (x.vec) {
    r.load(x.at(i0, i1, c));
    return;
  }
  r.x = make_float4(*x.at(i0, i1, c), *x.at(i0, i1, c + 1), *x.at(i0, i1, c + 2),
                    *x.at(i0, i1, c + 3));
}

/// weighted_rn(w, o), the same bits, with the product used whatever w is: it is masked to +0 by
/// an AND that the compilers cannot see through (inline PTX), where weighted_rn's select let
/// ptxas move the load of o into a branch on w (in merge_row_kernel's fast merge: the o load of a
/// state then left one memory round trip after the lse loads that decide its weight).
DCPATTN_DEVICE float weighted_masked(float w, float o) {
  const unsigned product = __float_as_uint(__fmul_rn(w, o));
  const unsigned mask = w != 0.0f ? 0xffffffffu : 0u;
  unsigned r;
  asm("and.b32 %0, %1, %2;" : "=r"(r) : "r"(product), "r"(mask));
  return __uint_as_float(r);
}

/// merge_lse with its empty cases as early returns: the same bits (the general case is
/// merge_lse's own arithmetic). For merge_tree_kernel, whose lanes each merge one node of a
/// level: measured on the H200 3-10% faster there than the straight-line merge_lse at 8 states
/// and 128 to 2048 rows, equal beyond (merge_row_kernel wants the straight line; see merge_lse).
DCPATTN_DEVICE MergeWeights merge_lse_early_out(float lse_a, float lse_b) {
  const float m = lse_a > lse_b ? lse_a : lse_b;
  if (m == lse_neg_inf) return {lse_neg_inf, 0.0f, 0.0f};
  if (lse_b == lse_neg_inf) return {lse_a, 1.0f, 0.0f};
  if (lse_a == lse_neg_inf) return {lse_b, 0.0f, 1.0f};
  return merge_lse(lse_a, lse_b);
}

/// lse_sum_n (fast_sum_n when kFast; dcpattn/core/lse.hpp) of n values evaluated by a whole
/// warp, the same value on every lane, with the same operations: the maximum (order-free for
/// sanitized inputs), the exponentials in parallel, summed sequentially in index order. my_lse:
/// value `lane` (-inf for lane >= n), already loaded; values from 32 on are read with lse_at. The
/// first kUnroll terms of each group of 32 are summed unrolled (their shuffles independent of the
/// sum); a term beyond n is +0 and leaves the sum (>= +0) bit-identical. Needs all 32 lanes.
template <int kUnroll, bool kFast, class LseAt>
DCPATTN_DEVICE LseSum warp_lse_sum(const LseAt& lse_at, float my_lse, int n, int lane) {
  float m = my_lse;
  for (int r = lane + kWarpSize; r < n; r += kWarpSize) {
    const float x = lse_at(r);
    m = x > m ? x : m;
  }
#pragma unroll
  for (int off = kWarpSize / 2; off >= 1; off >>= 1) {
    const float y = __shfl_xor_sync(kFullMask, m, off);
    m = y > m ? y : m;
  }
  if (m == lse_neg_inf) return {lse_neg_inf, 0.0f};
  float sum = 0.0f;
  for (int g0 = 0; g0 < n; g0 += kWarpSize) {
    const int r = g0 + lane;
    const float x = g0 == 0 ? my_lse : (r < n ? lse_at(r) : lse_neg_inf);
    const float d = ::dcpattn::detail::sub_rn(x, m);
    const float e = r < n ? (kFast ? ::dcpattn::detail::fast_exp(d) : cuda::std::exp(d)) : 0.0f;
    const int count = n - g0 < kWarpSize ? n - g0 : kWarpSize;
#pragma unroll
    for (int j = 0; j < kUnroll; ++j)
      sum = ::dcpattn::detail::add_rn(sum, __shfl_sync(kFullMask, e, j));
    for (int j = kUnroll; j < count; ++j)
      sum = ::dcpattn::detail::add_rn(sum, __shfl_sync(kFullMask, e, j));
  }
  return {m, sum};
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

/// The row and segment of the calling warp in a warp-per-row kernel (`segments` warps per row).
struct WarpRow {
  std::int64_t row;
  int seg;
  int lane;
};
DCPATTN_DEVICE WarpRow warp_row(std::int64_t w, int segments) {
  const int lane = int(threadIdx.x % kWarpSize);
  if (segments == 1) return {w, 0, lane};
  return {w / segments, int(w % segments), lane};
}

/// combine_pack_a2a: one warp per (t, h) row of the local partial (all H heads), or per 512-column
/// segment of it; lane columns seg * 512 + lane * 4 + 128 c. The o loads go out together with the
/// lse load at every size (an empty state's o is read and dropped): measured on the H200 from 4096
/// to 131072 warps, 6 to 10% faster with fp32 partials and up to 6% with bf16 partials than
/// loading o only once the lse says the state is live.
template <class Base, class PartT>
__global__ void __launch_bounds__(kRowBlock)
    pack_a2a_kernel(Strided3<const float> o, Strided2<const float> lse, int num_valid_rows,
                    int heads, int heads_local, int dv, int segments, std::int64_t warps,
                    std::byte* __restrict__ send, std::size_t chunk_bytes, std::size_t lse_offset) {
  constexpr int V = kLaneColumns, C = 4;
  const std::int64_t w = global_warp();
  if (w >= warps) return;
  const WarpRow wr = warp_row(w, segments);
  const std::int64_t t = wr.row / heads;
  const int h = int(wr.row % heads);
  const std::int64_t col0 = std::int64_t(wr.seg) * (C * kWarpSize * V) + wr.lane * V;
  RawVec<float, V> v[C];
#pragma unroll
  for (int c = 0; c < C; ++c) {
    v[c].zero();
    if (col0 + c * kWarpSize * V < dv) load_cols(v[c], o, t, h, col0 + c * kWarpSize * V);
  }
  // An empty state travels as o = 0 whatever its o holds (padding garbage, an empty row's NaN).
  const float l = t < num_valid_rows ? sanitize_lse(lse(t, h), Base{}) : lse_neg_inf;
  const int d = h / heads_local, hh = h % heads_local;
  std::byte* chunk = send + std::size_t(d) * chunk_bytes;
  const std::int64_t out_row = t * heads_local + hh;
  if (wr.seg == 0 && wr.lane == 0) reinterpret_cast<float*>(chunk + lse_offset)[out_row] = l;
  PartT* dst = reinterpret_cast<PartT*>(chunk) + out_row * dv;
#pragma unroll
  for (int c = 0; c < C; ++c) {
    const std::int64_t col = col0 + c * kWarpSize * V;
    if (col >= dv) continue;
    float f[V];
    v[c].unpack(f);
#pragma unroll
    for (int k = 0; k < V; ++k) f[k] = l == lse_neg_inf ? 0.0f : f[k];  // neutral: o = +0
    store_vec(dst + col, f);
  }
}

/// What the merge kernels read: N received chunks, each (T, H_local, Dv) o of PartT then
/// (T, H_local) fp32 lse at lse_offset; one warp per row (t, h_local), or per segment of it.
struct MergeArgs {
  const std::byte* recv;
  std::size_t chunk_bytes;
  std::size_t lse_offset;
  int n;
  int heads_local;
  int dv;
  int segments;        ///< warps per row
  std::int64_t warps;  ///< rows * segments
};

DCPATTN_DEVICE float load_state_lse(const MergeArgs& a, int r, std::int64_t row) {
  return reinterpret_cast<const float*>(a.recv + std::size_t(r) * a.chunk_bytes +
                                        a.lse_offset)[row];
}

/// Loads the o of states first .. first + count - 1 (count <= K) of `row` into raw[0 .. count - 1],
/// lane columns col0 + 32 V c; every other vector is zero. Speculative: every one of these states
/// at once. Otherwise only those whose lse (lane lse_lane0 + j of group_lse holds state
/// first + j's) is not -inf, once that lse has arrived. All loads are issued before any is used.
template <bool kSpeculative, class PartT, int V, int K, int C>
DCPATTN_DEVICE void load_states(RawVec<PartT, V> (&raw)[K][C], const MergeArgs& a, std::int64_t row,
                                std::int64_t col0, int first, int count, float group_lse,
                                int lse_lane0) {
  // bit i: lane i's lse is not -inf (speculative: every state counts as live)
  unsigned live_lanes = kFullMask;
  if constexpr (!kSpeculative) live_lanes = __ballot_sync(kFullMask, group_lse != lse_neg_inf);
#pragma unroll
  for (int j = 0; j < K; ++j) {
    const bool live = j < count && ((live_lanes >> (lse_lane0 + j)) & 1u) != 0;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      raw[j][c].zero();
      const std::int64_t col = col0 + c * kWarpSize * V;
      if (live && col < a.dv)
        raw[j][c].load(
            reinterpret_cast<const PartT*>(a.recv + std::size_t(first + j) * a.chunk_bytes) +
            row * a.dv + col);
    }
  }
}

/// Deterministic combine_merge_a2a for n <= S states (n a power of two; the launcher picks
/// S = n, or S = 2 for n = 1): tree_merge over the rank index, one warp per row segment of
/// C * 32 * V columns. Lane v computes the lse merges of state v (level by level, highest bit
/// first) and keeps their weights; every lane then replays the tree on its columns with the
/// weights broadcast by shuffles: the operations and their order of merge_state_into.
template <class OutT, class PartT, int V, int S, int C, bool kSpeculative>
__global__ void __launch_bounds__(kRowBlock)
    merge_tree_kernel(MergeArgs a, Strided3<OutT> out, Strided2<float> out_lse) {
  static_assert(S >= 2 && S <= kMaxTreeStates && (S & (S - 1)) == 0);
  constexpr int kLevels = int(cuda::std::bit_width(unsigned(S))) - 1;
  const std::int64_t w = global_warp();
  if (w >= a.warps) return;  // whole warps only: the shuffles below need all 32 lanes
  const WarpRow wr = warp_row(w, a.segments);
  const int lane = wr.lane, n = a.n;
  const std::int64_t row = wr.row;

  const float my_lse = lane < n ? load_state_lse(a, lane, row) : lse_neg_inf;
  const std::int64_t col0 = std::int64_t(wr.seg) * (C * kWarpSize * V) + lane * V;
  RawVec<PartT, V> raw[S][C];
  // Not speculative: an empty state's o is never read (the tree gives it weight 0 at every
  // level); speculative: it is read and dropped the same way.
  load_states<kSpeculative>(raw, a, row, col0, 0, n, my_lse, 0);

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
        const MergeWeights mw = merge_lse_early_out(cur, other);
        wa[li] = mw.w_a;
        wb[li] = mw.w_b;
        cur = mw.lse;
      }
    }
  }
  const float merged = __shfl_sync(kFullMask, cur, 0);

  float s[S][C][V];
#pragma unroll
  for (int j = 0; j < S; ++j) {
#pragma unroll
    for (int c = 0; c < C; ++c) raw[j][c].unpack(s[j][c]);
  }
  // Constant trip counts everywhere, so the loops unroll fully and s[], wa[], wb[] stay in
  // registers.
#pragma unroll
  for (int li = kLevels - 1; li >= 0; --li) {
    const int half = 1 << li;
    if (half < n) {
#pragma unroll
      for (int v = 0; v < S / 2; ++v) {
        if (v < half) {
          const float ca = __shfl_sync(kFullMask, wa[li], v);
          const float cb = __shfl_sync(kFullMask, wb[li], v);
#pragma unroll
          for (int c = 0; c < C; ++c)
#pragma unroll
            for (int k = 0; k < V; ++k)
              s[v][c][k] = merge_element(s[v][c][k], s[v + half][c][k], ca, cb);
        }
      }
    }
  }
  // n = 1: the one state passes through unchanged, the neutral o = +0 when it is empty (a
  // speculatively loaded o is dropped here). For n >= 2 the tree already gives +0 then.
  if (n == 1 && merged == lse_neg_inf) {
#pragma unroll
    for (int c = 0; c < C; ++c)
#pragma unroll
      for (int k = 0; k < V; ++k) s[0][c][k] = 0.0f;
  }
  const std::int64_t t = row / a.heads_local;
  const int hh = int(row % a.heads_local);
#pragma unroll
  for (int c = 0; c < C; ++c) {
    const std::int64_t col = col0 + c * kWarpSize * V;
    if (col < a.dv) store_cols<OutT, V>(out, t, hh, col, s[0][c]);
  }
  if (out_lse.ptr != nullptr && wr.seg == 0 && lane == 0) out_lse(t, hh) = merged;
}

/// acc += weighted(w_j, o_j) for the loaded states j < count in index order, explicitly rounded
/// (the fast merge's sum); lane lane0 + j of `weights` holds w_j.
template <class PartT, int V, int K, int C>
DCPATTN_DEVICE void accumulate_states(float (&acc)[C][V], const RawVec<PartT, V> (&raw)[K][C],
                                      float weights, int lane0, int count) {
#pragma unroll
  for (int j = 0; j < K; ++j) {
    const float wj = __shfl_sync(kFullMask, weights, lane0 + j);
    if (j < count) {
#pragma unroll
      for (int c = 0; c < C; ++c) {
        float f[V];
        raw[j][c].unpack(f);
#pragma unroll
        for (int k = 0; k < V; ++k) acc[c][k] = __fadd_rn(acc[c][k], weighted_rn(wj, f[k]));
      }
    }
  }
}

/// Fast-mode combine_merge_a2a for the merges merge_row_kernel does not take (more than
/// kRowKernelMaxStates states, or T beyond its grid): one N-way log-sum-exp per row (fast_sum_n,
/// fast_weight), then the weighted sum over the states in rank order (as the host), in batches of
/// B = kMaxSumBatch states whose loads are all issued before the first is used.
template <class OutT, class PartT, int V, int C, bool kSpeculative>
__global__ void __launch_bounds__(kRowBlock)
    merge_sum_kernel(MergeArgs a, Strided3<OutT> out, Strided2<float> out_lse) {
  constexpr int B = kMaxSumBatch;
  static_assert(B >= 1 && kWarpSize % B == 0);
  const std::int64_t w = global_warp();
  if (w >= a.warps) return;  // whole warps only
  const WarpRow wr = warp_row(w, a.segments);
  const int lane = wr.lane, n = a.n;
  const std::int64_t row = wr.row;
  auto lse_at = [&](int r) { return load_state_lse(a, r, row); };

  const float my_lse = lane < n ? lse_at(lane) : lse_neg_inf;
  const std::int64_t col0 = std::int64_t(wr.seg) * (C * kWarpSize * V) + lane * V;
  RawVec<PartT, V> raw[B][C];
  const int first = n < B ? n : B;
  load_states<kSpeculative>(raw, a, row, col0, 0, first, my_lse, 0);
  const LseSum total = warp_lse_sum<B, true>(lse_at, my_lse, n, lane);

  float acc[C][V];
#pragma unroll
  for (int c = 0; c < C; ++c)
#pragma unroll
    for (int k = 0; k < V; ++k) acc[c][k] = 0.0f;
  accumulate_states(acc, raw, fast_weight(my_lse, total), 0, first);
  // States B .. n - 1, B at a time.
  for (int s0 = B; s0 < n; s0 += B) {
    const int g0 = s0 / kWarpSize * kWarpSize;  // lane j of this group holds state g0 + j
    const float lse_g = g0 + lane < n ? lse_at(g0 + lane) : lse_neg_inf;
    const int in_batch = n - s0 < B ? n - s0 : B;
    load_states<kSpeculative>(raw, a, row, col0, s0, in_batch, lse_g, s0 - g0);
    accumulate_states(acc, raw, fast_weight(lse_g, total), s0 - g0, in_batch);
  }
  const std::int64_t t = row / a.heads_local;
  const int hh = int(row % a.heads_local);
#pragma unroll
  for (int c = 0; c < C; ++c) {
    const std::int64_t col = col0 + c * kWarpSize * V;
    if (col < a.dv) store_cols<OutT, V>(out, t, hh, col, acc[c]);
  }
  if (out_lse.ptr != nullptr && wr.seg == 0 && lane == 0) out_lse(t, hh) = lse_of(total);
}

/// The merges that row_kernel_serves (see "Small merges" at the top of this file): one CTA per row
/// (t, h_local), or per column segment of it (blockIdx.z), each thread V columns of every state.
/// Every thread loads the n lse values itself (broadcast loads, in flight together with its o
/// loads) and evaluates the weights in registers, with the operations of the warp kernels in the
/// same order, so the bits are theirs: kTree, the fixed tree of merge_state_into over the rank
/// index (S = n, or S = 2 for n = 1); otherwise the fast merge (fast_sum_n, fast_weight, the
/// weighted sum in rank order) of n <= S states.
template <class OutT, class PartT, int V, int S, bool kTree, bool kExact>
__global__ void __launch_bounds__(kRowBlock)
    merge_row_kernel(MergeArgs a, Strided3<OutT> out, Strided2<float> out_lse) {
  static_assert(S >= 1 && S <= kRowKernelMaxStates && (!kTree || (S >= 2 && (S & (S - 1)) == 0)));
  // kExact: n == S, known here, so that no load waits for n to arrive from the parameters. The
  // loads are unconditional either way (a state beyond n reads state 0 again and is dropped, a
  // column beyond Dv reads column 0 and is not stored): their addresses wait for nothing but the
  // parameters themselves.
  const int n = kExact ? S : a.n;
  // How the fast merge keeps every load ahead of the weights (ptxas would move an o load behind
  // them, into the branch of weighted_rn's select, or simply schedule it after the weights'
  // exponentials): 4 and 8 states, volatile loads (load16_now); 2 states, plain loads and the
  // branch-free weighted_masked. Measured on the H200 over every bench_combine shape: volatile
  // loads faster than plain ones at 4 and 8 states (or within 1.5%) and up to 5% slower at 2
  // states; the masked product slower than the select at 4 and 8 states with bf16 partials.
  constexpr bool kIssueNow = !kTree && S >= 4;
  // grid (H_local, T, segments): the row's indices without a division
  const int hh = int(blockIdx.x), t = int(blockIdx.y);
  const int row = t * a.heads_local + hh;
  const int col = (int(blockIdx.z) * int(blockDim.x) + int(threadIdx.x)) * V;
  const bool in_row = col < a.dv;
  const int load_col = in_row ? col : 0;
  float l[S];
  RawVec<PartT, V> raw[S];
#pragma unroll
  for (int j = 0; j < S; ++j) {
    const int state = kExact || j < n ? j : 0;
    const std::byte* chunk = a.recv + std::size_t(state) * a.chunk_bytes;
    const float* lse_p = reinterpret_cast<const float*>(chunk + a.lse_offset) + row;
    const PartT* o_p = reinterpret_cast<const PartT*>(chunk) + std::size_t(row) * a.dv + load_col;
    if constexpr (kIssueNow) {
      l[j] = load_float_now(lse_p);
      raw[j].load_now(o_p);
    } else {
      l[j] = *lse_p;
      raw[j].load(o_p);
    }
    if (!kExact && j >= n) l[j] = lse_neg_inf;  // weight 0: its o never reaches the result
  }
  float s[S][V];
#pragma unroll
  for (int j = 0; j < S; ++j) raw[j].unpack(s[j]);

  float res[V];
  float merged = lse_neg_inf;
  if constexpr (kTree) {
    // Every weight of the tree first, then the element merges (merge_tree.cuh). The lse chain is
    // the kernel's critical path; interleaved with the element merges (whose selects ptxas turns
    // into branches on the weights), the independent merges of a level ran one after the other.
    // kTree runs n = S, or n = 1 on the 2-state tree: that one state passes through, the neutral
    // o = +0 when it is empty.
    float2 w[S - 1];
    const bool merge = n > 1;
    const bool plain = merge && tree_weights<S>(l, w);  // the same for every thread of the row
    const auto weights = [&w](int node) { return w[node]; };
    merged = l[0];
    const bool zero = !merge && merged == lse_neg_inf;
    float column[V][S];
#pragma unroll
    for (int k = 0; k < V; ++k)
#pragma unroll
      for (int j = 0; j < S; ++j) column[k][j] = s[j][k];
    if (plain) {
#pragma unroll
      for (int k = 0; k < V; ++k) res[k] = tree_merge_column<true>(column[k], weights);
    } else if (merge) {
#pragma unroll
      for (int k = 0; k < V; ++k) res[k] = tree_merge_column<false>(column[k], weights);
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) res[k] = zero ? 0.0f : s[0][k];
    }
  } else {
    float m = lse_neg_inf;
#pragma unroll
    for (int j = 0; j < S; ++j) m = l[j] > m ? l[j] : m;  // -inf beyond n
    // Branch-free: a branch on m would let the compiler move the o loads behind it, one memory
    // round trip after the lse loads. With every input empty (m = -inf) every e is NaN and every
    // weight the select's 0, as fast_weight gives.
    float e[S];
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < S; ++j) {
      e[j] = ::dcpattn::detail::fast_exp(::dcpattn::detail::sub_rn(l[j], m));
      if (j < n) sum = ::dcpattn::detail::add_rn(sum, e[j]);
    }
    const float inv = ::dcpattn::detail::fast_inverse(sum);
#pragma unroll
    for (int k = 0; k < V; ++k) res[k] = 0.0f;
#pragma unroll
    for (int j = 0; j < S; ++j) {
      // fast_weight(l[j], {m, sum}), its exp already at hand
      const float w = l[j] == lse_neg_inf ? 0.0f : ::dcpattn::detail::mul_rn(e[j], inv);
      if (j < n) {
#pragma unroll
        for (int k = 0; k < V; ++k)
          res[k] =
              __fadd_rn(res[k], kIssueNow ? weighted_rn(w, s[j][k]) : weighted_masked(w, s[j][k]));
      }
    }
    if (out_lse.ptr != nullptr && col == 0) merged = lse_of(LseSum{m, sum});
  }
  if (in_row) store_cols<OutT, V>(out, t, hh, col, res);
  if (out_lse.ptr != nullptr && col == 0) out_lse(t, hh) = merged;
}

/// combine_rescale_agrs: one warp per (t, h) row of all H heads, or per 512-column segment of it;
/// lane columns seg * 512 + lane * 4 + 128 c. One pass: o read once, packed written once.
template <bool kSpeculative>
__global__ void __launch_bounds__(kRowBlock)
    rescale_agrs_kernel(Strided3<const float> o, const float* __restrict__ lse_all, int rank, int n,
                        int heads, int heads_local, std::int64_t tokens, int dv, int segments,
                        std::int64_t warps, float* __restrict__ packed, bool packed_vec,
                        Strided2<float> out_lse) {
  constexpr int V = kLaneColumns, C = 4;
  const std::int64_t w = global_warp();
  if (w >= warps) return;  // whole warps only
  const WarpRow wr = warp_row(w, segments);
  const std::int64_t row = wr.row;  // t * heads + h
  const std::int64_t plane = tokens * heads;
  auto lse_at = [&](int r) { return lse_all[std::int64_t(r) * plane + row]; };
  const std::int64_t t = row / heads;
  const int h = int(row % heads);
  const std::int64_t col0 = std::int64_t(wr.seg) * (C * kWarpSize * V) + wr.lane * V;
  RawVec<float, V> v[C];
#pragma unroll
  for (int c = 0; c < C; ++c) v[c].zero();
  if constexpr (kSpeculative) {
#pragma unroll
    for (int c = 0; c < C; ++c)
      if (col0 + c * kWarpSize * V < dv) load_cols(v[c], o, t, h, col0 + c * kWarpSize * V);
  }
  const float mine = lse_at(rank);
  const float my_lse = wr.lane < n ? lse_at(wr.lane) : lse_neg_inf;
  if constexpr (!kSpeculative) {
    if (mine != lse_neg_inf) {  // weight 0: o is not read
#pragma unroll
      for (int c = 0; c < C; ++c)
        if (col0 + c * kWarpSize * V < dv) load_cols(v[c], o, t, h, col0 + c * kWarpSize * V);
    }
  }
  const float total = lse_of(warp_lse_sum<8, false>(lse_at, my_lse, n, wr.lane));
  const float wt = merge_weight(mine, total);
  const int d = h / heads_local, hh = h % heads_local;
  if (d == rank && out_lse.ptr != nullptr && wr.seg == 0 && wr.lane == 0) out_lse(t, hh) = total;
  float* dst = packed + ((std::int64_t(d) * tokens + t) * heads_local + hh) * dv;
#pragma unroll
  for (int c = 0; c < C; ++c) {
    const std::int64_t col = col0 + c * kWarpSize * V;
    if (col >= dv) continue;
    float f[V];
    v[c].unpack(f);
#pragma unroll
    for (int k = 0; k < V; ++k) f[k] = weighted_rn(wt, f[k]);
    if (packed_vec) {
      store_vec(dst + col, f);
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) dst[col + k] = f[k];
    }
  }
}

/// Segments per row of a warp-per-row kernel whose warps cover `cols` columns.
inline int row_segments(std::int64_t dv, int cols) {
  return int((dv + cols - 1) / cols);
}

/// Launches merge kernel K<kSpeculative> (columns per warp: C * 32 * V) over out's rows: the
/// speculative variant for launches of at most kSpeculativeMaxWarps warps.
template <int V, int C, class OutT, class KSpec, class KPlain>
void launch_merge_kernel(const char* name, KSpec spec, KPlain plain, const std::byte* recv, int n,
                         const ::dcpattn::detail::A2aChunkLayout& layout,
                         const TensorView<OutT, 3>& out, const TensorView<float, 2>& out_lse,
                         cudaStream_t stream) {
  const std::int64_t rows = out.extent(0) * out.extent(1);
  const int segments = row_segments(out.extent(2), C * kWarpSize * V);
  const MergeArgs args{recv,     layout.bytes,       layout.lse_offset,
                       n,        int(out.extent(1)), int(out.extent(2)),
                       segments, rows * segments};
  Strided3<OutT> o = strided(out);
  // bf16 output: one V-element vector; fp32 output: 16-byte vectors (two of them for V = 8)
  o.vec = vectorizable(out, sizeof(OutT) == 2 ? V : kLaneColumns);
  const WarpGrid g = warp_grid(args.warps);
  if (args.warps <= kSpeculativeMaxWarps)
    combine_launch(name, spec, g.grid, g.block, stream, args, o, strided(out_lse));
  else
    combine_launch(name, plain, g.grid, g.block, stream, args, o, strided(out_lse));
}
/// Whether merge_row_kernel serves a merge of `states` states over T x H_local rows (see "Small
/// merges" at the top of this file); T and H_local must fit its grid's y and x.
inline bool row_kernel_serves(bool tree, int states, std::int64_t t, std::int64_t hl) {
  if (t > 65535 || hl > 65535 || states > kRowKernelMaxStates) return false;
  if (!tree) return true;
  return states <= 4 || t * hl <= kRowKernelMaxTree8Rows;
}

/// Launches merge_row_kernel `kernel` (V columns per thread) over out's rows, grid (H_local, T,
/// column segments).
template <int V, class OutT, class KRow>
void launch_merge_rows(const char* name, KRow kernel, const std::byte* recv, int n,
                       const ::dcpattn::detail::A2aChunkLayout& layout,
                       const TensorView<OutT, 3>& out, const TensorView<float, 2>& out_lse,
                       cudaStream_t stream) {
  const std::int64_t threads_needed = (out.extent(2) + V - 1) / V;
  const int threads = int(
      std::min<std::int64_t>((threads_needed + kWarpSize - 1) / kWarpSize * kWarpSize, kRowBlock));
  const int segments = int((threads_needed + threads - 1) / threads);
  const std::int64_t rows = out.extent(0) * out.extent(1);
  const MergeArgs args{recv,     layout.bytes,       layout.lse_offset,
                       n,        int(out.extent(1)), int(out.extent(2)),
                       segments, rows * segments};
  Strided3<OutT> o = strided(out);
  o.vec = vectorizable(out, sizeof(OutT) == 2 ? V : kLaneColumns);
  combine_launch(name, kernel,
                 dim3(unsigned(out.extent(1)), unsigned(out.extent(0)), unsigned(segments)),
                 dim3(unsigned(threads)), stream, args, o, strided(out_lse));
}

template <class OutT, class PartT, int V, int S, int C>
void launch_merge_tree(const std::byte* recv, int n,
                       const ::dcpattn::detail::A2aChunkLayout& layout,
                       const TensorView<OutT, 3>& out, const TensorView<float, 2>& out_lse,
                       cudaStream_t stream) {
  if constexpr (S <= kRowKernelMaxStates) {
    if (row_kernel_serves(true, S, out.extent(0), out.extent(1))) {
      if (n == S)
        launch_merge_rows<V>("merge_row_kernel", merge_row_kernel<OutT, PartT, V, S, true, true>,
                             recv, n, layout, out, out_lse, stream);
      else  // n = 1 on the 2-state tree
        launch_merge_rows<V>("merge_row_kernel", merge_row_kernel<OutT, PartT, V, S, true, false>,
                             recv, n, layout, out, out_lse, stream);
      return;
    }
  }
  launch_merge_kernel<V, C>("merge_tree_kernel", merge_tree_kernel<OutT, PartT, V, S, C, true>,
                            merge_tree_kernel<OutT, PartT, V, S, C, false>, recv, n, layout, out,
                            out_lse, stream);
}
/// The fast merge: merge_row_kernel for up to kRowKernelMaxStates states (S: n rounded up to 2,
/// 4 or 8; kExact where n is one of them), merge_sum_kernel with batches of kMaxSumBatch states (C
/// vectors per lane) otherwise.
template <class OutT, class PartT, int V, int C>
void launch_merge_fast(const std::byte* recv, int n,
                       const ::dcpattn::detail::A2aChunkLayout& layout,
                       const TensorView<OutT, 3>& out, const TensorView<float, 2>& out_lse,
                       cudaStream_t stream) {
  static_assert(kRowKernelMaxStates == 8);
  if (row_kernel_serves(false, n, out.extent(0), out.extent(1))) {
    auto go = [&](auto kernel) {
      launch_merge_rows<V>("merge_row_kernel", kernel, recv, n, layout, out, out_lse, stream);
    };
    switch (n) {
      case 2:
        go(merge_row_kernel<OutT, PartT, V, 2, false, true>);
        break;
      case 4:
        go(merge_row_kernel<OutT, PartT, V, 4, false, true>);
        break;
      case 8:
        go(merge_row_kernel<OutT, PartT, V, 8, false, true>);
        break;
      case 1:
        go(merge_row_kernel<OutT, PartT, V, 2, false, false>);
        break;
      case 3:
        go(merge_row_kernel<OutT, PartT, V, 4, false, false>);
        break;
      default:
        go(merge_row_kernel<OutT, PartT, V, 8, false, false>);
        break;  // 5 to 7
    }
    return;
  }
  launch_merge_kernel<V, C>("merge_sum_kernel", merge_sum_kernel<OutT, PartT, V, C, true>,
                            merge_sum_kernel<OutT, PartT, V, C, false>, recv, n, layout, out,
                            out_lse, stream);
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
      detail::combine_launch("pack_kernel", detail::pack_kernel<T, kV>,
                             detail::flat_grid(total / kV), dim3(detail::kFlatBlock), stream, s,
                             dst, e1, e2, total / kV);
      return;
    }
  }
  detail::combine_launch("pack_kernel", detail::pack_kernel<T, 1>, detail::flat_grid(total),
                         dim3(detail::kFlatBlock), stream, s, dst, e1, e2, total);
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
  detail::combine_launch("row_local_lengths_kernel", detail::row_local_lengths_kernel<Ownership>,
                         detail::flat_grid(rows), dim3(detail::kFlatBlock), stream, own, rank,
                         bound.data_handle(), bound.stride(0), num_valid_rows, out, rows);
}

/// dst (T, H) contiguous = sanitize_lse(lse(t, h), Base) for t < num_valid_rows, -inf on padding.
/// Bitwise the host's.
template <class Base>
void sanitize_lse_rows(TensorView<const float, 2> lse, int num_valid_rows, float* dst,
                       cudaStream_t stream) {
  const std::int64_t total = lse.extent(0) * lse.extent(1);
  if (total == 0) return;
  detail::combine_launch("sanitize_lse_rows_kernel", detail::sanitize_lse_rows_kernel<Base>,
                         detail::flat_grid(total), dim3(detail::kFlatBlock), stream,
                         detail::strided(lse), std::int64_t(lse.extent(1)), num_valid_rows, dst,
                         total);
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
    detail::combine_launch("convert_rows_kernel", detail::convert_rows_kernel<OutT>,
                           detail::flat_grid(vectors), dim3(detail::kFlatBlock), stream, src, o, e1,
                           e2, vectors);
  } else {
    detail::combine_launch("convert_rows_scalar_kernel", detail::convert_rows_scalar_kernel<OutT>,
                           detail::flat_grid(total), dim3(detail::kFlatBlock), stream, src, o, e1,
                           e2, total);
  }
}

/// Packs the local partial state for the all-to-all, as host::combine_pack_a2a: o (T, H, Dv) fp32,
/// lse (T, H) in base Base. Rows t >= num_valid_rows and states whose lse is -inf, +inf or NaN go
/// out as the neutral element (o = 0, lse = -inf) whatever their o holds (read and dropped). send:
/// group_size chunks of layout.bytes, 16-byte aligned. Bitwise the host's.
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
  const int hl = int(h / group_size);
  const int segments = detail::row_segments(dv, 4 * detail::kWarpSize * detail::kLaneColumns);
  const std::int64_t warps = t * h * segments;
  const detail::WarpGrid lg = detail::warp_grid(warps);
  auto go = [&](auto kernel) {
    detail::combine_launch("pack_a2a_kernel", kernel, lg.grid, lg.block, stream, detail::strided(o),
                           detail::strided(lse), num_valid_rows, int(h), hl, int(dv), segments,
                           warps, send, layout.bytes, layout.lse_offset);
  };
  if (dtype == PartialDtype::fp32)
    go(detail::pack_a2a_kernel<Base, float>);
  else
    go(detail::pack_a2a_kernel<Base, bfloat16>);
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
  DCPATTN_REQUIRE(group_size >= 1, "combine_merge_a2a: group_size (" + std::to_string(group_size) +
                                       ") must be >= 1");
  if (mode == DcpMode::deterministic)
    DCPATTN_REQUIRE(is_power_of_two(group_size) && group_size <= detail::kMaxTreeStates,
                    std::string("combine_merge_a2a: deterministic mode needs a power-of-two "
                                "group_size of at most ") +
                        std::to_string(detail::kMaxTreeStates) + " on CUDA, got " +
                        std::to_string(group_size));
  const int n = group_size;
  if (dtype == PartialDtype::fp32) {
    using P = float;
    if (mode == DcpMode::fast) {
      detail::launch_merge_fast<OutT, P, 4, 2>(recv, n, layout, out, out_lse, stream);
    } else if (n <= 2) {  // n = 1 runs the 2-state tree, which passes the one state through
      detail::launch_merge_tree<OutT, P, 4, 2, 4>(recv, n, layout, out, out_lse, stream);
    } else if (n == 4) {
      detail::launch_merge_tree<OutT, P, 4, 4, 4>(recv, n, layout, out, out_lse, stream);
    } else if (n == 8) {
      detail::launch_merge_tree<OutT, P, 4, 8, 2>(recv, n, layout, out, out_lse, stream);
    } else if (n == 16) {
      detail::launch_merge_tree<OutT, P, 4, 16, 1>(recv, n, layout, out, out_lse, stream);
    } else {
      detail::launch_merge_tree<OutT, P, 4, 32, 1>(recv, n, layout, out, out_lse, stream);
    }
  } else {
    using P = bfloat16;
    // 16-byte vectors of 8 bf16 need Dv % 8 == 0 (row starts 16-byte aligned); 8-byte vectors
    // of 4 otherwise, and for 16 or 32 tree states (register room).
    const bool v8 = dv % 8 == 0;
    if (mode == DcpMode::fast) {
      if (v8)
        detail::launch_merge_fast<OutT, P, 8, 2>(recv, n, layout, out, out_lse, stream);
      else
        detail::launch_merge_fast<OutT, P, 4, 4>(recv, n, layout, out, out_lse, stream);
    } else if (!v8) {  // any n <= 32 (a power of two): the 32-state tree with 8-byte vectors
      detail::launch_merge_tree<OutT, P, 4, 32, 1>(recv, n, layout, out, out_lse, stream);
    } else if (n <= 2) {
      detail::launch_merge_tree<OutT, P, 8, 2, 2>(recv, n, layout, out, out_lse, stream);
    } else if (n == 4) {
      detail::launch_merge_tree<OutT, P, 8, 4, 2>(recv, n, layout, out, out_lse, stream);
    } else if (n == 8) {
      detail::launch_merge_tree<OutT, P, 8, 8, 1>(recv, n, layout, out, out_lse, stream);
    } else if (n == 16) {
      detail::launch_merge_tree<OutT, P, 4, 16, 1>(recv, n, layout, out, out_lse, stream);
    } else {
      detail::launch_merge_tree<OutT, P, 4, 32, 1>(recv, n, layout, out, out_lse, stream);
    }
  }
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
  const int segments = detail::row_segments(dv, 4 * detail::kWarpSize * detail::kLaneColumns);
  const std::int64_t warps = t * h * segments;
  const detail::WarpGrid lg = detail::warp_grid(warps);
  auto go = [&](auto kernel) {
    detail::combine_launch("rescale_agrs_kernel", kernel, lg.grid, lg.block, stream,
                           detail::strided(o), lse_all, rank, group_size, int(h),
                           int(h / group_size), t, int(dv), segments, warps, packed,
                           detail::aligned_to(packed, 16), detail::strided(out_lse));
  };
  if (warps <= detail::kSpeculativeMaxWarps)
    go(detail::rescale_agrs_kernel<true>);
  else
    go(detail::rescale_agrs_kernel<false>);
}

}  // namespace cuda_kernels

DCPATTN_NAMESPACE_END
