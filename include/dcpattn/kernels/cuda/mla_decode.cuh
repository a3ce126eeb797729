// SPDX-License-Identifier: Apache-2.0
// CUDA MLA decode kernels (dense paged and sparse top-k) over the local KV shard of one DCP rank:
// the device counterparts of dcpattn/kernels/host/mla_decode.hpp, with the same split structure.
//
// Splits. A row's local shard is cut into S = p.num_splits splits, local position p belonging to
// split (p / I) mod S (I = p.interleave), walked in ascending position (dense) or in top-k list
// order (sparse). Each split gives one fp32 partial state (o (512,), lse natural log; an empty
// split is the neutral state o = 0, lse = -inf); the S states of a (row, head) are merged along
// dcpattn::tree_merge's fixed tree (highest split bit first) and written to o (T, H, 512) fp32 and
// lse (T, H) fp32, natural log.
//
// DCP invariance. The arithmetic of one (row, head, split) state depends only on the split's token
// sequence and the row's query: tiles of 64 consecutive split tokens starting at the split's first
// token, one fixed instruction sequence per tile (tensor-core products with a fixed k order, a
// fixed-shape max/sum reduction per head row), no atomics, and nothing that depends on S, the
// split index, N, T, the grid or the row count; how a tile reaches shared memory (cp.async,
// scalar loads, tensor copies) does not change it either. With S = V / N, split j of rank r is
// virtual shard v = j N + r of an N = 1 run with S = V, token for token, so its state is bitwise
// the same. The split merge takes its arithmetic from dcpattn/kernels/cuda/merge_tree.cuh
// (dcpattn::merge_lse and the element update of merge_state_into with explicitly rounded products
// and sums: no FMA contraction), as the CUDA combine (dcpattn/kernels/cuda/combine.cuh) does;
// merging rank states with the combine in rank order therefore reproduces the N = 1 result bit
// for bit on the GPU. Against the host reference the results are close, not bitwise (see
// "Numerics").
//
// Kernel design (mla_split_kernel, one CTA of 8 warps per (row, split, block of heads)):
//   - head block: 16 heads when H <= 16, else 64 (more blocks when H > 64); missing heads are
//     zero rows that are never written back;
//   - shared memory: Q block (heads x 576 bf16), one K/V tile (64 tokens x 576 bf16; the value is
//     the first 512 dims of the key), fp32 scores, bf16 probabilities, the tile's slots;
//     181,536 bytes (64 heads, 1 CTA/SM) or 104,928 bytes (16 heads, 2 CTAs/SM), dynamic, rows
//     padded by 16 bytes to avoid ldmatrix bank conflicts; a sparse CTA also gathers its split's
//     list entries (ballot compaction, in list order) into a 512-entry ring;
//   - tile load: bf16 cache rows copied with cp.async (16 B); fp8 ds_mla entries dequantized
//     (e4m3 * group scale, then rounded to bf16; the RoPE part is bf16 already) by ordinary loads
//     and stores; a non-contiguous or unaligned cache takes a scalar path with the same values;
//   - S = Q K^T: mma.sync m16n8k16 bf16 -> fp32, 36 k-steps in order, operands by ldmatrix;
//     warp w computes heads [16 (w mod HT), +16) x tokens of its 1/(8/HT) share of the tile;
//   - online softmax in fp32 from the scores in shared memory, 4 threads per head row, 16 tokens
//     each, combined by two xor shuffles (the same shape for every tile and head block); exp and
//     log are expf/logf (never the fast intrinsics);
//   - O += P V: P rounded to bf16 (as FlashAttention does), V by ldmatrix.trans, mma.sync with an
//     fp32 accumulator in registers (warp w: 16 heads x 512 / (8/HT) value dims); the row sum l
//     uses the unrounded fp32 probabilities, so lse is fp32-accurate;
//   - the state o = acc x (1 / l), lse = m + logf(l) goes to scratch (S, T, H, 512) + (S, T, H), or
//     straight to o/lse when S = 1; mla_merge_kernel (a CTA per (row, head), a dim per thread;
//     for S <= 8 mla_merge_row_kernel, four dims per thread) then merges the S states.
//
// Numerics (vs the scalar fp32 host reference): the query, the bf16 cache and the e4m3 codes are
// exact in bf16, the products are exact and summed in fp32 by the tensor cores; the differences
// are P rounded to bf16 (relative 2^-9 per weight: ~1e-3 relative on o) and, for the fp8 cache,
// the dequantized key rounded to bf16 (score error ~1e-3 absolute). exp/log are CUDA's, which
// differ from the host libm's by an ulp now and then; the 64-head warpgroup kernel's weights are
// ex2.approx of base-2 scores (relative error about 2^-22, far below P's bf16 rounding). The
// warpgroup kernel's narrow form for the fp8 cache (H <= 16) does not round the keys: the score
// products read the exact e4m3 codes on the fp8 tensor cores against the query as two e4m3 parts
// (exact down to 2^-10 of each head's largest element, within 2^-17 of it below), whose sums the
// tensor cores keep to fewer bits than fp32 (one chain of 4 products per scale group; in the
// tests the lse moves by up to 4.4e-3 with keys and queries spread over many octaves, 2e-5 on
// ordinary data); the group scales are applied in fp32 (scores) and folded into the weights,
// rounded to f16 (relative 2^-11 per weight), the row sums of a split's even and odd tiles are
// kept apart and added at the end, and its exponentials are 2^(x log2 e) on the special-function
// unit (detail::fast_exp, the merges' exp: relative error about 2^-22, far below that rounding of
// the weights; narrow_fp8_consumers).
//
// Data-dependent checks cannot be made on the host without a synchronization, so the kernels make
// them instead and never read outside the views: a row whose row_request is not a request of
// block_table, or whose row_local_length / row_bound is <= 0, gets the neutral state; a token whose
// local page index is beyond block_table's extent, whose page id is negative, or whose slot is
// beyond the cache is skipped (it does not take part in the softmax); a top-k entry that is
// negative or >= the row's bound is treated as -1, and one < -1 or >= the bound sets
// input_error_topk in p.error_flags when given. (The host reference throws on all of these.)
//
// Launchers: argument checks (extents, parameters, scratch size) throw dcpattn::Error naming the
// parameter before anything is enqueued; launches are stream-ordered with no allocation and no
// host synchronization (CUDA-graph capturable; the first launch of each kernel on a device raises
// its dynamic shared memory limit with cudaFuncSetAttribute, which is not a stream operation).
#pragma once

#include <atomic>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include <cuda.h>          // CUtensorMap (types only; no driver library is linked)
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled: the encoder, from the runtime
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <cuda/std/limits>
#include <cuda/std/mdspan>
#include <cuda/std/span>

#include "dcpattn/config.hpp"
#include "dcpattn/core/fp8_cache.hpp"
#include "dcpattn/core/lse.hpp"
#include "dcpattn/core/numeric.hpp"
#include "dcpattn/core/tensor.hpp"
#include "dcpattn/error.hpp"
#include "dcpattn/gather/query_gather.hpp"
#include "dcpattn/kernels/cache_layout.hpp"
#include "dcpattn/kernels/cuda/convert.cuh"
#include "dcpattn/kernels/cuda/device.cuh"
#include "dcpattn/kernels/cuda/merge_tree.cuh"
#include "dcpattn/kernels/mla_kernel.hpp"
#include "dcpattn/ownership/slot_ownership.hpp"

DCPATTN_NAMESPACE_BEGIN

namespace cuda_kernels {
namespace detail::mla {

inline constexpr int kThreads = 256;
inline constexpr int kWarps = kThreads / 32;
inline constexpr unsigned kFullMask = 0xffffffffu;
/// Split tokens per tile. Part of the numerical contract: changing it changes the results.
inline constexpr int kTileTokens = 64;
/// Shared-memory row strides (elements), padded by 16 bytes so that the 8 rows of an ldmatrix
/// (and the fp32 score rows) fall in different banks.
inline constexpr int kKStride = kMlaQkDim + 8;    // bf16: Q and K/V rows (1168 bytes)
inline constexpr int kSStride = kTileTokens + 4;  // fp32 scores (272 bytes)
inline constexpr int kPStride = kTileTokens + 8;  // bf16 probabilities (144 bytes)
/// Sparse: list entries of the split gathered ahead of the tile being processed.
inline constexpr int kRingSize = 512;
/// Largest num_splits (the merge keeps the split lse values in a per-thread array).
inline constexpr int kMaxSplits = 64;
inline constexpr int kMinSplitTokens = 128;  // mla_decode_fast_splits: the fewest a split gets
/// Value dims per lane of the merge kernel (a warp covers one (row, head)).

static_assert(kMlaQkDim % 16 == 0 && kMlaVDim % 16 == 0, "dcpattn: MLA dims are k16 multiples");
static_assert(kTileTokens == 64, "dcpattn: the warp tiling below assumes 64-token tiles");
static_assert(kRingSize >= kTileTokens + kThreads && (kRingSize & (kRingSize - 1)) == 0,
              "dcpattn: the sparse ring must hold a tile plus one gather round");
static_assert(DsMlaFp8Entry::rope_offset % 16 == 0 && DsMlaFp8Entry::scales_offset % 16 == 0,
              "dcpattn: the ds_mla entry's parts must be 16-byte aligned for the vector path");

/// Byte offsets of the dynamic shared memory of mla_split_kernel for HT head tiles of 16.
template <int HT>
struct SplitSmem {
  static constexpr int heads = 16 * HT;
  static constexpr std::size_t q = 0;
  static constexpr std::size_t k = q + std::size_t(heads) * kKStride * 2;
  static constexpr std::size_t s = k + std::size_t(kTileTokens) * kKStride * 2;
  static constexpr std::size_t p = s + std::size_t(heads) * kSStride * 4;
  static constexpr std::size_t slot = p + std::size_t(heads) * kPStride * 2;
  static constexpr std::size_t alpha = slot + std::size_t(kTileTokens) * 8;
  static constexpr std::size_t m = alpha + std::size_t(heads) * 4;
  static constexpr std::size_t l = m + std::size_t(heads) * 4;
  static constexpr std::size_t ring = l + std::size_t(heads) * 4;
  static constexpr std::size_t wsum = ring + std::size_t(kRingSize) * 8;
  static constexpr std::size_t bytes = wsum + std::size_t(kWarps) * 4;
  static_assert(k % 16 == 0 && s % 16 == 0 && p % 16 == 0 && slot % 16 == 0 && ring % 16 == 0,
                "dcpattn: shared-memory regions must be 16-byte aligned");
};

/// A bf16 query with per-dimension strides, the form every strided layout and the rank-major
/// gather layout take: element (t, h, d) at data[t st + (h / hl) sr + (h mod hl) sh + d sd].
struct QDesc {
  const bfloat16* data;
  std::int64_t st, sh, sr, sd, hl;
  /// Element (t, h, 0). h and hl are below 2^31 (validate_common bounds T x H), so the rank and
  /// the head within it come from a 32-bit division: a 64-bit one per 16-byte chunk was most of
  /// the producer's time before its first tile at batch 1.
  DCPATTN_DEVICE const bfloat16* row(std::int64_t t, int h) const {
    const int l = int(hl);
    return data + t * st + std::int64_t(h / l) * sr + std::int64_t(h % l) * sh;
  }
};
/// Any other query view (another layout or accessor, or float elements): read element by element
/// through the view and rounded to bf16.
template <class QView>
struct GenericQ {
  QView q;
};

/// Placeholder ownership of the dense kernel.
struct NoOwnership {};

/// Everything a split kernel reads; unused members (e.g. topk for dense) stay default.
template <class QSrc, class CacheView, class Own>
struct SplitArgs {
  QSrc q;
  CacheView cache;
  TensorView<const std::int32_t, 2> block_table;
  TensorView<const std::int32_t, 1> row_request;
  TensorView<const std::int64_t, 1> row_local_length;  // dense
  TensorView<const std::int32_t, 2> topk;              // sparse
  TensorView<const std::int64_t, 1> row_bound;         // sparse
  Own own;                                             // sparse
  int rank;                                            // sparse
  std::uint32_t* error_flags;                          // optional: input_error_* bits
  TensorView<float, 3> o;                              // written when num_splits == 1
  TensorView<float, 2> lse;                            // written when num_splits == 1
  float* scratch_o;                                    // (S, T, H, 512) when num_splits > 1
  float* scratch_lse;                                  // (S, T, H)
  std::int64_t tokens;
  int heads;
  int num_valid_rows;
  int num_splits;
  int interleave;
  int page_size;
  float softmax_scale;
  bool cache_vector;  // 16-byte cache path usable (contiguous, aligned rows)
  bool wgmma;         // the warpgroup kernels run (use_wgmma_kernel(), asked once per call)
  /// The fp8 kernel of 64 heads: the query block copied by the tensor memory accelerator, 9
  /// copies of 64 heads x 64 dims from q_map (a (576, heads, tokens) view of a bf16 query with
  /// contiguous dims), instead of 4608 16-byte cp.async issued by the producer's 128 threads
  /// before the first tile (dense fp8 1 x 32K, 128 heads: 58 -> 53 us; docs/performance.md,
  /// run 15).
  bool q_tma;
  CUtensorMap q_map;
  /// The dense fp8 kernels (64 heads and narrow), launched where every tile is a run of 64
  /// positions in one page (dense_splits) on a cache of contiguous entries: a full tile of 64
  /// consecutive slots is one bulk copy of 64 x 656 bytes (cp.async.bulk), not 2624 cp.async.
  bool raw_bulk;
  /// The split states' values in bf16 (state_row_bf16; the lse stays fp32): bf16_states_taken,
  /// set by fill_common; the merge kernels then read bf16.
  bool bf16_states;
  /// Sparse: split j scans entries mla_list_range(K, j, S) of the row's list and takes every one
  /// of them this rank owns (MlaDecodeParams::split_topk_list, with S > 1).
  bool split_list;
  /// Sparse, the warpgroup kernels: split j takes a position p where ((p / I) xor j) & split_mask
  /// is 0: S - 1 ((p / I) mod S == j), or 0 with split_list (every position).
  std::uint32_t split_mask;
};

/// The second parameter of the warpgroup kernel. With kOn (the dense bf16 kernels, 64 heads or
/// narrow, where every tile of the launch is 64 consecutive positions of one page: dense_splits),
/// `map`
/// describes the bf16 cache as a (slots, 576) tensor in 64 x 64 boxes with the 128-byte swizzle,
/// and a full tile of 64 consecutive slots is copied by the tensor memory accelerator
/// (cp.async.bulk.tensor: 9 copies) instead of 4608 16-byte cp.async. Without, it is empty: the
/// other kernels are compiled as if it did not exist.
template <bool kOn>
struct CacheTensorMap {};
template <>
struct CacheTensorMap<true> {
  CUtensorMap map;
};

// ---------------------------------------------------------------------------------------------
// PTX wrappers

DCPATTN_DEVICE std::uint32_t smem_u32(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}
DCPATTN_DEVICE void ldsm_x4(std::uint32_t addr, std::uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
DCPATTN_DEVICE void ldsm_x2(std::uint32_t addr, std::uint32_t (&r)[2]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr)
               : "memory");
}
DCPATTN_DEVICE void ldsm_x4_trans(std::uint32_t addr, std::uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
/// Stores four 8x8 matrices of 16-bit elements (stmatrix): register k of lane l holds elements
/// (l / 4, 2 (l % 4)) and (l / 4, 2 (l % 4) + 1) of matrix k (the low half the first); lane
/// 8 k + j gives the 16-byte-aligned address of row j of matrix k as stored. kTrans (stmatrix
/// .trans): each matrix is stored transposed, so that row j as stored holds column j.
template <bool kTrans>
DCPATTN_DEVICE void stsm_x4([[maybe_unused]] std::uint32_t addr,
                            [[maybe_unused]] const std::uint32_t (&r)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (kTrans)
    asm volatile(
        "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
        "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
        : "memory");
  else
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
                 "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
#else
  __trap();  // the fp8 kernels only: sm_90a
#endif
}
/// d += a b for one m16n8k16 bf16 tile with fp32 accumulation. Fragments (PTX ISA, "Matrix
/// Fragments for mma.m16n8k16 with floating point type"), g = lane / 4, c = lane % 4:
/// a = {(g, 2c..), (g+8, 2c..), (g, 2c+8..), (g+8, 2c+8..)}, b = {(k 2c.., n g), (k 2c+8.., n g)},
/// d = {(g, 2c), (g, 2c+1), (g+8, 2c), (g+8, 2c+1)}.
DCPATTN_DEVICE void mma_bf16(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                             std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
DCPATTN_DEVICE void cp_async_16(std::uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst),
               "l"(__cvta_generic_to_global(src))
               : "memory");
}
DCPATTN_DEVICE void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

DCPATTN_DEVICE void store_zero16(void* dst) {
  *static_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
}
DCPATTN_DEVICE std::uint32_t pack_bf16(std::uint16_t lo, std::uint16_t hi) {
  return std::uint32_t(lo) | (std::uint32_t(hi) << 16);
}
DCPATTN_DEVICE std::uint16_t bf16_bits_of(bfloat16 x) {
  return x.bits;
}
DCPATTN_DEVICE std::uint16_t bf16_bits_of(float x) {
  return bfloat16::from_float(x).bits;
}

// ---------------------------------------------------------------------------------------------
// Tile loads

/// Query rows [h0, h0 + 16 HT) of token t into q_s (rows of kKStride bf16); rows >= heads are 0.
template <int HT>
DCPATTN_DEVICE void load_q_block(const QDesc& q, std::int64_t t, int h0, int heads, bfloat16* q_s,
                                 int tid) {
  constexpr int kChunks = kMlaQkDim / 8;  // 16-byte chunks per row
  for (int i = tid; i < 16 * HT * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i % kChunks;
    const int h = h0 + r;
    bfloat16* dst = q_s + r * kKStride + c * 8;
    if (h >= heads) {
      store_zero16(dst);
      continue;
    }
    const bfloat16* src = q.row(t, h) + std::int64_t(c) * 8 * q.sd;
    if (q.sd == 1 && (reinterpret_cast<std::uintptr_t>(src) & 15u) == 0) {
      cp_async_16(smem_u32(dst), src);
    } else {
      std::uint32_t w[4];
#pragma unroll
      for (int e = 0; e < 4; ++e)
        w[e] = pack_bf16(src[(2 * e) * q.sd].bits, src[(2 * e + 1) * q.sd].bits);
      *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}
template <int HT, class QView>
DCPATTN_DEVICE void load_q_block(const GenericQ<QView>& q, std::int64_t t, int h0, int heads,
                                 bfloat16* q_s, int tid) {
  for (int i = tid; i < 16 * HT * kMlaQkDim; i += kThreads) {
    const int r = i / kMlaQkDim, d = i % kMlaQkDim;
    const int h = h0 + r;
    bfloat16 v{};
    if (h < heads) v.bits = bf16_bits_of(q.q(t, std::int64_t(h), std::int64_t(d)));
    q_s[r * kKStride + d] = v;
  }
}

/// True for views whose elements can be addressed as data_handle() + strides (no custom accessor).
template <class View>
inline constexpr bool is_plain_strided_v =
    View::mapping_type::is_always_strided() &&
    std::is_same_v<typename View::accessor_type,
                   cuda::std::default_accessor<typename View::element_type>>;

/// The 64 keys of a tile (slot_s[i] < 0: a zero row) into k_s as bf16 (rows of kKStride).
template <class CacheView>
DCPATTN_DEVICE void load_kv_tile(const CacheView& cache, bool vector_path,
                                 const std::int64_t* slot_s, bfloat16* k_s, int tid) {
  constexpr CacheFormat kFormat = mla_cache_format_v<CacheView>;
  if constexpr (is_plain_strided_v<CacheView>) {
    if (vector_path) {
      if constexpr (kFormat == CacheFormat::bf16) {
        constexpr int kChunks = kMlaQkDim / 8;  // 72
        for (int i = tid; i < kTileTokens * kChunks; i += kThreads) {
          const int tok = i / kChunks, c = i % kChunks;
          const std::int64_t slot = slot_s[tok];
          bfloat16* dst = k_s + tok * kKStride + c * 8;
          if (slot < 0)
            store_zero16(dst);
          else
            cp_async_16(smem_u32(dst), cache.data_handle() + slot * cache.stride(0) + c * 8);
        }
      } else {
        // 32 chunks of 16 e4m3 codes (each within one 128-value scale group), then 8 chunks of
        // 8 bf16 RoPE values.
        constexpr int kItems = DsMlaFp8Entry::latent_dim / 16 + DsMlaFp8Entry::rope_dim / 8;
        for (int i = tid; i < kTileTokens * kItems; i += kThreads) {
          const int tok = i / kItems, c = i % kItems;
          const std::int64_t slot = slot_s[tok];
          bfloat16* row = k_s + tok * kKStride;
          if (c < 32) {
            bfloat16* dst = row + c * 16;
            if (slot < 0) {
              store_zero16(dst);
              store_zero16(dst + 8);
              continue;
            }
            const std::uint8_t* e = cache.data_handle() + slot * cache.stride(0);
            const uint4 raw = *reinterpret_cast<const uint4*>(e + c * 16);
            const float scale = *reinterpret_cast<const float*>(
                e + DsMlaFp8Entry::scales_offset + 4 * (c * 16 / DsMlaFp8Entry::group_size));
            const std::uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
            std::uint32_t out[8];
#pragma unroll
            for (int k = 0; k < 8; ++k) {
              const std::uint32_t wv = words[k / 2];
              const int sh = (k % 2) * 16;
              const float lo = fp8_e4m3::decode(std::uint8_t((wv >> sh) & 0xffu)) * scale;
              const float hi = fp8_e4m3::decode(std::uint8_t((wv >> (sh + 8)) & 0xffu)) * scale;
              out[k] = pack_bf16(__bfloat16_as_ushort(__float2bfloat16_rn(lo)),
                                 __bfloat16_as_ushort(__float2bfloat16_rn(hi)));
            }
            *reinterpret_cast<uint4*>(dst) = make_uint4(out[0], out[1], out[2], out[3]);
            *reinterpret_cast<uint4*>(dst + 8) = make_uint4(out[4], out[5], out[6], out[7]);
          } else {
            bfloat16* dst = row + DsMlaFp8Entry::latent_dim + (c - 32) * 8;
            if (slot < 0) {
              store_zero16(dst);
              continue;
            }
            const std::uint8_t* e = cache.data_handle() + slot * cache.stride(0);
            *reinterpret_cast<uint4*>(dst) =
                *reinterpret_cast<const uint4*>(e + DsMlaFp8Entry::rope_offset + (c - 32) * 16);
          }
        }
      }
      return;
    }
  }
  // Scalar path: the host reference's accessor, rounded to bf16 (exact for the bf16 cache).
  for (int i = tid; i < kTileTokens * kMlaQkDim; i += kThreads) {
    const int tok = i / kMlaQkDim, d = i % kMlaQkDim;
    const std::int64_t slot = slot_s[tok];
    k_s[tok * kKStride + d] = bfloat16::from_float(slot < 0 ? 0.0f : mla_key(cache, slot, d));
  }
}

/// Slot of local position `pos` of request `req`, or -1 when the page index is beyond the block
/// table, the page id is negative or the slot is beyond the cache (the token is then skipped).
template <class Args>
DCPATTN_DEVICE std::int64_t checked_slot(const Args& a, std::int32_t req, std::int64_t pos) {
  if (pos < 0) return -1;
  const std::int64_t b = a.page_size;
  const std::int64_t page_index = pos / b;
  if (page_index >= a.block_table.extent(1)) return -1;
  const std::int64_t page = a.block_table(std::int64_t(req), page_index);
  if (page < 0) return -1;
  const std::int64_t slot = page * b + pos % b;
  return slot < a.cache.extent(0) ? slot : -1;
}

/// Programmatic dependent launch (compute capability 9.x; a no-op below). The split kernels are
/// launched as programmatic dependents of whatever kernel precedes them on the stream
/// (launch_dependent), and the merge kernel as the split kernel's. Each waits here, before its
/// first access to global memory, for the previous grid's completion and memory: nothing it reads
/// or writes is touched earlier, whatever that grid is; only the launch and the CTAs' start
/// overlap its tail (CUDA-graph replays of back-to-back calls, H200: 0.7-0.9 us a call, e.g.
/// dense bf16 1 x 32K, 128 heads, 35.5 -> 34.7 us; docs/performance.md, run 19). No kernel here
/// triggers its dependents early (griddepcontrol.launch_dependents), so a dependent's launch
/// begins as the CTAs exit. A split CTA's trigger right after its set-up was slower in the short
/// calls that end with a merge: dense bf16 1 x 32K, 128 heads, 40.4 against 38.9-39.1 us; fp8 16
/// heads 8 x 4K, 22.9-23.2 against 21.3-21.4 (run 18). So was a trigger right after the CTA's
/// last tile, before its state writes: dense fp8 1 x 32K, 128 heads, back to back 38.4 -> 39.8
/// us, sparse fp8 batch 1 16.8 -> 17.5 (docs/performance.md, run 37).
DCPATTN_DEVICE void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/// Where the (row t, split j, head h) state goes: its 512 values and its lse to the split states
/// in scratch when S > 1, else to the output row o(t, h, :), whose dim stride may be any, and
/// lse(t, h). `vec`: stride 1 and 16-byte aligned, so dims d..d+1 (d even) and d..d+3 (d a
/// multiple of 4) are one store.
/// The kernels scale their accumulators by 1 / l, one division per state: a division per value
/// (each with its slow-path branch) made the write-back code longer than the tile loop, and at
/// batch 1, where it runs once per CTA from a cold instruction cache, it took a third of the
/// consumers' time (see docs/performance.md, run 11).
struct StateRow {
  float* p;
  std::int64_t stride;  // elements between consecutive dims
  bool vec;
  float* lse;
  DCPATTN_DEVICE void put_lse(float v) const { *lse = v; }
  DCPATTN_DEVICE void put(int d, float v) const { p[d * stride] = v; }
  DCPATTN_DEVICE void put2(int d, float v0, float v1) const {
    if (vec) {
      *reinterpret_cast<float2*>(p + d) = make_float2(v0, v1);
    } else {
      p[d * stride] = v0;
      p[(d + 1) * stride] = v1;
    }
  }
  DCPATTN_DEVICE void put4(int d, float v0, float v1, float v2, float v3) const {
    if (vec) {
      *reinterpret_cast<float4*>(p + d) = make_float4(v0, v1, v2, v3);
    } else {
      p[d * stride] = v0;
      p[(d + 1) * stride] = v1;
      p[(d + 2) * stride] = v2;
      p[(d + 3) * stride] = v3;
    }
  }
};

template <class Args>
DCPATTN_DEVICE StateRow state_row(const Args& a, int j, std::int64_t t, int h) {
  float* p = nullptr;
  float* lse = nullptr;
  std::int64_t stride = 1;
  if (a.num_splits > 1) {
    const std::int64_t state = (std::int64_t(j) * a.tokens + t) * a.heads + h;
    p = a.scratch_o + state * kMlaVDim;
    lse = a.scratch_lse + state;
  } else {
    p = &a.o(t, std::int64_t(h), std::int64_t(0));
    stride = a.o.stride(2);
    lse = &a.lse(t, std::int64_t(h));
  }
  return StateRow{p, stride, stride == 1 && (reinterpret_cast<std::uintptr_t>(p) & 15) == 0, lse};
}

/// Split state (j, t, h) as bf16 (SplitArgs::bf16_states): its 512 values in the first half of
/// the fp32 layout's bytes, at element ((j T + t) H + h) 512 of the bf16 array.
template <class Args>
DCPATTN_DEVICE std::uint16_t* state_row_bf16(const Args& a, int j, std::int64_t t, int h) {
  const std::int64_t state = (std::int64_t(j) * a.tokens + t) * a.heads + h;
  return reinterpret_cast<std::uint16_t*>(a.scratch_o) + state * kMlaVDim;
}

// ---------------------------------------------------------------------------------------------
// Kernels

/// One (row, split, head block) partial state; see the file comment. Grid: (T, S * head blocks).
template <int HT, bool kSparse, class QSrc, class CacheView, class Own>
__global__ void __launch_bounds__(kThreads, HT == 4 ? 1 : 2)
    mla_split_kernel(const __grid_constant__ SplitArgs<QSrc, CacheView, Own> a) {
  static_assert(HT == 1 || HT == 2 || HT == 4, "dcpattn: head blocks of 16, 32 or 64");
  using L = SplitSmem<HT>;
  constexpr int kHeads = 16 * HT;
  constexpr int kWarpsN = kWarps / HT;                // warps sharing one 16-head tile
  constexpr int kTokPerWarp = kTileTokens / kWarpsN;  // S = QK^T columns per warp
  constexpr int kNtQk = kTokPerWarp / 8;
  constexpr int kDvPerWarp = kMlaVDim / kWarpsN;  // O columns per warp
  constexpr int kNtPv = kDvPerWarp / 8;
  static_assert(kNtPv % 2 == 0, "dcpattn: PV n-tiles are loaded in pairs");
  constexpr float kNegInf = -cuda::std::numeric_limits<float>::infinity();

  extern __shared__ __align__(16) unsigned char smem[];
  bfloat16* q_s = reinterpret_cast<bfloat16*>(smem + L::q);
  bfloat16* k_s = reinterpret_cast<bfloat16*>(smem + L::k);
  float* s_s = reinterpret_cast<float*>(smem + L::s);
  bfloat16* p_s = reinterpret_cast<bfloat16*>(smem + L::p);
  std::int64_t* slot_s = reinterpret_cast<std::int64_t*>(smem + L::slot);
  float* alpha_s = reinterpret_cast<float*>(smem + L::alpha);
  float* m_s = reinterpret_cast<float*>(smem + L::m);
  float* l_s = reinterpret_cast<float*>(smem + L::l);
  std::int64_t* ring_s = reinterpret_cast<std::int64_t*>(smem + L::ring);
  int* wsum_s = reinterpret_cast<int*>(smem + L::wsum);

  pdl_wait();  // launched as a programmatic dependent (launch_dependent)
  const int tid = int(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const std::int64_t t = blockIdx.x;
  const int S = a.num_splits;
  const int j = int(blockIdx.y) % S;
  const int h0 = (int(blockIdx.y) / S) * kHeads;

  if (t >= a.num_valid_rows) {
    // Padding row: nothing of it is read. With S > 1 the merge kernel writes its neutral state.
    if (S == 1) {
      for (int i = tid; i < kHeads * kMlaVDim; i += kThreads) {
        const int h = h0 + i / kMlaVDim;
        if (h < a.heads) a.o(t, std::int64_t(h), std::int64_t(i % kMlaVDim)) = 0.0f;
      }
      for (int i = tid; i < kHeads; i += kThreads)
        if (h0 + i < a.heads) a.lse(t, std::int64_t(h0 + i)) = kNegInf;
    }
    return;
  }

  // Row parameters (uniform over the CTA).
  const std::int32_t req = a.row_request(t);
  const bool req_ok = req >= 0 && std::int64_t(req) < a.block_table.extent(0);
  std::int64_t n = 0;                       // dense: tokens of this split
  [[maybe_unused]] std::int64_t bound = 0;  // sparse: the row's global causal bound
  std::int64_t list = 0;                    // sparse: top-k entries to scan
  if constexpr (!kSparse) {
    const std::int64_t len = a.row_local_length(t);
    if (req_ok && len > 0) n = mla_split_length(len, j, S, a.interleave);
  } else {
    bound = a.row_bound(t);
    if (req_ok && bound > 0) list = a.topk.extent(1);
  }
  // Sparse: the list entries [list_begin, list) this split scans.
  std::int64_t list_begin = 0;
  if (kSparse && a.split_list && list > 0) {
    const MlaListRange r = mla_list_range(list, j, S);
    list_begin = r.begin;
    list = r.end;
  }
  const bool any_work = kSparse ? list > list_begin : n > 0;
  if (any_work) load_q_block<HT>(a.q, t, h0, a.heads, q_s, tid);

  // Softmax state of head row sm_row, replicated in its 4 threads.
  const bool sm_thread = tid < kHeads * 4;
  const int sm_row = tid >> 2, sm_part = tid & 3;
  float m_run = kNegInf, l_run = 0.0f;

  const int mw = warp % HT, nw = warp / HT;
  float oacc[kNtPv][4];
#pragma unroll
  for (int nt = 0; nt < kNtPv; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) oacc[nt][e] = 0.0f;

  [[maybe_unused]] std::int64_t k0 = 0;  // dense: first split token of the tile
  [[maybe_unused]] std::int64_t cursor = list_begin, head = 0, tail = 0;  // sparse: scan, ring
  while (any_work) {
    // --- Slots of the tile's split tokens (-1: no token / skipped).
    int n_tile;
    if constexpr (!kSparse) {
      n_tile = int(n - k0 < kTileTokens ? n - k0 : kTileTokens);
      if (n_tile <= 0) break;
      if (tid < kTileTokens) {
        std::int64_t slot = -1;
        if (tid < n_tile)
          slot = checked_slot(a, req, mla_split_position(k0 + tid, j, S, a.interleave));
        slot_s[tid] = slot;
      }
      k0 += kTileTokens;
    } else {
      // Gather the split's entries in list order until a tile is full or the list is done.
      while (tail - head < kTileTokens && cursor < list) {
        const std::int64_t idx = cursor + tid;
        std::int64_t slot = -1;
        if (idx < list) {
          const std::int64_t g = a.topk(t, idx);
          if ((g < -1 || g >= bound) && a.error_flags != nullptr)
            atomicOr(a.error_flags, input_error_topk);
          if (g >= 0 && g < bound && int(a.own.owner(g)) == a.rank) {
            const std::int64_t pos = std::int64_t(a.own.local_position(g));
            if (pos >= 0 && (a.split_list || mla_split_of(pos, S, a.interleave) == j))
              slot = checked_slot(a, req, pos);
          }
        }
        const bool take = slot >= 0;
        const unsigned ballot = __ballot_sync(kFullMask, take);
        if (lane == 0) wsum_s[warp] = __popc(ballot);
        __syncthreads();
        int before = 0, total = 0;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
          const int c = wsum_s[w];
          before += w < warp ? c : 0;
          total += c;
        }
        if (take)
          ring_s[(tail + before + __popc(ballot & ((1u << lane) - 1u))) & (kRingSize - 1)] = slot;
        tail += total;
        cursor += kThreads;
        __syncthreads();  // ring entries visible; wsum_s free for the next round
      }
      n_tile = int(tail - head < kTileTokens ? tail - head : kTileTokens);
      if (n_tile == 0) break;
      if (tid < kTileTokens)
        slot_s[tid] = tid < n_tile ? ring_s[(head + tid) & (kRingSize - 1)] : -1;
      head += n_tile;
    }
    __syncthreads();  // slot_s visible

    // --- K/V tile into shared memory (also completes the query block's copies).
    load_kv_tile(a.cache, a.cache_vector, slot_s, k_s, tid);
    cp_async_wait_all();
    __syncthreads();

    // --- Scores: s_s[h][i] = q_h . k_i (fp32; the softmax scale is applied below).
    {
      float sacc[kNtQk][4];
#pragma unroll
      for (int nt = 0; nt < kNtQk; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) sacc[nt][e] = 0.0f;
      const int a_row = mw * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
      const std::uint32_t a_addr = smem_u32(q_s + a_row * kKStride + (lane >> 4) * 8);
      const int tok0 = nw * kTokPerWarp;
      std::uint32_t b_addr[kNtQk >= 2 ? kNtQk / 2 : 1];
      if constexpr (kNtQk >= 2) {
#pragma unroll
        for (int pr = 0; pr < kNtQk / 2; ++pr) {
          const int tok = tok0 + pr * 16 + (lane & 7) + ((lane >> 4) & 1) * 8;
          b_addr[pr] = smem_u32(k_s + tok * kKStride + ((lane >> 3) & 1) * 8);
        }
      } else {
        b_addr[0] = smem_u32(k_s + (tok0 + (lane & 7)) * kKStride + ((lane >> 3) & 1) * 8);
      }
#pragma unroll 4
      for (int ks = 0; ks < kMlaQkDim / 16; ++ks) {
        std::uint32_t af[4];
        ldsm_x4(a_addr + ks * 32, af);
        if constexpr (kNtQk >= 2) {
#pragma unroll
          for (int pr = 0; pr < kNtQk / 2; ++pr) {
            std::uint32_t bf[4];
            ldsm_x4(b_addr[pr] + ks * 32, bf);
            mma_bf16(sacc[2 * pr], af, bf[0], bf[1]);
            mma_bf16(sacc[2 * pr + 1], af, bf[2], bf[3]);
          }
        } else {
          std::uint32_t bf[2];
          ldsm_x2(b_addr[0] + ks * 32, bf);
          mma_bf16(sacc[0], af, bf[0], bf[1]);
        }
      }
      const int row = mw * 16 + (lane >> 2);
#pragma unroll
      for (int nt = 0; nt < kNtQk; ++nt) {
        const int col = tok0 + nt * 8 + 2 * (lane & 3);
        *reinterpret_cast<float2*>(s_s + row * kSStride + col) =
            make_float2(sacc[nt][0], sacc[nt][1]);
        *reinterpret_cast<float2*>(s_s + (row + 8) * kSStride + col) =
            make_float2(sacc[nt][2], sacc[nt][3]);
      }
    }
    __syncthreads();

    // --- Online softmax: 4 threads per head row, 16 tokens each.
    if (sm_thread) {
      const float* srow = s_s + sm_row * kSStride + sm_part * 16;
      float sv[16];
      float mx = kNegInf;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const float s = slot_s[sm_part * 16 + i] >= 0 ? a.softmax_scale * srow[i] : kNegInf;
        sv[i] = s;
        mx = fmaxf(mx, s);
      }
      mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
      const float m_new = fmaxf(m_run, mx);
      // m_new = -inf: nothing valid so far; keep l = 0 and o = 0 (alpha 1 avoids -inf - -inf).
      const float alpha = m_new == kNegInf ? 1.0f : expf(m_run - m_new);
      float sum = 0.0f;
      std::uint32_t pw[8];
#pragma unroll
      for (int i = 0; i < 16; i += 2) {
        const float p0 = sv[i] == kNegInf ? 0.0f : expf(sv[i] - m_new);
        const float p1 = sv[i + 1] == kNegInf ? 0.0f : expf(sv[i + 1] - m_new);
        sum += p0;
        sum += p1;
        pw[i / 2] = pack_bf16(__bfloat16_as_ushort(__float2bfloat16_rn(p0)),
                              __bfloat16_as_ushort(__float2bfloat16_rn(p1)));
      }
      uint4* prow = reinterpret_cast<uint4*>(p_s + sm_row * kPStride + sm_part * 16);
      prow[0] = make_uint4(pw[0], pw[1], pw[2], pw[3]);
      prow[1] = make_uint4(pw[4], pw[5], pw[6], pw[7]);
      // (a + b) + (c + d) on every lane: float addition is commutative, so the 4 copies agree.
      sum += __shfl_xor_sync(kFullMask, sum, 1);
      sum += __shfl_xor_sync(kFullMask, sum, 2);
      l_run = l_run * alpha + sum;
      m_run = m_new;
      if (sm_part == 0) alpha_s[sm_row] = alpha;
    }
    __syncthreads();

    // --- O = alpha O + P V.
    {
      const int r_lo = mw * 16 + (lane >> 2);
      const float al = alpha_s[r_lo], ah = alpha_s[r_lo + 8];
#pragma unroll
      for (int nt = 0; nt < kNtPv; ++nt) {
        oacc[nt][0] *= al;
        oacc[nt][1] *= al;
        oacc[nt][2] *= ah;
        oacc[nt][3] *= ah;
      }
      const int a_row = mw * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
      const std::uint32_t pa = smem_u32(p_s + a_row * kPStride + (lane >> 4) * 8);
      const int v_tok = (lane & 7) + ((lane >> 3) & 1) * 8;
      const int v_dim = nw * kDvPerWarp + (lane >> 4) * 8;
      const std::uint32_t vb = smem_u32(k_s + v_tok * kKStride + v_dim);
#pragma unroll
      for (int kk = 0; kk < kTileTokens / 16; ++kk) {
        std::uint32_t af[4];
        ldsm_x4(pa + kk * 32, af);
#pragma unroll
        for (int pr = 0; pr < kNtPv / 2; ++pr) {
          std::uint32_t bf[4];
          ldsm_x4_trans(vb + std::uint32_t((kk * 16 * kKStride + pr * 16) * 2), bf);
          mma_bf16(oacc[2 * pr], af, bf[0], bf[1]);
          mma_bf16(oacc[2 * pr + 1], af, bf[2], bf[3]);
        }
      }
    }
    __syncthreads();  // k_s, p_s, slot_s and alpha_s are rewritten by the next tile
  }

  // --- The state: o = acc / l, lse = m + log(l); l == 0 (no token) is the neutral state.
  cp_async_wait_all();
  if (sm_thread && sm_part == 0) {
    m_s[sm_row] = m_run;
    l_s[sm_row] = l_run;
  }
  __syncthreads();
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = mw * 16 + (lane >> 2) + half * 8;
    const int h = h0 + r;
    if (h >= a.heads) continue;
    const float l = l_s[r];
    const bool empty = l == 0.0f;
    const StateRow out = state_row(a, j, t, h);
    const float inv = empty ? 0.0f : 1.0f / l;
#pragma unroll
    for (int nt = 0; nt < kNtPv; ++nt) {
      const int d = nw * kDvPerWarp + nt * 8 + 2 * (lane & 3);
      out.put2(d, empty ? 0.0f : oacc[nt][2 * half] * inv,
               empty ? 0.0f : oacc[nt][2 * half + 1] * inv);
    }
    if (nw == 0 && (lane & 3) == 0) {
      const float lse = empty ? kNegInf : m_s[r] + logf(l);
      out.put_lse(lse);
    }
  }
}

/// A split state's value: fp32, or bf16 bits (SplitArgs::bf16_states).
DCPATTN_DEVICE float state_value(const float* p) {
  return *p;
}
DCPATTN_DEVICE float state_value(const std::uint16_t* p) {
  return bf16_lo(*p);
}

/// Tree-merges S states (S, T, H, 512) + (S, T, H) along tree_merge's tree and writes the result
/// to o/lse; padding rows t >= num_valid_rows get the neutral state without reading the states.
/// One CTA of 512 threads per (t, h), one value dim per thread: a thread loads its dim of all S
/// states at once (coalesced across the CTA) and merges them in registers. Each warp computes
/// the tree's S - 1 weights itself (merge_lse per node, a lane per node of a level, the lse
/// values passed down by shuffles) into its own slice of shared memory: no CTA barrier, and the
/// weights are ready while the values are still arriving. When every weight is non-zero (the
/// usual case; a warp vote, the same for every warp of the row) the element merges skip the
/// zero tests (tree_merge_column's Plain). The element arithmetic is merge_tree.cuh's, node by
/// node in tree_merge's order, so the result is bitwise what an in-place tree merge gives. The
/// states are only read. `T`: float, or std::uint16_t for bf16 states (SplitArgs::bf16_states).
template <int S, class T = float>
__global__ void __launch_bounds__(kMlaVDim)
    mla_merge_kernel(const T* __restrict__ states_o, const float* __restrict__ states_lse,
                     std::int64_t tokens, int heads, int num_valid_rows, TensorView<float, 3> o,
                     TensorView<float, 2> lse) {
  static_assert(S >= 1 && S <= kMaxSplits && (S & (S - 1)) == 0, "dcpattn: S: 1..64, power of 2");
  constexpr int kWarps = kMlaVDim / 32;
  __shared__ float2 w_s[kWarps][S > 1 ? S - 1 : 1];  // each warp's tree weights {w_a, w_b}
  pdl_wait();  // the states (and, launched after a split kernel, its whole grid) are complete
  const std::int64_t row = std::int64_t(blockIdx.x);  // t * heads + h
  const std::int64_t t = row / heads;
  const int h = int(row % heads);
  const int d = int(threadIdx.x);
  if (t >= num_valid_rows) {
    o(t, std::int64_t(h), std::int64_t(d)) = 0.0f;
    if (d == 0) lse(t, std::int64_t(h)) = lse_neg_inf;
    return;
  }
  const std::int64_t plane = tokens * heads;  // states per split
  float v[S];
#pragma unroll
  for (int k = 0; k < S; ++k) v[k] = state_value(states_o + (k * plane + row) * kMlaVDim + d);
  if constexpr (S == 1) {
    o(t, std::int64_t(h), std::int64_t(d)) = v[0];
    if (d == 0) lse(t, std::int64_t(h)) = states_lse[row];
  } else {
    const int lane = d % 32;
    float2* w = w_s[d / 32];
    // Level 0: lane k < S / 2 holds leaves k and k + S / 2 (S <= 64: at most two lse a lane).
    float la = lane < S / 2 ? states_lse[lane * plane + row] : lse_neg_inf;
    float lb = lane < S / 2 ? states_lse[(lane + S / 2) * plane + row] : lse_neg_inf;
    bool nonzero = true;
#pragma unroll
    for (int level = 0, half = S / 2; half >= 1; half >>= 1, ++level) {
      if (level > 0) {  // node k + half of the level above, from lane k + half
        lb = __shfl_down_sync(kFullMask, la, unsigned(half));
      }
      if (lane < half) {
        const MergeWeights mw = merge_lse(la, lb);
        w[tree_node<S>(level, lane)] = make_float2(mw.w_a, mw.w_b);
        nonzero = nonzero && mw.w_a != 0.0f && mw.w_b != 0.0f;
        la = mw.lse;
      }
    }
    const bool plain = __all_sync(kFullMask, nonzero);
    __syncwarp();
    const auto weights = [w](int node) { return w[node]; };
    o(t, std::int64_t(h), std::int64_t(d)) =
        plain ? tree_merge_column<true>(v, weights) : tree_merge_column<false>(v, weights);
    if (d == 0) lse(t, std::int64_t(h)) = la;
  }
}

/// Threads of mla_merge_row_kernel: 4 value dims each, one CTA per (t, h).
inline constexpr int kMergeRowThreads = kMlaVDim / 4;
/// The merge of few states (S = 2, 4, 8; chosen by launch_merge): mla_merge_kernel's result, bit
/// for bit, from a CTA of 128 threads per (t, h), each loading its 4 dims of every state as one
/// 16-byte vector and computing the tree's S - 1 weights itself from the S lse values (no shared
/// memory, no barrier). A batch of many rows then fits the GPU in one wave of small CTAs: at 64 x
/// 4K, 16 heads (1024 rows of 2 states) the 512-thread kernel's CTAs ran in two.
/// `vec_out`: o's dims contiguous and 16-byte aligned (else four scalar stores).
template <int S, class T = float>
__global__ void __launch_bounds__(kMergeRowThreads)
    mla_merge_row_kernel(const T* __restrict__ states_o, const float* __restrict__ states_lse,
                         std::int64_t tokens, int heads, int num_valid_rows, TensorView<float, 3> o,
                         TensorView<float, 2> lse, bool vec_out) {
  static_assert(S >= 2 && S <= 8 && (S & (S - 1)) == 0, "dcpattn: S: 2, 4 or 8");
  pdl_wait();  // the states (and, launched after a split kernel, its whole grid) are complete
  const std::int64_t row = std::int64_t(blockIdx.x);  // t * heads + h
  const std::int64_t t = row / heads;
  const int h = int(row % heads);
  const int d = 4 * int(threadIdx.x);
  float4 out = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  float out_lse = lse_neg_inf;
  if (t < num_valid_rows) {
    const std::int64_t plane = tokens * heads;  // states per split
    float l[S];
    float4 v[S];
#pragma unroll
    for (int k = 0; k < S; ++k) l[k] = states_lse[k * plane + row];
#pragma unroll
    for (int k = 0; k < S; ++k) {
      const T* src = states_o + (k * plane + row) * kMlaVDim + d;
      if constexpr (sizeof(T) == 2) {  // four bf16 values
        const uint2 b = *reinterpret_cast<const uint2*>(src);
        v[k] = make_float4(bf16_lo(b.x), bf16_hi(b.x), bf16_lo(b.y), bf16_hi(b.y));
      } else {
        v[k] = *reinterpret_cast<const float4*>(src);
      }
    }
    // The tree's weights, node by node in tree_merge's order (as each warp of mla_merge_kernel).
    float2 w[S - 1];
    const bool plain = tree_weights<S>(l, w);  // the same for every thread of the row
    const auto weights = [&w](int node) { return w[node]; };
    float c[4][S];
#pragma unroll
    for (int k = 0; k < S; ++k) {
      c[0][k] = v[k].x;
      c[1][k] = v[k].y;
      c[2][k] = v[k].z;
      c[3][k] = v[k].w;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (plain) {
        tree_merge_column<true>(c[e], weights);
      } else {
        tree_merge_column<false>(c[e], weights);
      }
    }
    out = make_float4(c[0][0], c[1][0], c[2][0], c[3][0]);
    out_lse = l[0];
  }
  if (vec_out) {
    *reinterpret_cast<float4*>(&o(t, std::int64_t(h), std::int64_t(d))) = out;
  } else {
    o(t, std::int64_t(h), std::int64_t(d)) = out.x;
    o(t, std::int64_t(h), std::int64_t(d + 1)) = out.y;
    o(t, std::int64_t(h), std::int64_t(d + 2)) = out.z;
    o(t, std::int64_t(h), std::int64_t(d + 3)) = out.w;
  }
  if (threadIdx.x == 0) lse(t, std::int64_t(h)) = out_lse;
}

// ---------------------------------------------------------------------------------------------
// Warpgroup kernel (sm_90a: wgmma), mla_wg_kernel. The same contract as mla_split_kernel (splits,
// tiles of 64 split tokens, neutral states, data-dependent checks); the arithmetic differs only
// in the tensor-core instruction, so the two kernels' results are close, not bitwise equal, and
// a program uses one of them on a given device (compute capability 9.x: this one).
//
//   - one CTA of two warpgroups per (row, split, block of 64 heads): the wgmma M dimension is
//     the 64 heads; missing heads are zero rows that are never written back;
//   - shared memory in the 128-byte-swizzled K-major layout the tensor cores read directly:
//     a 64-row tile of 576 bf16 is 9 column blocks of 64 dims, each 64 rows x 128 bytes with
//     16-byte chunk c of row r at chunk c ^ (r mod 8); Q block, K/V tiles, P (64 x 64 bf16);
//   - bf16 cache: two K/V stages; the tile after the current one is copied (cp.async, 16 B,
//     zero-filled for missing tokens, handed over by the copies' own mbarrier arrivals) while
//     the current one is computed; fp8 cache: one stage of raw 656-byte entries copied with
//     cp.async and handed over CTA-wide, dequantized into the single K/V stage;
//   - S = Q K^T: warpgroup 0 computes the 64 heads x 64 tokens of the tile with wgmma m64n64k16
//     (36 k-steps in order, fp32 accumulators);
//   - online softmax in warpgroup 0's registers (each thread holds 2 head rows x 16 tokens) on
//     base-2 scores (S x softmax_scale x log2(e)), the weights one ex2.approx each
//     (detail::fast_exp2), log as logf; P rounded to bf16, into shared memory for warpgroup 1
//     with each row's rescale factor (mbarriers p_full / p_empty); warpgroup 0 keeps the row sum;
//   - O += P V: warpgroup g owns value dims [256 g, 256 g + 256) (wgmma m64n256k16, V read in
//     place from the K/V tile as an MN-major operand; 128 fp32 accumulators per thread),
//     warpgroup 0 with P from its registers, warpgroup 1 with P read from shared memory into
//     its registers (bf16) or by the tensor cores (fp8), while warpgroup 0 goes on to the next
//     tile;
//   - the state o = acc / l, lse = m ln(2) + logf(l) goes to scratch or straight to o/lse as
//     before.
// Narrow kernel (H <= 16, one CTA per (row, split)): the same producer, a query block of 16 rows,
// and the products transposed: S^T = K Q^T and O^T = V^T P^T with the 64 tokens as the wgmma M
// and the heads as N (m64n16k16), so no padded head row is computed. bf16 cache: the bf16
// pipeline and narrow_consumers. fp8 cache: four warpgroups (two computing the scores of
// alternate tiles, one the values, the producer), four raw stages and no bf16 copy of the tile;
// the consumers convert the e4m3 codes in registers and apply the group scales outside the
// products (narrow_fp8_consumers). Which kernel runs depends on H only, never on N.
// Every reduction has a fixed shape and order and nothing depends on S, the split index, N, T
// or the grid, so the DCP invariance argument of the file comment holds for this kernel too.

// The wgmma instructions exist only in the sm_90a target. Any other compute-capability-9.x
// target (plain sm_90) cannot run this kernel, and a device of that capability would select it:
// refuse that build instead of trapping at run time.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && __CUDA_ARCH__ < 1000
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DCPATTN_MLA_WGMMA 1
#else
#error \
    "dcpattn: the MLA decode kernels need the sm_90a target on compute capability 9.0 (CMAKE_CUDA_ARCHITECTURES=90a, or -gencode arch=compute_90a,code=sm_90a), not sm_90"
#endif
#endif

namespace wg {
inline constexpr int kConsumers = 256;  // warpgroups 0 and 1: tensor-core products and softmax
inline constexpr int kProducers = 128;  // warpgroup 2: slots, copies, fp8 dequantization
inline constexpr int kThreads = kConsumers + kProducers;
inline constexpr int kHeads = 64;                       // heads per CTA: the wgmma M
/// Heads per CTA of the narrow kernel (H <= 16): the wgmma N of the transposed products.
inline constexpr int kNarrowHeads = 16;
inline constexpr int kBlock = kTileTokens * 128;        // one 64-dim column block (8 KiB)
inline constexpr int kDimBlocks = kMlaQkDim / 64;       // 9
inline constexpr int kTile = kDimBlocks * kBlock;       // a Q block or a K/V tile: 73,728 bytes
inline constexpr int kRawEntry = DsMlaFp8Entry::bytes;  // 656 = 41 x 16
inline constexpr int kRing = 256;                       // sparse: gathered list entries (slots)
inline constexpr int kGather = kProducers;  // sparse: list entries examined per gather round
inline constexpr int kSlotBufs = 4;         // tiles whose slots are held (in flight + computed)
/// Registers per thread after the producer/consumer split (setmaxnreg). setmaxnreg moves
/// registers only within the CTA's launch allocation (168 per thread: 65536 / 384 rounded down to
/// a multiple of 8); a consumer's increase waits until the producers' decrease has freed enough,
/// so a split over that allocation would never complete (a split of 64 + 224 hangs).
inline constexpr int kLaunchRegs = 168;
inline constexpr int kProducerRegs = 56;
inline constexpr int kConsumerRegs = 224;
static_assert(kProducerRegs * kProducers + kConsumerRegs * kConsumers <= kLaunchRegs * kThreads,
              "dcpattn: the setmaxnreg split must fit the CTA's launch register allocation");
static_assert(kLaunchRegs * kThreads <= 65536, "dcpattn: the launch allocation must fit the SM");
/// The narrow fp8 kernel (Smem::reg_a) runs four warpgroups: two compute the scores and the
/// softmax of alternate tiles, one the values, one is the producer (narrow_fp8_consumers). Its
/// launch allocation is 128 registers per thread (65536 / 512), split the same way.
inline constexpr int kRegALaunchRegs = 128;
inline constexpr int kRegAProducerRegs = 48;
inline constexpr int kRegAScoreRegs = 152;
inline constexpr int kRegAValueRegs = 160;
static_assert(kRegAProducerRegs + 2 * kRegAScoreRegs + kRegAValueRegs <= 4 * kRegALaunchRegs &&
                  kRegALaunchRegs * 512 <= 65536,
              "dcpattn: the narrow fp8 kernel's setmaxnreg split must fit its launch allocation");
static_assert(kRing >= kTileTokens + kGather && (kRing & (kRing - 1)) == 0,
              "dcpattn: the sparse ring must hold a tile plus one gather round");
static_assert(kRawEntry % 16 == 0, "dcpattn: ds_mla entries are copied in 16-byte chunks");

/// Byte offsets of mla_wg_kernel's dynamic shared memory for kRows heads per CTA (kHeads, or
/// kNarrowHeads); every swizzled region is 1024-aligned. The query block is kRows rows of 576;
/// P is 64 heads x 64 tokens (wide), or two buffers of P^T, 16 heads x 64 tokens, by tile parity
/// (narrow).
template <bool kFp8, int kRows = kHeads>
struct Smem {
  static_assert(kRows == kHeads || kRows == kNarrowHeads, "dcpattn: 64 or 16 heads per CTA");
  /// The narrow fp8 kernel's products read the raw entries through registers
  /// (narrow_fp8_consumers): no bf16 K/V stage, four raw stages, four warpgroups.
  static constexpr bool reg_a = kFp8 && kRows == kNarrowHeads;
  static constexpr int stages = kFp8 ? (reg_a ? 0 : 1) : 2;  // K/V stages (bf16 tiles)
  /// fp8: stages of raw entries.
  static constexpr int raw_stages = kFp8 ? (reg_a ? 4 : 1) : 0;
  /// Slot buffers (tiles whose slots are held); the narrow fp8 kernel holds more tiles at once.
  static constexpr int slot_bufs = reg_a ? 8 : kSlotBufs;
  /// Threads: the consumer warpgroups (three for reg_a: two for the scores, one for the values),
  /// then the producer warpgroup.
  static constexpr int consumers = reg_a ? 3 * 128 : kConsumers;
  static constexpr int threads = consumers + kProducers;
  static constexpr std::size_t raw_bytes = std::size_t(kTileTokens) * kRawEntry;  // one stage
  static constexpr std::size_t q = 0;
  static constexpr std::size_t k = q + std::size_t(kDimBlocks) * kRows * 128;
  static constexpr std::size_t raw = k + std::size_t(stages) * kTile;
  static constexpr std::size_t p = raw + std::size_t(raw_stages) * raw_bytes;
  /// P blocks of kRows x 64 tokens: P (wide), P^T by tile parity (narrow), P^T per scale group
  /// and tile parity (narrow fp8).
  static constexpr int p_blocks = kRows == kHeads ? 1 : (reg_a ? 8 : 2);
  /// The 64-head fp8 kernel: the 32 x 32 e4m3 permutation through which the tensor cores turn
  /// the tile's codes into fp32 (write_unpack_perm, dequant_tile); 32 rows of 128 bytes.
  static constexpr std::size_t perm = p + std::size_t(p_blocks) * kRows * 128;
  static constexpr std::size_t perm_bytes = kFp8 && !reg_a ? 32 * 128 : 0;
  static constexpr std::size_t slot = perm + perm_bytes;                        // int32 [4][64]
  static constexpr std::size_t count = slot + slot_bufs * kTileTokens * 4;      // int32 [bufs]
  static constexpr std::size_t xrow = count + slot_bufs * 4;                    // float [2][64]
  static constexpr std::size_t ring = xrow + 2 * kHeads * 4;                    // int32 [kRing]
  static constexpr std::size_t wsum = ring + kRing * 4;                         // int [4]
  /// Narrow fp8: the query's per-head factors, the scale exponents, rescale factors, the chained
  /// softmax state, the column maxima and row sums of the two score warpgroups
  /// (narrow_fp8_consumers).
  static constexpr std::size_t fold = wsum + 4 * 4;
  /// The 64-head fp8 kernel: set when the query's tensor copies were issued (q_tma).
  static constexpr std::size_t q_issued = fold + (reg_a ? 448 * 4 : 0);  // int
  // u64 full[4], empty[4] (by stage), then the narrow kernel's pt_full[2], pt_empty[2], then the
  // narrow fp8 kernel's q_full, chain_full[2], end_full
  static constexpr std::size_t bar = q_issued + 8;
  static constexpr std::size_t bytes = bar + (reg_a ? 16 : 12) * 8;
  static_assert(p % 1024 == 0 && k % 1024 == 0, "dcpattn: swizzled regions must be 1024-aligned");
  static_assert(bar % 8 == 0, "dcpattn: mbarriers must be 8-byte aligned");
  static_assert(bytes <= 232448, "dcpattn: over the 227 KiB shared-memory limit of sm_90");
};

/// mbarrier primitives (PTX ISA, "Parallel Synchronization and Communication: mbarrier").
/// arrive has release and try_wait acquire semantics at CTA scope.
DCPATTN_DEVICE void mbar_init(std::uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count)
               : "memory");
}
DCPATTN_DEVICE void mbar_arrive(std::uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
DCPATTN_DEVICE void mbar_wait(std::uint64_t* bar, int parity) {
  std::uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  } while (!done);
}
/// Whether the phase of `bar` with the given parity has completed, without waiting (acquire
/// semantics when it has, as mbar_wait).
DCPATTN_DEVICE bool mbar_test(std::uint64_t* bar, int parity) {
  std::uint32_t done = 0;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(smem_u32(bar)), "r"(parity)
      : "memory");
  return done != 0;
}
/// An arrival on `bar` once every cp.async this thread has issued so far has completed; counts
/// as one of the barrier's expected arrivals (.noinc).
DCPATTN_DEVICE void cp_async_mbar_arrive(std::uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(bar))
               : "memory");
}
/// An arrival on `bar` that also expects `bytes` more of asynchronous copies (complete_tx).
DCPATTN_DEVICE void mbar_arrive_expect_tx(std::uint64_t* bar, std::uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
}
/// The tensor memory accelerator's copy of box (c0, c1) of the tensor `map` describes (a kernel
/// parameter) to shared memory at `dst`; its bytes complete on `bar`.
DCPATTN_DEVICE void tma_load_2d([[maybe_unused]] std::uint32_t dst,
                                [[maybe_unused]] const CUtensorMap* map, [[maybe_unused]] int c0,
                                [[maybe_unused]] int c1, [[maybe_unused]] std::uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(c0), "r"(c1), "r"(smem_u32(bar))
      : "memory");
#else
  __trap();  // the warpgroup kernel only (compute capability 9.x)
#endif
}
/// tma_load_2d for a three-dimensional tensor: box (c0, c1, c2).
DCPATTN_DEVICE void tma_load_3d([[maybe_unused]] std::uint32_t dst,
                                [[maybe_unused]] const CUtensorMap* map, [[maybe_unused]] int c0,
                                [[maybe_unused]] int c1, [[maybe_unused]] int c2,
                                [[maybe_unused]] std::uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3, %4}], [%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(smem_u32(bar))
      : "memory");
#else
  __trap();  // the warpgroup kernel only (compute capability 9.x)
#endif
}
/// A bulk copy (no tensor map) of `bytes` (a multiple of 16) from global `src` to shared `dst`,
/// both 16-byte aligned; its bytes complete on `bar`.
DCPATTN_DEVICE void bulk_load([[maybe_unused]] std::uint32_t dst, [[maybe_unused]] const void* src,
                              [[maybe_unused]] std::uint32_t bytes,
                              [[maybe_unused]] std::uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(dst),
      "l"(__cvta_generic_to_global(src)), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
#else
  __trap();  // the warpgroup kernel only (compute capability 9.x)
#endif
}
/// One thread's bulk copy of a raw fp8 tile, the 64 consecutive entries from slot s0 of a cache of
/// contiguous 656-byte entries, to shared `dst`; its bytes complete on `bar` (expect_tx).
template <class CacheView>
DCPATTN_DEVICE void bulk_load_raw_tile(std::uint32_t dst, const CacheView& cache, int s0,
                                       std::uint64_t* bar) {
  constexpr std::uint32_t kBytes = std::uint32_t(kTileTokens) * kRawEntry;
  mbar_arrive_expect_tx(bar, kBytes);
  bulk_load(dst, cache.data_handle() + std::int64_t(s0) * kRawEntry, kBytes, bar);
}
/// The first slot of a tile when it is full and its slots run consecutively from it, else -1.
/// Only meaningful where the launch makes every tile a run of positions in one page
/// (dense_splits): there a full tile whose first and last slots are 63 apart is 64 consecutive
/// slots. A tile spanning pages could pass the same check with other pages between.
DCPATTN_DEVICE int page_run_start(const int* slots, int n_tile) {
  const int s0 = slots[0];
  return n_tile == kTileTokens && s0 >= 0 &&
                 std::int64_t(slots[kTileTokens - 1]) == std::int64_t(s0) + (kTileTokens - 1)
             ? s0
             : -1;
}
/// Barrier among `count` threads (a multiple of 32) under hardware barrier `id` (1..15).
DCPATTN_DEVICE void named_barrier(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
DCPATTN_DEVICE void consumer_barrier() {
  named_barrier(1, kConsumers);
}
DCPATTN_DEVICE void producer_barrier() {
  named_barrier(2, kProducers);
}
/// fp8: a CTA-wide hand-over, an mbarrier that all kThreads threads arrive on and then wait for
/// (phase: the tile's parity). Not bar.sync: compute-sanitizer racecheck orders the accesses of
/// two warpgroups across a CTA-wide bar.sync only when both have passed the same number of
/// barriers, and the consumers' own bar.sync (twice a tile) and the producer's (data dependent
/// for sparse) differ. It then reports the raw stage's reads and the next copy into it as races.
/// Measured with a minimal kernel of this hand-over: clean with equal counts, flagged with
/// unequal ones. mbarriers carry their own order (arrive releases, the wait acquires), as in the
/// bf16 pipeline.
DCPATTN_DEVICE void cta_handover(std::uint64_t* bar, int phase) {
  mbar_arrive(bar);
  mbar_wait(bar, phase);
}

/// Offset of 16-byte chunk c (0..71) of row r (0..kRows-1) in a swizzled kRows x 576 block:
/// 9 column blocks of kRows rows x 128 bytes.
template <int kRows = kTileTokens>
DCPATTN_DEVICE std::uint32_t tile_offset(int r, int c) {
  return std::uint32_t((c >> 3) * kRows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

/// wgmma shared-memory matrix descriptor, 128-byte swizzle: start address, leading and stride
/// byte offsets (PTX ISA, "Matrix Descriptor Format").
DCPATTN_DEVICE std::uint64_t gmma_desc(std::uint32_t addr, std::uint32_t lbo, std::uint32_t sbo) {
  return std::uint64_t((addr & 0x3FFFFu) >> 4) | (std::uint64_t(lbo >> 4) << 16) |
         (std::uint64_t(sbo >> 4) << 32) | (std::uint64_t(1) << 62);
}

DCPATTN_DEVICE void wgmma_fence() {
#if defined(DCPATTN_MLA_WGMMA)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
DCPATTN_DEVICE void wgmma_commit() {
#if defined(DCPATTN_MLA_WGMMA)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
DCPATTN_DEVICE void wgmma_wait_all() {
#if defined(DCPATTN_MLA_WGMMA)
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#endif
}
/// Makes this thread's generic-proxy shared-memory writes (ordinary stores and completed
/// cp.async copies) visible to the tensor cores' async proxy; a barrier must follow.
DCPATTN_DEVICE void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
/// cp.async of 16 bytes, zero-filled (nothing read) when !valid.
DCPATTN_DEVICE void cp_async_16z(std::uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst),
               "l"(__cvta_generic_to_global(src)), "r"(valid ? 16 : 0)
               : "memory");
}
DCPATTN_DEVICE void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
DCPATTN_DEVICE void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

DCPATTN_DEVICE void wgmma_m64n64_qk([[maybe_unused]] float (&d)[32],
                                    [[maybe_unused]] std::uint64_t desc_a,
                                    [[maybe_unused]] std::uint64_t desc_b,
                                    [[maybe_unused]] int accumulate) {
#if defined(DCPATTN_MLA_WGMMA)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "
      "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
#else
  __trap();  // not an sm_90a target: never selected (see use_wgmma_kernel)
#endif
}
// The 128 fp32 accumulators of an m64n256 product (one thread's share of O): their operand
// placeholders %0..%127 and output constraints.
#define DCPATTN_MLA_D128_REGS                                                            \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, "     \
  "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, "     \
  "%34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, "     \
  "%50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, "     \
  "%66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, "     \
  "%82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, "     \
  "%98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "   \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, " \
  "%126, %127"
#define DCPATTN_MLA_D128_OUTS(d)                                                                  \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),    \
      "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),  \
      "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),  \
      "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),  \
      "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),  \
      "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),  \
      "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),  \
      "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),  \
      "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]),  \
      "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]),  \
      "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]),  \
      "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]),  \
      "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]),  \
      "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]),          \
      "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]),         \
      "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]),         \
      "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]),         \
      "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
/// O += P V with P (the A operand) from registers: a[0..3] as the m64k16 A fragment.
DCPATTN_DEVICE void wgmma_m64n256_pv_rs([[maybe_unused]] float (&d)[128],
                                        [[maybe_unused]] const std::uint32_t (&a)[4],
                                        [[maybe_unused]] std::uint64_t desc_b) {
#if defined(DCPATTN_MLA_WGMMA)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" DCPATTN_MLA_D128_REGS
      "}, "
      "{%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
      : DCPATTN_MLA_D128_OUTS(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
#else
  __trap();  // not an sm_90a target: never selected (see use_wgmma_kernel)
#endif
}
/// O += P V with P from shared memory (desc_a) and V (desc_b), both from shared memory.
DCPATTN_DEVICE void wgmma_m64n256_pv([[maybe_unused]] float (&d)[128],
                                     [[maybe_unused]] std::uint64_t desc_a,
                                     [[maybe_unused]] std::uint64_t desc_b,
                                     [[maybe_unused]] int accumulate) {
#if defined(DCPATTN_MLA_WGMMA)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" DCPATTN_MLA_D128_REGS
      "}, "
      "%128, %129, p, 1, 1, 0, 1;\n}\n"
      : DCPATTN_MLA_D128_OUTS(d)
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
#else
  __trap();  // not an sm_90a target: never selected (see use_wgmma_kernel)
#endif
}
#undef DCPATTN_MLA_D128_REGS
#undef DCPATTN_MLA_D128_OUTS

/// d (+)= A B^T for one m64n16k16 bf16 tile, fp32 accumulation, both operands in shared memory:
/// B K-major, A K-major (kTransA = 0) or MN-major (kTransA = 1).
template <int kTransA>
DCPATTN_DEVICE void wgmma_m64n16([[maybe_unused]] float (&d)[8],
                                 [[maybe_unused]] std::uint64_t desc_a,
                                 [[maybe_unused]] std::uint64_t desc_b,
                                 [[maybe_unused]] int accumulate) {
#if defined(DCPATTN_MLA_WGMMA)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, %11, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransA));
#else
  __trap();  // not an sm_90a target: never selected (see use_wgmma_kernel)
#endif
}

/// d (+)= A B^T for one m64n16k16 bf16 tile, fp32 accumulation, A from registers (the fragment
/// of PTX ISA "Matrix Fragments for wgmma.mma_async.m64nNk16": warp w of the warpgroup holds rows
/// [16 w, 16 w + 16); with g = lane / 4, c = lane % 4, a = {(g, 2c..2c+1), (g+8, 2c..),
/// (g, 2c+8..), (g+8, 2c+8..)}, low element first), B K-major in shared memory.
/// kF16: both operands f16 instead of bf16.
template <bool kF16 = false>
DCPATTN_DEVICE void wgmma_m64n16_rs([[maybe_unused]] float (&d)[8],
                                    [[maybe_unused]] const std::uint32_t (&a)[4],
                                    [[maybe_unused]] std::uint64_t desc_b,
                                    [[maybe_unused]] int accumulate) {
#if defined(DCPATTN_MLA_WGMMA)
  if constexpr (kF16) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
  }
#else
  __trap();  // not an sm_90a target: never selected (see use_wgmma_kernel)
#endif
}
// One m64n32k32 e4m3 product; %21 non-zero: d += A B^T, zero: d = A B^T.
#define DCPATTN_WGMMA_M64N32K32_E4M3                                         \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"                               \
  "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 "                    \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, " \
  "{%16, %17, %18, %19}, %20, p, 1, 1;\n}\n"
#define DCPATTN_WGMMA_D16(c)                                                                \
  c(d[0]), c(d[1]), c(d[2]), c(d[3]), c(d[4]), c(d[5]), c(d[6]), c(d[7]), c(d[8]), c(d[9]), \
      c(d[10]), c(d[11]), c(d[12]), c(d[13]), c(d[14]), c(d[15])
/// d (+)= A B^T for one m64n32k32 e4m3 tile, fp32 accumulation, A from registers (the 8-bit
/// fragment of PTX ISA "Matrix Fragments for wgmma.mma_async.m64nNk32": warp w of the warpgroup
/// holds rows [16 w, 16 w + 16); with g = lane / 4, c = lane % 4, a = {(g, 4c..4c+3), (g+8,
/// 4c..), (g, 16+4c..), (g+8, 16+4c..)}, lowest byte first), B K-major in shared memory. d holds
/// (g, 8 jn + 2c + e) in d[4 jn + e] and (g + 8, 8 jn + 2c + e) in d[4 jn + 2 + e], jn < 4.
DCPATTN_DEVICE void wgmma_m64n32k32_e4m3_rs([[maybe_unused]] float (&d)[16],
                                            [[maybe_unused]] const std::uint32_t (&a)[4],
                                            [[maybe_unused]] std::uint64_t desc_b,
                                            [[maybe_unused]] int accumulate) {
#if defined(DCPATTN_MLA_WGMMA)
  asm volatile(DCPATTN_WGMMA_M64N32K32_E4M3
               : DCPATTN_WGMMA_D16("+f")
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
#else
  __trap();  // not an sm_90a target: never selected (see use_wgmma_kernel)
#endif
}
/// d = A B^T for one m64n32k32 e4m3 tile (wgmma_m64n32k32_e4m3_rs without accumulation: d is
/// only written).
DCPATTN_DEVICE void wgmma_m64n32k32_e4m3_rs_set([[maybe_unused]] float (&d)[16],
                                                [[maybe_unused]] const std::uint32_t (&a)[4],
                                                [[maybe_unused]] std::uint64_t desc_b) {
#if defined(DCPATTN_MLA_WGMMA)
  asm volatile(DCPATTN_WGMMA_M64N32K32_E4M3
               : DCPATTN_WGMMA_D16("=f")
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(0));
#else
  __trap();  // not an sm_90a target: never selected (see use_wgmma_kernel)
#endif
}
#undef DCPATTN_WGMMA_D16
#undef DCPATTN_WGMMA_M64N32K32_E4M3
/// Waits until at most N committed wgmma groups of this warpgroup are pending.
template <int N>
DCPATTN_DEVICE void wgmma_wait() {
#if defined(DCPATTN_MLA_WGMMA)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

/// Pins the values of `r` at this point of the program (the register-operand fence of wgmma code):
/// the compiler may not move their computation past it.
template <int N>
DCPATTN_DEVICE void fence_registers(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

/// 16 zero bytes at a shared-memory address.
DCPATTN_DEVICE void zero16(unsigned char* dst) {
  *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
}

/// Query rows [h0, h0 + kRows) of token t into the swizzled Q block by kBy threads (thread tid);
/// rows >= heads are zero. cp.async where the row is contiguous and aligned, else stores: the
/// caller waits for its copies (cp_async_wait_all) and fences them for the tensor cores.
template <int kRows, int kBy>
DCPATTN_DEVICE void load_q(const QDesc& q, std::int64_t t, int h0, int heads, unsigned char* q_s,
                           int tid) {
  // Warp w takes rows w, w + kBy / 32, ...; lane l chunks l, l + 32 and l + 64 (< 72) of each:
  // one row address per row and lane.
  constexpr int kChunks = kMlaQkDim / 8;  // 72
  const int lane = tid & 31;
  for (int r = tid >> 5; r < kRows; r += kBy / 32) {
    const int h = h0 + r;
    const bfloat16* src = h < heads ? q.row(t, h) : nullptr;
#pragma unroll
    for (int c = lane; c < kChunks; c += 32) {
      unsigned char* dst = q_s + tile_offset<kRows>(r, c);
      if (src == nullptr) {
        zero16(dst);
        continue;
      }
      const bfloat16* s = src + std::int64_t(c) * 8 * q.sd;
      if (q.sd == 1 && (reinterpret_cast<std::uintptr_t>(s) & 15u) == 0) {
        cp_async_16z(smem_u32(dst), s, true);
      } else {
        std::uint32_t w[4];
#pragma unroll
        for (int e = 0; e < 4; ++e)
          w[e] = pack_bf16(s[(2 * e) * q.sd].bits, s[(2 * e + 1) * q.sd].bits);
        *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
  }
}
template <int kRows, int kBy, class QView>
DCPATTN_DEVICE void load_q(const GenericQ<QView>& q, std::int64_t t, int h0, int heads,
                           unsigned char* q_s, int tid) {
  for (int i = tid; i < kRows * kMlaQkDim; i += kBy) {
    const int r = i / kMlaQkDim, d = i % kMlaQkDim;
    const int h = h0 + r;
    std::uint16_t bits = 0;
    if (h < heads) bits = bf16_bits_of(q.q(t, std::int64_t(h), std::int64_t(d)));
    *reinterpret_cast<std::uint16_t*>(q_s + tile_offset<kRows>(r, d / 8) + (d % 8) * 2) = bits;
  }
}

/// Starts the copy of a bf16 tile's keys (slot < 0: zero rows) into stage k_s: cp.async on the
/// vector path, else ordinary element reads through the view (both formats; complete on return).
/// Vector path: producer warp w copies tokens [16 w, 16 w + 16); lane l copies 16-byte chunks l,
/// l + 32 and l + 64 (< 72) of each, so a warp reads 512 contiguous bytes per instruction and
/// the per-chunk address work is done once per tile.
template <class CacheView>
DCPATTN_DEVICE void load_tile_direct(const CacheView& cache, bool vector_path, const int* slot_s,
                                     unsigned char* k_s, int ptid) {
  constexpr CacheFormat kFormat = mla_cache_format_v<CacheView>;
  if constexpr (is_plain_strided_v<CacheView> && kFormat == CacheFormat::bf16) {
    if (vector_path) {
      const int lane = ptid & 31, w = ptid >> 5;
      const bfloat16* base = cache.data_handle();
      const std::int64_t stride = cache.stride(0);
      const std::uint32_t k_base = smem_u32(k_s);
      const bool third = lane < kMlaQkDim / 8 - 64;  // chunk lane + 64 exists (lanes 0..7)
      // Chunk c of row r lands at (c / 8) * kBlock + r * 128 + ((c mod 8) ^ (r mod 8)) * 16.
      const std::uint32_t blk0 = std::uint32_t((lane >> 3) * kBlock);
      const std::uint32_t blk1 = std::uint32_t(((lane + 32) >> 3) * kBlock);
      const std::uint32_t blk2 = std::uint32_t(((lane + 64) >> 3) * kBlock);
      const int c7 = lane & 7;  // the same for lane, lane + 32 and lane + 64
#pragma unroll 4
      for (int r = 0; r < kTileTokens / 4; ++r) {
        const int tok = w * (kTileTokens / 4) + r;
        const int slot = slot_s[tok];
        const bool valid = slot >= 0;
        const bfloat16* row = base + std::int64_t(valid ? slot : 0) * stride + lane * 8;
        const std::uint32_t dst = k_base + std::uint32_t(tok * 128 + ((c7 ^ (tok & 7)) << 4));
        cp_async_16z(dst + blk0, row, valid);
        cp_async_16z(dst + blk1, row + 256, valid);
        if (third) cp_async_16z(dst + blk2, row + 512, valid);
      }
      return;
    }
  }
  for (int i = ptid; i < kTileTokens * kMlaQkDim; i += kProducers) {
    const int tok = i / kMlaQkDim, d = i % kMlaQkDim;
    const int slot = slot_s[tok];
    const bfloat16 v = bfloat16::from_float(slot < 0 ? 0.0f : mla_key(cache, slot, d));
    *reinterpret_cast<std::uint16_t*>(k_s + tile_offset(tok, d / 8) + (d % 8) * 2) = v.bits;
  }
}

/// Starts the cp.async copy of a tile's raw ds_mla entries (slot < 0: zeros) into raw_s: producer
/// warp w copies tokens [16 w, 16 w + 16), lane l chunks l and l + 32 (< 41) of each.
template <class CacheView>
DCPATTN_DEVICE void load_tile_raw(const CacheView& cache, const int* slot_s, unsigned char* raw_s,
                                  int ptid) {
  constexpr int kChunks = kRawEntry / 16;  // 41
  const int lane = ptid & 31, w = ptid >> 5;
  const std::uint8_t* base = cache.data_handle();
  const std::int64_t stride = cache.stride(0);
  const std::uint32_t raw_base = smem_u32(raw_s) + std::uint32_t(lane * 16);
  const bool second = lane + 32 < kChunks;
  // The warp's 16 slots, four per (broadcast) load, all read before the first copy.
  int sl[kTileTokens / 4];
#pragma unroll
  for (int v = 0; v < kTileTokens / 16; ++v) {
    const int4 x = reinterpret_cast<const int4*>(slot_s + w * (kTileTokens / 4))[v];
    sl[4 * v] = x.x;
    sl[4 * v + 1] = x.y;
    sl[4 * v + 2] = x.z;
    sl[4 * v + 3] = x.w;
  }
#pragma unroll
  for (int r = 0; r < kTileTokens / 4; ++r) {
    const int tok = w * (kTileTokens / 4) + r;
    const int slot = sl[r];
    const bool valid = slot >= 0;
    const std::uint8_t* src = base + std::int64_t(valid ? slot : 0) * stride + lane * 16;
    const std::uint32_t dst = raw_base + std::uint32_t(tok * kRawEntry);
    cp_async_16z(dst, src, valid);
    if (second) cp_async_16z(dst + 512, src + 512, valid);
  }
}

/// The four e4m3 codes of w (low byte first) as two f16x2 values, exactly (every e4m3 value is
/// an f16 value): lo = codes 0, 1 and hi = codes 2, 3; one conversion instruction each.
DCPATTN_DEVICE void e4m3x4_to_f16x2x2(std::uint32_t w, std::uint32_t& lo, std::uint32_t& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\n"
      "cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(w));
#else
  const __half2_raw a = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(w & 0xffffu), __NV_E4M3);
  const __half2_raw b = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(w >> 16), __NV_E4M3);
  lo = std::uint32_t(a.x) | (std::uint32_t(a.y) << 16);
  hi = std::uint32_t(b.x) | (std::uint32_t(b.y) << 16);
#endif
}

/// Bits of query element (t, h, d) (bf16; float views rounded).
DCPATTN_DEVICE std::uint16_t q_bits(const QDesc& q, std::int64_t t, int h, int d) {
  return q.row(t, h)[std::int64_t(d) * q.sd].bits;
}
template <class QView>
DCPATTN_DEVICE std::uint16_t q_bits(const GenericQ<QView>& q, std::int64_t t, int h, int d) {
  return bf16_bits_of(q.q(t, std::int64_t(h), std::int64_t(d)));
}

/// The column of RoPE dim d in the narrow fp8 kernel's query block (kperm_column): within each
/// 16-dim k-step, the 4 bf16 dims [4 c, 4 c + 4) a thread reads from a cache entry with one 64-bit
/// load are the fragment columns {2 c, 2 c + 1, 2 c + 8, 2 c + 9} that lane c % 4 of the register
/// A operand holds (wgmma_m64n16_rs). Permuting the columns of Q and K alike gives the same
/// products; the order in which the tensor cores sum a k-step's 16 products is theirs either way.
DCPATTN_HOST_DEVICE constexpr int kperm_column(int d) {
  const int w = d % 16, c = w / 4, e = w % 4;
  return d - w + (e < 2 ? 2 * c + e : 2 * c + 6 + e);
}
/// kperm_column is a permutation of each 16-dim k-step that keeps pairs (2 i, 2 i + 1) together.
constexpr bool kperm_column_is_valid() {
  for (int d = 0; d < 16; ++d) {
    int hits = 0;
    for (int x = 0; x < 16; ++x) hits += kperm_column(x) == d;
    if (hits != 1 || kperm_column(d + 16) != kperm_column(d) + 16) return false;
    if (d % 2 == 0 && kperm_column(d + 1) != kperm_column(d) + 1) return false;
  }
  return true;
}
static_assert(kperm_column_is_valid(), "dcpattn: kperm_column must permute each k-step");

inline constexpr int kDsLatent = DsMlaFp8Entry::latent_dim;  // 512

/// 2^e as a float for an integer e in [-126, 127].
DCPATTN_DEVICE float pow2i(int e) {
  return __int_as_float((e + 127) << 23);
}

/// The narrow fp8 kernel's query block (rows [h0, h0 + kNarrowHeads) of token t; rows >= heads
/// zero), each head's row scaled by 2^tau_h so that its largest magnitude lies in [2^7, 2^8):
///   - the 512 latent dims as two e4m3 parts, x 2^tau = hi + lo (hi = e4m3(x 2^tau), lo =
///     e4m3(x 2^tau - hi)): per scale group g (dims [128 g, 128 g + 128)) a block of 32 rows of
///     128 bytes (kQ8Block, 128-byte swizzle), row h holding hi of head h and row 16 + h lo, so
///     that one product of N = 32 gives both (wgmma_m64n32k32_e4m3_rs). A bf16 value has 8
///     significant bits and hi takes 4, so the rest is exact in lo wherever it is at least
///     e4m3's smallest step 2^-9: every value down to 2^-10 of the row's maximum is exact, and a
///     smaller one is off by at most 2^-10 (2^-17 of the maximum);
///   - the 64 RoPE dims (column block 8, at kQ8Rope) in bf16 as given, columns permuted by
///     kperm_column (pairs of dims stay together);
///   - qinv[h] = 2^-tau_h, which the scores are multiplied by.
/// A NaN or infinite element makes the head's row NaN codes, so that its scores are NaN.
/// Built by kBuilders threads (thread `tid`): warp w fills heads [hw w, hw w + hw), hw = 16 /
/// (kBuilders / 32); lane l reads latent dims [16 l, 16 l + 16) (16-byte chunk l mod 8 of group
/// l / 8) and RoPE dims 512 + 2 l, + 1 of each. Every element a thread needs is loaded once, all
/// of them before the first is used (one memory round trip), with three vector loads per head
/// where the row's dims are contiguous and 16-byte aligned. (Each head's row read twice, for its
/// maximum and then for its conversion, one head after the other, left the query block to 9-11
/// us after the CTA's start at 64 x 4K, 16 heads, against 5-6 us for the first tile;
/// docs/performance.md, run 16.)
inline constexpr int kQ8Block = 2 * kNarrowHeads * 128;  // one scale group's hi and lo rows
inline constexpr int kQ8Rope = 4 * kQ8Block;             // the RoPE block (16 rows of 128 bytes)
template <int kBuilders, class QSrc>
DCPATTN_DEVICE void load_q_fp8(const QSrc& q, std::int64_t t, int h0, int heads, unsigned char* q_s,
                               float* qinv, int tid) {
  constexpr int kHw = kNarrowHeads / (kBuilders / 32);  // heads per warp
  static_assert(kHw * (kBuilders / 32) == kNarrowHeads, "dcpattn: whole heads per warp");
  static_assert(kQ8Rope == 8 * kNarrowHeads * 128, "dcpattn: the RoPE block at column block 8");
  const int lane = tid & 31, w = tid >> 5;
  // Latent dims 16 lane + 2 k (low half) and + 1 (high half), and RoPE dims 512 + 2 lane, + 1, of
  // each of the warp's heads, as bf16 pairs; zeros for a head >= heads.
  std::uint32_t x[kHw][8], rope[kHw];
#pragma unroll
  for (int i = 0; i < kHw; ++i) {
    const int h = h0 + kHw * w + i;
    bool done = h >= heads;
    if (done) {
#pragma unroll
      for (int k = 0; k < 8; ++k) x[i][k] = 0u;
      rope[i] = 0u;
    }
    if constexpr (std::is_same_v<QSrc, QDesc>) {
      const bfloat16* row = done ? nullptr : q.row(t, h);
      if (!done && q.sd == 1 && (reinterpret_cast<std::uintptr_t>(row) & 15) == 0) {
        const uint4 v0 = *reinterpret_cast<const uint4*>(row + 16 * lane);
        const uint4 v1 = *reinterpret_cast<const uint4*>(row + 16 * lane + 8);
        x[i][0] = v0.x, x[i][1] = v0.y, x[i][2] = v0.z, x[i][3] = v0.w;
        x[i][4] = v1.x, x[i][5] = v1.y, x[i][6] = v1.z, x[i][7] = v1.w;
        rope[i] = *reinterpret_cast<const std::uint32_t*>(row + kDsLatent + 2 * lane);
        done = true;
      }
    }
    if (!done) {
#pragma unroll
      for (int k = 0; k < 8; ++k)
        x[i][k] =
            pack_bf16(q_bits(q, t, h, 16 * lane + 2 * k), q_bits(q, t, h, 16 * lane + 2 * k + 1));
      const int d = kDsLatent + 2 * lane;
      rope[i] = pack_bf16(q_bits(q, t, h, d), q_bits(q, t, h, d + 1));
    }
  }
  const auto lo = [](std::uint32_t v) { return __int_as_float(int(v << 16)); };
  const auto hi = [](std::uint32_t v) { return __int_as_float(int(v & 0xFFFF0000u)); };
  // Two floats as e4m3 codes (x in the low byte; one cvt.rn.satfinite: the values are below 2^8
  // or NaN, see below); and back (exact).
  const auto to_e4m3x2 = [](float x, float y) {
    return std::uint32_t(__nv_cvt_float2_to_fp8x2(make_float2(x, y), __NV_SATFINITE, __NV_E4M3));
  };
  const auto from_e4m3x2 = [](std::uint32_t v) {
    const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(v), __NV_E4M3);
    return __half22float2(*reinterpret_cast<const __half2*>(&r));
  };
  const int grp = lane >> 3, chunk = lane & 7;
#pragma unroll
  for (int i = 0; i < kHw; ++i) {
    const int r = kHw * w + i;
    float amax = 0.0f;  // a dead row (h >= heads) is all zeros: amax 0, tau 0
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      amax = fmaxf(amax, fabsf(lo(x[i][k])));
      amax = fmaxf(amax, fabsf(hi(x[i][k])));
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, off));
    // amax in [2^(e - 127), 2^(e - 126)): tau = 134 - e puts it in [2^7, 2^8), below e4m3's
    // largest value 448. A NaN or infinite query keeps tau = 0 (the scores are NaN either way).
    const int e = (__float_as_int(amax) >> 23) & 0xFF;
    const int tau = (amax > 0.0f && e < 255) ? max(-120, min(120, 134 - e)) : 0;
    const float up = pow2i(tau);
    // A NaN or infinite element makes the whole row NaN codes (e4m3 has no infinity, and the
    // saturating conversion would make an infinity finite): the head's scores are NaN.
    const float nan_or_zero = e == 255 ? __int_as_float(0x7FFFFFFF) : 0.0f;
    std::uint32_t hw[4], lw[4];  // the 16 hi and lo codes of the chunk, dims in order
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float a = lo(x[i][k]) * up + nan_or_zero, b = hi(x[i][k]) * up + nan_or_zero;
      const std::uint32_t h8 = to_e4m3x2(a, b);
      const float2 hv = from_e4m3x2(h8);
      const std::uint32_t l8 = to_e4m3x2(a - hv.x, b - hv.y);  // exact differences
      const int sh = 16 * (k & 1);
      hw[k >> 1] = (k & 1) ? hw[k >> 1] | (h8 << sh) : h8;
      lw[k >> 1] = (k & 1) ? lw[k >> 1] | (l8 << sh) : l8;
    }
    unsigned char* blk = q_s + grp * kQ8Block;
    const int rl = r + kNarrowHeads;  // the lo row
    *reinterpret_cast<uint4*>(blk + r * 128 + ((chunk ^ (r & 7)) << 4)) =
        make_uint4(hw[0], hw[1], hw[2], hw[3]);
    *reinterpret_cast<uint4*>(blk + rl * 128 + ((chunk ^ (rl & 7)) << 4)) =
        make_uint4(lw[0], lw[1], lw[2], lw[3]);
    const int col = kperm_column(kDsLatent + 2 * lane);
    *reinterpret_cast<std::uint32_t*>(q_s + tile_offset<kNarrowHeads>(r, col / 8) + (col % 8) * 2) =
        rope[i];
    if (lane == 0) qinv[r] = pow2i(-tau);
  }
}

/// A tile's raw entries (slot < 0: zeros) copied into raw_s byte by byte through the view: the
/// path of caches whose entries are not 16-byte aligned, or of views with another layout or
/// accessor (entries are contiguous: validate_mla_cache). Complete on return.
template <class CacheView>
DCPATTN_DEVICE void load_tile_raw_bytes(const CacheView& cache, const int* slot_s,
                                        unsigned char* raw_s, int ptid) {
  for (int i = ptid; i < kTileTokens * kRawEntry; i += kProducers) {
    const int tok = i / kRawEntry, b = i % kRawEntry;
    const int slot = slot_s[tok];
    raw_s[i] = slot >= 0 ? (&cache(std::int64_t(slot), std::int64_t(0)))[b] : 0;
  }
}

/// The product column of k-slot kappa of the 8-bit A fragment in dequant_tile's unpacking
/// products: the thread at quad position c (lane % 4) loads 8 consecutive codes of a row for a
/// k-step, the first 4 into k-slots [4 c, 4 c + 4) and the other 4 into [16 + 4 c, 16 + 4 c + 4)
/// (wgmma_m64n32k32_e4m3_rs); code j of those 8 then lands in column 8 c + j.
DCPATTN_HOST_DEVICE constexpr int unpack_column(int kappa) {
  return kappa < 16 ? 8 * (kappa / 4) + kappa % 4 : 8 * ((kappa - 16) / 4) + 4 + kappa % 4;
}
/// The k-slot whose code lands in product column n (the inverse of unpack_column).
DCPATTN_HOST_DEVICE constexpr int unpack_slot(int n) {
  return (n & 7) < 4 ? 4 * (n >> 3) + (n & 7) : 16 + 4 * (n >> 3) + (n & 7) - 4;
}
constexpr bool unpack_slot_inverts_column() {
  for (int n = 0; n < 32; ++n)
    if (unpack_slot(n) < 0 || unpack_slot(n) >= 32 || unpack_column(unpack_slot(n)) != n)
      return false;
  return true;
}
static_assert(unpack_slot_inverts_column(),
              "dcpattn: unpack_slot must invert unpack_column over the 32 k-slots");

/// Writes the permutation B of dequant_tile's unpacking products at perm_s (a K-major B operand
/// of 32 rows of 128 bytes, 128-byte swizzle, 4 KiB, Smem::perm), by 128 threads (thread `wtid`,
/// two 16-byte chunks each): row n holds e4m3 1.0 (0x38) at the k-slot kappa with
/// kappa = unpack_slot(n) and zero elsewhere, so that A B^T holds k-slot kappa of A in column
/// unpack_column(kappa), exactly (one product by 1.0, the others by 0). Written once at the
/// kernel's start; the tensor cores read it once a proxy fence and a CTA barrier follow.
DCPATTN_DEVICE void write_unpack_perm(unsigned char* perm_s, int wtid) {
  const int n = wtid >> 2, kappa = unpack_slot(n);
  const int hit = (kappa >> 4) ^ (n & 7);  // the stored chunk holding kappa
  const int word = (kappa & 15) >> 2;
  const std::uint32_t v = 0x38u << (8 * (kappa & 3));
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int sc = 2 * (wtid & 3) + k;
    const bool on = sc == hit;
    *reinterpret_cast<uint4*>(perm_s + n * 128 + sc * 16) =
        make_uint4(on && word == 0 ? v : 0u, on && word == 1 ? v : 0u, on && word == 2 ? v : 0u,
                   on && word == 3 ? v : 0u);
  }
}

/// Dequantizes a tile's raw entries into the swizzled K/V stage, shared by all 384 threads of the
/// CTA (thread `tid`): the 256 consumer threads convert the latent part, e4m3 code * group scale
/// rounded to bf16 (the arithmetic of mla_split_kernel), and the 128 producer threads copy the
/// RoPE part (bf16 already); a zero-filled entry (no token) gives a zero row.
///   - Latent part: consumer warpgroup q unpacks scale groups 2 q and 2 q + 1 (dims [256 q, 256 q
///     + 256)) of all 64 tokens on the tensor cores: the codes as loaded are the 8-bit A fragment
///     of wgmma m64n32k32 (warp w: tokens [16 w, 16 w + 16)) against the permutation
///     (write_unpack_perm), which gives each code as an fp32 value, exactly; then the fp32 product
///     with the group scale, rounded to bf16 (cvt_bf16x2), stored by stmatrix. Lane l (g = l / 4,
///     c = l % 4) reads 16 codes of tokens 16 w + g and + 8 at [128 grp + 32 c + 16 h, + 16) for
///     half h of the group (two k-steps of 8 codes each); a quarter warp's 16-byte loads fall on
///     eight distinct 16-byte bank groups (entries 656 = 5 x 128 + 16 bytes apart, quads 32 bytes
///     apart), as do the stores (eight tokens of one chunk). 3 instructions a pair of codes
///     against 6 for the hardware conversion e4m3x2 -> f16x2 -> f32 before the same product:
///     dense fp8 128 heads 1 x 32K 44.0-44.4 -> 41.9-42.3 us, 64 x 32K 1492-1495 -> 1459-1468,
///     sparse 128 x top-2048 232-234 -> 224-225 (docs/performance.md, run 32).
///   - RoPE part: items 0..511 (token, 8 values), token fastest, by the producer.
/// A NaN code makes the 32 values of its token's k-step NaN (a product by 0), where the
/// conversion made that one value NaN; either way every score of the token is NaN.
/// `kConsumer`: the consumers' part (tid < kConsumers) or the producer's, each compiled into its
/// own role's code (within that role's registers, setmaxnreg).
template <bool kConsumer>
DCPATTN_DEVICE void dequant_tile(const unsigned char* raw_s, unsigned char* k_s,
                                 const unsigned char* perm_s, int tid) {
  constexpr int kRopeItems = kTileTokens * (DsMlaFp8Entry::rope_dim / 8);  // 512
  static_assert(kRopeItems % kProducers == 0, "dcpattn: whole rounds of items");
  static_assert(
      kConsumers == 256 && DsMlaFp8Entry::num_groups == 4 && DsMlaFp8Entry::group_size == 128,
      "dcpattn: two consumer warpgroups of two scale groups each");
  if constexpr (kConsumer) {
    const int wg = tid >> 7, w = (tid >> 5) & 3, lane = tid & 31;
    const int g = lane >> 2, c = lane & 3;
    const unsigned char* e0 = raw_s + (16 * w + g) * kRawEntry;  // token 16 w + g
    const unsigned char* e1 = e0 + 8 * kRawEntry;                // token 16 w + g + 8
    const float2 sc0 = *reinterpret_cast<const float2*>(e0 + DsMlaFp8Entry::scales_offset + 8 * wg);
    const float2 sc1 = *reinterpret_cast<const float2*>(e1 + DsMlaFp8Entry::scales_offset + 8 * wg);
    // stmatrix: lane l gives row l % 8 of matrix l / 8, token 16 w + l % 8 + 8 ((l / 8) % 2), in
    // column block (l / 16) of the pair stored.
    const int stok = 16 * w + (lane & 7) + 8 * ((lane >> 3) & 1);
    const std::uint32_t kb = smem_u32(k_s) + std::uint32_t(stok * 128);
    const std::uint64_t desc = gmma_desc(smem_u32(perm_s), 16, 1024);
    // The warpgroup's 8 k-steps one product each, the next issued before a step is stored
    // (against products waited for two at a time: dense fp8 128 heads 1 x 32K 42.7-42.9 ->
    // 42.2-42.4 us, 64 x 32K 1520 -> 1460-1468; two products ahead: slower, docs/performance.md,
    // run 32).
    std::uint32_t a[8][4];
    float d[2][16];
    auto load_half = [&](int h) {  // k-steps 2 h, 2 h + 1: half h % 2 of scale group 2 wg + h / 2
      const int off = (2 * wg + (h >> 1)) * DsMlaFp8Entry::group_size + 32 * c + 16 * (h & 1);
      const uint4 x0 = *reinterpret_cast<const uint4*>(e0 + off);
      const uint4 x1 = *reinterpret_cast<const uint4*>(e1 + off);
      a[2 * h][0] = x0.x, a[2 * h][1] = x1.x, a[2 * h][2] = x0.y, a[2 * h][3] = x1.y;
      a[2 * h + 1][0] = x0.z, a[2 * h + 1][1] = x1.z, a[2 * h + 1][2] = x0.w,
                a[2 * h + 1][3] = x1.w;
    };
    auto issue = [&](int step) {
      if (step % 2 == 0) load_half(step / 2);
      wgmma_fence();
      wgmma_m64n32k32_e4m3_rs_set(d[step & 1], a[step], desc);
      wgmma_commit();
    };
    issue(0);
#pragma unroll
    for (int step = 0; step < 8; ++step) {
      if (step + 1 < 8) {
        issue(step + 1);
        wgmma_wait<1>();  // step's product is done, step + 1's in flight
      } else {
        wgmma_wait<0>();
      }
      const float(&dq)[16] = d[step & 1];
      const int grp = 2 * wg + (step >> 2), u = step & 3;
      const float s0 = (step >> 2) ? sc0.y : sc0.x, s1 = (step >> 2) ? sc1.y : sc1.x;
#pragma unroll
      for (int jp = 0; jp < 4; jp += 2) {
        const std::uint32_t r[4] = {cvt_bf16x2(dq[4 * jp] * s0, dq[4 * jp + 1] * s0),
                                    cvt_bf16x2(dq[4 * jp + 2] * s1, dq[4 * jp + 3] * s1),
                                    cvt_bf16x2(dq[4 * jp + 4] * s0, dq[4 * jp + 5] * s0),
                                    cvt_bf16x2(dq[4 * jp + 6] * s1, dq[4 * jp + 7] * s1)};
        const int chunk = 16 * grp + 4 * (jp + (lane >> 4)) + u;
        stsm_x4<false>(
            kb + std::uint32_t((chunk >> 3) * kBlock + (((chunk & 7) ^ (stok & 7)) << 4)), r);
      }
    }
  } else {
    (void)perm_s;
#pragma unroll
    for (int item = tid - kConsumers; item < kRopeItems; item += kProducers) {
      const int tok = item & (kTileTokens - 1);
      const int c = item >> 6;  // RoPE values [8 c, 8 c + 8)
      *reinterpret_cast<uint4*>(k_s + tile_offset(tok, 64 + c)) = *reinterpret_cast<const uint4*>(
          raw_s + tok * kRawEntry + DsMlaFp8Entry::rope_offset + c * 16);
    }
  }
}

/// Warpgroup 0 of the narrow bf16 kernel, head h, once the 4 warps' column maxima are in xcol: the
/// running maximum m, the factor al of the previous state, the weights p0, p1 of the thread's two
/// tokens and its share l of the row sum. Branch-free as in the wide kernel: while nothing is
/// valid the maximum used is 0, so no -inf - -inf arises.
DCPATTN_DEVICE void narrow_softmax(const float* xcol, int h, float s0, float s1, float& m,
                                   float& l, float& al, float& p0, float& p1) {
  constexpr float kNegInf = -cuda::std::numeric_limits<float>::infinity();
  const float mn =
      fmaxf(m, fmaxf(fmaxf(xcol[h], xcol[kNarrowHeads + h]),
                     fmaxf(xcol[2 * kNarrowHeads + h], xcol[3 * kNarrowHeads + h])));
  const float mu = mn == kNegInf ? 0.0f : mn;
  al = expf(m - mu);
  p0 = expf(s0 - mu);
  p1 = expf(s1 - mu);
  l = l * al + (p0 + p1);
  m = mn;
}

/// Warpgroup 0 of the narrow kernels at the end of a split: each head's row sum over the lanes of
/// a column (xor 4, 8, 16), then over the 4 warps in order, to lsum_s[head] (xcol reused). Lane l
/// holds heads 8 (q / 2) + 2 (l mod 4) + (q mod 2), q = 0..3.
DCPATTN_DEVICE void narrow_row_sums(float (&l)[4], float* xcol, float* lsum_s, int wq, int lane,
                                    int bar_id = 3) {
  const int hc = 2 * (lane & 3);
  auto head_of = [&](int q) { return 8 * (q >> 1) + hc + (q & 1); };
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    l[q] += __shfl_xor_sync(kFullMask, l[q], 4);
    l[q] += __shfl_xor_sync(kFullMask, l[q], 8);
    l[q] += __shfl_xor_sync(kFullMask, l[q], 16);
  }
  if (lane < 4) {
#pragma unroll
    for (int q = 0; q < 4; ++q) xcol[wq * kNarrowHeads + head_of(q)] = l[q];
  }
  named_barrier(bar_id, 128);
  if (wq == 0 && lane < 4) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int h = head_of(q);
      lsum_s[h] = (xcol[h] + xcol[kNarrowHeads + h]) +
                  (xcol[2 * kNarrowHeads + h] + xcol[3 * kNarrowHeads + h]);
    }
  }
}

/// The consumers of mla_wg_kernel at H <= 16 (kNarrowHeads heads per CTA): the transposed
/// products, with the tile's 64 tokens as the wgmma M and the heads as N, so that no padded head
/// row is computed (at 16 heads the wide kernel computes 64 head rows, four times the work).
///   - S^T = K Q^T: warpgroup 0 alone, wgmma m64n16k16, K (the A operand) and Q (B) both K-major
///     as stored, 36 k-steps in order. (When both warpgroups computed it, the tile was read from
///     shared memory twice, and those reads bound the products.)
///   - online softmax per head (a column of S^T), warpgroup 0: each thread holds 2 tokens x 4
///     heads; the column maximum is reduced over the lanes of a column (xor 4, 8, 16) and over
///     the 4 warps through shared memory (warp 0's first); the row sum l stays a per-thread
///     partial sum (each thread's own tokens, rescaled like o) and is reduced once at the end in
///     a fixed order. P^T (bf16) and each head's rescale factor go to shared memory, in one of
///     two buffers by tile parity, handed to warpgroup 1 by mbarriers: pt_full[b] (warpgroup 0
///     wrote buffer b) and pt_empty[b] (warpgroup 1's products have read it). The end of the
///     split is handed over the same way, with the row sums. (Not bar.sync: warpgroup 0 also
///     passes its own barrier for the column maxima, and compute-sanitizer racecheck orders two
///     warpgroups across a bar.sync only when both have passed the same number of barriers;
///     see the fp8 hand-over, cta_handover.)
///   - O^T = V^T P^T: warpgroup g owns value dims [256 g, 256 g + 256), 4 wgmma m64n16k16 blocks
///     of 64 dims, V^T read in place from the K/V tile as an MN-major A operand.
/// The same fixed shapes and orders for every tile, so the DCP invariance argument holds.
template <class Args>
DCPATTN_DEVICE void narrow_consumers(const Args& a, unsigned char* smem, std::int64_t t, int j) {
  using L = Smem<false, kNarrowHeads>;
  constexpr float kNegInf = -cuda::std::numeric_limits<float>::infinity();
  constexpr int kQBlock = kNarrowHeads * 128;  // one 64-dim column block of the query, or P^T
  const int tid = int(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = warp >> 2;  // warpgroup: value dims [256 g, +256) of O^T
  const int wq = warp & 3;  // warp in the warpgroup: tokens [16 wq, +16) of S^T
  const int r0 = 16 * wq + (lane >> 2), r1 = r0 + 8;  // this thread's rows (tokens, or dims)
  const int hc = 2 * (lane & 3);  // this thread's heads: 8 jn + hc + e, index q = 2 jn + e
  const int* slot_s = reinterpret_cast<const int*>(smem + L::slot);
  const int* count_s = reinterpret_cast<const int*>(smem + L::count);
  // 128 floats: the column maxima of warpgroup 0's 4 warps [4][16], then the rescale factors by
  // tile parity [2][16], then the row sums [16].
  float* xcol = reinterpret_cast<float*>(smem + L::xrow);
  float* alpha_s = xcol + 4 * kNarrowHeads;
  float* lsum_s = alpha_s + 2 * kNarrowHeads;
  std::uint64_t* full = reinterpret_cast<std::uint64_t*>(smem + L::bar);
  std::uint64_t* empty = full + 4;
  std::uint64_t* pt_full = full + 8;
  std::uint64_t* pt_empty = full + 10;
  const std::uint32_t qa = smem_u32(smem + L::q);
  auto head_of = [&](int q) { return 8 * (q >> 1) + hc + (q & 1); };
  auto elem_of = [](int q) { return 4 * (q >> 1) + (q & 1); };  // s[e]: token r0, s[e + 2]: r1

  float m[4], l[4];  // warpgroup 0, per head q: running maximum (shared by the column), own sum
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    m[q] = kNegInf;
    l[q] = 0.0f;
  }
  float o[4][8];  // O^T block mb: dims 256 g + 64 mb + r0 (+8), heads as in s
#pragma unroll
  for (int mb = 0; mb < 4; ++mb)
#pragma unroll
    for (int e = 0; e < 8; ++e) o[mb][e] = 0.0f;

  int n_done = 0;  // tiles computed
  for (int i = 0;; ++i) {
    const int st = i & 1;
    mbar_wait(&full[st], (i >> 1) & 1);
    fence_proxy_async();  // the tile's copies, landed, for the tensor cores
    const int n_tile = count_s[i % kSlotBufs];
    if (n_tile == 0) break;
    const int* slots = slot_s + (i % kSlotBufs) * kTileTokens;
    const std::uint32_t k_s = smem_u32(smem + L::k + std::size_t(st) * kTile);
    unsigned char* pt_s = smem + L::p + (i & 1) * kQBlock;  // P^T: 16 heads x 64 tokens
    float* alpha = alpha_s + (i & 1) * kNarrowHeads;

    float al[4];
    if (g == 0) {
      if (i >= 2) mbar_wait(&pt_empty[i & 1], ((i - 2) >> 1) & 1);  // buffer i & 1 is free
      // --- S^T = K Q^T: s[4 jn + e] = (token r0, head 8 jn + hc + e), s[4 jn + 2 + e]: r1.
      float s[8];
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kMlaQkDim / 16; ++ks) {
        const std::uint32_t in = std::uint32_t((ks & 3) * 32);
        wgmma_m64n16<0>(s, gmma_desc(k_s + std::uint32_t((ks >> 2) * kBlock) + in, 16, 1024),
                        gmma_desc(qa + std::uint32_t((ks >> 2) * kQBlock) + in, 16, 1024), ks > 0);
      }
      wgmma_commit();
      wgmma_wait_all();

      // --- Online softmax per head.
      const bool v0 = slots[r0] >= 0, v1 = slots[r1] >= 0;
      float mx[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int e = elem_of(q);
        s[e] = v0 ? a.softmax_scale * s[e] : kNegInf;
        s[e + 2] = v1 ? a.softmax_scale * s[e + 2] : kNegInf;
        mx[q] = fmaxf(s[e], s[e + 2]);
        mx[q] = fmaxf(mx[q], __shfl_xor_sync(kFullMask, mx[q], 4));
        mx[q] = fmaxf(mx[q], __shfl_xor_sync(kFullMask, mx[q], 8));
        mx[q] = fmaxf(mx[q], __shfl_xor_sync(kFullMask, mx[q], 16));
      }
      if (lane < 4) {
#pragma unroll
        for (int q = 0; q < 4; ++q) xcol[wq * kNarrowHeads + head_of(q)] = mx[q];
      }
      named_barrier(3, 128);  // warpgroup 0
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int h = head_of(q);
        const int e = elem_of(q);
        float p0, p1;
        narrow_softmax(xcol, h, s[e], s[e + 2], m[q], l[q], al[q], p0, p1);
        // P^T row h, token r: chunk (r / 8) ^ (h mod 8) of the 128-byte row, element r mod 8.
        unsigned char* row = pt_s + h * 128 + (r0 & 7) * 2;
        *reinterpret_cast<std::uint16_t*>(row + (((r0 >> 3) ^ (h & 7)) << 4)) =
            bfloat16::from_float(p0).bits;
        *reinterpret_cast<std::uint16_t*>(row + (((r1 >> 3) ^ (h & 7)) << 4)) =
            bfloat16::from_float(p1).bits;
        if (wq == 0 && lane < 4) alpha[h] = al[q];
      }
      fence_proxy_async();
      mbar_arrive(&pt_full[i & 1]);  // P^T and the rescale factors of tile i are complete
      // Warpgroup 0's next xcol writes follow its products below; every warp of it has read
      // xcol by then (its products wait for pt_full, which all 128 threads arrive on).
      mbar_wait(&pt_full[i & 1], (i >> 1) & 1);
    } else {
      mbar_wait(&pt_full[i & 1], (i >> 1) & 1);
#pragma unroll
      for (int q = 0; q < 4; ++q) al[q] = alpha[head_of(q)];
    }
#pragma unroll
    for (int mb = 0; mb < 4; ++mb) {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        o[mb][elem_of(q)] *= al[q];
        o[mb][elem_of(q) + 2] *= al[q];
      }
    }
    // The rescaling completes before the products: otherwise the compiler may sink it between
    // the wgmma of different blocks, and ptxas then serializes them (warpgroup.arrive).
#pragma unroll
    for (int mb = 0; mb < 4; ++mb) fence_registers(o[mb]);

    // --- O^T = alpha O^T + V^T P^T for value dims [256 g, 256 g + 256).
    const std::uint32_t pa = smem_u32(pt_s);
    wgmma_fence();
#pragma unroll
    for (int mb = 0; mb < 4; ++mb) {
      const std::uint32_t va = k_s + std::uint32_t((4 * g + mb) * kBlock);
#pragma unroll
      for (int kk = 0; kk < kTileTokens / 16; ++kk)
        wgmma_m64n16<1>(o[mb], gmma_desc(va + kk * 2048, kBlock, 1024),
                        gmma_desc(pa + kk * 32, 16, 1024), 1);
    }
    wgmma_commit();
    wgmma_wait_all();
    mbar_arrive(&empty[st]);  // this warpgroup's reads of the stage are done
    if (g == 1) mbar_arrive(&pt_empty[i & 1]);
    n_done = i + 1;
  }

  // --- The state: l summed over a column's lanes (xor 4, 8, 16) then its warps in order, by
  // warpgroup 0, handed over as tile n_done; o = acc / l, lse = m + log(l); l == 0 (no token)
  // is the neutral state.
  const int b_end = n_done & 1;
  if (g == 0) {
    if (n_done >= 2) mbar_wait(&pt_empty[b_end], ((n_done - 2) >> 1) & 1);
    narrow_row_sums(l, xcol, lsum_s, wq, lane);
    mbar_arrive(&pt_full[b_end]);
  }
  mbar_wait(&pt_full[b_end], (n_done >> 1) & 1);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int h = head_of(q);  // one head block: h0 = 0
    if (h >= a.heads) continue;
    const float lq = lsum_s[h];
    const bool empty_state = lq == 0.0f;
    const StateRow out = state_row(a, j, t, h);
    const float inv = empty_state ? 0.0f : 1.0f / lq;
    const int e = elem_of(q);
#pragma unroll
    for (int mb = 0; mb < 4; ++mb) {
      const int d = 256 * g + 64 * mb + r0;
      out.put(d, empty_state ? 0.0f : o[mb][e] * inv);
      out.put(d + 8, empty_state ? 0.0f : o[mb][e + 2] * inv);
    }
    if (g == 0 && wq == 0 && lane < 4) {
      const float lse = empty_state ? kNegInf : m[q] + logf(lq);
      out.put_lse(lse);
    }
  }
}

/// The consumers of the narrow kernel for the fp8 cache (H <= 16): the products of
/// narrow_consumers, with the tensor cores reading the e4m3 codes themselves as the register A
/// operand of wgmma, and the group scales applied outside the products. No bf16 copy of the tile
/// is made, and nothing runs between the tiles: the raw stages are handed over like the bf16
/// pipeline's stages (full / empty by stage).
///   - Scores: S^T = K Q^T per scale group g (latent dims [128 g, 128 g + 128)) on the fp8 tensor
///     cores, the codes as loaded (wgmma_m64n32k32_e4m3_rs) against the query scaled by 2^tau_h
///     as two e4m3 parts, hi in columns [0, 16) and lo in [16, 32) (load_q_fp8); plus the RoPE
///     dims in bf16 as stored; then s = 2^-tau_h (sum over g of scale[token][g] * (S_g,hi +
///     S_g,lo), in a fixed order) + S_rope. The keys are the exact e4m3 values times their
///     scales in fp32, not rounded to bf16. (Until run 30 the codes were converted to f16 in
///     registers, one instruction per two, for f16 products against an f16 query:
///     docs/performance.md.)
///   - Values: O^T = V^T P_g^T per scale group, with the group scale folded into the weights:
///     P_g[token][h] = f16(p * scale[token][g] * 2^(127 - sigma_g)), sigma_g the largest scale
///     exponent of group g so far (at most 2 before rounding, so within f16's range; a weight
///     below 2^-14 of it rounds to an f16 subnormal). When sigma_g grows, O^T's rows of group g
///     are rescaled by 2^(old - new), with the softmax's alpha; the state is O^T 2^(sigma_g - 127).
///   - Roles: warpgroups 0 and 1 compute the scores, the online softmax and P_g^T of the tiles of
///     their parity (tile i: warpgroup i mod 2, P_g^T buffer i mod 2), warpgroup 2 computes O^T
///     for every tile in order. The scores of two tiles are thus in progress at once, and the
///     one step that must follow the tile order, the running maxima and scale exponents, is
///     passed from tile i - 1 to tile i through shared memory (chain_full[i mod 2]): m_i = the
///     tile's column maximum where it exceeds m_{i-1} by more than kMaxLag, else m_{i-1}
///     (lazy rescaling; sigma_i likewise with kExpLag), so that O^T is rescaled only in the tiles
///     that move one of them (rescale_s). Each score warpgroup keeps its own per-thread row
///     sums, rescaled to the maxima it last used; at the end both are rescaled to the final
///     maxima, reduced, and added in warpgroup order. Which warpgroup
///     computes a tile depends on the tile's index within the split only, so the state is a
///     fixed function of the split's tokens, as DCP invariance requires.
///   - Score warpgroup thread (warp w, lane 4 g + c) loads tokens 16 w + g and 16 w + g + 8:
///     per 32-dim k-step two 32-bit loads of 4 codes of each token (dims [4 c, 4 c + 4) and
///     [16 + 4 c, 20 + 4 c) of the step, the fragment's columns as they are). One accumulator
///     per group (4 k-steps each) and one for the RoPE dims (bf16, 16-dim k-steps, the columns
///     kperm_column gives the query), so no chain of dependent products is longer than 4.
///   - Warpgroup 2: O^T for all 512 value dims, 8 blocks of 64 rows, block mb within group
///     mb / 2: row r of block 2 G + b is latent dim 128 G + 4 (8 w + g) + 2 b + (r >= 8), so
///     thread (w, g, c) reads 4 consecutive codes of each group per token with one 32-bit load;
///     its tokens are the fragment's columns as they are (16 kk + 2 c + {0, 1, 8, 9}), and a byte
///     permute pairs the two tokens of each register.
/// The narrow fp8 kernel's lazy rescaling (narrow_fp8_consumers): a running maximum moves only
/// when a tile's exceeds it by more than kMaxLag, a group's scale exponent only when a tile's
/// exceeds it by more than kExpLag. A weight p scale 2^(127 - sigma) then stays below
/// e^8 2^3 < 2^15, within f16's range.
inline constexpr float kMaxLag = 8.0f;
inline constexpr int kExpLag = 2;

template <bool kSparse, class Args>
DCPATTN_DEVICE void narrow_fp8_consumers(const Args& a, unsigned char* smem, std::int64_t t,
                                         int j) {
  using L = Smem<true, kNarrowHeads>;
  constexpr int R = L::raw_stages;
  constexpr int SB = L::slot_bufs;
  constexpr float kNegInf = -cuda::std::numeric_limits<float>::infinity();
  constexpr int kQBlock = kNarrowHeads * 128;  // one 64-dim column block of the query, or P^T
  constexpr int kScales = DsMlaFp8Entry::scales_offset;
  constexpr int kRope = DsMlaFp8Entry::rope_offset;
  constexpr int kGroups = DsMlaFp8Entry::num_groups;            // 4
  constexpr int kGroupSteps = DsMlaFp8Entry::group_size / 32;   // 4 fp8 k-steps per group
  constexpr int kRopeSteps = DsMlaFp8Entry::rope_dim / 16;      // 4
  const int tid = int(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int role = warp >> 2;  // 0, 1: scores and softmax of the tiles of that parity; 2: O^T
  const int wq = warp & 3;
  const int gq = lane >> 2, c = lane & 3;
  const int hc = 2 * c;  // this thread's heads: 8 jn + hc + e, index q = 2 jn + e
  const int* slot_s = reinterpret_cast<const int*>(smem + L::slot);
  const int* count_s = reinterpret_cast<const int*>(smem + L::count);
  // xrow: 64 floats unused here, then the softmax's rescale factors by tile parity [2][16], then
  // by tile parity whether O^T is rescaled at all [2].
  float* alpha_s = reinterpret_cast<float*>(smem + L::xrow) + 4 * kNarrowHeads;
  int* rescale_s = reinterpret_cast<int*>(smem + L::xrow) + 6 * kNarrowHeads;
  // fold, 448 words: qinv[16] (load_q_fp8); 32 words unused; by tile parity the groups' rescale
  // factors [2][4], and the chained state: the largest scale exponents [2][4] and the running
  // maxima [2][16]; by score warpgroup the row sums [2][16]; by score warpgroup and the parity of
  // its tile count (i / 2) the warps' column maxima [2][2][4][16] and scale exponents [2][2][4][4].
  float* fold = reinterpret_cast<float*>(smem + L::fold);
  const float* qinv_s = fold;
  float* resc_s = fold + 48;
  int* csig_s = reinterpret_cast<int*>(fold + 56);
  float* cm_s = fold + 64;
  float* lsum_all = fold + 96;
  float* xcol_all = fold + 128;
  int* sexp_all = reinterpret_cast<int*>(fold + 384);
  std::uint64_t* full = reinterpret_cast<std::uint64_t*>(smem + L::bar);
  std::uint64_t* empty = full + 4;
  std::uint64_t* pt_full = full + 8;
  std::uint64_t* pt_empty = full + 10;
  std::uint64_t* q_full = full + 12;
  std::uint64_t* chain_full = full + 13;
  std::uint64_t* end_full = full + 15;
  const std::uint32_t qa = smem_u32(smem + L::q);
  auto head_of = [&](int q) { return 8 * (q >> 1) + hc + (q & 1); };
  auto elem_of = [](int q) { return 4 * (q >> 1) + (q & 1); };  // acc[e]: row r0, acc[e + 2]: r1
  // P_g^T of tile parity b: 16 heads x 64 tokens.
  auto pt_block = [&](int b, int grp) { return smem + L::p + (b * kGroups + grp) * kQBlock; };
  // Descriptors of the query block and of the P_g^T blocks: a column offset is added to the
  // start address field (bits 0..13, address / 16), computed once.
  // The start address field cannot carry: shared addresses are below 256 KiB.
  const std::uint64_t q_desc = gmma_desc(qa, 16, 1024);
  const std::uint64_t p_desc = gmma_desc(smem_u32(smem + L::p), 16, 1024);
  auto desc_plus = [](std::uint64_t d, int bytes) {
    return (d & 0xFFFFFFFF00000000ull) |
           std::uint32_t(std::uint32_t(d) + std::uint32_t(bytes >> 4));
  };
  auto rope_desc_at = [&](int u) { return desc_plus(q_desc, kQ8Rope + 32 * u); };

  int n_done = 0;  // tiles of the split
  if (role < 2) {
    // =========================== scores: tiles role, role + 2, ... ===========================
#if defined(DCPATTN_MLA_WGMMA)
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegAScoreRegs));
#endif
    const int r0 = 16 * wq + gq, r1 = r0 + 8;  // this thread's tokens
    // The warps' column maxima and scale exponents of this warpgroup's tile i, by (i / 2) mod 2:
    // a warp writes those of tile i + 4 only after the named barrier of tile i + 2, which every
    // warp passes only once done reading those of tile i.
    float* xcol = xcol_all + role * 8 * kNarrowHeads;
    int* sexp_s = sexp_all + role * 8 * kGroups;
    const int bar_id = 3 + role;  // this warpgroup's named barrier
    // The query block (one head block: h0 = 0), built by both score warpgroups while the first
    // tiles are copied, fenced for the tensor cores and published.
    load_q_fp8<256>(a.q, t, 0, a.heads, smem + L::q, fold, tid);
    fence_proxy_async();
    mbar_arrive(q_full);
    float mo[4], l[4];  // per head q: the maximum this warpgroup last used, its own row sum
    float qv[4];        // 2^-tau of its heads
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      mo[q] = kNegInf;
      l[q] = 0.0f;
      qv[q] = 0.0f;
    }
    for (int i = role;; i += 2) {
      const int st = i % R;
      mbar_wait(&full[st], (i / R) & 1);
      if (count_s[i % SB] == 0) {
        // The end is marked twice, at tiles n and n + 1: once for each score warpgroup.
        n_done = (i > 0 && count_s[(i - 1) % SB] == 0) ? i - 1 : i;
        break;
      }
      const unsigned char* raw = smem + L::raw + std::size_t(st) * L::raw_bytes;
      if (i == role) {
        mbar_wait(q_full, 0);
#pragma unroll
        for (int q = 0; q < 4; ++q) qv[q] = qinv_s[head_of(q)];
      }
      // --- S^T per group on the fp8 tensor cores: acc[grp][4 jn + e] = (token r0, column 8 jn +
      // hc + e), [+ 2]: r1; column h < 16 is head h against the query's hi part, 16 + h against
      // its lo part (load_q_fp8).
      const unsigned char* e0 = raw + r0 * kRawEntry;
      const unsigned char* e1 = raw + r1 * kRawEntry;
      const float4 sc0v = *reinterpret_cast<const float4*>(e0 + kScales);
      const float4 sc1v = *reinterpret_cast<const float4*>(e1 + kScales);
      const float sc0[4] = {sc0v.x, sc0v.y, sc0v.z, sc0v.w};
      const float sc1[4] = {sc1v.x, sc1v.y, sc1v.z, sc1v.w};
      float acc[kGroups][16], accr[8];
#pragma unroll
      for (int grp = 0; grp < kGroups; ++grp) {
        if (grp >= 2) wgmma_wait<1>();  // group grp - 2 has read its registers
        std::uint32_t ak[kGroupSteps][4];
#pragma unroll
        for (int u = 0; u < kGroupSteps; ++u) {
          const int off = DsMlaFp8Entry::group_size * grp + 32 * u + 4 * c;
          ak[u][0] = *reinterpret_cast<const std::uint32_t*>(e0 + off);
          ak[u][1] = *reinterpret_cast<const std::uint32_t*>(e1 + off);
          ak[u][2] = *reinterpret_cast<const std::uint32_t*>(e0 + off + 16);
          ak[u][3] = *reinterpret_cast<const std::uint32_t*>(e1 + off + 16);
        }
        wgmma_fence();
#pragma unroll
        for (int u = 0; u < kGroupSteps; ++u)
          wgmma_m64n32k32_e4m3_rs(acc[grp], ak[u], desc_plus(q_desc, grp * kQ8Block + 32 * u),
                                  u > 0);
        wgmma_commit();
      }
      {
        std::uint32_t ar[kRopeSteps][4];
#pragma unroll
        for (int u = 0; u < kRopeSteps; ++u) {
          const uint2 x0 = *reinterpret_cast<const uint2*>(e0 + kRope + 32 * u + 8 * c);
          const uint2 x1 = *reinterpret_cast<const uint2*>(e1 + kRope + 32 * u + 8 * c);
          ar[u][0] = x0.x;
          ar[u][1] = x1.x;
          ar[u][2] = x0.y;
          ar[u][3] = x1.y;
        }
        mbar_arrive(&empty[st]);  // this thread's reads of the stage are done
        wgmma_fence();
#pragma unroll
        for (int u = 0; u < kRopeSteps; ++u) {
          wgmma_m64n16_rs<false>(accr, ar[u], rope_desc_at(u), u > 0);
        }
        wgmma_commit();
      }
      wgmma_wait<0>();

      // --- The scores, and the tile's column maxima and largest scale exponents.
      const int* slots = slot_s + (i % SB) * kTileTokens;
      const bool v0 = slots[r0] >= 0, v1 = slots[r1] >= 0;
      float s[8];
      float mx[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int e = elem_of(q);
        float g0[kGroups], g1[kGroups];  // hi + lo per group
#pragma unroll
        for (int grp = 0; grp < kGroups; ++grp) {
          g0[grp] = acc[grp][e] + acc[grp][8 + e];
          g1[grp] = acc[grp][e + 2] + acc[grp][8 + e + 2];
        }
        const float n0 = (g0[0] * sc0[0] + g0[1] * sc0[1]) + (g0[2] * sc0[2] + g0[3] * sc0[3]);
        const float n1 = (g1[0] * sc1[0] + g1[1] * sc1[1]) + (g1[2] * sc1[2] + g1[3] * sc1[3]);
        s[e] = v0 ? a.softmax_scale * (n0 * qv[q] + accr[e]) : kNegInf;
        s[e + 2] = v1 ? a.softmax_scale * (n1 * qv[q] + accr[e + 2]) : kNegInf;
        mx[q] = fmaxf(s[e], s[e + 2]);
        mx[q] = fmaxf(mx[q], __shfl_xor_sync(kFullMask, mx[q], 4));
        mx[q] = fmaxf(mx[q], __shfl_xor_sync(kFullMask, mx[q], 8));
        mx[q] = fmaxf(mx[q], __shfl_xor_sync(kFullMask, mx[q], 16));
      }
      // The largest scale exponent per group over the tile's tokens (zero-filled entries: 0).
      int ex[kGroups];
#pragma unroll
      for (int grp = 0; grp < kGroups; ++grp) {
        ex[grp] =
            max((__float_as_int(sc0[grp]) >> 23) & 0xFF, (__float_as_int(sc1[grp]) >> 23) & 0xFF);
        ex[grp] = max(ex[grp], __shfl_xor_sync(kFullMask, ex[grp], 4));
        ex[grp] = max(ex[grp], __shfl_xor_sync(kFullMask, ex[grp], 8));
        ex[grp] = max(ex[grp], __shfl_xor_sync(kFullMask, ex[grp], 16));
      }
      float* xc = xcol + ((i >> 1) & 1) * 4 * kNarrowHeads;
      int* sx = sexp_s + ((i >> 1) & 1) * 4 * kGroups;
      if (lane < 4) {
#pragma unroll
        for (int q = 0; q < 4; ++q) xc[wq * kNarrowHeads + head_of(q)] = mx[q];
      }
      if (lane == 0) {
#pragma unroll
        for (int grp = 0; grp < kGroups; ++grp) sx[wq * kGroups + grp] = ex[grp];
      }
      named_barrier(bar_id, 128);

      // --- The chained state: after tile i - 1 (mp, sp; the other warpgroup's), after tile i
      // (mn, sn), published for tile i + 1 at once.
      float mp[4], mn[4];
      int sp[kGroups], sn[kGroups];
      if (i > 0) {
        const int b = (i - 1) & 1;
        mbar_wait(&chain_full[b], ((i - 1) >> 1) & 1);
#pragma unroll
        for (int q = 0; q < 4; ++q) mp[q] = cm_s[b * kNarrowHeads + head_of(q)];
#pragma unroll
        for (int grp = 0; grp < kGroups; ++grp) sp[grp] = csig_s[b * kGroups + grp];
      } else {
#pragma unroll
        for (int q = 0; q < 4; ++q) mp[q] = kNegInf;
#pragma unroll
        for (int grp = 0; grp < kGroups; ++grp) sp[grp] = 0;
      }
      // The maxima and scale exponents move only when the tile's exceed them by more than
      // kMaxLag and kExpLag (lazy rescaling): the weights stay below e^kMaxLag 2^(1 + kExpLag),
      // within f16's range, and most tiles leave O^T as it is.
      bool moved = false;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int h = head_of(q);
        const float tm = fmaxf(fmaxf(xc[h], xc[kNarrowHeads + h]),
                               fmaxf(xc[2 * kNarrowHeads + h], xc[3 * kNarrowHeads + h]));
        mn[q] = tm > mp[q] + kMaxLag ? tm : mp[q];  // mp = -inf: the tile's maximum
        moved = moved || mn[q] != mp[q];
      }
#pragma unroll
      for (int grp = 0; grp < kGroups; ++grp) {
        int tx = 0;
#pragma unroll
        for (int w = 0; w < 4; ++w) tx = max(tx, sx[w * kGroups + grp]);
        sn[grp] = tx > sp[grp] + kExpLag ? tx : sp[grp];
        sn[grp] = min(sn[grp], 253);  // inf / NaN scales: their weights are not finite either way
        moved = moved || sn[grp] != sp[grp];
      }
      moved = __any_sync(kFullMask, moved);
      if (wq == 0 && lane < 4) {
#pragma unroll
        for (int q = 0; q < 4; ++q) cm_s[(i & 1) * kNarrowHeads + head_of(q)] = mn[q];
      }
      if (wq == 0 && lane == 0) {
#pragma unroll
        for (int grp = 0; grp < kGroups; ++grp) csig_s[(i & 1) * kGroups + grp] = sn[grp];
      }
      mbar_arrive(&chain_full[i & 1]);

      // --- The weights P_g = p * scale * 2^(127 - sigma_g) and the rescale factors of tile i.
      if (i >= 2) mbar_wait(&pt_empty[i & 1], ((i - 2) >> 1) & 1);  // buffers i & 1 are free
      float* alpha = alpha_s + (i & 1) * kNarrowHeads;
      float f0[kGroups], f1[kGroups];
#pragma unroll
      for (int grp = 0; grp < kGroups; ++grp) {
        const float up = __int_as_float((254 - sn[grp]) << 23);  // 2^(127 - sn)
        f0[grp] = sc0[grp] * up;
        f1[grp] = sc1[grp] * up;
        if (wq == 0 && lane == 0) {
          const int d = sp[grp] - sn[grp];  // <= 0
          resc_s[(i & 1) * kGroups + grp] = d >= -126 ? pow2i(d) : 0.0f;
        }
      }
      float p0[4], p1[4];  // head q's weights of tokens r0, r1
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int h = head_of(q);
        const int e = elem_of(q);
        const float mu = mn[q] == kNegInf ? 0.0f : mn[q];
        p0[q] = ::dcpattn::detail::fast_exp(s[e] - mu);
        p1[q] = ::dcpattn::detail::fast_exp(s[e + 2] - mu);
        l[q] = l[q] * ::dcpattn::detail::fast_exp(mo[q] - mu) + (p0[q] + p1[q]);
        mo[q] = mn[q];
        if (wq == 0 && lane < 4) alpha[h] = ::dcpattn::detail::fast_exp(mp[q] - mu);
      }
      if (wq == 0 && lane == 0) rescale_s[i & 1] = moved ? 1 : 0;
      // P_g^T: row h holds token r in chunk (r / 8) ^ (h mod 8) of its 128 bytes, element r mod
      // 8. One transposing matrix store per group: this thread's weights (tokens r0, r1; heads
      // 2c, 2c + 1 and 8 + 2c, 9 + 2c) are its fragment of the matrices {tokens 16 wq + [0, 8),
      // heads [0, 8)}, {16 wq + [8, 16), [0, 8)}, {16 wq + [0, 8), [8, 16)} and {16 wq + [8, 16),
      // [8, 16)}; lane 8 m + j addresses row (head) 8 (m / 2) + j of matrix m.
      const int sm = lane >> 3, sj = lane & 7;
      const std::uint32_t st_row =
          std::uint32_t((8 * (sm >> 1) + sj) * 128 + (((2 * wq + (sm & 1)) ^ sj) << 4));
      const auto half2_bits = [](float x, float y) {
        const __half2 v = __floats2half2_rn(x, y);  // x in the low half
        return *reinterpret_cast<const std::uint32_t*>(&v);
      };
#pragma unroll
      for (int grp = 0; grp < kGroups; ++grp) {
        const std::uint32_t r[4] = {half2_bits(p0[0] * f0[grp], p0[1] * f0[grp]),
                                    half2_bits(p1[0] * f1[grp], p1[1] * f1[grp]),
                                    half2_bits(p0[2] * f0[grp], p0[3] * f0[grp]),
                                    half2_bits(p1[2] * f1[grp], p1[3] * f1[grp])};
        stsm_x4<true>(smem_u32(pt_block(i & 1, grp)) + st_row, r);
      }
      fence_proxy_async();
      // P_g^T and the rescale factors of tile i are complete. No warp arrives for tile i + 2
      // before all have arrived for tile i: each passes tile i + 2's named barrier first.
      mbar_arrive(&pt_full[i & 1]);
    }

    // --- End of the split: the row sums rescaled to the final maxima, reduced over this
    // warpgroup, then added in warpgroup order; lse = m + log(l) by warpgroup 0.
    float mf[4];
    if (n_done > 0) {
      const int b = (n_done - 1) & 1;
      mbar_wait(&chain_full[b], ((n_done - 1) >> 1) & 1);
#pragma unroll
      for (int q = 0; q < 4; ++q) mf[q] = cm_s[b * kNarrowHeads + head_of(q)];
    } else {
#pragma unroll
      for (int q = 0; q < 4; ++q) mf[q] = kNegInf;
    }
#pragma unroll
    for (int q = 0; q < 4; ++q)
      l[q] *= ::dcpattn::detail::fast_exp(mo[q] - (mf[q] == kNegInf ? 0.0f : mf[q]));
    named_barrier(bar_id, 128);  // every warp is done reading the column maxima (xcol reused)
    narrow_row_sums(l, xcol, lsum_all + role * kNarrowHeads, wq, lane, bar_id);
    mbar_arrive(end_full);
    if (role == 0 && wq == 0 && lane < 4) {
      mbar_wait(end_full, 0);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int h = head_of(q);  // one head block: h0 = 0
        if (h >= a.heads) continue;
        const float lq = lsum_all[h] + lsum_all[kNarrowHeads + h];
        state_row(a, j, t, h).put_lse(lq == 0.0f ? kNegInf : mf[q] + logf(lq));
      }
    }
    return;
  }

  // ============================ values: O^T for every tile in order ============================
#if defined(DCPATTN_MLA_WGMMA)
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegAValueRegs));
#endif
  float o[8][8];  // O^T block mb, rows as above, heads as in elem_of
#pragma unroll
  for (int mb = 0; mb < 8; ++mb)
#pragma unroll
    for (int e = 0; e < 8; ++e) o[mb][e] = 0.0f;
  const int doff = 4 * (8 * wq + gq);  // this thread's 4 dims within each group
  for (int i = 0;; ++i) {
    const int st = i % R;
    mbar_wait(&full[st], (i / R) & 1);
    if (count_s[i % SB] == 0) {
      n_done = i;
      break;
    }
    const unsigned char* raw = smem + L::raw + std::size_t(st) * L::raw_bytes;
    // --- O^T = alpha r_g O^T + V^T P_g^T for all 512 value dims.
    constexpr int kSteps = kTileTokens / 16;  // 4
    std::uint32_t av[kSteps][8][4];
#pragma unroll
    for (int kk = 0; kk < kSteps; ++kk) {
      if (kk >= 2) wgmma_wait<1>();  // the products of k-step kk - 2 have read their registers
      // Tokens of the fragment's columns 2c, 2c+1 (registers 0, 1) and 2c+8, 2c+9 (2, 3).
      const unsigned char* ea = raw + (16 * kk + 2 * c) * kRawEntry + doff;
      const unsigned char* eb = ea + kRawEntry;
      const unsigned char* ec = ea + 8 * kRawEntry;
      const unsigned char* ed = ea + 9 * kRawEntry;
#pragma unroll
      for (int grp = 0; grp < kGroups; ++grp) {
        const std::uint32_t wa = *reinterpret_cast<const std::uint32_t*>(ea + 128 * grp);
        const std::uint32_t wb = *reinterpret_cast<const std::uint32_t*>(eb + 128 * grp);
        const std::uint32_t wc = *reinterpret_cast<const std::uint32_t*>(ec + 128 * grp);
        const std::uint32_t wd = *reinterpret_cast<const std::uint32_t*>(ed + 128 * grp);
#pragma unroll
        for (int b = 0; b < 2; ++b) {
          // Dims 2b and 2b + 1 of the 4: {a: 2b, b-token: 2b, a: 2b+1, b-token: 2b+1}.
          const std::uint32_t sel = b ? 0x7362u : 0x5140u;
          const std::uint32_t ab = __byte_perm(wa, wb, sel);
          const std::uint32_t cd = __byte_perm(wc, wd, sel);
          e4m3x4_to_f16x2x2(ab, av[kk][2 * grp + b][0], av[kk][2 * grp + b][1]);
          e4m3x4_to_f16x2x2(cd, av[kk][2 * grp + b][2], av[kk][2 * grp + b][3]);
        }
      }
      if (kk == kSteps - 1) mbar_arrive(&empty[st]);  // this thread's reads are done
      if (kk == 0) {
        mbar_wait(&pt_full[i & 1], (i >> 1) & 1);
        if (rescale_s[i & 1] != 0) {  // the same for the whole warpgroup
          const float* alpha = alpha_s + (i & 1) * kNarrowHeads;
          float al[4], rg[kGroups];
#pragma unroll
          for (int q = 0; q < 4; ++q) al[q] = alpha[head_of(q)];
#pragma unroll
          for (int grp = 0; grp < kGroups; ++grp) rg[grp] = resc_s[(i & 1) * kGroups + grp];
#pragma unroll
          for (int mb = 0; mb < 8; ++mb) {
#pragma unroll
            for (int q = 0; q < 4; ++q) {
              const float f = al[q] * rg[mb >> 1];
              o[mb][elem_of(q)] *= f;
              o[mb][elem_of(q) + 2] *= f;
            }
          }
          // The rescaling completes before the products (see narrow_consumers).
#pragma unroll
          for (int mb = 0; mb < 8; ++mb) fence_registers(o[mb]);
        }
      }
      wgmma_fence();
#pragma unroll
      for (int mb = 0; mb < 8; ++mb) {
        const int off = ((i & 1) * kGroups + (mb >> 1)) * kQBlock + kk * 32;  // P_g^T block
        wgmma_m64n16_rs<true>(o[mb], av[kk][mb], desc_plus(p_desc, off), 1);
      }
      wgmma_commit();
    }
    wgmma_wait<0>();
    mbar_arrive(&pt_empty[i & 1]);
  }

  // --- The state: o = acc 2^(sigma_g - 127) / l, with the score warpgroups' row sums and the
  // final scale exponents (the chained state after the last tile).
  mbar_wait(end_full, 0);
  float fin[kGroups];
#pragma unroll
  for (int grp = 0; grp < kGroups; ++grp)
    fin[grp] = n_done > 0 ? ldexpf(1.0f, csig_s[((n_done - 1) & 1) * kGroups + grp] - 127) : 0.0f;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int h = head_of(q);  // one head block: h0 = 0
    if (h >= a.heads) continue;
    const float lq = lsum_all[h] + lsum_all[kNarrowHeads + h];
    const bool empty_state = lq == 0.0f;
    const StateRow out = state_row(a, j, t, h);
    const float inv = empty_state ? 0.0f : 1.0f / lq;
    const int e = elem_of(q);
#pragma unroll
    for (int grp = 0; grp < kGroups; ++grp) {
      const float f = fin[grp] * inv;  // a power of two times 1 / l
      out.put4(128 * grp + doff, empty_state ? 0.0f : o[2 * grp][e] * f,
               empty_state ? 0.0f : o[2 * grp][e + 2] * f,
               empty_state ? 0.0f : o[2 * grp + 1][e] * f,
               empty_state ? 0.0f : o[2 * grp + 1][e + 2] * f);
    }
  }
}

/// One (row, split, head block) partial state; see the section comment. 1-D grid, head block
/// fastest (the CTAs reading the same tiles run side by side), then split, then row.
///
/// Roles. Warpgroup 2 (the producer) computes each tile's slots, copies the tile into shared
/// memory and, for the fp8 cache, copies the query block and dequantizes the tile; warpgroups 0
/// and 1 (the consumers) compute, and for the bf16 cache first build the query block.
/// Tile i's slots sit in slot buffer i mod 4 with its token count (0: the split is done).
///   bf16: two K/V stages; tile i + 1 is copied while tile i is computed. The hand-over is a pair
///         of mbarriers per stage: `full` (the producer's 128 threads arrive once a tile's bytes
///         are in place and fenced for the tensor cores) and `empty` (the consumers' 256 threads
///         arrive once their products have read the stage). With kTma (the dense kernels, wide
///         and narrow, launched where every tile is 64 consecutive positions of one page) a full
///         tile is 9 tensor copies, whose bytes complete `full` (expect_tx).
///   fp8 (64 heads per CTA): one K/V stage (two bf16 stages, the query block and a raw stage do
///         not fit in 227 KiB) and one raw stage; the raw entries of tile i + 1 are copied while
///         tile i is computed.
///         Between tiles all 384 threads fill the K/V stage from the raw stage (the consumers
///         convert the latent part, the producer copies the RoPE part: dequant_tile), between two
///         CTA-wide hand-overs (cta_handover, mbarriers): `tile_begin` (the consumers' products
///         of tile i - 1 are done, the raw entries of tile i have landed and its count is
///         published) and `tile_ready` (the stage is complete and fenced; the raw stage is free).
///         The consumers would otherwise wait for the conversion, which the producer warpgroup
///         alone would do at a third of the width.
///   fp8 (narrow): four warpgroups, the producer the last. Four raw stages handed over by full /
///         empty mbarriers, the full arrival made by the copies themselves
///         (cp.async.mbarrier.arrive); see narrow_fp8_consumers. kTableRing (dense, launched where
///         a split's consecutive tiles have their block-table entries in lines of their own and
///         the grid covers the GPU): the entries are copied into shared memory ahead, four
///         tiles' at a time (table_chunk).
template <int kRows, bool kSparse, bool kTma, bool kTableRing, class QSrc, class CacheView,
          class Own>
__global__ void __launch_bounds__(
    Smem<mla_cache_format_v<CacheView> == CacheFormat::fp8_ds_mla, kRows>::threads, 1)
    mla_wg_kernel(const __grid_constant__ SplitArgs<QSrc, CacheView, Own> a,
                  const __grid_constant__ CacheTensorMap<kTma> tensor_map) {
  constexpr bool kFp8 = mla_cache_format_v<CacheView> == CacheFormat::fp8_ds_mla;
  static_assert(!kTma || (!kSparse && !kFp8 && is_plain_strided_v<CacheView>),
                "dcpattn: tensor copies are for the dense bf16 kernels");
  static_assert(!kTableRing || (!kSparse && kFp8 && kRows == kNarrowHeads),
                "dcpattn: the block-table ring is for the dense 16-head fp8 kernel");
  constexpr bool kRawPath = kFp8 && is_plain_strided_v<CacheView>;
  using L = Smem<kFp8, kRows>;
  static_assert(L::raw_stages + 2 <= L::slot_bufs,
                "dcpattn: a slot buffer per tile being computed, in flight or being gathered");
  constexpr float kNegInf = -cuda::std::numeric_limits<float>::infinity();

  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char* q_s = smem + L::q;
  unsigned char* raw_s = smem + L::raw;
  unsigned char* p_s = smem + L::p;
  int* slot_s = reinterpret_cast<int*>(smem + L::slot);    // [4][64]
  int* count_s = reinterpret_cast<int*>(smem + L::count);  // [4]
  float* xrow = reinterpret_cast<float*>(smem + L::xrow);  // [2][64]
  int* ring_s = reinterpret_cast<int*>(smem + L::ring);
  int* wsum_s = reinterpret_cast<int*>(smem + L::wsum);
  std::uint64_t* full = reinterpret_cast<std::uint64_t*>(smem + L::bar);
  std::uint64_t* empty = full + 4;
  int* q_issued_s = reinterpret_cast<int*>(smem + L::q_issued);
  auto stage = [&](int st) { return smem + L::k + std::size_t(st) * kTile; };

  const int tid = int(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int head_blocks = (a.heads + kRows - 1) / kRows;
  const int S = a.num_splits;
  const int hb = int(blockIdx.x % unsigned(head_blocks));
  const int j = int((blockIdx.x / unsigned(head_blocks)) % unsigned(S));
  const std::int64_t t = std::int64_t(blockIdx.x / unsigned(head_blocks) / unsigned(S));
  const int h0 = hb * kRows;
  pdl_wait();  // launched as a programmatic dependent (launch_dependent)

  if (t >= a.num_valid_rows) {
    // Padding row: nothing of it is read. With S > 1 the merge kernel writes its neutral state.
    if (S == 1) {
      for (int i = tid; i < kRows * kMlaVDim; i += L::threads) {
        const int h = h0 + i / kMlaVDim;
        if (h < a.heads) a.o(t, std::int64_t(h), std::int64_t(i % kMlaVDim)) = 0.0f;
      }
      for (int i = tid; i < kRows; i += L::threads)
        if (h0 + i < a.heads) a.lse(t, std::int64_t(h0 + i)) = kNegInf;
    }
    return;
  }

  if (tid == 0) {
    if constexpr (kFp8 && !L::reg_a) {
      *q_issued_s = 0;
      mbar_init(&full[0], kThreads);   // tile_begin: the raw entries and count of tile i are in
      mbar_init(&empty[0], kThreads);  // tile_ready: the K/V stage holds tile i; raw_s is free
      mbar_init(&full[1], 1);          // q_full: the query block's tensor copies landed (q_tma)
      for (int r = 0; r < L::raw_stages; ++r)
        mbar_init(&full[2 + r], 1);  // raw_full: raw stage r's bulk copy landed (raw_bulk)
    } else {
      for (int st = 0; st < (L::reg_a ? L::raw_stages : L::stages); ++st) {
        mbar_init(&full[st], kProducers);
        mbar_init(&empty[st], kConsumers);
      }
      if constexpr (L::reg_a) {
        mbar_init(&full[12], 256);  // q_full: the score warpgroups built the query block
        for (int b = 0; b < 2; ++b)
          mbar_init(&full[13 + b], 128);  // chain_full: the state after a tile of parity b
        mbar_init(&full[15], 256);        // end_full: both score warpgroups' row sums are in
      }
    }
    if constexpr (kRows == kNarrowHeads) {
      for (int b = 0; b < 2; ++b) {
        mbar_init(&full[8 + b], kConsumers / 2);   // pt_full: warpgroup 0 wrote P^T buffer b
        mbar_init(&full[10 + b], kConsumers / 2);  // pt_empty: warpgroup 1 is done with it
      }
    } else {
      mbar_init(&full[8], kConsumers / 2);  // p_full: warpgroup 0 wrote P and alpha_s (or the end)
      mbar_init(&full[9], kConsumers / 2);  // p_empty: warpgroup 1 holds them in registers
    }
  }
  if constexpr (kFp8 && !L::reg_a && kRawPath) {
    if (tid < 128) write_unpack_perm(smem + L::perm, tid);
    fence_proxy_async();  // read by the tensor cores (dequant_tile)
  }
  __syncthreads();  // barriers initialized (the last CTA-wide barrier)

  if (warp >= L::consumers / 32) {
    // ===================================== producer =====================================
#if defined(DCPATTN_MLA_WGMMA)
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(L::reg_a ? kRegAProducerRegs
                                                                        : kProducerRegs));
#endif
    const int ptid = tid - L::consumers;
    const int pw = warp - L::consumers / 32;
    const std::int32_t req = a.row_request(t);
    const bool req_ok = req >= 0 && std::int64_t(req) < a.block_table.extent(0);
    std::int64_t n = 0;                       // dense: tokens of this split
    [[maybe_unused]] bool pos32 = false;      // dense: every local position is below 2^31
    [[maybe_unused]] std::int64_t bound = 0;  // sparse: the row's global causal bound
    // Sparse: top-k entries to scan; the scan counts in 32 bits (validate_mla_sparse_extents
    // bounds K), which keeps the producer within its registers.
    int list = 0;
    if constexpr (!kSparse) {
      const std::int64_t len = a.row_local_length(t);
      if (req_ok && len > 0) n = mla_split_length(len, j, S, a.interleave);
      pos32 = len < (std::int64_t(1) << 31);
    } else {
      bound = a.row_bound(t);
      if (req_ok && bound > 0) list = int(a.topk.extent(1));
    }
    // Sparse: the list entries [list_begin, list) this split scans.
    int list_begin = 0;
    if (kSparse && a.split_list && list > 0) {
      const MlaListRange r = mla_list_range(list, j, S);
      list_begin = int(r.begin);
      list = int(r.end);
    }
    // Sparse: the list scan's pipeline (next_tile). list_entry reads entry idx of the row's list
    // (-1 past its end); read_page checks an entry (flagging one out of range) and, when it is
    // this split's, reads its page id into pipe_page (-1 otherwise) and its offset into pipe_off.
    [[maybe_unused]] int pipe_cursor = -1;  // the round whose pages are in pipe_page
    [[maybe_unused]] std::int32_t pipe_gpos = -1, pipe_page = -1, pipe_off = 0;
    [[maybe_unused]] auto list_entry = [&](int idx) -> std::int32_t {
      if constexpr (kSparse) return idx < list ? a.topk(t, idx) : -1;
      return -1;
    };
    [[maybe_unused]] auto read_page = [&](std::int32_t gpos) {
      if constexpr (kSparse) {
        if ((gpos < -1 || gpos >= bound) && a.error_flags != nullptr)
          atomicOr(a.error_flags, input_error_topk);
        pipe_page = -1;
        if (gpos >= 0 && gpos < bound && int(a.own.owner(gpos)) == a.rank) {
          const std::int64_t pos = std::int64_t(a.own.local_position(gpos));
          // In 32-bit arithmetic: a 64-bit division is a long subroutine, and the scan runs
          // these for every list entry in every split (docs/performance.md, run 25). A position
          // past 2^31 - 1 is past the block table (sparse_splits checks that the table's pages
          // end below 2^31), skipped as every position past it is.
          std::int64_t page_index = -1;
          if (pos >= 0 && pos <= std::int64_t(INT32_MAX)) {
            const std::uint32_t p32 = std::uint32_t(pos);
            const std::uint32_t ps = std::uint32_t(a.page_size);
            if ((((p32 / std::uint32_t(a.interleave)) ^ std::uint32_t(j)) & a.split_mask) == 0) {
              const std::uint32_t pi = p32 / ps;
              page_index = pi;
              pipe_off = std::int32_t(p32 - pi * ps);
            }
          }
          if (page_index >= 0 && page_index < a.block_table.extent(1))
            pipe_page = a.block_table(std::int64_t(req), page_index);
        }
      }
    };
    // Slots of the next tile's split tokens into slot buffer sb (-1: no token / skipped) and its
    // token count; returns the count (0: the split is done). Uniform over the producer.
    [[maybe_unused]] std::int64_t k0 = 0;                          // dense: next split token
    [[maybe_unused]] int cursor = list_begin, head = 0, tail = 0;  // sparse: list scan and ring
    // Dense: the page id and the offset in the page of split token k0 + ptid of the tile at
    // ahead_k0, read ahead (read_ahead) so that the block-table read is in flight while the
    // producer waits and copies; in 32-bit arithmetic when every position fits (pos32).
    [[maybe_unused]] std::int64_t ahead_k0 = -1, ahead_page = -1, ahead_off = 0;
    [[maybe_unused]] auto read_ahead = [&]() {
      ahead_k0 = k0;
      ahead_page = -1;
      if (ptid < kTileTokens && k0 + ptid < n) {
        std::int64_t page_index;
        if (pos32) {
          const std::uint32_t pos =
              mla_split_position(std::uint32_t(k0 + ptid), j, S, a.interleave);
          const std::uint32_t ps = std::uint32_t(a.page_size), pi = pos / ps;
          page_index = pi;
          ahead_off = pos - pi * ps;
        } else {
          const std::int64_t pos = mla_split_position(k0 + ptid, j, S, a.interleave);
          page_index = pos / a.page_size;
          ahead_off = pos % a.page_size;
        }
        if (page_index < a.block_table.extent(1))
          ahead_page = a.block_table(std::int64_t(req), page_index);
      }
    };
    // Dense fp8 (narrow), tiles of one page each (raw_bulk): the block-table entry of each tile
    // (its page's: every token of a tile is in one page) is copied into the (dense: unused) ring
    // by cp.async a chunk of kTableChunk tiles at a time, two chunks ahead of use at the start
    // and one chunk ahead after it (table_chunk; ring entry m mod 2 kTableChunk, one thread a
    // tile). next_tile waits for a chunk when it enters it (cp.async.wait_group and a producer
    // barrier, as the entry is read by every producer thread). A read_ahead one tile ahead held
    // the copies back by its latency where each tile's entry is in a line of its own (many
    // splits: S = 16 at 8 x 32K). Against 64 copies of the entry a tile (one a token, four tiles
    // ahead, each thread reading its own): 8 x 32K 57.8-58.0 -> 56.4-56.7 us, 8 x 128K
    // 189.5-189.7 -> 179.5-180.7 (docs/performance.md, run 33). Nothing waits on these copies
    // but next_tile.
    [[maybe_unused]] bool table_ring = false;
    constexpr int kTableChunk = 4;
    [[maybe_unused]] auto table_chunk = [&](std::int64_t c) {
      const std::int64_t m = c * kTableChunk + ptid;  // the tile of this thread's entry
      if (ptid < kTableChunk && m > 0 && m * kTileTokens < n) {
        const std::uint32_t pos =
            mla_split_position(std::uint32_t(m * kTileTokens), j, S, a.interleave);
        const std::int64_t page_index = pos / std::uint32_t(a.page_size);
        int* dst = ring_s + (m & (2 * kTableChunk - 1));
        if (page_index < a.block_table.extent(1)) {
          asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_u32(dst)),
                       "l"(__cvta_generic_to_global(&a.block_table(std::int64_t(req), page_index)))
                       : "memory");
        } else {
          *dst = -1;
        }
      }
      cp_async_commit();
    };
    auto next_tile = [&](int sb) -> int {
      int* slots = slot_s + sb * kTileTokens;
      int n_tile = 0;
      if constexpr (!kSparse) {
        n_tile = int(n - k0 < kTileTokens ? (n - k0 > 0 ? n - k0 : 0) : kTileTokens);
        const bool from_ring = kTableRing && table_ring && k0 > 0 && n_tile > 0;
        if constexpr (kTableRing) {
          const std::int64_t m = k0 / kTileTokens;
          if (from_ring && (m == 1 || m % kTableChunk == 0)) {
            // Entering chunk m / 4 (tile 1: chunk 0): the chunk after it goes out, into the
            // entries of the chunk before, whose tiles are all done; then this chunk's entries.
            if (m > 1) table_chunk(m / kTableChunk + 1);
            cp_async_wait<1>();
            producer_barrier();
          }
        }
        if (n_tile > 0 && ptid < kTileTokens) {
          std::int64_t slot = -1;
          if (ptid < n_tile) {
            if (from_ring) {
              const std::int64_t page =
                  ring_s[(k0 / kTileTokens) & (2 * kTableChunk - 1)];  // every thread
              const std::uint32_t pos =
                  mla_split_position(std::uint32_t(k0 + ptid), j, S, a.interleave);
              slot = page * a.page_size + std::int64_t(pos % std::uint32_t(a.page_size));
              if (page < 0 || slot >= a.cache.extent(0)) slot = -1;
            } else if (ahead_k0 == k0) {
              slot = ahead_page * a.page_size + ahead_off;
              if (ahead_page < 0 || slot >= a.cache.extent(0)) slot = -1;
            } else {
              slot = checked_slot(a, req, mla_split_position(k0 + ptid, j, S, a.interleave));
            }
          }
          slots[ptid] = int(slot);
        }
        k0 += kTileTokens;
      } else {
        // Gather the split's entries in list order until a tile is full or the list is done.
        // Each round places the entries cursor + [0, kGather): their pages were read during the
        // previous round (pipe_page, pipe_off), whose list entries were read the round before
        // (pipe_gpos), so a round waits on one memory latency instead of two in sequence.
        while (tail - head < kTileTokens && cursor < list) {
          if (pipe_cursor != cursor) {  // the first round of the split: nothing read ahead yet
            pipe_gpos = list_entry(cursor + ptid);
            read_page(pipe_gpos);
            pipe_gpos = list_entry(cursor + kGather + ptid);
          }
          std::int64_t slot = -1;
          if (pipe_page >= 0) {
            slot = std::int64_t(pipe_page) * a.page_size + pipe_off;
            if (slot >= a.cache.extent(0)) slot = -1;
          }
          // The next round's pages, and the entries of the round after it.
          read_page(pipe_gpos);
          pipe_gpos = list_entry(cursor + 2 * kGather + ptid);
          pipe_cursor = cursor + kGather;
          const bool take = slot >= 0;
          const unsigned ballot = __ballot_sync(kFullMask, take);
          if (lane == 0) wsum_s[pw] = __popc(ballot);
          producer_barrier();
          int before = 0, total = 0;
#pragma unroll
          for (int w = 0; w < kProducers / 32; ++w) {
            const int c = wsum_s[w];
            before += w < pw ? c : 0;
            total += c;
          }
          if (take)
            ring_s[(tail + before + __popc(ballot & ((1u << lane) - 1u))) & (kRing - 1)] =
                int(slot);
          tail += total;
          cursor += kGather;
          producer_barrier();  // ring entries visible; wsum_s free for the next round
        }
        n_tile = int(tail - head < kTileTokens ? tail - head : kTileTokens);
        if (n_tile > 0 && ptid < kTileTokens)
          slots[ptid] = ptid < n_tile ? ring_s[(head + ptid) & (kRing - 1)] : -1;
        head += n_tile;
      }
      if (ptid == 0) count_s[sb] = n_tile;
      producer_barrier();  // the slots are visible to every producer thread
      return n_tile;
    };

    const bool any_work = kSparse ? list > list_begin : n > 0;
    if constexpr (kFp8 && !L::reg_a) {
      // The 64-head fp8 kernel's producer copies the query block, first: the copies do not wait
      // on the block table. (Its consumers copying it instead made every tile about 10% slower.)
      // With q_tma one thread issues 9 tensor copies (heads past H read as zeros), which complete
      // on q_full; the consumers wait for it before their first product, or, in a split without
      // tiles, after their tile loop (q_issued_s tells them the copies were issued).
      if (any_work) {
        if (a.q_tma) {
          if (ptid == 0) {
            mbar_arrive_expect_tx(&full[1], std::uint32_t(kTile));
            for (int b = 0; b < kDimBlocks; ++b)
              tma_load_3d(smem_u32(q_s + b * kBlock), &a.q_map, 64 * b, h0, int(t), &full[1]);
            *q_issued_s = 1;  // published to the consumers with tile 0's count (tile_begin)
          }
        } else {
          load_q<kRows, kProducers>(a.q, t, h0, a.heads, q_s, ptid);
        }
      }
    }
    int n_cur = any_work ? next_tile(0) : 0;
    if (!any_work && ptid == 0) count_s[0] = 0;
    if constexpr (L::reg_a) {
      // R raw stages handed over like the bf16 stages (full / empty by stage), with the full
      // arrival made by the copies themselves (cp.async.mbarrier.arrive): tile k is published as
      // soon as its bytes land, whatever the producer waits on meanwhile. Tiles 0 .. R - 1 are
      // copied at once (the score warpgroups build the query block meanwhile); tile k >= R goes
      // to the stage of tile k - R once its readers are done with it, and its slots to slot
      // buffer k mod SB, which every consumer is done with by then. The end of the split is marked
      // twice, at tiles n and n + 1, so that each score warpgroup reads a marker
      // (narrow_fp8_consumers).
      constexpr int R = L::raw_stages;
      constexpr int SB = L::slot_bufs;
      auto load_raw = [&](int k, int n_k) {
        const int* slots = slot_s + (k % SB) * kTileTokens;
        unsigned char* dst = raw_s + std::size_t(k % R) * L::raw_bytes;
        if constexpr (kRawPath) {
          if (a.cache_vector) {
            // A full tile of 64 consecutive slots (raw_bulk): one bulk copy, its bytes completing
            // full[k mod R] (expect_tx) beside the other producer threads' arrivals.
            const int s0 = a.raw_bulk ? page_run_start(slots, n_k) : -1;
            if (s0 >= 0) {
              if (ptid == 0) {
                bulk_load_raw_tile(smem_u32(dst), a.cache, s0, &full[k % R]);
              } else {
                mbar_arrive(&full[k % R]);
              }
              return;
            }
            load_tile_raw(a.cache, slots, dst, ptid);
            cp_async_commit();
            cp_async_mbar_arrive(&full[k % R]);
            return;
          }
        }
        load_tile_raw_bytes(a.cache, slots, dst, ptid);
        mbar_arrive(&full[k % R]);
      };
      int n_k = n_cur;  // token count of tile k
      int k = 0;
      if constexpr (kTableRing) {
        table_ring = a.raw_bulk && a.cache_vector && pos32 && n > kTileTokens;
        if (table_ring) {
          table_chunk(0);
          table_chunk(1);
        }
      }
      for (; k < R && n_k > 0; ++k) {
        load_raw(k, n_k);
        if (k + 1 < R) n_k = next_tile((k + 1) % SB);
      }
      if (k == R) n_k = next_tile(k % SB);  // tiles 0 .. R - 1 all had tokens
      while (n_k > 0) {
        // Tile k's slots are in; the block-table reads of tile k + 1 go out before the wait.
        if constexpr (!kSparse)
          if (!kTableRing || !table_ring) read_ahead();
        // Tile k - R was read: one warp polls for it, the others wait at the producer barrier,
        // which issues nothing while it waits (the polls of four warps took issue slots from the
        // consumer warps beside them).
        if (ptid < 32) mbar_wait(&empty[k % R], (k / R - 1) & 1);
        producer_barrier();
        load_raw(k, n_k);
        n_k = next_tile(++k % SB);
      }
      for (int e = 0; e < 2; ++e, ++k) {
        if (k >= R) mbar_wait(&empty[k % R], (k / R - 1) & 1);
        if (ptid == 0) count_s[k % SB] = 0;
        mbar_arrive(&full[k % R]);  // an end marker: the consumers read the count 0 and stop
      }
      if constexpr (kTableRing) cp_async_wait_all();  // table_chunk's: none in flight at the exit
    } else if constexpr (!kFp8) {
      // Tile k is handed over by its own copies: each producer thread's arrival on full[k mod 2]
      // is made when its copies of tile k have landed (cp.async.mbarrier.arrive; the consumers
      // fence them for the tensor cores), so the producer goes on to tile k + 1 as soon as its
      // stage is free instead of waiting for tile k to land. Issuing a tile's copies takes about
      // as long as the consumers' products of a tile (3470-4210 against 4320-4820 cycles on the
      // H200, docs/performance.md, run 12): two tiles' copies must be in flight, or the tiles
      // come one issue-plus-landing time apart.
      auto hand_over = [&](int k, int n_k) {
        if (n_k > 0) {
          unsigned char* dst = stage(k & 1);
          const int* slots = slot_s + (k % kSlotBufs) * kTileTokens;
          if (a.cache_vector && is_plain_strided_v<CacheView>) {
            if constexpr (kTma) {
              // The launch's tiles are 64 consecutive positions of one page (dense_splits), so a
              // full tile whose first and last slots are 63 apart is 64 consecutive slots: one
              // tensor copy per column block, all completing on full[k mod 2] (expect_tx). A
              // partial tile (whose missing tokens must be zeros), a bad page id or a page past
              // the cache's end: cp.async. The same decision in every producer thread (the
              // slots are in shared memory).
              const int s0 = page_run_start(slots, n_k);
              if (s0 >= 0) {
                if (ptid == 0) {
                  mbar_arrive_expect_tx(&full[k & 1], std::uint32_t(kTile));
                  for (int b = 0; b < kDimBlocks; ++b)
                    tma_load_2d(smem_u32(dst + b * kBlock), &tensor_map.map, 64 * b, s0,
                                &full[k & 1]);
                } else {
                  mbar_arrive(&full[k & 1]);
                }
                return;
              }
            }
            load_tile_direct(a.cache, true, slots, dst, ptid);
            cp_async_mbar_arrive(&full[k & 1]);
            return;
          }
          load_tile_direct(a.cache, false, slots, dst, ptid);  // complete on return
          fence_proxy_async();
        }
        mbar_arrive(&full[k & 1]);  // the copies, or the end marker (count 0)
      };
      int n_k = n_cur;
      hand_over(0, n_k);
      for (int k = 1; n_k > 0; ++k) {
        n_k = next_tile(k % kSlotBufs);  // the slots of tile k (count 0: the end marker)
        // Tile k goes to the stage of tile k - 2: wait until the consumers are done with it.
        if (k >= 2) mbar_wait(&empty[k & 1], ((k - 2) >> 1) & 1);
        hand_over(k, n_k);
      }
      cp_async_wait_all();  // nothing of this thread's is in flight when it leaves
    } else {
      // R raw stages: tiles 0 .. R - 1 are copied ahead, then tile i + R into tile i's stage once
      // tile i is dequantized. One cp.async group per tile. A tile of 64 consecutive slots
      // (raw_bulk) is one bulk copy completing on raw_full (full[2 + stage]); every tile makes
      // one arrival there, so its phase also completes for the cp.async tiles. The slots of
      // tile i + R + 1 are gathered right after tile i + R's copies go out, while the consumers
      // compute tile i (dense: the block-table reads; sparse: the top-k scan), so the copies of
      // the next tile start as soon as the raw stage is free.
      constexpr int R = L::raw_stages;
      static_assert(2 + R <= 4, "dcpattn: raw_full barriers");
      static_assert(R + 2 <= kSlotBufs, "dcpattn: slot buffers: tile i, R in flight, one ahead");
      auto raw = [&](int i) { return raw_s + std::size_t(i % R) * L::raw_bytes; };
      auto copy_raw = [&](int k, int n_k) {
        std::uint64_t* raw_full = &full[2 + k % R];
        if constexpr (kRawPath) {
          if (n_k > 0 && a.cache_vector) {
            const int* slots = slot_s + (k % kSlotBufs) * kTileTokens;
            const int s0 = a.raw_bulk ? page_run_start(slots, n_k) : -1;
            if (s0 >= 0) {
              if (ptid == 0) bulk_load_raw_tile(smem_u32(raw(k)), a.cache, s0, raw_full);
              return;
            }
            load_tile_raw(a.cache, slots, raw(k), ptid);
          }
        }
        if (ptid == 0) mbar_arrive(raw_full);
      };
      int n_ahead[R];  // token counts of tiles i .. i + R - 1 (0: the end marker)
      n_ahead[0] = n_cur;
#pragma unroll
      for (int k = 0; k < R; ++k) {
        if (k > 0) n_ahead[k] = n_ahead[k - 1] > 0 ? next_tile(k % kSlotBufs) : 0;
        copy_raw(k, n_ahead[k]);
        cp_async_commit();
      }
      int n_next = n_ahead[R - 1] > 0 ? next_tile(R % kSlotBufs) : 0;  // tile i + R
      for (int i = 0;; ++i) {
        cp_async_wait<R - 1>();  // tile i's raw entries this thread copied landed
        cta_handover(&full[0], i & 1);  // tile_begin
        if (n_ahead[0] == 0) break;     // the end marker: the consumers read the count 0 and stop
        if (kRawPath && a.cache_vector) {
          mbar_wait(&full[2 + i % R], (i / R) & 1);  // raw_full
          dequant_tile<false>(raw(i), stage(0), smem + L::perm, tid);
        } else {
          load_tile_direct(a.cache, a.cache_vector, slot_s + (i % kSlotBufs) * kTileTokens,
                           stage(0), ptid);
        }
        fence_proxy_async();
        cta_handover(&empty[0], i & 1);  // tile_ready: tile i complete; raw(i) free
        copy_raw(i + R, n_next);
        cp_async_commit();
#pragma unroll
        for (int k = 0; k + 1 < R; ++k) n_ahead[k] = n_ahead[k + 1];
        n_ahead[R - 1] = n_next;
        n_next = n_next > 0 ? next_tile((i + R + 1) % kSlotBufs) : 0;
      }
      cp_async_wait<0>();
    }
    return;
  }

  // ===================================== consumers =====================================
#if defined(DCPATTN_MLA_WGMMA)
  // The narrow fp8 kernel's roles raise their own counts (narrow_fp8_consumers).
  if constexpr (!L::reg_a)
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));
#endif
  if constexpr (!kFp8) {
    // bf16: the consumers build the query block while the producer reads the block table and
    // copies the first tiles; with the producer's four warps issuing both, the first tile came
    // about 5 us later at batch 1 (docs/performance.md, run 11).
    load_q<kRows, kConsumers>(a.q, t, h0, a.heads, q_s, tid);
    cp_async_wait_all();
    fence_proxy_async();
    consumer_barrier();
  }
  if constexpr (L::reg_a) {
    narrow_fp8_consumers<kSparse>(a, smem, t, j);
  } else if constexpr (kRows == kNarrowHeads) {
    narrow_consumers(a, smem, t, j);
  } else {
    // The two warpgroups take different roles (as FlashMLA's decoding kernels). Warpgroup 0
    // computes all of S = Q K^T (m64n64: the query block is read once a tile), the whole softmax
    // (no exchange of row maxima), and O = P V for value dims [0, 256) with P from its registers;
    // it hands P and the rescale factors to warpgroup 1 through shared memory (mbarrier p_full),
    // and warpgroup 1 computes O for value dims [256, 512) while warpgroup 0 goes on. (mbarriers,
    // not bar.arrive / bar.sync: compute-sanitizer racecheck reported the named barriers' hand-
    // over as races, the tool's limit with unequal barrier counts; see cta_handover.) Against
    // both warpgroups computing the scores of 32 tokens and exchanging row maxima (runs 3-22):
    // dense bf16 128 heads 64 x 32K 1197-1229 -> 1049-1052 us, 8 x 32K 176 -> 155-156, 1 x 32K
    // 38.8-39.2 -> 37.1-37.4 (docs/performance.md, run 23). Warpgroup 0 ends with the whole row
    // sum and warpgroup 1 with none, so the state below adds 0 to it. FlashMLA's pair order
    // (each warpgroup the scores and softmax of alternate tiles, both the P V halves of both)
    // computes 13% faster but, with two stages, frees a stage too late for its next tile to
    // land: 6-11% slower with the copies (docs/performance.md, run 27).
    // The weights are powers of two of base-2 scores (detail::fast_exp2: one special-function
    // instruction against about eight for expf, on warpgroup 0's path between its products while
    // the tensor cores wait): 64 x 32K 1077-1080 -> 1001-1003 us, 8 x 32K 157 -> 146, fp8
    // 64 x 32K 1593-1595 -> 1506 (docs/performance.md, run 26).
    const int g = warp >> 2;  // warpgroup: value dims [256 g, +256) of O; 0 also the scores
    const int wq = warp & 3;  // warp in the warpgroup: head rows [16 wq, +16)
    const int r0 = 16 * wq + (lane >> 2), r1 = r0 + 8;

    // Softmax state of head rows r0 and r1 (warpgroup 0; replicated in the 4 threads of a quad).
    float m_0 = kNegInf, m_1 = kNegInf, l_0 = 0.0f, l_1 = 0.0f;
    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.0f;

    const std::uint32_t qa = smem_u32(q_s);
    const std::uint32_t pa = smem_u32(p_s);
    float* alpha_s = xrow;  // [64]: the rescale factors of the tile's P
    std::uint64_t* p_full = full + 8;
    std::uint64_t* p_empty = full + 9;
    auto rescale = [&](float al0, float al1) {
      // Rescaling by 1 changes nothing: skipped when no row of the warp moved its maximum.
      if (__any_sync(kFullMask, al0 != 1.0f || al1 != 1.0f)) {
#pragma unroll
        for (int c = 0; c < 32; ++c) {
          o[4 * c] *= al0;
          o[4 * c + 1] *= al0;
          o[4 * c + 2] *= al1;
          o[4 * c + 3] *= al1;
        }
      }
    };
    // Warpgroup 0, one tile (K/V stage at k_s, its slots): the scores, the softmax, P and alpha_s
    // handed to warpgroup 1 (p_full), O for dims [0, 256). Branch-free softmax: a masked score
    // (-inf) gives 2^-inf = 0 against a finite maximum; while nothing is valid (mn = -inf)
    // the maximum used is 0, so no -inf - -inf arises, and alpha is 0 against o = 0 and l = 0.
    // O += P V for 256 value dims (the V tile's columns from shared-memory address v) with P
    // from registers (pf: its k16 fragments are the score registers' layout).
    auto pv_issue = [&](const std::uint32_t(&pf)[8][2], std::uint32_t v) {
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kTileTokens / 16; ++kk) {
        const std::uint32_t p_kk[4] = {pf[2 * kk][0], pf[2 * kk][1], pf[2 * kk + 1][0],
                                       pf[2 * kk + 1][1]};
        wgmma_m64n256_pv_rs(o, p_kk, gmma_desc(v + kk * 2048, kBlock, 1024));
      }
      wgmma_commit();
    };
    auto pv_registers = [&](const std::uint32_t(&pf)[8][2], std::uint32_t v) {
      pv_issue(pf, v);
      wgmma_wait_all();
    };
    // The scores in base 2: s log2(e), so that each weight is one ex2 (m, the running maximum,
    // in the same unit; lse = m ln(2) + log(l) at the end).
    const float scale2 = a.softmax_scale * 1.44269504088896341f;
    // bf16: the waits that stalled warpgroup 0 between its products are made while the tensor
    // cores work (during_scores, during_values): warpgroup 1's release of the previous P under
    // the scores, the next tile's hand-over under P V. Timestamps put about 130 cycles in the
    // first and 230 in the second (with the proxy fence after it) of a 3670-cycle tile, the
    // tensor cores idle meanwhile; dense bf16 128 heads 64 x 32K 990-992 -> 960-964 us, 8 x 32K
    // 145-147 -> 142, 64 x 128K 4411-4485 -> 4349 (docs/performance.md, run 27).
    auto scores_tile = [&](std::uint32_t k_s, const int* slots, auto&& during_scores,
                           auto&& during_values) {
      float s[32];  // s[4 jn + e]: (r0, token 8 jn + 2 (lane mod 4) + e), [+ 2]: r1
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kMlaQkDim / 16; ++ks) {
        const std::uint32_t off = std::uint32_t((ks >> 2) * kBlock + (ks & 3) * 32);
        wgmma_m64n64_qk(s, gmma_desc(qa + off, 16, 1024), gmma_desc(k_s + off, 16, 1024), ks > 0);
      }
      wgmma_commit();
      during_scores();
      wgmma_wait_all();
      float mx0 = kNegInf, mx1 = kNegInf;
#pragma unroll
      for (int jn = 0; jn < 8; ++jn) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const bool valid = slots[8 * jn + 2 * (lane & 3) + e] >= 0;
          s[4 * jn + e] = valid ? scale2 * s[4 * jn + e] : kNegInf;
          s[4 * jn + 2 + e] = valid ? scale2 * s[4 * jn + 2 + e] : kNegInf;
          mx0 = fmaxf(mx0, s[4 * jn + e]);
          mx1 = fmaxf(mx1, s[4 * jn + 2 + e]);
        }
      }
      mx0 = fmaxf(mx0, __shfl_xor_sync(kFullMask, mx0, 1));
      mx0 = fmaxf(mx0, __shfl_xor_sync(kFullMask, mx0, 2));
      mx1 = fmaxf(mx1, __shfl_xor_sync(kFullMask, mx1, 1));
      mx1 = fmaxf(mx1, __shfl_xor_sync(kFullMask, mx1, 2));
      const float mn0 = fmaxf(m_0, mx0), mn1 = fmaxf(m_1, mx1);
      const float mu0 = mn0 == kNegInf ? 0.0f : mn0;
      const float mu1 = mn1 == kNegInf ? 0.0f : mn1;
      const float al0 = ::dcpattn::detail::fast_exp2(m_0 - mu0);
      const float al1 = ::dcpattn::detail::fast_exp2(m_1 - mu1);
      float sum0 = 0.0f, sum1 = 0.0f;
      std::uint32_t pf[8][2];  // P in bf16 pairs: [jn][row r0, r1], tokens 8 jn + 2 (lane mod 4)
#pragma unroll
      for (int jn = 0; jn < 8; ++jn) {
        const float p00 = ::dcpattn::detail::fast_exp2(s[4 * jn] - mu0);
        const float p01 = ::dcpattn::detail::fast_exp2(s[4 * jn + 1] - mu0);
        const float p10 = ::dcpattn::detail::fast_exp2(s[4 * jn + 2] - mu1);
        const float p11 = ::dcpattn::detail::fast_exp2(s[4 * jn + 3] - mu1);
        sum0 += p00;
        sum0 += p01;
        sum1 += p10;
        sum1 += p11;
        pf[jn][0] = cvt_bf16x2(p00, p01);
        pf[jn][1] = cvt_bf16x2(p10, p11);
        const int tok = 8 * jn + 2 * (lane & 3);
        const std::uint32_t cb = std::uint32_t(((tok >> 3) ^ (r0 & 7)) << 4) + (tok & 7) * 2;
        // r1 = r0 + 8 has the same swizzle phase (r1 & 7 == r0 & 7).
        *reinterpret_cast<std::uint32_t*>(p_s + r0 * 128 + cb) = pf[jn][0];
        *reinterpret_cast<std::uint32_t*>(p_s + r1 * 128 + cb) = pf[jn][1];
      }
      if ((lane & 3) == 0) {
        alpha_s[r0] = al0;
        alpha_s[r1] = al1;
      }
      // (a + b) + (c + d) on every lane: float addition is commutative, so the 4 copies agree.
      sum0 += __shfl_xor_sync(kFullMask, sum0, 1);
      sum0 += __shfl_xor_sync(kFullMask, sum0, 2);
      sum1 += __shfl_xor_sync(kFullMask, sum1, 1);
      sum1 += __shfl_xor_sync(kFullMask, sum1, 2);
      l_0 = l_0 * al0 + sum0;
      l_1 = l_1 * al1 + sum1;
      m_0 = mn0;
      m_1 = mn1;
      // The bf16 path's warpgroup 1 reads P with ordinary loads, which p_full orders without a
      // proxy fence (dropped there in run 27 together with the two waits above).
      if constexpr (kFp8) fence_proxy_async();  // P, for warpgroup 1's tensor cores
      mbar_arrive(p_full);                      // P and alpha_s are in
      rescale(al0, al1);
      pv_issue(pf, k_s);  // value dims [0, 256)
      during_values();
      wgmma_wait_all();
    };
    // fp8, warpgroup 1, one tile once p_full has handed P and alpha_s over: O for dims
    // [256, 512) with P read from shared memory by the tensor cores.
    auto values_tile_ss = [&](std::uint32_t k_s) {
      rescale(alpha_s[r0], alpha_s[r1]);
      const std::uint32_t va = k_s + std::uint32_t(4 * kBlock);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kTileTokens / 16; ++kk)
        wgmma_m64n256_pv(o, gmma_desc(pa + kk * 32, 16, 1024),
                         gmma_desc(va + kk * 2048, kBlock, 1024), 1);
      wgmma_commit();
      wgmma_wait_all();
    };
    // bf16, warpgroup 1, one tile: O for dims [256, 512) from P in registers (pf, the words
    // warpgroup 0's thread of the same warp and lane wrote) and the tile's rescale factors.
    auto values_tile = [&](std::uint32_t k_s, const std::uint32_t(&pf)[8][2], float al0,
                           float al1) {
      rescale(al0, al1);
      pv_registers(pf, k_s + std::uint32_t(4 * kBlock));  // value dims [256, 512)
    };
    if constexpr (!kFp8) {
      // Two stages handed over by the producer's copies. Warpgroup 1 reads P and the rescale
      // factors into registers and frees them (p_empty) before its products; warpgroup 0 waits
      // for that only where it writes the next P, after that tile's scores, and hands the end of
      // the split (count 0) over on p_full like a P. (Warpgroup 1's products of tile i held back
      // until warpgroup 0's scores of tile i + 1 are done, to fill the tensor cores during its
      // softmax, made 64 x 32K 1087 -> 1358 us, likely because the stage of tile i is then freed
      // too late for tile i + 2's copies to land in time; docs/performance.md, run 26. Warpgroup
      // 0's scores of tile i + 1 issued right behind its P V of tile i, ahead of warpgroup 1's:
      // 989-991 -> 1626-1630 us, likely the same cause; run 27.)
      if (g == 0) {
        mbar_wait(&full[0], 0);
        fence_proxy_async();  // the tile's copies, landed, for the tensor cores
        int n_tile = count_s[0];
        for (int i = 0;; ++i) {
          const int st = i & 1;
          if (n_tile < 0) {  // tile i had not landed while P V of tile i - 1 ran
            mbar_wait(&full[st], (i >> 1) & 1);
            fence_proxy_async();
            n_tile = count_s[i % kSlotBufs];
          }
          if (n_tile == 0) {
            // Warpgroup 1 holds P of tile i - 1: p_full's next phase is free.
            if (i > 0) mbar_wait(p_empty, (i - 1) & 1);
            mbar_arrive(p_full);  // the end, to warpgroup 1
            break;
          }
          scores_tile(
              smem_u32(stage(st)), slot_s + (i % kSlotBufs) * kTileTokens,
              [&] {
                if (i > 0) mbar_wait(p_empty, (i - 1) & 1);  // warpgroup 1 holds P of tile i - 1
              },
              [&] {
                // Tile i + 1 (or the end marker), while P V of tile i runs, if it has landed;
                // else it is waited for after this tile's stage is freed (n_tile = -1): waited
                // for here unconditionally, a late tile held the stage's release back, and with
                // it the next copy (sparse bf16 128 x top-2048 183-184 -> 200-201 us).
                n_tile = -1;
                if (mbar_test(&full[st ^ 1], ((i + 1) >> 1) & 1)) {
                  fence_proxy_async();
                  n_tile = count_s[(i + 1) % kSlotBufs];
                }
              });
          mbar_arrive(&empty[st]);  // this warpgroup's reads of the stage are done
        }
      } else {
        for (int i = 0;; ++i) {
          const int st = i & 1;
          mbar_wait(p_full, i & 1);  // P and alpha_s of tile i, or the end
          if (count_s[i % kSlotBufs] == 0) break;
          std::uint32_t pf[8][2];
#pragma unroll
          for (int jn = 0; jn < 8; ++jn) {  // the words warpgroup 0 wrote (scores_tile)
            const int tok = 8 * jn + 2 * (lane & 3);
            const std::uint32_t cb = std::uint32_t(((tok >> 3) ^ (r0 & 7)) << 4) + (tok & 7) * 2;
            pf[jn][0] = *reinterpret_cast<const std::uint32_t*>(p_s + r0 * 128 + cb);
            pf[jn][1] = *reinterpret_cast<const std::uint32_t*>(p_s + r1 * 128 + cb);
          }
          const float al0 = alpha_s[r0], al1 = alpha_s[r1];
          mbar_arrive(p_empty);  // P and alpha_s are free
          values_tile(smem_u32(stage(st)), pf, al0, al1);
          mbar_arrive(&empty[st]);
        }
      }
    } else {
      // fp8: one stage, filled by all 384 threads between two CTA-wide hand-overs: tile_begin
      // (tile i's raw entries are in; every product of tile i - 1, P's reads included, is done)
      // and tile_ready (the stage holds tile i; the raw stage is free for tile i + 1's copies).
      for (int i = 0;; ++i) {
        cta_handover(&full[0], i & 1);  // tile_begin
        const int n_tile = count_s[i % kSlotBufs];
        if (n_tile == 0) break;
        if (kRawPath && a.cache_vector) {
          mbar_wait(&full[2], i & 1);  // raw_full (one raw stage): a bulk copy has landed
          dequant_tile<true>(raw_s, stage(0), smem + L::perm, tid);
        }
        fence_proxy_async();
        cta_handover(&empty[0], i & 1);                 // tile_ready
        if (i == 0 && a.q_tma) mbar_wait(&full[1], 0);  // q_full: the query block is in
        if (g == 0) {
          scores_tile(
              smem_u32(stage(0)), slot_s + (i % kSlotBufs) * kTileTokens, [] {}, [] {});
        } else {
          mbar_wait(p_full, i & 1);  // P and alpha_s of tile i
          values_tile_ss(smem_u32(stage(0)));
        }
      }
    }

    // --- The state: o = acc / l with l warpgroup 0's row sum (plus warpgroup 1's 0), lse =
    // m + log(l); l == 0 (no token) is the neutral state.
    // A split without tiles (a sparse row whose entries all belong to other splits) never waited
    // for the query's tensor copies: wait for them here, so that no CTA exits with a copy into
    // its shared memory in flight (after a tile the phase is complete and this returns at once).
    if constexpr (kFp8)
      if (a.q_tma && *q_issued_s != 0) mbar_wait(&full[1], 0);
    consumer_barrier();  // every xrow read of the last tile is done
    if ((lane & 3) == 0) {
      xrow[g * kHeads + r0] = l_0;
      xrow[g * kHeads + r1] = l_1;
    }
    consumer_barrier();
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = half ? r1 : r0;
      const int h = h0 + r;
      const bool live = h < a.heads;  // rows past the heads (a partial head block) write nothing
      const float l = xrow[r] + xrow[kHeads + r];
      const bool empty_state = l == 0.0f;
      const float inv = empty_state ? 0.0f : 1.0f / l;
      if (a.bf16_states) {
        // bf16 states: each quad writes 16 consecutive dims (32 bytes, a whole sector) a store,
        // lane l of the quad dims 4 l .. 4 l + 3 of chunks c, c + 1 (8 dims each), gathered from
        // the quad by shuffles (every lane takes part; only live rows store). Two-dim stores
        // (half sectors) made the writes slower than fp32 (docs/performance.md, run 16).
        std::uint16_t* out = state_row_bf16(a, j, t, live ? h : h0);
        const int l = lane & 3, quad = lane & ~3;
#pragma unroll
        for (int c = 0; c < 32; c += 2) {
          const std::uint32_t x0 = cvt_bf16x2(empty_state ? 0.0f : o[4 * c + 2 * half] * inv,
                                              empty_state ? 0.0f : o[4 * c + 2 * half + 1] * inv);
          const std::uint32_t x1 =
              cvt_bf16x2(empty_state ? 0.0f : o[4 * (c + 1) + 2 * half] * inv,
                         empty_state ? 0.0f : o[4 * (c + 1) + 2 * half + 1] * inv);
          // Lane l needs dims 2 (2 l mod 4) .. + 3 of chunk c + l / 2: the pairs of lanes
          // quad + (2 l mod 4) and quad + (2 l mod 4) + 1.
          const int src = quad + ((2 * l) & 3);
          const std::uint32_t a0 = __shfl_sync(kFullMask, x0, src);
          const std::uint32_t a1 = __shfl_sync(kFullMask, x0, src + 1);
          const std::uint32_t b0 = __shfl_sync(kFullMask, x1, src);
          const std::uint32_t b1 = __shfl_sync(kFullMask, x1, src + 1);
          if (live)
            *reinterpret_cast<uint2*>(out + 256 * g + 8 * c + 4 * l) =
                l < 2 ? make_uint2(a0, a1) : make_uint2(b0, b1);
        }
      }
      if (!live) continue;
      const StateRow out = state_row(a, j, t, h);
      if (!a.bf16_states) {
#pragma unroll
        for (int c = 0; c < 32; ++c) {
          out.put2(256 * g + 8 * c + 2 * (lane & 3), empty_state ? 0.0f : o[4 * c + 2 * half] * inv,
                   empty_state ? 0.0f : o[4 * c + 2 * half + 1] * inv);
        }
      }
      if (g == 0 && (lane & 3) == 0) {
        const float lse =
            empty_state ? kNegInf : (half ? m_1 : m_0) * ::dcpattn::detail::kLn2 + logf(l);
        out.put_lse(lse);
      }
    }
  }
}
}  // namespace wg

// ---------------------------------------------------------------------------------------------
// Host side

/// The query as the kernels read it: a QDesc for bf16 strided or rank-major views, else the view.
template <class QView>
auto make_q_source(const QView& q) {
  static_assert(QView::rank() == 3, "dcpattn: q must be a rank-3 view (tokens, heads, 576)");
  using E = std::remove_cv_t<typename QView::element_type>;
  static_assert(std::is_same_v<E, bfloat16> || std::is_same_v<E, float>,
                "dcpattn: the CUDA MLA decode reads q as dcpattn::bfloat16 (or float, rounded to "
                "bfloat16)");
  constexpr bool kDefaultAccessor =
      std::is_same_v<typename QView::accessor_type,
                     cuda::std::default_accessor<typename QView::element_type>>;
  const std::int64_t heads = q.extent(1) > 0 ? std::int64_t(q.extent(1)) : 1;
  if constexpr (std::is_same_v<E, bfloat16> && kDefaultAccessor &&
                QView::mapping_type::is_always_strided()) {
    return QDesc{q.data_handle(),           std::int64_t(q.stride(0)),
                 std::int64_t(q.stride(1)), 0,
                 std::int64_t(q.stride(2)), heads};
  } else if constexpr (std::is_same_v<E, bfloat16> && kDefaultAccessor &&
                       std::is_same_v<typename QView::layout_type, LayoutRankMajorHeads>) {
    const std::int64_t hl = std::int64_t(q.mapping().heads_per_rank());
    DCPATTN_REQUIRE(hl >= 1,
                    "q (rank-major) must have heads_per_rank >= 1, got " + std::to_string(hl));
    const std::int64_t d = q.extent(2), t = q.extent(0);
    return QDesc{q.data_handle(), hl * d, d, t * hl * d, 1, hl};
  } else {
    return GenericQ<QView>{q};
  }
}

/// True when the cache rows can be read as 16-byte vectors (strided view, contiguous aligned rows).
template <class CacheView>
bool cache_vector_path(const CacheView& cache) {
  if constexpr (!is_plain_strided_v<CacheView>) {
    return false;
  } else {
    constexpr CacheFormat f = mla_cache_format_v<CacheView>;
    const std::int64_t row_align = f == CacheFormat::bf16 ? 8 : 16;  // elements per 16 bytes
    return cache.extent(0) > 0 && cache.stride(1) == 1 && cache.stride(0) % row_align == 0 &&
           reinterpret_cast<std::uintptr_t>(cache.data_handle()) % 16 == 0;
  }
}

inline std::string shape3(std::int64_t a, std::int64_t b, std::int64_t c) {
  return "(" + std::to_string(a) + ", " + std::to_string(b) + ", " + std::to_string(c) + ")";
}

/// Bytes of the split states for T tokens, H heads, S splits (0 when S == 1: direct write).
inline std::size_t split_state_bytes(std::int64_t tokens, std::int64_t heads, int num_splits) {
  if (num_splits <= 1) return 0;
  return std::size_t(num_splits) * std::size_t(tokens) * std::size_t(heads) *
         std::size_t(kMlaVDim + 1) * sizeof(float);
}

/// Raises `kernel`'s dynamic shared-memory limit to `smem` on the current device, once per device
/// (bit d of `configured`, one per kernel; devices beyond 63 set it at every launch). Not a stream
/// operation: launches stay graph-capturable.
template <class Kernel>
void raise_smem_limit(Kernel kernel, std::size_t smem,
                      std::atomic<unsigned long long>& configured) {
  int device = 0;
  DCPATTN_CUDA_CHECK(cudaGetDevice(&device));
  const unsigned long long bit = device < 64 ? (1ull << device) : 0ull;
  if (bit == 0 || (configured.load(std::memory_order_relaxed) & bit) == 0) {
    DCPATTN_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    configured.fetch_or(bit, std::memory_order_relaxed);
  }
}

/// Launches one of this file's kernels on `stream`; with `dependent`, on a compute capability 9.x
/// device, as a programmatic dependent of the kernel before it on the stream (every kernel here
/// begins with pdl_wait), so that its launch overlaps that kernel's tail.
template <class... Params, class... Args>
void launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem,
                      cudaStream_t stream, bool dependent, const Args&... args) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &attr;
  config.numAttrs = dependent && device_cc_major() == 9 ? 1 : 0;
  DCPATTN_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, args...));
}

template <int HT, bool kSparse, class QSrc, class CacheView, class Own>
void launch_split_ht(const SplitArgs<QSrc, CacheView, Own>& args, cudaStream_t stream) {
  auto kernel = &mla_split_kernel<HT, kSparse, QSrc, CacheView, Own>;
  constexpr std::size_t smem = SplitSmem<HT>::bytes;
  static std::atomic<unsigned long long> configured{0};
  raise_smem_limit(kernel, smem, configured);
  const int head_blocks = (args.heads + 16 * HT - 1) / (16 * HT);
  const dim3 grid(unsigned(args.tokens), unsigned(args.num_splits * head_blocks));
  launch_dependent(kernel, grid, dim3(kThreads), smem, stream, /*dependent=*/true, args);
}

/// Head block of a launch: 16 heads when H <= 16, else 64.
inline int head_tiles_for(int heads) {
  return heads <= 16 ? 1 : 4;
}

/// One block of kRows heads per CTA, 1-D grid.
template <int kRows, bool kSparse, bool kTma = false, bool kTableRing = false, class QSrc,
          class CacheView, class Own>
void launch_wg_rows(const SplitArgs<QSrc, CacheView, Own>& args, cudaStream_t stream,
                    const CacheTensorMap<kTma>& tensor_map = {}) {
  auto kernel = &wg::mla_wg_kernel<kRows, kSparse, kTma, kTableRing, QSrc, CacheView, Own>;
  using L = wg::Smem<mla_cache_format_v<CacheView> == CacheFormat::fp8_ds_mla, kRows>;
  constexpr std::size_t smem = L::bytes;
  static std::atomic<unsigned long long> configured{0};
  raise_smem_limit(kernel, smem, configured);
  const std::int64_t head_blocks = (args.heads + kRows - 1) / kRows;
  const std::int64_t blocks = args.tokens * args.num_splits * head_blocks;
  launch_dependent(kernel, dim3(unsigned(blocks)), dim3(unsigned(L::threads)), smem, stream,
                   /*dependent=*/true, args, tensor_map);
}

/// The warpgroup kernel: one CTA per (row, split, block of heads); the narrow (transposed) one
/// when H <= 16, else one per 64 heads.
template <bool kSparse, class QSrc, class CacheView, class Own>
void launch_wg(const SplitArgs<QSrc, CacheView, Own>& args, cudaStream_t stream) {
  if (args.heads <= wg::kNarrowHeads)
    launch_wg_rows<wg::kNarrowHeads, kSparse>(args, stream);
  else
    launch_wg_rows<wg::kHeads, kSparse>(args, stream);
}

/// Set by the tests and benchmarks only: run mla_split_kernel (mma.sync) on every device, so that
/// the kernel compute capability 8.x devices use is checked and measured on a 9.x device too.
inline std::atomic<bool> force_mma_sync_kernel{false};

/// True when the current device runs the warpgroup (wgmma) kernel: compute capability 9.x.
/// Other devices (8.x) run mla_split_kernel (mma.sync).
inline bool use_wgmma_kernel() {
  if (force_mma_sync_kernel.load(std::memory_order_relaxed)) return false;
  return device_cc_major() == 9;
}

template <bool kSparse, class QSrc, class CacheView, class Own>
void launch_split(const SplitArgs<QSrc, CacheView, Own>& args, cudaStream_t stream) {
  if (args.wgmma)
    launch_wg<kSparse>(args, stream);
  else if (head_tiles_for(args.heads) == 1)
    launch_split_ht<1, kSparse>(args, stream);
  else
    launch_split_ht<4, kSparse>(args, stream);
}

/// Host checks shared by dense and sparse (no device memory is read). Throws dcpattn::Error.
template <class QView, class CacheView>
void validate_common(const QView& q, const CacheView& cache,
                     TensorView<const std::int32_t, 2> block_table,
                     TensorView<const std::int32_t, 1> row_request, const MlaDecodeParams& p,
                     TensorView<float, 3> o, TensorView<float, 2> lse,
                     cuda::std::span<std::byte> scratch) {
  dcpattn::detail::validate_mla_extents(q, cache, row_request, p, o, lse);
  const std::int64_t t = q.extent(0);
  const std::int64_t h = q.extent(1);
  DCPATTN_REQUIRE(block_table.extent(0) >= 0 && block_table.extent(1) >= 0,
                  "block_table must be (num_requests, max_pages)");
  DCPATTN_REQUIRE(p.num_splits <= kMaxSplits, "num_splits (" + std::to_string(p.num_splits) +
                                                  ") must be a power of two in [1, " +
                                                  std::to_string(kMaxSplits) + "]");
  DCPATTN_REQUIRE(t <= std::int64_t(INT_MAX),
                  "tokens (" + std::to_string(t) + ") must be at most " + std::to_string(INT_MAX));
  const std::int64_t head_blocks = h <= 16 ? 1 : (h + 63) / 64;  // see head_tiles_for
  DCPATTN_REQUIRE(std::int64_t(p.num_splits) * head_blocks <= 65535,
                  "num_splits (" + std::to_string(p.num_splits) + ") times head blocks of heads (" +
                      std::to_string(h) + ") exceeds the grid limit (65535)");
  DCPATTN_REQUIRE(t * std::int64_t(p.num_splits) * ((h + 63) / 64) <= std::int64_t(INT_MAX),
                  "tokens (" + std::to_string(t) + ") times num_splits (" +
                      std::to_string(p.num_splits) + ") times head blocks exceeds the grid limit");
  DCPATTN_REQUIRE(t * h <= std::int64_t(INT_MAX),
                  "tokens (" + std::to_string(t) + ") times heads (" + std::to_string(h) +
                      ") exceeds the grid limit of the split merge (2^31 - 1)");
  DCPATTN_REQUIRE(cache.extent(0) <= std::int64_t(INT_MAX),
                  "cache has " + std::to_string(cache.extent(0)) +
                      " slots; the CUDA kernels address at most 2^31 - 1");
  const std::size_t need = split_state_bytes(t, h, p.num_splits);
  DCPATTN_REQUIRE(scratch.size() >= need,
                  "scratch has " + std::to_string(scratch.size()) + " bytes, but " +
                      std::to_string(need) + " are needed (mla_decode_scratch_bytes(tokens = " +
                      std::to_string(t) + ", heads = " + std::to_string(h) +
                      ", num_splits = " + std::to_string(p.num_splits) + "))");
  DCPATTN_REQUIRE(need == 0 || reinterpret_cast<std::uintptr_t>(scratch.data()) % 16 == 0,
                  "scratch must be 16-byte aligned");
}

/// The driver's cuTensorMapEncodeTiled, found once through the runtime (no driver library is
/// linked); nullptr when the driver does not provide it (the callers then take cp.async).
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  using Encode = PFN_cuTensorMapEncodeTiled_v12000;
  static const Encode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return Encode(nullptr);
    }
    return reinterpret_cast<Encode>(fn);
  }();
  return encode;
}

/// Describes a bf16 cache (rows x 576, rows 16-byte aligned, `row_stride` elements apart) for
/// the tensor memory accelerator: 64 x 64 boxes with the 128-byte swizzle, the layout the tensor
/// cores read. False when the driver's encoder is unavailable or refuses the tensor; the kernel
/// then copies with cp.async. A host function (no stream work): launches stay capturable.
inline bool encode_cache_map(CUtensorMap& map, const void* base, std::int64_t rows,
                             std::int64_t row_stride) {
  const auto encode = tensor_map_encoder();
  if (encode == nullptr || rows <= 0 || rows > (std::int64_t(1) << 32)) return false;
  const cuuint64_t dims[2] = {cuuint64_t(kMlaQkDim), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(row_stride) * 2};  // bytes between rows
  const cuuint32_t box[2] = {64, cuuint32_t(kTileTokens)};
  const cuuint32_t elem[2] = {1, 1};
  return encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides,
                box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

/// Encodes q as a (576, heads, tokens) bf16 tensor in boxes of 64 dims x 64 heads x 1 token, with
/// the 128-byte swizzle of the query block (heads past `heads` read as zeros); false when the
/// query cannot be read so (dims not contiguous, a rank-major view of several ranks, unaligned
/// base or strides) or no encoder is found.
inline bool encode_query_map(CUtensorMap& map, const QDesc& q, std::int64_t tokens, int heads) {
  const auto encode = tensor_map_encoder();
  const auto aligned = [](std::int64_t stride) {
    return stride > 0 && (stride * 2) % 16 == 0 && stride * 2 < (std::int64_t(1) << 40);
  };
  if (encode == nullptr || tokens <= 0 || heads <= 0 || tokens > (std::int64_t(1) << 31) ||
      q.sd != 1 || q.hl < heads || !aligned(q.sh) || !aligned(q.st) ||
      reinterpret_cast<std::uintptr_t>(q.data) % 16 != 0)
    return false;
  const cuuint64_t dims[3] = {cuuint64_t(kMlaQkDim), cuuint64_t(heads), cuuint64_t(tokens)};
  const cuuint64_t strides[2] = {cuuint64_t(q.sh) * 2, cuuint64_t(q.st) * 2};  // bytes
  const cuuint32_t box[3] = {64, cuuint32_t(wg::kHeads), 1};
  const cuuint32_t elem[3] = {1, 1, 1};
  return encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<bfloat16*>(q.data), dims,
                strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

/// The fp8 kernel of 64 heads copies the query block with tensor copies where q allows it
/// (SplitArgs::q_tma).
template <class QSrc, class CacheView, class Own>
void set_query_map(SplitArgs<QSrc, CacheView, Own>& a) {
  a.q_tma = false;
  if constexpr (std::is_same_v<QSrc, QDesc> &&
                mla_cache_format_v<CacheView> == CacheFormat::fp8_ds_mla) {
    if (a.heads > wg::kNarrowHeads && a.wgmma)
      a.q_tma = encode_query_map(a.q_map, a.q, a.tokens, a.heads);
  }
}

/// Whether a call's split states are bf16 (SplitArgs::bf16_states): the option asked for
/// (MlaDecodeParams::bf16_split_states), splits to merge, and the 64-head warpgroup kernels
/// (`wgmma`, more than kNarrowHeads heads), the only writers of bf16 states.
inline bool bf16_states_taken(const MlaDecodeParams& p, std::int64_t heads, bool wgmma) {
  return p.bf16_split_states && p.num_splits > 1 && wgmma && heads > wg::kNarrowHeads;
}

template <class QSrc, class CacheView, class Own>
void fill_common(SplitArgs<QSrc, CacheView, Own>& a, const CacheView& cache,
                 TensorView<const std::int32_t, 2> block_table,
                 TensorView<const std::int32_t, 1> row_request, const MlaDecodeParams& p,
                 TensorView<float, 3> o, TensorView<float, 2> lse, std::int64_t tokens, int heads,
                 cuda::std::span<std::byte> scratch) {
  a.cache = cache;
  a.block_table = block_table;
  a.row_request = row_request;
  a.o = o;
  a.lse = lse;
  a.tokens = tokens;
  a.heads = heads;
  a.num_valid_rows = p.num_valid_rows;
  a.num_splits = p.num_splits;
  a.interleave = p.interleave;
  a.page_size = p.page_size;
  a.softmax_scale = p.softmax_scale;
  a.cache_vector = cache_vector_path(cache);
  a.wgmma = use_wgmma_kernel();
  a.raw_bulk = false;  // dense_splits sets it where it applies
  a.bf16_states = bf16_states_taken(p, heads, a.wgmma);
  a.rank = 0;
  a.error_flags = p.error_flags;
  if (p.num_splits > 1) {
    a.scratch_o = reinterpret_cast<float*>(scratch.data());
    a.scratch_lse = a.scratch_o +
                    std::size_t(p.num_splits) * std::size_t(tokens) * std::size_t(heads) * kMlaVDim;
  } else {
    a.scratch_o = nullptr;
    a.scratch_lse = nullptr;
  }
}

/// Launches the merge kernel of `count` states (count, T, H, 512) + (count, T, H); count is a
/// power of two in [1, 64] (checked by the callers; 1 copies the state); 2, 4 and 8 states take
/// mla_merge_row_kernel, more mla_merge_kernel (the same bits either way). `after_split`: the
/// previous operation on `stream` is the split kernel that wrote the states; on a compute
/// capability 9.x device the merge is then launched as its programmatic dependent (pdl_wait).
template <class T>
void launch_merge_of(const T* states_o, const float* states_lse, int count, std::int64_t tokens,
                     int heads, int num_valid_rows, TensorView<float, 3> o,
                     TensorView<float, 2> lse, cudaStream_t stream, bool after_split) {
  const std::int64_t rows = tokens * std::int64_t(heads);
  if (rows == 0) return;
  const dim3 grid = dim3(unsigned(rows));
  if (count == 2 || count == 4 || count == 8) {
    const bool vec_out = o.stride(2) == 1 && o.stride(1) % 4 == 0 && o.stride(0) % 4 == 0 &&
                         reinterpret_cast<std::uintptr_t>(o.data_handle()) % 16 == 0;
    switch (count) {
#define DCPATTN_MLA_MERGE_ROW_CASE(S)                                                          \
  case S:                                                                                      \
    launch_dependent(&mla_merge_row_kernel<S, T>, grid, dim3(kMergeRowThreads), 0, stream,     \
                     after_split, states_o, states_lse, tokens, heads, num_valid_rows, o, lse, \
                     vec_out);                                                                 \
    break;
      DCPATTN_MLA_MERGE_ROW_CASE(2)
      DCPATTN_MLA_MERGE_ROW_CASE(4)
      DCPATTN_MLA_MERGE_ROW_CASE(8)
#undef DCPATTN_MLA_MERGE_ROW_CASE
    }
    return;
  }
  switch (count) {
#define DCPATTN_MLA_MERGE_CASE(S)                                                           \
  case S:                                                                                   \
    launch_dependent(&mla_merge_kernel<S, T>, grid, dim3(kMlaVDim), 0, stream, after_split, \
                     states_o, states_lse, tokens, heads, num_valid_rows, o, lse);          \
    break;
    DCPATTN_MLA_MERGE_CASE(1)
    DCPATTN_MLA_MERGE_CASE(16)
    DCPATTN_MLA_MERGE_CASE(32)
    DCPATTN_MLA_MERGE_CASE(64)
#undef DCPATTN_MLA_MERGE_CASE
    default:
      throw Error("dcpattn: launch_merge: count (" + std::to_string(count) +
                  ") must be a power of two in [1, 64]");
  }
}

/// `bf16_states`: the states' values are bf16 (SplitArgs::bf16_states, as dense_splits and
/// sparse_splits return it), in the first half of the fp32 layout's bytes: state k of row (t, h)
/// at element ((k T + t) H + h) 512; the lse values stay fp32.
inline void launch_merge(const float* states_o, const float* states_lse, int count,
                         std::int64_t tokens, int heads, int num_valid_rows, TensorView<float, 3> o,
                         TensorView<float, 2> lse, cudaStream_t stream, bool after_split = false,
                         bool bf16_states = false) {
  if (bf16_states)
    launch_merge_of(reinterpret_cast<const std::uint16_t*>(states_o), states_lse, count, tokens,
                    heads, num_valid_rows, o, lse, stream, after_split);
  else
    launch_merge_of(states_o, states_lse, count, tokens, heads, num_valid_rows, o, lse, stream,
                    after_split);
}

}  // namespace detail::mla

/// Bytes of device scratch mla_decode_dense / mla_decode_sparse need for up to `max_tokens` rows
/// of `heads` heads and `num_splits` local splits: the fp32 split states (S, T, H, 512) and their
/// lse (S, T, H); 0 when num_splits == 1 (the single state is written to the output directly).
/// Throws dcpattn::Error on a negative count or a num_splits that is not a power of two <= 64.
inline std::size_t mla_decode_scratch_bytes(std::int64_t max_tokens, int heads, int num_splits) {
  DCPATTN_REQUIRE(max_tokens >= 0, "max_tokens (" + std::to_string(max_tokens) + ") must be >= 0");
  DCPATTN_REQUIRE(heads >= 0, "heads (" + std::to_string(heads) + ") must be >= 0");
  DCPATTN_REQUIRE(is_power_of_two(num_splits) && num_splits <= detail::mla::kMaxSplits,
                  "num_splits (" + std::to_string(num_splits) + ") must be a power of two in [1, " +
                      std::to_string(detail::mla::kMaxSplits) + "]");
  return detail::mla::split_state_bytes(max_tokens, heads, num_splits);
}

/// Fast mode's split count: the largest power of two S (at most 64) for which `tokens` rows of
/// `heads` heads still run in one wave on `sm_count` multiprocessors (T x head blocks x S CTAs,
/// one CTA per multiprocessor), without cutting a row's `attended` local tokens (its longest
/// local length, or its top-k count) into splits of fewer than 128 tokens (2 tiles); 1 when the
/// rows alone fill the GPU. One wave, not the first S that fills it: a second, nearly full wave
/// of CTAs half as long costs the same time plus twice the split states to write and merge (and,
/// sparse with splits of positions, twice the top-k scans); on the H200 at 32K tokens the rule is
/// worth 269 -> 315 TFLOP/s at batch 8 and 128 heads. The minimum of 128 tokens (256 before run
/// 25): H200, 128 heads, batch 1, fp32 split states: dense bf16 4K 23.9 -> 20.2 us (S = 16 ->
/// 32; 22.1 at S = 64), sparse bf16 top-2048 with list splits 26.5 -> 20.3 (S = 8 -> 16).
/// Deterministic mode must not use this: there S = V / N is part of the numerical contract (see
/// the file comment).
inline int mla_decode_fast_splits(std::int64_t tokens, int heads, std::int64_t attended,
                                  int sm_count) {
  DCPATTN_REQUIRE(tokens >= 0 && heads >= 1 && attended >= 0 && sm_count >= 1,
                  "mla_decode_fast_splits: tokens, attended >= 0, heads, sm_count >= 1 required");
  const std::int64_t head_blocks = (heads + 63) / 64;  // one CTA (of one per SM) per 64 heads
  int s = 1;
  while (s < detail::mla::kMaxSplits && tokens * head_blocks * (2 * s) <= sm_count &&
         attended >= std::int64_t(2 * s) * detail::mla::kMinSplitTokens)
    s *= 2;
  return s;
}

namespace detail::mla {

/// The split stage of mla_decode_dense alone: with num_splits > 1 it leaves the split states in
/// scratch ((S, T, H, 512) fp32 then (S, T, H) lse, natural log; padding rows not written) and
/// does not touch o/lse; with num_splits == 1 it writes o/lse. Same arguments and checks as
/// mla_decode_dense. Returns whether the states' values were written as bf16 instead
/// (SplitArgs::bf16_states: only with p.bf16_split_states).
template <class QView, class CacheView>
bool dense_splits(const QView& q, const CacheView& cache,
                  TensorView<const std::int32_t, 2> block_table,
                  TensorView<const std::int32_t, 1> row_request,
                  TensorView<const std::int64_t, 1> row_local_length, const MlaDecodeParams& p,
                  TensorView<float, 3> o, TensorView<float, 2> lse,
                  cuda::std::span<std::byte> scratch, cudaStream_t stream) {
  validate_common(q, cache, block_table, row_request, p, o, lse, scratch);
  DCPATTN_REQUIRE(row_local_length.extent(0) == q.extent(0),
                  "row_local_length has " + std::to_string(row_local_length.extent(0)) +
                      " rows, but q has " + std::to_string(q.extent(0)) + " tokens");
  const std::int64_t tokens = q.extent(0);
  if (tokens == 0) return false;
  auto qs = make_q_source(q);
  SplitArgs<decltype(qs), CacheView, NoOwnership> a{};
  a.q = qs;
  fill_common(a, cache, block_table, row_request, p, o, lse, tokens, int(q.extent(1)), scratch);
  a.row_local_length = row_local_length;
  set_query_map(a);
  // Tensor copies (the 64-head kernels) where a split's tiles are runs of 64 consecutive
  // positions in one page: one split, or an interleave that is a multiple of 64, and pages of a
  // multiple of 64 tokens. The kernels rely on this to check a tile by its first and last slots
  // (a tile spanning pages could have them 63 apart with other pages between). Elsewhere (e.g.
  // the 64 splits of interleave 1 at batch 1) tiles are never consecutive. bf16: the kernels
  // with the tensor copies (kTma), separate instantiations; fp8: one bulk copy per raw tile
  // (raw_bulk) where the cache's entries are contiguous rows.
  const bool page_runs = a.cache_vector && a.wgmma && p.page_size % kTileTokens == 0 &&
                         (p.num_splits == 1 || p.interleave % kTileTokens == 0);
  if constexpr (is_plain_strided_v<CacheView> &&
                mla_cache_format_v<CacheView> == CacheFormat::fp8_ds_mla) {
    a.raw_bulk = page_runs && cache.stride(0) == wg::kRawEntry;
    // The 16-head kernel with the block-table ring (mla_wg_kernel's table_chunk), a separate
    // instantiation, where a split's runs of positions lie 8 pages apart or more (S > 1, S x I
    // >= 8 pages: consecutive tiles' entries at least 32 bytes apart where I is one tile) and
    // the grid covers at least 3/4 of the multiprocessors. H200 (docs/performance.md, run 20):
    // 8 x 32K (S = 16, 128 CTAs) 67.7 -> 61.8 us, 8 x 128K 211.8 -> 201.2. Where the entries
    // share lines (S = 2) the ring cost 5-10%, and with 64 CTAs (1 x 128K, S = 64) 2%.
    const std::int64_t ctas = tokens * p.num_splits;
    if (a.raw_bulk && a.heads <= wg::kNarrowHeads && p.num_splits > 1 &&
        std::int64_t(p.num_splits) * p.interleave >= 8LL * p.page_size &&
        4 * ctas >= 3 * std::int64_t(device_sm_count())) {
      launch_wg_rows<wg::kNarrowHeads, false, false, true>(a, stream);
      return a.bf16_states;
    }
  }
  if constexpr (is_plain_strided_v<CacheView> &&
                mla_cache_format_v<CacheView> == CacheFormat::bf16) {
    if (page_runs) {
      CacheTensorMap<true> tm;
      if (encode_cache_map(tm.map, cache.data_handle(), cache.extent(0), cache.stride(0))) {
        if (a.heads <= wg::kNarrowHeads)
          launch_wg_rows<wg::kNarrowHeads, false, true>(a, stream, tm);
        else
          launch_wg_rows<wg::kHeads, false, true>(a, stream, tm);
        return a.bf16_states;
      }
    }
  }
  launch_split<false>(a, stream);
  return a.bf16_states;
}

/// The split stage of mla_decode_sparse alone (see dense_splits; the same return value).
template <class QView, class CacheView, class Ownership>
bool sparse_splits(const QView& q, const CacheView& cache,
                   TensorView<const std::int32_t, 2> block_table,
                   TensorView<const std::int32_t, 1> row_request,
                   TensorView<const std::int32_t, 2> topk,
                   TensorView<const std::int64_t, 1> row_bound, const Ownership& own, int rank,
                   const MlaDecodeParams& p, TensorView<float, 3> o, TensorView<float, 2> lse,
                   cuda::std::span<std::byte> scratch, cudaStream_t stream) {
  static_assert(SlotOwnership<Ownership>, DCPATTN_SLOT_OWNERSHIP_MESSAGE);
  validate_common(q, cache, block_table, row_request, p, o, lse, scratch);
  dcpattn::detail::validate_mla_sparse_extents(q, topk, row_bound, own, rank, p);
  const std::int64_t tokens = q.extent(0);
  if (tokens == 0) return false;
  auto qs = make_q_source(q);
  SplitArgs<decltype(qs), CacheView, Ownership> a{};
  a.q = qs;
  fill_common(a, cache, block_table, row_request, p, o, lse, tokens, int(q.extent(1)), scratch);
  a.topk = topk;
  a.row_bound = row_bound;
  a.own = own;
  a.rank = rank;
  a.split_list = p.split_topk_list && p.num_splits > 1;
  a.split_mask = a.split_list ? 0u : std::uint32_t(p.num_splits - 1);
  // The kernels compute a local position's page in 32 bits (mla_wg_kernel's read_page).
  DCPATTN_REQUIRE(block_table.extent(1) <= std::int64_t(INT32_MAX) / p.page_size,
                  "block_table has " + std::to_string(block_table.extent(1)) +
                      " pages a request; the CUDA sparse kernels address at most 2^31 - 1 local "
                      "positions (" +
                      std::to_string(std::int64_t(INT32_MAX) / p.page_size) + " pages of " +
                      std::to_string(p.page_size) + ")");
  set_query_map(a);
  launch_split<true>(a, stream);
  return a.bf16_states;
}

/// Merges `count` stacked states along tree_merge's tree, with the arithmetic of the
/// split merge (and of the CUDA combine): states_o (count, T, H, 512) fp32, states_lse
/// (count, T, H) natural log, contiguous; writes the merged state to o (T, H, 512) and
/// lse (T, H); rows t >= num_valid_rows get the neutral state and their states are not read.
/// count: a power of two in [1, 64].
inline void merge_states(const float* states_o, const float* states_lse, int count,
                         std::int64_t tokens, int heads, int num_valid_rows, TensorView<float, 3> o,
                         TensorView<float, 2> lse, cudaStream_t stream) {
  DCPATTN_REQUIRE(is_power_of_two(count) && count <= kMaxSplits,
                  "count (" + std::to_string(count) + ") must be a power of two in [1, " +
                      std::to_string(kMaxSplits) + "]");
  DCPATTN_REQUIRE(tokens >= 0 && heads >= 0 && num_valid_rows >= 0 && num_valid_rows <= tokens,
                  "merge_states: bad tokens/heads/num_valid_rows");
  DCPATTN_REQUIRE(o.extent(0) == tokens && o.extent(1) == heads && o.extent(2) == kMlaVDim,
                  "o must be " + shape3(tokens, heads, kMlaVDim) + ", got " +
                      shape3(o.extent(0), o.extent(1), o.extent(2)));
  DCPATTN_REQUIRE(lse.extent(0) == tokens && lse.extent(1) == heads, "lse must be (tokens, heads)");
  launch_merge(states_o, states_lse, count, tokens, heads, num_valid_rows, o, lse, stream);
}

}  // namespace detail::mla

/// Dense paged MLA decode over THIS rank's local KV shard on the GPU; writes the merged local
/// partial state. Semantics of dcpattn::host::mla_decode_dense (see the file comment for the
/// numerics and for the data-dependent checks made in the kernel instead of on the host).
///
/// @tparam QView     rank-3 mdspan of bfloat16 (or float, rounded to bf16), any layout; strided
///                   and LayoutRankMajorHeads views are read in place with 16-byte copies when
///                   the head dim is contiguous and 16-byte aligned
/// @tparam CacheView mla_cache_view_t<CacheFormat::bf16> (num_slots, 576) or
///                   mla_cache_view_t<CacheFormat::fp8_ds_mla> (num_slots, 656)
/// @param q                (tokens, heads, 576) device queries: latent-absorbed part then RoPE
/// @param cache            the local paged MLA cache (device)
/// @param block_table      (num_requests, max_pages) LOCAL page ids of each request (device)
/// @param row_request      (tokens,) request of each row (device)
/// @param row_local_length (tokens,) how many of this rank's tokens the row attends (device)
/// @param p                softmax scale, page size, interleave, splits (power of two <= 64),
///                         valid rows
/// @param o                (tokens, heads, 512) fp32 output (device): softmax-weighted values
/// @param lse              (tokens, heads) fp32 output (device): natural-log sum of exp(scores)
/// @param scratch          device scratch of at least mla_decode_scratch_bytes(tokens, heads,
///                         p.num_splits) bytes, 16-byte aligned, not overlapping the outputs
/// @param stream           the stream everything is enqueued on
/// A row with no local token, and every padding row t >= p.num_valid_rows, gets the neutral state
/// (o = 0, lse = -inf); nothing of a padding row is read. Throws dcpattn::Error naming the
/// parameter on bad extents or parameters, before anything is enqueued.
template <class QView, class CacheView>
void mla_decode_dense(const QView& q, const CacheView& cache,
                      TensorView<const std::int32_t, 2> block_table,
                      TensorView<const std::int32_t, 1> row_request,
                      TensorView<const std::int64_t, 1> row_local_length, const MlaDecodeParams& p,
                      TensorView<float, 3> o, TensorView<float, 2> lse,
                      cuda::std::span<std::byte> scratch, cudaStream_t stream) {
  const bool bf16_states = detail::mla::dense_splits(q, cache, block_table, row_request,
                                                     row_local_length, p, o, lse, scratch, stream);
  if (p.num_splits > 1 && q.extent(0) > 0) {
    float* so = reinterpret_cast<float*>(scratch.data());
    float* sl = so + std::size_t(p.num_splits) * std::size_t(q.extent(0)) *
                         std::size_t(q.extent(1)) * kMlaVDim;
    detail::mla::launch_merge(so, sl, p.num_splits, q.extent(0), int(q.extent(1)), p.num_valid_rows,
                              o, lse, stream, /*after_split=*/true, bf16_states);
  }
}

/// Sparse (top-k, DSA) MLA decode over THIS rank's local KV shard on the GPU; writes the merged
/// local state. Semantics of dcpattn::host::mla_decode_sparse: each row lists GLOBAL positions
/// (any order, -1 = none, duplicates attended as listed); the rank keeps those it owns
/// (own.owner(g) == rank) at local position own.local_position(g), split
/// (local position / I) mod S, in list order. An entry < 0 or >= row_bound[t] is treated as -1;
/// one < -1 or >= row_bound[t] also sets input_error_topk in *p.error_flags (when not null).
///
/// @tparam Ownership a SlotOwnership model whose owner() and local_position() are callable on the
///                   device (e.g. RoundRobinOwnership); when it has interleave(), it must equal
///                   p.interleave
/// @param topk      (tokens, k) global positions, -1 = none (device)
/// @param row_bound (tokens,) global causal bound of each row (device)
/// @param own, rank the ownership policy and this rank's index in [0, own.group_size())
/// Other parameters, outputs, scratch and the neutral state as for mla_decode_dense.
template <class QView, class CacheView, class Ownership>
void mla_decode_sparse(const QView& q, const CacheView& cache,
                       TensorView<const std::int32_t, 2> block_table,
                       TensorView<const std::int32_t, 1> row_request,
                       TensorView<const std::int32_t, 2> topk,
                       TensorView<const std::int64_t, 1> row_bound, const Ownership& own, int rank,
                       const MlaDecodeParams& p, TensorView<float, 3> o, TensorView<float, 2> lse,
                       cuda::std::span<std::byte> scratch, cudaStream_t stream) {
  const bool bf16_states = detail::mla::sparse_splits(
      q, cache, block_table, row_request, topk, row_bound, own, rank, p, o, lse, scratch, stream);
  if (p.num_splits > 1 && q.extent(0) > 0) {
    float* so = reinterpret_cast<float*>(scratch.data());
    float* sl = so + std::size_t(p.num_splits) * std::size_t(q.extent(0)) *
                         std::size_t(q.extent(1)) * kMlaVDim;
    detail::mla::launch_merge(so, sl, p.num_splits, q.extent(0), int(q.extent(1)), p.num_valid_rows,
                              o, lse, stream, /*after_split=*/true, bf16_states);
  }
}

}  // namespace cuda_kernels

DCPATTN_NAMESPACE_END
