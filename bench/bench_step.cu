// SPDX-License-Identifier: Apache-2.0
// DCP scaling: one whole decode step per GPU, one MPI process per GPU over NCCL:
//   the fused prologue (query RMSNorm; the new token's KV normalized, rotated and written on its
//   owner), then DcpAttention::forward (query gather into the direct workspace, dense MLA decode
//   over the local shard, all-to-all combine),
// for 128 query heads (H / N per rank before the gather), batch B in {1, 32} requests of one
// decode row each, every request at context length L in {128K, 1M} tokens (token-interleaved
// round-robin ownership, page 64), bf16 and fp8 ds_mla caches, fast and deterministic mode
// (V = DCPATTN_BENCH_V virtual shards, default 64: each rank runs V / N splits in deterministic
// mode, so V sets how much of the GPU one row uses; see docs/performance.md, "Choosing V").
// Run it at N = 1, 2, 4, 8 and compare:
//
//   mpirun -np N build/cuda/bench/bench_step step_nN.json     (N GPUs, NCCL_NVLS_ENABLE=0)
//
// Reported per case (rank 0 prints; the JSON has one record per case):
//   step_us     median time of a step from CUDA-graph replays (NCCL captured in the graph; the
//               step captured `calls` times back to back), the maximum over ranks;
//   forward_us  the same for DcpAttention::forward alone (gather + attention + combine);
//   kv_gib      KV-cache bytes per GPU for the batch (its local pages), GiB;
//   tflops      attention FLOPs of the group (2 B H L (576 + 512)) / step_us / N: what each GPU
//               achieves on its share;
//   splits      ForwardInfo::num_splits (local attention splits per rank).
// The caches are larger than L2 (50 MiB) except at B = 1, 128K on N >= 4 ranks; nothing flushes
// L2 between replays, so that case reads partly from L2.
// DCPATTN_BENCH_QUICK=1 runs B = 1 at 128K only (a smoke test).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <cuda_runtime.h>
#include <mpi.h>

#include "bench_common.cuh"
#include "bench_mpi.cuh"

#include "dcpattn/comm/nccl.cuh"
#include "dcpattn/dcpattn.hpp"
#include "dcpattn/exec/cuda.cuh"
#include "dcpattn/kernels/cuda/prologue.cuh"

namespace {

using dcpattn::bfloat16;
using dcpattn::CacheFormat;
using dcpattn::make_view;
using dcpattn::bench::DeviceBuffer;
using dcpattn::bench::max_over_ranks;

constexpr int kHeads = 128;
constexpr int kPage = 64;
constexpr int kQ = 1536;  // q_lora_rank
constexpr float kScale = 0.0721687836f;

struct Case {
  CacheFormat format;
  int batch;
  std::int64_t length;  // context tokens before the step; the step's row is token `length`
  dcpattn::DcpMode mode;
};

/// Runs one case on this rank (every rank calls it; rank 0 prints and records).
template <CacheFormat F>
void run_case(dcpattn::NcclCommunicator& comm, const Case& cs, cudaStream_t stream,
              dcpattn::bench::JsonRecords& json, const DeviceBuffer& weights,
              const DeviceBuffer& cos_sin, std::int64_t max_position, int virtual_shards) {
  using Op = dcpattn::DcpAttention<dcpattn::RoundRobinOwnership, dcpattn::DirectWorkspace,
                                   dcpattn::DenseMla<F>, dcpattn::AllToAll,
                                   dcpattn::NcclCommunicator, dcpattn::CudaExecution>;
  const int n = comm.size(), rank = comm.rank();
  const std::int64_t b = cs.batch, hl = kHeads / n, len = cs.length + 1;  // with the new token
  dcpattn::DcpConfig cfg;
  cfg.group_size = n;
  cfg.num_heads = kHeads;
  cfg.page_size = kPage;
  cfg.interleave = 1;
  cfg.virtual_shards = virtual_shards;
  cfg.max_tokens = int(b);
  cfg.gather_capacity = int(b);
  cfg.softmax_scale = kScale;
  cfg.mode = cs.mode;
  Op op(comm, cfg);

  // Local pages: every request's shard of `len` tokens, pages handed out in order.
  const std::int64_t local = op.ownership().local_length(len, rank);
  const std::int64_t pages = (local + kPage - 1) / kPage;
  const std::int64_t num_slots = std::max<std::int64_t>(b * pages, 1) * kPage;
  const std::size_t row_bytes =
      dcpattn::mla_cache_row_width(F) * sizeof(dcpattn::mla_cache_element_t<F>);
  std::vector<std::int32_t> table(std::size_t(b * pages));
  for (std::size_t i = 0; i < table.size(); ++i) table[i] = std::int32_t(i);
  const std::size_t rows = static_cast<std::size_t>(b);
  std::vector<std::int32_t> row_request(rows);
  std::vector<std::int64_t> row_bound(rows, len), positions(rows, cs.length), slots(rows, -1);
  for (std::int64_t r = 0; r < b; ++r) {
    row_request[std::size_t(r)] = std::int32_t(r);
    slots[std::size_t(r)] =
        dcpattn::paged_slot(op.ownership(), cs.length, rank, table.data() + r * pages, kPage);
  }
  DeviceBuffer cache(std::size_t(num_slots) * row_bytes, 0x3c);  // finite values, fp8 included
  const DeviceBuffer d_table(table), d_row_request(row_request), d_row_bound(row_bound),
      d_positions(positions), d_slots(slots);
  // Prologue inputs and outputs; q (B, H / N, 576): this rank's heads after the projections.
  DeviceBuffer q_c(std::size_t(b) * kQ * 2, 0x3c), q_c_out(std::size_t(b) * kQ * 2),
      kv_c(std::size_t(b) * dcpattn::kMlaLatentDim * 2, 0x3c),
      k_pe(std::size_t(b) * dcpattn::kMlaRopeDim * 2, 0x3c),
      q(std::size_t(b * hl) * dcpattn::kMlaQkDim * 2, 0x3c),
      out(std::size_t(b * hl) * dcpattn::kMlaVDim * 2), out_lse(std::size_t(b * hl) * 4),
      ws(Op::workspace_bytes(cfg));

  dcpattn::PrologueArgs<dcpattn::mla_cache_out_view_t<F>> p;
  const bfloat16* w = weights.as<const bfloat16>();
  p.q_c = make_view(q_c.as<const bfloat16>(), {b, std::int64_t(kQ)});
  p.q_c_out = make_view(q_c_out.as<bfloat16>(), {b, std::int64_t(kQ)});
  p.q_norm_weight = make_view(w, {std::int64_t(kQ)});
  p.kv_c = make_view(kv_c.as<const bfloat16>(), {b, std::int64_t(dcpattn::kMlaLatentDim)});
  p.kv_norm_weight = make_view(w + kQ, {std::int64_t(dcpattn::kMlaLatentDim)});
  p.k_pe = make_view(k_pe.as<const bfloat16>(), {b, std::int64_t(dcpattn::kMlaRopeDim)});
  p.positions = make_view(d_positions.as<const std::int64_t>(), {b});
  p.cos_sin_cache =
      make_view(cos_sin.as<const float>(), {max_position, std::int64_t(dcpattn::kMlaRopeDim)});
  p.slot_mapping = make_view(d_slots.as<const std::int64_t>(), {b});
  p.kv_cache = make_view(cache.as<dcpattn::mla_cache_element_t<F>>(),
                         {num_slots, std::int64_t(dcpattn::mla_cache_row_width(F))});

  typename Op::Arguments a;
  a.q = make_view(q.as<const bfloat16>(), {b, hl, std::int64_t(dcpattn::kMlaQkDim)});
  a.cache = make_view(cache.as<const dcpattn::mla_cache_element_t<F>>(),
                      {num_slots, std::int64_t(dcpattn::mla_cache_row_width(F))});
  a.block_table = make_view(d_table.as<const std::int32_t>(), {b, pages});
  a.row_request = make_view(d_row_request.as<const std::int32_t>(), {b});
  a.row_bound = make_view(d_row_bound.as<const std::int64_t>(), {b});
  a.num_valid_rows = int(b);
  a.out = make_view(out.as<bfloat16>(), {b, hl, std::int64_t(dcpattn::kMlaVDim)});
  a.out_lse = make_view(out_lse.as<float>(), {b, hl});
  const cuda::std::span<std::byte> wss(ws.as<std::byte>(), Op::workspace_bytes(cfg));

  int splits = 0;
  auto forward = [&] { splits = op.forward(a, wss, stream).num_splits; };
  auto step = [&] {
    dcpattn::cuda_kernels::fused_prologue(p, stream);
    forward();
  };
  // A few ms per step at 1M: fewer calls per graph there.
  const int calls = len > 200'000 ? 2 : 10;
  const double step_us = max_over_ranks(dcpattn::bench::median_us_graph(step, stream, calls));
  const double forward_us = max_over_ranks(dcpattn::bench::median_us_graph(forward, stream, calls));
  const double kv_gib =
      max_over_ranks(double(b * pages * kPage) * double(row_bytes)) / double(1ull << 30);
  const double flops =
      2.0 * double(b) * kHeads * double(len) * double(dcpattn::kMlaQkDim + dcpattn::kMlaVDim);
  const double tflops = flops / (step_us * 1e-6) / n / 1e12;
  if (rank != 0) return;
  const char* fmt = F == CacheFormat::bf16 ? "bf16" : "fp8";
  const char* mode = cs.mode == dcpattn::DcpMode::fast ? "fast" : "determ";
  std::printf("%-5s %-7s %3d %8lld %3d %8.3f %10.1f %10.1f %8.1f %6d\n", fmt, mode, cs.batch,
              (long long)cs.length, n, kv_gib, step_us, forward_us, tflops, splits);
  std::fflush(stdout);
  json.begin()
      .field("format", fmt)
      .field("mode", mode)
      .field("batch", cs.batch)
      .field("length", double(cs.length))
      .field("N", n)
      .field("V", cfg.virtual_shards)
      .field("kv_gib_per_gpu", kv_gib)
      .field("step_us", step_us)
      .field("forward_us", forward_us)
      .field("tflops_per_gpu", tflops)
      .field("splits", splits);
}

}  // namespace

int main(int argc, char** argv) {
  return dcpattn::bench::run_per_gpu(
      argc, argv, "bench_step", "needs one GPU per rank and N dividing 128",
      [](int size) { return kHeads % size == 0; },
      [&](dcpattn::NcclCommunicator& comm, cudaStream_t stream) {
        const int rank = comm.rank();
        const bool quick = std::getenv("DCPATTN_BENCH_QUICK") != nullptr;
        const std::vector<int> batches = quick ? std::vector<int>{1} : std::vector<int>{1, 32};
        const std::vector<std::int64_t> lengths =
            quick ? std::vector<std::int64_t>{131072} : std::vector<std::int64_t>{131072, 1048576};
        const std::int64_t max_position = lengths.back() + 1;
        const char* v_env = std::getenv("DCPATTN_BENCH_V");
        const int v = v_env ? std::atoi(v_env) : 64;
        // Norm weights (q, kv) near 1 and a cos/sin table of finite values.
        DeviceBuffer weights(std::size_t(kQ + dcpattn::kMlaLatentDim) * 2);
        {
          std::vector<bfloat16> h(std::size_t(kQ + dcpattn::kMlaLatentDim),
                                  bfloat16::from_float(1.0f));
          DCPATTN_CUDA_CHECK(
              cudaMemcpy(weights.ptr, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
          DCPATTN_CUDA_CHECK(cudaDeviceSynchronize());  // before the non-blocking stream reads it
        }
        DeviceBuffer cos_sin(std::size_t(max_position) * dcpattn::kMlaRopeDim * 4, 0x3c);
        dcpattn::bench::JsonRecords json;
        if (rank == 0)
          std::printf("%-5s %-7s %3s %8s %3s %8s %10s %10s %8s %6s\n", "cache", "mode", "B", "L",
                      "N", "kv_GiB", "step_us", "fwd_us", "TFLOP/s", "splits");
        for (CacheFormat f : {CacheFormat::bf16, CacheFormat::fp8_ds_mla})
          for (std::int64_t len : lengths)
            for (int b : batches)
              for (dcpattn::DcpMode m : {dcpattn::DcpMode::fast, dcpattn::DcpMode::deterministic}) {
                const Case cs{f, b, len, m};
                if (f == CacheFormat::bf16)
                  run_case<CacheFormat::bf16>(comm, cs, stream, json, weights, cos_sin,
                                              max_position, v);
                else
                  run_case<CacheFormat::fp8_ds_mla>(comm, cs, stream, json, weights, cos_sin,
                                                    max_position, v);
              }
        if (rank == 0) json.write(dcpattn::bench::json_path(argc, argv, "step.json"));
      });
}
