// SPDX-License-Identifier: Apache-2.0
// The host execution space: scalar reference code on the CPU, host memory, no streams.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>

#include <cuda/std/span>

#include "dcpattn/comm/communicator.hpp"
#include "dcpattn/config.hpp"
#include "dcpattn/core/lse.hpp"
#include "dcpattn/core/numeric.hpp"
#include "dcpattn/core/tensor.hpp"
#include "dcpattn/kernels/host/combine.hpp"
#include "dcpattn/kernels/host/mla_decode.hpp"
#include "dcpattn/op/config.hpp"

DCPATTN_NAMESPACE_BEGIN

/// Execution space that runs every step on the calling CPU thread: the reference path, and what
/// CPU-only CI runs. Each member is one step of a DCP forward; the CUDA execution space offers the
/// same members as stream-ordered kernels.
struct HostExecution {
  using stream_type = HostStream;

  /// A persistent allocation owned by an operator (e.g. the direct gather workspace).
  using buffer_type = std::unique_ptr<std::byte[]>;
  static buffer_type allocate(std::size_t bytes) {
    return buffer_type(new std::byte[bytes == 0 ? 1 : bytes]());
  }

  /// Scratch the attention kernels need per forward (none: the host kernels merge splits in place).
  static std::size_t attention_scratch_bytes(const DcpConfig&, int /*num_splits*/) { return 0; }

  /// Copies a strided (T, H, D) view into contiguous row-major memory.
  template <class T>
  void pack(TensorView<const T, 3> src, T* dst, stream_type) const {
    std::size_t k = 0;
    for (std::int64_t a = 0; a < src.extent(0); ++a)
      for (std::int64_t b = 0; b < src.extent(1); ++b)
        for (std::int64_t c = 0; c < src.extent(2); ++c) dst[k++] = src(a, b, c);
  }

  /// The input-error word of a forward (MlaDecodeParams::error_flags): zeroed before the kernels,
  /// read after them. The host kernels throw instead of setting it, so it stays 0 here.
  void clear_input_errors(std::uint32_t* flags, stream_type) const { *flags = 0; }
  std::uint32_t read_input_errors(const std::uint32_t* flags, stream_type) const { return *flags; }

  /// Per-row local causal bound: local_length(row_bound[t], rank) for valid rows, 0 for padding.
  template <class Ownership>
  void row_local_lengths(const Ownership& own, int rank, TensorView<const std::int64_t, 1> bound,
                         int num_valid_rows, std::int64_t* out, stream_type) const {
    for (std::int64_t t = 0; t < bound.extent(0); ++t)
      out[t] = t < num_valid_rows ? std::int64_t(own.local_length(bound(t), rank)) : 0;
  }

  template <class QView, class CacheView>
  void mla_decode_dense(const QView& q, const CacheView& cache,
                        TensorView<const std::int32_t, 2> block_table,
                        TensorView<const std::int32_t, 1> row_request,
                        TensorView<const std::int64_t, 1> row_local_length,
                        const MlaDecodeParams& p, TensorView<float, 3> o, TensorView<float, 2> lse,
                        cuda::std::span<std::byte> /*scratch*/, stream_type) const {
    host::mla_decode_dense(q, cache, block_table, row_request, row_local_length, p, o, lse);
  }

  template <class QView, class CacheView, class Ownership>
  void mla_decode_sparse(const QView& q, const CacheView& cache,
                         TensorView<const std::int32_t, 2> block_table,
                         TensorView<const std::int32_t, 1> row_request,
                         TensorView<const std::int32_t, 2> topk,
                         TensorView<const std::int64_t, 1> row_bound, const Ownership& own,
                         int rank, const MlaDecodeParams& p, TensorView<float, 3> o,
                         TensorView<float, 2> lse, cuda::std::span<std::byte> /*scratch*/,
                         stream_type) const {
    host::mla_decode_sparse(q, cache, block_table, row_request, topk, row_bound, own, rank, p, o,
                            lse);
  }

  template <class LseBase>
  void combine_pack_a2a(TensorView<const float, 3> o, TensorView<const float, 2> lse,
                        int num_valid_rows, int group_size, PartialDtype dtype,
                        const detail::A2aChunkLayout& layout, std::byte* send, stream_type) const {
    host::combine_pack_a2a<LseBase>(o, lse, num_valid_rows, group_size, dtype, layout, send);
  }

  template <class OutT>
  void combine_merge_a2a(const std::byte* recv, int group_size, DcpMode mode, PartialDtype dtype,
                         const detail::A2aChunkLayout& layout, TensorView<OutT, 3> out,
                         TensorView<float, 2> out_lse, stream_type) const {
    host::combine_merge_a2a(recv, group_size, mode, dtype, layout, out, out_lse);
  }

  /// dst (T, H) contiguous = sanitized natural-log lse, -inf on padding rows.
  template <class LseBase>
  void sanitize_lse_rows(TensorView<const float, 2> lse, int num_valid_rows, float* dst,
                         stream_type) const {
    for (std::int64_t t = 0; t < lse.extent(0); ++t)
      for (std::int64_t h = 0; h < lse.extent(1); ++h)
        *dst++ = t < num_valid_rows ? sanitize_lse(lse(t, h), LseBase{}) : lse_neg_inf;
  }

  void combine_rescale_agrs(TensorView<const float, 3> o, const float* lse_all, int rank,
                            int group_size, float* packed, TensorView<float, 2> out_lse,
                            stream_type) const {
    host::combine_rescale_agrs(o, lse_all, rank, group_size, packed, out_lse);
  }

  /// out (T, H_local, Dv) = src contiguous (T, H_local, Dv) fp32, rounded to OutT.
  template <class OutT>
  void convert_rows(const float* src, TensorView<OutT, 3> out, stream_type) const {
    for (std::int64_t t = 0; t < out.extent(0); ++t)
      for (std::int64_t h = 0; h < out.extent(1); ++h)
        for (std::int64_t i = 0; i < out.extent(2); ++i) out(t, h, i) = from_float<OutT>(*src++);
  }
};

DCPATTN_NAMESPACE_END
