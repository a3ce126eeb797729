// SPDX-License-Identifier: Apache-2.0
// The DCP operator on the host under mpirun: bitwise DCP invariance in deterministic mode, fast
// mode within tolerance, an independent double-precision reference, the gather fallback, and the
// seed bug (b): with N > 1 the combine runs.
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "support/catch.hpp"
#include "support/mpi_env.hpp"

#include "dcpattn/comm/mpi.hpp"
#include "dcpattn/dcpattn.hpp"
#include "op/scenario.hpp"

using namespace dcpattn;
using dcpattn::test::Scenario;

namespace {

constexpr float kScale = 0.0721687836f;  // 1 / sqrt(192)

/// The output of one forward over all heads: out (T, H, 512) and lse (T, H), assembled from the
/// ranks' head slices.
struct Result {
  std::vector<bfloat16> out;
  std::vector<float> lse;
  bool fell_back = false;
  int num_splits = 0;
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

template <CacheFormat F, bool Sparse, class Gather, class Combiner, class Comm,
          class Exec = HostExecution>
Result run_op(Comm& comm, const Scenario& s, const DcpConfig& cfg) {
  using Kernel = std::conditional_t<Sparse, SparseMla<F>, DenseMla<F>>;
  using Op = DcpAttention<RoundRobinOwnership, Gather, Kernel, Combiner, Comm, Exec>;
  const int n = comm.size(), rank = comm.rank();
  const std::int64_t t = s.rows(), h = s.num_heads, hl = h / n;
  Op op(comm, cfg);
  const auto cache = dcpattn::test::build_local_cache<F>(s, op.ownership(), rank);

  const bool replicated = std::is_same_v<Gather, Replicated>;
  std::vector<bfloat16> q_local;
  TensorView<const bfloat16, 3> q;
  if (replicated) {
    q = make_view(static_cast<const bfloat16*>(s.q.data()), {t, h, std::int64_t(kMlaQkDim)});
  } else {
    // this rank's heads, as a strided view into the full q (no copy): the gather packs it
    q = make_view(static_cast<const bfloat16*>(s.q.data()) + rank * hl * kMlaQkDim,
                  {t, hl, std::int64_t(kMlaQkDim)},
                  {h * kMlaQkDim, std::int64_t(kMlaQkDim), 1});
  }
  std::vector<bfloat16> out_local(std::size_t(t * hl * kMlaVDim));
  std::vector<float> lse_local(std::size_t(t * hl));
  typename Op::Arguments a;
  a.q = q;
  a.cache = cache.view();
  a.block_table = cache.table();
  a.row_request = make_view(s.row_request.data(), {t});
  a.row_bound = make_view(s.row_bound.data(), {t});
  a.topk = make_view(s.topk_idx.data(), {t, std::int64_t(s.topk)});
  a.num_valid_rows = s.num_valid_rows;
  a.out = make_view(out_local.data(), {t, hl, std::int64_t(kMlaVDim)});
  a.out_lse = make_view(lse_local.data(), {t, hl});
  // Poisoned: forward() must write whatever it reads, including clearing the input-error record
  // (else check_input_errors would report the poison).
  std::vector<std::byte> ws(Op::workspace_bytes(cfg), std::byte{0xff});
  Result r;
  const ForwardInfo info = op.forward(a, ws);
  r.fell_back = info.gather_fell_back;
  r.num_splits = info.num_splits;
  // The host kernels throw on bad input inside forward(); nothing is left to report after it.
  CHECK_NOTHROW(op.check_input_errors(ws));

  // assemble all heads: all-gather the (T, H_local, ...) slices, then reorder rank-major -> heads
  std::vector<bfloat16> out_all(std::size_t(n) * out_local.size());
  std::vector<float> lse_all(std::size_t(n) * lse_local.size());
  comm.all_gather(reinterpret_cast<const std::uint8_t*>(out_local.data()),
                  reinterpret_cast<std::uint8_t*>(out_all.data()), out_local.size() * 2, {});
  comm.all_gather(lse_local.data(), lse_all.data(), lse_local.size(), {});
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

bool bitwise_equal(const Result& a, const Result& b) {
  return a.out.size() == b.out.size() && a.lse.size() == b.lse.size() &&
         std::memcmp(a.out.data(), b.out.data(), a.out.size() * sizeof(bfloat16)) == 0 &&
         std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float)) == 0;
}

/// Plain double-precision attention over the scenario's global keys: no ownership, no splits.
/// For the fp8 format the keys are what the cache stores (the 656-byte entry decoded).
template <CacheFormat F, bool Sparse>
void reference(const Scenario& s, std::vector<double>& out, std::vector<double>& lse) {
  const std::int64_t t = s.rows(), h = s.num_heads;
  out.assign(std::size_t(t * h * kMlaVDim), 0.0);
  lse.assign(std::size_t(t * h), -std::numeric_limits<double>::infinity());
  for (std::int64_t row = 0; row < s.num_valid_rows; ++row) {
    const auto& keys = s.keys[std::size_t(s.row_request[std::size_t(row)])];
    std::vector<std::int64_t> pos;
    if (Sparse) {
      for (int k = 0; k < s.topk; ++k)
        if (const int g = s.topk_idx[std::size_t(row * s.topk + k)]; g >= 0) pos.push_back(g);
    } else {
      for (std::int64_t g = 0; g < s.row_bound[std::size_t(row)]; ++g) pos.push_back(g);
    }
    if (pos.empty()) continue;
    std::vector<std::vector<double>> kv(pos.size(), std::vector<double>(kMlaQkDim));
    for (std::size_t j = 0; j < pos.size(); ++j) {
      const float* k = keys.data() + pos[j] * kMlaQkDim;
      if (F == CacheFormat::bf16) {
        for (int i = 0; i < kMlaQkDim; ++i) kv[j][i] = k[i];
      } else {
        std::uint8_t entry[DsMlaFp8Entry::bytes];
        DsMlaFp8Entry::encode(k, k + kMlaLatentDim, entry);
        for (int i = 0; i < kMlaQkDim; ++i) kv[j][i] = DsMlaFp8Entry::key(entry, i);
      }
    }
    for (std::int64_t head = 0; head < h; ++head) {
      const bfloat16* q = s.q.data() + (row * h + head) * kMlaQkDim;
      std::vector<double> sc(pos.size());
      double m = -std::numeric_limits<double>::infinity();
      for (std::size_t j = 0; j < pos.size(); ++j) {
        double d = 0;
        for (int i = 0; i < kMlaQkDim; ++i) d += double(q[i].to_float()) * kv[j][i];
        sc[j] = d * kScale;
        m = std::max(m, sc[j]);
      }
      double l = 0;
      for (auto x : sc) l += std::exp(x - m);
      lse[std::size_t(row * h + head)] = m + std::log(l);
      for (std::size_t j = 0; j < pos.size(); ++j)
        for (int i = 0; i < kMlaVDim; ++i)
          out[std::size_t((row * h + head) * kMlaVDim + i)] += std::exp(sc[j] - m) / l * kv[j][i];
    }
  }
}

/// Largest error of a result against the reference, in units of the tolerance
/// (|diff| <= 4e-3 + 8e-3 |ref| for o: bf16 output rounding is 2^-9 relative, plus fp32
/// accumulation over <= 576-term dot products; |diff| <= 1e-4 (1 + |ref|) for the fp32 lse).
/// Padding and empty rows must be exactly (0, -inf).
double error_vs_reference(const Result& r, const std::vector<double>& out,
                          const std::vector<double>& lse) {
  double worst = 0;
  for (std::size_t i = 0; i < out.size(); ++i) {
    const double got = r.out[i].to_float();
    if (std::isnan(got)) return std::numeric_limits<double>::infinity();
    worst = std::max(worst, std::fabs(got - out[i]) / (4e-3 + 8e-3 * std::fabs(out[i])));
  }
  for (std::size_t i = 0; i < lse.size(); ++i) {
    if (std::isinf(lse[i])) {
      if (!(std::isinf(r.lse[i]) && r.lse[i] < 0)) return std::numeric_limits<double>::infinity();
      continue;
    }
    worst = std::max(worst, std::fabs(r.lse[i] - lse[i]) / (1e-4 * (1 + std::fabs(lse[i]))));
  }
  return worst;
}

Scenario scenario_for(int interleave, std::uint32_t seed) {
  // lengths below N*I (so some ranks hold nothing), 0, 1, and longer; spec-decode rows; 2 padding rows
  const int page = interleave == 1 ? 16 : 64;
  return dcpattn::test::make_scenario(seed, {0, 1, 5, 70, 300}, {1, 1, 2, 3, 1}, 2,
                                      /*heads=*/8, interleave, page, /*topk=*/24);
}

template <CacheFormat F, bool Sparse>
void check_invariance(int interleave) {
  MpiCommunicator world(MPI_COMM_WORLD);
  SelfCommunicator self;
  const Scenario s = scenario_for(interleave, 1234u + unsigned(interleave));
  const Result dcp = run_op<F, Sparse, DirectWorkspace, AllToAll>(
      world, s, make_config(s, world.size(), DcpMode::deterministic));
  const Result single = run_op<F, Sparse, DirectWorkspace, AllToAll>(
      self, s, make_config(s, 1, DcpMode::deterministic));
  INFO("N = " << world.size() << ", I = " << interleave);
  CHECK(bitwise_equal(dcp, single));
  std::vector<double> ref_out, ref_lse;
  reference<F, Sparse>(s, ref_out, ref_lse);
  CHECK(error_vs_reference(dcp, ref_out, ref_lse) <= 1.0);
  CHECK(error_vs_reference(single, ref_out, ref_lse) <= 1.0);
}

}  // namespace

TEST_CASE("deterministic dense bf16: N ranks are bitwise N = 1", "[op][deterministic]") {
  check_invariance<CacheFormat::bf16, false>(1);
  check_invariance<CacheFormat::bf16, false>(64);
}

TEST_CASE("deterministic dense fp8: N ranks are bitwise N = 1", "[op][deterministic]") {
  check_invariance<CacheFormat::fp8_ds_mla, false>(1);
  check_invariance<CacheFormat::fp8_ds_mla, false>(64);
}

TEST_CASE("deterministic sparse bf16: N ranks are bitwise N = 1", "[op][deterministic]") {
  check_invariance<CacheFormat::bf16, true>(1);
  check_invariance<CacheFormat::bf16, true>(64);
}

TEST_CASE("deterministic sparse fp8: N ranks are bitwise N = 1", "[op][deterministic]") {
  check_invariance<CacheFormat::fp8_ds_mla, true>(1);
  check_invariance<CacheFormat::fp8_ds_mla, true>(64);
}

TEST_CASE("fast mode is within tolerance of N = 1 and of the reference", "[op][fast]") {
  MpiCommunicator world(MPI_COMM_WORLD);
  SelfCommunicator self;
  const Scenario s = scenario_for(1, 77u);
  const Result single = run_op<CacheFormat::bf16, false, DirectWorkspace, AllToAll>(
      self, s, make_config(s, 1, DcpMode::deterministic));
  std::vector<double> ref_out, ref_lse;
  reference<CacheFormat::bf16, false>(s, ref_out, ref_lse);

  DcpConfig fast = make_config(s, world.size(), DcpMode::fast);
  SECTION("all-to-all with bf16 partials") {
    fast.partial_dtype = PartialDtype::bf16;
    const Result r = run_op<CacheFormat::bf16, false, AllGather, AllToAll>(world, s, fast);
    // bf16 partials add one more 2^-9 relative rounding before the merge: within 2x the tolerance
    CHECK(error_vs_reference(r, ref_out, ref_lse) <= 2.0);
  }
  SECTION("all-gather + reduce-scatter") {
    const Result r =
        run_op<CacheFormat::bf16, false, AllGather, AllGatherReduceScatter>(world, s, fast);
    CHECK(error_vs_reference(r, ref_out, ref_lse) <= 1.0);
    double max_diff = 0;
    for (std::size_t i = 0; i < r.out.size(); ++i)
      max_diff = std::max(max_diff, double(std::fabs(r.out[i].to_float() - single.out[i].to_float())));
    CHECK(max_diff <= 1.6e-2);  // a few bf16 ulps of |o| <= 2
  }
}

namespace {
/// HostExecution that chooses fast mode's split count itself, as CudaExecution does (a pretend
/// GPU: 8 splits for a batch of up to 2 rows, else 1), with split states of 1 float per (split,
/// row, head) and room in the workspace for 8 (split, row) pairs: a batch of 1 row runs 8
/// splits, a batch of 2 rows is halved to 4.
struct SplitPickingExec : HostExecution {
  static int fast_mode_splits(const DcpConfig&, std::int64_t tokens) { return tokens <= 2 ? 8 : 1; }
  static std::size_t attention_scratch_bytes(const DcpConfig& c, int splits) {
    return splits > 1 ? std::size_t(splits) * std::size_t(c.max_tokens) * std::size_t(c.num_heads) *
                            sizeof(float)
                      : 0;
  }
  static std::size_t fast_mode_scratch_bytes(const DcpConfig& c) {
    return std::size_t(8) * std::size_t(c.num_heads) * sizeof(float);
  }
};
}  // namespace

TEST_CASE("fast mode: the execution space's split count, halved to fit the workspace",
          "[op][fast][splits]") {
  MpiCommunicator world(MPI_COMM_WORLD);
  struct Case {
    std::int64_t length;
    int padding;  // rows of padding after the one request row
    int splits;   // expected in fast mode
  };
  for (const Case k : {Case{300, 0, 8}, Case{300, 1, 4}, Case{70, 3, 1}}) {
    const Scenario s = dcpattn::test::make_scenario(91u + unsigned(k.padding), {k.length}, {1},
                                                    k.padding, /*heads=*/8, 1, 16, 24);
    CAPTURE(k.length, k.padding, s.rows());
    std::vector<double> ref_out, ref_lse;
    reference<CacheFormat::bf16, false>(s, ref_out, ref_lse);
    const DcpConfig fast = make_config(s, world.size(), DcpMode::fast);
    const Result r = run_op<CacheFormat::bf16, false, DirectWorkspace, AllToAll, MpiCommunicator,
                            SplitPickingExec>(world, s, fast);
    CHECK(r.num_splits == k.splits);
    CHECK(error_vs_reference(r, ref_out, ref_lse) <= 1.0);
    // Deterministic mode keeps V / N whatever the execution space prefers.
    const DcpConfig det = make_config(s, world.size(), DcpMode::deterministic);
    const Result d = run_op<CacheFormat::bf16, false, DirectWorkspace, AllToAll, MpiCommunicator,
                            SplitPickingExec>(world, s, det);
    CHECK(d.num_splits == det.virtual_shards / world.size());
    // And the plain host execution space keeps V / N in fast mode too.
    const Result h = run_op<CacheFormat::bf16, false, DirectWorkspace, AllToAll>(world, s, fast);
    CHECK(h.num_splits == fast.virtual_shards / world.size());
  }
}

namespace {
/// SplitPickingExec with the three-argument fast_mode_splits: it records the `attended` the
/// operator passes (the top-k list's width for the sparse kernel, -1 for the dense one) and
/// chooses 4 splits.
struct AttendedSplitsExec : SplitPickingExec {
  static inline std::int64_t seen = -2;
  static int fast_mode_splits(const DcpConfig&, std::int64_t, std::int64_t attended) {
    seen = attended;
    return 4;
  }
  static std::size_t fast_mode_scratch_bytes(const DcpConfig& c) {
    return attention_scratch_bytes(c, 4);  // room for 4 splits of every row
  }
};
}  // namespace

TEST_CASE("fast mode: the execution space learns the top-k width of a sparse forward",
          "[op][fast][splits]") {
  MpiCommunicator world(MPI_COMM_WORLD);
  const Scenario s = scenario_for(1, 17u);
  REQUIRE(s.topk > 0);
  std::vector<double> ref_out, ref_lse;
  const DcpConfig fast = make_config(s, world.size(), DcpMode::fast);
  AttendedSplitsExec::seen = -2;
  const Result sparse = run_op<CacheFormat::bf16, true, DirectWorkspace, AllToAll, MpiCommunicator,
                               AttendedSplitsExec>(world, s, fast);
  CHECK(AttendedSplitsExec::seen == s.topk);
  CHECK(sparse.num_splits == 4);
  reference<CacheFormat::bf16, true>(s, ref_out, ref_lse);
  CHECK(error_vs_reference(sparse, ref_out, ref_lse) <= 1.0);
  AttendedSplitsExec::seen = -2;
  const Result dense = run_op<CacheFormat::bf16, false, DirectWorkspace, AllToAll, MpiCommunicator,
                              AttendedSplitsExec>(world, s, fast);
  CHECK(AttendedSplitsExec::seen == -1);
  CHECK(dense.num_splits == 4);
  reference<CacheFormat::bf16, false>(s, ref_out, ref_lse);
  CHECK(error_vs_reference(dense, ref_out, ref_lse) <= 1.0);
}

TEST_CASE("gather: capacity overflow falls back to all-gather with the same bits", "[op][gather]") {
  MpiCommunicator world(MPI_COMM_WORLD);
  const Scenario s = scenario_for(1, 5u);
  DcpConfig cfg = make_config(s, world.size(), DcpMode::deterministic);
  const Result direct = run_op<CacheFormat::bf16, true, DirectWorkspace, AllToAll>(world, s, cfg);
  CHECK_FALSE(direct.fell_back);
  cfg.gather_capacity = int(s.rows()) - 1;
  const Result overflow = run_op<CacheFormat::bf16, true, DirectWorkspace, AllToAll>(world, s, cfg);
  CHECK(overflow.fell_back);
  CHECK(bitwise_equal(direct, overflow));
  const Result replicated = run_op<CacheFormat::bf16, true, Replicated, AllToAll>(world, s, cfg);
  CHECK_FALSE(replicated.fell_back);
  CHECK(bitwise_equal(direct, replicated));
}

namespace {
/// A combiner that skips the exchange: each rank keeps its own heads' local partial. This is the
/// pure-DCP bug of the seed report (combine gated behind another feature); the test below proves
/// the suite catches it.
struct NoExchange {
  static bool supports(DcpMode) { return true; }
  static std::size_t scratch_bytes(const DcpConfig&) { return 0; }
  template <class LseBase, class C, class E>
  static void combine(C& comm, E&, const CombineArgs& a, cuda::std::span<std::byte>,
                      const DcpConfig&, typename C::stream_type) {
    const std::int64_t hl = a.out.extent(1);
    for (std::int64_t t = 0; t < a.out.extent(0); ++t)
      for (std::int64_t hh = 0; hh < hl; ++hh) {
        const std::int64_t h = comm.rank() * hl + hh;
        const bool empty = t >= a.num_valid_rows || !(sanitize_lse(a.lse(t, h)) > lse_neg_inf);
        for (std::int64_t i = 0; i < a.out.extent(2); ++i)
          a.out(t, hh, i) = bfloat16::from_float(empty ? 0.0f : a.o(t, h, i));
        if (a.out_lse.data_handle()) a.out_lse(t, hh) = empty ? lse_neg_inf : a.lse(t, h);
      }
  }
};
}  // namespace

TEST_CASE("seed bug (b): without the cross-rank combine the result is wrong for N > 1",
          "[op][seed]") {
  MpiCommunicator world(MPI_COMM_WORLD);
  const Scenario s = scenario_for(1, 9u);
  std::vector<double> ref_out, ref_lse;
  reference<CacheFormat::bf16, false>(s, ref_out, ref_lse);
  const DcpConfig cfg = make_config(s, world.size(), DcpMode::deterministic);
  const Result good = run_op<CacheFormat::bf16, false, DirectWorkspace, AllToAll>(world, s, cfg);
  const Result skipped = run_op<CacheFormat::bf16, false, DirectWorkspace, NoExchange>(world, s, cfg);
  CHECK(error_vs_reference(good, ref_out, ref_lse) <= 1.0);
  if (world.size() > 1)
    CHECK(error_vs_reference(skipped, ref_out, ref_lse) > 1.0);  // the check above would fail
  else
    CHECK(bitwise_equal(good, skipped));  // N = 1: the combine is a copy
}

TEST_CASE("all -1 top-k rows give the neutral element", "[op][sparse]") {
  MpiCommunicator world(MPI_COMM_WORLD);
  Scenario s = scenario_for(1, 11u);
  std::fill(s.topk_idx.begin(), s.topk_idx.end(), -1);
  const Result r = run_op<CacheFormat::fp8_ds_mla, true, DirectWorkspace, AllToAll>(
      world, s, make_config(s, world.size(), DcpMode::deterministic));
  for (auto v : r.out) REQUIRE(v.bits == 0);
  for (auto l : r.lse) REQUIRE((std::isinf(l) && l < 0));
}
