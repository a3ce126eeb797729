// SPDX-License-Identifier: Apache-2.0
// AllGatherReduceScatter combiner (the scheme of vLLM's DCP): all-gather the LSEs, rescale the
// local o by its weight, reduce-scatter the sum over heads.
#pragma once

#include <cstddef>

#include "dcpattn/combine/lse_combiner.hpp"
#include "dcpattn/config.hpp"
#include "dcpattn/kernels/host/combine.hpp"

DCPATTN_NAMESPACE_BEGIN

/// LseCombiner for fast mode only: the reduce-scatter sums in an order the communicator chooses,
/// so the result depends (slightly) on N. Traffic per rank: the LSEs of all heads plus (N-1)/N of
/// the o, in fp32.
struct AllGatherReduceScatter {
  static bool supports(DcpMode mode) { return mode == DcpMode::fast; }

  static std::size_t scratch_bytes(const DcpConfig& c) {
    const std::size_t lse = std::size_t(c.max_tokens) * c.num_heads * 4;
    const std::size_t o = std::size_t(c.max_tokens) * c.num_heads * c.head_dim_v * 4;
    // local lse + gathered lse (N planes) + packed o + reduced o (1/N of it)
    return lse + std::size_t(c.group_size) * lse + o + o / c.group_size;
  }

  template <class LseBase, class C, class E>
  static void combine(C& comm, E& exec, const CombineArgs& a, cuda::std::span<std::byte> scratch,
                      const DcpConfig&, typename C::stream_type stream) {
    const int n = comm.size();
    const std::size_t t = std::size_t(a.o.extent(0)), h = std::size_t(a.o.extent(1));
    const std::size_t dv = std::size_t(a.o.extent(2));
    auto* lse_mine = reinterpret_cast<float*>(scratch.data());
    float* lse_all = lse_mine + t * h;
    float* packed = lse_all + std::size_t(n) * t * h;
    float* reduced = packed + t * h * dv;
    exec.template sanitize_lse_rows<LseBase>(a.lse, a.num_valid_rows, lse_mine, stream);
    comm.all_gather(lse_mine, lse_all, t * h, stream);
    exec.combine_rescale_agrs(a.o, lse_all, comm.rank(), n, packed, a.out_lse, stream);
    comm.reduce_scatter_sum(packed, reduced, t * (h / n) * dv, stream);
    exec.convert_rows(reduced, a.out, stream);
  }
};

DCPATTN_NAMESPACE_END
