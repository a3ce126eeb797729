// SPDX-License-Identifier: Apache-2.0
// The worked examples of docs/policies.md, compiled and run: a user-written contiguous-block
// ownership and a user-written communicator wrapping an engine's own group, in the operator.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "support/catch.hpp"
#include "support/mpi_env.hpp"

#include "dcpattn/comm/mpi.hpp"
#include "dcpattn/dcpattn.hpp"

using namespace dcpattn;

namespace {

// --- docs/policies.md: "Worked example: contiguous blocks" ---
struct ContiguousBlocks {
  int n;      // ranks
  int block;  // tokens per rank before moving on

  DCPATTN_HOST_DEVICE int group_size() const { return n; }
  DCPATTN_HOST_DEVICE int owner(std::int64_t t) const { return int((t / block) % n); }
  DCPATTN_HOST_DEVICE std::int64_t local_position(std::int64_t t) const {
    return (t / (std::int64_t(n) * block)) * block + t % block;
  }
  DCPATTN_HOST_DEVICE std::int64_t global_position(std::int64_t p, int r) const {
    return ((p / block) * n + r) * block + p % block;
  }
  DCPATTN_HOST_DEVICE std::int64_t local_length(std::int64_t len, int r) const {
    const std::int64_t span = std::int64_t(n) * block;
    const std::int64_t tail =
        std::clamp<std::int64_t>(len % span - std::int64_t(r) * block, 0, block);
    return (len / span) * block + tail;
  }
};
static_assert(SlotOwnership<ContiguousBlocks>);
static_assert(!VirtualShardedOwnership<ContiguousBlocks>);

// --- docs/policies.md: "Worked example: a communicator over an engine's own process group" ---
// EngineGroup stands for an engine's collectives; here it is backed by MPI byte collectives.
class EngineGroup {
 public:
  explicit EngineGroup(MPI_Comm c) : c_(c) {}
  int rank() const { int r; MPI_Comm_rank(c_, &r); return r; }
  int size() const { int n; MPI_Comm_size(c_, &n); return n; }
  void all_gather_bytes(const void* s, void* r, std::size_t b) {
    MPI_Allgather(s, int(b), MPI_BYTE, r, int(b), MPI_BYTE, c_);
  }
  void all_to_all_bytes(const void* s, void* r, std::size_t b) {
    MPI_Alltoall(s, int(b), MPI_BYTE, r, int(b), MPI_BYTE, c_);
  }
  void reduce_scatter_f32(const float* s, float* r, std::size_t n) {
    MPI_Reduce_scatter_block(s, r, int(n), MPI_FLOAT, MPI_SUM, c_);
  }
  void barrier() { MPI_Barrier(c_); }

 private:
  MPI_Comm c_;
};

class EngineCommunicator {
 public:
  using stream_type = dcpattn::HostStream;
  explicit EngineCommunicator(EngineGroup& g) : g_(&g) { dcpattn::set_error_rank(g.rank()); }
  int rank() const { return g_->rank(); }
  int size() const { return g_->size(); }
  template <class T> void all_gather(const T* s, T* r, std::size_t n, stream_type = {}) {
    g_->all_gather_bytes(s, r, n * sizeof(T));
  }
  template <class T> void all_to_all(const T* s, T* r, std::size_t n, stream_type = {}) {
    g_->all_to_all_bytes(s, r, n * sizeof(T));
  }
  void reduce_scatter_sum(const float* s, float* r, std::size_t n, stream_type = {}) {
    g_->reduce_scatter_f32(s, r, n);
  }
  void barrier(stream_type = {}) { g_->barrier(); }

 private:
  EngineGroup* g_;
};
static_assert(dcpattn::Communicator<EngineCommunicator>, DCPATTN_COMMUNICATOR_MESSAGE);

constexpr int kHeads = 4;
constexpr int kBlock = 64;  // page size == block: a page never straddles two ranks

}  // namespace

TEST_CASE("custom ownership and communicator: fast-mode DCP matches plain attention",
          "[op][custom]") {
  EngineGroup group(MPI_COMM_WORLD);
  EngineCommunicator comm(group);
  const int n = comm.size(), rank = comm.rank();
  const ContiguousBlocks own{n, kBlock};

  // one request of L tokens (spanning several blocks per rank), two decode rows
  const std::int64_t len = 5 * kBlock + 17;
  std::vector<float> keys(std::size_t(len) * kMlaQkDim);
  std::vector<bfloat16> q(std::size_t(2) * kHeads * kMlaQkDim);
  std::uint32_t state = 12345u;
  auto next = [&] {
    state = state * 1664525u + 1013904223u;
    return float(int(state >> 9) % 2001 - 1000) / 1000.0f;
  };
  for (auto& k : keys) k = round_to_bf16(next());
  for (auto& x : q) x = bfloat16::from_float(next());
  const std::vector<std::int64_t> bound{len - 1, len};
  const std::vector<std::int32_t> req{0, 0};

  // this rank's cache: pages in order, slot = page * B + p mod B
  const std::int64_t local = own.local_length(len, rank);
  const std::int64_t pages = std::max<std::int64_t>((local + kBlock - 1) / kBlock, 1);
  std::vector<std::int32_t> table(static_cast<std::size_t>(pages));
  for (std::int64_t p = 0; p < pages; ++p) table[std::size_t(p)] = std::int32_t(pages - 1 - p);
  std::vector<bfloat16> cache(std::size_t(pages * kBlock) * kMlaQkDim);
  for (std::int64_t t = 0; t < len; ++t) {
    const std::int64_t slot = paged_slot(own, t, rank, table.data(), kBlock);
    if (slot < 0) continue;
    for (int i = 0; i < kMlaQkDim; ++i)
      cache[std::size_t(slot) * kMlaQkDim + i] =
          bfloat16::from_float(keys[std::size_t(t) * kMlaQkDim + i]);
  }

  using Op = DcpAttention<ContiguousBlocks, AllGather, DenseMla<CacheFormat::bf16>, AllToAll,
                          EngineCommunicator, HostExecution>;
  DcpConfig cfg;
  cfg.group_size = n;
  cfg.num_heads = kHeads * n;  // each rank projects kHeads heads; the group has kHeads * n
  cfg.page_size = kBlock;
  cfg.interleave = kBlock;
  cfg.max_tokens = 2;
  cfg.softmax_scale = 0.05f;
  cfg.mode = DcpMode::fast;
  REQUIRE(Op::can_implement(cfg).ok());
  cfg.mode = DcpMode::deterministic;
  CHECK_FALSE(Op::can_implement(cfg).ok());  // no virtual shards: deterministic mode refused
  CHECK(Op::can_implement(cfg).message().find("VirtualShardedOwnership") != std::string::npos);
  cfg.mode = DcpMode::fast;
  Op op(comm, cfg, own);

  // the group's q: rank r's heads are heads [r kHeads, (r+1) kHeads); every rank holds q for its own
  std::vector<bfloat16> q_local(std::size_t(2) * kHeads * kMlaQkDim);
  for (std::int64_t t = 0; t < 2; ++t)
    for (int h = 0; h < kHeads; ++h)
      for (int d = 0; d < kMlaQkDim; ++d)  // head h of rank r uses q row (h + r) mod kHeads
        q_local[std::size_t((t * kHeads + h) * kMlaQkDim + d)] =
            q[std::size_t((t * kHeads + (h + rank) % kHeads) * kMlaQkDim + d)];
  std::vector<bfloat16> out(std::size_t(2) * kHeads * kMlaVDim);
  std::vector<float> out_lse(std::size_t(2) * kHeads);
  Op::Arguments a;
  a.q = make_view(static_cast<const bfloat16*>(q_local.data()), {2, kHeads, std::int64_t(kMlaQkDim)});
  a.cache = make_view(static_cast<const bfloat16*>(cache.data()), {pages * kBlock, std::int64_t(kMlaQkDim)});
  a.block_table = make_view(static_cast<const std::int32_t*>(table.data()), {1, pages});
  a.row_request = make_view(req.data(), {2});
  a.row_bound = make_view(bound.data(), {2});
  a.num_valid_rows = 2;
  a.out = make_view(out.data(), {2, kHeads, std::int64_t(kMlaVDim)});
  a.out_lse = make_view(out_lse.data(), {2, kHeads});
  std::vector<std::byte> ws(Op::workspace_bytes(cfg));
  op.forward(a, ws);

  // plain double attention of this rank's heads over the whole request
  double worst = 0;
  for (std::int64_t t = 0; t < 2; ++t)
    for (int h = 0; h < kHeads; ++h) {
      const bfloat16* qr = &q_local[std::size_t((t * kHeads + h) * kMlaQkDim)];
      std::vector<double> s(std::size_t(bound[std::size_t(t)]));
      double m = -1e300;
      for (std::int64_t k = 0; k < bound[std::size_t(t)]; ++k) {
        double d = 0;
        for (int i = 0; i < kMlaQkDim; ++i) d += double(qr[i].to_float()) * keys[std::size_t(k) * kMlaQkDim + i];
        s[std::size_t(k)] = d * cfg.softmax_scale;
        m = std::max(m, s[std::size_t(k)]);
      }
      double l = 0;
      for (double x : s) l += std::exp(x - m);
      worst = std::max(worst, std::fabs(out_lse[std::size_t(t * kHeads + h)] - (m + std::log(l))) / 1e-4);
      for (int i = 0; i < kMlaVDim; ++i) {
        double o = 0;
        for (std::int64_t k = 0; k < bound[std::size_t(t)]; ++k)
          o += std::exp(s[std::size_t(k)] - m) / l * keys[std::size_t(k) * kMlaQkDim + i];
        const double got = out[std::size_t((t * kHeads + h) * kMlaVDim + i)].to_float();
        worst = std::max(worst, std::fabs(got - o) / (4e-3 + 8e-3 * std::fabs(o)));  // bf16 output
      }
    }
  CHECK(worst <= 1.0);
}
