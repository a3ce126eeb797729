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

#include "dcpattn/combine/all_gather_reduce_scatter.hpp"
#include "dcpattn/combine/all_to_all.hpp"
#include "dcpattn/comm/nccl.cuh"
#include "dcpattn/exec/cuda.cuh"
#include "dcpattn/gather/all_gather.hpp"
#include "dcpattn/gather/direct_workspace.hpp"

namespace {

using dcpattn::bfloat16;

struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(std::size_t bytes) {
    DCPATTN_CUDA_CHECK(cudaMalloc(&ptr, bytes ? bytes : 1));
    // 0x3c bytes: bf16 / fp32 values near 0.0115, finite and nonzero (never time on zeros)
    DCPATTN_CUDA_CHECK(cudaMemset(ptr, 0x3c, bytes ? bytes : 1));
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { cudaFree(ptr); }
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr);
  }
};

/// Maximum over ranks of a per-rank time.
double max_over_ranks(double v) {
  double m = v;
  MPI_Allreduce(&v, &m, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1, devices = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  int rc = 0;
  try {
    if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;  // no driver or no GPU
    if (devices < size) {
      if (rank == 0)
        std::printf("bench_comm: %d ranks but %d GPUs; NCCL needs one GPU per rank\n", size,
                    devices);
      MPI_Finalize();
      return 0;
    }
    DCPATTN_CUDA_CHECK(cudaSetDevice(rank));
    dcpattn::NcclCommunicator comm = dcpattn::NcclCommunicator::init(MPI_COMM_WORLD);
    dcpattn::CudaExecution exec;
    cudaStream_t stream;
    DCPATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    dcpattn::bench::JsonRecords json;
    const int n = size;
    if (rank == 0)
      std::printf("%-18s %5s %4s %3s %10s %12s %9s\n", "op", "T", "H", "N", "us", "bytes/rank",
                  "GB/s");
    auto record = [&](const char* op, int t, int h, double us, double bytes) {
      us = max_over_ranks(us);
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
    constexpr int kCalls = 20;
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
        const std::int64_t q_elems = std::int64_t(t) * hl * c.head_dim_qk;
        DeviceBuffer q(std::size_t(q_elems) * 2);
        auto qv =
            dcpattn::make_view(static_cast<const bfloat16*>(q.ptr),
                               {std::int64_t(t), std::int64_t(hl), std::int64_t(c.head_dim_qk)});
        DeviceBuffer persistent(dcpattn::DirectWorkspace::persistent_bytes(c));
        DeviceBuffer scratch(std::max(dcpattn::DirectWorkspace::scratch_bytes(c),
                                      dcpattn::AllGather::scratch_bytes(c)));
        cuda::std::span<std::byte> ps(static_cast<std::byte*>(persistent.ptr),
                                      dcpattn::DirectWorkspace::persistent_bytes(c));
        cuda::std::span<std::byte> ss(static_cast<std::byte*>(scratch.ptr),
                                      std::max(dcpattn::DirectWorkspace::scratch_bytes(c),
                                               dcpattn::AllGather::scratch_bytes(c)));
        const double q_bytes = double(q_elems) * 2;
        record("gather_direct", t, h,
               dcpattn::bench::median_us_graph(
                   [&] { dcpattn::DirectWorkspace::gather(comm, exec, qv, ps, ss, c, stream); },
                   stream, kCalls),
               q_bytes);
        record("gather_fallback", t, h,
               dcpattn::bench::median_us_graph(
                   [&] { dcpattn::AllGather::gather(comm, exec, qv, ps, ss, c, stream); }, stream,
                   kCalls),
               q_bytes);
        DeviceBuffer gathered(std::size_t(q_elems) * 2 * std::size_t(n));
        record("nccl_all_gather", t, h,
               dcpattn::bench::median_us_graph(
                   [&] {
                     comm.all_gather(static_cast<const bfloat16*>(q.ptr), gathered.as<bfloat16>(),
                                     std::size_t(q_elems), stream);
                   },
                   stream, kCalls),
               q_bytes);

        // Combine: this rank's partial over all H heads of its shard.
        const std::int64_t o_elems = std::int64_t(t) * h * c.head_dim_v;
        DeviceBuffer o(std::size_t(o_elems) * 4), lse(std::size_t(t) * h * 4);
        DeviceBuffer out(std::size_t(t) * hl * c.head_dim_v * 2), out_lse(std::size_t(t) * hl * 4);
        dcpattn::CombineArgs a;
        a.o = dcpattn::make_view(static_cast<const float*>(o.ptr),
                                 {std::int64_t(t), std::int64_t(h), std::int64_t(c.head_dim_v)});
        a.lse = dcpattn::make_view(static_cast<const float*>(lse.ptr),
                                   {std::int64_t(t), std::int64_t(h)});
        a.num_valid_rows = t;
        a.out = dcpattn::make_view(out.as<bfloat16>(),
                                   {std::int64_t(t), std::int64_t(hl), std::int64_t(c.head_dim_v)});
        a.out_lse = dcpattn::make_view(out_lse.as<float>(), {std::int64_t(t), std::int64_t(hl)});
        const double a2a_fp32_bytes = double(o_elems) * 4 + double(t) * h * 4;
        {
          dcpattn::DcpConfig cd = c;  // deterministic, fp32 partials
          DeviceBuffer s(dcpattn::AllToAll::scratch_bytes(cd));
          cuda::std::span<std::byte> sp(static_cast<std::byte*>(s.ptr),
                                        dcpattn::AllToAll::scratch_bytes(cd));
          record("combine_a2a_fp32", t, h,
                 dcpattn::bench::median_us_graph(
                     [&] {
                       dcpattn::AllToAll::combine<dcpattn::lse_base_e>(comm, exec, a, sp, cd,
                                                                       stream);
                     },
                     stream, kCalls),
                 a2a_fp32_bytes);
          DeviceBuffer send(dcpattn::AllToAll::scratch_bytes(cd) / 2 + 16);
          DeviceBuffer recv(dcpattn::AllToAll::scratch_bytes(cd) / 2 + 16);
          const std::size_t chunk = std::size_t(a2a_fp32_bytes) / std::size_t(n);
          record("nccl_all_to_all", t, h,
                 dcpattn::bench::median_us_graph(
                     [&] {
                       comm.all_to_all(send.as<std::uint8_t>(), recv.as<std::uint8_t>(), chunk,
                                       stream);
                     },
                     stream, kCalls),
                 a2a_fp32_bytes);
        }
        {
          dcpattn::DcpConfig cf = c;
          cf.mode = dcpattn::DcpMode::fast;
          cf.partial_dtype = dcpattn::PartialDtype::bf16;
          DeviceBuffer s(dcpattn::AllToAll::scratch_bytes(cf));
          cuda::std::span<std::byte> sp(static_cast<std::byte*>(s.ptr),
                                        dcpattn::AllToAll::scratch_bytes(cf));
          record("combine_a2a_bf16", t, h,
                 dcpattn::bench::median_us_graph(
                     [&] {
                       dcpattn::AllToAll::combine<dcpattn::lse_base_e>(comm, exec, a, sp, cf,
                                                                       stream);
                     },
                     stream, kCalls),
                 double(o_elems) * 2 + double(t) * h * 4);
        }
        {
          dcpattn::DcpConfig cf = c;
          cf.mode = dcpattn::DcpMode::fast;
          DeviceBuffer s(dcpattn::AllGatherReduceScatter::scratch_bytes(cf));
          cuda::std::span<std::byte> sp(static_cast<std::byte*>(s.ptr),
                                        dcpattn::AllGatherReduceScatter::scratch_bytes(cf));
          record("combine_agrs", t, h,
                 dcpattn::bench::median_us_graph(
                     [&] {
                       dcpattn::AllGatherReduceScatter::combine<dcpattn::lse_base_e>(
                           comm, exec, a, sp, cf, stream);
                     },
                     stream, kCalls),
                 a2a_fp32_bytes);
        }
      }
    }
    if (rank == 0) json.write(dcpattn::bench::json_path(argc, argv, "comm.json"));
    cudaStreamDestroy(stream);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_comm [rank %d]: %s\n", rank, e.what());
    rc = 1;
  }
  MPI_Finalize();
  return rc;
}
