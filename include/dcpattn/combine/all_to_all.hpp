// SPDX-License-Identifier: Apache-2.0
// AllToAll combiner: one all-to-all carries o and lse of each destination's heads; each rank then
// merges the N states of its own heads locally, in a fixed order.
#pragma once

#include <cstddef>

#include "dcpattn/combine/lse_combiner.hpp"
#include "dcpattn/config.hpp"
#include "dcpattn/kernels/host/combine.hpp"

DCPATTN_NAMESPACE_BEGIN

/// The default LseCombiner. Traffic per rank: (N-1)/N of its partial state, once. In
/// deterministic mode the partials travel in fp32 and are merged along the fixed tree over the
/// rank index, which makes the result bitwise independent of N; in fast mode they may travel as
/// bf16 (config.partial_dtype) and are merged by one N-way log-sum-exp.
struct AllToAll {
  static bool supports(DcpMode) { return true; }

  static std::size_t scratch_bytes(const DcpConfig& c) {
    const auto layout = detail::A2aChunkLayout::make(c.max_tokens, c.num_heads / c.group_size,
                                                     c.head_dim_v, c.partial_dtype);
    return 2 * std::size_t(c.group_size) * layout.bytes;  // send + receive
  }

  template <class LseBase, class C, class E>
  static void combine(C& comm, E& exec, const CombineArgs& a, cuda::std::span<std::byte> scratch,
                      const DcpConfig& c, typename C::stream_type stream) {
    const int n = comm.size();
    const auto layout = detail::A2aChunkLayout::make(a.o.extent(0), a.o.extent(1) / n,
                                                     a.o.extent(2), c.partial_dtype);
    std::byte* send = scratch.data();
    std::byte* recv = send + std::size_t(n) * layout.bytes;
    exec.template combine_pack_a2a<LseBase>(a.o, a.lse, a.num_valid_rows, n, c.partial_dtype,
                                            layout, send, stream);
    comm.all_to_all(reinterpret_cast<const std::uint8_t*>(send),
                    reinterpret_cast<std::uint8_t*>(recv), layout.bytes, stream);
    exec.combine_merge_a2a(recv, n, c.mode, c.partial_dtype, layout, a.out, a.out_lse, stream);
  }
};

DCPATTN_NAMESPACE_END
