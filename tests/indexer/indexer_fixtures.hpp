// SPDX-License-Identifier: Apache-2.0
// Seeded indexer test data built identically on every rank, and the plain references the indexer
// tests compare against: a scorer reading the stored cache bytes with its own decoder, and a top-k
// that fully sorts every key of a row. Shared by the host and the GPU tests.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "dcpattn/core/numeric.hpp"
#include "dcpattn/indexer/indexer.hpp"
#include "dcpattn/kernels/cache_layout.hpp"
#include "dcpattn/ownership/round_robin.hpp"

namespace dcpattn::test {

inline constexpr int kIdxDim = 128;
inline constexpr int kIdxBytesPerToken = 132;

// ---- plain references -------------------------------------------------------------------------

/// e4m3 byte -> value, written from the format's definition (bias 7, S.1111.111 = NaN).
inline float e4m3_plain(std::uint8_t b) {
  const int e = (b >> 3) & 15;
  const int m = b & 7;
  if (e == 15 && m == 7) return std::numeric_limits<float>::quiet_NaN();
  const float mag = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(1.0f + float(m) / 8.0f, e - 7);
  return (b & 0x80) ? -mag : mag;
}

/// One stored indexer key, as read back from cache bytes.
struct PlainKey {
  float value[kIdxDim];  // raw e4m3 values (scale not applied)
  float scale;
};

/// Reads the key at local position p of a request from a paged indexer cache given as raw bytes
/// (num_pages rows of page_size * 132 bytes), through the request's block-table row.
inline PlainKey read_plain_key(const std::vector<std::uint8_t>& cache, std::int64_t page_size,
                               const std::int32_t* table_row, std::int64_t p) {
  const std::int64_t page = table_row[p / page_size];
  const std::int64_t s = p % page_size;
  const std::uint8_t* base = cache.data() + page * page_size * kIdxBytesPerToken;
  PlainKey k{};
  for (int i = 0; i < kIdxDim; ++i) k.value[i] = e4m3_plain(base[s * kIdxDim + i]);
  std::memcpy(&k.scale, base + page_size * kIdxDim + s * 4, 4);  // little-endian hosts
  return k;
}

/// The specified fp32 arithmetic, written out plainly: sequential dot, (dot * ks) * qs, ReLU,
/// fma over the heads in order.
inline float plain_score(const std::vector<float>& q_raw, const std::vector<float>& q_scale,
                         const std::vector<float>& w, const PlainKey& k) {
  const int heads = int(w.size());
  float s = 0.0f;
  for (int j = 0; j < heads; ++j) {
    float d = 0.0f;
    for (int i = 0; i < kIdxDim; ++i) d += q_raw[std::size_t(j * kIdxDim + i)] * k.value[i];
    const float x = d * k.scale * q_scale[std::size_t(j)];
    s = std::fma(w[std::size_t(j)], x > 0.0f ? x : 0.0f, s);
  }
  return s;
}

/// The same score in double, and the magnitude sum_j |w_j| sum_i |q k| that bounds the error of
/// any fp32 summation order (for tolerance checks).
inline void double_score(const std::vector<float>& q_raw, const std::vector<float>& q_scale,
                         const std::vector<float>& w, const PlainKey& k, double& score,
                         double& magnitude) {
  score = 0.0;
  magnitude = 0.0;
  for (std::size_t j = 0; j < w.size(); ++j) {
    double d = 0.0, m = 0.0;
    for (int i = 0; i < kIdxDim; ++i) {
      const double prod = double(q_raw[j * kIdxDim + std::size_t(i)]) * double(k.value[i]);
      d += prod;
      m += std::fabs(prod);
    }
    const double scale = double(k.scale) * double(q_scale[j]);
    score += double(w[j]) * std::max(0.0, d * scale);
    magnitude += std::fabs(double(w[j])) * m * std::fabs(scale);
  }
}

/// The exact top-k of one row by a full sort of all its positions [0, bound): score descending
/// (NaN as -inf, -0 equal to +0), position ascending; the first min(k, bound) positions in
/// ascending order, -1 padded to k.
inline std::vector<std::int32_t> sorted_topk(const float* scores, std::int64_t bound, int k) {
  auto key = [](float s) { return std::isnan(s) ? -std::numeric_limits<float>::infinity() : s; };
  std::vector<std::int32_t> idx(static_cast<std::size_t>(bound));
  std::iota(idx.begin(), idx.end(), 0);
  std::sort(idx.begin(), idx.end(), [&](std::int32_t a, std::int32_t b) {
    const float ka = key(scores[a]), kb = key(scores[b]);
    if (ka != kb) return ka > kb;
    return a < b;
  });
  if (idx.size() > std::size_t(k)) idx.resize(std::size_t(k));
  std::sort(idx.begin(), idx.end());
  idx.resize(std::size_t(k), -1);
  return idx;
}

// ---- synthetic score rows (for the top-k alone) ------------------------------------------------

/// How the scores of a row are drawn.
enum class ScorePattern { distinct, ties, specials, constant };

/// Global scores of T rows, each over [0, bound_t): (T, width) row-major, NaN beyond the bound.
struct GlobalScores {
  std::vector<std::int64_t> bound;  // (T,)
  int num_valid_rows = 0;
  std::int64_t width = 1;
  std::vector<float> s;  // (T, width)
  std::int64_t rows() const { return std::int64_t(bound.size()); }
  const float* row(std::int64_t t) const { return s.data() + t * width; }
};

inline float draw_score(std::mt19937& rng, ScorePattern p) {
  constexpr float inf = std::numeric_limits<float>::infinity();
  switch (p) {
    case ScorePattern::distinct:
      return std::uniform_real_distribution<float>(-4.0f, 4.0f)(rng);
    case ScorePattern::ties: {
      static const float v[] = {0.0f, -0.0f, 0.5f, 1.0f, 1.0f, 2.0f};
      return v[rng() % 6];
    }
    case ScorePattern::specials: {
      static const float v[] = {std::numeric_limits<float>::quiet_NaN(),
                                -std::numeric_limits<float>::quiet_NaN(),
                                -inf,
                                inf,
                                -0.0f,
                                0.0f,
                                std::numeric_limits<float>::denorm_min(),
                                -std::numeric_limits<float>::max(),
                                3.0f,
                                3.0f};
      return v[rng() % 10];
    }
    case ScorePattern::constant:
      return 1.0f;
  }
  return 0.0f;
}

/// Rows of every bound in `bounds`, each with every pattern, plus `padding` rows (bound garbage).
inline GlobalScores make_global_scores(std::uint32_t seed, const std::vector<std::int64_t>& bounds,
                                       int padding) {
  std::mt19937 rng(seed);
  GlobalScores g;
  const ScorePattern patterns[] = {ScorePattern::distinct, ScorePattern::ties,
                                   ScorePattern::specials, ScorePattern::constant};
  std::vector<ScorePattern> row_pattern;
  for (auto b : bounds)
    for (auto p : patterns) {
      g.bound.push_back(b);
      row_pattern.push_back(p);
    }
  g.num_valid_rows = int(g.bound.size());
  for (int i = 0; i < padding; ++i) g.bound.push_back(std::int64_t(1) << 40);  // never read
  for (auto b : bounds) g.width = std::max(g.width, b);
  g.s.assign(std::size_t(g.rows() * g.width), std::numeric_limits<float>::quiet_NaN());
  for (std::int64_t t = 0; t < g.num_valid_rows; ++t)
    for (std::int64_t p = 0; p < g.bound[std::size_t(t)]; ++p)
      g.s[std::size_t(t * g.width + p)] = draw_score(rng, row_pattern[std::size_t(t)]);
  return g;
}

/// Rank r's (T, C) score buffer for global scores: column p of row t is the score of
/// global_position(p, r) for p < local_length(bound_t, r), and +inf (which would win if read)
/// everywhere else, padding rows included.
inline std::vector<float> local_scores(const GlobalScores& g, const RoundRobinOwnership& own,
                                       int rank, std::int64_t& columns) {
  columns = 1;
  for (std::int64_t t = 0; t < g.num_valid_rows; ++t)
    columns = std::max(columns, own.local_length(g.bound[std::size_t(t)], rank));
  std::vector<float> l(std::size_t(g.rows() * columns), std::numeric_limits<float>::infinity());
  for (std::int64_t t = 0; t < g.num_valid_rows; ++t) {
    const std::int64_t n = own.local_length(g.bound[std::size_t(t)], rank);
    for (std::int64_t p = 0; p < n; ++p)
      l[std::size_t(t * columns + p)] = g.row(t)[own.global_position(p, rank)];
  }
  return l;
}

/// The expected (T, k) result: a full sort per valid row, all -1 for padding rows.
inline std::vector<std::int32_t> expected_topk(const GlobalScores& g, int k) {
  std::vector<std::int32_t> e(std::size_t(g.rows() * k), -1);
  for (std::int64_t t = 0; t < g.num_valid_rows; ++t) {
    const auto row = sorted_topk(g.row(t), g.bound[std::size_t(t)], k);
    std::copy(row.begin(), row.end(), e.begin() + t * k);
  }
  return e;
}

// ---- a batch of indexer queries over paged caches ---------------------------------------------

/// One rank's paged layout for a set of requests: LOCAL page ids per request, scrambled (handed
/// out in reverse) so a wrong page lookup reads another request's keys.
struct PagedShard {
  std::int64_t page_size = 16;
  std::int64_t num_pages = 1;
  std::int64_t max_pages = 1;
  std::vector<std::int32_t> block_table;  // (num_requests, max_pages), -1 = unused
  const std::int32_t* row(std::size_t req) const {
    return block_table.data() + req * std::size_t(max_pages);
  }
};

inline PagedShard make_paged_shard(const std::vector<std::int64_t>& lengths,
                                   const RoundRobinOwnership& own, int rank,
                                   std::int64_t page_size) {
  PagedShard s;
  s.page_size = page_size;
  std::vector<std::int64_t> pages(lengths.size());
  std::int64_t total = 0;
  for (std::size_t r = 0; r < lengths.size(); ++r) {
    pages[r] = (own.local_length(lengths[r], rank) + page_size - 1) / page_size;
    s.max_pages = std::max(s.max_pages, pages[r]);
    total += pages[r];
  }
  s.num_pages = std::max<std::int64_t>(total, 1);
  s.block_table.assign(lengths.size() * std::size_t(s.max_pages), -1);
  std::int64_t next = total - 1;
  for (std::size_t r = 0; r < lengths.size(); ++r)
    for (std::int64_t p = 0; p < pages[r]; ++p)
      s.block_table[r * std::size_t(s.max_pages) + std::size_t(p)] = std::int32_t(next--);
  return s;
}

/// Query rows of an indexer batch (identical on every rank): requests of given lengths, several
/// decode rows per request (MTP: the last row sees the whole request, earlier ones one token
/// fewer each), padding rows, and the indexer queries/weights of every row.
struct IndexerBatch {
  std::vector<std::int64_t> request_length;
  std::vector<std::int32_t> row_request;  // (T,)
  std::vector<std::int64_t> row_bound;    // (T,)
  int num_valid_rows = 0;
  int heads = kIndexerNumHeads;
  std::vector<bfloat16> q_bf16;     // (T, H, 128)
  std::vector<std::uint8_t> q_fp8;  // (T, H, 128) e4m3 bytes
  std::vector<float> q_scale;       // (T, H)
  std::vector<float> weights;       // (T, H)
  std::int64_t rows() const { return std::int64_t(row_request.size()); }
  std::int64_t max_bound() const {
    std::int64_t m = 0;
    for (auto l : request_length) m = std::max(m, l);
    return m;
  }
};

/// `integer_data`: queries and weights are small integers (and scales powers of two) so that every
/// dot product is exact in fp32 whatever the summation order.
inline IndexerBatch make_indexer_batch(std::uint32_t seed, std::vector<std::int64_t> lengths,
                                       std::vector<int> rows_per_request, int padding, int heads,
                                       bool integer_data = false) {
  IndexerBatch b;
  b.heads = heads;
  b.request_length = lengths;
  std::mt19937 rng(seed);
  for (std::size_t r = 0; r < lengths.size(); ++r)
    for (int k = rows_per_request[r] - 1; k >= 0; --k) {
      b.row_request.push_back(std::int32_t(r));
      b.row_bound.push_back(std::max<std::int64_t>(lengths[r] - k, 0));
    }
  b.num_valid_rows = int(b.row_request.size());
  for (int p = 0; p < padding; ++p) {
    b.row_request.push_back(9999);  // garbage: padding rows must not be read
    b.row_bound.push_back(std::int64_t(1) << 40);
  }
  const std::size_t n = std::size_t(b.rows() * heads);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  b.q_bf16.resize(n * kIdxDim);
  b.q_fp8.resize(n * kIdxDim);
  b.q_scale.resize(n);
  b.weights.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    const bool pad = i >= std::size_t(b.num_valid_rows) * std::size_t(heads);
    for (int d = 0; d < kIdxDim; ++d) {
      float v = integer_data ? float(int(rng() % 7) - 3) : normal(rng);
      if (pad) v = std::numeric_limits<float>::quiet_NaN();
      b.q_bf16[i * kIdxDim + std::size_t(d)] = bfloat16::from_float(v);
      b.q_fp8[i * kIdxDim + std::size_t(d)] = pad ? std::uint8_t(0x7f) : fp8_e4m3::encode(v);
    }
    b.q_scale[i] = integer_data ? 0.25f : std::uniform_real_distribution<float>(0.01f, 0.1f)(rng);
    b.weights[i] = integer_data ? float(int(rng() % 5) - 2)
                                : std::uniform_real_distribution<float>(-0.5f, 1.0f)(rng);
    if (pad) b.q_scale[i] = b.weights[i] = std::numeric_limits<float>::quiet_NaN();
  }
  return b;
}

/// Global indexer keys of every request, quantized once: (L, 132) bytes per request, each token's
/// 128 e4m3 values then its fp32 scale (one page of size 1 per token). `duplicates` > 0 draws the
/// keys from that many distinct vectors, so many scores tie exactly.
struct GlobalKeys {
  std::vector<std::vector<std::uint8_t>> bytes;  // per request, (L, 132)
};

inline GlobalKeys make_global_keys(std::uint32_t seed, const std::vector<std::int64_t>& lengths,
                                   int duplicates, bool integer_data = false) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto draw = [&](bfloat16* key) {
    for (int d = 0; d < kIdxDim; ++d)
      key[d] = bfloat16::from_float(integer_data ? float(int(rng() % 9) - 4) : normal(rng));
    if (integer_data) key[0] = bfloat16::from_float(448.0f);  // scale = 1: values stay integers
  };
  std::vector<std::vector<bfloat16>> pool(static_cast<std::size_t>(duplicates),
                                          std::vector<bfloat16>(kIdxDim));
  for (auto& k : pool) draw(k.data());
  GlobalKeys g;
  for (auto len : lengths) {
    std::vector<std::uint8_t> req(std::size_t(len) * kIdxBytesPerToken);
    for (std::int64_t t = 0; t < len; ++t) {
      std::vector<bfloat16> key(kIdxDim);
      if (duplicates > 0)
        key = pool[rng() % std::size_t(duplicates)];
      else
        draw(key.data());
      auto one = make_view(req.data() + t * kIdxBytesPerToken, {1, kIdxBytesPerToken});
      indexer_k_store(one, 0, key.data());
    }
    g.bytes.push_back(std::move(req));
  }
  return g;
}

/// Rank r's paged indexer cache holding the tokens it owns of every request, at the slots of
/// its block table: (num_pages, page_size * 132) bytes.
inline std::vector<std::uint8_t> build_indexer_cache(const GlobalKeys& keys,
                                                     const std::vector<std::int64_t>& lengths,
                                                     const RoundRobinOwnership& own, int rank,
                                                     const PagedShard& shard) {
  const std::int64_t b = shard.page_size;
  std::vector<std::uint8_t> cache(std::size_t(shard.num_pages * b * kIdxBytesPerToken), 0xa5);
  for (std::size_t r = 0; r < lengths.size(); ++r)
    for (std::int64_t t = 0; t < lengths[r]; ++t) {
      const std::int64_t slot = paged_slot(own, t, rank, shard.row(r), b);
      if (slot < 0) continue;
      const std::int64_t page = slot / b, s = slot % b;
      std::uint8_t* base = cache.data() + page * b * kIdxBytesPerToken;
      const std::uint8_t* src = keys.bytes[r].data() + t * kIdxBytesPerToken;
      std::memcpy(base + s * kIdxDim, src, kIdxDim);
      std::memcpy(base + b * kIdxDim + s * 4, src + kIdxDim, 4);
    }
  return cache;
}

/// Raw query values, scales and weights of row t, as the plain scorer takes them.
inline void row_inputs(const IndexerBatch& b, std::int64_t t, bool fp8, std::vector<float>& q,
                       std::vector<float>& qs, std::vector<float>& w) {
  const std::size_t h = std::size_t(b.heads);
  q.resize(h * kIdxDim);
  qs.resize(h);
  w.resize(h);
  for (std::size_t j = 0; j < h; ++j) {
    const std::size_t row = std::size_t(t) * h + j;
    for (std::size_t d = 0; d < kIdxDim; ++d)
      q[j * kIdxDim + d] =
          fp8 ? e4m3_plain(b.q_fp8[row * kIdxDim + d]) : b.q_bf16[row * kIdxDim + d].to_float();
    qs[j] = fp8 ? b.q_scale[row] : 1.0f;
    w[j] = b.weights[row];
  }
}

/// Plain global scores of every valid row over [0, bound) from the global key bytes: (T, width).
inline GlobalScores plain_global_scores(const IndexerBatch& b, const GlobalKeys& keys, bool fp8) {
  GlobalScores g;
  g.bound = b.row_bound;
  g.num_valid_rows = b.num_valid_rows;
  g.width = std::max<std::int64_t>(b.max_bound(), 1);
  g.s.assign(std::size_t(b.rows() * g.width), std::numeric_limits<float>::quiet_NaN());
  std::vector<float> q, qs, w;
  for (std::int64_t t = 0; t < b.num_valid_rows; ++t) {
    row_inputs(b, t, fp8, q, qs, w);
    const auto& req = keys.bytes[std::size_t(b.row_request[std::size_t(t)])];
    const std::vector<std::int32_t> identity = {0};
    for (std::int64_t s = 0; s < b.row_bound[std::size_t(t)]; ++s) {
      const std::vector<std::uint8_t> one(req.begin() + s * kIdxBytesPerToken,
                                          req.begin() + (s + 1) * kIdxBytesPerToken);
      g.s[std::size_t(t * g.width + s)] =
          plain_score(q, qs, w, read_plain_key(one, 1, identity.data(), 0));
    }
  }
  return g;
}

}  // namespace dcpattn::test
