// SPDX-License-Identifier: Apache-2.0
// The local steps of the combine, on one GPU: what runs besides the collective.
//   pack_a2a_{fp32,bf16}   (T, H, 512) fp32 partial + lse -> N all-to-all chunks
//   merge_det_fp32         N received fp32 chunks -> (T, H/N, 512) bf16, fixed tree (deterministic)
//   merge_fast_{fp32,bf16} N received chunks -> (T, H/N, 512) bf16, one N-way log-sum-exp
//   rescale_agrs           (T, H, 512) fp32 + (N, T, H) lse -> (N, T, H/N, 512) fp32 (vLLM-style)
// for T in {1, 16, 64, 256, 1024, 8192}, H in {16, 128}, N in {2, 4, 8}. Reports the median time,
// the bytes each step must move (every input read once, every output written once), the achieved
// GB/s and its share of the measured device-to-device copy bandwidth. Inputs rotate among enough
// copies to exceed the L2 cache where memory allows ("l2_resident" says when they could not).
//
// Usage: bench_combine [out.json]   (default: bench_combine.json)
#include <algorithm>
#include <cstdint>
#include <cstdio>
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

  bench::JsonRecords json;
  json.begin()
      .field("kernel", std::string("copy_ceiling"))
      .field("device", std::string(prop.name))
      .field("gbps", copy_gbs);

  std::printf("%-16s %6s %4s %2s %10s %12s %8s %7s %5s\n", "kernel", "T", "H", "N", "median_us",
              "bytes", "GB/s", "%copy", "sets");
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
        const std::size_t set_b = o_b + lse_b + s32_b + s16_b + out_b + lse_all_b + packed_b;
        const int sets = int(std::clamp<std::size_t>((3 * std::size_t(l2) + set_b - 1) / set_b, 1, 64));
        const bool l2_resident = std::size_t(sets) * set_b < 2 * std::size_t(l2);

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
          cuda_kernels::combine_pack_a2a<lse_base_e>(o_view(i), lse_view(i), int(t), n,
                                                     PartialDtype::fp32, l32, s32 + i * s32_b, stream);
          cuda_kernels::combine_pack_a2a<lse_base_e>(o_view(i), lse_view(i), int(t), n,
                                                     PartialDtype::bf16, l16, s16 + i * s16_b, stream);
        }
        DCPATTN_CUDA_CHECK(cudaStreamSynchronize(stream));

        auto record = [&](const char* kernel, double us, double bytes) {
          const double gbs = bytes / (us * 1e3);
          std::printf("%-16s %6lld %4lld %2d %10.2f %12.0f %8.0f %6.1f%% %5d%s\n", kernel,
                      (long long)s.t, (long long)s.h, s.n, us, bytes, gbs, 100.0 * gbs / copy_gbs,
                      sets, l2_resident ? " (L2)" : "");
          json.begin()
              .field("kernel", std::string(kernel))
              .field("T", double(s.t))
              .field("H", double(s.h))
              .field("N", double(s.n))
              .field("H_local", double(hl))
              .field("median_us", us)
              .field("bytes", bytes)
              .field("gbps", gbs)
              .field("pct_copy_bw", 100.0 * gbs / copy_gbs)
              .field("sets", double(sets))
              .field("l2_resident", l2_resident ? 1.0 : 0.0);
        };
        int it = 0;
        auto next = [&] { return (it++) % sets; };

        // pack: read o + lse, write N chunks (o in the partial dtype + lse); it rewrites the
        // chunks the merges read below with the same bytes
        const double rows_all = double(t * h);
        for (PartialDtype dt : {PartialDtype::fp32, PartialDtype::bf16}) {
          const auto& lay = dt == PartialDtype::fp32 ? l32 : l16;
          std::byte* base = dt == PartialDtype::fp32 ? s32 : s16;
          const std::size_t stride = dt == PartialDtype::fp32 ? s32_b : s16_b;
          const double us = bench::median_us(
              [&] {
                const int i = next();
                cuda_kernels::combine_pack_a2a<lse_base_e>(o_view(i), lse_view(i), int(t), n, dt,
                                                           lay, base + i * stride, stream);
              },
              stream);
          const double esize = dt == PartialDtype::fp32 ? 4 : 2;
          record(dt == PartialDtype::fp32 ? "pack_a2a_fp32" : "pack_a2a_bf16", us,
                 rows_all * (kDv * 4 + 4) + rows_all * (kDv * esize + 4));
        }

        // merges: read N chunks (o + lse), write (T, H_local, 512) bf16
        const double rows_local = double(t * hl);
        struct MergeCase {
          const char* name;
          DcpMode mode;
          PartialDtype dt;
        };
        for (const MergeCase& mc : {MergeCase{"merge_det_fp32", DcpMode::deterministic, PartialDtype::fp32},
                                    MergeCase{"merge_fast_fp32", DcpMode::fast, PartialDtype::fp32},
                                    MergeCase{"merge_fast_bf16", DcpMode::fast, PartialDtype::bf16}}) {
          const auto& lay = mc.dt == PartialDtype::fp32 ? l32 : l16;
          const std::byte* base = mc.dt == PartialDtype::fp32 ? s32 : s16;
          const std::size_t stride = mc.dt == PartialDtype::fp32 ? s32_b : s16_b;
          const double us = bench::median_us(
              [&] {
                const int i = next();
                cuda_kernels::combine_merge_a2a<bfloat16>(base + i * stride, n, mc.mode, mc.dt, lay,
                                                          out_view(i), no_lse, stream);
              },
              stream);
          const double esize = mc.dt == PartialDtype::fp32 ? 4 : 2;
          record(mc.name, us, double(n) * rows_local * (kDv * esize + 4) + rows_local * kDv * 2);
        }

        // all-gather/reduce-scatter rescale: read o + N lse planes, write packed o (fp32)
        {
          const double us = bench::median_us(
              [&] {
                const int i = next();
                cuda_kernels::combine_rescale_agrs(o_view(i), lse_all + std::size_t(i) * lse_all_b / 4,
                                                   0, n, packed + std::size_t(i) * packed_b / 4,
                                                   no_lse, stream);
              },
              stream);
          record("rescale_agrs", us, rows_all * kDv * 4 + double(n) * rows_all * 4 + rows_all * kDv * 4);
        }

        DCPATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
        for (void* p : {(void*)o, (void*)lse, (void*)s32, (void*)s16, (void*)out, (void*)lse_all,
                        (void*)packed})
          DCPATTN_CUDA_CHECK(cudaFree(p));
      }
    }
  }
  json.write(out_path);
  std::printf("wrote %s\n", out_path.c_str());
  DCPATTN_CUDA_CHECK(cudaStreamDestroy(stream));
  return 0;
}
