// SPDX-License-Identifier: Apache-2.0
// AllGather: every forward all-gathers the local query heads into the operator's scratch.
#pragma once

#include <cstddef>

#include "dcpattn/config.hpp"
#include "dcpattn/gather/query_gather.hpp"

DCPATTN_NAMESPACE_BEGIN

/// QueryGatherPolicy that all-gathers q (T, H_local, D) into per-forward scratch (sized for
/// config.max_tokens) and hands the kernel the rank-major (T, H, D) view. Works for any batch size;
/// DirectWorkspace falls back to it for batches over its capacity.
struct AllGather {
  using view_type = GatheredQueryView;

  static std::size_t persistent_bytes(const DcpConfig&) { return 0; }
  static std::size_t scratch_bytes(const DcpConfig& c) {
    const int hl = c.num_heads / (c.group_size > 0 ? c.group_size : 1);
    // gathered query (N * T * H_local * D) + pack area for a strided q (T * H_local * D)
    return detail::query_bytes(c.max_tokens, c.num_heads, c.head_dim_qk) +
           detail::query_bytes(c.max_tokens, hl, c.head_dim_qk);
  }
  static int query_heads(const DcpConfig& c) { return c.num_heads / c.group_size; }

  template <class C, class E>
  static GatherOutcome<view_type> gather(C& comm, E& exec, TensorView<const bfloat16, 3> q,
                                         cuda::std::span<std::byte> /*persistent*/,
                                         cuda::std::span<std::byte> scratch, const DcpConfig& c,
                                         typename C::stream_type stream) {
    auto* gathered = reinterpret_cast<bfloat16*>(scratch.data());
    auto* pack = reinterpret_cast<bfloat16*>(
        scratch.data() + detail::query_bytes(c.max_tokens, c.num_heads, c.head_dim_qk));
    return {detail::all_gather_query(comm, exec, q, gathered, pack, stream), true};
  }
};

DCPATTN_NAMESPACE_END
