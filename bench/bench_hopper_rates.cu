// SPDX-License-Identifier: Apache-2.0
// Rates of the SM that the MLA decode kernels (kernels/cuda/mla_decode.cuh) are built around,
// measured on the device (sm_90a):
//   - wgmma: cycles per m64nNk16 f16 product (A from registers, B from shared memory) for one SM,
//     with W warpgroups issuing independent products at once (N = 16: the kernel's value
//     products; N = 32 for comparison), and per m64n32k32 e4m3 product (its score products, A
//     the codes from registers), and both again with products whose sums depend on each other
//     (1, 2 or 4 accumulators in turn instead of 8: a chain of k-steps into one accumulator).
//     Cycles from clock64 around 2000 x 32 products per warpgroup.
//   - e4m3 -> f16 conversion: f16x2 results per SM per clock of cvt.rn.f16x2.e4m3x2 (the kernel's
//     conversion), of an integer-only conversion (byte permutes, masks and shifts into the f16
//     bits of the value times 2^-8), and of the two alternating. Checked first against each other
//     on all 256 codes (NaN codes excepted).
//   - shared-memory stores: bytes per SM per clock of 16-byte st.shared stores of a 64 x 576
//     bf16 tile in the kernels' swizzled layout (tile_offset; 384 threads, as the 64-head fp8
//     kernel's dequantization), into the CTA's own shared memory, half of it into the other CTA
//     of a 2-CTA cluster (st.shared::cluster), or all of it there: what a pair of head-block
//     CTAs would pay to share one tile's dequantization; and the half handed over as such a pair
//     would: by st.async (asynchronous stores completing on the partner's mbarrier), with eight
//     lanes to a 128-byte row, or by bulk copies of the own half once it is stored. Cycles from
//     clock64 around 2000 tiles, a cluster barrier after each.
//   - the split states' traffic through the L2 at batch 1 (the tail of a 128-head 1 x 32K MLA
//     decode call: 128 CTAs, one per SM, each writing its 64 x 512 state, then a merge reading all
//     of them): the span from the first CTA's start to the last CTA's end (%globaltimer, the
//     median of 9 launches) of 128 CTAs each storing 128 KiB (fp32) or 64 KiB (bf16) into a
//     buffer that stays in the L2, in the split kernels' pattern (256 threads, a quad's 32 bytes
//     to each of 8 rows a store; also with the rows' start staggered, and with a thread's two rows
//     in turn) and in whole 512-byte rows a warp; and of 128 CTAs of 512 threads each reading its
//     head's value dims of the 64 states, as the merge kernel of 64 states does. Beside each span,
//     the time per launch of 20 launches back to back in a CUDA graph.
//   - products with both operands in shared memory (the 64-head kernels' products): cycles per
//     m64n64k16 bf16 product in the kernels' score pattern (36 k-steps over 9 column blocks of
//     the query and the tile, one accumulator; checked against the host's product), per m64n32k16
//     product in the same pattern (the scores of a 32-token half tile), and per m64n256k16 value
//     product (4 a wait, the values MN-major), each alone and beside a second warpgroup storing
//     or loading 16-byte chunks of other shared memory as fast as it can (what a conversion of
//     the next tile beside the products would do): the products' cycles and the other
//     warpgroup's bytes per clock. Then the products' own rate and latency: m64nNk16 for N = 64,
//     128, 256 on one column block, B K-major or MN-major, 4 or 32 products between waits.
// Every SM runs the same CTAs; the figures are per SM (the L2 traffic's: per GPU). JSON records go
// to argv[1] (default hopper_rates.json).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <cuda_fp16.h>

#include "bench_common.cuh"

#include "dcpattn/kernels/cuda/mla_decode.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && __CUDA_ARCH__ < 1000 && \
    defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DCPATTN_RATES_WGMMA 1
#endif

namespace {

// The kernel's own helpers: the shared-memory descriptor (128-byte swizzle) and the e4m3 -> f16
// conversion.
using dcpattn::cuda_kernels::detail::mla::wg::e4m3x4_to_f16x2x2;
using dcpattn::cuda_kernels::detail::mla::wg::gmma_desc;
using dcpattn::cuda_kernels::detail::mla::wg::tile_offset;

constexpr int kStoreTiles = 2000;
constexpr int kStoreThreads = 384;
constexpr int kTileChunks = 64 * 576 * 2 / 16;  // 16-byte chunks of a 64 x 576 bf16 tile

// kMode 0: every chunk into this CTA's shared memory; 1: the chunks of the partner's 32 rows
// into the partner's (the other CTA of the cluster), the others into this CTA's; 2: every chunk
// into the partner's; 3: as 1, the partner's chunks by st.async, which completes them on the
// partner's mbarrier (expect_tx of the half tile, waited for before the cluster barrier);
// 4: as 3 and 5: as 1, with eight lanes to a 128-byte row (below); 6: this CTA's rows into its
// own shared memory, then copied into the partner's by 9 bulk copies of 4 KiB (cp.async.bulk
// shared::cta -> shared::cluster), completing on the partner's mbarrier as in 3.
// Modes 0-3, 6: chunk i is row i mod 64, column chunk i / 64: a quarter warp writes 8 rows of
// distinct swizzle phases (no bank conflict), as the kernel's dequantization does. Modes 4, 5:
// chunk i is chunk i mod 8 of row (i / 8) mod 64 of column block i / 512.
template <int kMode>
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(kStoreThreads)
    smem_store_rate_kernel(unsigned long long* cycles) {
  extern __shared__ __align__(1024) unsigned char tile[];
  __shared__ __align__(8) std::uint64_t landed;  // modes 3, 4, 6: the partner's half is in
  std::uint32_t rank = 0, local = 0, remote = 0, bar = 0, remote_bar = 0;
#if defined(DCPATTN_RATES_WGMMA)
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  local = std::uint32_t(__cvta_generic_to_shared(tile));
  bar = std::uint32_t(__cvta_generic_to_shared(&landed));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n"
               : "=r"(remote)
               : "r"(local), "r"(rank ^ 1u));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n"
               : "=r"(remote_bar)
               : "r"(bar), "r"(rank ^ 1u));
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::
                   : "memory");
  const long long t0 = clock64();
  for (int it = 0; it < kStoreTiles; ++it) {
    if ((kMode == 3 || kMode == 4 || kMode == 6) && threadIdx.x == 0)
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar),
                   "r"(kTileChunks * 8)
                   : "memory");
    for (int i = int(threadIdx.x); i < kTileChunks; i += kStoreThreads) {
      const int row = kMode >= 4 ? (i >> 3) & 63 : i & 63;
      const std::uint32_t off =
          kMode >= 4 ? std::uint32_t((i >> 9) * 8192 + row * 128 + (((i & 7) ^ (row & 7)) << 4))
                     : tile_offset(row, i >> 6);
      const std::uint32_t v = std::uint32_t(i + it);
      if (kMode == 6 && std::uint32_t(row >> 5) != rank) continue;  // the partner's rows: copied
      const bool far = kMode == 2 || (kMode != 0 && kMode != 6 && std::uint32_t(row >> 5) != rank);
      if (far && (kMode == 3 || kMode == 4))
        asm volatile(
            "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %1, %1, "
            "%1}, [%2];\n" ::"r"(remote + off),
            "r"(v), "r"(remote_bar)
            : "memory");
      else if (far)
        asm volatile("st.shared::cluster.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(remote + off),
                     "r"(v)
                     : "memory");
      else
        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(local + off), "r"(v)
                     : "memory");
    }
    if (kMode == 6) {
      // This CTA's 32 rows of each column block (4 KiB, contiguous) into the partner's shared
      // memory by the tensor memory accelerator, completing on the partner's mbarrier.
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      __syncthreads();
      if (threadIdx.x < 9) {
        const std::uint32_t off = threadIdx.x * 8192u + rank * 4096u;
        asm volatile(
            "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], "
            "4096, [%2];\n" ::"r"(remote + off),
            "r"(local + off), "r"(remote_bar)
            : "memory");
      }
    }
    if (kMode == 3 || kMode == 4 || kMode == 6) {
      std::uint32_t done = 0;
      while (!done)
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
            "selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(std::uint32_t(it & 1))
            : "memory");
    }
    asm volatile(
        "barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::
            : "memory");
  }
  const long long t1 = clock64();
  if (threadIdx.x == 0) cycles[blockIdx.x] = static_cast<unsigned long long>(t1 - t0);
#else
  (void)cycles, (void)rank, (void)local, (void)remote, (void)bar, (void)remote_bar, (void)landed;
  __trap();
#endif
}

template <int N, bool kFp8>
__device__ __forceinline__ void mma_rs(float (&d)[N / 2], const std::uint32_t (&a)[4],
                                       std::uint64_t b) {
#if defined(DCPATTN_RATES_WGMMA)
  static_assert(!kFp8 || N == 32, "the e4m3 product is m64n32k32");
  if constexpr (kFp8) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,"
        "%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, 1, 1, 1;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
  } else if constexpr (N == 16) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, "
        "{%8,%9,%10,%11}, %12, 1, 1, 1, 0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
  } else {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,"
        "%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, 1, 1, 1, 0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
  }
#else
  (void)d, (void)a, (void)b;
  __trap();
#endif
}

constexpr int kProductsPerRound = 32;  // 8 A fragments x 4 k-steps
constexpr int kRounds = 2000;

/// W warpgroups, each issuing kRounds rounds of 32 products; out[w] = its cycles. The products
/// go to kChains accumulators in turn (8: independent neighbours; 1: each product waits for the
/// previous one's sum, as a chain of k-steps into one accumulator).
template <int N, bool kFp8, int kChains = 8>
__global__ void wgmma_rate_kernel(unsigned long long* out, float* sink) {
  extern __shared__ __align__(1024) unsigned char smem[];
  for (int i = threadIdx.x; i < 16384; i += blockDim.x) smem[i] = 0;
  __syncthreads();
  const std::uint32_t base = std::uint32_t(__cvta_generic_to_shared(smem));
  std::uint32_t a[8][4];  // distinct registers per product, as in the kernel
  for (int j = 0; j < 8; ++j)
    for (int e = 0; e < 4; ++e)
      a[j][e] = reinterpret_cast<const std::uint32_t*>(smem)[(threadIdx.x + 4 * j + e) & 1023] |
                0x3c003c00u;
  float d[8][N / 2] = {};
  const unsigned long long t0 = clock64();
#if defined(DCPATTN_RATES_WGMMA)
  for (int it = 0; it < kRounds; ++it) {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int u = 0; u < 4; ++u)
#pragma unroll
      for (int j = 0; j < 8; ++j)
        mma_rs<N, kFp8>(d[j % kChains], a[j], gmma_desc(base + 32 * u + 2048 * (j & 3), 16, 1024));
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
  }
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#endif
  const unsigned long long t1 = clock64();
  float s = 0.0f;
  for (int j = 0; j < 8; ++j)
    for (int e = 0; e < N / 2; ++e) s += d[j][e];
  if (s == 1.2345f) sink[threadIdx.x] = s;  // never: keeps the products
  if ((threadIdx.x & 127) == 0 && blockIdx.x == 0) out[threadIdx.x / 128] = t1 - t0;
}

/// The f16 bits of (e4m3 value x 2^-8): the sign to bit 15, the other 7 bits to bits 13..7.
__device__ __forceinline__ void cvt_int(std::uint32_t w, std::uint32_t& lo, std::uint32_t& hi) {
  const std::uint32_t m = w & 0x7F7F7F7Fu, s = w & 0x80808080u;
  lo = (__byte_perm(m, 0, 0x4140) << 7) | __byte_perm(s, 0, 0x1404);
  hi = (__byte_perm(m, 0, 0x4342) << 7) | __byte_perm(s, 0, 0x3424);
}

/// Counts the codes (of all 256, NaN excepted) where cvt_int differs from e4m3x4_to_f16x2x2 x 2^-8.
__global__ void convert_check_kernel(int* bad) {
  const std::uint32_t c = threadIdx.x;
  const std::uint32_t w =
      c | (((c + 1) & 255) << 8) | (((c + 2) & 255) << 16) | (((c + 3) & 255) << 24);
  std::uint32_t l0, h0, l1, h1;
  e4m3x4_to_f16x2x2(w, l0, h0);
  cvt_int(w, l1, h1);
  const std::uint32_t r0[4] = {l0 & 0xFFFFu, l0 >> 16, h0 & 0xFFFFu, h0 >> 16};
  const std::uint32_t r1[4] = {l1 & 0xFFFFu, l1 >> 16, h1 & 0xFFFFu, h1 >> 16};
  for (int i = 0; i < 4; ++i) {
    if (((c + i) & 0x7F) == 0x7F) continue;  // NaN
    __half_raw a, b;
    a.x = static_cast<unsigned short>(r0[i]);
    b.x = static_cast<unsigned short>(r1[i]);
    const float fa = __half2float(__half(a)) * 0.00390625f, fb = __half2float(__half(b));
    if (__float_as_uint(fa) != __float_as_uint(fb)) atomicAdd(bad, 1);
  }
}

constexpr int kConvertIters = 4096;

/// mode 0: cvt; 1: integer ops; 2: the two alternating. 8 independent chains a thread.
template <int kMode>
__global__ void convert_rate_kernel(const std::uint32_t* in, std::uint32_t* out) {
  std::uint32_t x[8];
  for (int i = 0; i < 8; ++i) x[i] = in[(threadIdx.x + 37 * i) & 1023];
  std::uint32_t acc = 0;
  for (int it = 0; it < kConvertIters; ++it) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      std::uint32_t lo, hi;
      if (kMode == 0 || (kMode == 2 && (i & 1) == 0))
        e4m3x4_to_f16x2x2(x[i], lo, hi);
      else
        cvt_int(x[i], lo, hi);
      acc ^= lo ^ hi;
      x[i] += 0x01010101u;
    }
  }
  if (acc == 0x12345678u) out[threadIdx.x] = acc;  // never: keeps the conversions
}

// ---- the split states through the L2 ----
constexpr int kStateCtas = 128;                // 2 head blocks x 64 splits: 128 heads at 1 x 32K
constexpr int kStateThreads = 256;             // the 64-head kernels' two consumer warpgroups
constexpr int kStateValues = 64 * 512;         // a CTA's state: 64 heads x 512 dims
__device__ unsigned g_state_smid[kStateCtas];  // the SM of each CTA of the last launch

__device__ __forceinline__ unsigned smid() {
  unsigned id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}

/// One 8-byte store of two floats (st.global.v2.f32), as the split kernels' float2 stores
/// compile; a plain float2 assignment here compiled to two 4-byte stores.
__device__ __forceinline__ void st_v2(void* p, float a, float b) {
  asm volatile("st.global.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(a), "f"(b) : "memory");
}

/// Each CTA stores its state (kStateValues of T) into `dst` + blockIdx.x * kStateValues, then
/// records its start and end (%globaltimer; with kFence the end after a fence, so that its stores
/// are performed, else once they are issued).
/// kRows false: the split kernels' pattern (warpgroup g: dims [256 g, +256); warp w of it: rows
/// 16 w + lane / 4 and + 8; per store a quad writes 32 bytes of one row, 8 a lane: fp32 2 dims,
/// bf16 4); true: each warp stores whole 512-byte rows, 16 bytes a lane.
/// kOrder (the split kernels' pattern): 0 as they store; 1 warp w of CTA b starts at column
/// block 4 w + b (mod 32); 2 a thread's two rows in turn at each column block.
template <class T, bool kRows, bool kFence = true, int kOrder = 0>
__global__ void __launch_bounds__(kStateThreads)
    state_store_kernel(T* dst, unsigned long long* stamps) {
  __syncthreads();
  const unsigned long long t0 = dcpattn::bench::globaltimer_ns();
  T* base = dst + std::size_t(blockIdx.x) * kStateValues;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float v = float(blockIdx.x + threadIdx.x);
  if (dst == nullptr) {
    // nothing stored: the launch and the stamps alone
  } else if constexpr (kRows) {
    constexpr int kPerVec = 16 / int(sizeof(T));
    uint4* q = reinterpret_cast<uint4*>(base);
    const uint4 x = make_uint4(__float_as_uint(v), 0u, 1u, 2u);
    for (int i = threadIdx.x; i < kStateValues / kPerVec; i += kStateThreads) q[i] = x;
  } else {
    const int g = warp >> 2, wq = warp & 3;
#pragma unroll
    for (int i = 0; i < 64; ++i) {
      const int half = kOrder == 2 ? i & 1 : i >> 5;
      const int c0 = kOrder == 2 ? i >> 1 : i & 31;
      const int c = kOrder == 1 ? (c0 + 4 * warp + int(blockIdx.x)) & 31 : c0;
      const int r = 16 * wq + (lane >> 2) + 8 * half;
      if constexpr (sizeof(T) == 4) {
        st_v2(base + r * 512 + 256 * g + 8 * c + 2 * (lane & 3), v, v + 1.0f);
      } else if ((c0 & 1) == 0) {
        // bf16: as the split kernels' bf16 states, a quad's 32 bytes (16 dims) of one row a
        // store, 8 bytes a lane: dims 8 c + 4 (lane mod 4) .. + 3.
        st_v2(base + r * 512 + 256 * g + 8 * c + 4 * (lane & 3), v, v);
      }
    }
  }
  if constexpr (kFence) __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    stamps[2 * blockIdx.x] = t0;
    g_state_smid[blockIdx.x] = smid();
    stamps[2 * blockIdx.x + 1] = dcpattn::bench::globaltimer_ns();
  }
}

/// The merge kernel's reads of 64 fp32 states: CTA h (of 128, 512 threads) reads value dim
/// threadIdx.x of state (k, h) for every k, all loads issued before any is used, and stamps its
/// start and end as state_store_kernel.
__global__ void __launch_bounds__(512)
    state_read_kernel(const float* __restrict__ src, float* sink, unsigned long long* stamps) {
  __syncthreads();
  const unsigned long long t0 = dcpattn::bench::globaltimer_ns();
  float v[64];
#pragma unroll
  for (int k = 0; k < 64; ++k)
    v[k] = src[(std::size_t(k) * kStateCtas + blockIdx.x) * 512 + threadIdx.x];
  float s = 0.0f;
#pragma unroll
  for (int k = 0; k < 64; ++k) s += v[k];
  if (s == 1.2345f) sink[threadIdx.x] = s;  // never: keeps the loads
  __syncthreads();
  if (threadIdx.x == 0) {
    stamps[2 * blockIdx.x] = t0;
    g_state_smid[blockIdx.x] = smid();
    stamps[2 * blockIdx.x + 1] = dcpattn::bench::globaltimer_ns();
  }
}

template <int N, int W, bool kFp8 = false, int kChains = 8>
void wgmma_case(dcpattn::bench::JsonRecords& json, int clock_khz) {
  unsigned long long* out = nullptr;
  float* sink = nullptr;
  DCPATTN_CUDA_CHECK(cudaMalloc(&out, 8 * sizeof(unsigned long long)));
  DCPATTN_CUDA_CHECK(cudaMalloc(&sink, 1024 * sizeof(float)));
  DCPATTN_CUDA_CHECK(cudaFuncSetAttribute(wgmma_rate_kernel<N, kFp8, kChains>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, 16384));
  int sms = 0;
  DCPATTN_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  double worst = 0.0;
  for (int rep = 0; rep < 2; ++rep) {  // the first launch warms up
    wgmma_rate_kernel<N, kFp8, kChains><<<sms, 128 * W, 16384>>>(out, sink);
    DCPATTN_CUDA_CHECK(cudaGetLastError());
    DCPATTN_CUDA_CHECK(cudaDeviceSynchronize());
    unsigned long long h[8] = {};
    DCPATTN_CUDA_CHECK(cudaMemcpy(h, out, sizeof h, cudaMemcpyDeviceToHost));
    worst = 0.0;
    for (int w = 0; w < W; ++w) worst = std::max(worst, double(h[w]));
  }
  const double per_wg = worst / (double(kRounds) * kProductsPerRound);
  std::printf(
      "wgmma m64n%dk%d %s (A registers), %d warpgroup(s) per SM, %d accumulator(s) in turn: "
      "%6.1f cycles a product per warpgroup, %5.1f cycles a product per SM\n",
      N, kFp8 ? 32 : 16, kFp8 ? "e4m3" : "f16", W, kChains, per_wg, per_wg / W);
  json.begin()
      .field("kind", "wgmma")
      .field("type", kFp8 ? "e4m3" : "f16")
      .field("n", N)
      .field("k", kFp8 ? 32 : 16)
      .field("warpgroups", W)
      .field("accumulators_in_turn", kChains)
      .field("cycles_per_product_per_warpgroup", per_wg)
      .field("cycles_per_product_per_sm", per_wg / W)
      .field("clock_khz", clock_khz);
  cudaFree(out);
  cudaFree(sink);
}

// ---- products with both operands in shared memory, beside other shared-memory traffic ----
// The 64-head kernels' products read both operands from shared memory: the scores as 36
// m64n64k16 products a tile (the query block and the tile's keys, 2 KiB of each a product), the
// values as m64n256k16 products (P, 2 KiB, and 8 KiB of the tile's values, MN-major). A half
// tile of 32 tokens would make the scores m64n32k16 products, the query read twice a tile.
// Warpgroup 0 issues the products; warpgroup 1 meanwhile stores (or loads) 16-byte chunks of
// another 32 KiB of shared memory as fast as it can, as a conversion of the next tile beside the
// products would, or stays idle.
constexpr int kSsA = 0;                  // A: 9 column blocks of 64 rows x 128 bytes (72 KiB)
constexpr int kSsB = 9 * 8192;           // B: up to 9 column blocks of 64 rows (72 KiB)
constexpr int kSsTraffic = 2 * 9 * 8192; // warpgroup 1's 32 KiB
constexpr int kSsFlag = kSsTraffic + 32768;
constexpr int kSsBytes = kSsFlag + 16;

/// Word i of the operands' shared memory in CTA `cta`: two random bf16 values of either sign in
/// [2^-7, 1). The tensor cores must see varied operands; the host rebuilds CTA 0's for its check.
__host__ __device__ inline std::uint32_t ss_word(std::uint32_t i, std::uint32_t cta) {
  std::uint32_t h = i * 0x9e3779b9u + cta;
  h ^= h >> 15;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  return (h & 0x83FF83FFu) | 0x3C003C00u;
}

// The accumulator operands of the products below: registers %0.. of the asm string, d[0]..
#define DCPATTN_RATES_R16 "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15"
#define DCPATTN_RATES_R0 \
  DCPATTN_RATES_R16 ",%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
#define DCPATTN_RATES_R1 \
  "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47," \
  "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
#define DCPATTN_RATES_R2 \
  "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79," \
  "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95"
#define DCPATTN_RATES_R3 \
  "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111," \
  "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127"
#define DCPATTN_RATES_D8(o)                                                                   \
  "+f"(d[o]), "+f"(d[o + 1]), "+f"(d[o + 2]), "+f"(d[o + 3]), "+f"(d[o + 4]), "+f"(d[o + 5]), \
      "+f"(d[o + 6]), "+f"(d[o + 7])
#define DCPATTN_RATES_D32(o) \
  DCPATTN_RATES_D8(o), DCPATTN_RATES_D8(o + 8), DCPATTN_RATES_D8(o + 16), DCPATTN_RATES_D8(o + 24)

/// m64nNk16 bf16 products, both operands in shared memory, A K-major, B K-major (kTransB 0) or
/// MN-major (1), accumulating into d (N / 2 floats a thread).
template <int N, int kTransB>
__device__ __forceinline__ void mma_ss(float* d, std::uint64_t a, std::uint64_t b) {
#if defined(DCPATTN_RATES_WGMMA)
  if constexpr (N == 32) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {" DCPATTN_RATES_R16
                 "}, %16, %17, 1, 1, 1, 0, %18;\n"
                 : DCPATTN_RATES_D8(0), DCPATTN_RATES_D8(8)
                 : "l"(a), "l"(b), "n"(kTransB));
  } else if constexpr (N == 64) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" DCPATTN_RATES_R0
                 "}, %32, %33, 1, 1, 1, 0, %34;\n"
                 : DCPATTN_RATES_D32(0)
                 : "l"(a), "l"(b), "n"(kTransB));
  } else if constexpr (N == 128) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" DCPATTN_RATES_R0
                 "," DCPATTN_RATES_R1 "}, %64, %65, 1, 1, 1, 0, %66;\n"
                 : DCPATTN_RATES_D32(0), DCPATTN_RATES_D32(32)
                 : "l"(a), "l"(b), "n"(kTransB));
  } else {
    static_assert(N == 256, "m64n32k16, m64n64k16, m64n128k16 or m64n256k16");
    asm volatile("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" DCPATTN_RATES_R0
                 "," DCPATTN_RATES_R1 "," DCPATTN_RATES_R2 "," DCPATTN_RATES_R3
                 "}, %128, %129, 1, 1, 1, 0, %130;\n"
                 : DCPATTN_RATES_D32(0), DCPATTN_RATES_D32(32), DCPATTN_RATES_D32(64),
                   DCPATTN_RATES_D32(96)
                 : "l"(a), "l"(b), "n"(kTransB));
  }
#else
  (void)d, (void)a, (void)b;
  __trap();
#endif
}
#undef DCPATTN_RATES_R16
#undef DCPATTN_RATES_R0
#undef DCPATTN_RATES_R1
#undef DCPATTN_RATES_R2
#undef DCPATTN_RATES_R3
#undef DCPATTN_RATES_D8
#undef DCPATTN_RATES_D32

/// The same products by shape alone, on one 64-dim column block of the operands: rounds of
/// kSteps products (the block's 4 k-steps in turn) into one accumulator, then a wait. B K-major:
/// N rows of 128 bytes; MN-major: N / 64 blocks of 64 k-rows x 128 bytes, 8 KiB apart (the
/// values' layout). out[b]: the cycles, out[gridDim.x + b]: the SM.
template <int N, int kTransB, int kSteps>
__global__ void __launch_bounds__(128, 1) ss_shape_kernel(unsigned long long* out, float* sink) {
  extern __shared__ __align__(1024) unsigned char smem[];
  for (int i = threadIdx.x; i < (8192 + 32768) / 4; i += blockDim.x)
    reinterpret_cast<std::uint32_t*>(smem)[i] = ss_word(std::uint32_t(i), blockIdx.x);
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const std::uint32_t base = std::uint32_t(__cvta_generic_to_shared(smem));
  float d[N / 2] = {};
  const unsigned long long t0 = clock64();
#if defined(DCPATTN_RATES_WGMMA)
  for (int it = 0; it < 16000 / kSteps; ++it) {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int k = 0; k < kSteps; ++k) {
      const int ks = k & 3;
      const std::uint64_t a = gmma_desc(base + 32 * ks, 16, 1024);
      const std::uint64_t b = kTransB ? gmma_desc(base + 8192 + 2048 * ks, 8192, 1024)
                                      : gmma_desc(base + 8192 + 32 * ks, 16, 1024);
      mma_ss<N, kTransB>(d, a, b);
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  }
#endif
  const unsigned long long t1 = clock64();
  float acc = 0.0f;
  for (float v : d) acc += v;
  if (acc == 1.2345f) sink[threadIdx.x] = acc;  // never: keeps the products
  if (threadIdx.x == 0) {
    out[blockIdx.x] = t1 - t0;
    out[gridDim.x + blockIdx.x] = smid();
  }
}

template <int N, int kTransB, int kSteps>
void ss_shape_case(dcpattn::bench::JsonRecords& json, int sms, int clock_khz) {
  unsigned long long* out = nullptr;
  float* sink = nullptr;
  DCPATTN_CUDA_CHECK(cudaMalloc(&out, std::size_t(2) * sms * sizeof(unsigned long long)));
  DCPATTN_CUDA_CHECK(cudaMalloc(&sink, 128 * sizeof(float)));
  // 200 KiB a CTA, so that each SM holds one (8 + 32 KiB are used; with 40 KiB, two CTAs could
  // share an SM: the same times, measured).
  constexpr int kBytes = 200 * 1024;
  DCPATTN_CUDA_CHECK(cudaFuncSetAttribute(ss_shape_kernel<N, kTransB, kSteps>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes));
  for (int rep = 0; rep < 2; ++rep) {
    ss_shape_kernel<N, kTransB, kSteps><<<sms, 128, kBytes>>>(out, sink);
    DCPATTN_CUDA_CHECK(cudaGetLastError());
    DCPATTN_CUDA_CHECK(cudaDeviceSynchronize());
  }
  std::vector<unsigned long long> h(std::size_t(2) * sms);
  DCPATTN_CUDA_CHECK(cudaMemcpy(h.data(), out, h.size() * sizeof h[0], cudaMemcpyDeviceToHost));
  std::vector<int> per_sm(1024, 0);
  int shared_sms = 0;
  for (int b = 0; b < sms; ++b)
    if (++per_sm[h[sms + b] & 1023] == 2) ++shared_sms;
  h.resize(sms);
  std::sort(h.begin(), h.end());
  const double per = double(h[h.size() / 2]) / 16000.0;
  std::printf("products from shared memory: m64n%dk16 bf16, B %s, one accumulator, %2d products "
              "a wait: %6.1f cycles a product, %5.0f flops a clock (SMs holding 2+ CTAs: %d)\n",
              N, kTransB ? "MN-major" : "K-major ", kSteps, per, 2.0 * 64 * N * 16 / per,
              shared_sms);
  json.begin()
      .field("kind", "wgmma_ss_shape")
      .field("n", N)
      .field("b_major", kTransB ? "MN" : "K")
      .field("products_per_wait", kSteps)
      .field("smem_bytes", kBytes)
      .field("sms_holding_two_or_more", shared_sms)
      .field("cycles_per_product", per)
      .field("flops_per_clock", 2.0 * 64 * N * 16 / per)
      .field("clock_khz", clock_khz);
  cudaFree(out);
  cudaFree(sink);
}

/// kShape 0: rounds of the 36 score products of a 64-token tile (m64n64k16, one accumulator, as
/// the kernels); 1: of a 32-token half tile (m64n32k16); 2: rounds of 4 value products
/// (m64n256k16, A = P, B = the values MN-major, as wgmma_m64n256_pv). kTraffic 0: warpgroup 1
/// idle; 1: it stores 16 bytes a thread a step (st.shared.v4); 2: it loads them (ld.shared.v4).
/// out[4 b]: warpgroup 0's cycles, out[4 b + 1]: warpgroup 1's cycles until it saw the products
/// done, out[4 b + 2]: the bytes it moved in them.
template <int kShape, int kTraffic>
__global__ void __launch_bounds__(256, 1)
    ss_rate_kernel(unsigned long long* out, float* sink, float* scores) {
  extern __shared__ __align__(1024) unsigned char smem[];
  for (int i = threadIdx.x; i < kSsBytes / 4; i += blockDim.x)
    reinterpret_cast<std::uint32_t*>(smem)[i] = ss_word(std::uint32_t(i), blockIdx.x);
  volatile int* flag = reinterpret_cast<volatile int*>(smem + kSsFlag);
  if (threadIdx.x == 0) *flag = 0;
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const std::uint32_t base = std::uint32_t(__cvta_generic_to_shared(smem));
  constexpr int kRoundsSs = kShape == 2 ? 4000 : 500;
  if (threadIdx.x < 128) {
    const unsigned long long t0 = clock64();
    float acc = 0.0f;
#if defined(DCPATTN_RATES_WGMMA)
    namespace wgk = dcpattn::cuda_kernels::detail::mla::wg;
    if constexpr (kShape == 0) {
      float d[32] = {};
      for (int it = 0; it < kRoundsSs; ++it) {
        wgk::wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < 36; ++ks) {
          const std::uint32_t off = std::uint32_t((ks >> 2) * 8192 + (ks & 3) * 32);
          // Always accumulating: a round that starts from zero leaves the round before it dead,
          // and ptxas then drops that round's products (seen in the machine code: the loop ran
          // half the rounds).
          wgk::wgmma_m64n64_qk(d, gmma_desc(base + kSsA + off, 16, 1024),
                               gmma_desc(base + kSsB + off, 16, 1024), 1);
        }
        wgk::wgmma_commit();
        wgk::wgmma_wait_all();
      }
      for (float v : d) acc += v;
      if (blockIdx.x == 0) {  // the rounds' sum of S = A B^T (64 x 64), for the host's check
        const int lane = threadIdx.x & 31, r0 = 16 * (threadIdx.x >> 5) + (lane >> 2);
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            scores[(r0 + 8 * (e >> 1)) * 64 + 8 * j + 2 * (lane & 3) + (e & 1)] = d[4 * j + e];
      }
    } else if constexpr (kShape == 1) {
      float d[16] = {};
      for (int it = 0; it < kRoundsSs; ++it) {
        wgk::wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < 36; ++ks) {
          const std::uint32_t in = std::uint32_t((ks & 3) * 32);
          mma_ss<32, 0>(d, gmma_desc(base + kSsA + (ks >> 2) * 8192 + in, 16, 1024),
                        gmma_desc(base + kSsB + (ks >> 2) * 4096 + in, 16, 1024));
        }
        wgk::wgmma_commit();
        wgk::wgmma_wait_all();
      }
      for (float v : d) acc += v;
    } else {
      float d[128] = {};
      for (int it = 0; it < kRoundsSs; ++it) {
        wgk::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          wgk::wgmma_m64n256_pv(d, gmma_desc(base + kSsA + kk * 32, 16, 1024),
                                gmma_desc(base + kSsB + kk * 2048, 8192, 1024), 1);
        wgk::wgmma_commit();
        wgk::wgmma_wait_all();
      }
      for (float v : d) acc += v;
    }
#endif
    const unsigned long long t1 = clock64();
    if (threadIdx.x == 0) *flag = 1;
    if (acc == 1.2345f) sink[threadIdx.x] = acc;  // never: keeps the products
    if (threadIdx.x == 0) out[4 * blockIdx.x] = t1 - t0;
  } else if (kTraffic != 0) {
    const int t = int(threadIdx.x) - 128;
    const unsigned long long t0 = clock64();
    unsigned long long steps = 0;
    std::uint32_t x = std::uint32_t(t), y = 1u, z = 2u, w = 3u;
    while (*flag == 0) {
#pragma unroll
      for (int u = 0; u < 16; ++u) {
        // 16 consecutive bytes a thread, a warp 512 contiguous bytes: no bank conflict.
        const std::uint32_t a =
            base + kSsTraffic + std::uint32_t(((int(steps) * 16 + u) * 128 + t) & 2047) * 16;
        if constexpr (kTraffic == 1) {
          asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(a), "r"(x), "r"(y),
                       "r"(z), "r"(w)
                       : "memory");
        } else {
          std::uint32_t p, q, r, s2;
          asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                       : "=r"(p), "=r"(q), "=r"(r), "=r"(s2)
                       : "r"(a)
                       : "memory");
          x ^= p;
          y ^= q;
          z ^= r;
          w ^= s2;
        }
      }
      ++steps;
    }
    const unsigned long long t1 = clock64();
    if ((x ^ y ^ z ^ w) == 0x12345678u) sink[128 + t] = 1.0f;  // never: keeps the loads
    if (t == 0) {
      out[4 * blockIdx.x + 1] = t1 - t0;
      out[4 * blockIdx.x + 2] = steps * 16 * 128 * 16;  // the warpgroup's bytes
    }
  }
}

template <int kShape, int kTraffic>
void ss_case(dcpattn::bench::JsonRecords& json, int sms, int clock_khz) {
  unsigned long long* out = nullptr;
  float* sink = nullptr;
  DCPATTN_CUDA_CHECK(cudaMalloc(&out, std::size_t(4) * sms * sizeof(unsigned long long)));
  float* scores = nullptr;
  DCPATTN_CUDA_CHECK(cudaMalloc(&sink, 256 * sizeof(float)));
  DCPATTN_CUDA_CHECK(cudaMalloc(&scores, 64 * 64 * sizeof(float)));
  DCPATTN_CUDA_CHECK(cudaMemset(out, 0, std::size_t(4) * sms * sizeof(unsigned long long)));
  DCPATTN_CUDA_CHECK(cudaFuncSetAttribute(ss_rate_kernel<kShape, kTraffic>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, kSsBytes));
  std::vector<unsigned long long> h(std::size_t(4) * sms);
  cudaEvent_t e0, e1;
  DCPATTN_CUDA_CHECK(cudaEventCreate(&e0));
  DCPATTN_CUDA_CHECK(cudaEventCreate(&e1));
  float ms = 0.0f;
  for (int rep = 0; rep < 2; ++rep) {  // the first launch warms up
    DCPATTN_CUDA_CHECK(cudaEventRecord(e0));
    ss_rate_kernel<kShape, kTraffic><<<sms, 256, kSsBytes>>>(out, sink, scores);
    DCPATTN_CUDA_CHECK(cudaGetLastError());
    DCPATTN_CUDA_CHECK(cudaEventRecord(e1));
    DCPATTN_CUDA_CHECK(cudaDeviceSynchronize());
    DCPATTN_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  DCPATTN_CUDA_CHECK(
      cudaMemcpy(h.data(), out, h.size() * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
  if constexpr (kShape == 0) {
    // The scores against the host's: the operands rebuilt as the kernel filled them (CTA 0),
    // each element read through the 128-byte swizzle (tile_offset's layout).
    std::vector<std::uint32_t> words(kSsBytes / 4);
    for (std::size_t i = 0; i < words.size(); ++i) words[i] = ss_word(std::uint32_t(i), 0);
    const auto* bytes = reinterpret_cast<const unsigned char*>(words.data());
    auto elem = [&](int region, int r, int dim) {
      const int chunk = ((dim >> 3) & 7) ^ (r & 7);  // the 128-byte swizzle of tile_offset
      const std::size_t off =
          std::size_t(region + (dim >> 6) * 8192 + r * 128 + chunk * 16 + (dim & 7) * 2);
      std::uint32_t bits = std::uint32_t(bytes[off]) | (std::uint32_t(bytes[off + 1]) << 8);
      bits <<= 16;
      float f;
      std::memcpy(&f, &bits, 4);
      return double(f);
    };
    std::vector<float> got(64 * 64);
    DCPATTN_CUDA_CHECK(
        cudaMemcpy(got.data(), scores, got.size() * sizeof(float), cudaMemcpyDeviceToHost));
    double worst = 0.0, norm = 0.0;
    for (int r = 0; r < 64; ++r)
      for (int n = 0; n < 64; ++n) {
        double ref = 0.0, mag = 0.0;
        for (int dim = 0; dim < 576; ++dim) {
          const double x = elem(kSsA, r, dim) * elem(kSsB, n, dim);
          ref += x;
          mag += std::abs(x);
        }
        worst = std::max(worst, std::abs(double(got[r * 64 + n]) / 500.0 - ref));
        norm = std::max(norm, mag);
      }
    if (worst > 1e-3 * norm)  // fp32 sums of 18000 products; every other round dropped: off by half
      throw dcpattn::Error("the m64n64k16 products' scores differ from the host's by " +
                           std::to_string(worst) + " (sum of |terms| up to " +
                           std::to_string(norm) + ")");
    std::printf("products from shared memory: the 64 x 64 scores (500 rounds' sum / 500) match "
                "the host's (max error %.2e of a sum of |terms| up to %.1f)\n", worst, norm);
  }
  // The median SM: products' cycles, and the other warpgroup's bytes per cycle of its own window.
  std::vector<double> prod, traffic;
  for (int b = 0; b < sms; ++b) {
    prod.push_back(double(h[4 * b]));
    if (kTraffic != 0) traffic.push_back(double(h[4 * b + 2]) / double(h[4 * b + 1]));
  }
  std::sort(prod.begin(), prod.end());
  std::sort(traffic.begin(), traffic.end());
  const double products = kShape == 2 ? 4000.0 * 4 : 500.0 * 36;
  const double per = prod[prod.size() / 2] / products;
  const int n = kShape == 0 ? 64 : kShape == 1 ? 32 : 256;
  const double operand_bytes = kShape == 0 ? 4096.0 : kShape == 1 ? 3072.0 : 10240.0;
  const double other = kTraffic != 0 ? traffic[traffic.size() / 2] : 0.0;
  const char* what = kShape == 2 ? "values" : "scores";
  const char* beside =
      kTraffic == 0 ? "nothing" : kTraffic == 1 ? "16-byte stores" : "16-byte loads";
  // The launch's matrix rate by the event timing: a check on the cycle count (the GPU's dense
  // bf16 peak is 4096 flops per SM and clock).
  const double tflops = 2.0 * 64 * n * 16 * products * sms / (double(ms) * 1e-3) * 1e-12;
  std::printf(
      "products from shared memory: %s m64n%dk16 bf16, beside %-14s: %6.1f cycles a product "
      "(%5.1f B/clk of operands), the other warpgroup %5.1f B/clk, together %5.1f B/clk; "
      "launch %.3f ms, %.0f TFLOP/s\n",
      what, n, beside, per, operand_bytes / per, other, operand_bytes / per + other, ms, tflops);
  json.begin()
      .field("kind", "wgmma_ss_beside_traffic")
      .field("products", what)
      .field("n", n)
      .field("beside", beside)
      .field("cycles_per_product", per)
      .field("operand_bytes_per_clock", operand_bytes / per)
      .field("other_bytes_per_clock", other)
      .field("launch_ms", double(ms))
      .field("tflops", tflops)
      .field("clock_khz", clock_khz);
  cudaFree(out);
  cudaFree(sink);
  cudaFree(scores);
}

template <int kMode>
void convert_case(dcpattn::bench::JsonRecords& json, const std::uint32_t* in, std::uint32_t* out,
                  int sms, int clock_khz) {
  const int blocks = 4 * sms, threads = 512;
  cudaEvent_t e0, e1;
  DCPATTN_CUDA_CHECK(cudaEventCreate(&e0));
  DCPATTN_CUDA_CHECK(cudaEventCreate(&e1));
  float ms = 0.0f;
  for (int rep = 0; rep < 3; ++rep) {  // the last of three
    DCPATTN_CUDA_CHECK(cudaEventRecord(e0));
    convert_rate_kernel<kMode><<<blocks, threads>>>(in, out);
    DCPATTN_CUDA_CHECK(cudaEventRecord(e1));
    DCPATTN_CUDA_CHECK(cudaEventSynchronize(e1));
    DCPATTN_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
  }
  const double results = double(blocks) * threads * kConvertIters * 8 * 2;  // f16x2 results
  const double per_sm_clock = results / (ms * 1e-3) / sms / (double(clock_khz) * 1e3);
  const char* name = kMode == 0 ? "cvt" : kMode == 1 ? "integer ops" : "cvt and integer ops";
  std::printf(
      "e4m3 -> f16x2 by %-19s: %6.2f results per SM per clock (at the %d MHz nominal "
      "clock)\n",
      name, per_sm_clock, clock_khz / 1000);
  json.begin()
      .field("kind", "e4m3_to_f16")
      .field("method", name)
      .field("results_per_sm_per_clock", per_sm_clock)
      .field("ms", ms)
      .field("clock_khz", clock_khz);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
}

template <int kMode>
void store_case(dcpattn::bench::JsonRecords& json, int sms, int clock_khz) {
  constexpr int kBytes = kTileChunks * 16;
  const int ctas = sms - sms % 2;
  unsigned long long* cycles = nullptr;
  DCPATTN_CUDA_CHECK(cudaMalloc(&cycles, std::size_t(ctas) * sizeof(unsigned long long)));
  DCPATTN_CUDA_CHECK(cudaFuncSetAttribute(smem_store_rate_kernel<kMode>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes));
  std::vector<unsigned long long> h(static_cast<std::size_t>(ctas));
  for (int rep = 0; rep < 2; ++rep) {  // the first launch warms up
    smem_store_rate_kernel<kMode><<<ctas, kStoreThreads, kBytes>>>(cycles);
    DCPATTN_CUDA_CHECK(cudaGetLastError());
    DCPATTN_CUDA_CHECK(cudaDeviceSynchronize());
    DCPATTN_CUDA_CHECK(cudaMemcpy(h.data(), cycles, h.size() * sizeof(unsigned long long),
                                  cudaMemcpyDeviceToHost));
  }
  const double worst = double(*std::max_element(h.begin(), h.end())) / kStoreTiles;
  const double best = double(*std::min_element(h.begin(), h.end())) / kStoreTiles;
  const char* name = kMode == 0   ? "own"
                     : kMode == 1 ? "half into the partner's"
                     : kMode == 2 ? "all into the partner's"
                     : kMode == 3 ? "half into the partner's by st.async"
                     : kMode == 4 ? "half, st.async, 128-byte rows"
                     : kMode == 5 ? "half, st.shared::cluster, 128-byte rows"
                                  : "half, bulk copies of the own half";
  std::printf(
      "st.shared of a 73,728-byte tile, %-36s: %7.0f - %7.0f cycles a tile (%5.1f - %5.1f bytes "
      "per SM per clock)\n",
      name, best, worst, kBytes / worst, kBytes / best);
  json.begin()
      .field("kind", "smem_store")
      .field("target", name)
      .field("threads", kStoreThreads)
      .field("bytes_per_tile", kBytes)
      .field("cycles_per_tile_max", worst)
      .field("cycles_per_tile_min", best)
      .field("bytes_per_sm_per_clock", kBytes / worst)
      .field("clock_khz", clock_khz);
  cudaFree(cycles);
}

/// One launch's stamps: the span from the first CTA's start to the last CTA's end, and the
/// median and largest of the CTAs' own durations, in us.
struct Stamps {
  double span, cta_median, cta_most;
};

Stamps read_stamps(const std::vector<unsigned long long>& h) {
  unsigned long long first = ~0ull, last = 0;
  std::vector<double> d;
  for (std::size_t i = 0; i + 1 < h.size(); i += 2) {
    first = std::min(first, h[i]);
    last = std::max(last, h[i + 1]);
    d.push_back(double(h[i + 1] - h[i]) / 1000.0);
  }
  std::sort(d.begin(), d.end());
  return {double(last - first) / 1000.0, d[d.size() / 2], d.back()};
}

/// launch() once to warm up, then 9 times; the launch of the median span.
template <class Launch>
Stamps median_stamps(Launch&& launch, unsigned long long* stamps) {
  std::vector<unsigned long long> h(std::size_t(2 * kStateCtas));
  std::vector<Stamps> runs;
  for (int rep = 0; rep < 10; ++rep) {
    launch();
    DCPATTN_CUDA_CHECK(cudaGetLastError());
    DCPATTN_CUDA_CHECK(cudaDeviceSynchronize());
    DCPATTN_CUDA_CHECK(cudaMemcpy(h.data(), stamps, h.size() * sizeof(unsigned long long),
                                  cudaMemcpyDeviceToHost));
    if (rep > 0) runs.push_back(read_stamps(h));
  }
  std::sort(runs.begin(), runs.end(),
            [](const Stamps& a, const Stamps& b) { return a.span < b.span; });
  return runs[runs.size() / 2];
}

void state_traffic_cases(dcpattn::bench::JsonRecords& json, int clock_khz) {
  const std::size_t bytes = std::size_t(kStateCtas) * kStateValues * sizeof(float);
  void* buf = nullptr;
  float* sink = nullptr;
  unsigned long long* stamps = nullptr;
  DCPATTN_CUDA_CHECK(cudaMalloc(&buf, bytes));
  DCPATTN_CUDA_CHECK(cudaMalloc(&sink, 512 * sizeof(float)));
  DCPATTN_CUDA_CHECK(cudaMalloc(&stamps, 2 * kStateCtas * sizeof(unsigned long long)));
  DCPATTN_CUDA_CHECK(cudaMemset(buf, 0, bytes));
  cudaStream_t stream = nullptr;
  DCPATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // Every case holds 200 KiB of shared memory a CTA, as the split kernels do: one CTA an SM.
  // (Without it the CTAs also took 128 SMs and the same time.)
  constexpr int kSmem = 200 * 1024;
  // Beside the stamps of one launch: the per-call time of 20 launches back to back in a CUDA
  // graph (each launch waits for the one before to complete, its stores included).
  auto record = [&](const char* what, double state_bytes, auto kernel, auto launch) {
    DCPATTN_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    const Stamps st = median_stamps([&] { launch(cudaStream_t{}); }, stamps);
    unsigned ids[kStateCtas];
    DCPATTN_CUDA_CHECK(cudaMemcpyFromSymbol(ids, g_state_smid, sizeof ids));
    std::sort(ids, ids + kStateCtas);
    const int sms_used = int(std::unique(ids, ids + kStateCtas) - ids);
    const double per_call = dcpattn::bench::median_us_graph([&] { launch(stream); }, stream, 20);
    std::printf(
        "split states through the L2, %-48s: span %6.2f us, back to back %6.2f us a "
        "call (%5.0f GB/s), %d SMs, a CTA %5.2f us (median), %5.2f (most)\n",
        what, st.span, per_call, state_bytes / per_call * 1e-3, sms_used, st.cta_median,
        st.cta_most);
    json.begin()
        .field("kind", "state_traffic")
        .field("what", what)
        .field("ctas", kStateCtas)
        .field("bytes", state_bytes)
        .field("span_us", st.span)
        .field("back_to_back_us", per_call)
        .field("gbs_back_to_back", state_bytes / per_call * 1e-3)
        .field("sms_used", sms_used)
        .field("clock_khz", clock_khz);
  };
  float* f = static_cast<float*>(buf);
  auto* b = static_cast<std::uint16_t*>(buf);
  const double fp32_bytes = double(bytes), bf16_bytes = double(bytes) / 2;
  // One case: `what`, its bytes and the store kernel <T, kRows, kFence, kOrder> on `dst`.
#define DCPATTN_STATE_STORE_CASE(what, bytes_, dst, ...)                                   \
  record(what, bytes_, state_store_kernel<__VA_ARGS__>, [&](cudaStream_t s) {              \
    state_store_kernel<__VA_ARGS__><<<kStateCtas, kStateThreads, kSmem, s>>>(dst, stamps); \
  })
  DCPATTN_STATE_STORE_CASE("nothing stored (the launch alone)", 0.0, nullptr, float, true);
  DCPATTN_STATE_STORE_CASE("fp32 stores, the split kernels' pattern", fp32_bytes, f, float, false);
  DCPATTN_STATE_STORE_CASE("the same, span to the last store issued (no fence)", fp32_bytes, f,
                           float, false, false);
  DCPATTN_STATE_STORE_CASE("the same, column blocks staggered by warp and CTA", fp32_bytes, f,
                           float, false, true, 1);
  DCPATTN_STATE_STORE_CASE("the same, rows r0 and r0 + 8 in turn", fp32_bytes, f, float, false,
                           true, 2);
  DCPATTN_STATE_STORE_CASE("fp32 stores, 512-byte rows", fp32_bytes, f, float, true);
  DCPATTN_STATE_STORE_CASE("bf16 stores, the split kernels' pattern", bf16_bytes, b, std::uint16_t,
                           false);
  DCPATTN_STATE_STORE_CASE("bf16 stores, 512-byte rows", bf16_bytes, b, std::uint16_t, true);
#undef DCPATTN_STATE_STORE_CASE
  record(
      "fp32 reads, the merge kernel's (64 states)", fp32_bytes, state_read_kernel,
      [&](cudaStream_t s) { state_read_kernel<<<kStateCtas, 512, kSmem, s>>>(f, sink, stamps); });
  cudaStreamDestroy(stream);
  cudaFree(buf);
  cudaFree(sink);
  cudaFree(stamps);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    int device = 0, major = 0, minor = 0, sms = 0, clock_khz = 0;
    DCPATTN_CUDA_CHECK(cudaGetDevice(&device));
    DCPATTN_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    DCPATTN_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    DCPATTN_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    DCPATTN_CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device));
    if (major != 9) {
      std::printf("bench_hopper_rates: compute capability %d.%d; these rates are sm_90a's\n", major,
                  minor);
      return 0;
    }
    dcpattn::bench::JsonRecords json;
    wgmma_case<16, 1>(json, clock_khz);
    wgmma_case<16, 2>(json, clock_khz);
    wgmma_case<16, 4>(json, clock_khz);
    wgmma_case<32, 1>(json, clock_khz);
    wgmma_case<32, 2>(json, clock_khz);
    wgmma_case<32, 1, true>(json, clock_khz);
    wgmma_case<32, 2, true>(json, clock_khz);
    // Products that depend on each other's sums: one accumulator, two, four in turn.
    wgmma_case<32, 1, false, 1>(json, clock_khz);
    wgmma_case<32, 1, false, 2>(json, clock_khz);
    wgmma_case<32, 1, true, 1>(json, clock_khz);
    wgmma_case<32, 1, true, 2>(json, clock_khz);
    wgmma_case<32, 1, true, 4>(json, clock_khz);
    wgmma_case<32, 2, true, 1>(json, clock_khz);
    wgmma_case<32, 2, true, 2>(json, clock_khz);
    // Both operands from shared memory, beside another warpgroup's shared-memory traffic.
    ss_case<0, 0>(json, sms, clock_khz);
    ss_case<0, 1>(json, sms, clock_khz);
    ss_case<0, 2>(json, sms, clock_khz);
    ss_case<1, 0>(json, sms, clock_khz);
    ss_case<1, 1>(json, sms, clock_khz);
    ss_case<1, 2>(json, sms, clock_khz);
    ss_case<2, 0>(json, sms, clock_khz);
    ss_case<2, 1>(json, sms, clock_khz);
    ss_case<2, 2>(json, sms, clock_khz);
    // The products' own rate and latency: one 64-dim column block, 4 or 32 products a wait.
    ss_shape_case<64, 0, 4>(json, sms, clock_khz);
    ss_shape_case<64, 1, 4>(json, sms, clock_khz);
    ss_shape_case<256, 0, 4>(json, sms, clock_khz);
    ss_shape_case<256, 1, 4>(json, sms, clock_khz);
    ss_shape_case<64, 0, 32>(json, sms, clock_khz);
    ss_shape_case<128, 0, 32>(json, sms, clock_khz);
    ss_shape_case<256, 0, 32>(json, sms, clock_khz);
    ss_shape_case<256, 1, 32>(json, sms, clock_khz);

    int* bad = nullptr;
    std::uint32_t *in = nullptr, *out = nullptr;
    DCPATTN_CUDA_CHECK(cudaMalloc(&bad, sizeof(int)));
    DCPATTN_CUDA_CHECK(cudaMemset(bad, 0, sizeof(int)));
    convert_check_kernel<<<1, 256>>>(bad);
    DCPATTN_CUDA_CHECK(cudaGetLastError());
    int h_bad = 0;
    DCPATTN_CUDA_CHECK(cudaMemcpy(&h_bad, bad, sizeof h_bad, cudaMemcpyDeviceToHost));
    if (h_bad != 0)
      throw dcpattn::Error("the integer e4m3 conversion differs on " + std::to_string(h_bad) +
                           " codes");
    std::uint32_t h_in[1024];
    for (int i = 0; i < 1024; ++i) h_in[i] = 0x9e3779b9u * std::uint32_t(i + 1);
    DCPATTN_CUDA_CHECK(cudaMalloc(&in, sizeof h_in));
    DCPATTN_CUDA_CHECK(cudaMalloc(&out, sizeof h_in));
    DCPATTN_CUDA_CHECK(cudaMemcpy(in, h_in, sizeof h_in, cudaMemcpyHostToDevice));
    convert_case<0>(json, in, out, sms, clock_khz);
    convert_case<1>(json, in, out, sms, clock_khz);
    convert_case<2>(json, in, out, sms, clock_khz);
    store_case<0>(json, sms, clock_khz);
    store_case<1>(json, sms, clock_khz);
    store_case<2>(json, sms, clock_khz);
    store_case<3>(json, sms, clock_khz);
    store_case<4>(json, sms, clock_khz);
    store_case<5>(json, sms, clock_khz);
    store_case<6>(json, sms, clock_khz);
    state_traffic_cases(json, clock_khz);
    cudaFree(bad);
    cudaFree(in);
    cudaFree(out);
    json.write(dcpattn::bench::json_path(argc, argv, "hopper_rates.json"));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_hopper_rates: %s\n", e.what());
    return 1;
  }
  return 0;
}
