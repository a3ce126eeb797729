// SPDX-License-Identifier: Apache-2.0
// DcpAttention on the CUDA execution space under mpirun, the ranks sharing the GPU(s) through the
// host-staged MPI communicator: deterministic mode is bitwise identical for N = 1, 2, 4 (dense and
// sparse, bf16 and fp8 caches), and close to the host operator; fast mode is close to both.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <iomanip>
#include <limits>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <cuda_runtime.h>

#include "support/catch.hpp"
#include "support/mpi_env.hpp"

#include "dcpattn/comm/cuda_self.cuh"
#include "dcpattn/comm/mpi.hpp"
#include "dcpattn/comm/mpi_staged.cuh"
#if DCPATTN_TEST_NCCL
#include "dcpattn/comm/nccl.cuh"
#endif
#include "dcpattn/dcpattn.hpp"
#include "dcpattn/exec/cuda.cuh"
#include "op/scenario.hpp"

using namespace dcpattn;
using dcpattn::test::Scenario;

namespace {

constexpr float kScale = 0.0721687836f;  // 1 / sqrt(192)

#define CUDA_OK(call) REQUIRE((call) == cudaSuccess)

/// A non-blocking stream, destroyed on scope exit (also when a forward throws).
struct Stream {
  cudaStream_t s = nullptr;
  Stream() { CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~Stream() { cudaStreamDestroy(s); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
};

template <class T>
struct DeviceArray {
  T* ptr = nullptr;
  std::size_t n = 0;
  explicit DeviceArray(std::size_t count) : n(count) {
    CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&ptr), (count ? count : 1) * sizeof(T)));
  }
  explicit DeviceArray(const std::vector<T>& h) : DeviceArray(h.size()) {
    CUDA_OK(cudaMemcpy(ptr, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  ~DeviceArray() { cudaFree(ptr); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  std::vector<T> download() const {
    std::vector<T> h(n);
    CUDA_OK(cudaMemcpy(h.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

/// Output of one forward over all heads: out (T, H, 512), lse (T, H).
struct Result {
  std::vector<bfloat16> out;
  std::vector<float> lse;
  int num_splits = 0;  // ForwardInfo::num_splits
};

DcpConfig make_config(const Scenario& s, int group_size, DcpMode mode) {
  DcpConfig c;
  c.group_size = group_size;
  c.num_heads = s.num_heads;
  c.page_size = s.page_size;
  c.interleave = s.interleave;
  c.virtual_shards = 8;
  c.max_tokens = int(s.rows());
  c.gather_capacity = int(s.rows());
  c.topk = s.topk;
  c.softmax_scale = kScale;
  c.mode = mode;
  return c;
}

Scenario scenario_for(int interleave, std::uint32_t seed) {
  // lengths below N*I (some ranks hold nothing), 0, 1 and longer; spec-decode rows; 2 padding rows
  const int page = interleave == 1 ? 16 : 64;
  return dcpattn::test::make_scenario(seed, {0, 1, 5, 70, 300}, {1, 1, 2, 3, 1}, 2,
                                      /*heads=*/8, interleave, page, /*topk=*/24);
}

/// Rank-major (N, T, H_local, ...) slices -> (T, H, ...).
Result assemble(const std::vector<bfloat16>& out_all, const std::vector<float>& lse_all, int n,
                std::int64_t t, std::int64_t h) {
  const std::int64_t hl = h / n;
  Result r;
  r.out.resize(std::size_t(t * h * kMlaVDim));
  r.lse.resize(std::size_t(t * h));
  for (int src = 0; src < n; ++src)
    for (std::int64_t row = 0; row < t; ++row)
      for (std::int64_t hh = 0; hh < hl; ++hh) {
        const std::int64_t head = src * hl + hh;
        r.lse[std::size_t(row * h + head)] = lse_all[std::size_t((src * t + row) * hl + hh)];
        std::memcpy(&r.out[std::size_t((row * h + head) * kMlaVDim)],
                    &out_all[std::size_t(((src * t + row) * hl + hh) * kMlaVDim)],
                    kMlaVDim * sizeof(bfloat16));
      }
  return r;
}

/// One forward of DcpAttention<RoundRobin, Gather, Kernel, Combiner, MpiStaged, Cuda> on this
/// rank's device copy of the scenario; returns all heads on every rank.
/// All ranks' copies of a host vector, rank-major (the communicator's host side when it has one,
/// else MPI_COMM_WORLD for a multi-rank group).
template <class Comm, class T>
std::vector<T> gather_all(Comm& comm, const std::vector<T>& local) {
  std::vector<T> all(std::size_t(comm.size()) * local.size());
  if constexpr (requires { comm.host(); }) {
    comm.host().all_gather(local.data(), all.data(), local.size());
  } else if (comm.size() == 1) {
    all = local;
  } else {
    CHECK(MPI_Allgather(local.data(), int(local.size() * sizeof(T)), MPI_BYTE, all.data(),
                        int(local.size() * sizeof(T)), MPI_BYTE, MPI_COMM_WORLD) == MPI_SUCCESS);
  }
  return all;
}

/// input_error: the scenario's top-k lists carry out-of-range entries; check_input_errors must
/// then throw on every rank (naming topk_indices and the rank), else it must not throw.
/// graph: the forward is captured in a CUDA graph and replayed instead of run eagerly.
template <CacheFormat F, bool Sparse, class Gather, class Combiner, class Comm>
Result run_cuda(Comm& comm, const Scenario& s, const DcpConfig& cfg, bool input_error = false,
                bool graph = false) {
  using Kernel = std::conditional_t<Sparse, SparseMla<F>, DenseMla<F>>;
  using Op = DcpAttention<RoundRobinOwnership, Gather, Kernel, Combiner, Comm, CudaExecution>;
  const int n = comm.size(), rank = comm.rank();
  const std::int64_t t = s.rows(), h = s.num_heads, hl = h / n;
  Op op(comm, cfg);
  const auto cache = dcpattn::test::build_local_cache<F>(s, op.ownership(), rank);

  DeviceArray<bfloat16> q(s.q);
  DeviceArray<mla_cache_element_t<F>> d_cache(cache.data);
  DeviceArray<std::int32_t> table(cache.block_table), row_request(s.row_request), topk(s.topk_idx);
  DeviceArray<std::int64_t> row_bound(s.row_bound);
  DeviceArray<bfloat16> out(std::size_t(t * hl * kMlaVDim));
  DeviceArray<float> out_lse(std::size_t(t * hl));
  DeviceArray<std::byte> ws(Op::workspace_bytes(cfg));
  CUDA_OK(cudaMemset(out.ptr, 0xff, out.n * sizeof(bfloat16)));  // NaN: unwritten shows
  CUDA_OK(cudaMemset(out_lse.ptr, 0xff, out_lse.n * sizeof(float)));

  typename Op::Arguments a;
  if constexpr (std::is_same_v<Gather, Replicated>) {
    a.q = make_view(static_cast<const bfloat16*>(q.ptr), {t, h, std::int64_t(kMlaQkDim)});
  } else {
    // this rank's heads as a strided view into the full q (for N > 1 the gather packs it)
    a.q = make_view(static_cast<const bfloat16*>(q.ptr) + rank * hl * kMlaQkDim,
                    {t, hl, std::int64_t(kMlaQkDim)}, {h * kMlaQkDim, std::int64_t(kMlaQkDim), 1});
  }
  a.cache = make_view(static_cast<const mla_cache_element_t<F>*>(d_cache.ptr),
                      {cache.num_slots, std::int64_t(mla_cache_row_width(F))});
  a.block_table = make_view(static_cast<const std::int32_t*>(table.ptr),
                            {std::int64_t(s.request_length.size()), cache.max_pages});
  a.row_request = make_view(static_cast<const std::int32_t*>(row_request.ptr), {t});
  a.row_bound = make_view(static_cast<const std::int64_t*>(row_bound.ptr), {t});
  a.topk = make_view(static_cast<const std::int32_t*>(topk.ptr), {t, std::int64_t(s.topk)});
  a.num_valid_rows = s.num_valid_rows;
  a.out = make_view(out.ptr, {t, hl, std::int64_t(kMlaVDim)});
  a.out_lse = make_view(out_lse.ptr, {t, hl});

  // The uploads (pageable cudaMemcpy, which may return before its copy has landed) and the
  // memsets above ran on the legacy stream, which the non-blocking stream does not wait for.
  CUDA_OK(cudaDeviceSynchronize());
  const Stream stream;
  int num_splits = 0;
  if (graph) {
    cudaGraph_t g = nullptr;
    cudaGraphExec_t exec = nullptr;
    CUDA_OK(cudaStreamBeginCapture(stream.s, cudaStreamCaptureModeThreadLocal));
    num_splits = op.forward(a, cuda::std::span<std::byte>(ws.ptr, ws.n), stream.s).num_splits;
    CUDA_OK(cudaStreamEndCapture(stream.s, &g));
    CUDA_OK(cudaGraphInstantiate(&exec, g, 0));
    CUDA_OK(cudaGraphLaunch(exec, stream.s));
    CUDA_OK(cudaStreamSynchronize(stream.s));
    CUDA_OK(cudaGraphExecDestroy(exec));
    CUDA_OK(cudaGraphDestroy(g));
  } else {
    num_splits = op.forward(a, cuda::std::span<std::byte>(ws.ptr, ws.n), stream.s).num_splits;
  }
  CUDA_OK(cudaStreamSynchronize(stream.s));
  CUDA_OK(cudaGetLastError());
  std::string error;
  try {
    op.check_input_errors(cuda::std::span<const std::byte>(ws.ptr, ws.n), stream.s);
  } catch (const dcpattn::Error& e) {
    error = e.what();
  }
  if (input_error) {
    CHECK(error.find("topk_indices") != std::string::npos);
    CHECK(error.find("[rank " + std::to_string(rank) + "]") != std::string::npos);
  } else {
    CHECK(error.empty());
  }

  const auto out_local = out.download();
  const auto lse_local = out_lse.download();
  const std::vector<bfloat16> out_all = gather_all(comm, out_local);
  const std::vector<float> lse_all = gather_all(comm, lse_local);
  Result r = assemble(out_all, lse_all, n, t, h);
  r.num_splits = num_splits;
  return r;
}

/// The host operator at N = 1 on the same scenario (the reference of the CUDA path).
template <CacheFormat F, bool Sparse>
Result run_host(const Scenario& s) {
  using Kernel = std::conditional_t<Sparse, SparseMla<F>, DenseMla<F>>;
  using Op = DcpAttention<RoundRobinOwnership, DirectWorkspace, Kernel, AllToAll, SelfCommunicator,
                          HostExecution>;
  SelfCommunicator self;
  const DcpConfig cfg = make_config(s, 1, DcpMode::deterministic);
  const std::int64_t t = s.rows(), h = s.num_heads;
  Op op(self, cfg);
  const auto cache = dcpattn::test::build_local_cache<F>(s, op.ownership(), 0);
  Result r;
  r.out.resize(std::size_t(t * h * kMlaVDim));
  r.lse.resize(std::size_t(t * h));
  typename Op::Arguments a;
  a.q = make_view(static_cast<const bfloat16*>(s.q.data()), {t, h, std::int64_t(kMlaQkDim)});
  a.cache = cache.view();
  a.block_table = cache.table();
  a.row_request = make_view(s.row_request.data(), {t});
  a.row_bound = make_view(s.row_bound.data(), {t});
  a.topk = make_view(s.topk_idx.data(), {t, std::int64_t(s.topk)});
  a.num_valid_rows = s.num_valid_rows;
  a.out = make_view(r.out.data(), {t, h, std::int64_t(kMlaVDim)});
  a.out_lse = make_view(r.lse.data(), {t, h});
  std::vector<std::byte> ws(Op::workspace_bytes(cfg));
  op.forward(a, ws);
  return r;
}

bool bitwise_equal(const Result& a, const Result& b) {
  return a.out.size() == b.out.size() && a.lse.size() == b.lse.size() &&
         std::memcmp(a.out.data(), b.out.data(), a.out.size() * sizeof(bfloat16)) == 0 &&
         std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float)) == 0;
}

/// Where two results differ bitwise (for the failure message): how many outputs and lse values
/// differ, and the first of each.
std::string first_differences(const Result& a, const Result& b) {
  std::ostringstream os;
  if (a.out.size() != b.out.size() || a.lse.size() != b.lse.size()) return "different shapes";
  std::size_t n_out = 0, n_lse = 0;
  for (std::size_t i = 0; i < a.out.size(); ++i) {
    if (a.out[i].bits == b.out[i].bits) continue;
    if (n_out++ == 0)
      os << "out[row " << i / kMlaVDim << ", dim " << i % kMlaVDim << "]: " << a.out[i].to_float()
         << " vs " << b.out[i].to_float() << "; ";
  }
  for (std::size_t i = 0; i < a.lse.size(); ++i) {
    if (std::memcmp(&a.lse[i], &b.lse[i], sizeof(float)) == 0) continue;
    if (n_lse++ == 0)
      os << std::setprecision(9) << "lse[row " << i << "]: " << a.lse[i] << " vs " << b.lse[i]
         << "; ";
  }
  os << n_out << " of " << a.out.size() << " outputs and " << n_lse << " of " << a.lse.size()
     << " lse values differ";
  return os.str();
}

/// Largest error of the CUDA result against the host operator, in units of the tolerance:
///   o:   |d| <= 8e-3 + 1.6e-2 |ref|  (twice the host suite's tolerance against float64: the CUDA
///        kernel rounds the softmax weights to bf16 for the tensor cores, ~1e-3 relative, and
///        both sides round the output to bf16);
///   lse: |d| <= 2e-4 (1 + |ref|) with the bf16 cache (fp32 scores from exact bf16 products), and
///        |d| <= 2e-2 with the fp8 cache (the CUDA kernel rounds the dequantized key to bf16:
///        2^-9 relative per element, ~3e-3 on a score of 576 terms, worst case a few times that).
/// Rows empty on the host (lse -inf: padding, no key) must be exactly (0, -inf). Scaled by
/// `factor` for fast-mode paths (bf16 partials add one more rounding).
double error_vs_host(const Result& got, const Result& host, CacheFormat f, double factor = 1.0) {
  double worst = 0;
  const double inf = std::numeric_limits<double>::infinity();
  for (std::size_t row = 0; row < host.lse.size(); ++row) {
    const float hl = host.lse[row], gl = got.lse[row];
    if (std::isinf(hl)) {
      if (!(std::isinf(gl) && gl < 0)) return inf;
      for (int i = 0; i < kMlaVDim; ++i)
        if (got.out[row * kMlaVDim + i].bits != 0) return inf;
      continue;
    }
    if (std::isnan(gl)) return inf;
    const double lse_tol = f == CacheFormat::bf16 ? 2e-4 * (1 + std::fabs(hl)) : 2e-2;
    worst = std::max(worst, std::fabs(double(gl) - hl) / (factor * lse_tol));
    for (int i = 0; i < kMlaVDim; ++i) {
      const double g = got.out[row * kMlaVDim + i].to_float();
      const double r = host.out[row * kMlaVDim + i].to_float();
      if (std::isnan(g)) return inf;
      worst = std::max(worst, std::fabs(g - r) / (factor * (8e-3 + 1.6e-2 * std::fabs(r))));
    }
  }
  return worst;
}

template <CacheFormat F, bool Sparse>
void check_invariance(int interleave) {
  const Scenario s = scenario_for(interleave, 4321u + unsigned(interleave));
  const DcpConfig world_cfg = make_config(s, dcpattn::test::world_size(), DcpMode::deterministic);
  const DcpConfig self_cfg = make_config(s, 1, DcpMode::deterministic);
  // (self first: the last communicator built sets the rank that errors report)
  MpiStagedCommunicator self(MPI_COMM_SELF, MpiStagedCommunicator::staging_bytes_for(self_cfg));
  MpiStagedCommunicator world(MPI_COMM_WORLD, MpiStagedCommunicator::staging_bytes_for(world_cfg));
  const Result dcp = run_cuda<F, Sparse, DirectWorkspace, AllToAll>(world, s, world_cfg);
  const Result single = run_cuda<F, Sparse, DirectWorkspace, AllToAll>(self, s, self_cfg);
  const Result host = run_host<F, Sparse>(s);
  INFO("N = " << world.size() << ", I = " << interleave);
  INFO(first_differences(dcp, single));
  CHECK(bitwise_equal(dcp, single));
  CHECK(dcp.num_splits == world_cfg.virtual_shards / world.size());  // V / N, the contract
  CHECK(single.num_splits == self_cfg.virtual_shards);
  const double err = error_vs_host(dcp, host, F);
  CAPTURE(err);
  CHECK(err <= 1.0);
}

}  // namespace

#if !DCPATTN_TEST_NCCL
TEST_CASE("CUDA deterministic dense bf16: N ranks are bitwise N = 1, close to the host",
          "[cuda][op][deterministic]") {
  check_invariance<CacheFormat::bf16, false>(1);
  check_invariance<CacheFormat::bf16, false>(64);
}

TEST_CASE("CUDA deterministic dense fp8: N ranks are bitwise N = 1, close to the host",
          "[cuda][op][deterministic]") {
  check_invariance<CacheFormat::fp8_ds_mla, false>(1);
  check_invariance<CacheFormat::fp8_ds_mla, false>(64);
}

TEST_CASE("CUDA deterministic sparse bf16: N ranks are bitwise N = 1, close to the host",
          "[cuda][op][deterministic]") {
  check_invariance<CacheFormat::bf16, true>(1);
  check_invariance<CacheFormat::bf16, true>(64);
}

TEST_CASE("CUDA deterministic sparse fp8: N ranks are bitwise N = 1, close to the host",
          "[cuda][op][deterministic]") {
  check_invariance<CacheFormat::fp8_ds_mla, true>(1);
  check_invariance<CacheFormat::fp8_ds_mla, true>(64);
}

TEST_CASE("CUDA sparse: out-of-range top-k entries are skipped and reported by check_input_errors",
          "[cuda][op][errors]") {
  Scenario s = scenario_for(1, 97u);
  // The last entry of the first two valid rows becomes out of range (>= the bound, then < -1);
  // the reference is the same scenario with -1 there (the host path throws on such entries).
  REQUIRE(s.num_valid_rows >= 2);
  Scenario clean = s;
  int planted = 0;
  for (std::int64_t t = 0; t < 2; ++t) {
    const std::size_t k = std::size_t(t * s.topk + s.topk - 1);
    s.topk_idx[k] = t == 0 ? std::int32_t(s.row_bound[std::size_t(t)] + 3) : -7;
    clean.topk_idx[k] = -1;
    ++planted;
  }
  REQUIRE(planted == 2);
  const DcpConfig world_cfg = make_config(s, dcpattn::test::world_size(), DcpMode::deterministic);
  MpiStagedCommunicator world(MPI_COMM_WORLD, MpiStagedCommunicator::staging_bytes_for(world_cfg));
  const Result bad =
      run_cuda<CacheFormat::bf16, true, DirectWorkspace, AllToAll>(world, s, world_cfg, true);
  const Result good =
      run_cuda<CacheFormat::bf16, true, DirectWorkspace, AllToAll>(world, clean, world_cfg);
  CHECK(bitwise_equal(bad, good));  // the bad entries were left out, nothing else changed
}

TEST_CASE("CUDA fast mode (bf16 partials, all-gather + reduce-scatter) is close to the host",
          "[cuda][op][fast]") {
  const Scenario s = scenario_for(1, 77u);
  const Result host = run_host<CacheFormat::bf16, false>(s);
  DcpConfig fast = make_config(s, dcpattn::test::world_size(), DcpMode::fast);
  fast.partial_dtype = PartialDtype::bf16;
  MpiStagedCommunicator world(MPI_COMM_WORLD, MpiStagedCommunicator::staging_bytes_for(fast));
  SECTION("all-to-all with bf16 partials") {
    const Result r = run_cuda<CacheFormat::bf16, false, AllGather, AllToAll>(world, s, fast);
    const double err = error_vs_host(r, host, CacheFormat::bf16, 2.0);
    CAPTURE(err);
    CHECK(err <= 1.0);
    // Fast mode on the GPU: the one-wave split count of this batch (the workspace, sized on this
    // device, holds its states without halving).
    int device = 0, sms = 0;
    CUDA_OK(cudaGetDevice(&device));
    CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    CHECK(r.num_splits ==
          dcpattn::cuda_kernels::mla_decode_fast_splits(s.rows(), s.num_heads, 1LL << 40, sms));
  }
  SECTION("all-to-all with bf16 partials at 128 heads (bf16 split states on 9.x)") {
    const Scenario wide = dcpattn::test::make_scenario(78u, {0, 1, 5, 70, 300}, {1, 1, 2, 3, 1}, 2,
                                                       /*heads=*/128, 1, 16, /*topk=*/24);
    const Result wide_host = run_host<CacheFormat::bf16, false>(wide);
    DcpConfig wide_fast = make_config(wide, dcpattn::test::world_size(), DcpMode::fast);
    wide_fast.partial_dtype = PartialDtype::bf16;
    world.reserve(MpiStagedCommunicator::staging_bytes_for(wide_fast));
    const Result r =
        run_cuda<CacheFormat::bf16, false, AllGather, AllToAll>(world, wide, wide_fast);
    CHECK(r.num_splits > 1);  // the states exist (and are bf16 on 9.x)
    const double err = error_vs_host(r, wide_host, CacheFormat::bf16, 2.0);
    CAPTURE(err);
    CHECK(err <= 1.0);
  }
  SECTION("all-gather + reduce-scatter, replicated query") {
    fast.partial_dtype = PartialDtype::fp32;
    world.reserve(MpiStagedCommunicator::staging_bytes_for(fast));
    const Result r =
        run_cuda<CacheFormat::bf16, false, Replicated, AllGatherReduceScatter>(world, s, fast);
    const double err = error_vs_host(r, host, CacheFormat::bf16, 2.0);
    CAPTURE(err);
    CHECK(err <= 1.0);
  }
}

TEST_CASE("CUDA fast sparse: each split scans its run of a 512-wide top-k list, close to the host",
          "[cuda][op][fast][sparse]") {
  // A list of 512: the operator passes its width to CudaExecution, whose split count keeps 128
  // entries a split or more (at most 4 here), and the kernel's splits take runs of the list
  // (MlaDecodeParams::split_topk_list).
  const Scenario s = dcpattn::test::make_scenario(79u, {700, 1500, 900}, {1, 2, 1}, 1,
                                                  /*heads=*/128, 1, 64, /*topk=*/512);
  DcpConfig fast = make_config(s, dcpattn::test::world_size(), DcpMode::fast);
  MpiStagedCommunicator world(MPI_COMM_WORLD, MpiStagedCommunicator::staging_bytes_for(fast));
  int device = 0, sms = 0;
  CUDA_OK(cudaGetDevice(&device));
  CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int expected =
      dcpattn::cuda_kernels::mla_decode_fast_splits(s.rows(), s.num_heads, 512, sms);
  for (CacheFormat format : {CacheFormat::bf16, CacheFormat::fp8_ds_mla}) {
    CAPTURE(int(format));
    const Result host = format == CacheFormat::bf16 ? run_host<CacheFormat::bf16, true>(s)
                                                    : run_host<CacheFormat::fp8_ds_mla, true>(s);
    const Result r =
        format == CacheFormat::bf16
            ? run_cuda<CacheFormat::bf16, true, DirectWorkspace, AllToAll>(world, s, fast)
            : run_cuda<CacheFormat::fp8_ds_mla, true, DirectWorkspace, AllToAll>(world, s, fast);
    CHECK(r.num_splits == expected);
    CHECK(r.num_splits > 1);
    const double err = error_vs_host(r, host, format, 2.0);
    CAPTURE(err);
    CHECK(err <= 1.0);
  }
}

TEST_CASE("MpiStagedCommunicator refuses a collective beyond its capacity, on every rank",
          "[cuda][comm]") {
  const Scenario s = scenario_for(1, 3u);
  const DcpConfig cfg = make_config(s, dcpattn::test::world_size(), DcpMode::deterministic);
  // enough for nothing: the query all-gather, the first collective, is refused before any
  // communication, identically on every rank
  MpiStagedCommunicator small(MPI_COMM_WORLD, 64);
  std::string message;
  try {
    (void)run_cuda<CacheFormat::bf16, false, DirectWorkspace, AllToAll>(small, s, cfg);
  } catch (const dcpattn::Error& e) {
    message = e.what();
  }
  INFO(message);
  CHECK(message.find("capacity (64 bytes)") != std::string::npos);
  CHECK(dcpattn::test::all_ranks(!message.empty()));
}

TEST_CASE("MpiStagedCommunicator refuses to be captured in a CUDA graph", "[cuda][comm]") {
  MpiStagedCommunicator self(MPI_COMM_SELF, 1024);
  MpiStagedCommunicator world(MPI_COMM_WORLD, 1024);  // restores the error rank
  DeviceArray<float> a(16), b(16);
  const Stream stream;
  CUDA_OK(cudaStreamBeginCapture(stream.s, cudaStreamCaptureModeThreadLocal));
  bool threw = false;
  try {
    self.all_gather(static_cast<const float*>(a.ptr), b.ptr, 16, stream.s);
  } catch (const dcpattn::Error& e) {
    threw = std::string(e.what()).find("CUDA graph") != std::string::npos;
  }
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamEndCapture(stream.s, &graph));
  if (graph) CUDA_OK(cudaGraphDestroy(graph));
  CHECK(threw);
}
#endif  // !DCPATTN_TEST_NCCL

#if DCPATTN_TEST_NCCL
// The same operator over NcclCommunicator: one process per GPU (NCCL refuses two ranks on one
// GPU before 2.30). With fewer GPUs than ranks the cases say so and check nothing.
namespace {
/// Whether every rank has its own GPU; when not, says so (the case then checks nothing).
bool one_gpu_per_rank() {
  int devices = 0;
  CUDA_OK(cudaGetDeviceCount(&devices));
  if (devices >= dcpattn::test::world_size()) return true;
  WARN("fewer GPUs than ranks: NcclCommunicator needs one GPU per rank; nothing checked");
  return false;
}

template <CacheFormat F, bool Sparse>
void check_nccl(bool graph) {
  const Scenario s = scenario_for(1, 555u + unsigned(Sparse));
  const DcpConfig world_cfg = make_config(s, dcpattn::test::world_size(), DcpMode::deterministic);
  const DcpConfig self_cfg = make_config(s, 1, DcpMode::deterministic);
  CudaSelfCommunicator self;
  NcclCommunicator world = NcclCommunicator::init(MPI_COMM_WORLD);
  const Result dcp =
      run_cuda<F, Sparse, DirectWorkspace, AllToAll>(world, s, world_cfg, false, graph);
  const Result single = run_cuda<F, Sparse, DirectWorkspace, AllToAll>(self, s, self_cfg);
  const Result host = run_host<F, Sparse>(s);
  INFO("N = " << world.size() << (graph ? ", forward captured in a CUDA graph" : ", eager"));
  INFO(first_differences(dcp, single));
  CHECK(bitwise_equal(dcp, single));
  const double err = error_vs_host(dcp, host, F);
  CAPTURE(err);
  CHECK(err <= 1.0);
}
}  // namespace

TEST_CASE("NCCL: N GPUs are bitwise N = 1 (dense bf16, sparse fp8), close to the host",
          "[cuda][nccl][deterministic]") {
  if (!one_gpu_per_rank()) return;
  check_nccl<CacheFormat::bf16, false>(false);
  check_nccl<CacheFormat::fp8_ds_mla, true>(false);
}

TEST_CASE("NCCL inside a CUDA graph: the replayed forward is bitwise N = 1",
          "[cuda][nccl][graph]") {
  if (!one_gpu_per_rank()) return;
  check_nccl<CacheFormat::bf16, false>(true);
  check_nccl<CacheFormat::fp8_ds_mla, true>(true);
}

namespace {
/// Spins until the host sets *flag (host-mapped memory), or about `max_cycles` clock cycles pass
/// (a bound, so a failing test cannot leave the GPU busy forever).
__global__ void spin_until_set(const volatile int* flag, long long max_cycles) {
  const long long start = clock64();
  while (*flag == 0 && clock64() - start < max_cycles) {
  }
}
}  // namespace

TEST_CASE("NCCL watchdog: a step that misses its deadline aborts the communicator and throws",
          "[cuda][nccl][watchdog]") {
  if (!one_gpu_per_rank()) return;
  NcclCommunicator comm = NcclCommunicator::init(MPI_COMM_WORLD);
  const int rank = comm.rank();
  Stream stream;
  DeviceArray<float> send(4), recv(4 * std::size_t(comm.size()));
  // A step that completes: the watchdog returns.
  comm.all_gather(send.ptr, recv.ptr, 4, stream.s);
  REQUIRE_NOTHROW(comm.synchronize_with_watchdog(stream.s, std::chrono::seconds(30)));

  // A step that does not complete in time: the stream waits behind a kernel that a host thread
  // releases after 1 s, as it would behind a collective whose peer is late. Nothing of NCCL is in
  // flight, so the abort frees nothing a queued kernel still uses. ncclCommAbort itself waits
  // for kernels running on the GPU that are not NCCL's (measured on the H200: it returned when
  // the spinning kernel ended), so the throw comes after the release, not at 200 ms.
  int* flag = nullptr;
  CUDA_OK(cudaHostAlloc(reinterpret_cast<void**>(&flag), sizeof(int), cudaHostAllocMapped));
  *flag = 0;
  int* flag_dev = nullptr;
  CUDA_OK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&flag_dev), flag, 0));
  spin_until_set<<<1, 1, 0, stream.s>>>(flag_dev, 20'000'000'000LL);  // at most ~10 s
  CUDA_OK(cudaGetLastError());
  std::string what;
  const auto t0 = std::chrono::steady_clock::now();
  std::thread releaser([flag] {
    std::this_thread::sleep_for(std::chrono::seconds(1));
    *reinterpret_cast<volatile int*>(flag) = 1;
  });
  try {
    comm.synchronize_with_watchdog(stream.s, std::chrono::milliseconds(200));
  } catch (const Error& e) {
    what = e.what();
  }
  const double waited_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  releaser.join();
  CUDA_OK(cudaStreamSynchronize(stream.s));
  CUDA_OK(cudaFreeHost(flag));
  CAPTURE(what, waited_ms);
  CHECK(what.find("[rank " + std::to_string(rank) + "]") != std::string::npos);
  CHECK(what.find("synchronize_with_watchdog") != std::string::npos);
  CHECK(what.find("did not complete within 200 ms") != std::string::npos);
  CHECK(waited_ms >= 200.0);
  CHECK(waited_ms < 5'000.0);  // the deadline, then the abort once the kernel ended
  // Aborted: every later use says so instead of reaching NCCL.
  CHECK(comm.comm() == nullptr);
  try {
    comm.all_gather(send.ptr, recv.ptr, 4, stream.s);
    FAIL("all_gather on an aborted communicator did not throw");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("watchdog aborted it") != std::string::npos);
  }
}

TEST_CASE("NCCL watchdog: a peer that never joins a collective aborts every rank, none hangs",
          "[cuda][nccl][watchdog]") {
  if (!one_gpu_per_rank()) return;
  NcclCommunicator comm = NcclCommunicator::init(MPI_COMM_WORLD);
  if (comm.size() < 2) {
    SUCCEED("needs two ranks or more: a peer to stay away");
    return;
  }
  const int rank = comm.rank(), late = comm.size() - 1;
  Stream stream;
  DeviceArray<float> send(4), recv(4 * std::size_t(comm.size()));
  comm.all_gather(send.ptr, recv.ptr, 4, stream.s);
  REQUIRE_NOTHROW(comm.synchronize_with_watchdog(stream.s, std::chrono::seconds(30)));

  // Every rank but the last enters an all-gather that the last never joins: their NCCL kernels
  // wait for a peer that is not there, their watchdogs abort the communicator (which ends those
  // kernels) and throw. Only then does the last rank enter collectives, which its peers have
  // left. Its first all-gather may still complete: the others delivered their part before they
  // gave up (measured on two H200s over NVLink: it completed in 0.4 ms). The next one cannot,
  // and its watchdog fires. Every rank ends with an error, an aborted communicator and an idle
  // GPU; none hangs.
  std::string what;
  double waited_ms = 0;
  int attempts = 0;
  auto attempt = [&] {
    try {
      while (attempts < 3) {  // at most 3: the test must end even if collectives kept completing
        ++attempts;
        const auto t0 = std::chrono::steady_clock::now();
        comm.all_gather(send.ptr, recv.ptr, 4, stream.s);
        try {
          comm.synchronize_with_watchdog(stream.s, std::chrono::milliseconds(300));
        } catch (...) {
          waited_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() -
                                                                t0)
                          .count();
          throw;
        }
        if (rank != late) break;  // a rank waiting for the late peer must not get here
      }
    } catch (const Error& e) {
      what = e.what();
    }
  };
  if (rank != late) attempt();
  REQUIRE(MPI_Barrier(MPI_COMM_WORLD) == MPI_SUCCESS);
  if (rank == late) attempt();
  CUDA_OK(cudaStreamSynchronize(stream.s));  // nothing of the aborted collectives is left running
  CAPTURE(rank, what, waited_ms, attempts);
  CHECK(what.find("[rank " + std::to_string(rank) + "]") != std::string::npos);
  CHECK(what.find("communicator aborted") != std::string::npos);
  if (rank != late) {  // waited for the absent peer until the deadline, on the first collective
    CHECK(attempts == 1);
    CHECK(what.find("did not complete within 300 ms") != std::string::npos);
    CHECK(waited_ms >= 300.0);
  }
  CHECK(waited_ms < 10'000.0);
  CHECK(comm.comm() == nullptr);
}
#endif  // DCPATTN_TEST_NCCL
