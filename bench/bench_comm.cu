// SPDX-License-Identifier: Apache-2.0
// Communication steps of a DCP decode step over NCCL, one MPI process per GPU:
//   gather_direct     DirectWorkspace::gather  (all-gather into the persistent workspace)
//   gather_fallback   AllGather::gather        (the over-capacity path: scratch + pack)
//   nccl_all_gather   ncclAllGather of the same query bytes (the raw collective)
//   combine_a2a_fp32  AllToAll::combine, deterministic mode (fp32 partials: pack, exchange, merge)
//   combine_a2a_bf16  AllToAll::combine, fast mode with bf16 partials
//   combine_agrs      AllGatherReduceScatter::combine, fast mode
//   nccl_all_to_all   ncclSend/ncclRecv exchange of the fp32 all-to-all payload (the raw
//   collective)
// for T in {1, 8, 64, 512, 4096} rows and H in {64, 128} heads of the whole group (H / N per
// rank). Times: per call, from CUDA-graph replays of 20 calls back to back (NCCL captured in the
// graph), median of 20 replays, the maximum over ranks. Bytes: what one rank sends.
//
//   mpirun -np N build/host/bench/bench_comm comm.json     (N GPUs, NCCL_NVLS_ENABLE=0)
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <cuda_runtime.h>
#include <mpi.h>

#include "bench_common.cuh"
#include "bench_mpi.cuh"

#include "dcpattn/combine/all_gather_reduce_scatter.hpp"
#include "dcpattn/combine/all_to_all.hpp"
#include "dcpattn/comm/nccl.cuh"
#include "dcpattn/exec/cuda.cuh"
#include "dcpattn/gather/all_gather.hpp"
#include "dcpattn/gather/direct_workspace.hpp"

namespace {

using dcpattn::bfloat16;
using dcpattn::bench::max_over_ranks;

/// Every buffer here is filled with 0x3c bytes: values do not change the timings, zeros might.
struct DeviceBuffer : dcpattn::bench::DeviceBuffer {
  explicit DeviceBuffer(std::size_t bytes) : dcpattn::bench::DeviceBuffer(bytes, 0x3c) {}
};

cuda::std::span<std::byte> span_of(const DeviceBuffer& b, std::size_t bytes) {
  return {static_cast<std::byte*>(b.ptr), bytes};
}

}  // namespace

int main(int argc, char** argv) {
  return dcpattn::bench::run_per_gpu(
      argc, argv, "bench_comm", "NCCL needs one GPU per rank", [](int) { return true; },
      [&](dcpattn::NcclCommunicator& comm, cudaStream_t stream) {
        const int rank = comm.rank(), n = comm.size();
        dcpattn::CudaExecution exec;
        dcpattn::bench::JsonRecords json;
        if (rank == 0)
          std::printf("%-18s %5s %4s %3s %10s %12s %9s\n", "op", "T", "H", "N", "us", "bytes/rank",
                      "GB/s");
        constexpr int kCallsPerGraph = 20;
        // Times fn (enqueued on `stream`) per call, the maximum over ranks, and records it.
        auto time_op = [&](const char* op, int t, int h, double bytes, auto&& fn) {
          const double us =
              max_over_ranks(dcpattn::bench::median_us_graph(fn, stream, kCallsPerGraph));
          if (rank != 0) return;
          const double gbs = bytes / (us * 1e3);
          std::printf("%-18s %5d %4d %3d %10.2f %12.0f %9.1f\n", op, t, h, n, us, bytes, gbs);
          std::fflush(stdout);
          json.begin()
              .field("op", op)
              .field("T", t)
              .field("H", h)
              .field("N", n)
              .field("median_us", us)
              .field("bytes", bytes)
              .field("gbs", gbs);
        };
        for (int h : {64, 128}) {
          if (h % n != 0) continue;
          for (int t : {1, 8, 64, 512, 4096}) {
            dcpattn::DcpConfig c;
            c.group_size = n;
            c.num_heads = h;
            c.max_tokens = t;
            c.gather_capacity = t;
            c.softmax_scale = 0.0721688f;
            const int hl = h / n;

            // Query gather: this rank's (T, H / N, 576) bf16 to every rank.
            const std::int64_t q_elems = std::int64_t(t) * hl * c.head_dim_qk;
            const double q_bytes = double(q_elems) * 2;
            DeviceBuffer q(static_cast<std::size_t>(q_bytes));
            const auto qv = dcpattn::make_view(
                static_cast<const bfloat16*>(q.ptr),
                {std::int64_t(t), std::int64_t(hl), std::int64_t(c.head_dim_qk)});
            const std::size_t scratch_bytes = std::max(dcpattn::DirectWorkspace::scratch_bytes(c),
                                                       dcpattn::AllGather::scratch_bytes(c));
            DeviceBuffer persistent(dcpattn::DirectWorkspace::persistent_bytes(c)),
                scratch(scratch_bytes), gathered(std::size_t(q_bytes) * std::size_t(n));
            const auto ps = span_of(persistent, dcpattn::DirectWorkspace::persistent_bytes(c));
            const auto ss = span_of(scratch, scratch_bytes);
            time_op("gather_direct", t, h, q_bytes,
                    [&] { dcpattn::DirectWorkspace::gather(comm, exec, qv, ps, ss, c, stream); });
            time_op("gather_fallback", t, h, q_bytes,
                    [&] { dcpattn::AllGather::gather(comm, exec, qv, ps, ss, c, stream); });
            time_op("nccl_all_gather", t, h, q_bytes, [&] {
              comm.all_gather(static_cast<const bfloat16*>(q.ptr), gathered.as<bfloat16>(),
                              std::size_t(q_elems), stream);
            });

            // Combine: this rank's partial over all H heads of its shard.
            const std::int64_t o_elems = std::int64_t(t) * h * c.head_dim_v;
            DeviceBuffer o(std::size_t(o_elems) * 4), lse(std::size_t(t) * h * 4);
            DeviceBuffer out(std::size_t(t) * hl * c.head_dim_v * 2),
                out_lse(std::size_t(t) * hl * 4);
            dcpattn::CombineArgs a;
            a.o =
                dcpattn::make_view(static_cast<const float*>(o.ptr),
                                   {std::int64_t(t), std::int64_t(h), std::int64_t(c.head_dim_v)});
            a.lse = dcpattn::make_view(static_cast<const float*>(lse.ptr),
                                       {std::int64_t(t), std::int64_t(h)});
            a.num_valid_rows = t;
            a.out = dcpattn::make_view(out.as<bfloat16>(), {std::int64_t(t), std::int64_t(hl),
                                                            std::int64_t(c.head_dim_v)});
            a.out_lse =
                dcpattn::make_view(out_lse.as<float>(), {std::int64_t(t), std::int64_t(hl)});
            const double fp32_bytes = double(o_elems) * 4 + double(t) * h * 4;  // partials + lse
            const double bf16_bytes = double(o_elems) * 2 + double(t) * h * 4;
            // One combiner in one configuration: scratch sized for it, timed per call.
            auto time_combine = [&](const char* op, auto combiner, dcpattn::DcpConfig cc,
                                    double bytes) {
              using K = decltype(combiner);
              DeviceBuffer s(K::scratch_bytes(cc));
              const auto sp = span_of(s, K::scratch_bytes(cc));
              time_op(op, t, h, bytes, [&] {
                K::template combine<dcpattn::lse_base_e>(comm, exec, a, sp, cc, stream);
              });
            };
            dcpattn::DcpConfig fast = c;
            fast.mode = dcpattn::DcpMode::fast;
            dcpattn::DcpConfig fast_bf16 = fast;
            fast_bf16.partial_dtype = dcpattn::PartialDtype::bf16;
            time_combine("combine_a2a_fp32", dcpattn::AllToAll{}, c, fp32_bytes);  // deterministic
            time_combine("combine_a2a_bf16", dcpattn::AllToAll{}, fast_bf16, bf16_bytes);
            time_combine("combine_agrs", dcpattn::AllGatherReduceScatter{}, fast, fp32_bytes);
            // The raw exchange of the fp32 all-to-all payload: one chunk per peer.
            const std::size_t chunk = std::size_t(fp32_bytes) / std::size_t(n);
            DeviceBuffer send(chunk * std::size_t(n)), recv(chunk * std::size_t(n));
            time_op("nccl_all_to_all", t, h, fp32_bytes, [&] {
              comm.all_to_all(send.as<std::uint8_t>(), recv.as<std::uint8_t>(), chunk, stream);
            });
          }
        }
        if (rank == 0) json.write(dcpattn::bench::json_path(argc, argv, "comm.json"));
      });
}
