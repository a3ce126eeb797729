// SPDX-License-Identifier: Apache-2.0
// Fused MLA prologue (cuda_kernels::fused_prologue): median time, bytes moved, achieved GB/s and
// the share of the measured device-to-device copy bandwidth, for T in {64, 4096, 32768} rows and
//   fp8_indexer       fp8 ds_mla cache + indexer keys + top-k 2048 (DeepSeek-V3.2 / GLM-5), every
//                     row owning a slot (DCP1),
//   fp8_indexer_dcp4  the same as one rank of DCP4 sees it: a quarter of the rows own a slot,
//   bf16              bf16 cache, no indexer, no top-k (dense MLA, DeepSeek-V3).
// Bytes counted are the minimum any implementation moves: q_c read + q_c_out written (every row);
// per row that owns a slot kv_c + k_pe read, its position and cos/sin row read, the cache entry
// written, and with the indexer the key read and its 132 cache bytes written; slot_mapping read;
// top-k rows written; the norm weights once.
// Inputs are rotated over enough copies that one call's working set is not served from L2
// ("rotated"); T = 64 is also timed on one L2-resident set ("resident"), the decode case where
// the projection that produced q_c just ran.
// median_us is per call, from CUDA-graph replays of `calls_per_graph` calls over the rotated sets
// (what a graph-captured decode step sees: no host launch cost); stream_us is one eagerly launched
// call between two events (host enqueue cost included where the kernel is shorter than it).
// copy_same_us: a plain copy of the same bytes timed the same way (bench_common.cuh
// same_size_copy_us), the ceiling at this size; pct_copy_same = 100 copy_same_us / median_us.
// JSON records go to argv[1] (default prologue.json).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "bench_common.cuh"

#include "dcpattn/kernels/cuda/prologue.cuh"

namespace {

using dcpattn::bench::DeviceBuffer;
using dcpattn::bench::fill_bf16;

using dcpattn::bfloat16;
using dcpattn::CacheFormat;

constexpr int kQ = dcpattn::kMlaQLoraRank;
constexpr int kLatent = dcpattn::kMlaLatentDim;
constexpr int kRope = dcpattn::kMlaRopeDim;
constexpr int kIdx = dcpattn::kIndexerHeadDim;
constexpr int kIdxBytes = dcpattn::IndexerKCacheLayout::bytes_per_token;
constexpr std::int64_t kPageSize = 64;
constexpr std::int64_t kMaxPosition = 65536;

__global__ void fill_cos_sin(float* cs, std::int64_t max_position) {
  const std::int64_t n = max_position * (kRope / 2);
  for (std::int64_t k = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; k < n;
       k += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t p = k / (kRope / 2);
    const int i = int(k % (kRope / 2));
    const float angle = float(p) * powf(10000.0f, -2.0f * float(i) / float(kRope));
    cs[p * kRope + i] = cosf(angle);
    cs[p * kRope + kRope / 2 + i] = sinf(angle);
  }
}

struct Config {
  const char* name;
  CacheFormat format;
  bool indexer;
  std::int64_t topk;
  double own_fraction;
};

/// Minimum bytes one call moves (see the file comment).
double min_bytes(const Config& c, std::int64_t T, std::int64_t owned) {
  const double entry = c.format == CacheFormat::bf16 ? dcpattn::kMlaQkDim * 2.0 : dcpattn::DsMlaFp8Entry::bytes;
  double b = double(T) * kQ * 2.0 * 2.0;                                    // q_c, q_c_out
  b += double(T) * 8.0;                                                     // slot_mapping
  b += double(owned) * ((kLatent + kRope) * 2.0 + 8.0 + kRope * 4.0 + entry);  // kv_c, k_pe, pos, cos/sin, entry
  if (c.indexer) b += double(owned) * (kIdx * 2.0 + kIdxBytes);             // index_k, its cache bytes
  b += double(T) * double(c.topk) * 4.0;                                    // top-k rows
  b += (kQ + kLatent + (c.indexer ? 2 * kIdx : 0)) * 2.0;                   // weights, once
  return b;
}

/// One set of per-call buffers (inputs and outputs) of a batch of T rows.
struct Set {
  DeviceBuffer q_c, q_out, kv_c, k_pe, positions, slots, index_k, kv_cache, index_cache, topk;
  Set(const Config& c, std::int64_t T, std::int64_t num_slots)
      : q_c(std::size_t(T) * kQ * 2),
        q_out(std::size_t(T) * kQ * 2),
        kv_c(std::size_t(T) * kLatent * 2),
        k_pe(std::size_t(T) * kRope * 2),
        positions(std::size_t(T) * 8),
        slots(std::size_t(T) * 8),
        index_k(c.indexer ? std::size_t(T) * kIdx * 2 : 0),
        kv_cache(std::size_t(num_slots) *
                 std::size_t(c.format == CacheFormat::bf16 ? dcpattn::kMlaQkDim * 2 : dcpattn::DsMlaFp8Entry::bytes)),
        index_cache(c.indexer ? std::size_t(num_slots) * kIdxBytes : 0),
        topk(std::size_t(T) * std::size_t(std::max<std::int64_t>(c.topk, 1)) * 4) {}
};

template <CacheFormat F>
dcpattn::PrologueArgs<dcpattn::mla_cache_out_view_t<F>> make_args(const Config& c, const Set& s,
                                                                  std::int64_t T, std::int64_t num_slots,
                                                                  const DeviceBuffer& weights,
                                                                  const DeviceBuffer& cos_sin) {
  using dcpattn::make_view;
  dcpattn::PrologueArgs<dcpattn::mla_cache_out_view_t<F>> a;
  const bfloat16* w = weights.as<const bfloat16>();
  a.q_c = make_view(s.q_c.as<const bfloat16>(), {T, std::int64_t(kQ)});
  a.q_c_out = make_view(s.q_out.as<bfloat16>(), {T, std::int64_t(kQ)});
  a.q_norm_weight = make_view(w, {std::int64_t(kQ)});
  a.kv_c = make_view(s.kv_c.as<const bfloat16>(), {T, std::int64_t(kLatent)});
  a.kv_norm_weight = make_view(w + kQ, {std::int64_t(kLatent)});
  a.k_pe = make_view(s.k_pe.as<const bfloat16>(), {T, std::int64_t(kRope)});
  a.positions = make_view(s.positions.as<const std::int64_t>(), {T});
  a.cos_sin_cache = make_view(cos_sin.as<const float>(), {kMaxPosition, std::int64_t(kRope)});
  a.slot_mapping = make_view(s.slots.as<const std::int64_t>(), {T});
  a.kv_cache = make_view(s.kv_cache.as<dcpattn::mla_cache_element_t<F>>(),
                         {num_slots, std::int64_t(dcpattn::mla_cache_row_width(F))});
  if (c.indexer) {
    a.index_k = make_view(s.index_k.as<const bfloat16>(), {T, std::int64_t(kIdx)});
    a.index_k_norm_weight = make_view(w + kQ + kLatent, {std::int64_t(kIdx)});
    a.index_k_norm_bias = make_view(w + kQ + kLatent + kIdx, {std::int64_t(kIdx)});
    a.index_k_cache = make_view(s.index_cache.as<std::uint8_t>(),
                                {num_slots / kPageSize, kPageSize * kIdxBytes});
  }
  if (c.topk > 0) a.topk_indices = make_view(s.topk.as<std::int32_t>(), {T, c.topk});
  return a;
}

void fill(bfloat16* p, std::size_t n, std::uint64_t seed, float lo, float hi, cudaStream_t stream) {
  if (n == 0) return;
  fill_bf16<<<1024, 256, 0, stream>>>(p, n, seed, lo, hi);
  DCPATTN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

int main(int argc, char** argv) {
  using namespace dcpattn::bench;
  const std::string out = json_path(argc, argv, "prologue.json");
  cudaStream_t stream;
  DCPATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  int device = 0, l2_bytes = 0;
  DCPATTN_CUDA_CHECK(cudaGetDevice(&device));
  DCPATTN_CUDA_CHECK(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device));
  cudaDeviceProp prop{};
  DCPATTN_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  const double copy_gbs = measure_copy_bandwidth_gbs(stream);
  std::printf("device %s, L2 %d MiB, copy bandwidth %.0f GB/s\n", prop.name, l2_bytes >> 20, copy_gbs);

  DeviceBuffer weights(std::size_t(kQ + kLatent + 2 * kIdx) * 2);
  DeviceBuffer cos_sin(std::size_t(kMaxPosition) * kRope * 4);
  fill(weights.as<bfloat16>(), kQ + kLatent + kIdx, 1, 0.5f, 1.5f, stream);
  fill(weights.as<bfloat16>() + kQ + kLatent + kIdx, kIdx, 2, -0.2f, 0.2f, stream);
  fill_cos_sin<<<1024, 256, 0, stream>>>(cos_sin.as<float>(), kMaxPosition);
  DCPATTN_CUDA_CHECK(cudaGetLastError());

  const Config configs[] = {
      {"fp8_indexer", CacheFormat::fp8_ds_mla, true, 2048, 1.0},
      {"fp8_indexer_dcp4", CacheFormat::fp8_ds_mla, true, 2048, 0.25},
      {"bf16", CacheFormat::bf16, false, 0, 1.0},
  };
  JsonRecords json;
  std::printf("%-18s %7s %-9s %10s %10s %10s %9s %7s %9s %7s\n", "config", "T", "l2",
              "median_us", "stream_us", "MB", "GB/s", "%copy", "copy_us", "%same");
  for (const Config& c : configs)
    for (std::int64_t T : {std::int64_t(64), std::int64_t(4096), std::int64_t(32768)}) {
      // Slots: pages in shuffled order, the owned rows in order within them.
      std::mt19937_64 rng(std::uint64_t(T) * 7 + std::uint64_t(c.indexer));
      const std::int64_t num_slots = (T + kPageSize - 1) / kPageSize * kPageSize;
      std::vector<std::int64_t> pages(std::size_t(num_slots / kPageSize));
      std::iota(pages.begin(), pages.end(), 0);
      std::shuffle(pages.begin(), pages.end(), rng);
      std::vector<std::int64_t> slots(std::size_t(T), -1);
      std::vector<std::int64_t> positions(std::size_t(T), 0);
      std::int64_t owned = 0;
      for (std::int64_t t = 0; t < T; ++t) {
        positions[std::size_t(t)] = std::int64_t(rng() % std::uint64_t(kMaxPosition));
        const bool own = c.own_fraction >= 1.0 ||
                         std::uniform_real_distribution<double>(0, 1)(rng) < c.own_fraction;
        if (!own) continue;
        slots[std::size_t(t)] = pages[std::size_t(owned / kPageSize)] * kPageSize + owned % kPageSize;
        ++owned;
      }
      const double bytes = min_bytes(c, T, owned);

      // Enough sets that the rotation's footprint is three times the L2.
      const int rotated_sets = rotation_sets(bytes, std::size_t(l2_bytes));
      std::vector<std::unique_ptr<Set>> sets;
      for (int i = 0; i < rotated_sets; ++i) {
        sets.emplace_back(new Set(c, T, num_slots));
        Set& s = *sets.back();
        const std::uint64_t seed = 1000 + std::uint64_t(i) * 16;
        fill(s.q_c.as<bfloat16>(), std::size_t(T) * kQ, seed + 1, -2.0f, 2.0f, stream);
        fill(s.kv_c.as<bfloat16>(), std::size_t(T) * kLatent, seed + 2, -3.0f, 3.0f, stream);
        fill(s.k_pe.as<bfloat16>(), std::size_t(T) * kRope, seed + 3, -1.0f, 1.0f, stream);
        if (c.indexer) fill(s.index_k.as<bfloat16>(), std::size_t(T) * kIdx, seed + 4, -2.0f, 3.0f, stream);
        DCPATTN_CUDA_CHECK(cudaMemcpyAsync(s.slots.ptr, slots.data(), slots.size() * 8,
                                           cudaMemcpyHostToDevice, stream));
        DCPATTN_CUDA_CHECK(cudaMemcpyAsync(s.positions.ptr, positions.data(), positions.size() * 8,
                                           cudaMemcpyHostToDevice, stream));
      }
      DCPATTN_CUDA_CHECK(cudaStreamSynchronize(stream));

      for (const char* l2 : {"rotated", "resident"}) {
        const bool resident = std::string(l2) == "resident";
        if (resident && T != 64) continue;
        const int n_sets = resident ? 1 : rotated_sets;
        int next = 0;
        auto call = [&] {
          const Set& s = *sets[std::size_t(next++ % n_sets)];
          if (c.format == CacheFormat::bf16)
            dcpattn::cuda_kernels::fused_prologue(
                make_args<CacheFormat::bf16>(c, s, T, num_slots, weights, cos_sin), stream);
          else
            dcpattn::cuda_kernels::fused_prologue(
                make_args<CacheFormat::fp8_ds_mla>(c, s, T, num_slots, weights, cos_sin), stream);
        };
        const double stream_us = median_us(call, stream, 10, 100);

        // A graph of calls_per_graph calls walking the sets in order.
        const int min_calls = T <= 4096 ? 32 : 4;
        const int calls_per_graph = (std::max(min_calls, n_sets) + n_sets - 1) / n_sets * n_sets;
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        next = 0;
        DCPATTN_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        for (int i = 0; i < calls_per_graph; ++i) call();
        DCPATTN_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
        DCPATTN_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
        const double us =
            median_us([&] { DCPATTN_CUDA_CHECK(cudaGraphLaunch(exec, stream)); }, stream, 3,
                      T <= 4096 ? 50 : 20) /
            calls_per_graph;
        DCPATTN_CUDA_CHECK(cudaGraphExecDestroy(exec));
        DCPATTN_CUDA_CHECK(cudaGraphDestroy(graph));

        const double gbs = bytes / (us * 1e3);
        const double copy_us = same_size_copy_us(bytes, std::size_t(l2_bytes), stream);
        std::printf("%-18s %7lld %-9s %10.2f %10.2f %10.2f %9.0f %6.1f%% %9.2f %6.1f%%\n", c.name,
                    (long long)T, l2, us, stream_us, bytes / 1e6, gbs, 100.0 * gbs / copy_gbs,
                    copy_us, 100.0 * copy_us / us);
        json.begin()
            .field("bench", "prologue")
            .field("impl", "dcpattn")
            .field("device", prop.name)
            .field("config", c.name)
            .field("cache", c.format == CacheFormat::bf16 ? "bf16" : "fp8_ds_mla")
            .field("indexer", c.indexer ? 1.0 : 0.0)
            .field("topk", double(c.topk))
            .field("T", double(T))
            .field("owned_rows", double(owned))
            .field("l2", l2)
            .field("sets", double(n_sets))
            .field("calls_per_graph", double(calls_per_graph))
            .field("median_us", us)
            .field("stream_us", stream_us)
            .field("bytes", bytes)
            .field("gbs", gbs)
            .field("copy_gbs", copy_gbs)
            .field("pct_copy", 100.0 * gbs / copy_gbs)
            .field("copy_same_us", copy_us)
            .field("pct_copy_same", 100.0 * copy_us / us);
      }
    }
  json.write(out);
  std::printf("wrote %s\n", out.c_str());
  DCPATTN_CUDA_CHECK(cudaStreamDestroy(stream));
  return 0;
}
