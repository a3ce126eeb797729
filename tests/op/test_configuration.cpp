// SPDX-License-Identifier: Apache-2.0
// Refused configurations and inputs, each with a message naming the parameter; foreign LSE forms
// at the combiner.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "support/catch.hpp"
#include "support/mpi_env.hpp"

#include "dcpattn/comm/mpi.hpp"
#include "dcpattn/dcpattn.hpp"

using namespace dcpattn;

namespace {
using DenseOp = DcpAttention<RoundRobinOwnership, DirectWorkspace, DenseMla<CacheFormat::bf16>,
                             AllToAll, MpiCommunicator, HostExecution>;
using AgrsOp = DcpAttention<RoundRobinOwnership, AllGather, DenseMla<CacheFormat::bf16>,
                            AllGatherReduceScatter, MpiCommunicator, HostExecution>;

DcpConfig good_config(int n) {
  DcpConfig c;
  c.group_size = n;
  c.num_heads = 16;
  c.page_size = 64;
  c.interleave = 1;
  c.max_tokens = 4;
  c.gather_capacity = 4;
  c.softmax_scale = 0.07f;
  return c;
}

/// can_implement refuses `c` with a message that mentions `parameter`.
template <class Op = DenseOp>
void expect_refused(const DcpConfig& c, const std::string& parameter) {
  const Status st = Op::can_implement(c);
  INFO("expected a refusal naming " << parameter << ", got: " << st.message());
  REQUIRE_FALSE(st.ok());
  CHECK(st.message().find(parameter) != std::string::npos);
}
}  // namespace

TEST_CASE("can_implement accepts a good configuration and names the offending parameter",
          "[op][config]") {
  CHECK(DenseOp::can_implement(good_config(4)).ok());
  CHECK(DenseOp::can_implement(good_config(4)).message().empty());
  DcpConfig c = good_config(4);
  c.num_heads = 6;
  expect_refused(c, "num_heads");
  c = good_config(4);
  c.page_size = 48;
  c.interleave = 32;
  expect_refused(c, "page_size");
  c = good_config(16);
  c.num_heads = 32;
  expect_refused(c, "virtual_shards");  // 8 virtual shards cannot be split over 16 ranks
  c.mode = DcpMode::fast;
  CHECK(DenseOp::can_implement(c).ok());  // fast mode has no such constraint
  c = good_config(4);
  c.head_dim_qk = 128;
  expect_refused(c, "head_dim_qk");
  c = good_config(4);
  c.head_dim_v = 128;
  expect_refused(c, "head_dim_v");
  c = good_config(4);
  c.gather_capacity = -1;
  expect_refused(c, "gather_capacity");
  c = good_config(4);
  c.max_tokens = 0;
  expect_refused(c, "max_tokens");
  c = good_config(4);
  c.virtual_shards = 6;
  expect_refused(c, "virtual_shards");
  c = good_config(4);
  c.softmax_scale = std::numeric_limits<float>::quiet_NaN();
  expect_refused(c, "softmax_scale");
  c = good_config(4);
  c.partial_dtype = PartialDtype::bf16;
  expect_refused(c, "partial_dtype");  // deterministic mode exchanges fp32
  expect_refused<AgrsOp>(good_config(4), "mode");  // reduce-scatter is fast-mode only
}

TEST_CASE("the operator refuses a communicator of another size", "[op][config]") {
  MpiCommunicator world(MPI_COMM_WORLD);
  DcpConfig c = good_config(world.size() * 2);
  c.num_heads = 32;
  c.mode = DcpMode::fast;
  try {
    DenseOp op(world, c);
    FAIL("constructed with a mismatched group size");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("group_size") != std::string::npos);
    CHECK(e.rank() == world.rank());
  }
}

TEST_CASE("forward refuses mismatched inputs before communicating", "[op][config]") {
  MpiCommunicator world(MPI_COMM_WORLD);
  const int n = world.size();
  const DcpConfig c = good_config(n);
  DenseOp op(world, c);
  const std::int64_t t = 2, hl = c.num_heads / n;
  std::vector<bfloat16> q(std::size_t(c.max_tokens + 1) * std::size_t(hl) * kMlaQkDim);
  std::vector<bfloat16> cache(64 * kMlaQkDim);
  std::vector<std::int32_t> table{0}, req{0, 0};
  std::vector<std::int64_t> bound{1, 1};
  std::vector<bfloat16> out(std::size_t(t * hl * kMlaVDim));
  DenseOp::Arguments a;
  a.q = make_view(static_cast<const bfloat16*>(q.data()), {t, hl, std::int64_t(kMlaQkDim)});
  a.cache = make_view(static_cast<const bfloat16*>(cache.data()), {64, std::int64_t(kMlaQkDim)});
  a.block_table = make_view(static_cast<const std::int32_t*>(table.data()), {1, 1});
  a.row_request = make_view(static_cast<const std::int32_t*>(req.data()), {t});
  a.row_bound = make_view(static_cast<const std::int64_t*>(bound.data()), {t});
  a.num_valid_rows = 2;
  a.out = make_view(out.data(), {t, hl, std::int64_t(kMlaVDim)});
  std::vector<std::byte> ws(DenseOp::workspace_bytes(c));
  auto message_of = [&](DenseOp::Arguments bad, std::size_t ws_bytes) -> std::string {
    try {
      op.forward(bad, cuda::std::span<std::byte>(ws.data(), ws_bytes));
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  CHECK(message_of(a, ws.size()).empty());  // the good call runs (and communicates) fine

  auto bad = a;
  bad.q = make_view(static_cast<const bfloat16*>(q.data()), {t, hl + 1, std::int64_t(kMlaQkDim)});
  CHECK(message_of(bad, ws.size()).find("q must be") != std::string::npos);
  bad = a;
  bad.q = make_view(static_cast<const bfloat16*>(q.data()),
                    {std::int64_t(c.max_tokens + 1), hl, std::int64_t(kMlaQkDim)});
  CHECK(message_of(bad, ws.size()).find("max_tokens") != std::string::npos);
  bad = a;
  bad.num_valid_rows = 3;
  CHECK(message_of(bad, ws.size()).find("num_valid_rows") != std::string::npos);
  bad = a;
  bad.row_bound = make_view(static_cast<const std::int64_t*>(bound.data()), {1});
  CHECK(message_of(bad, ws.size()).find("row_bound") != std::string::npos);
  CHECK(message_of(a, ws.size() - 1).find("workspace") != std::string::npos);
}

TEST_CASE("combiners: +inf, NaN and -inf LSE from every rank give the neutral element",
          "[combine]") {
  MpiCommunicator world(MPI_COMM_WORLD);
  const int n = world.size();
  DcpConfig c = good_config(n);
  c.max_tokens = 3;
  const std::int64_t t = 3, h = c.num_heads, hl = h / n, dv = kMlaVDim;
  // row 0: every rank reports +inf (an empty row in some kernels); row 1: NaN; row 2: valid on
  // rank 0 only (lse = 0 there, -inf elsewhere). o is garbage wherever the state is empty.
  std::vector<float> o(std::size_t(t * h * dv), std::numeric_limits<float>::quiet_NaN());
  std::vector<float> lse(std::size_t(t * h));
  for (std::int64_t hd = 0; hd < h; ++hd) {
    lse[std::size_t(0 * h + hd)] = std::numeric_limits<float>::infinity();
    lse[std::size_t(1 * h + hd)] = std::numeric_limits<float>::quiet_NaN();
    lse[std::size_t(2 * h + hd)] = world.rank() == 0 ? 0.0f : -std::numeric_limits<float>::infinity();
    if (world.rank() == 0)
      for (std::int64_t i = 0; i < dv; ++i) o[std::size_t((2 * h + hd) * dv + i)] = 0.5f;
  }
  std::vector<bfloat16> out(std::size_t(t * hl * dv));
  std::vector<float> out_lse(std::size_t(t * hl));
  CombineArgs a;
  a.o = make_view(static_cast<const float*>(o.data()), {t, h, dv});
  a.lse = make_view(static_cast<const float*>(lse.data()), {t, h});
  a.num_valid_rows = int(t);
  a.out = make_view(out.data(), {t, hl, dv});
  a.out_lse = make_view(out_lse.data(), {t, hl});
  HostExecution exec;

  auto check = [&](float expected_row2_lse) {
    for (std::int64_t row = 0; row < 2; ++row)
      for (std::int64_t i = 0; i < hl * dv; ++i) REQUIRE(out[std::size_t(row * hl * dv + i)].bits == 0);
    for (std::int64_t i = 0; i < 2 * hl; ++i) REQUIRE((std::isinf(out_lse[i]) && out_lse[i] < 0));
    for (std::int64_t i = 0; i < hl * dv; ++i) REQUIRE(out[std::size_t(2 * hl * dv + i)].to_float() == 0.5f);
    for (std::int64_t i = 0; i < hl; ++i) REQUIRE(out_lse[std::size_t(2 * hl + i)] == expected_row2_lse);
  };
  std::vector<std::byte> scratch(AllToAll::scratch_bytes(c));
  SECTION("all-to-all, deterministic") {
    AllToAll::combine<lse_base_e>(world, exec, a, scratch, c, {});
    check(0.0f);
  }
  SECTION("all-gather + reduce-scatter, fast") {
    c.mode = DcpMode::fast;
    std::vector<std::byte> s2(AllGatherReduceScatter::scratch_bytes(c));
    AllGatherReduceScatter::combine<lse_base_e>(world, exec, a, s2, c, {});
    check(0.0f);
  }
  SECTION("base-2 LSE is converted by its tag") {
    for (std::int64_t hd = 0; hd < h; ++hd)
      if (world.rank() == 0) lse[std::size_t(2 * h + hd)] = 1.0f;  // 2^1: ln 2 in natural log
    AllToAll::combine<lse_base_2>(world, exec, a, scratch, c, {});
    check(0.693147182f);
  }
  SECTION("padding rows are neutral whatever their inputs") {
    a.num_valid_rows = 2;
    AllToAll::combine<lse_base_e>(world, exec, a, scratch, c, {});
    for (auto v : out) REQUIRE(v.bits == 0);
    for (auto l : out_lse) REQUIRE((std::isinf(l) && l < 0));
  }
}

TEST_CASE("a configuration that differs across ranks is refused on every rank", "[op][config]") {
  MpiCommunicator world(MPI_COMM_WORLD);
  const int n = world.size();
  DcpConfig c = good_config(n);
  c.num_heads = 8 * n;
  if (world.rank() == 0 && n > 1) c.num_heads = 16 * n;  // valid alone, inconsistent as a group
  if (n == 1) {
    CHECK_NOTHROW(DenseOp(world, c));
    return;
  }
  std::string message;
  try {
    DenseOp op(world, c);
  } catch (const Error& e) {
    message = e.what();
  }
  INFO(message);
  CHECK(message.find("num_heads") != std::string::npos);
  CHECK(message.find("differs across the DCP group") != std::string::npos);
}

/// One decode row of a dense bf16 step on this rank: q with `heads` local heads (H_local unless a
/// test plants a mismatch), a one-page cache and block table, the row attending `bound` tokens.
struct OneRowStep {
  std::int64_t hl;
  std::vector<bfloat16> q, cache, out;
  std::vector<float> out_lse;
  std::vector<std::int32_t> table{0}, req{0};
  std::vector<std::int64_t> bound;
  OneRowStep(const DcpConfig& c, std::int64_t heads, std::int64_t row_bound)
      : hl(c.num_heads / c.group_size),
        q(std::size_t(heads) * kMlaQkDim, bfloat16::from_float(0.25f)),
        cache(64 * kMlaQkDim, bfloat16::from_float(0.5f)),
        out(std::size_t(hl) * kMlaVDim),
        out_lse(std::size_t(hl)),
        bound{row_bound} {}
  DenseOp::Arguments arguments() {
    const std::int64_t heads = std::int64_t(q.size()) / kMlaQkDim;
    DenseOp::Arguments a;
    a.q = make_view(static_cast<const bfloat16*>(q.data()), {1, heads, std::int64_t(kMlaQkDim)});
    a.cache = make_view(static_cast<const bfloat16*>(cache.data()), {64, std::int64_t(kMlaQkDim)});
    a.block_table = make_view(static_cast<const std::int32_t*>(table.data()), {1, 1});
    a.row_request = make_view(static_cast<const std::int32_t*>(req.data()), {1});
    a.row_bound = make_view(static_cast<const std::int64_t*>(bound.data()), {1});
    a.num_valid_rows = 1;
    a.out = make_view(out.data(), {1, hl, std::int64_t(kMlaVDim)});
    a.out_lse = make_view(out_lse.data(), {1, hl});
    return a;
  }
};

/// A failure agreed by the group: the culprit raised its own error (containing `own`), every
/// other rank "rank <culprit> <others>".
void check_group_error(const std::string& message, int rank, int culprit, const std::string& own,
                       const std::string& others) {
  INFO(message);
  if (rank == culprit)
    CHECK(message.find(own) != std::string::npos);
  else
    CHECK(message.find("rank " + std::to_string(culprit) + " " + others) != std::string::npos);
}

/// The what() of the Error forward() raises, or "" when it returns.
std::string forward_error(DenseOp& op, const DenseOp::Arguments& a, std::vector<std::byte>& ws) {
  try {
    op.forward(a, ws);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST_CASE("validate_collectively: one rank's bad input raises on every rank, naming it",
          "[op][config]") {
  MpiCommunicator world(MPI_COMM_WORLD);
  const int n = world.size(), culprit = n - 1;
  DcpConfig c = good_config(n);
  c.validate_collectively = true;
  DenseOp op(world, c);
  // the culprit passes q with one head too many; everyone else is fine
  const std::int64_t hl = c.num_heads / n;
  OneRowStep step(c, world.rank() == culprit ? hl + 1 : hl, 1);
  std::vector<std::byte> ws(DenseOp::workspace_bytes(c));
  check_group_error(forward_error(op, step.arguments(), ws), world.rank(), culprit, "q must be",
                    "of the DCP group refused");
  // the group is still usable afterwards: a good call on every rank runs
  OneRowStep good(c, hl, 1);
  CHECK(forward_error(op, good.arguments(), ws).empty());
}

TEST_CASE("validate_collectively: a rank whose attention throws mid-step raises on every rank",
          "[op][config]") {
  MpiCommunicator world(MPI_COMM_WORLD);
  const int n = world.size(), culprit = n - 1;
  DcpConfig c = good_config(n);
  c.validate_collectively = true;
  DenseOp op(world, c);
  // Every rank owns one of the row's n tokens (local position 0, page 0). The culprit's block
  // table points page 0 outside its cache: its inputs pass the extent checks, and its attention
  // kernel throws after the query gather (a collective) has run.
  OneRowStep step(c, c.num_heads / n, n);
  if (world.rank() == culprit) step.table[0] = 5;
  std::vector<std::byte> ws(DenseOp::workspace_bytes(c));
  check_group_error(forward_error(op, step.arguments(), ws), world.rank(), culprit,
                    "outside the cache", "of the DCP group failed in the attention stage");
  // the group is still in step: a good call on every rank runs and attends all n tokens
  step.table[0] = 0;
  CHECK(forward_error(op, step.arguments(), ws).empty());
  for (float l : step.out_lse) CHECK(std::isfinite(l));
}

TEST_CASE("split layout: fast mode's dense splits take whole pages, the rest the ownership's",
          "[op][config]") {
  using SparseOp = DcpAttention<RoundRobinOwnership, DirectWorkspace, SparseMla<CacheFormat::bf16>,
                                AllToAll, MpiCommunicator, HostExecution>;
  DcpConfig c = good_config(2);
  c.page_size = 64;
  c.interleave = 16;
  // Deterministic mode: local split j must be virtual shard j N + r, so the ownership's interleave.
  c.mode = DcpMode::deterministic;
  CHECK(DenseOp::split_interleave(c) == 16);
  CHECK(SparseOp::split_interleave(c) == 16);
  // Fast mode: a dense split reads whole pages; the sparse kernel maps positions through the
  // ownership and must keep its interleave.
  c.mode = DcpMode::fast;
  CHECK(DenseOp::split_interleave(c) == 64);
  CHECK(SparseOp::split_interleave(c) == 16);
}
