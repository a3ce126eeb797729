// SPDX-License-Identifier: Apache-2.0
// DirectWorkspace: decode batches gather straight into a persistent workspace; larger batches fall
// back to AllGather.
#pragma once

#include <cstddef>

#include "dcpattn/config.hpp"
#include "dcpattn/gather/all_gather.hpp"
#include "dcpattn/gather/query_gather.hpp"

DCPATTN_NAMESPACE_BEGIN

/// QueryGatherPolicy with a persistent workspace of config.gather_capacity tokens, allocated once
/// when the operator is built (so its address is stable: CUDA-graph safe, and registrable with a
/// communicator). A batch of T <= capacity tokens is all-gathered into it and the kernel reads it
/// in place through the rank-major view. A larger batch (a mixed prefill/decode batch, say) goes
/// through AllGather into scratch instead, and the outcome says so (forward() reports it).
struct DirectWorkspace {
  using view_type = GatheredQueryView;

  static std::size_t persistent_bytes(const DcpConfig& c) {
    return detail::query_bytes(c.gather_capacity, c.num_heads, c.head_dim_qk);
  }
  static std::size_t scratch_bytes(const DcpConfig& c) { return AllGather::scratch_bytes(c); }
  static int query_heads(const DcpConfig& c) { return c.num_heads / c.group_size; }

  template <class C, class E>
  static GatherOutcome<view_type> gather(C& comm, E& exec, TensorView<const bfloat16, 3> q,
                                         cuda::std::span<std::byte> persistent,
                                         cuda::std::span<std::byte> scratch, const DcpConfig& c,
                                         typename C::stream_type stream) {
    if (q.extent(0) > c.gather_capacity)
      return AllGather::gather(comm, exec, q, persistent, scratch, c, stream);
    auto* pack = reinterpret_cast<bfloat16*>(
        scratch.data() + detail::query_bytes(c.max_tokens, c.num_heads, c.head_dim_qk));
    return {detail::all_gather_query(comm, exec, q, reinterpret_cast<bfloat16*>(persistent.data()),
                                     pack, stream),
            false};
  }
};

DCPATTN_NAMESPACE_END
