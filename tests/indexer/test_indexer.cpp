// SPDX-License-Identifier: Apache-2.0
// The lightning indexer and its exact distributed top-k on the host, under mpirun with N ranks:
//   - scores of every rank's shard equal a plainly written scorer over the stored key bytes
//     (bitwise, bf16 and fp8 queries) and a double-precision one within tolerance;
//   - local top-k lists are the best k of each rank's own keys;
//   - the distributed top-k equals a full sort of all keys of the row (and a single-rank run) for
//     k in {1, 7, 64, 2048}: ties, NaN/inf/-0 scores, rows shorter than k, ranks with no keys,
//     padding rows;
//   - the sparse decode step (fused prologue -> indexer -> distributed top-k -> sparse attention
//     -> combine) is bitwise identical for N ranks and for one rank, in deterministic mode.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "support/catch.hpp"
#include "support/mpi_env.hpp"

#include "dcpattn/comm/mpi.hpp"
#include "dcpattn/dcpattn.hpp"
#include "dcpattn/indexer/indexer.hpp"
#include "indexer/indexer_fixtures.hpp"

using namespace dcpattn;
using namespace dcpattn::test;

namespace {

/// Bitwise float equality (NaN payloads included).
bool same_bits(float a, float b) {
  return std::memcmp(&a, &b, 4) == 0;
}

/// Runs host::distributed_topk on `comm` over the global scores and returns (T, k) indices.
template <class Comm>
std::vector<std::int32_t> run_distributed_topk(Comm& comm, const GlobalScores& g, int k,
                                               int interleave) {
  const RoundRobinOwnership own(comm.size(), interleave);
  std::int64_t columns = 0;
  const std::vector<float> local = local_scores(g, own, comm.rank(), columns);
  const std::int64_t t = g.rows();
  std::vector<std::int32_t> out(std::size_t(t * k), 12345);
  std::vector<std::byte> ws(distributed_topk_workspace_bytes(t, k, comm.size()));
  host::distributed_topk(comm, own, make_view(local.data(), {t, columns}),
                         make_view(g.bound.data(), {t}), g.num_valid_rows,
                         make_view(out.data(), {t, std::int64_t(k)}), ws);
  return out;
}

/// First row where two (T, k) results differ, -1 when equal.
std::int64_t first_diff_row(const std::vector<std::int32_t>& a, const std::vector<std::int32_t>& b,
                            int k) {
  if (a.size() != b.size()) return 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return std::int64_t(i / std::size_t(k));
  return -1;
}

}  // namespace

// ---- the order ----------------------------------------------------------------------------------

TEST_CASE("top-k order: NaN ranks as -inf, -0 as +0, ties by position", "[indexer][order]") {
  constexpr float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  CHECK(topk_canonical_score(nan) == -inf);
  CHECK(topk_canonical_score(-nan) == -inf);
  CHECK_FALSE(std::signbit(topk_canonical_score(-0.0f)));
  CHECK(topk_before(1.0f, 5, 0.5f, 1));
  CHECK(topk_before(1.0f, 1, 1.0f, 5));
  CHECK(topk_before(-0.0f, 1, 0.0f, 2));
  CHECK(topk_before(0.0f, 1, -0.0f, 2));
  CHECK(topk_before(-inf, 3, nan, 4));
  CHECK(topk_before(nan, 3, -inf, 4));
  CHECK(topk_before(-1e30f, 9, nan, 0));
  // the 64-bit key agrees with the comparator
  const float values[] = {nan, -inf, -1.0f, -0.0f, 0.0f, 1e-45f, 1.0f, inf};
  for (float a : values)
    for (float b : values)
      for (std::uint32_t pa : {0u, 7u})
        for (std::uint32_t pb : {0u, 7u}) {
          if (pa == pb && !same_bits(a, b)) continue;  // one position, one score
          CHECK((topk_order_key(a, pa) > topk_order_key(b, pb)) == topk_before(a, pa, b, pb));
        }
}

TEST_CASE("top-k: the worked example of docs/semantics.md", "[indexer][order]") {
  // N = 2, I = 1, k = 2, one row of bound 5, scores [0.5, 2, NaN, 2, 2]
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const RoundRobinOwnership own(2, 1);
  const std::vector<std::vector<float>> local = {{0.5f, nan, 2.0f}, {2.0f, 2.0f}};
  const std::vector<std::int64_t> bound = {5};
  std::vector<TopkCandidate> gathered(4);
  for (int r = 0; r < 2; ++r)
    host::local_topk(
        own, r,
        make_view(local[std::size_t(r)].data(), {1, std::int64_t(local[std::size_t(r)].size())}),
        make_view(bound.data(), {1}), 1, make_view(gathered.data() + 2 * r, {1, 2}));
  const std::vector<std::pair<float, int>> sent = {{0.5f, 0}, {2.0f, 4}, {2.0f, 1}, {2.0f, 3}};
  for (std::size_t i = 0; i < 4; ++i) {
    CHECK(gathered[i].score == sent[i].first);
    CHECK(gathered[i].position == sent[i].second);
  }
  std::vector<std::int32_t> out(2);
  host::merge_topk(make_view(static_cast<const TopkCandidate*>(gathered.data()), {2, 2}), 2, 1,
                   make_view(out.data(), {1, 2}));
  CHECK(out == std::vector<std::int32_t>{1, 3});
}

// ---- scoring ------------------------------------------------------------------------------------

namespace {

/// Scores a batch on every rank and checks its shard against the plain scorer at the global
/// positions it owns; untouched entries keep their sentinel.
template <bool Fp8>
void check_scores(int interleave, int page_size, int duplicates) {
  MpiCommunicator world(MPI_COMM_WORLD);
  const int n = world.size(), rank = world.rank();
  const RoundRobinOwnership own(n, interleave);
  const IndexerBatch b = make_indexer_batch(21u + unsigned(interleave), {0, 1, 3, 70, 400},
                                            {1, 1, 2, 3, 1}, 2, kIndexerNumHeads);
  const GlobalKeys keys = make_global_keys(5u, b.request_length, duplicates);
  const PagedShard shard = make_paged_shard(b.request_length, own, rank, page_size);
  const std::vector<std::uint8_t> cache =
      build_indexer_cache(keys, b.request_length, own, rank, shard);
  const GlobalScores ref = plain_global_scores(b, keys, Fp8);

  const std::int64_t t = b.rows(), h = b.heads;
  const std::int64_t columns = std::max<std::int64_t>(own.local_length(b.max_bound(), 0), 1) + 3;
  constexpr float sentinel = -12345.0f;
  std::vector<float> scores(std::size_t(t * columns), sentinel);
  using QElem = std::conditional_t<Fp8, std::uint8_t, bfloat16>;
  IndexerArgs<QElem> a;
  if constexpr (Fp8) {
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
  host::indexer_scores(own, rank, a, make_view(scores.data(), {t, columns}));

  std::vector<float> q, qs, w;
  bool bitwise = true, untouched = true;
  double worst = 0.0;
  for (std::int64_t row = 0; row < t; ++row) {
    const std::int64_t len =
        row < b.num_valid_rows ? own.local_length(b.row_bound[std::size_t(row)], rank) : 0;
    if (row < b.num_valid_rows) row_inputs(b, row, Fp8, q, qs, w);
    for (std::int64_t p = 0; p < columns; ++p) {
      const float got = scores[std::size_t(row * columns + p)];
      if (p >= len) {
        untouched = untouched && got == sentinel;
        continue;
      }
      const std::int64_t g = own.global_position(p, rank);
      bitwise = bitwise && same_bits(got, ref.row(row)[g]);
      const auto& req = keys.bytes[std::size_t(b.row_request[std::size_t(row)])];
      const std::vector<std::uint8_t> one(req.begin() + g * kIdxBytesPerToken,
                                          req.begin() + (g + 1) * kIdxBytesPerToken);
      const std::int32_t identity = 0;
      double dref = 0, mag = 0;
      double_score(q, qs, w, read_plain_key(one, 1, &identity, 0), dref, mag);
      // 128 + 64 fp32 roundings of partial sums bounded by the magnitude: 2^-24 * 200 * mag
      worst = std::max(worst, std::fabs(double(got) - dref) / (1.2e-5 * mag + 1e-30));
    }
  }
  INFO("N = " << n << ", rank " << rank << ", I = " << interleave << ", fp8 q = " << Fp8);
  CHECK(all_ranks(bitwise));
  CHECK(all_ranks(untouched));
  CHECK(all_ranks(worst <= 1.0));
}

}  // namespace

TEST_CASE("indexer scores: every rank's shard equals the plain scorer bitwise",
          "[indexer][score]") {
  check_scores<false>(1, 16, 0);
  check_scores<false>(8, 16, 0);
  check_scores<true>(1, 16, 0);
  check_scores<true>(2, 64, 3);
}

TEST_CASE("indexer scores: bad inputs are refused before anything is written", "[indexer][score]") {
  const RoundRobinOwnership own(1, 1);
  const IndexerBatch b = make_indexer_batch(3u, {40}, {1}, 0, 4);
  const GlobalKeys keys = make_global_keys(4u, b.request_length, 0);
  const PagedShard shard = make_paged_shard(b.request_length, own, 0, 16);
  const std::vector<std::uint8_t> cache =
      build_indexer_cache(keys, b.request_length, own, 0, shard);
  std::vector<float> scores(64, -1.0f);
  IndexerArgs<bfloat16> a;
  a.q = make_view(b.q_bf16.data(), {1, 4, std::int64_t(kIdxDim)});
  a.weights = make_view(b.weights.data(), {1, 4});
  a.k_cache = make_view(cache.data(), {shard.num_pages, 16 * kIdxBytesPerToken});
  a.block_table = make_view(shard.block_table.data(), {1, shard.max_pages});
  a.row_request = make_view(b.row_request.data(), {1});
  a.row_bound = make_view(b.row_bound.data(), {1});
  a.num_valid_rows = 1;
  auto out = make_view(scores.data(), {1, 64});
  CHECK_NOTHROW(host::indexer_scores(own, 0, a, out));

  auto refused = [&](IndexerArgs<bfloat16> bad, TensorView<float, 2> o, const char* what) {
    std::fill(scores.begin(), scores.end(), -1.0f);
    bool thrown = false;
    try {
      host::indexer_scores(own, 0, bad, o);
    } catch (const Error& e) {
      thrown = std::string(e.what()).find(what) != std::string::npos;
      INFO(e.what());
    }
    CHECK(thrown);
    CHECK(std::all_of(scores.begin(), scores.end(), [](float x) { return x == -1.0f; }));
  };
  refused(a, make_view(scores.data(), {1, 39}), "columns of scores");
  auto bad = a;
  bad.num_valid_rows = -1;
  refused(bad, out, "num_valid_rows");
  std::vector<std::int32_t> table = shard.block_table;
  table[1] = std::int32_t(shard.num_pages);  // page beyond the cache
  bad = a;
  bad.block_table = make_view(table.data(), {1, shard.max_pages});
  refused(bad, out, "outside k_cache");
  std::vector<std::int32_t> req = {1};
  bad = a;
  bad.row_request = make_view(req.data(), {1});
  refused(bad, out, "row_request");
  IndexerArgs<std::uint8_t> f8;  // fp8 queries without scales
  f8.q = make_view(b.q_fp8.data(), {1, 4, std::int64_t(kIdxDim)});
  f8.weights = a.weights;
  f8.k_cache = a.k_cache;
  f8.block_table = a.block_table;
  f8.row_request = a.row_request;
  f8.row_bound = a.row_bound;
  f8.num_valid_rows = 1;
  CHECK_THROWS_AS(host::indexer_scores(own, 0, f8, out), Error);
}

// ---- top-k --------------------------------------------------------------------------------------

namespace {
std::vector<std::int64_t> bounds_for(int k) {
  std::vector<std::int64_t> b = {0, 1, 2, 3, 5, 7, 9, 64, 100, 700};
  for (std::int64_t x :
       {std::int64_t(k) - 1, std::int64_t(k), std::int64_t(k) + 1, 3 * std::int64_t(k) + 5})
    if (x >= 0) b.push_back(x);
  return b;
}
}  // namespace

TEST_CASE("local top-k: the best k of the rank's own keys, ascending, canonical scores",
          "[indexer][topk]") {
  const int n = world_size(), rank = world_rank();
  for (int k : {1, 7, 64}) {
    for (int interleave : {1, 3}) {
      const RoundRobinOwnership own(n, interleave);
      const GlobalScores g = make_global_scores(100u + unsigned(k), bounds_for(k), 2);
      std::int64_t columns = 0;
      const std::vector<float> local = local_scores(g, own, rank, columns);
      const std::int64_t t = g.rows();
      std::vector<TopkCandidate> out(std::size_t(t * k), TopkCandidate{7.0f, 7});
      host::local_topk(own, rank, make_view(local.data(), {t, columns}),
                       make_view(g.bound.data(), {t}), g.num_valid_rows,
                       make_view(out.data(), {t, std::int64_t(k)}));
      bool ok = true;
      for (std::int64_t row = 0; row < t; ++row) {
        // reference: the rank's own scores sorted fully, best k, by position
        std::vector<float> mine;
        std::vector<std::int32_t> expect(std::size_t(k), -1);
        if (row < g.num_valid_rows) {
          const std::int64_t len = own.local_length(g.bound[std::size_t(row)], rank);
          for (std::int64_t p = 0; p < len; ++p)
            mine.push_back(local[std::size_t(row * columns + p)]);
          const auto best = sorted_topk(mine.data(), len, k);  // local positions
          for (int i = 0; i < k; ++i)
            expect[std::size_t(i)] =
                best[std::size_t(i)] < 0
                    ? -1
                    : std::int32_t(own.global_position(best[std::size_t(i)], rank));
          for (int i = 0; i < k; ++i) {
            const TopkCandidate c = out[std::size_t(row * k + i)];
            ok = ok && c.position == expect[std::size_t(i)];
            if (c.position < 0) {
              ok = ok && c.score == -std::numeric_limits<float>::infinity();
            } else {
              const float s = mine[std::size_t(best[std::size_t(i)])];
              ok = ok && same_bits(c.score, topk_canonical_score(s));
            }
          }
        } else {
          for (int i = 0; i < k; ++i) ok = ok && out[std::size_t(row * k + i)].position == -1;
        }
      }
      INFO("k = " << k << ", I = " << interleave << ", rank " << rank);
      CHECK(all_ranks(ok));
    }
  }
}

TEST_CASE("distributed top-k equals a full sort of every key and a single-rank run",
          "[indexer][topk]") {
  MpiCommunicator world(MPI_COMM_WORLD);
  SelfCommunicator self;
  for (int k : {1, 7, 64, 2048}) {
    for (int interleave : {1, 2, 64}) {
      const GlobalScores g =
          make_global_scores(7u * unsigned(k) + unsigned(interleave), bounds_for(k), 3);
      const auto expect = expected_topk(g, k);
      const auto dcp = run_distributed_topk(world, g, k, interleave);
      const auto single = run_distributed_topk(self, g, k, interleave);
      INFO("N = " << world.size() << ", k = " << k << ", I = " << interleave
                  << ", first differing row (dcp) " << first_diff_row(dcp, expect, k)
                  << ", (single) " << first_diff_row(single, expect, k));
      CHECK(all_ranks(dcp == expect));
      CHECK(all_ranks(single == expect));
    }
  }
}

TEST_CASE("distributed top-k: every rank holds candidates only below the bound",
          "[indexer][topk]") {
  // a row whose bound is below N * I: ranks past the bound have no key at all; and a batch of
  // only padding rows.
  MpiCommunicator world(MPI_COMM_WORLD);
  GlobalScores g = make_global_scores(99u, {1, 2, 3}, 0);
  for (int k : {1, 2, 5})
    CHECK(all_ranks(run_distributed_topk(world, g, k, 1) == expected_topk(g, k)));
  g.num_valid_rows = 0;
  CHECK(all_ranks(run_distributed_topk(world, g, 4, 1) ==
                  std::vector<std::int32_t>(g.bound.size() * 4, -1)));
}

TEST_CASE("distributed top-k: refusals name the parameter", "[indexer][topk]") {
  SelfCommunicator self;
  const RoundRobinOwnership own(1, 1);
  std::vector<float> s(10, 1.0f);
  std::vector<std::int64_t> bound = {10};
  std::vector<std::int32_t> out(4);
  std::vector<std::byte> ws(distributed_topk_workspace_bytes(1, 4, 1));
  auto call = [&](std::int64_t cols, std::size_t ws_bytes, const RoundRobinOwnership& o) {
    host::distributed_topk(self, o, make_view(static_cast<const float*>(s.data()), {1, cols}),
                           make_view(static_cast<const std::int64_t*>(bound.data()), {1}), 1,
                           make_view(out.data(), {1, 4}),
                           cuda::std::span<std::byte>(ws.data(), ws_bytes));
  };
  CHECK_NOTHROW(call(10, ws.size(), own));
  CHECK(out == std::vector<std::int32_t>{0, 1, 2, 3});
  CHECK_THROWS_AS(call(9, ws.size(), own), Error);       // local length beyond columns
  CHECK_THROWS_AS(call(10, ws.size() - 1, own), Error);  // workspace too small
  CHECK_THROWS_AS(call(10, ws.size(), RoundRobinOwnership(2, 1)), Error);  // N mismatch
}

// ---- the decode step end to end -----------------------------------------------------------------

namespace {

constexpr float kSoftmaxScale = 0.0721687836f;  // 1 / sqrt(192)
constexpr int kAttnHeads = 8;

/// Model inputs of the end-to-end step, identical on every rank: per request, the per-token
/// prologue inputs of its context; the decode rows' indexer batch and attention queries.
struct Step {
  std::vector<std::int64_t> lengths;
  int page_size = 16;
  int interleave = 1;
  int topk = 64;
  bool fp8_queries = false;
  IndexerBatch batch;
  std::vector<bfloat16> q_w, kv_w, ik_w;                      // norm weights
  std::vector<float> cos_sin;                                 // (max_pos, 64)
  std::vector<std::vector<bfloat16>> q_c, kv_c, k_pe, idx_k;  // per request, per token
  std::vector<bfloat16> attn_q;                               // (T, H, 576)
};

std::vector<bfloat16> normal_bf16(std::mt19937& rng, std::size_t n, float stddev) {
  std::normal_distribution<float> d(0.0f, stddev);
  std::vector<bfloat16> v(n);
  for (auto& x : v) x = bfloat16::from_float(d(rng));
  return v;
}

/// `ties`: the indexer LayerNorm weight is zero on the rotated dims [0, 64), so RoPE cannot tell
/// positions apart, and index_k repeats 4 distinct rows: many keys, hence scores, are identical.
Step make_step(std::uint32_t seed, std::vector<std::int64_t> lengths, std::vector<int> rows,
               int interleave, int page_size, int topk, bool fp8_queries, bool ties) {
  Step s;
  s.lengths = lengths;
  s.page_size = page_size;
  s.interleave = interleave;
  s.topk = topk;
  s.fp8_queries = fp8_queries;
  s.batch = make_indexer_batch(seed, lengths, rows, 2, kIndexerNumHeads);
  std::mt19937 rng(seed + 1);
  s.q_w = normal_bf16(rng, 1536, 0.3f);
  s.kv_w = normal_bf16(rng, 512, 0.3f);
  s.ik_w = normal_bf16(rng, 128, 0.5f);
  if (ties)
    for (int i = 0; i < 64; ++i) s.ik_w[std::size_t(i)] = bfloat16::from_float(0.0f);
  std::int64_t max_pos = 1;
  for (auto l : lengths) max_pos = std::max(max_pos, l);
  s.cos_sin.resize(std::size_t(max_pos * 64));
  for (std::int64_t p = 0; p < max_pos; ++p)
    for (int i = 0; i < 32; ++i) {
      const double angle = double(p) * std::pow(10000.0, -2.0 * i / 64);
      s.cos_sin[std::size_t(p * 64 + i)] = float(std::cos(angle));
      s.cos_sin[std::size_t(p * 64 + 32 + i)] = float(std::sin(angle));
    }
  const auto pool = normal_bf16(rng, 4 * 128, 1.0f);
  for (auto l : lengths) {
    const std::size_t n = std::size_t(l);
    s.q_c.push_back(normal_bf16(rng, n * 1536, 1.0f));
    s.kv_c.push_back(normal_bf16(rng, n * 512, 1.0f));
    s.k_pe.push_back(normal_bf16(rng, n * 64, 1.0f));
    std::vector<bfloat16> ik = normal_bf16(rng, n * 128, 1.0f);
    if (ties)
      for (std::size_t t = 0; t < n; ++t)
        std::copy_n(pool.begin() + std::ptrdiff_t((rng() % 4) * 128), 128,
                    ik.begin() + std::ptrdiff_t(t * 128));
    s.idx_k.push_back(std::move(ik));
  }
  s.attn_q = normal_bf16(rng, std::size_t(s.batch.rows()) * kAttnHeads * kMlaQkDim, 1.0f);
  return s;
}

/// What one rank's run of the step produces, for all heads: top-k (T, k), out (T, H, 512) and lse
/// (T, H), the heads assembled from every rank.
struct StepResult {
  std::vector<std::int32_t> topk;
  std::vector<bfloat16> out;
  std::vector<float> lse;
};

/// Runs the fused prologue over every request's context on `rank`: the owner of each token writes
/// its MLA entry and its indexer key (fp8 ds_mla and paged indexer caches); other slots are -1.
void write_context(const Step& s, const RoundRobinOwnership& own, int rank, const PagedShard& shard,
                   std::vector<std::uint8_t>& kv_cache, std::vector<std::uint8_t>& idx_cache) {
  const std::int64_t b = s.page_size;
  std::vector<bfloat16> q_out;
  for (std::size_t r = 0; r < s.lengths.size(); ++r) {
    const std::int64_t len = s.lengths[r];
    if (len == 0) continue;
    std::vector<std::int64_t> positions(static_cast<std::size_t>(len));
    std::vector<std::int64_t> slots(static_cast<std::size_t>(len));
    for (std::int64_t t = 0; t < len; ++t) {
      positions[std::size_t(t)] = t;
      slots[std::size_t(t)] = paged_slot(own, t, rank, shard.row(r), b);
    }
    q_out.resize(std::size_t(len) * 1536);
    PrologueArgs<mla_cache_out_view_t<CacheFormat::fp8_ds_mla>> p;
    p.q_c = make_view(s.q_c[r].data(), {len, 1536});
    p.q_c_out = make_view(q_out.data(), {len, 1536});
    p.q_norm_weight = make_view(s.q_w.data(), {1536});
    p.kv_c = make_view(s.kv_c[r].data(), {len, 512});
    p.kv_norm_weight = make_view(s.kv_w.data(), {512});
    p.k_pe = make_view(s.k_pe[r].data(), {len, 64});
    p.positions = make_view(static_cast<const std::int64_t*>(positions.data()), {len});
    p.cos_sin_cache = make_view(s.cos_sin.data(), {std::int64_t(s.cos_sin.size() / 64), 64});
    p.slot_mapping = make_view(static_cast<const std::int64_t*>(slots.data()), {len});
    p.kv_cache =
        make_view(kv_cache.data(), {shard.num_pages * b, std::int64_t(DsMlaFp8Entry::bytes)});
    p.index_k = make_view(s.idx_k[r].data(), {len, 128});
    p.index_k_norm_weight = make_view(s.ik_w.data(), {128});
    p.index_k_cache = make_view(idx_cache.data(), {shard.num_pages, b * kIdxBytesPerToken});
    host::fused_prologue(p);
  }
}

template <class Comm>
StepResult run_step(Comm& comm, const Step& s) {
  constexpr CacheFormat F = CacheFormat::fp8_ds_mla;
  const int n = comm.size(), rank = comm.rank();
  const RoundRobinOwnership own(n, s.interleave);
  const PagedShard shard = make_paged_shard(s.lengths, own, rank, s.page_size);
  const std::int64_t b = s.page_size;
  std::vector<std::uint8_t> kv_cache(std::size_t(shard.num_pages * b * DsMlaFp8Entry::bytes), 0);
  std::vector<std::uint8_t> idx_cache(std::size_t(shard.num_pages * b * kIdxBytesPerToken), 0xa5);

  // 1. the fused prologue over every request's context: owners write their tokens' entries
  write_context(s, own, rank, shard, kv_cache, idx_cache);

  // 2. indexer + exact distributed top-k
  const IndexerBatch& ib = s.batch;
  const std::int64_t t = ib.rows(), hi = ib.heads;
  IndexerConfig icfg;
  icfg.num_heads = ib.heads;
  icfg.topk = s.topk;
  icfg.max_tokens = int(t);
  icfg.max_context_len = ib.max_bound();
  StepResult res;
  res.topk.assign(std::size_t(t * s.topk), 777);
  std::vector<std::byte> iws(indexer_topk_workspace_bytes(icfg, own));
  auto fill = [&](auto& a) {
    a.weights = make_view(ib.weights.data(), {t, hi});
    a.k_cache = make_view(static_cast<const std::uint8_t*>(idx_cache.data()),
                          {shard.num_pages, b * kIdxBytesPerToken});
    a.block_table =
        make_view(shard.block_table.data(), {std::int64_t(s.lengths.size()), shard.max_pages});
    a.row_request = make_view(ib.row_request.data(), {t});
    a.row_bound = make_view(ib.row_bound.data(), {t});
    a.num_valid_rows = ib.num_valid_rows;
  };
  auto topk_view = make_view(res.topk.data(), {t, std::int64_t(s.topk)});
  if (s.fp8_queries) {
    IndexerArgs<std::uint8_t> a;
    a.q = make_view(ib.q_fp8.data(), {t, hi, std::int64_t(kIdxDim)});
    a.q_scale = make_view(ib.q_scale.data(), {t, hi});
    fill(a);
    host::indexer_topk(comm, own, icfg, a, topk_view, iws);
  } else {
    IndexerArgs<bfloat16> a;
    a.q = make_view(ib.q_bf16.data(), {t, hi, std::int64_t(kIdxDim)});
    fill(a);
    host::indexer_topk(comm, own, icfg, a, topk_view, iws);
  }

  // 3. sparse attention over the chosen positions, combined across ranks
  using Op = DcpAttention<RoundRobinOwnership, DirectWorkspace, SparseMla<F>, AllToAll, Comm,
                          HostExecution>;
  DcpConfig c;
  c.group_size = n;
  c.num_heads = kAttnHeads;
  c.page_size = s.page_size;
  c.interleave = s.interleave;
  c.max_tokens = int(t);
  c.gather_capacity = int(t);
  c.topk = s.topk;
  c.softmax_scale = kSoftmaxScale;
  c.mode = DcpMode::deterministic;
  Op op(comm, c);
  const std::int64_t h = kAttnHeads, hl = h / n;
  std::vector<bfloat16> out_local(std::size_t(t * hl * kMlaVDim));
  std::vector<float> lse_local(std::size_t(t * hl));
  typename Op::Arguments a;
  a.q = make_view(static_cast<const bfloat16*>(s.attn_q.data()) + rank * hl * kMlaQkDim,
                  {t, hl, std::int64_t(kMlaQkDim)}, {h * kMlaQkDim, std::int64_t(kMlaQkDim), 1});
  a.cache = make_view(static_cast<const std::uint8_t*>(kv_cache.data()),
                      {shard.num_pages * b, std::int64_t(DsMlaFp8Entry::bytes)});
  a.block_table =
      make_view(shard.block_table.data(), {std::int64_t(s.lengths.size()), shard.max_pages});
  a.row_request = make_view(ib.row_request.data(), {t});
  a.row_bound = make_view(ib.row_bound.data(), {t});
  a.topk = make_view(static_cast<const std::int32_t*>(res.topk.data()), {t, std::int64_t(s.topk)});
  a.num_valid_rows = ib.num_valid_rows;
  a.out = make_view(out_local.data(), {t, hl, std::int64_t(kMlaVDim)});
  a.out_lse = make_view(lse_local.data(), {t, hl});
  std::vector<std::byte> ws(Op::workspace_bytes(c));
  // padding rows carry a garbage request; the operator reads nothing of them
  op.forward(a, ws);

  std::vector<bfloat16> out_all(std::size_t(n) * out_local.size());
  std::vector<float> lse_all(std::size_t(n) * lse_local.size());
  comm.all_gather(reinterpret_cast<const std::uint8_t*>(out_local.data()),
                  reinterpret_cast<std::uint8_t*>(out_all.data()), out_local.size() * 2, {});
  comm.all_gather(lse_local.data(), lse_all.data(), lse_local.size(), {});
  res.out.resize(std::size_t(t * h * kMlaVDim));
  res.lse.resize(std::size_t(t * h));
  for (int src = 0; src < n; ++src)
    for (std::int64_t row = 0; row < t; ++row)
      for (std::int64_t hh = 0; hh < hl; ++hh) {
        const std::int64_t head = src * hl + hh;
        res.lse[std::size_t(row * h + head)] = lse_all[std::size_t((src * t + row) * hl + hh)];
        std::memcpy(&res.out[std::size_t((row * h + head) * kMlaVDim)],
                    &out_all[std::size_t(((src * t + row) * hl + hh) * kMlaVDim)],
                    kMlaVDim * sizeof(bfloat16));
      }
  return res;
}

bool bitwise_equal(const StepResult& a, const StepResult& b) {
  return a.topk == b.topk && a.out.size() == b.out.size() && a.lse.size() == b.lse.size() &&
         std::memcmp(a.out.data(), b.out.data(), a.out.size() * sizeof(bfloat16)) == 0 &&
         std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float)) == 0;
}

/// The top-k the step must choose: a full sort of the plain scores of every stored key, read
/// back from a single-rank cache with the test's own decoder (a key's bytes do not depend on N).
std::vector<std::int32_t> step_reference_topk(const Step& s) {
  const RoundRobinOwnership own(1, s.interleave);
  const PagedShard shard = make_paged_shard(s.lengths, own, 0, s.page_size);
  const std::int64_t b = s.page_size;
  std::vector<std::uint8_t> kv(std::size_t(shard.num_pages * b * DsMlaFp8Entry::bytes));
  std::vector<std::uint8_t> idx_cache(std::size_t(shard.num_pages * b * kIdxBytesPerToken));
  write_context(s, own, 0, shard, kv, idx_cache);
  const IndexerBatch& ib = s.batch;
  std::vector<std::int32_t> expect(std::size_t(ib.rows() * s.topk), -1);
  std::vector<float> q, qs, w, scores;
  for (std::int64_t t = 0; t < ib.num_valid_rows; ++t) {
    row_inputs(ib, t, s.fp8_queries, q, qs, w);
    const std::int64_t bound = ib.row_bound[std::size_t(t)];
    const std::size_t req = std::size_t(ib.row_request[std::size_t(t)]);
    scores.assign(std::size_t(bound), 0.0f);
    for (std::int64_t g = 0; g < bound; ++g)
      scores[std::size_t(g)] =
          plain_score(q, qs, w, read_plain_key(idx_cache, s.page_size, shard.row(req), g));
    const auto row = sorted_topk(scores.data(), bound, s.topk);
    std::copy(row.begin(), row.end(), expect.begin() + t * s.topk);
  }
  return expect;
}

void check_step(const Step& s) {
  MpiCommunicator world(MPI_COMM_WORLD);
  SelfCommunicator self;
  const StepResult dcp = run_step(world, s);
  const StepResult single = run_step(self, s);
  const auto expect = step_reference_topk(s);
  INFO("N = " << world.size() << ", I = " << s.interleave << ", k = " << s.topk
              << ", fp8 q = " << s.fp8_queries << ", top-k differs from the full sort at row "
              << first_diff_row(dcp.topk, expect, s.topk));
  CHECK(all_ranks(bitwise_equal(dcp, single)));
  CHECK(all_ranks(dcp.topk == expect));
  // the step attends somewhere: some valid row chose keys and got a finite lse
  bool attended = false;
  for (float l : dcp.lse) attended = attended || std::isfinite(l);
  CHECK(attended);
}

}  // namespace

TEST_CASE("sparse decode step: N ranks are bitwise one rank (bf16 indexer queries)",
          "[indexer][step]") {
  // lengths 0, 1, 5 leave some ranks without keys; 2500 > k = 2048 exercises the selection
  check_step(
      make_step(31u, {0, 1, 5, 70, 300, 2500}, {1, 1, 2, 1, 1, 2}, 1, 16, 2048, false, false));
  check_step(make_step(32u, {3, 300, 900}, {1, 3, 1}, 64, 64, 64, false, true));
}

TEST_CASE("sparse decode step: N ranks are bitwise one rank (fp8 indexer queries)",
          "[indexer][step]") {
  check_step(make_step(33u, {1, 130, 700}, {1, 2, 1}, 2, 16, 128, true, false));
  check_step(make_step(34u, {0, 260, 999}, {1, 1, 2}, 1, 16, 100, true, true));
}
