// SPDX-License-Identifier: Apache-2.0
// The local steps of the combine, on one GPU: what runs besides the collective.
//   pack_a2a_{fp32,bf16}   (T, H, 512) fp32 partial + lse -> N all-to-all chunks
//   merge_det_fp32         N received fp32 chunks -> (T, H/N, 512) bf16, fixed tree (deterministic)
//   merge_fast_{fp32,bf16} N received chunks -> (T, H/N, 512) bf16, one N-way log-sum-exp
//   rescale_agrs           (T, H, 512) fp32 + (N, T, H) lse -> (N, T, H/N, 512) fp32 (vLLM-style)
// for T in {1, 16, 64, 256, 1024, 8192}, H in {16, 128}, N in {2, 4, 8}. Reports the bytes each
// step must move (every input read once, every output written once), the achieved GB/s and its
// share of the measured device-to-device copy bandwidth, from three timings per step:
//   median_us  per call, CUDA-graph replays of calls_per_graph back-to-back calls (median replay
//              over calls_per_graph; each timed replay queued behind an untimed one): no host
//              launch work, the launch gaps of a graph-captured step (bench_common.cuh
//              median_us_graph; the peers: triton.testing.do_bench_cudagraph)
//   single_us  one call behind a 256 MiB L2 flush, events around it: the latency of one launch
//              without its host launch work (median_us_flushed; the peers: triton.testing.do_bench)
//   eager_us   one call from an idle stream, events around it: host launch work included
// L2: every step rotates among `sets` copies of its inputs and outputs, sets = clamp(ceil(3 L2 /
// bytes), 1, 64) from its own bytes per call (the peers use the same rule), so that consecutive
// calls do not find their inputs in L2; pct_l2_footprint = 100 sets bytes / L2 says where 64 sets
// could not reach that (small T: the graph then runs from L2, for the peers as for us).
// copy_same_us: a plain copy of the same bytes timed the same way (bench::same_size_copy_us), the
// ceiling at this size; pct_copy_same = 100 copy_same_us / median_us.
//
// Usage: bench_combine [out.json]   (default: bench_combine.json)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "bench_common.cuh"
#include "dcpattn/core/tensor.hpp"
#include "dcpattn/kernels/cuda/combine.cuh"

using namespace dcpattn;

namespace {

constexpr int kDv = 512;

/// Deterministic pseudo-random fill: values in [lo, hi).
__global__ void fill_uniform(float* p, std::size_t n, std::uint32_t seed, float lo, float hi) {
  for (std::size_t i = std::size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x) {
    std::uint32_t x = std::uint32_t(i) * 2654435761u ^ seed ^ std::uint32_t(i >> 32) * 40503u;
    x ^= x >> 15;
    x *= 2246822519u;
    x ^= x >> 13;
    x *= 3266489917u;
    x ^= x >> 16;
    p[i] = lo + (hi - lo) * float(x >> 8) * (1.0f / 16777216.0f);
  }
}
void fill(float* p, std::size_t n, std::uint32_t seed, float lo, float hi, cudaStream_t stream) {
  fill_uniform<<<1024, 256, 0, stream>>>(p, n, seed, lo, hi);
  DCPATTN_CUDA_CHECK(cudaGetLastError());
}

template <class T>
T* device_alloc(std::size_t bytes) {
  void* p = nullptr;
  DCPATTN_CUDA_CHECK(cudaMalloc(&p, bytes == 0 ? 16 : bytes));
  return static_cast<T*>(p);
}

struct Shape {
  std::int64_t t, h;
  int n;
};

}  // namespace

int main(int argc, char** argv) {
  const std::string out_path = bench::json_path(argc, argv, "bench_combine.json");
  cudaStream_t stream;
  DCPATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  int device = 0, l2 = 0;
  DCPATTN_CUDA_CHECK(cudaGetDevice(&device));
  DCPATTN_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
  cudaDeviceProp prop{};
  DCPATTN_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  const double copy_gbs = bench::measure_copy_bandwidth_gbs(stream);
  std::printf("device: %s, L2 %d MiB, copy bandwidth %.0f GB/s (read + write)\n", prop.name,
              l2 >> 20, copy_gbs);
  // the L2 flush of single_us: 256 MiB, as triton.testing.do_bench
  constexpr std::size_t kFlushBytes = std::size_t(256) << 20;
  void* flush = device_alloc<std::byte>(kFlushBytes);
  constexpr int kMinCallsPerGraph = 20;

  bench::JsonRecords json;
  json.begin()
      .field("kernel", std::string("copy_ceiling"))
      .field("device", std::string(prop.name))
      .field("gbps", copy_gbs)
      .field("l2_bytes", double(l2))
      .field("note",
             std::string("median_us: per call from CUDA-graph replays of calls_per_graph calls "
                         "(median replay / calls); single_us: one call behind a 256 MiB L2 flush "
                         "(as triton do_bench); eager_us: one call from an idle stream, host "
                         "launch included; inputs rotate over sets = clamp(ceil(3 L2 / bytes), 1, "
                         "64) copies; gbps and pct_copy_bw from median_us"));

  std::printf("%-16s %6s %4s %2s %9s %9s %9s %12s %7s %6s %6s %5s %8s %6s\n", "kernel", "T", "H",
              "N", "graph_us", "single_us", "eager_us", "bytes", "GB/s", "%copy", "%copy1", "sets",
              "copy_us", "%same");
  // time of a copy of the same bytes (bench::same_size_copy_us), per byte count
  std::map<double, double> copy_same_us;
  for (std::int64_t t : {1, 16, 64, 256, 1024, 8192}) {
    for (std::int64_t h : {16, 128}) {
      for (int n : {2, 4, 8}) {
        const Shape s{t, h, n};
        const std::int64_t hl = h / n;
        const auto l32 = dcpattn::detail::A2aChunkLayout::make(t, hl, kDv, PartialDtype::fp32);
        const auto l16 = dcpattn::detail::A2aChunkLayout::make(t, hl, kDv, PartialDtype::bf16);
        // one set of every buffer of this shape
        const std::size_t o_b = std::size_t(t * h * kDv) * 4, lse_b = std::size_t(t * h) * 4;
        const std::size_t s32_b = std::size_t(n) * l32.bytes, s16_b = std::size_t(n) * l16.bytes;
        const std::size_t out_b = std::size_t(t * hl * kDv) * 2;
        const std::size_t lse_all_b = std::size_t(n) * lse_b, packed_b = o_b;

        // bytes each step must move per call
        const double rows_all = double(t * h), rows_local = double(t * hl);
        auto pack_bytes = [&](double esize) {
          return rows_all * (kDv * 4 + 4) + rows_all * (kDv * esize + 4);
        };
        auto merge_bytes = [&](double esize) {
          return double(n) * rows_local * (kDv * esize + 4) + rows_local * kDv * 2;
        };
        const double rescale_bytes =
            rows_all * kDv * 4 + double(n) * rows_all * 4 + rows_all * kDv * 4;
        auto sets_for = [&](double bytes) { return bench::rotation_sets(bytes, std::size_t(l2)); };
        const int sets =
            std::max({sets_for(pack_bytes(4)), sets_for(pack_bytes(2)), sets_for(merge_bytes(4)),
                      sets_for(merge_bytes(2)), sets_for(rescale_bytes)});

        auto* o = device_alloc<float>(sets * o_b);
        auto* lse = device_alloc<float>(sets * lse_b);
        auto* s32 = device_alloc<std::byte>(sets * s32_b);
        auto* s16 = device_alloc<std::byte>(sets * s16_b);
        auto* out = device_alloc<bfloat16>(sets * out_b);
        auto* lse_all = device_alloc<float>(sets * lse_all_b);
        auto* packed = device_alloc<float>(sets * packed_b);
        fill(o, sets * o_b / 4, 1u, -2.0f, 2.0f, stream);
        fill(lse, sets * lse_b / 4, 2u, -4.0f, 4.0f, stream);  // finite: every state is read
        fill(lse_all, sets * lse_all_b / 4, 3u, -4.0f, 4.0f, stream);

        auto o_view = [&](int i) {
          return make_view(static_cast<const float*>(o) + std::size_t(i) * o_b / 4,
                           {t, h, std::int64_t(kDv)});
        };
        auto lse_view = [&](int i) {
          return make_view(static_cast<const float*>(lse) + std::size_t(i) * lse_b / 4, {t, h});
        };
        auto out_view = [&](int i) {
          return make_view(out + std::size_t(i) * out_b / 2, {t, hl, std::int64_t(kDv)});
        };
        const TensorView<float, 2> no_lse{};
        // the received chunks: this rank's pack output stands in for what the exchange delivers
        for (int i = 0; i < sets; ++i) {
          cuda_kernels::combine_pack_a2a<lse_base_e>(
              o_view(i), lse_view(i), int(t), n, PartialDtype::fp32, l32, s32 + i * s32_b, stream);
          cuda_kernels::combine_pack_a2a<lse_base_e>(
              o_view(i), lse_view(i), int(t), n, PartialDtype::bf16, l16, s16 + i * s16_b, stream);
        }
        DCPATTN_CUDA_CHECK(cudaStreamSynchronize(stream));

        // Times `call(i)` (i: the input set) three ways, rotating over the sets its bytes need.
        auto run = [&](const char* kernel, double bytes, const auto& call) {
          const int k_sets = std::min(sets, sets_for(bytes));
          auto cached = copy_same_us.find(bytes);
          if (cached == copy_same_us.end())
            cached = copy_same_us.emplace(bytes, bench::same_size_copy_us(bytes, l2, stream)).first;
          const double copy_us = cached->second;
          int it = 0;
          auto next = [&] { call((it++) % k_sets); };
          const double eager_us = bench::median_us(next, stream);
          const double single_us = bench::median_us_flushed(next, stream, flush, kFlushBytes);
          const int calls = (std::max(kMinCallsPerGraph, k_sets) + k_sets - 1) / k_sets * k_sets;
          it = 0;
          const double us = bench::median_us_graph(next, stream, calls);
          const double gbs = bytes / (us * 1e3), gbs1 = bytes / (single_us * 1e3);
          const double l2_pct = 100.0 * double(k_sets) * bytes / double(l2);
          std::printf(
              "%-16s %6lld %4lld %2d %9.2f %9.2f %9.2f %12.0f %7.0f %5.1f%% %5.1f%% %5d %8.2f "
              "%5.1f%%%s\n",
              kernel, (long long)s.t, (long long)s.h, s.n, us, single_us, eager_us, bytes, gbs,
              100.0 * gbs / copy_gbs, 100.0 * gbs1 / copy_gbs, k_sets, copy_us,
              100.0 * copy_us / us, l2_pct < 200.0 ? " (L2)" : "");
          json.begin()
              .field("kernel", std::string(kernel))
              .field("T", double(s.t))
              .field("H", double(s.h))
              .field("N", double(s.n))
              .field("H_local", double(hl))
              .field("median_us", us)
              .field("single_us", single_us)
              .field("eager_us", eager_us)
              .field("bytes", bytes)
              .field("gbps", gbs)
              .field("pct_copy_bw", 100.0 * gbs / copy_gbs)
              .field("pct_copy_bw_single", 100.0 * gbs1 / copy_gbs)
              .field("sets", double(k_sets))
              .field("calls_per_graph", double(calls))
              .field("pct_l2_footprint", l2_pct)
              .field("copy_same_us", copy_us)
              .field("pct_copy_same", 100.0 * copy_us / us);
        };

        // pack: read o + lse, write N chunks (o in the partial dtype + lse); it rewrites the
        // chunks the merges read below with the same bytes
        for (PartialDtype dt : {PartialDtype::fp32, PartialDtype::bf16}) {
          const auto& lay = dt == PartialDtype::fp32 ? l32 : l16;
          std::byte* base = dt == PartialDtype::fp32 ? s32 : s16;
          const std::size_t stride = dt == PartialDtype::fp32 ? s32_b : s16_b;
          run(dt == PartialDtype::fp32 ? "pack_a2a_fp32" : "pack_a2a_bf16",
              pack_bytes(dt == PartialDtype::fp32 ? 4 : 2), [&](int i) {
                cuda_kernels::combine_pack_a2a<lse_base_e>(o_view(i), lse_view(i), int(t), n, dt,
                                                           lay, base + i * stride, stream);
              });
        }

        // merges: read N chunks (o + lse), write (T, H_local, 512) bf16
        struct MergeCase {
          const char* name;
          DcpMode mode;
          PartialDtype dt;
        };
        for (const MergeCase& mc :
             {MergeCase{"merge_det_fp32", DcpMode::deterministic, PartialDtype::fp32},
              MergeCase{"merge_fast_fp32", DcpMode::fast, PartialDtype::fp32},
              MergeCase{"merge_fast_bf16", DcpMode::fast, PartialDtype::bf16}}) {
          const auto& lay = mc.dt == PartialDtype::fp32 ? l32 : l16;
          const std::byte* base = mc.dt == PartialDtype::fp32 ? s32 : s16;
          const std::size_t stride = mc.dt == PartialDtype::fp32 ? s32_b : s16_b;
          run(mc.name, merge_bytes(mc.dt == PartialDtype::fp32 ? 4 : 2), [&](int i) {
            cuda_kernels::combine_merge_a2a<bfloat16>(base + i * stride, n, mc.mode, mc.dt, lay,
                                                      out_view(i), no_lse, stream);
          });
        }

        // all-gather/reduce-scatter rescale: read o + N lse planes, write packed o (fp32)
        run("rescale_agrs", rescale_bytes, [&](int i) {
          cuda_kernels::combine_rescale_agrs(o_view(i), lse_all + std::size_t(i) * lse_all_b / 4, 0,
                                             n, packed + std::size_t(i) * packed_b / 4, no_lse,
                                             stream);
        });

        DCPATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
        for (void* p : {(void*)o, (void*)lse, (void*)s32, (void*)s16, (void*)out, (void*)lse_all,
                        (void*)packed})
          DCPATTN_CUDA_CHECK(cudaFree(p));
      }
    }
  }
  DCPATTN_CUDA_CHECK(cudaFree(flush));
  json.write(out_path);
  std::printf("wrote %s\n", out_path.c_str());
  DCPATTN_CUDA_CHECK(cudaStreamDestroy(stream));
  return 0;
}
