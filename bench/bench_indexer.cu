// SPDX-License-Identifier: Apache-2.0
// Lightning indexer + top-k time per decode step on one GPU: B query rows, each the last token of
// its own request of L cached tokens (fp8 keys in the paged indexer cache, page size 64), 64 heads
// x 128 dims, bf16 queries, k = 2048. For L in {8K, 32K, 128K} and B in {1, 32, 128} it reports
// the median time of the whole step (cuda_kernels::indexer_topk with CudaSelfCommunicator) and
// of its two parts (scores; local + merged top-k), and the key bytes read per microsecond. The
// PyTorch eager peer (bench/peers/indexer_peer.py) measures the same shapes:
//   bench_indexer indexer.json && python3 bench/peers/indexer_peer.py indexer_peer.json
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "bench_common.cuh"
#include "dcpattn/comm/cuda_self.cuh"
#include "dcpattn/kernels/cuda/indexer.cuh"
#include "dcpattn/ownership/round_robin.hpp"

namespace {

using namespace dcpattn;

__device__ std::uint32_t hash(std::uint64_t i, std::uint32_t seed) {
  std::uint64_t x = i * 0x9e3779b97f4a7c15ull + seed;
  x ^= x >> 31;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 29;
  return std::uint32_t(x);
}

/// Random e4m3 keys (no NaN bytes) and per-token scales in every page of the indexer cache.
__global__ void fill_cache(std::uint8_t* cache, std::int64_t pages, int page_size) {
  const std::int64_t page_bytes = std::int64_t(page_size) * IndexerKCacheLayout::bytes_per_token;
  const std::int64_t total = pages * page_bytes;
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < total;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t in_page = i % page_bytes;
    if (in_page < std::int64_t(page_size) * IndexerKCacheLayout::head_dim) {
      std::uint8_t b =
          std::uint8_t(hash(std::uint64_t(i), 1u) & 0xb7u);  // exponent <= 7: |v| < 2, never NaN
      cache[i] = b;
    } else if ((in_page - std::int64_t(page_size) * IndexerKCacheLayout::head_dim) % 4 == 0) {
      *reinterpret_cast<float*>(cache + i) = 1.0f / 64.0f;
    }
  }
}

__global__ void fill_bf16(bfloat16* p, std::int64_t n, std::uint32_t seed) {
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x)
    p[i] = bfloat16::from_float(float(hash(std::uint64_t(i), seed) % 2001u) / 1000.0f - 1.0f);
}

__global__ void fill_float(float* p, std::int64_t n, std::uint32_t seed) {
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x)
    p[i] = float(hash(std::uint64_t(i), seed) % 1000u) / 1000.0f;
}

template <class T>
T* device_alloc(std::size_t n) {
  T* p = nullptr;
  DCPATTN_CUDA_CHECK(cudaMalloc(&p, n * sizeof(T)));
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  constexpr int kHeads = 64, kDim = 128, kTopk = 2048, kPageSize = 64;
  const std::vector<std::int64_t> lengths = {8192, 32768, 131072};
  const std::vector<int> batches = {1, 32, 128};
  const std::int64_t max_len = 131072, max_batch = 128;

  cudaStream_t stream;
  DCPATTN_CUDA_CHECK(cudaStreamCreate(&stream));
  const std::int64_t max_pages = max_batch * (max_len / kPageSize);
  const std::int64_t page_bytes = std::int64_t(kPageSize) * IndexerKCacheLayout::bytes_per_token;
  auto* cache = device_alloc<std::uint8_t>(std::size_t(max_pages * page_bytes));
  auto* q = device_alloc<bfloat16>(std::size_t(max_batch * kHeads * kDim));
  auto* w = device_alloc<float>(std::size_t(max_batch * kHeads));
  auto* out = device_alloc<std::int32_t>(std::size_t(max_batch * kTopk));
  fill_cache<<<4096, 256, 0, stream>>>(cache, max_pages, kPageSize);
  fill_bf16<<<256, 256, 0, stream>>>(q, max_batch * kHeads * kDim, 7u);
  fill_float<<<64, 256, 0, stream>>>(w, max_batch * kHeads, 9u);
  DCPATTN_CUDA_CHECK(cudaGetLastError());

  CudaSelfCommunicator comm;
  const RoundRobinOwnership own(1, 1);
  bench::JsonRecords records;
  std::printf("%8s %8s %12s %12s %12s %14s\n", "batch", "context", "step_us", "scores_us",
              "topk_us", "key_GB/s");
  for (const std::int64_t len : lengths)
    for (const int batch : batches) {
      const std::int64_t pages_per_request = len / kPageSize;
      std::vector<std::int32_t> table(static_cast<std::size_t>(batch * pages_per_request));
      for (std::size_t i = 0; i < table.size(); ++i) table[i] = std::int32_t(i);
      std::vector<std::int32_t> row_request(static_cast<std::size_t>(batch));
      for (int b = 0; b < batch; ++b) row_request[std::size_t(b)] = b;
      std::vector<std::int64_t> row_bound(std::size_t(batch), len);
      auto* d_table = device_alloc<std::int32_t>(table.size());
      auto* d_req = device_alloc<std::int32_t>(row_request.size());
      auto* d_bound = device_alloc<std::int64_t>(row_bound.size());
      DCPATTN_CUDA_CHECK(
          cudaMemcpy(d_table, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
      DCPATTN_CUDA_CHECK(
          cudaMemcpy(d_req, row_request.data(), row_request.size() * 4, cudaMemcpyHostToDevice));
      DCPATTN_CUDA_CHECK(
          cudaMemcpy(d_bound, row_bound.data(), row_bound.size() * 8, cudaMemcpyHostToDevice));

      IndexerConfig cfg;
      cfg.num_heads = kHeads;
      cfg.topk = kTopk;
      cfg.max_tokens = batch;
      cfg.max_context_len = len;
      const std::size_t ws_bytes = indexer_topk_workspace_bytes(cfg, own);
      auto* ws = device_alloc<std::byte>(ws_bytes);

      IndexerArgs<bfloat16> a;
      const std::int64_t t = batch;
      a.q =
          make_view(static_cast<const bfloat16*>(q), {t, std::int64_t(kHeads), std::int64_t(kDim)});
      a.weights = make_view(static_cast<const float*>(w), {t, std::int64_t(kHeads)});
      a.k_cache = make_view(static_cast<const std::uint8_t*>(cache), {max_pages, page_bytes});
      a.block_table = make_view(static_cast<const std::int32_t*>(d_table), {t, pages_per_request});
      a.row_request = make_view(static_cast<const std::int32_t*>(d_req), {t});
      a.row_bound = make_view(static_cast<const std::int64_t*>(d_bound), {t});
      a.num_valid_rows = batch;
      auto topk = make_view(out, {t, std::int64_t(kTopk)});
      const cuda::std::span<std::byte> span(ws, ws_bytes);
      auto scores = make_view(reinterpret_cast<float*>(ws), {t, len});
      const cuda::std::span<std::byte> topk_ws =
          span.subspan(dcpattn::detail::align_workspace(std::size_t(t * len) * sizeof(float)));

      const double step_us = bench::median_us(
          [&] { cuda_kernels::indexer_topk(comm, own, cfg, a, topk, span, stream); }, stream);
      const double scores_us = bench::median_us(
          [&] { cuda_kernels::indexer_scores(own, 0, a, scores, stream); }, stream);
      const double topk_us = bench::median_us(
          [&] {
            cuda_kernels::distributed_topk(
                comm, own, make_view(static_cast<const float*>(scores.data_handle()), {t, len}),
                a.row_bound, batch, topk, topk_ws, stream);
          },
          stream);
      const double key_bytes = double(batch) * double(len) * IndexerKCacheLayout::bytes_per_token;
      const double flops = 2.0 * batch * double(len) * kHeads * kDim;
      std::printf("%8d %8lld %12.1f %12.1f %12.1f %14.1f\n", batch, (long long)len, step_us,
                  scores_us, topk_us, key_bytes / (scores_us * 1e3));
      records.begin()
          .field("bench", "indexer_topk")
          .field("impl", "dcpattn")
          .field("batch", batch)
          .field("context", double(len))
          .field("heads", kHeads)
          .field("topk", kTopk)
          .field("us", step_us)
          .field("us_scores", scores_us)
          .field("us_topk", topk_us)
          .field("key_gbs", key_bytes / (scores_us * 1e3))
          .field("tflops_scores", flops / (scores_us * 1e6));
      cudaFree(ws);
      cudaFree(d_table);
      cudaFree(d_req);
      cudaFree(d_bound);
    }
  records.write(bench::json_path(argc, argv, "bench_indexer.json"));
  cudaFree(cache);
  cudaFree(q);
  cudaFree(w);
  cudaFree(out);
  cudaStreamDestroy(stream);
  return 0;
}
