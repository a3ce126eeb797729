// SPDX-License-Identifier: Apache-2.0
// One decode step (fused prologue + DcpAttention forward) captured in a CUDA graph at N = 1
// (CudaSelfCommunicator) and replayed after the inputs were overwritten in place with new values
// of the same shapes: the replay must give the bytes of an eager run on the new inputs. This is
// what an engine's CUDA-graph decode does; anything the capture froze (a host-side value, a
// pointer into a temporary, an allocation) shows up as a difference.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <type_traits>
#include <vector>

#include <cuda_runtime.h>

#include "support/catch.hpp"

#include "dcpattn/comm/cuda_self.cuh"
#include "dcpattn/dcpattn.hpp"
#include "dcpattn/exec/cuda.cuh"
#include "dcpattn/kernels/cuda/prologue.cuh"
#include "op/scenario.hpp"

using namespace dcpattn;
using dcpattn::test::Scenario;

namespace {

#define CUDA_OK(call) REQUIRE((call) == cudaSuccess)

template <class T>
struct DeviceArray {
  T* ptr = nullptr;
  std::size_t n = 0;
  explicit DeviceArray(std::size_t count) : n(count) {
    CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&ptr), (count ? count : 1) * sizeof(T)));
  }
  ~DeviceArray() { cudaFree(ptr); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  void upload(const std::vector<T>& h) {
    REQUIRE(h.size() == n);
    CUDA_OK(cudaMemcpy(ptr, h.data(), n * sizeof(T), cudaMemcpyHostToDevice));
    // A pageable cudaMemcpy may return before its copy has landed, on the legacy stream, which
    // the test's non-blocking stream does not wait for.
    CUDA_OK(cudaDeviceSynchronize());
  }
  std::vector<T> download() const {
    std::vector<T> h(n);
    CUDA_OK(cudaMemcpy(h.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

template <class T>
bool same_bytes(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

constexpr std::int64_t kQPad = kMlaQkDim + 64;  // q rows padded: a strided view the gather packs
constexpr std::int64_t kMaxPosition = 320;

/// Host values of every input of one decode step.
template <CacheFormat F>
struct StepInputs {
  std::vector<bfloat16> q;  // (T, H, kQPad), the first 576 of each row used
  dcpattn::test::LocalCache<F> cache;
  std::vector<bfloat16> q_c, kv_c, k_pe;  // (T, 1536), (T, 512), (T, 64)
};

template <CacheFormat F>
StepInputs<F> make_inputs(const Scenario& s, const RoundRobinOwnership& own, std::uint32_t seed) {
  StepInputs<F> in;
  const std::int64_t t = s.rows(), h = s.num_heads;
  in.q.assign(std::size_t(t * h * kQPad), bfloat16::from_float(NAN));
  for (std::int64_t r = 0; r < t * h; ++r)
    std::memcpy(&in.q[std::size_t(r * kQPad)], &s.q[std::size_t(r * kMlaQkDim)],
                kMlaQkDim * sizeof(bfloat16));
  in.cache = dcpattn::test::build_local_cache<F>(s, own, 0);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto fill = [&](std::vector<bfloat16>& v, std::size_t n) {
    v.resize(n);
    for (auto& x : v) x = bfloat16::from_float(normal(rng));
  };
  fill(in.q_c, std::size_t(t * kMlaQLoraRank));
  fill(in.kv_c, std::size_t(t * kMlaLatentDim));
  fill(in.k_pe, std::size_t(t * kMlaRopeDim));
  return in;
}

/// Runs the graph test for one kernel policy.
template <CacheFormat F, bool Sparse>
void check_graph_replay() {
  using Kernel = std::conditional_t<Sparse, SparseMla<F>, DenseMla<F>>;
  using Op = DcpAttention<RoundRobinOwnership, DirectWorkspace, Kernel, AllToAll,
                          CudaSelfCommunicator, CudaExecution>;
  using Elem = mla_cache_element_t<F>;
  // two scenarios of identical shapes (lengths, rows, padding) and different values
  auto scenario = [](std::uint32_t seed) {
    return dcpattn::test::make_scenario(seed, {0, 1, 5, 70, 300}, {1, 1, 2, 3, 1}, 2,
                                        /*heads=*/16, /*interleave=*/1, /*page=*/16, /*topk=*/24);
  };
  const Scenario sa = scenario(21u), sb = scenario(22u);
  const std::int64_t t = sa.rows(), h = sa.num_heads;

  DcpConfig cfg;
  cfg.group_size = 1;
  cfg.num_heads = int(h);
  cfg.page_size = sa.page_size;
  cfg.interleave = sa.interleave;
  cfg.max_tokens = int(t);
  cfg.gather_capacity = int(t);
  cfg.topk = sa.topk;
  cfg.softmax_scale = 0.0721687836f;
  cfg.mode = DcpMode::deterministic;
  CudaSelfCommunicator self;
  Op op(self, cfg);
  const StepInputs<F> ia = make_inputs<F>(sa, op.ownership(), 31u);
  const StepInputs<F> ib = make_inputs<F>(sb, op.ownership(), 32u);
  REQUIRE(ia.cache.block_table == ib.cache.block_table);
  const std::int64_t num_slots = ia.cache.num_slots, max_pages = ia.cache.max_pages;
  const std::int64_t width = mla_cache_row_width(F);

  // Step inputs that keep their values: weights, RoPE table, positions and slots of the new
  // tokens (the last row of each request writes its request's last token).
  std::vector<bfloat16> q_norm_w(kMlaQLoraRank), kv_norm_w(kMlaLatentDim);
  for (int i = 0; i < kMlaQLoraRank; ++i) q_norm_w[i] = bfloat16::from_float(0.5f + (i % 7) * 0.125f);
  for (int i = 0; i < kMlaLatentDim; ++i) kv_norm_w[i] = bfloat16::from_float(0.75f + (i % 5) * 0.125f);
  std::vector<float> cos_sin(std::size_t(kMaxPosition * kMlaRopeDim));
  for (std::int64_t p = 0; p < kMaxPosition; ++p)
    for (int i = 0; i < kMlaRopeDim / 2; ++i) {
      const double angle = double(p) * std::pow(10000.0, -double(i) / (kMlaRopeDim / 2));
      cos_sin[std::size_t(p * kMlaRopeDim + i)] = float(std::cos(angle));
      cos_sin[std::size_t(p * kMlaRopeDim + kMlaRopeDim / 2 + i)] = float(std::sin(angle));
    }
  std::vector<std::int64_t> positions(std::size_t(t), 0), slots(std::size_t(t), -1);
  for (std::int64_t r = 0; r < sa.num_valid_rows; ++r) {
    const std::int32_t req = sa.row_request[std::size_t(r)];
    const std::int64_t bound = sa.row_bound[std::size_t(r)];
    if (bound < 1 || bound != sa.request_length[std::size_t(req)]) continue;
    positions[std::size_t(r)] = bound - 1;
    slots[std::size_t(r)] = paged_slot(op.ownership(), bound - 1, 0,
                                       ia.cache.block_table.data() + req * max_pages, sa.page_size);
  }

  // device buffers: one set, the graph is captured over their addresses
  DeviceArray<bfloat16> q(ia.q.size()), q_c(ia.q_c.size()), q_c_out(ia.q_c.size()),
      kv_c(ia.kv_c.size()), k_pe(ia.k_pe.size()), d_q_norm_w(q_norm_w.size()),
      d_kv_norm_w(kv_norm_w.size());
  DeviceArray<Elem> cache(ia.cache.data.size());
  DeviceArray<std::int32_t> table(ia.cache.block_table.size()), row_request(sa.row_request.size()),
      topk(sa.topk_idx.size());
  DeviceArray<std::int64_t> row_bound(sa.row_bound.size()), d_positions(positions.size()),
      d_slots(slots.size());
  DeviceArray<float> d_cos_sin(cos_sin.size());
  DeviceArray<bfloat16> out(std::size_t(t * h * kMlaVDim)), out2(out.n);
  DeviceArray<float> lse(std::size_t(t * h)), lse2(lse.n);
  DeviceArray<bfloat16> q_c_out2(q_c_out.n);
  DeviceArray<std::byte> ws(Op::workspace_bytes(cfg));
  d_q_norm_w.upload(q_norm_w);
  d_kv_norm_w.upload(kv_norm_w);
  d_cos_sin.upload(cos_sin);
  d_positions.upload(positions);
  d_slots.upload(slots);
  table.upload(ia.cache.block_table);

  auto upload = [&](const Scenario& s, const StepInputs<F>& in) {
    q.upload(in.q);
    cache.upload(in.cache.data);
    row_request.upload(s.row_request);
    row_bound.upload(s.row_bound);
    topk.upload(s.topk_idx);
    q_c.upload(in.q_c);
    kv_c.upload(in.kv_c);
    k_pe.upload(in.k_pe);
  };

  // one decode step: the fused prologue writes the new tokens into the cache (and normalizes
  // q_c), then the attention reads the cache
  auto step = [&](cudaStream_t stream, DeviceArray<bfloat16>& o, DeviceArray<float>& l,
                  DeviceArray<bfloat16>& qco) {
    PrologueArgs<mla_cache_out_view_t<F>> pa;
    pa.q_c = make_view(static_cast<const bfloat16*>(q_c.ptr), {t, std::int64_t(kMlaQLoraRank)});
    pa.q_c_out = make_view(qco.ptr, {t, std::int64_t(kMlaQLoraRank)});
    pa.q_norm_weight = make_view(static_cast<const bfloat16*>(d_q_norm_w.ptr), {std::int64_t(kMlaQLoraRank)});
    pa.kv_c = make_view(static_cast<const bfloat16*>(kv_c.ptr), {t, std::int64_t(kMlaLatentDim)});
    pa.kv_norm_weight = make_view(static_cast<const bfloat16*>(d_kv_norm_w.ptr), {std::int64_t(kMlaLatentDim)});
    pa.k_pe = make_view(static_cast<const bfloat16*>(k_pe.ptr), {t, std::int64_t(kMlaRopeDim)});
    pa.positions = make_view(static_cast<const std::int64_t*>(d_positions.ptr), {t});
    pa.cos_sin_cache = make_view(static_cast<const float*>(d_cos_sin.ptr), {kMaxPosition, std::int64_t(kMlaRopeDim)});
    pa.slot_mapping = make_view(static_cast<const std::int64_t*>(d_slots.ptr), {t});
    pa.kv_cache = make_view(cache.ptr, {num_slots, width});
    cuda_kernels::fused_prologue(pa, stream);

    typename Op::Arguments a;
    a.q = make_view(static_cast<const bfloat16*>(q.ptr), {t, h, std::int64_t(kMlaQkDim)},
                    {h * kQPad, kQPad, 1});
    a.cache = make_view(static_cast<const Elem*>(cache.ptr), {num_slots, width});
    a.block_table = make_view(static_cast<const std::int32_t*>(table.ptr),
                              {std::int64_t(sa.request_length.size()), max_pages});
    a.row_request = make_view(static_cast<const std::int32_t*>(row_request.ptr), {t});
    a.row_bound = make_view(static_cast<const std::int64_t*>(row_bound.ptr), {t});
    a.topk = make_view(static_cast<const std::int32_t*>(topk.ptr), {t, std::int64_t(sa.topk)});
    a.num_valid_rows = sa.num_valid_rows;
    a.out = make_view(o.ptr, {t, h, std::int64_t(kMlaVDim)});
    a.out_lse = make_view(l.ptr, {t, h});
    op.forward(a, cuda::std::span<std::byte>(ws.ptr, ws.n), stream);
  };

  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  // eager on A (also the first launch of every kernel, outside the capture)
  upload(sa, ia);
  step(stream, out, lse, q_c_out);
  CUDA_OK(cudaStreamSynchronize(stream));
  const auto out_a = out.download();

  // capture one step, then overwrite every input in place with B and replay
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  step(stream, out, lse, q_c_out);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));

  upload(sb, ib);
  CUDA_OK(cudaGraphLaunch(exec, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  const auto g_out = out.download();
  const auto g_lse = lse.download();
  const auto g_qc = q_c_out.download();
  const auto g_cache = cache.download();

  // eager on B, from the same cache contents
  upload(sb, ib);
  step(stream, out2, lse2, q_c_out2);
  CUDA_OK(cudaStreamSynchronize(stream));
  CHECK(same_bytes(g_out, out2.download()));
  CHECK(same_bytes(g_lse, lse2.download()));
  CHECK(same_bytes(g_qc, q_c_out2.download()));
  CHECK(same_bytes(g_cache, cache.download()));
  CHECK_FALSE(same_bytes(g_out, out_a));  // the replay read the new inputs

  // a second replay on the same inputs gives the same bytes
  upload(sb, ib);
  CUDA_OK(cudaGraphLaunch(exec, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  CHECK(same_bytes(g_out, out.download()));
  CHECK(same_bytes(g_lse, lse.download()));

  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  CUDA_OK(cudaStreamDestroy(stream));
  CUDA_OK(cudaGetLastError());
}

}  // namespace

TEST_CASE("CUDA graph: prologue + dense bf16 forward replays bitwise like eager on new inputs",
          "[cuda][graph]") {
  check_graph_replay<CacheFormat::bf16, false>();
}

TEST_CASE("CUDA graph: prologue + sparse fp8 forward replays bitwise like eager on new inputs",
          "[cuda][graph]") {
  check_graph_replay<CacheFormat::fp8_ds_mla, true>();
}
