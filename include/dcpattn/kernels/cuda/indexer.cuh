// SPDX-License-Identifier: Apache-2.0
// CUDA lightning indexer and exact distributed top-k: the stream-ordered counterparts of
// host::indexer_scores, host::local_topk, host::merge_topk, host::distributed_topk and
// host::indexer_topk (dcpattn/indexer/indexer.hpp), with the same arguments, the same workspace
// layout, and the same results (see below).
//
// Scores. One CTA scores a chunk of one row's local keys, 128 keys per tile: the row's query
// heads sit in registers as bf16 MMA fragments (fp8 queries are decoded to bf16 exactly), the
// tile's fp8 keys are decoded to bf16 in shared memory (exactly: every e4m3 value is a bf16), and
// mma.sync m16n8k16 (bf16 in, fp32 accumulate) forms the raw dot products d_j. Then one thread per
// key applies indexer_accumulate_head over the heads j = 0..H-1 in order, like the host. Only the
// summation order inside d_j differs from the host (tensor cores), so GPU scores are within a few
// fp32 ulps of sum |q k| of the host's and bitwise equal where the d_j are exact. A key's score
// depends only on its bytes and the row's query, never on the tile, chunk, rank or N: the top-k
// below is therefore N-invariant on the GPU as well.
//
// Top-k. Per row one CTA of 512 threads runs a radix select over the 64-bit order keys
// (topk_order_key: score image, then complemented index): at most six 11-bit digit passes, each a
// shared-memory histogram (warp-aggregated atomics) and a cub::BlockScan over the bins to find the
// bin of the k-th key, stopping as soon as that bin is taken whole. The keys at or above the
// threshold (exactly k: keys are distinct) are compacted in index order with cub::BlockScan. The
// local lists come out in ascending position (index order is position order on one rank); the
// merge sorts the chosen positions with cub::BlockRadixSort (512 threads x 4 items: k <= 2048).
// NaN scores rank as -inf (topk_canonical_score), exactly as on the host: GPU and host lists are
// identical for identical scores.
//
// What the host path checks and the GPU path cannot without a sync: request ids, page ids and
// bounds inside device buffers. The GPU path trusts them, except that a row's local length is
// clamped to the columns of `scores`, so nothing is written or read out of bounds of it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>
#include <cuda/std/span>

#include "dcpattn/comm/communicator.hpp"
#include "dcpattn/config.hpp"
#include "dcpattn/core/numeric.hpp"
#include "dcpattn/core/tensor.hpp"
#include "dcpattn/kernels/cuda/convert.cuh"
#include "dcpattn/error.hpp"
#include "dcpattn/indexer/distributed_topk.hpp"
#include "dcpattn/indexer/indexer.hpp"
#include "dcpattn/kernels/cache_layout.hpp"
#include "dcpattn/ownership/slot_ownership.hpp"

DCPATTN_NAMESPACE_BEGIN

namespace cuda_kernels {

/// Empty status when the CUDA indexer can run `c`: indexer_can_implement, plus 32 or 64 heads
/// and k <= 2048. Else a message naming the parameter.
inline Status indexer_can_implement(const IndexerConfig& c) {
  if (Status s = ::dcpattn::indexer_can_implement(c); !s.ok()) return s;
  if (c.num_heads != 32 && c.num_heads != 64)
    return Status::failure("num_heads (" + std::to_string(c.num_heads) +
                           ") must be 32 or 64 for the CUDA indexer");
  if (c.topk > kIndexerMaxTopk)
    return Status::failure("topk (" + std::to_string(c.topk) + ") must be <= " +
                           std::to_string(kIndexerMaxTopk) + " for the CUDA top-k");
  return Status::success();
}

namespace indexer_detail {

// ---- scores ------------------------------------------------------------------------------------

inline constexpr int kTileKeys = 128;             // keys per tile of the score kernel
inline constexpr int kSmemRow = kIndexerDim + 8;  // bf16 per shared row of q and k (272 bytes)
inline constexpr int kLogitRow = kTileKeys + 8;   // floats per shared row of logits
inline constexpr int kKSteps = kIndexerDim / 16;  // MMA k-steps over the 128 dims

/// Shared memory of the score kernel (dynamic; 88 KiB for 64 heads). The padded rows keep the
/// MMA fragment loads and the logit stores free of bank conflicts.
template <int kHeads>
struct ScoreShared {
  std::uint16_t q[kHeads][kSmemRow];     // bf16 bits of the row's raw query values
  std::uint16_t k[kTileKeys][kSmemRow];  // bf16 bits of the tile's raw key values
  float logits[kHeads][kLogitRow];       // raw dot products d_j of the tile
  float k_scale[kTileKeys];
  float q_scale[kHeads];
  float w[kHeads];
};

template <class QElem, class Ownership>
struct ScoreParams {
  TensorView<const QElem, 3> q;
  TensorView<const float, 2> q_scale;
  TensorView<const float, 2> weights;
  const std::uint8_t* k_cache;
  std::int64_t page_stride;  // bytes between pages
  std::int64_t page_size;
  TensorView<const std::int32_t, 2> block_table;
  TensorView<const std::int32_t, 1> row_request;
  TensorView<const std::int64_t, 1> row_bound;
  float* scores;
  std::int64_t score_stride;
  std::int64_t columns;
  int num_valid_rows;
  int rank;
  int tiles_per_cta;
  Ownership own;
};

DCPATTN_DEVICE std::uint16_t bf16_bits(bfloat16 x) {
  return x.bits;
}
DCPATTN_DEVICE std::uint16_t bf16_bits(std::uint8_t x) {
  return bfloat16::from_float(fp8_e4m3::decode(x)).bits;  // exact
}

/// Two e4m3 bytes (low byte first) to two bf16 in one 32-bit word, exactly.
DCPATTN_DEVICE std::uint32_t e4m3x2_to_bf16x2(std::uint32_t two) {
  const float2 f = detail::e4m3x2_to_float2(two);
  return detail::cvt_bf16x2(f.x, f.y);
}

DCPATTN_DEVICE std::uint32_t load_u32(const std::uint16_t* p) {
  return *reinterpret_cast<const std::uint32_t*>(p);
}

/// d += A (16 x 16, row-major bf16) * B (16 x 8, column-major bf16), fp32 accumulate.
DCPATTN_DEVICE void mma_bf16_16816(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                   std::uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  (void)d, (void)a, (void)b0, (void)b1;
  __trap();  // the indexer needs sm_80 or newer (built for sm_90a)
#endif
}

/// Grid: (chunks of tiles_per_cta tiles, T). Block: kHeads / 16 warps, warp w owning heads
/// [16 w, 16 w + 16) of the MMA.
template <class QElem, int kHeads, class Ownership>
__global__ void __launch_bounds__(kHeads * 2)
    indexer_score_kernel(const ScoreParams<QElem, Ownership> p) {
  constexpr int kThreads = kHeads * 2;
  extern __shared__ __align__(16) unsigned char indexer_score_smem[];
  auto& sm = *reinterpret_cast<ScoreShared<kHeads>*>(indexer_score_smem);

  const std::int64_t t = blockIdx.y;
  if (t >= p.num_valid_rows) return;
  std::int64_t n = p.own.local_length(p.row_bound(t), p.rank);
  n = n < p.columns ? n : p.columns;
  const std::int64_t begin = std::int64_t(blockIdx.x) * p.tiles_per_cta * kTileKeys;
  if (begin >= n) return;
  const std::int64_t chunk_end = begin + std::int64_t(p.tiles_per_cta) * kTileKeys;
  const std::int64_t end = n < chunk_end ? n : chunk_end;
  const int tid = int(threadIdx.x);
  const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, c = lane & 3;
  const std::int32_t req = p.row_request(t);

  for (int e = tid; e < kHeads * kIndexerDim; e += kThreads) {
    const int j = e / kIndexerDim, i = e % kIndexerDim;
    sm.q[j][i] = bf16_bits(p.q(t, std::int64_t(j), std::int64_t(i)));
  }
  for (int j = tid; j < kHeads; j += kThreads) {
    if constexpr (std::is_same_v<QElem, std::uint8_t>)
      sm.q_scale[j] = p.q_scale(t, std::int64_t(j));
    else
      sm.q_scale[j] = 1.0f;
    sm.w[j] = p.weights(t, std::int64_t(j));
  }
  __syncthreads();

  // A fragments of this warp's 16 heads over the 128 dims (m16n8k16 row-major layout).
  std::uint32_t a[kKSteps][4];
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
    const std::uint16_t* r0 = &sm.q[warp * 16 + g][ks * 16 + 2 * c];
    const std::uint16_t* r1 = &sm.q[warp * 16 + g + 8][ks * 16 + 2 * c];
    a[ks][0] = load_u32(r0);
    a[ks][1] = load_u32(r1);
    a[ks][2] = load_u32(r0 + 8);
    a[ks][3] = load_u32(r1 + 8);
  }

  for (std::int64_t base = begin; base < end; base += kTileKeys) {
    const int count = int(end - base < kTileKeys ? end - base : kTileKeys);
    // Keys: 8 threads per key, 16 bytes each (coalesced 128-byte rows); zeros past the end.
    for (int e = tid; e < kTileKeys * 8; e += kThreads) {
      const int key = e >> 3, chunk = e & 7;
      uint4 raw = make_uint4(0u, 0u, 0u, 0u);
      if (key < count) {
        const std::int64_t pos = base + key;
        const std::int64_t page = p.block_table(std::int64_t(req), pos / p.page_size);
        const std::int64_t s = pos % p.page_size;
        const std::uint8_t* page_ptr = p.k_cache + page * p.page_stride;
        raw = *reinterpret_cast<const uint4*>(page_ptr + s * kIndexerDim + chunk * 16);
        if (chunk == 0)
          sm.k_scale[key] =
              *reinterpret_cast<const float*>(page_ptr + p.page_size * kIndexerDim + s * 4);
      }
      const uint4 lo = make_uint4(e4m3x2_to_bf16x2(raw.x), e4m3x2_to_bf16x2(raw.x >> 16),
                                  e4m3x2_to_bf16x2(raw.y), e4m3x2_to_bf16x2(raw.y >> 16));
      const uint4 hi = make_uint4(e4m3x2_to_bf16x2(raw.z), e4m3x2_to_bf16x2(raw.z >> 16),
                                  e4m3x2_to_bf16x2(raw.w), e4m3x2_to_bf16x2(raw.w >> 16));
      uint4* dst = reinterpret_cast<uint4*>(&sm.k[key][chunk * 16]);
      dst[0] = lo;
      dst[1] = hi;
    }
    __syncthreads();

    // d_j for 16 heads x 128 keys per warp: 16 n-tiles of 8 keys, 8 k-steps each.
    for (int nt = 0; nt < kTileKeys / 8; ++nt) {
      float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      const std::uint16_t* kr = &sm.k[nt * 8 + g][2 * c];
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks)
        mma_bf16_16816(d, a[ks], load_u32(kr + ks * 16), load_u32(kr + ks * 16 + 8));
      *reinterpret_cast<float2*>(&sm.logits[warp * 16 + g][nt * 8 + 2 * c]) =
          make_float2(d[0], d[1]);
      *reinterpret_cast<float2*>(&sm.logits[warp * 16 + g + 8][nt * 8 + 2 * c]) =
          make_float2(d[2], d[3]);
    }
    __syncthreads();

    // Head sum, one thread per key, heads in order: the host's arithmetic.
    for (int key = tid; key < count; key += kThreads) {
      const float ks = sm.k_scale[key];
      float s = 0.0f;
      for (int j = 0; j < kHeads; ++j)
        s = indexer_accumulate_head(s, sm.logits[j][key], ks, sm.q_scale[j], sm.w[j]);
      p.scores[t * p.score_stride + base + key] = s;
    }
    __syncthreads();
  }
}

template <class QElem, int kHeads, class Ownership>
void launch_scores(const ScoreParams<QElem, Ownership>& p, std::int64_t rows, cudaStream_t stream) {
  const std::int64_t tiles = (p.columns + kTileKeys - 1) / kTileKeys;
  const std::int64_t chunks = (tiles + p.tiles_per_cta - 1) / p.tiles_per_cta;
  if (rows == 0 || chunks == 0) return;
  constexpr std::size_t smem = sizeof(ScoreShared<kHeads>);
  auto kernel = indexer_score_kernel<QElem, kHeads, Ownership>;
  DCPATTN_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  DCPATTN_REQUIRE(chunks <= 0x7fffffff, "scores has too many columns for one grid");
  kernel<<<dim3(unsigned(chunks), unsigned(rows)), kHeads * 2, smem, stream>>>(p);
  DCPATTN_CUDA_CHECK(cudaGetLastError());
}

// ---- top-k -------------------------------------------------------------------------------------

inline constexpr int kSelectThreads = 512;
inline constexpr int kRadixBits = 11;
inline constexpr int kRadixBins = 1 << kRadixBits;
inline constexpr int kBinsPerThread = kRadixBins / kSelectThreads;
inline constexpr int kSortItems = kIndexerMaxTopk / kSelectThreads;
static_assert(kBinsPerThread * kSelectThreads == kRadixBins);
static_assert(kSortItems * kSelectThreads == kIndexerMaxTopk);

using SelectScan = cub::BlockScan<int, kSelectThreads>;

struct SelectShared {
  unsigned int hist[kRadixBins];
  typename SelectScan::TempStorage scan;
  int bin;
  int above;
  int bin_count;
};

/// The smallest key T such that exactly k of the n items have key >= T, where key_at(i) is the
/// item's topk_order_key (distinct for distinct items) or 0 for an item that is not a candidate.
/// Requires more than k nonzero keys. Radix descent, 11 bits per pass, highest digit first; stops
/// when the bin holding the k-th key is taken whole. Called by all threads of the block.
template <class KeyAt>
__device__ std::uint64_t radix_select_threshold(std::int64_t n, int k, const KeyAt& key_at,
                                                SelectShared& sm) {
  const int tid = int(threadIdx.x), lane = tid & 31;
  std::uint64_t prefix = 0;  // the high `bits` bits of the k-th key
  int bits = 0;
  int need = k;  // items still to take among those whose high bits equal prefix
  while (bits < 64) {
    const int width = 64 - bits < kRadixBits ? 64 - bits : kRadixBits;
    const int shift = 64 - bits - width;
    for (int b = tid; b < kRadixBins; b += kSelectThreads) sm.hist[b] = 0u;
    __syncthreads();
    for (std::int64_t base = 0; base < n; base += kSelectThreads) {  // uniform trip count
      const std::int64_t i = base + tid;
      int digit = -1;
      if (i < n) {
        const std::uint64_t key = key_at(i);
        if (key != 0 && (bits == 0 || (key >> (64 - bits)) == prefix))
          digit = int((key >> shift) & ((std::uint64_t(1) << width) - 1));
      }
      const unsigned peers = __match_any_sync(0xffffffffu, digit);
      if (digit >= 0 && lane == __ffs(int(peers)) - 1)
        atomicAdd(&sm.hist[digit], unsigned(__popc(peers)));
    }
    __syncthreads();
    // Bins in descending order, kBinsPerThread consecutive ones per thread; the exclusive sum is
    // the count of items in higher bins.
    int cnt[kBinsPerThread], above[kBinsPerThread];
#pragma unroll
    for (int q = 0; q < kBinsPerThread; ++q)
      cnt[q] = int(sm.hist[kRadixBins - 1 - (tid * kBinsPerThread + q)]);
    SelectScan(sm.scan).ExclusiveSum(cnt, above);
#pragma unroll
    for (int q = 0; q < kBinsPerThread; ++q)
      if (above[q] < need && above[q] + cnt[q] >= need) {
        sm.bin = kRadixBins - 1 - (tid * kBinsPerThread + q);
        sm.above = above[q];
        sm.bin_count = cnt[q];
      }
    __syncthreads();
    const int bin = sm.bin, bin_count = sm.bin_count;
    need -= sm.above;
    prefix = (prefix << width) | std::uint64_t(bin);
    bits += width;
    __syncthreads();
    if (bin_count == need) break;  // the whole bin is taken
  }
  return bits == 64 ? prefix : prefix << (64 - bits);
}

/// Calls emit(slot, i) for every item with a nonzero key >= threshold, slots 0, 1, ... in index
/// order. Called by all threads of the block.
template <class KeyAt, class Emit>
__device__ void compact_selected(std::int64_t n, std::uint64_t threshold, const KeyAt& key_at,
                                 const Emit& emit, SelectShared& sm) {
  int out = 0;
  for (std::int64_t base = 0; base < n; base += kSelectThreads) {
    const std::int64_t i = base + threadIdx.x;
    int selected = 0;
    if (i < n) {
      const std::uint64_t key = key_at(i);
      selected = key != 0 && key >= threshold ? 1 : 0;
    }
    int offset = 0, total = 0;
    SelectScan(sm.scan).ExclusiveSum(selected, offset, total);
    if (selected) emit(out + offset, i);
    out += total;
    __syncthreads();
  }
}

template <class Ownership>
struct LocalTopkParams {
  const float* scores;
  std::int64_t score_stride;
  std::int64_t columns;
  TensorView<const std::int64_t, 1> row_bound;
  TopkCandidate* out;  // (T, k) contiguous
  int num_valid_rows;
  int k;
  int rank;
  Ownership own;
};

/// One block per row: the row's candidate list (see host::local_topk).
template <class Ownership>
__global__ void __launch_bounds__(kSelectThreads)
    local_topk_kernel(const LocalTopkParams<Ownership> p) {
  __shared__ SelectShared sm;
  const std::int64_t t = blockIdx.x;
  TopkCandidate* out = p.out + t * p.k;
  std::int64_t n = 0;
  if (t < p.num_valid_rows) {
    n = p.own.local_length(p.row_bound(t), p.rank);
    n = n < p.columns ? n : p.columns;
  }
  const float* s = p.scores + t * p.score_stride;
  const auto candidate = [&](std::int64_t i) {
    return TopkCandidate{topk_canonical_score(s[i]),
                         std::int32_t(p.own.global_position(i, p.rank))};
  };
  if (n <= p.k) {
    for (int i = int(threadIdx.x); i < p.k; i += kSelectThreads)
      out[i] = i < n ? candidate(i) : topk_padding_candidate();
    return;
  }
  // Within a rank the global position grows with the local one: the index breaks ties.
  const auto key_at = [s](std::int64_t i) { return topk_order_key(s[i], std::uint32_t(i)); };
  const std::uint64_t threshold = radix_select_threshold(n, p.k, key_at, sm);
  compact_selected(
      n, threshold, key_at, [&](int slot, std::int64_t i) { out[slot] = candidate(i); }, sm);
}

struct MergeParams {
  const TopkCandidate* gathered;  // (N * T, k) contiguous, rank-major
  std::int64_t rows;              // T
  std::int32_t* out;
  std::int64_t out_stride;
  int group_size;
  int k;
  int num_valid_rows;
};

/// One block per row: the global top-k of the row's N candidate lists (see host::merge_topk).
/// (A template, like every kernel of this header, so that several translation units may include
/// it: a plain __global__ function would be defined in each.)
template <int kItems = kSortItems>
__global__ void __launch_bounds__(kSelectThreads) merge_topk_kernel(const MergeParams p) {
  using MergeSort = cub::BlockRadixSort<std::uint32_t, kSelectThreads, kItems>;
  static_assert(kItems * kSelectThreads >= kIndexerMaxTopk);
  __shared__ union {
    SelectShared select;
    typename MergeSort::TempStorage sort;
  } sm;
  __shared__ std::uint32_t chosen[kItems * kSelectThreads];
  const std::int64_t t = blockIdx.x;
  const int tid = int(threadIdx.x);
  std::int32_t* out = p.out + t * p.out_stride;
  if (t >= p.num_valid_rows) {
    for (int i = tid; i < p.k; i += kSelectThreads) out[i] = -1;
    return;
  }
  const std::int64_t n = std::int64_t(p.group_size) * p.k;
  const auto candidate = [&](std::int64_t i) {
    const std::int64_t r = i / p.k, j = i % p.k;
    return p.gathered[(r * p.rows + t) * p.k + j];
  };
  const auto key_at = [&](std::int64_t i) {
    const TopkCandidate c = candidate(i);
    return c.position >= 0 ? topk_order_key(c.score, std::uint32_t(c.position)) : std::uint64_t(0);
  };
  int mine = 0;
  for (std::int64_t i = tid; i < n; i += kSelectThreads) mine += candidate(i).position >= 0;
  int ignored = 0, valid = 0;
  SelectScan(sm.select.scan).ExclusiveSum(mine, ignored, valid);
  __syncthreads();
  const std::uint64_t threshold =
      valid > p.k ? radix_select_threshold(n, p.k, key_at, sm.select) : std::uint64_t(1);
  compact_selected(
      n, threshold, key_at,
      [&](int slot, std::int64_t i) { chosen[slot] = std::uint32_t(candidate(i).position); },
      sm.select);
  const int taken = valid < p.k ? valid : p.k;
  for (int i = taken + tid; i < kItems * kSelectThreads; i += kSelectThreads)
    chosen[i] = 0xffffffffu;
  __syncthreads();
  std::uint32_t keys[kItems];
#pragma unroll
  for (int q = 0; q < kItems; ++q) keys[q] = chosen[tid * kItems + q];
  MergeSort(sm.sort).Sort(keys);  // ascending; the 0xffffffff fillers go last
#pragma unroll
  for (int q = 0; q < kItems; ++q) {
    const int i = tid * kItems + q;
    if (i < p.k) out[i] = keys[q] == 0xffffffffu ? -1 : std::int32_t(keys[q]);
  }
}

inline void require_aligned(const void* ptr, std::size_t alignment, const char* name) {
  DCPATTN_REQUIRE(reinterpret_cast<std::uintptr_t>(ptr) % alignment == 0,
                  std::string(name) + " must be " + std::to_string(alignment) +
                      "-byte aligned for the CUDA indexer");
}

}  // namespace indexer_detail

/// CUDA indexer scores of this rank's keys: what host::indexer_scores computes (same arguments,
/// same entries written), stream-ordered, no allocation, no host sync. Device buffers throughout.
///
/// @tparam QElem bfloat16 or std::uint8_t (fp8 e4m3 queries with q_scale)
/// @param scores (T, C) fp32, contiguous rows (stride(1) == 1); a row whose local length exceeds C
///               is scored on its first C keys only (the host path refuses it)
/// Extra requirements: H in {32, 64}; k_cache 16-byte aligned with contiguous pages whose byte
/// stride is a multiple of 16 (page_size a multiple of 4); T <= 65535. Violations throw
/// dcpattn::Error naming the parameter, before anything is enqueued.
template <class QElem, class Ownership>
void indexer_scores(const Ownership& own, int rank, const IndexerArgs<QElem>& a,
                    TensorView<float, 2> scores, cudaStream_t stream) {
  static_assert(SlotOwnership<Ownership>, DCPATTN_SLOT_OWNERSHIP_MESSAGE);
  dcpattn::detail::validate_indexer_shapes(a, scores);
  const std::int64_t t = a.q.extent(0);
  const int heads = int(a.q.extent(1));
  DCPATTN_REQUIRE(heads == 32 || heads == 64,
                  "q has " + std::to_string(heads) + " heads; the CUDA indexer supports 32 or 64");
  DCPATTN_REQUIRE(rank >= 0 && rank < own.group_size(),
                  "rank (" + std::to_string(rank) +
                      ") must be in [0, group_size = " + std::to_string(own.group_size()) + ")");
  DCPATTN_REQUIRE(t <= 65535, "T (" + std::to_string(t) + ") must be <= 65535 on the GPU");
  DCPATTN_REQUIRE(scores.extent(0) == 0 || scores.extent(1) <= 1 || scores.stride(1) == 1,
                  "scores must have contiguous rows (stride(1) == 1)");
  DCPATTN_REQUIRE(a.k_cache.extent(0) <= 1 || a.k_cache.stride(0) % 16 == 0,
                  "k_cache pages must be a multiple of 16 bytes apart");
  DCPATTN_REQUIRE(a.k_cache.stride(1) == 1, "k_cache pages must be contiguous (stride(1) == 1)");
  indexer_detail::require_aligned(a.k_cache.data_handle(), 16, "k_cache");
  if (a.num_valid_rows == 0 || scores.extent(1) == 0) return;

  // About 2048 tiles per launch: one tile per CTA for short batches (parallelism), up to 16 for
  // large ones (the query fragments are loaded once per CTA).
  const std::int64_t columns = scores.extent(1);
  const std::int64_t tiles = (columns + indexer_detail::kTileKeys - 1) / indexer_detail::kTileKeys;
  const std::int64_t per = tiles * a.num_valid_rows / 2048;
  const indexer_detail::ScoreParams<QElem, Ownership> p{
      .q = a.q,
      .q_scale = a.q_scale,
      .weights = a.weights,
      .k_cache = a.k_cache.data_handle(),
      .page_stride = a.k_cache.extent(0) > 1 ? a.k_cache.stride(0) : a.k_cache.extent(1),
      .page_size = IndexerKCacheLayout::page_size(a.k_cache.extent(1)),
      .block_table = a.block_table,
      .row_request = a.row_request,
      .row_bound = a.row_bound,
      .scores = scores.data_handle(),
      .score_stride = scores.extent(0) > 1 ? scores.stride(0) : columns,
      .columns = columns,
      .num_valid_rows = a.num_valid_rows,
      .rank = rank,
      .tiles_per_cta = int(per < 1 ? 1 : (per > 16 ? 16 : per)),
      .own = own};
  if (heads == 64)
    indexer_detail::launch_scores<QElem, 64>(p, a.num_valid_rows, stream);
  else
    indexer_detail::launch_scores<QElem, 32>(p, a.num_valid_rows, stream);
}

/// CUDA per-rank top-k: what host::local_topk computes (bytes identical for identical scores).
/// `scores` (T, C) with contiguous rows; `out` (T, k) contiguous, k <= 2048 is not required here
/// (only the merge needs it). Stream-ordered.
template <class Ownership>
void local_topk(const Ownership& own, int rank, TensorView<const float, 2> scores,
                TensorView<const std::int64_t, 1> row_bound, int num_valid_rows,
                TensorView<TopkCandidate, 2> out, cudaStream_t stream) {
  static_assert(SlotOwnership<Ownership>, DCPATTN_SLOT_OWNERSHIP_MESSAGE);
  const std::int64_t rows = scores.extent(0);
  const int k = int(out.extent(1));
  dcpattn::detail::validate_local_topk_shape(rows, scores.extent(1), row_bound.extent(0),
                                             num_valid_rows, k, out.extent(0), out.extent(1));
  DCPATTN_REQUIRE(rank >= 0 && rank < own.group_size(),
                  "rank (" + std::to_string(rank) +
                      ") must be in [0, group_size = " + std::to_string(own.group_size()) + ")");
  DCPATTN_REQUIRE(rows <= 1 || out.stride(0) == k, "the candidate list must be contiguous");
  DCPATTN_REQUIRE(out.stride(1) == 1 || k == 1, "the candidate list must be contiguous");
  DCPATTN_REQUIRE(scores.extent(1) <= 1 || scores.stride(1) == 1,
                  "scores must have contiguous rows (stride(1) == 1)");
  if (rows == 0) return;
  const indexer_detail::LocalTopkParams<Ownership> p{
      .scores = scores.data_handle(),
      .score_stride = rows > 1 ? scores.stride(0) : scores.extent(1),
      .columns = scores.extent(1),
      .row_bound = row_bound,
      .out = out.data_handle(),
      .num_valid_rows = num_valid_rows,
      .k = k,
      .rank = rank,
      .own = own};
  indexer_detail::local_topk_kernel<Ownership>
      <<<unsigned(rows), indexer_detail::kSelectThreads, 0, stream>>>(p);
  DCPATTN_CUDA_CHECK(cudaGetLastError());
}

/// CUDA global top-k from the gathered candidate lists: what host::merge_topk computes.
/// `gathered` (N * T, k) contiguous; `topk_indices` (T, k) with contiguous rows, k <= 2048.
inline void merge_topk(TensorView<const TopkCandidate, 2> gathered, int group_size,
                       int num_valid_rows, TensorView<std::int32_t, 2> topk_indices,
                       cudaStream_t stream) {
  dcpattn::detail::validate_merge_shape(gathered.extent(0), gathered.extent(1), group_size,
                                        num_valid_rows, topk_indices.extent(0),
                                        topk_indices.extent(1));
  const std::int64_t rows = topk_indices.extent(0);
  const int k = int(topk_indices.extent(1));
  DCPATTN_REQUIRE(k <= kIndexerMaxTopk, "topk (" + std::to_string(k) + ") must be <= " +
                                            std::to_string(kIndexerMaxTopk) + " on the GPU");
  DCPATTN_REQUIRE(
      (gathered.extent(0) <= 1 || gathered.stride(0) == k) && (k == 1 || gathered.stride(1) == 1),
      "the gathered candidate lists must be contiguous");
  DCPATTN_REQUIRE(k == 1 || topk_indices.stride(1) == 1,
                  "topk_indices must have contiguous rows (stride(1) == 1)");
  if (rows == 0) return;
  const indexer_detail::MergeParams p{.gathered = gathered.data_handle(),
                                      .rows = rows,
                                      .out = topk_indices.data_handle(),
                                      .out_stride = rows > 1 ? topk_indices.stride(0) : k,
                                      .group_size = group_size,
                                      .k = k,
                                      .num_valid_rows = num_valid_rows};
  indexer_detail::merge_topk_kernel<>
      <<<unsigned(rows), indexer_detail::kSelectThreads, 0, stream>>>(p);
  DCPATTN_CUDA_CHECK(cudaGetLastError());
}

/// Exact global top-k over a DCP group on the GPU: local_topk, one all_gather of the (T, k)
/// candidate lists as bytes on `stream`, merge_topk. Same contract and workspace layout as
/// host::distributed_topk; workspace in device memory, 16-byte aligned.
///
/// @tparam Comm a Communicator whose stream_type is cudaStream_t (NcclCommunicator, or one that
///              stages device buffers through the host)
template <class Comm, class Ownership>
void distributed_topk(Comm& comm, const Ownership& own, TensorView<const float, 2> scores,
                      TensorView<const std::int64_t, 1> row_bound, int num_valid_rows,
                      TensorView<std::int32_t, 2> topk_indices,
                      cuda::std::span<std::byte> workspace, cudaStream_t stream) {
  static_assert(Communicator<Comm>, DCPATTN_COMMUNICATOR_MESSAGE);
  static_assert(std::is_same_v<typename Comm::stream_type, cudaStream_t>,
                "dcpattn: the CUDA top-k needs a communicator on device buffers ordered on a "
                "cudaStream_t (e.g. NcclCommunicator)");
  const int n = comm.size();
  DCPATTN_REQUIRE(own.group_size() == n,
                  "the ownership's group_size (" + std::to_string(own.group_size()) +
                      ") differs from the communicator's size (" + std::to_string(n) + ")");
  const std::int64_t rows = scores.extent(0);
  const int k = int(topk_indices.extent(1));
  DCPATTN_REQUIRE(topk_indices.extent(0) == rows, "topk_indices has " +
                                                      std::to_string(topk_indices.extent(0)) +
                                                      " rows, scores has " + std::to_string(rows));
  const auto layout = dcpattn::detail::distributed_topk_layout(rows, k, n);
  DCPATTN_REQUIRE(workspace.size() >= layout.total,
                  "workspace has " + std::to_string(workspace.size()) +
                      " bytes, distributed_topk_workspace_bytes is " +
                      std::to_string(layout.total));
  indexer_detail::require_aligned(workspace.data(), 16, "workspace");
  auto* local = reinterpret_cast<TopkCandidate*>(workspace.data() + layout.local);
  auto* gathered = reinterpret_cast<TopkCandidate*>(workspace.data() + layout.gathered);
  local_topk(own, comm.rank(), scores, row_bound, num_valid_rows,
             make_view(local, {rows, std::int64_t(k)}), stream);
  comm.all_gather(reinterpret_cast<const std::uint8_t*>(local),
                  reinterpret_cast<std::uint8_t*>(gathered), topk_candidate_bytes(rows, k), stream);
  merge_topk(make_view(static_cast<const TopkCandidate*>(gathered), {n * rows, std::int64_t(k)}), n,
             num_valid_rows, topk_indices, stream);
}

/// One indexer step on the GPU: indexer_scores into the workspace, then distributed_topk. Same
/// contract and workspace (indexer_topk_workspace_bytes) as host::indexer_topk; stream-ordered,
/// no allocation, no host sync (CUDA-graph capturable with a capturable communicator). Row bounds
/// above config.max_context_len are not detected (the host path refuses them); their rows are
/// cut to the first max_local_keys local keys.
template <class Comm, class Ownership, class QElem>
void indexer_topk(Comm& comm, const Ownership& own, const IndexerConfig& config,
                  const IndexerArgs<QElem>& a, TensorView<std::int32_t, 2> topk_indices,
                  cuda::std::span<std::byte> workspace, cudaStream_t stream) {
  cuda_kernels::indexer_can_implement(config).throw_if_failed("cuda_kernels::indexer_topk");
  const std::int64_t t = a.q.extent(0);
  DCPATTN_REQUIRE(t <= config.max_tokens, "q has " + std::to_string(t) +
                                              " rows, more than config.max_tokens (" +
                                              std::to_string(config.max_tokens) + ")");
  DCPATTN_REQUIRE(topk_indices.extent(1) == config.topk,
                  "topk_indices has " + std::to_string(topk_indices.extent(1)) +
                      " columns, config.topk is " + std::to_string(config.topk));
  const auto layout = dcpattn::detail::indexer_topk_layout(config, own);
  DCPATTN_REQUIRE(workspace.size() >= layout.total,
                  "workspace has " + std::to_string(workspace.size()) +
                      " bytes, indexer_topk_workspace_bytes is " + std::to_string(layout.total));
  const std::int64_t columns = indexer_max_local_keys(config, own);
  auto* scores = reinterpret_cast<float*>(workspace.data() + layout.scores);
  indexer_scores(own, comm.rank(), a, make_view(scores, {t, columns}), stream);
  distributed_topk(comm, own, make_view(static_cast<const float*>(scores), {t, columns}),
                   a.row_bound, a.num_valid_rows, topk_indices, workspace.subspan(layout.topk),
                   stream);
}

}  // namespace cuda_kernels

DCPATTN_NAMESPACE_END
