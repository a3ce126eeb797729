// SPDX-License-Identifier: Apache-2.0
// The CUDA execution space: every step of a DCP forward as a stream-ordered kernel on device
// memory.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>

#include <cuda_runtime.h>
#include <cuda/std/span>

#include "dcpattn/config.hpp"
#include "dcpattn/core/lse.hpp"
#include "dcpattn/core/numeric.hpp"
#include "dcpattn/core/tensor.hpp"
#include "dcpattn/error.hpp"
#include "dcpattn/kernels/cuda/combine.cuh"
#include "dcpattn/kernels/cuda/device.cuh"
#include "dcpattn/kernels/cuda/mla_decode.cuh"
#include "dcpattn/kernels/host/combine.hpp"
#include "dcpattn/kernels/mla_kernel.hpp"
#include "dcpattn/op/config.hpp"

DCPATTN_NAMESPACE_BEGIN

/// Execution space that runs every step of a DCP forward on the current CUDA device: the same
/// members as HostExecution, each a kernel enqueued on the given stream. All tensors (views,
/// workspace, buffers) are device memory. No member allocates or synchronizes with the host, so a
/// forward with a stream-ordered communicator (NcclCommunicator, CudaSelfCommunicator) can be
/// captured in a CUDA graph. Argument checks throw dcpattn::Error before anything is enqueued;
/// a launch failure is raised as dcpattn::Error naming the kernel.
///
/// Numerics: the combine steps compute what the host steps compute, with the same fp32
/// operations in the same order (see dcpattn/kernels/cuda/combine.cuh); results are bitwise
/// reproducible run to run and, in deterministic mode, independent of the group size N.
/// Stateless; copy freely.
struct CudaExecution {
  using stream_type = cudaStream_t;

  /// Deleter of device allocations (cudaFree; errors at teardown are ignored).
  struct DeviceFree {
    void operator()(std::byte* p) const noexcept {
      if (p != nullptr) cudaFree(p);
    }
  };
  /// A persistent device allocation owned by an operator (e.g. the direct gather workspace).
  using buffer_type = std::unique_ptr<std::byte[], DeviceFree>;

  /// cudaMalloc on the current device, zero-filled (like HostExecution::allocate). Synchronous:
  /// for operator construction, not for the forward path.
  static buffer_type allocate(std::size_t bytes) {
    void* p = nullptr;
    const std::size_t n = bytes == 0 ? 1 : bytes;
    DCPATTN_CUDA_CHECK(cudaMalloc(&p, n));
    buffer_type owned(static_cast<std::byte*>(p));
    DCPATTN_CUDA_CHECK(cudaMemset(p, 0, n));
    DCPATTN_CUDA_CHECK(cudaStreamSynchronize(0));
    return owned;
  }

  /// A shard length no batch reaches: fast_mode_splits does not know the real ones.
  static constexpr std::int64_t kUnknownLength = std::int64_t(1) << 40;
  /// Multiprocessors of the current device.
  static int multiprocessors() { return cuda_kernels::detail::device_sm_count(); }

  /// Device scratch the attention kernels need per forward (their split states), for
  /// config.max_tokens rows of config.num_heads heads and `num_splits` local splits.
  static std::size_t attention_scratch_bytes(const DcpConfig& config, int num_splits) {
    return cuda_kernels::mla_decode_scratch_bytes(config.max_tokens, config.num_heads, num_splits);
  }

  /// Fast mode's split count for a batch of `tokens` rows: the most splits that run in one wave
  /// on the current device, none under 128 of the `attended` tokens a row attends
  /// (cuda_kernels::mla_decode_fast_splits). `attended`: the top-k list's width for the sparse
  /// kernels; the shard lengths of the dense ones are not known on the host (-1), so there the
  /// minimum is not applied. H200, sparse top-2048, 128 heads, batch 1: 64 -> 16 splits, 22.4 ->
  /// 19.6 us (docs/performance.md, run 25).
  static int fast_mode_splits(const DcpConfig& config, std::int64_t tokens,
                              std::int64_t attended = -1) {
    return cuda_kernels::mla_decode_fast_splits(
        tokens, config.num_heads, attended < 0 ? kUnknownLength : attended, multiprocessors());
  }
  /// Attention scratch fast mode needs for any batch of up to config.max_tokens rows: with S > 1
  /// splits the one-wave rule keeps T x ceil(H / 64) x S <= the SM count, so the split states of
  /// one batch never exceed those of SMs / ceil(H / 64) rows at one split each (nor 64 splits of
  /// max_tokens rows; S = 1 needs none).
  static std::size_t fast_mode_scratch_bytes(const DcpConfig& config) {
    const std::int64_t head_blocks = (std::int64_t(config.num_heads) + 63) / 64;
    const std::int64_t max_splits = cuda_kernels::detail::mla::kMaxSplits;
    const std::int64_t rows = std::min<std::int64_t>(std::int64_t(multiprocessors()) / head_blocks,
                                                     max_splits * config.max_tokens);
    return std::size_t(rows) * std::size_t(config.num_heads) * (kMlaVDim + 1) * sizeof(float);
  }

  /// Copies a strided (T, H, D) view into contiguous row-major device memory.
  template <class T>
  void pack(TensorView<const T, 3> src, T* dst, stream_type stream) const {
    cuda_kernels::pack(src, dst, stream);
  }

  /// The input-error word of a forward (MlaDecodeParams::error_flags, device memory): zeroed on
  /// the stream before the kernels (capturable); read back after them, which synchronizes the
  /// stream (not capturable: DcpAttention::check_input_errors, outside graph capture).
  void clear_input_errors(std::uint32_t* flags, stream_type stream) const {
    DCPATTN_CUDA_CHECK(cudaMemsetAsync(flags, 0, sizeof(std::uint32_t), stream));
  }
  std::uint32_t read_input_errors(const std::uint32_t* flags, stream_type stream) const {
    std::uint32_t v = 0;
    DCPATTN_CUDA_CHECK(
        cudaMemcpyAsync(&v, flags, sizeof(std::uint32_t), cudaMemcpyDeviceToHost, stream));
    DCPATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
    return v;
  }

  /// Per-row local causal bound: local_length(row_bound[t], rank) for valid rows, 0 for padding.
  template <class Ownership>
  void row_local_lengths(const Ownership& own, int rank, TensorView<const std::int64_t, 1> bound,
                         int num_valid_rows, std::int64_t* out, stream_type stream) const {
    cuda_kernels::row_local_lengths(own, rank, bound, num_valid_rows, out, stream);
  }

  /// Dense paged MLA decode over this rank's shard (dcpattn/kernels/cuda/mla_decode.cuh).
  template <class QView, class CacheView>
  void mla_decode_dense(const QView& q, const CacheView& cache,
                        TensorView<const std::int32_t, 2> block_table,
                        TensorView<const std::int32_t, 1> row_request,
                        TensorView<const std::int64_t, 1> row_local_length,
                        const MlaDecodeParams& p, TensorView<float, 3> o, TensorView<float, 2> lse,
                        cuda::std::span<std::byte> scratch, stream_type stream) const {
    cuda_kernels::mla_decode_dense(q, cache, block_table, row_request, row_local_length, p, o, lse,
                                   scratch, stream);
  }

  /// Sparse (top-k) MLA decode over this rank's shard (dcpattn/kernels/cuda/mla_decode.cuh).
  template <class QView, class CacheView, class Ownership>
  void mla_decode_sparse(const QView& q, const CacheView& cache,
                         TensorView<const std::int32_t, 2> block_table,
                         TensorView<const std::int32_t, 1> row_request,
                         TensorView<const std::int32_t, 2> topk,
                         TensorView<const std::int64_t, 1> row_bound, const Ownership& own,
                         int rank, const MlaDecodeParams& p, TensorView<float, 3> o,
                         TensorView<float, 2> lse, cuda::std::span<std::byte> scratch,
                         stream_type stream) const {
    cuda_kernels::mla_decode_sparse(q, cache, block_table, row_request, topk, row_bound, own, rank,
                                    p, o, lse, scratch, stream);
  }

  /// See cuda_kernels::combine_pack_a2a.
  template <class LseBase>
  void combine_pack_a2a(TensorView<const float, 3> o, TensorView<const float, 2> lse,
                        int num_valid_rows, int group_size, PartialDtype dtype,
                        const detail::A2aChunkLayout& layout, std::byte* send,
                        stream_type stream) const {
    cuda_kernels::combine_pack_a2a<LseBase>(o, lse, num_valid_rows, group_size, dtype, layout, send,
                                            stream);
  }

  /// See cuda_kernels::combine_merge_a2a.
  template <class OutT>
  void combine_merge_a2a(const std::byte* recv, int group_size, DcpMode mode, PartialDtype dtype,
                         const detail::A2aChunkLayout& layout, TensorView<OutT, 3> out,
                         TensorView<float, 2> out_lse, stream_type stream) const {
    cuda_kernels::combine_merge_a2a(recv, group_size, mode, dtype, layout, out, out_lse, stream);
  }

  /// dst (T, H) contiguous = sanitized natural-log lse, -inf on padding rows.
  template <class LseBase>
  void sanitize_lse_rows(TensorView<const float, 2> lse, int num_valid_rows, float* dst,
                         stream_type stream) const {
    cuda_kernels::sanitize_lse_rows<LseBase>(lse, num_valid_rows, dst, stream);
  }

  /// See cuda_kernels::combine_rescale_agrs.
  void combine_rescale_agrs(TensorView<const float, 3> o, const float* lse_all, int rank,
                            int group_size, float* packed, TensorView<float, 2> out_lse,
                            stream_type stream) const {
    cuda_kernels::combine_rescale_agrs(o, lse_all, rank, group_size, packed, out_lse, stream);
  }

  /// out (T, H_local, Dv) = src contiguous (T, H_local, Dv) fp32, rounded to OutT.
  template <class OutT>
  void convert_rows(const float* src, TensorView<OutT, 3> out, stream_type stream) const {
    cuda_kernels::convert_rows(src, out, stream);
  }
};

static_assert(std::is_empty_v<CudaExecution>, "dcpattn: CudaExecution must stay stateless");

DCPATTN_NAMESPACE_END
