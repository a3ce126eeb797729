// SPDX-License-Identifier: Apache-2.0
// The CUDA indexer and top-k against the host path, under mpirun with N ranks sharing one GPU
// (device buffers travel through the host: MpiStagedCommunicator):
//   - GPU scores equal the host's bitwise on exact (small-integer) data, and are within the
//     fp32 summation bound of them otherwise; entries outside the rows' local keys are untouched;
//   - GPU candidate lists are the host's byte for byte (ties, NaN/inf/-0, short rows, padding);
//   - the GPU distributed top-k equals a full sort of every key, for k in {1, 7, 64, 2048} and
//     rows of 100K keys;
//   - the GPU indexer step gives the same lists for N ranks and for one rank, and the host's
//     top-k of the GPU's own scores.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <cuda_runtime.h>

#include "support/catch.hpp"
#include "support/mpi_env.hpp"

#include "dcpattn/comm/mpi.hpp"
#include "dcpattn/comm/mpi_staged.cuh"
#include "dcpattn/dcpattn.hpp"
#include "dcpattn/indexer/indexer.hpp"
#include "dcpattn/kernels/cuda/indexer.cuh"
#include "indexer/indexer_fixtures.hpp"

using namespace dcpattn;
using namespace dcpattn::test;

namespace {

/// A device array of n T, freed on destruction.
template <class T>
class DeviceArray {
 public:
  explicit DeviceArray(std::size_t n) : n_(n) {
    DCPATTN_CUDA_CHECK(cudaMalloc(&ptr_, std::max<std::size_t>(n, 1) * sizeof(T)));
  }
  explicit DeviceArray(const std::vector<T>& v) : DeviceArray(v.size()) { upload(v); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() { cudaFree(ptr_); }
  T* get() const { return ptr_; }
  std::size_t size() const { return n_; }
  void upload(const std::vector<T>& v) {
    DCPATTN_CUDA_CHECK(cudaMemcpy(ptr_, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> v(n_);
    DCPATTN_CUDA_CHECK(cudaDeviceSynchronize());
    DCPATTN_CUDA_CHECK(cudaMemcpy(v.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
  }

 private:
  T* ptr_ = nullptr;
  std::size_t n_ = 0;
};

/// The device copies of one rank's indexer inputs.
struct DeviceBatch {
  DeviceArray<bfloat16> q_bf16;
  DeviceArray<std::uint8_t> q_fp8;
  DeviceArray<float> q_scale, weights;
  DeviceArray<std::uint8_t> cache;
  DeviceArray<std::int32_t> block_table, row_request;
  DeviceArray<std::int64_t> row_bound;
  std::int64_t pages, page_bytes, max_pages, requests;

  DeviceBatch(const IndexerBatch& b, const PagedShard& shard, const std::vector<std::uint8_t>& c)
      : q_bf16(b.q_bf16),
        q_fp8(b.q_fp8),
        q_scale(b.q_scale),
        weights(b.weights),
        cache(c),
        block_table(shard.block_table),
        row_request(b.row_request),
        row_bound(b.row_bound),
        pages(shard.num_pages),
        page_bytes(shard.page_size * kIdxBytesPerToken),
        max_pages(shard.max_pages),
        requests(std::int64_t(b.request_length.size())) {}

  template <class QElem>
  IndexerArgs<QElem> args(const IndexerBatch& b) const {
    const std::int64_t t = b.rows(), h = b.heads;
    IndexerArgs<QElem> a;
    if constexpr (std::is_same_v<QElem, std::uint8_t>) {
      a.q = make_view(static_cast<const std::uint8_t*>(q_fp8.get()), {t, h, std::int64_t(kIdxDim)});
      a.q_scale = make_view(static_cast<const float*>(q_scale.get()), {t, h});
    } else {
      a.q = make_view(static_cast<const bfloat16*>(q_bf16.get()), {t, h, std::int64_t(kIdxDim)});
    }
    a.weights = make_view(static_cast<const float*>(weights.get()), {t, h});
    a.k_cache = make_view(static_cast<const std::uint8_t*>(cache.get()), {pages, page_bytes});
    a.block_table =
        make_view(static_cast<const std::int32_t*>(block_table.get()), {requests, max_pages});
    a.row_request = make_view(static_cast<const std::int32_t*>(row_request.get()), {t});
    a.row_bound = make_view(static_cast<const std::int64_t*>(row_bound.get()), {t});
    a.num_valid_rows = b.num_valid_rows;
    return a;
  }
};

/// The same arguments over host memory.
template <class QElem>
IndexerArgs<QElem> host_args(const IndexerBatch& b, const PagedShard& shard,
                             const std::vector<std::uint8_t>& cache) {
  const std::int64_t t = b.rows(), h = b.heads;
  IndexerArgs<QElem> a;
  if constexpr (std::is_same_v<QElem, std::uint8_t>) {
    a.q = make_view(b.q_fp8.data(), {t, h, std::int64_t(kIdxDim)});
    a.q_scale = make_view(b.q_scale.data(), {t, h});
  } else {
    a.q = make_view(b.q_bf16.data(), {t, h, std::int64_t(kIdxDim)});
  }
  a.weights = make_view(b.weights.data(), {t, h});
  a.k_cache = make_view(cache.data(), {shard.num_pages, shard.page_size * kIdxBytesPerToken});
  a.block_table =
      make_view(shard.block_table.data(), {std::int64_t(b.request_length.size()), shard.max_pages});
  a.row_request = make_view(b.row_request.data(), {t});
  a.row_bound = make_view(b.row_bound.data(), {t});
  a.num_valid_rows = b.num_valid_rows;
  return a;
}

bool same_bytes(const void* a, const void* b, std::size_t n) {
  return std::memcmp(a, b, n) == 0;
}

template <class QElem>
void check_gpu_scores(int heads, int interleave, bool integer_data) {
  MpiCommunicator world(MPI_COMM_WORLD);
  const int n = world.size(), rank = world.rank();
  const RoundRobinOwnership own(n, interleave);
  constexpr bool fp8 = std::is_same_v<QElem, std::uint8_t>;
  const IndexerBatch b = make_indexer_batch(41u + unsigned(heads), {0, 2, 7, 129, 300, 1100},
                                            {1, 1, 2, 1, 3, 1}, 2, heads, integer_data);
  const GlobalKeys keys =
      make_global_keys(43u, b.request_length, integer_data ? 0 : 5, integer_data);
  const PagedShard shard = make_paged_shard(b.request_length, own, rank, 16);
  const std::vector<std::uint8_t> cache =
      build_indexer_cache(keys, b.request_length, own, rank, shard);
  const std::int64_t t = b.rows();
  const std::int64_t columns = own.local_length(b.max_bound(), 0) + 5;

  std::vector<float> host_scores(std::size_t(t * columns), -7.0f);
  host::indexer_scores(own, rank, host_args<QElem>(b, shard, cache),
                       make_view(host_scores.data(), {t, columns}));
  DeviceBatch d(b, shard, cache);
  DeviceArray<float> gpu(std::vector<float>(std::size_t(t * columns), -7.0f));
  cuda_kernels::indexer_scores(own, rank, d.args<QElem>(b), make_view(gpu.get(), {t, columns}),
                               nullptr);
  const std::vector<float> got = gpu.download();

  bool ok = true;
  if (integer_data) {
    ok = same_bytes(got.data(), host_scores.data(), got.size() * sizeof(float));
  } else {
    std::vector<float> q, qs, w;
    for (std::int64_t row = 0; row < t && ok; ++row) {
      const std::int64_t len =
          row < b.num_valid_rows ? own.local_length(b.row_bound[std::size_t(row)], rank) : 0;
      if (row < b.num_valid_rows) row_inputs(b, row, fp8, q, qs, w);
      for (std::int64_t p = 0; p < columns; ++p) {
        const float g = got[std::size_t(row * columns + p)];
        const float h = host_scores[std::size_t(row * columns + p)];
        if (p >= len) {
          ok = ok && g == -7.0f;
          continue;
        }
        const std::int64_t pos = own.global_position(p, rank);
        const auto& req = keys.bytes[std::size_t(b.row_request[std::size_t(row)])];
        const std::vector<std::uint8_t> one(req.begin() + pos * kIdxBytesPerToken,
                                            req.begin() + (pos + 1) * kIdxBytesPerToken);
        const std::int32_t identity = 0;
        double ref = 0, mag = 0;
        double_score(q, qs, w, read_plain_key(one, 1, &identity, 0), ref, mag);
        // both are fp32 sums of the same products in different orders: within 2 x 200 roundings
        ok = ok && std::fabs(double(g) - double(h)) <= 2.4e-5 * mag + 1e-30;
      }
    }
  }
  INFO("N = " << n << ", heads " << heads << ", I = " << interleave << ", fp8 q = " << fp8
              << ", integer data = " << integer_data);
  CHECK(all_ranks(ok));
}

}  // namespace

TEST_CASE("GPU indexer scores equal the host's", "[indexer][gpu]") {
  check_gpu_scores<bfloat16>(64, 1, true);
  check_gpu_scores<std::uint8_t>(64, 2, true);
  check_gpu_scores<bfloat16>(32, 1, true);
  check_gpu_scores<bfloat16>(64, 1, false);
  check_gpu_scores<std::uint8_t>(64, 8, false);
}

namespace {
std::vector<std::int64_t> gpu_bounds(int k) {
  std::vector<std::int64_t> b = {0, 1, 2, 3, 7, 64, 700, 100000};
  for (std::int64_t x :
       {std::int64_t(k) - 1, std::int64_t(k), std::int64_t(k) + 1, 3 * std::int64_t(k) + 5})
    if (x >= 0) b.push_back(x);
  return b;
}
}  // namespace

TEST_CASE("GPU candidate lists are the host's byte for byte", "[indexer][gpu]") {
  const int n = world_size(), rank = world_rank();
  for (int k : {1, 7, 64, 2048})
    for (int interleave : {1, 3}) {
      const RoundRobinOwnership own(n, interleave);
      const GlobalScores g = make_global_scores(300u + unsigned(k), gpu_bounds(k), 2);
      std::int64_t columns = 0;
      const std::vector<float> local = local_scores(g, own, rank, columns);
      const std::int64_t t = g.rows();
      std::vector<TopkCandidate> host_out(std::size_t(t * k));
      host::local_topk(own, rank, make_view(local.data(), {t, columns}),
                       make_view(g.bound.data(), {t}), g.num_valid_rows,
                       make_view(host_out.data(), {t, std::int64_t(k)}));
      DeviceArray<float> d_scores(local);
      DeviceArray<std::int64_t> d_bound(g.bound);
      DeviceArray<TopkCandidate> d_out(std::size_t(t * k));
      cuda_kernels::local_topk(
          own, rank, make_view(static_cast<const float*>(d_scores.get()), {t, columns}),
          make_view(static_cast<const std::int64_t*>(d_bound.get()), {t}), g.num_valid_rows,
          make_view(d_out.get(), {t, std::int64_t(k)}), nullptr);
      const auto got = d_out.download();
      INFO("k = " << k << ", I = " << interleave << ", rank " << rank);
      CHECK(all_ranks(same_bytes(got.data(), host_out.data(), got.size() * sizeof(TopkCandidate))));
    }
}

TEST_CASE("GPU distributed top-k equals a full sort of every key", "[indexer][gpu]") {
  MpiStagedCommunicator world(MPI_COMM_WORLD, 0);
  for (int k : {1, 7, 64, 2048})
    for (int interleave : {1, 64}) {
      const RoundRobinOwnership own(world.size(), interleave);
      const GlobalScores g = make_global_scores(500u + unsigned(k), gpu_bounds(k), 3);
      std::int64_t columns = 0;
      const std::vector<float> local = local_scores(g, own, world.rank(), columns);
      const std::int64_t t = g.rows();
      world.reserve(std::size_t(world.size()) * topk_candidate_bytes(t, k));
      DeviceArray<float> d_scores(local);
      DeviceArray<std::int64_t> d_bound(g.bound);
      DeviceArray<std::int32_t> d_out(std::vector<std::int32_t>(std::size_t(t * k), 12345));
      DeviceArray<std::byte> ws(distributed_topk_workspace_bytes(t, k, world.size()));
      cuda_kernels::distributed_topk(
          world, own, make_view(static_cast<const float*>(d_scores.get()), {t, columns}),
          make_view(static_cast<const std::int64_t*>(d_bound.get()), {t}), g.num_valid_rows,
          make_view(d_out.get(), {t, std::int64_t(k)}),
          cuda::std::span<std::byte>(ws.get(), ws.size()), nullptr);
      INFO("N = " << world.size() << ", k = " << k << ", I = " << interleave);
      CHECK(all_ranks(d_out.download() == expected_topk(g, k)));
    }
}

namespace {

/// Runs cuda_kernels::indexer_topk on `comm` for a batch; returns the (T, k) lists and this rank's
/// scores (what the step's workspace held).
template <class QElem, class Comm>
std::vector<std::int32_t> gpu_step(Comm& comm, const IndexerBatch& b, const GlobalKeys& keys,
                                   int interleave, int k, std::vector<float>* scores_out,
                                   std::int64_t* columns_out) {
  const RoundRobinOwnership own(comm.size(), interleave);
  const PagedShard shard = make_paged_shard(b.request_length, own, comm.rank(), 16);
  const auto cache = build_indexer_cache(keys, b.request_length, own, comm.rank(), shard);
  DeviceBatch d(b, shard, cache);
  IndexerConfig cfg;
  cfg.num_heads = b.heads;
  cfg.topk = k;
  cfg.max_tokens = int(b.rows());
  cfg.max_context_len = b.max_bound();
  const std::int64_t t = b.rows();
  DeviceArray<std::byte> ws(indexer_topk_workspace_bytes(cfg, own));
  DeviceArray<std::int32_t> out(std::size_t(t * k));
  cuda_kernels::indexer_topk(comm, own, cfg, d.args<QElem>(b),
                             make_view(out.get(), {t, std::int64_t(k)}),
                             cuda::std::span<std::byte>(ws.get(), ws.size()), nullptr);
  if (scores_out) {
    const std::int64_t columns = indexer_max_local_keys(cfg, own);
    const auto bytes = ws.download();
    scores_out->resize(std::size_t(t * columns));
    std::memcpy(scores_out->data(), bytes.data(), scores_out->size() * sizeof(float));
    *columns_out = columns;
  }
  return out.download();
}

template <class QElem>
void check_gpu_step(int interleave, int k, bool integer_data) {
  const IndexerBatch b = make_indexer_batch(61u + unsigned(k), {0, 3, 90, 2100, 5000},
                                            {1, 2, 1, 1, 2}, 2, kIndexerNumHeads, integer_data);
  const std::size_t staging = std::size_t(world_size()) * topk_candidate_bytes(b.rows(), k);
  MpiStagedCommunicator world(MPI_COMM_WORLD, staging);
  MpiStagedCommunicator self(MPI_COMM_SELF, staging);
  MpiCommunicator host_world(MPI_COMM_WORLD);
  const GlobalKeys keys =
      make_global_keys(62u, b.request_length, integer_data ? 0 : 7, integer_data);
  std::vector<float> scores;
  std::int64_t columns = 0;
  const auto dcp = gpu_step<QElem>(world, b, keys, interleave, k, &scores, &columns);
  const auto single = gpu_step<QElem>(self, b, keys, interleave, k, nullptr, nullptr);
  // the host's top-k of the GPU's own scores
  const RoundRobinOwnership own(world.size(), interleave);
  const std::int64_t t = b.rows();
  std::vector<std::int32_t> host_of_gpu(std::size_t(t * k));
  std::vector<std::byte> ws(distributed_topk_workspace_bytes(t, k, world.size()));
  host::distributed_topk(host_world, own,
                         make_view(static_cast<const float*>(scores.data()), {t, columns}),
                         make_view(b.row_bound.data(), {t}), b.num_valid_rows,
                         make_view(host_of_gpu.data(), {t, std::int64_t(k)}), ws);
  INFO("N = " << world.size() << ", I = " << interleave << ", k = " << k
              << ", integer data = " << integer_data);
  CHECK(all_ranks(dcp == single));
  CHECK(all_ranks(dcp == host_of_gpu));
  if (integer_data) {
    // exact dot products: the GPU chooses exactly what the host path chooses
    const PagedShard shard = make_paged_shard(b.request_length, own, world.rank(), 16);
    const auto cache = build_indexer_cache(keys, b.request_length, own, world.rank(), shard);
    IndexerConfig cfg;
    cfg.num_heads = b.heads;
    cfg.topk = k;
    cfg.max_tokens = int(t);
    cfg.max_context_len = b.max_bound();
    std::vector<std::int32_t> host_lists(std::size_t(t * k));
    std::vector<std::byte> hws(indexer_topk_workspace_bytes(cfg, own));
    host::indexer_topk(host_world, own, cfg, host_args<QElem>(b, shard, cache),
                       make_view(host_lists.data(), {t, std::int64_t(k)}), hws);
    CHECK(all_ranks(dcp == host_lists));
  }
}

}  // namespace

TEST_CASE("GPU indexer step: N ranks choose what one rank and the host choose", "[indexer][gpu]") {
  check_gpu_step<bfloat16>(1, 2048, true);
  check_gpu_step<std::uint8_t>(2, 64, true);
  check_gpu_step<bfloat16>(1, 2048, false);
  check_gpu_step<std::uint8_t>(64, 7, false);
}
