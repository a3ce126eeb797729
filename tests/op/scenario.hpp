// SPDX-License-Identifier: Apache-2.0
// A seeded decode batch built identically on every rank: requests of ragged lengths, multi-token
// rows, padding rows, global keys/queries, and each rank's own paged cache and block table.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "dcpattn/dcpattn.hpp"

namespace dcpattn::test {

struct Scenario {
  // shape
  int num_heads = 8;
  int page_size = 64;
  int interleave = 1;
  int topk = 24;
  std::vector<std::int64_t> request_length;  // L per request
  // rows
  std::vector<std::int32_t> row_request;     // (T)
  std::vector<std::int64_t> row_bound;       // (T) global causal bound
  int num_valid_rows = 0;
  // global data (values already representable in bf16)
  std::vector<bfloat16> q;                   // (T, H, 576)
  std::vector<std::vector<float>> keys;      // per request: (L, 576) latent 512 + rope 64
  std::vector<std::int32_t> topk_idx;        // (T, topk), -1 = none

  std::int64_t rows() const { return std::int64_t(row_request.size()); }
};

/// Builds a scenario. lengths: one per request; rows_per_request: multi-token decode rows (the
/// last row of a request sees the whole request, earlier rows one token fewer each); padding:
/// extra rows beyond the valid ones, filled with NaN queries.
inline Scenario make_scenario(std::uint32_t seed, std::vector<std::int64_t> lengths,
                              std::vector<int> rows_per_request, int padding, int num_heads,
                              int interleave, int page_size, int topk) {
  Scenario s;
  s.num_heads = num_heads;
  s.interleave = interleave;
  s.page_size = page_size;
  s.topk = topk;
  s.request_length = lengths;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (std::size_t r = 0; r < lengths.size(); ++r) {
    for (int k = rows_per_request[r] - 1; k >= 0; --k) {
      s.row_request.push_back(std::int32_t(r));
      const std::int64_t b = lengths[r] - k;
      s.row_bound.push_back(b < 0 ? 0 : b);
    }
  }
  s.num_valid_rows = int(s.row_request.size());
  for (int p = 0; p < padding; ++p) {  // padding rows point at request 0 with a bogus bound
    s.row_request.push_back(0);
    s.row_bound.push_back(lengths.empty() ? 0 : lengths[0]);
  }
  const std::int64_t t = s.rows();
  s.q.resize(std::size_t(t * num_heads * kMlaQkDim));
  for (std::int64_t row = 0; row < t; ++row)
    for (std::int64_t i = 0; i < num_heads * kMlaQkDim; ++i)
      s.q[std::size_t(row * num_heads * kMlaQkDim + i)] = bfloat16::from_float(
          row < s.num_valid_rows ? normal(rng) : std::numeric_limits<float>::quiet_NaN());
  s.keys.resize(lengths.size());
  for (std::size_t r = 0; r < lengths.size(); ++r) {
    s.keys[r].resize(std::size_t(lengths[r] * kMlaQkDim));
    for (auto& x : s.keys[r]) x = round_to_bf16(normal(rng));
  }
  s.topk_idx.assign(std::size_t(t * topk), -1);
  for (std::int64_t row = 0; row < s.num_valid_rows; ++row) {
    const std::int64_t bound = s.row_bound[std::size_t(row)];
    // a sorted random subset of [0, bound), at most topk, sometimes fewer (-1 padded)
    std::vector<std::int32_t> all;
    for (std::int64_t g = 0; g < bound; ++g) all.push_back(std::int32_t(g));
    std::shuffle(all.begin(), all.end(), rng);
    const std::size_t keep = std::min<std::size_t>(all.size(), std::size_t(topk - (row % 3)));
    all.resize(keep);
    std::sort(all.begin(), all.end());
    for (std::size_t k = 0; k < all.size(); ++k) s.topk_idx[std::size_t(row * topk) + k] = all[k];
  }
  return s;
}

/// One rank's paged cache and block table for a scenario: token t of request r lives at local
/// position p = local_position(t) on owner(t), in local page p / B of that request. Pages are
/// handed out in a scrambled order so a wrong page lookup reads the wrong keys.
template <CacheFormat F>
struct LocalCache {
  std::vector<mla_cache_element_t<F>> data;  // (num_slots, width)
  std::vector<std::int32_t> block_table;     // (num_requests, max_pages)
  std::int64_t num_slots = 0;
  std::int64_t max_pages = 0;

  mla_cache_view_t<F> view() const {
    return make_view(static_cast<const mla_cache_element_t<F>*>(data.data()),
                     {num_slots, std::int64_t(mla_cache_row_width(F))});
  }
  TensorView<const std::int32_t, 2> table() const {
    return make_view(static_cast<const std::int32_t*>(block_table.data()),
                     {std::int64_t(block_table.size() / std::size_t(max_pages)), max_pages});
  }
};

template <CacheFormat F>
LocalCache<F> build_local_cache(const Scenario& s, const RoundRobinOwnership& own, int rank) {
  LocalCache<F> c;
  const std::int64_t b = s.page_size;
  const std::size_t nreq = s.request_length.size();
  std::int64_t max_pages = 1;
  std::vector<std::int64_t> pages(nreq);
  for (std::size_t r = 0; r < nreq; ++r) {
    pages[r] = (own.local_length(s.request_length[r], rank) + b - 1) / b;
    max_pages = std::max(max_pages, pages[r]);
  }
  std::int64_t total = 0;
  for (auto p : pages) total += p;
  c.max_pages = max_pages;
  c.num_slots = std::max<std::int64_t>(total, 1) * b;
  const int width = mla_cache_row_width(F);
  c.data.assign(std::size_t(c.num_slots * width), mla_cache_element_t<F>{});
  c.block_table.assign(nreq * std::size_t(max_pages), -1);
  // scrambled page ids: page k of the pool goes to (request, local page) in reverse order
  std::int64_t next = total - 1;
  for (std::size_t r = 0; r < nreq; ++r)
    for (std::int64_t p = 0; p < pages[r]; ++p)
      c.block_table[r * std::size_t(max_pages) + std::size_t(p)] = std::int32_t(next--);
  for (std::size_t r = 0; r < nreq; ++r) {
    const int* row = c.block_table.data() + r * std::size_t(max_pages);
    for (std::int64_t t = 0; t < s.request_length[r]; ++t) {
      const std::int64_t slot = paged_slot(own, t, rank, row, b);
      if (slot < 0) continue;
      const float* key = s.keys[r].data() + t * kMlaQkDim;
      auto* dst = c.data.data() + slot * width;
      if constexpr (F == CacheFormat::bf16) {
        for (int i = 0; i < kMlaQkDim; ++i) dst[i] = bfloat16::from_float(key[i]);
      } else {
        DsMlaFp8Entry::encode(key, key + kMlaLatentDim, dst);
      }
    }
  }
  return c;
}

}  // namespace dcpattn::test
