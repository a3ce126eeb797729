// SPDX-License-Identifier: Apache-2.0
// One DeepSeek-V3.2-shaped sparse MLA decode step under DCP on the host backend.
//
// Every rank of MPI_COMM_WORLD is one rank of the DCP group. Each rank:
//   1. fills its own shard of an fp8 "ds_mla" paged cache by running the fused prologue over the
//      context of 4 requests (slots of tokens it does not own are -1: nothing written);
//   2. runs the prologue of the decode step (query RMSNorm on every row, new tokens' KV written by
//      their owners, top-k rows reset), picks a seeded top-2048 list per row (the indexer's job),
//      and projects its H / N query heads;
//   3. runs DcpAttention (direct-workspace gather, sparse kernel, all-to-all combine,
//      deterministic mode) and keeps its heads of the output.
// Rank 0 then repeats the whole step alone (N = 1) and compares: the outputs must be bitwise
// identical whatever N is.
//   usage: mpirun -np N dcp_decode        (N in 1, 2, 4, 8)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include <mpi.h>

#include "dcpattn/comm/mpi.hpp"
#include "dcpattn/dcpattn.hpp"

namespace {
using namespace dcpattn;
constexpr CacheFormat kFormat = CacheFormat::fp8_ds_mla;
constexpr int kHeads = 128;         // DeepSeek-V3.2 attention heads
constexpr int kTopk = 2048;
constexpr int kPageSize = 64;
constexpr int kProjRank = 16;       // rank of the stand-in query projection
constexpr std::uint32_t kSeed = 2026;
const std::vector<std::int64_t> kContext = {4000, 2500, 700, 6100};  // tokens before this step
const std::vector<int> kRowsPerRequest = {1, 1, 2, 1};  // request 2 decodes 2 tokens (MTP)
constexpr int kPaddingRows = 1;                             // a CUDA-graph style padded batch

std::vector<bfloat16> random_bf16(std::mt19937& rng, std::size_t n, float stddev) {
  std::normal_distribution<float> d(0.0f, stddev);
  std::vector<bfloat16> v(n);
  for (auto& x : v) x = bfloat16::from_float(d(rng));
  return v;
}

/// Model weights and the decode batch: identical on every rank (same seed).
struct World {
  std::vector<bfloat16> q_norm_w, kv_norm_w;
  std::vector<float> cos_sin;                   // (max_pos, 64)
  std::vector<bfloat16> proj_a, proj_b;         // q projection (1536 x 16), (H, 16, 576)
  std::vector<std::vector<bfloat16>> kv_c, k_pe;  // per request, all tokens incl. new ones
  std::vector<bfloat16> q_c;                    // (T, 1536) decode rows
  std::vector<std::int32_t> row_request;
  std::vector<std::int64_t> row_pos;            // position of each decode row's token
  std::vector<std::int32_t> topk;               // (T, 2048), ascending, -1 padded
  int valid_rows = 0;

  World() {
    std::mt19937 rng(kSeed);
    q_norm_w = random_bf16(rng, kMlaQLoraRank, 0.1f);
    for (auto& w : q_norm_w) w = bfloat16::from_float(1.0f + w.to_float());
    kv_norm_w = random_bf16(rng, kMlaLatentDim, 0.1f);
    for (auto& w : kv_norm_w) w = bfloat16::from_float(1.0f + w.to_float());
    const std::int64_t max_pos = 8192;
    cos_sin.resize(std::size_t(max_pos) * kMlaRopeDim);
    for (std::int64_t p = 0; p < max_pos; ++p)
      for (int i = 0; i < kMlaRopeDim / 2; ++i) {
        const auto cs = rope_cos_sin(p, i, kMlaRopeDim, 10000.0f);
        cos_sin[std::size_t(p * kMlaRopeDim + i)] = cs.cos_v;
        cos_sin[std::size_t(p * kMlaRopeDim + kMlaRopeDim / 2 + i)] = cs.sin_v;
      }
    proj_a = random_bf16(rng, std::size_t(kMlaQLoraRank) * kProjRank, 1.0f / 39.0f);
    proj_b = random_bf16(rng, std::size_t(kHeads) * kProjRank * kMlaQkDim, 0.25f);
    for (std::size_t r = 0; r < kContext.size(); ++r) {
      const std::size_t len = std::size_t(kContext[r] + kRowsPerRequest[r]);
      kv_c.push_back(random_bf16(rng, len * kMlaLatentDim, 1.0f));
      k_pe.push_back(random_bf16(rng, len * kMlaRopeDim, 1.0f));
      for (int k = 0; k < kRowsPerRequest[r]; ++k) {
        row_request.push_back(std::int32_t(r));
        row_pos.push_back(kContext[r] + k);
      }
    }
    valid_rows = int(row_request.size());
    for (int p = 0; p < kPaddingRows; ++p) {
      row_request.push_back(0);
      row_pos.push_back(0);
    }
    q_c = random_bf16(rng, row_request.size() * kMlaQLoraRank, 1.0f);
    topk.assign(row_request.size() * kTopk, -1);
    for (int t = 0; t < valid_rows; ++t) {
      const std::int64_t bound = row_pos[std::size_t(t)] + 1;  // causal: itself included
      std::vector<std::int32_t> cand(static_cast<std::size_t>(bound));
      std::iota(cand.begin(), cand.end(), 0);
      std::shuffle(cand.begin(), cand.end(), rng);
      cand.resize(std::min<std::size_t>(cand.size(), kTopk));
      std::sort(cand.begin(), cand.end());
      std::copy(cand.begin(), cand.end(), topk.begin() + std::ptrdiff_t(t) * kTopk);
    }
  }
  std::int64_t rows() const { return std::int64_t(row_request.size()); }
};

/// One rank's view of the step: its cache shard, block table, and the output of its heads.
struct RankResult {
  std::vector<bfloat16> out;  // (T, H_local, 512)
  std::vector<std::int64_t> shard_tokens;  // per request, tokens this rank stores
  double seconds = 0;
};

template <class Comm>
RankResult decode_step(const World& w, Comm& comm) {
  const int n = comm.size(), rank = comm.rank();
  const RoundRobinOwnership own(n, /*interleave=*/1);
  RankResult res;
  const auto t0 = std::chrono::steady_clock::now();

  // local pages per request, handed out from one pool
  std::vector<std::int64_t> pages;
  std::int64_t max_pages = 1, total_pages = 0;
  for (std::size_t r = 0; r < kContext.size(); ++r) {
    const std::int64_t len = kContext[r] + kRowsPerRequest[r];
    res.shard_tokens.push_back(own.local_length(len, rank));
    pages.push_back((res.shard_tokens.back() + kPageSize - 1) / kPageSize);
    max_pages = std::max(max_pages, pages.back());
    total_pages += pages.back();
  }
  std::vector<std::int32_t> table(kContext.size() * std::size_t(max_pages), 0);
  std::int32_t next = 0;
  for (std::size_t r = 0; r < kContext.size(); ++r)
    for (std::int64_t p = 0; p < pages[r]; ++p) table[r * std::size_t(max_pages) + std::size_t(p)] = next++;
  const std::int64_t num_slots = std::max<std::int64_t>(total_pages, 1) * kPageSize;
  std::vector<std::uint8_t> cache(std::size_t(num_slots) * DsMlaFp8Entry::bytes, 0);
  auto cache_out = make_view(cache.data(), {num_slots, std::int64_t(DsMlaFp8Entry::bytes)});

  // common prologue arguments
  // (a padding row has no cache slot on any rank: its slot is -1 everywhere)
  auto run_prologue = [&](std::size_t req, const std::vector<std::int64_t>& positions,
                          const bfloat16* q_c, bfloat16* q_out, std::int32_t* topk_rows,
                          bool padding = false) {
    const std::int64_t t = std::int64_t(positions.size());
    std::vector<std::int64_t> slots(positions.size());
    const int* row = table.data() + req * std::size_t(max_pages);
    for (std::size_t i = 0; i < positions.size(); ++i)
      slots[i] = padding ? -1 : paged_slot(own, positions[i], rank, row, kPageSize);
    std::vector<bfloat16> kv(std::size_t(t) * kMlaLatentDim), pe(std::size_t(t) * kMlaRopeDim);
    for (std::size_t i = 0; i < positions.size(); ++i) {
      std::memcpy(&kv[i * kMlaLatentDim], &w.kv_c[req][std::size_t(positions[i]) * kMlaLatentDim],
                  kMlaLatentDim * 2);
      std::memcpy(&pe[i * kMlaRopeDim], &w.k_pe[req][std::size_t(positions[i]) * kMlaRopeDim],
                  kMlaRopeDim * 2);
    }
    std::vector<bfloat16> dummy_q(std::size_t(t) * kMlaQLoraRank);
    PrologueArgs<mla_cache_out_view_t<kFormat>> a;
    a.q_c = make_view(q_c ? q_c : static_cast<const bfloat16*>(dummy_q.data()), {t, std::int64_t(kMlaQLoraRank)});
    a.q_c_out = make_view(q_out ? q_out : dummy_q.data(), {t, std::int64_t(kMlaQLoraRank)});
    a.q_norm_weight = make_view(w.q_norm_w.data(), {std::int64_t(kMlaQLoraRank)});
    a.kv_c = make_view(static_cast<const bfloat16*>(kv.data()), {t, std::int64_t(kMlaLatentDim)});
    a.kv_norm_weight = make_view(w.kv_norm_w.data(), {std::int64_t(kMlaLatentDim)});
    a.k_pe = make_view(static_cast<const bfloat16*>(pe.data()), {t, std::int64_t(kMlaRopeDim)});
    a.positions = make_view(positions.data(), {t});
    a.cos_sin_cache = make_view(w.cos_sin.data(), {std::int64_t(w.cos_sin.size() / kMlaRopeDim), std::int64_t(kMlaRopeDim)});
    a.slot_mapping = make_view(static_cast<const std::int64_t*>(slots.data()), {t});
    a.kv_cache = cache_out;
    if (topk_rows) a.topk_indices = make_view(topk_rows, {t, std::int64_t(kTopk)});
    host::fused_prologue(a);
  };

  // 1. context: every rank runs the prologue over every context token; only owners write
  for (std::size_t r = 0; r < kContext.size(); ++r) {
    std::vector<std::int64_t> pos(std::size_t(kContext[r]));
    std::iota(pos.begin(), pos.end(), 0);
    run_prologue(r, pos, nullptr, nullptr, nullptr);
  }

  // 2. the decode step's prologue, row by row (each row's token belongs to its request)
  const std::int64_t t = w.rows();
  std::vector<bfloat16> q_c_norm(w.q_c.size());
  std::vector<std::int32_t> topk(w.topk.size(), 7);  // stale values: the prologue resets them
  for (std::int64_t row = 0; row < t; ++row) {
    const std::size_t req = std::size_t(w.row_request[std::size_t(row)]);
    const bool padding = row >= w.valid_rows;
    run_prologue(req, {w.row_pos[std::size_t(row)]}, &w.q_c[std::size_t(row) * kMlaQLoraRank],
                 &q_c_norm[std::size_t(row) * kMlaQLoraRank], &topk[std::size_t(row) * kTopk],
                 padding);
  }
  for (std::size_t i = 0; i < std::size_t(w.valid_rows) * kTopk; ++i) topk[i] = w.topk[i];  // "indexer"

  // query projection of this rank's heads: q = (q_c_norm A) B_h, (T, H_local, 576)
  const int hl = kHeads / n;
  std::vector<bfloat16> q(std::size_t(t) * hl * kMlaQkDim);
  for (std::int64_t row = 0; row < t; ++row) {
    float low[kProjRank] = {};
    for (int i = 0; i < kMlaQLoraRank; ++i)
      for (int k = 0; k < kProjRank; ++k)
        low[k] += q_c_norm[std::size_t(row) * kMlaQLoraRank + i].to_float() *
                  w.proj_a[std::size_t(i) * kProjRank + k].to_float();
    for (int hh = 0; hh < hl; ++hh) {
      const int h = rank * hl + hh;
      for (int d = 0; d < kMlaQkDim; ++d) {
        float acc = 0;
        for (int k = 0; k < kProjRank; ++k)
          acc += low[k] * w.proj_b[(std::size_t(h) * kProjRank + k) * kMlaQkDim + d].to_float();
        q[(std::size_t(row) * hl + hh) * kMlaQkDim + d] = bfloat16::from_float(acc);
      }
    }
  }

  // 3. DCP attention
  using Op = DcpAttention<RoundRobinOwnership, DirectWorkspace, SparseMla<kFormat>, AllToAll,
                          Comm, HostExecution>;
  DcpConfig cfg;
  cfg.group_size = n;
  cfg.num_heads = kHeads;
  cfg.page_size = kPageSize;
  cfg.interleave = 1;
  cfg.max_tokens = int(t);
  cfg.gather_capacity = 16;
  cfg.topk = kTopk;
  cfg.softmax_scale = 1.0f / std::sqrt(192.0f);
  cfg.mode = DcpMode::deterministic;
  Op op(comm, cfg);
  std::vector<std::int64_t> bound(static_cast<std::size_t>(t));
  for (std::int64_t row = 0; row < t; ++row) bound[std::size_t(row)] = w.row_pos[std::size_t(row)] + 1;
  res.out.resize(std::size_t(t) * hl * kMlaVDim);
  typename Op::Arguments a;
  a.q = make_view(static_cast<const bfloat16*>(q.data()), {t, std::int64_t(hl), std::int64_t(kMlaQkDim)});
  a.cache = make_view(static_cast<const std::uint8_t*>(cache.data()), {num_slots, std::int64_t(DsMlaFp8Entry::bytes)});
  a.block_table = make_view(static_cast<const std::int32_t*>(table.data()), {std::int64_t(kContext.size()), max_pages});
  a.row_request = make_view(w.row_request.data(), {t});
  a.row_bound = make_view(static_cast<const std::int64_t*>(bound.data()), {t});
  a.topk = make_view(static_cast<const std::int32_t*>(topk.data()), {t, std::int64_t(kTopk)});
  a.num_valid_rows = w.valid_rows;
  a.out = make_view(res.out.data(), {t, std::int64_t(hl), std::int64_t(kMlaVDim)});
  std::vector<std::byte> ws(Op::workspace_bytes(cfg));
  op.forward(a, ws);
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return res;
}
}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rc = 0;
  try {
    const World w;
    MpiCommunicator comm(MPI_COMM_WORLD);
    const int n = comm.size(), rank = comm.rank();
    const RankResult mine = decode_step(w, comm);

    // shard sizes and the assembled output (T, H, 512) on rank 0
    const std::int64_t t = w.rows();
    const int hl = kHeads / n;
    std::vector<std::int64_t> shards(std::size_t(n) * kContext.size());
    MPI_Gather(mine.shard_tokens.data(), int(kContext.size()), MPI_INT64_T, shards.data(),
               int(kContext.size()), MPI_INT64_T, 0, MPI_COMM_WORLD);
    std::vector<bfloat16> gathered(std::size_t(n) * mine.out.size());
    MPI_Gather(mine.out.data(), int(mine.out.size() * 2), MPI_BYTE, gathered.data(),
               int(mine.out.size() * 2), MPI_BYTE, 0, MPI_COMM_WORLD);
    if (rank == 0) {
      std::printf("dcpattn DCP decode demo: DeepSeek-V3.2 shapes (H = %d, q/k 576, v 512, fp8 ds_mla "
                  "cache, page %d, top-%d sparse), N = %d rank(s), deterministic mode\n",
                  kHeads, kPageSize, kTopk, n);
      std::printf("batch: %lld rows (%d valid: 4 requests, one with 2 MTP rows; %d padding)\n",
                  (long long)t, w.valid_rows, kPaddingRows);
      for (int r = 0; r < n; ++r) {
        std::printf("  rank %d shard (tokens per request):", r);
        for (std::size_t q = 0; q < kContext.size(); ++q)
          std::printf(" %6lld", (long long)shards[std::size_t(r) * kContext.size() + q]);
        std::printf("\n");
      }
      std::vector<bfloat16> dcp(std::size_t(t) * kHeads * kMlaVDim);
      for (int src = 0; src < n; ++src)
        for (std::int64_t row = 0; row < t; ++row)
          std::memcpy(&dcp[(std::size_t(row) * kHeads + std::size_t(src) * hl) * kMlaVDim],
                      &gathered[(std::size_t(src) * t + std::size_t(row)) * hl * kMlaVDim],
                      std::size_t(hl) * kMlaVDim * 2);
      SelfCommunicator self;
      const RankResult single = decode_step(w, self);
      double max_diff = 0, checksum = 0;
      std::uint64_t hash = 1469598103934665603ull;  // FNV-1a over the output bits
      for (std::size_t i = 0; i < dcp.size(); ++i) {
        max_diff = std::max(max_diff, double(std::fabs(dcp[i].to_float() - single.out[i].to_float())));
        checksum += dcp[i].to_float();
        hash = (hash ^ dcp[i].bits) * 1099511628211ull;
      }
      const bool identical = std::memcmp(dcp.data(), single.out.data(), dcp.size() * 2) == 0;
      std::printf("N = %d step: %.2f s on rank 0; N = 1 step: %.2f s\n", n, mine.seconds, single.seconds);
      std::printf("max |diff| vs N = 1: %g\n", max_diff);
      std::printf("checksum: sum = %.6f, fnv1a = %016llx\n", checksum, (unsigned long long)hash);
      std::printf("bitwise identical to N = 1: %s\n", identical ? "yes" : "no");
      rc = identical ? 0 : 1;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    rc = 2;
  }
  MPI_Bcast(&rc, 1, MPI_INT, 0, MPI_COMM_WORLD);
  MPI_Finalize();
  return rc;
}
