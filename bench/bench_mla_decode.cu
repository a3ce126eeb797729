// SPDX-License-Identifier: Apache-2.0
// MLA decode kernels (cuda_kernels::mla_decode_dense / mla_decode_sparse) on one GPU: median time,
// TFLOP/s and GB/s against the device's measured copy bandwidth (the matrix rate of the same GPU
// is measured by the PyTorch peer, bench/peers/mla_decode_peer.py, in the same run).
//
// Dense: batch B in {1, 8, 64, 128} x context L in {4K, 32K, 128K} x heads H in {16, 128}, bf16
// and fp8 (ds_mla) caches, one query row per request, paged (64 tokens per page; each request's
// pages are scattered over the cache by a fixed permutation, so no two consecutive pages of a
// request are neighbours).
// Sparse: H in {64, 128}, top-k 2048 distinct random positions of a 32K context, B in
// {1, 8, 64, 128}, bf16 and fp8.
// Splits: mla_decode_fast_splits (fast mode: the most local splits that run in one wave;
// DCPATTN_BENCH_SPLITS=S forces S); the merge of the split states is part of the timed call.
// Sparse splits take runs of the top-k list, as in fast mode (MlaDecodeParams::split_topk_list;
// DCPATTN_BENCH_POSITION_SPLITS=1: splits of positions, as in deterministic mode).
//
// FLOPs counted: 2 * H * n * (576 + 512) per row (QK^T and PV, n attended tokens). Bytes counted:
// the minimum any implementation moves: each attended cache entry once (1152 B bf16, 656 B fp8),
// the queries (bf16) and the outputs (fp32 o and lse) once; the block table and top-k lists too.
// Time: one call behind a 256 MiB L2 flush, CUDA events, median of 30 (bench_common.cuh). The
// flush reads the buffer, leaving clean lines in L2 (DCPATTN_BENCH_FLUSH=write: writes it, as
// triton.testing.do_bench; on the H200 the two differ by under 3 us on batch-1 calls).
// `behind flush`: the same call enqueued right behind the flush, without the start event between
// them, as the difference of [flush, call] and [flush] (median_us_behind_flush). The start event
// delays the first block of the kernel after it (bench_launch_gap: 3.1 us, against 0.8 us for a
// kernel right behind another), which the first figure includes; on the H200 the two figures
// differ by 3.5-5 us on the 35-60 us calls, and the second agrees with `graph` there. On calls of
// several hundred us the second runs slower instead: the SM clock drops under the sustained load
// of a flush and a long call back to back (docs/performance.md, run 20). TFLOP/s and % of copy are
// given for both.
// `sustained`: the first timing again after a second of flushes and calls back to back
// (DCPATTN_BENCH_WARMUP_MS), the case's own steady state under the power limit; each timing with
// the SM clock read right behind it (docs/performance.md, run 28). `back to back` (`window_us`):
// a second of calls with nothing between them (DCPATTN_BENCH_ENERGY_MS), its wall time over its
// calls: the steady-state time a serving loop sees; `mJ/call`: the GPU's energy counter over the
// same window (-1 without NVML; docs/performance.md, run 29).
// `host us`: the CPU time of one call's enqueue (checks, tensor-map encoding, launches).
// JSON records go to argv[1] (default mla_decode.json).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "bench_common.cuh"

#include "dcpattn/kernels/cuda/mla_decode.cuh"
#include "dcpattn/ownership/round_robin.hpp"

namespace {

using dcpattn::bench::DeviceBuffer;
using dcpattn::bench::fill_bf16;
using dcpattn::bench::hash32;
using dcpattn::bench::uniform;

using dcpattn::bfloat16;
using dcpattn::CacheFormat;
constexpr std::int64_t kPage = 64;
/// The sustained load before each case's second timing, ms (DCPATTN_BENCH_WARMUP_MS overrides
/// it; 0 skips that timing).
constexpr double kDefaultWarmupMs = 1000.0;
/// The window of back-to-back calls whose time and energy per call are read, ms
/// (DCPATTN_BENCH_ENERGY_MS).
constexpr double kDefaultEnergyMs = 1000.0;

/// Random ds_mla entries: finite e4m3 codes, positive group scales, bf16 RoPE values.
__global__ void fill_fp8(std::uint8_t* p, std::size_t entries, std::uint64_t seed) {
  using E = dcpattn::DsMlaFp8Entry;
  const std::size_t words = entries * (E::bytes / 4);
  for (std::size_t w = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; w < words;
       w += std::size_t(gridDim.x) * blockDim.x) {
    const std::size_t e = w / (E::bytes / 4);
    const int off = int(w % (E::bytes / 4)) * 4;
    std::uint32_t v = hash32(seed * 0x9e3779b97f4a7c15ull + w);
    if (off < E::latent_dim) {
      v &= 0xf7f7f7f7u;  // exponent below 15: finite codes of magnitude < 256
    } else if (off < E::scales_offset + 4 * E::num_groups && off >= E::scales_offset) {
      const float s = (1.0f + uniform(seed + 1, w)) / 448.0f;
      v = __float_as_uint(s);
    } else {
      const float a = 2.0f * uniform(seed + 2, w) - 1.0f, b = 2.0f * uniform(seed + 3, w) - 1.0f;
      v = std::uint32_t(bfloat16::from_float(a).bits) |
          (std::uint32_t(bfloat16::from_float(b).bits) << 16);
    }
    *reinterpret_cast<std::uint32_t*>(p + e * E::bytes + off) = v;
  }
}

struct Case {
  bool sparse;
  CacheFormat format;
  int batch;
  std::int64_t context;
  int heads;
  int topk;  // sparse only
};

std::string format_name(CacheFormat f) {
  return f == CacheFormat::bf16 ? "bf16" : "fp8";
}

/// Runs one case; returns false (and records nothing) when it does not fit in device memory.
bool run_case(const Case& c, cudaStream_t stream, int sm_count, double copy_gbs, void* flush,
              std::size_t flush_bytes, const dcpattn::bench::EnergyCounter& energy,
              dcpattn::bench::JsonRecords& json) {
  const int B = c.batch, H = c.heads;
  const std::int64_t L = c.context;
  const std::int64_t pages_per_req = (L + kPage - 1) / kPage;
  const std::int64_t num_pages = pages_per_req * B;
  const std::int64_t slots = num_pages * kPage;
  const int row_bytes =
      dcpattn::mla_cache_row_width(c.format) * (c.format == CacheFormat::bf16 ? 2 : 1);
  const std::size_t cache_bytes = std::size_t(slots) * std::size_t(row_bytes);
  std::size_t free_b = 0, total_b = 0;
  DCPATTN_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  if (cache_bytes + (std::size_t(1) << 30) > free_b) return false;

  DeviceBuffer cache(cache_bytes);
  if (c.format == CacheFormat::bf16)
    fill_bf16<<<4096, 256, 0, stream>>>(cache.as<bfloat16>(), std::size_t(slots) * 576, 11, -1.0f,
                                        1.0f);
  else
    fill_fp8<<<4096, 256, 0, stream>>>(cache.as<std::uint8_t>(), std::size_t(slots), 11);
  DCPATTN_CUDA_CHECK(cudaGetLastError());

  // Block table: request b's page p is page perm[b * pages_per_req + p] of the cache.
  std::vector<std::int32_t> table(static_cast<std::size_t>(num_pages));
  std::iota(table.begin(), table.end(), 0);
  std::mt19937_64 rng(7);
  std::shuffle(table.begin(), table.end(), rng);
  const DeviceBuffer d_table(table);

  std::vector<std::int32_t> row_request(static_cast<std::size_t>(B));
  std::iota(row_request.begin(), row_request.end(), 0);
  std::vector<std::int64_t> row_len(static_cast<std::size_t>(B), L);
  const DeviceBuffer d_req(row_request), d_len(row_len);

  DeviceBuffer q(std::size_t(B) * H * 576 * 2);
  fill_bf16<<<1024, 256, 0, stream>>>(q.as<bfloat16>(), std::size_t(B) * H * 576, 5, -1.0f, 1.0f);
  DeviceBuffer o(std::size_t(B) * H * 512 * 4), lse(std::size_t(B) * H * 4);

  // Sparse: top-k distinct positions of [0, L) per row.
  const int K = c.sparse ? c.topk : 0;
  DeviceBuffer d_topk(std::size_t(B) * std::size_t(K > 0 ? K : 1) * 4);
  if (c.sparse) {
    std::vector<std::int32_t> topk(std::size_t(B) * std::size_t(K));
    std::vector<std::int32_t> pos(static_cast<std::size_t>(L));
    std::iota(pos.begin(), pos.end(), 0);
    for (int b = 0; b < B; ++b) {
      for (int i = 0; i < K; ++i) {  // partial Fisher-Yates
        std::uniform_int_distribution<std::int64_t> d(i, L - 1);
        std::swap(pos[std::size_t(i)], pos[std::size_t(d(rng))]);
      }
      std::copy(pos.begin(), pos.begin() + K, topk.begin() + std::ptrdiff_t(b) * K);
    }
    DCPATTN_CUDA_CHECK(
        cudaMemcpy(d_topk.ptr, topk.data(), topk.size() * 4, cudaMemcpyHostToDevice));
  }

  const std::int64_t attended = c.sparse ? K : L;
  dcpattn::MlaDecodeParams p;
  p.softmax_scale = 0.0721688f;  // 1 / sqrt(192)
  p.page_size = int(kPage);
  // Dense: splits of whole pages, as DcpAttention's fast mode (DcpAttention::split_interleave);
  // DCPATTN_BENCH_INTERLEAVE=1 gives the ownership's interleave of deterministic mode instead.
  // Sparse: the ownership's interleave (1).
  p.interleave = c.sparse ? 1 : int(kPage);
  if (const char* il = std::getenv("DCPATTN_BENCH_INTERLEAVE"); il != nullptr && !c.sparse)
    p.interleave = std::atoi(il);
  p.num_valid_rows = B;
  // DCPATTN_BENCH_BF16_STATES=1: the split states in bf16 (fast mode with bf16 partials).
  p.bf16_split_states = std::getenv("DCPATTN_BENCH_BF16_STATES") != nullptr;
  p.num_splits = dcpattn::cuda_kernels::mla_decode_fast_splits(B, H, attended, sm_count);
  if (const char* forced = std::getenv("DCPATTN_BENCH_SPLITS")) p.num_splits = std::atoi(forced);
  // Sparse: each split scans its run of the top-k list, as DcpAttention's fast mode;
  // DCPATTN_BENCH_POSITION_SPLITS=1 gives deterministic mode's splits of positions instead.
  p.split_topk_list = c.sparse && std::getenv("DCPATTN_BENCH_POSITION_SPLITS") == nullptr;
  const bool bf16_states = dcpattn::cuda_kernels::detail::mla::bf16_states_taken(
      p, H, dcpattn::cuda_kernels::detail::mla::use_wgmma_kernel());
  const std::size_t scratch_bytes =
      dcpattn::cuda_kernels::mla_decode_scratch_bytes(B, H, p.num_splits);
  DeviceBuffer scratch(scratch_bytes);

  auto qv = dcpattn::make_view(static_cast<const bfloat16*>(q.ptr), {B, H, 576});
  auto ov = dcpattn::make_view(o.as<float>(), {B, H, 512});
  auto lv = dcpattn::make_view(lse.as<float>(), {B, H});
  auto tv = dcpattn::make_view(static_cast<const std::int32_t*>(d_table.ptr), {B, pages_per_req});
  auto rv = dcpattn::make_view(static_cast<const std::int32_t*>(d_req.ptr), {B});
  auto len_v = dcpattn::make_view(static_cast<const std::int64_t*>(d_len.ptr), {B});
  auto kv = dcpattn::make_view(static_cast<const std::int32_t*>(d_topk.ptr), {B, std::int64_t(K)});
  cuda::std::span<std::byte> sc(static_cast<std::byte*>(scratch.ptr), scratch_bytes);
  const dcpattn::RoundRobinOwnership own(1, 1, 1);

  auto call = [&] {
    if (c.format == CacheFormat::bf16) {
      auto cv = dcpattn::make_view(static_cast<const bfloat16*>(cache.ptr), {slots, 576});
      if (c.sparse)
        dcpattn::cuda_kernels::mla_decode_sparse(qv, cv, tv, rv, kv, len_v, own, 0, p, ov, lv, sc,
                                                 stream);
      else
        dcpattn::cuda_kernels::mla_decode_dense(qv, cv, tv, rv, len_v, p, ov, lv, sc, stream);
    } else {
      auto cv = dcpattn::make_view(static_cast<const std::uint8_t*>(cache.ptr), {slots, 656});
      if (c.sparse)
        dcpattn::cuda_kernels::mla_decode_sparse(qv, cv, tv, rv, kv, len_v, own, 0, p, ov, lv, sc,
                                                 stream);
      else
        dcpattn::cuda_kernels::mla_decode_dense(qv, cv, tv, rv, len_v, p, ov, lv, sc, stream);
    }
  };
  const char* flush_env = std::getenv("DCPATTN_BENCH_FLUSH");
  const bool write_flush = flush_env != nullptr && std::string(flush_env) == "write";
  const dcpattn::bench::Flush flush_mode =
      write_flush ? dcpattn::bench::Flush::write : dcpattn::bench::Flush::read;
  const double us =
      dcpattn::bench::median_us_flushed(call, stream, flush, flush_bytes, 5, 30, flush_mode);
  const double sm_mhz = dcpattn::bench::sm_clock_mhz(stream);
  // Calls under 1 ms also as CUDA-graph replays of 10 back-to-back calls (no host launch work,
  // no flush: a small case's inputs then sit in L2): what a graph-captured decode step sees.
  const double graph_us =
      us < 1000.0 ? dcpattn::bench::median_us_graph(call, stream, 10, 3, 10) : -1.0;
  const double behind_us =
      dcpattn::bench::median_us_behind_flush(call, stream, flush, flush_bytes, 5, 30, flush_mode);

  // The same timing after a sustained load of flushes and calls (DCPATTN_BENCH_WARMUP_MS, 0:
  // skipped): the clock a busy GPU settles at under its power limit (bench_common.cuh, sustain).
  const char* warm_env = std::getenv("DCPATTN_BENCH_WARMUP_MS");
  const double warm_ms = warm_env != nullptr ? std::atof(warm_env) : kDefaultWarmupMs;
  double sustained_us = -1.0, sustained_mhz = -1.0;
  if (warm_ms > 0) {
    dcpattn::bench::sustain(
        [&] {
          dcpattn::bench::flush_l2(flush, flush_bytes, flush_mode, 0, stream);
          call();
        },
        stream, warm_ms);
    sustained_us =
        dcpattn::bench::median_us_flushed(call, stream, flush, flush_bytes, 0, 30, flush_mode);
    sustained_mhz = dcpattn::bench::sm_clock_mhz(stream);
  }
  // Then calls back to back for DCPATTN_BENCH_ENERGY_MS (default 1000; 0 skips it): their time
  // per call, and their energy from the GPU's counter read at both ends (-1 where the driver has
  // no NVML).
  const char* energy_env = std::getenv("DCPATTN_BENCH_ENERGY_MS");
  const double energy_ms = energy_env != nullptr ? std::atof(energy_env) : kDefaultEnergyMs;
  const dcpattn::bench::BackToBack window =
      dcpattn::bench::back_to_back(call, stream, energy_ms, energy);

  // The host's share of a call: what the CPU spends enqueueing it (the argument checks, the
  // tensor maps' encoding, the launches), the median over 20 calls enqueued back to back.
  std::vector<double> host;
  for (int i = 0; i < 20; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    call();
    const auto t1 = std::chrono::steady_clock::now();
    host.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  DCPATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::sort(host.begin(), host.end());
  const double host_us = host[host.size() / 2];

  const double flops = 2.0 * double(B) * H * double(attended) * (576 + 512);
  const double bytes = double(B) * double(attended) * row_bytes + double(B) * H * 576 * 2 +
                       double(B) * H * (512 + 1) * 4 +
                       double(B) * (c.sparse ? K * 4.0 : pages_per_req * 4.0);
  const double tflops = flops / (us * 1e6);
  const double gbs = bytes / (us * 1e3);
  const double gbs_behind = bytes / (behind_us * 1e3);
  std::printf(
      "%-6s %-4s B=%4d L=%7lld H=%4d S=%2d I=%2d  %10.1f us  %7.1f TFLOP/s  %7.0f GB/s (%5.1f%% of "
      "copy)  behind flush %.1f us (%.1f TFLOP/s, %.1f%%)  graph %.1f us  host %.1f us  %.0f MHz  "
      "sustained %.1f us (%.1f TFLOP/s) %.0f MHz  back to back %.1f us  %.2f mJ/call (%.0f "
      "W)%s%s\n",
      c.sparse ? "sparse" : "dense", format_name(c.format).c_str(), B, (long long)L, H,
      p.num_splits, p.interleave, us, tflops, gbs, 100.0 * gbs / copy_gbs, behind_us,
      flops / (behind_us * 1e6), 100.0 * gbs_behind / copy_gbs, graph_us, host_us, sm_mhz,
      sustained_us, sustained_us > 0 ? flops / (sustained_us * 1e6) : -1.0, sustained_mhz,
      window.us_per_call, window.mj_per_call, window.watts,
      bf16_states ? "  (bf16 split states)" : "",
      c.sparse && p.num_splits > 1 && !p.split_topk_list ? "  (splits of positions)" : "");
  std::fflush(stdout);
  json.begin()
      .field("kernel", c.sparse ? "sparse" : "dense")
      .field("impl", dcpattn::cuda_kernels::detail::mla::use_wgmma_kernel() ? "wgmma" : "mma.sync")
      .field("cache", format_name(c.format))
      .field("batch", B)
      .field("context", double(L))
      .field("heads", H)
      .field("topk", K)
      .field("split_states", bf16_states ? "bf16" : "fp32")
      .field("num_splits", p.num_splits)
      .field("interleave", p.interleave)
      .field("splits_of", c.sparse && p.split_topk_list ? "list" : "positions")
      .field("flush", write_flush ? "write" : "read")
      .field("median_us", us)
      .field("sm_mhz", sm_mhz)
      .field("sustained_ms", warm_ms)
      .field("sustained_us", sustained_us)
      .field("sustained_mhz", sustained_mhz)
      .field("graph_us", graph_us)
      .field("host_us", host_us)
      .field("tflops", tflops)
      .field("gbs", gbs)
      .field("copy_gbs", copy_gbs)
      .field("pct_copy", 100.0 * gbs / copy_gbs)
      .field("behind_flush_us", behind_us)
      .field("tflops_behind_flush", flops / (behind_us * 1e6))
      .field("pct_copy_behind_flush", 100.0 * gbs_behind / copy_gbs)
      .field("tflops_sustained", sustained_us > 0 ? flops / (sustained_us * 1e6) : -1.0)
      .field("energy_ms", energy_ms)
      .field("energy_calls", double(window.calls))
      .field("window_us", window.us_per_call)
      .field("tflops_window", window.us_per_call > 0 ? flops / (window.us_per_call * 1e6) : -1.0)
      .field("energy_mj_per_call", window.mj_per_call)
      .field("energy_watts", window.watts);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    cudaStream_t stream;
    DCPATTN_CUDA_CHECK(cudaStreamCreate(&stream));
    int dev = 0;
    DCPATTN_CUDA_CHECK(cudaGetDevice(&dev));
    cudaDeviceProp prop{};
    DCPATTN_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    const double copy_gbs = dcpattn::bench::measure_copy_bandwidth_gbs(stream);
    std::printf("device %s, %d SMs, copy bandwidth %.0f GB/s\n", prop.name,
                prop.multiProcessorCount, copy_gbs);
    const std::size_t flush_bytes = std::size_t(256) << 20;
    DeviceBuffer flush(flush_bytes);
    const dcpattn::bench::EnergyCounter energy(dev);
    std::printf("energy counter: %s\n", energy.available() ? "NVML" : "none (no NVML)");
    dcpattn::bench::JsonRecords json;
    // DCPATTN_BENCH_QUICK=1: a few representative cases only.
    const bool quick = std::getenv("DCPATTN_BENCH_QUICK") != nullptr;
    // DCPATTN_BENCH_MMA_SYNC=1: time the mma.sync kernel (what compute capability 8.x runs).
    const bool mma_sync = std::getenv("DCPATTN_BENCH_MMA_SYNC") != nullptr;
    dcpattn::cuda_kernels::detail::mla::force_mma_sync_kernel.store(mma_sync);
    std::printf("kernel: %s\n", mma_sync ? "mma.sync (forced)" : "default for this device");
    std::vector<Case> cases;
    for (CacheFormat f : {CacheFormat::bf16, CacheFormat::fp8_ds_mla})
      for (int h : {16, 128})
        for (std::int64_t l : {4096LL, 32768LL, 131072LL})
          for (int b : {1, 8, 64, 128}) {
            if (quick && !(b == 64 && l == 32768) && !(b == 1 && l == 131072)) continue;
            cases.push_back({false, f, b, l, h, 0});
          }
    for (CacheFormat f : {CacheFormat::bf16, CacheFormat::fp8_ds_mla})
      for (int h : {64, 128})
        for (int b : {1, 8, 64, 128}) {
          if (quick && b != 64) continue;
          cases.push_back({true, f, b, 32768, h, 2048});
        }
    // DCPATTN_BENCH_FILTER="dense bf16 B=128 L=32768 H=128": only cases whose label contains it.
    const char* filter = std::getenv("DCPATTN_BENCH_FILTER");
    for (const Case& c : cases) {
      const std::string label = std::string(c.sparse ? "sparse " : "dense ") +
                                format_name(c.format) + " B=" + std::to_string(c.batch) +
                                " L=" + std::to_string(c.context) + " H=" + std::to_string(c.heads);
      if (filter && label.find(filter) == std::string::npos) continue;
      if (!run_case(c, stream, prop.multiProcessorCount, copy_gbs, flush.ptr, flush_bytes, energy,
                    json))
        std::printf("skipped (does not fit): B=%d L=%lld\n", c.batch, (long long)c.context);
    }
    json.write(dcpattn::bench::json_path(argc, argv, "mla_decode.json"));
    cudaStreamDestroy(stream);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_mla_decode: %s\n", e.what());
    return 1;
  }
  return 0;
}
