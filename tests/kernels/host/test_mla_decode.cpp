// SPDX-License-Identifier: Apache-2.0
// Host MLA decode kernels (dense paged and sparse top-k):
//   - against plain double-precision attention over the row's keys (no splits, no sharding), with
//     keys decoded by the test's own plain bf16 / e4m3 decoders;
//   - the DCP invariance of the split structure: N ranks, each with V / N local splits, merged by
//     tree_merge in rank order, are bitwise equal to one rank with V splits.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "support/catch.hpp"

#include "dcpattn/core/fp8_cache.hpp"
#include "dcpattn/core/lse.hpp"
#include "dcpattn/core/numeric.hpp"
#include "dcpattn/core/tensor.hpp"
#include "dcpattn/error.hpp"
#include "dcpattn/kernels/cache_layout.hpp"
#include "dcpattn/kernels/host/mla_decode.hpp"
#include "dcpattn/ownership/round_robin.hpp"

namespace {

using dcpattn::bfloat16;
using dcpattn::CacheFormat;
using dcpattn::MlaDecodeParams;
using dcpattn::RoundRobinOwnership;

constexpr int kQk = 576;
constexpr int kDv = 512;
constexpr int kEntry = 656;
constexpr int kVirtualShards = 8;
constexpr float kSoftmaxScale = 0.07216878364870322f;  // 1 / sqrt(192)

// ---------------------------------------------------------------------------------------------
// Plain decoders, written independently of the library.

double bf16_plain(std::uint16_t bits) {
  const std::uint32_t u = std::uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// e4m3 "fn": bias 7, S.1111.111 is NaN, subnormals m * 2^-9.
double e4m3_plain(std::uint8_t b) {
  const int e = (b >> 3) & 15;
  const int m = b & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double mag = e == 0 ? std::ldexp(double(m), -9) : std::ldexp(1.0 + m / 8.0, e - 7);
  return (b & 0x80) ? -mag : mag;
}

// Key dim i of a 656-byte entry: 512 e4m3 latent values (scale per 128 at byte 512 + 4 g), then
// 64 little-endian bf16 rope values at byte 528.
double fp8_entry_key_plain(const std::uint8_t* e, int i) {
  if (i < 512) {
    float scale;
    std::memcpy(&scale, e + 512 + 4 * (i / 128), 4);
    return e4m3_plain(e[i]) * double(scale);
  }
  const int j = i - 512;
  return bf16_plain(std::uint16_t(e[528 + 2 * j] | (e[529 + 2 * j] << 8)));
}

// ---------------------------------------------------------------------------------------------
// Test data: one global set of keys per request, and the paged caches of each rank built from it.

struct Batch {
  std::vector<std::int64_t> lengths;          // per request
  std::vector<std::vector<bfloat16>> tokens;  // per request: (length, 576) latent then rope
};

bfloat16 random_bf16(std::mt19937_64& rng, float lo, float hi) {
  return bfloat16::from_float(std::uniform_real_distribution<float>(lo, hi)(rng));
}

Batch make_batch(const std::vector<std::int64_t>& lengths, std::mt19937_64& rng) {
  Batch b;
  b.lengths = lengths;
  for (std::int64_t len : lengths) {
    std::vector<bfloat16> k(std::size_t(len) * kQk);
    for (auto& x : k) x = random_bf16(rng, -1.0f, 1.0f);
    b.tokens.push_back(std::move(k));
  }
  return b;
}

struct RankCache {
  CacheFormat format;
  int page_size;
  std::int64_t num_slots = 0;
  std::vector<bfloat16> bf16;     // (num_slots, 576)
  std::vector<std::uint8_t> fp8;  // (num_slots, 656)
  std::int64_t num_requests = 0, max_pages = 0;
  std::vector<std::int32_t> block_table;  // (num_requests, max_pages), local page ids

  dcpattn::TensorView<const std::int32_t, 2> table() const {
    return dcpattn::make_view(block_table.data(), {num_requests, max_pages});
  }
  std::int64_t slot(std::int64_t req, std::int64_t local_pos) const {
    return std::int64_t(block_table[std::size_t(req * max_pages + local_pos / page_size)]) *
               page_size +
           local_pos % page_size;
  }
  // Key dim i of the entry at `slot`, decoded plainly.
  double key(std::int64_t s, int i) const {
    return format == CacheFormat::bf16 ? bf16_plain(bf16[std::size_t(s * kQk + i)].bits)
                                       : fp8_entry_key_plain(&fp8[std::size_t(s * kEntry)], i);
  }
};

// Rank `rank`'s cache: token t of a request goes to rank own.owner(t), local position
// own.local_position(t), through shuffled pages. Unused slots hold NaN, so reading one shows.
RankCache build_rank_cache(const Batch& b, const RoundRobinOwnership& own, int rank, int page_size,
                           CacheFormat format, std::mt19937_64& rng) {
  RankCache c;
  c.format = format;
  c.page_size = page_size;
  c.num_requests = std::int64_t(b.lengths.size());
  std::vector<std::int64_t> pages_of;
  std::int64_t total_pages = 3;  // spare pages, never referenced
  for (std::int64_t len : b.lengths) {
    const std::int64_t local = own.local_length(len, rank);
    pages_of.push_back((local + page_size - 1) / page_size);
    total_pages += pages_of.back();
    c.max_pages = std::max(c.max_pages, pages_of.back() + 1);
  }
  std::vector<std::int32_t> perm(static_cast<std::size_t>(total_pages));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  c.block_table.assign(std::size_t(c.num_requests * c.max_pages), -1);
  std::size_t next = 0;
  for (std::int64_t r = 0; r < c.num_requests; ++r)
    for (std::int64_t pg = 0; pg < pages_of[std::size_t(r)]; ++pg)
      c.block_table[std::size_t(r * c.max_pages + pg)] = perm[next++];
  c.num_slots = total_pages * page_size;
  if (format == CacheFormat::bf16)
    c.bf16.assign(std::size_t(c.num_slots * kQk), bfloat16{0x7fc0});
  else
    c.fp8.assign(std::size_t(c.num_slots * kEntry), 0xff);
  for (std::int64_t r = 0; r < c.num_requests; ++r) {
    const auto& toks = b.tokens[std::size_t(r)];
    for (std::int64_t t = 0; t < b.lengths[std::size_t(r)]; ++t) {
      if (own.owner(t) != rank) continue;
      const std::int64_t s = c.slot(r, own.local_position(t));
      const bfloat16* src = &toks[std::size_t(t * kQk)];
      if (format == CacheFormat::bf16)
        std::copy(src, src + kQk, &c.bf16[std::size_t(s * kQk)]);
      else
        dcpattn::DsMlaFp8Entry::encode(src, src + 512, &c.fp8[std::size_t(s * kEntry)]);
    }
  }
  return c;
}

// Queries (T, H, 576), stored row-major or head-major (H, T, 576) to exercise strided views.
struct Queries {
  std::int64_t T = 0, H = 0;
  bool head_major = false;
  std::vector<bfloat16> data;

  std::size_t index(std::int64_t t, std::int64_t h, int d) const {
    return head_major ? std::size_t((h * T + t) * kQk + d) : std::size_t((t * H + h) * kQk + d);
  }
  double at(std::int64_t t, std::int64_t h, int d) const {
    return bf16_plain(data[index(t, h, d)].bits);
  }
  dcpattn::TensorView<const bfloat16, 3> view() const {
    if (!head_major) return dcpattn::make_view(data.data(), {T, H, std::int64_t(kQk)});
    return dcpattn::make_view(data.data(), {T, H, std::int64_t(kQk)},
                              {std::int64_t(kQk), T * kQk, std::int64_t(1)});
  }
};

// Random queries; rows t >= num_valid are NaN (padding must never be read).
Queries make_queries(std::int64_t T, std::int64_t H, std::int64_t num_valid, bool head_major,
                     std::mt19937_64& rng) {
  Queries q;
  q.T = T;
  q.H = H;
  q.head_major = head_major;
  q.data.resize(std::size_t(T * H * kQk));
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t h = 0; h < H; ++h)
      for (int d = 0; d < kQk; ++d)
        q.data[q.index(t, h, d)] = t < num_valid ? random_bf16(rng, -1.0f, 1.0f) : bfloat16{0x7fc0};
  return q;
}

// Kernel outputs (T, H, 512) and (T, H), pre-filled with a sentinel so unwritten entries show.
struct States {
  std::int64_t T = 0, H = 0;
  std::vector<float> o, lse;
  States(std::int64_t t, std::int64_t h)
      : T(t), H(h), o(std::size_t(t * h * kDv), 12345.0f), lse(std::size_t(t * h), 12345.0f) {}
  dcpattn::TensorView<float, 3> o_view() {
    return dcpattn::make_view(o.data(), {T, H, std::int64_t(kDv)});
  }
  dcpattn::TensorView<float, 2> lse_view() { return dcpattn::make_view(lse.data(), {T, H}); }
  const float* o_at(std::int64_t t, std::int64_t h) const {
    return &o[std::size_t((t * H + h) * kDv)];
  }
  float lse_at(std::int64_t t, std::int64_t h) const { return lse[std::size_t(t * H + h)]; }
};

bool bitwise_equal(const States& a, const States& b) {
  return a.o.size() == b.o.size() && a.lse.size() == b.lse.size() &&
         std::memcmp(a.o.data(), b.o.data(), a.o.size() * sizeof(float)) == 0 &&
         std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float)) == 0;
}

// Rows of a test batch: the request of each row and its global causal bound.
struct Rows {
  std::vector<std::int32_t> request;
  std::vector<std::int64_t> bound;
  std::int64_t num_valid = 0;  // rows after these are padding
};

MlaDecodeParams params(const RankCache& c, int interleave, int num_splits, std::int64_t num_valid) {
  MlaDecodeParams p;
  p.softmax_scale = kSoftmaxScale;
  p.page_size = c.page_size;
  p.interleave = interleave;
  p.num_splits = num_splits;
  p.num_valid_rows = int(num_valid);
  return p;
}

States run_dense(const RankCache& c, const Queries& q, const Rows& rows,
                 const std::vector<std::int64_t>& local_length, const MlaDecodeParams& p) {
  States s(q.T, q.H);
  auto req = dcpattn::make_view(rows.request.data(), {std::int64_t(rows.request.size())});
  auto len = dcpattn::make_view(local_length.data(), {std::int64_t(local_length.size())});
  if (c.format == CacheFormat::bf16) {
    auto cache = dcpattn::make_view(c.bf16.data(), {c.num_slots, std::int64_t(kQk)});
    dcpattn::host::mla_decode_dense(q.view(), cache, c.table(), req, len, p, s.o_view(),
                                    s.lse_view());
  } else {
    auto cache = dcpattn::make_view(c.fp8.data(), {c.num_slots, std::int64_t(kEntry)});
    dcpattn::host::mla_decode_dense(q.view(), cache, c.table(), req, len, p, s.o_view(),
                                    s.lse_view());
  }
  return s;
}

States run_sparse(const RankCache& c, const Queries& q, const Rows& rows,
                  const std::vector<std::int32_t>& topk, std::int64_t K,
                  const RoundRobinOwnership& own, int rank, const MlaDecodeParams& p) {
  States s(q.T, q.H);
  auto req = dcpattn::make_view(rows.request.data(), {std::int64_t(rows.request.size())});
  auto bound = dcpattn::make_view(rows.bound.data(), {std::int64_t(rows.bound.size())});
  auto tk = dcpattn::make_view(topk.data(), {q.T, K});
  if (c.format == CacheFormat::bf16) {
    auto cache = dcpattn::make_view(c.bf16.data(), {c.num_slots, std::int64_t(kQk)});
    dcpattn::host::mla_decode_sparse(q.view(), cache, c.table(), req, tk, bound, own, rank, p,
                                     s.o_view(), s.lse_view());
  } else {
    auto cache = dcpattn::make_view(c.fp8.data(), {c.num_slots, std::int64_t(kEntry)});
    dcpattn::host::mla_decode_sparse(q.view(), cache, c.table(), req, tk, bound, own, rank, p,
                                     s.o_view(), s.lse_view());
  }
  return s;
}

// ---------------------------------------------------------------------------------------------
// Plain double-precision attention of one row over an explicit list of global positions, keys
// read through the N = 1 cache: softmax(scale * q . k) weighted average of the latents.

struct RefState {
  std::vector<double> o;    // (H, 512)
  std::vector<double> lse;  // (H,), -inf when the list is empty
};

RefState reference_row(const RankCache& c1, const Queries& q, std::int64_t t, std::int64_t req,
                       const std::vector<std::int64_t>& positions) {
  const std::size_t n = positions.size();
  std::vector<double> keys(n * kQk);
  for (std::size_t k = 0; k < n; ++k) {
    const std::int64_t s = c1.slot(req, positions[k]);  // N = 1: local position = global
    for (int d = 0; d < kQk; ++d) keys[k * kQk + d] = c1.key(s, d);
  }
  RefState r;
  r.o.assign(std::size_t(q.H * kDv), 0.0);
  r.lse.assign(std::size_t(q.H), -std::numeric_limits<double>::infinity());
  if (n == 0) return r;
  std::vector<double> sc(n);
  for (std::int64_t h = 0; h < q.H; ++h) {
    double m = -std::numeric_limits<double>::infinity();
    for (std::size_t k = 0; k < n; ++k) {
      double dot = 0.0;
      for (int d = 0; d < kQk; ++d) dot += q.at(t, h, d) * keys[k * kQk + d];
      sc[k] = double(kSoftmaxScale) * dot;
      m = std::max(m, sc[k]);
    }
    double l = 0.0;
    for (std::size_t k = 0; k < n; ++k) l += std::exp(sc[k] - m);
    r.lse[std::size_t(h)] = m + std::log(l);
    for (std::size_t k = 0; k < n; ++k) {
      const double w = std::exp(sc[k] - m) / l;
      for (int d = 0; d < kDv; ++d) r.o[std::size_t(h * kDv + d)] += w * keys[k * kQk + d];
    }
  }
  return r;
}

// Tolerances against the double reference. The kernel accumulates in fp32: a 576-term dot product
// of values in [-1, 1] (|score| <~ 2 after the 1/sqrt(192) scale) carries an absolute error of
// ~1e-6, exp/log add a relative 6e-8 each, and the softmax sums over <= 300 keys add a relative
// 6e-8 per term. Observed: |o - o_ref| <= 4e-7, |lse - lse_ref| <= 1.1e-6; the bounds leave ~10x,
// while a wrong, missing or extra key moves o and lse by >= 1e-3.
constexpr double kTolO = 5e-6;
constexpr double kTolLse = 1e-5;

struct ErrorStats {
  double o = 0.0, lse = 0.0;
};

// Compares the kernel's (t, h) states with the reference; neutral rows must be exact.
void check_row(const States& s, std::int64_t t, const RefState& r, ErrorStats& err) {
  for (std::int64_t h = 0; h < s.H; ++h) {
    const double ref_lse = r.lse[std::size_t(h)];
    const float lse = s.lse_at(t, h);
    if (std::isinf(ref_lse)) {
      REQUIRE(lse == dcpattn::lse_neg_inf);
      for (int d = 0; d < kDv; ++d) REQUIRE(s.o_at(t, h)[d] == 0.0f);
      continue;
    }
    REQUIRE(std::isfinite(lse));
    err.lse = std::max(err.lse, std::fabs(double(lse) - ref_lse));
    for (int d = 0; d < kDv; ++d) {
      const double e = std::fabs(double(s.o_at(t, h)[d]) - r.o[std::size_t(h * kDv + d)]);
      REQUIRE(!std::isnan(e));
      err.o = std::max(err.o, e);
    }
  }
}

void check_padding(const States& s, std::int64_t num_valid) {
  for (std::int64_t t = num_valid; t < s.T; ++t)
    for (std::int64_t h = 0; h < s.H; ++h) {
      REQUIRE(s.lse_at(t, h) == dcpattn::lse_neg_inf);
      for (int d = 0; d < kDv; ++d) REQUIRE(s.o_at(t, h)[d] == 0.0f);
    }
}

// Merges the rank states of every (row, head) with tree_merge in rank order, as the combine does.
States merge_ranks(const std::vector<States>& ranks) {
  const int n = int(ranks.size());
  States out(ranks[0].T, ranks[0].H);
  std::vector<float> o(static_cast<std::size_t>(n) * kDv), lse(static_cast<std::size_t>(n));
  for (std::int64_t t = 0; t < out.T; ++t)
    for (std::int64_t h = 0; h < out.H; ++h) {
      for (int r = 0; r < n; ++r) {
        std::copy(ranks[std::size_t(r)].o_at(t, h), ranks[std::size_t(r)].o_at(t, h) + kDv,
                  &o[std::size_t(r) * kDv]);
        lse[std::size_t(r)] = ranks[std::size_t(r)].lse_at(t, h);
      }
      dcpattn::tree_merge(
          [&](int v) {
            return dcpattn::TreeStateRef{&o[std::size_t(v) * kDv], &lse[std::size_t(v)]};
          },
          n, kDv);
      std::copy(o.begin(), o.begin() + kDv, &out.o[std::size_t((t * out.H + h) * kDv)]);
      out.lse[std::size_t(t * out.H + h)] = lse[0];
    }
  return out;
}

std::string error_message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const dcpattn::Error& e) {
    return e.message();
  }
  return "<no dcpattn::Error thrown>";
}

bool contains(const std::string& s, const std::string& sub) {
  return s.find(sub) != std::string::npos;
}

// A batch of ragged requests (lengths 0 and 1 included) with multi-token rows carrying their own
// bounds, followed by padding rows whose request and length entries are garbage.
struct DenseCase {
  Batch batch;
  Rows rows;
};

DenseCase make_dense_case(const std::vector<std::int64_t>& lengths, std::int64_t padding,
                          std::mt19937_64& rng) {
  DenseCase c;
  c.batch = make_batch(lengths, rng);
  for (std::size_t r = 0; r < lengths.size(); ++r) {
    const std::int64_t len = lengths[r];
    const int mtp = len >= 3 && r % 2 == 0 ? 3 : 1;  // speculative rows: bounds len-2, len-1, len
    for (int k = mtp - 1; k >= 0; --k) {
      c.rows.request.push_back(std::int32_t(r));
      c.rows.bound.push_back(len - k);
    }
  }
  c.rows.num_valid = std::int64_t(c.rows.request.size());
  for (std::int64_t i = 0; i < padding; ++i) {
    c.rows.request.push_back(987654);  // out of range: a padding row must not be read
    c.rows.bound.push_back(-7);
  }
  return c;
}

}  // namespace

TEST_CASE("dense MLA decode matches plain double attention", "[kernels][mla][dense]") {
  std::mt19937_64 rng(20260101);
  const std::vector<std::int64_t> lengths{0, 1, 37, 130, 2, 300};
  DenseCase dc = make_dense_case(lengths, 2, rng);
  const std::int64_t T = std::int64_t(dc.rows.request.size());
  ErrorStats worst;
  for (CacheFormat format : {CacheFormat::bf16, CacheFormat::fp8_ds_mla}) {
    for (std::int64_t H : {1, 16}) {
      const Queries q = make_queries(T, H, dc.rows.num_valid, /*head_major=*/H == 16, rng);
      for (int page_size : {64, 16}) {
        const RankCache c1 =
            build_rank_cache(dc.batch, RoundRobinOwnership(1, 1), 0, page_size, format, rng);
        for (int interleave : {1, 16}) {
          for (int num_splits : {1, 2, 8}) {
            CAPTURE(int(format), H, page_size, interleave, num_splits);
            std::vector<std::int64_t> local_length = dc.rows.bound;  // N = 1: local = global
            const States s = run_dense(c1, q, dc.rows, local_length,
                                       params(c1, interleave, num_splits, dc.rows.num_valid));
            for (std::int64_t t = 0; t < dc.rows.num_valid; ++t) {
              std::vector<std::int64_t> pos(
                  static_cast<std::size_t>(dc.rows.bound[std::size_t(t)]));
              std::iota(pos.begin(), pos.end(), 0);
              check_row(s, t, reference_row(c1, q, t, dc.rows.request[std::size_t(t)], pos), worst);
            }
            check_padding(s, dc.rows.num_valid);
          }
        }
      }
    }
  }
  INFO("max |o - o_ref| = " << worst.o << ", max |lse - lse_ref| = " << worst.lse);
  CHECK(worst.o <= kTolO);
  CHECK(worst.lse <= kTolLse);
}

TEST_CASE("dense MLA decode: N ranks with V/N splits merge bitwise to one rank with V splits",
          "[kernels][mla][dense][invariance]") {
  std::mt19937_64 rng(7);
  // Lengths around block and span boundaries: V I = 8 (I = 1) and 512 (I = 64).
  const std::vector<std::int64_t> lengths{0, 1, 5, 63, 64, 65, 515, 1100};
  DenseCase dc = make_dense_case(lengths, 1, rng);
  const std::int64_t T = std::int64_t(dc.rows.request.size());
  const std::int64_t H = 4;
  const Queries q = make_queries(T, H, dc.rows.num_valid, false, rng);
  for (CacheFormat format : {CacheFormat::bf16, CacheFormat::fp8_ds_mla}) {
    for (int interleave : {1, 64}) {
      const int page_size = interleave == 1 ? 16 : 64;
      const RoundRobinOwnership own1(1, interleave, kVirtualShards);
      const RankCache c1 = build_rank_cache(dc.batch, own1, 0, page_size, format, rng);
      const States one = run_dense(c1, q, dc.rows, dc.rows.bound,
                                   params(c1, interleave, kVirtualShards, dc.rows.num_valid));
      // Sensitivity control: a different split structure rounds differently on these data.
      const States other = run_dense(c1, q, dc.rows, dc.rows.bound,
                                     params(c1, interleave, kVirtualShards / 2, dc.rows.num_valid));
      CHECK_FALSE(bitwise_equal(one, other));
      for (int N : {2, 4}) {
        CAPTURE(int(format), interleave, N);
        const RoundRobinOwnership own(N, interleave, kVirtualShards);
        std::vector<States> ranks;
        for (int r = 0; r < N; ++r) {
          const RankCache cr = build_rank_cache(dc.batch, own, r, page_size, format, rng);
          std::vector<std::int64_t> local_length;
          for (std::int64_t t = 0; t < T; ++t)
            local_length.push_back(
                t < dc.rows.num_valid ? own.local_length(dc.rows.bound[std::size_t(t)], r) : -7);
          ranks.push_back(run_dense(cr, q, dc.rows, local_length,
                                    params(cr, interleave, kVirtualShards / N, dc.rows.num_valid)));
        }
        const States merged = merge_ranks(ranks);
        CHECK(bitwise_equal(merged, one));
      }
    }
  }
}

namespace {

// Top-k lists: random positions below the bound in random order, with duplicates and -1 gaps.
std::vector<std::int32_t> make_topk(const Rows& rows, std::int64_t T, std::int64_t K,
                                    std::mt19937_64& rng) {
  std::vector<std::int32_t> topk(std::size_t(T * K), -1);
  for (std::int64_t t = 0; t < rows.num_valid; ++t) {
    const std::int64_t bound = rows.bound[std::size_t(t)];
    if (bound == 0) continue;
    for (std::int64_t k = 0; k < K; ++k) {
      const auto u = rng() % 16;
      std::int32_t g;
      if (u == 0) {
        g = -1;
      } else if (u == 1 && k > 0) {
        g = topk[std::size_t(t * K + std::int64_t(rng() % std::uint64_t(k)))];  // duplicate
      } else {
        g = std::int32_t(rng() % std::uint64_t(bound));
      }
      topk[std::size_t(t * K + k)] = g;
    }
  }
  return topk;
}

std::vector<std::int64_t> listed_positions(const std::vector<std::int32_t>& topk, std::int64_t t,
                                           std::int64_t K) {
  std::vector<std::int64_t> pos;
  for (std::int64_t k = 0; k < K; ++k)
    if (topk[std::size_t(t * K + k)] >= 0) pos.push_back(topk[std::size_t(t * K + k)]);
  return pos;
}

}  // namespace

TEST_CASE("sparse MLA decode matches plain double attention over the listed positions",
          "[kernels][mla][sparse]") {
  std::mt19937_64 rng(99);
  const std::vector<std::int64_t> lengths{0, 1, 40, 300, 257};
  DenseCase dc = make_dense_case(lengths, 1, rng);
  const std::int64_t T = std::int64_t(dc.rows.request.size());
  const std::int64_t K = 48;
  std::vector<std::int32_t> topk = make_topk(dc.rows, T, K, rng);
  // The last valid row lists nothing: all -1 must give the neutral state.
  const std::int64_t empty_row = dc.rows.num_valid - 1;
  for (std::int64_t k = 0; k < K; ++k) topk[std::size_t(empty_row * K + k)] = -1;
  ErrorStats worst;
  for (CacheFormat format : {CacheFormat::bf16, CacheFormat::fp8_ds_mla}) {
    for (std::int64_t H : {1, 16}) {
      const Queries q = make_queries(T, H, dc.rows.num_valid, H == 1, rng);
      for (int page_size : {64, 16}) {
        for (int interleave : {1, 16}) {
          const RoundRobinOwnership own1(1, interleave, kVirtualShards);
          const RankCache c1 = build_rank_cache(dc.batch, own1, 0, page_size, format, rng);
          // Splits of positions (deterministic mode), and runs of the list (fast mode's
          // split_topk_list; 64 splits give runs of one entry, most of them empty past K).
          for (const auto& [num_splits, list_splits] :
               {std::pair{1, false}, std::pair{2, false}, std::pair{8, false}, std::pair{2, true},
                std::pair{8, true}, std::pair{64, true}}) {
            CAPTURE(int(format), H, page_size, interleave, num_splits, list_splits);
            MlaDecodeParams p = params(c1, interleave, num_splits, dc.rows.num_valid);
            p.split_topk_list = list_splits;
            const States s = run_sparse(c1, q, dc.rows, topk, K, own1, 0, p);
            for (std::int64_t t = 0; t < dc.rows.num_valid; ++t)
              check_row(s, t,
                        reference_row(c1, q, t, dc.rows.request[std::size_t(t)],
                                      listed_positions(topk, t, K)),
                        worst);
            for (std::int64_t h = 0; h < H; ++h) {
              REQUIRE(s.lse_at(empty_row, h) == dcpattn::lse_neg_inf);
              for (int d = 0; d < kDv; ++d) REQUIRE(s.o_at(empty_row, h)[d] == 0.0f);
            }
            check_padding(s, dc.rows.num_valid);
          }
        }
      }
    }
  }
  INFO("max |o - o_ref| = " << worst.o << ", max |lse - lse_ref| = " << worst.lse);
  CHECK(worst.o <= kTolO);
  CHECK(worst.lse <= kTolLse);
}

TEST_CASE("sparse MLA decode: N ranks merge bitwise to one rank with V splits",
          "[kernels][mla][sparse][invariance]") {
  std::mt19937_64 rng(1234);
  const std::vector<std::int64_t> lengths{0, 1, 70, 600, 1100};
  DenseCase dc = make_dense_case(lengths, 1, rng);
  const std::int64_t T = std::int64_t(dc.rows.request.size());
  const std::int64_t H = 4, K = 96;
  const std::vector<std::int32_t> topk = make_topk(dc.rows, T, K, rng);
  const Queries q = make_queries(T, H, dc.rows.num_valid, false, rng);
  for (CacheFormat format : {CacheFormat::bf16, CacheFormat::fp8_ds_mla}) {
    for (int interleave : {1, 64}) {
      const int page_size = interleave == 1 ? 16 : 64;
      const RoundRobinOwnership own1(1, interleave, kVirtualShards);
      const RankCache c1 = build_rank_cache(dc.batch, own1, 0, page_size, format, rng);
      const States one = run_sparse(c1, q, dc.rows, topk, K, own1, 0,
                                    params(c1, interleave, kVirtualShards, dc.rows.num_valid));
      const States other = run_sparse(c1, q, dc.rows, topk, K, own1, 0,
                                      params(c1, interleave, 1, dc.rows.num_valid));
      CHECK_FALSE(bitwise_equal(one, other));
      for (int N : {2, 4}) {
        CAPTURE(int(format), interleave, N);
        const RoundRobinOwnership own(N, interleave, kVirtualShards);
        std::vector<States> ranks;
        for (int r = 0; r < N; ++r) {
          const RankCache cr = build_rank_cache(dc.batch, own, r, page_size, format, rng);
          ranks.push_back(
              run_sparse(cr, q, dc.rows, topk, K, own, r,
                         params(cr, interleave, kVirtualShards / N, dc.rows.num_valid)));
        }
        CHECK(bitwise_equal(merge_ranks(ranks), one));
      }
    }
  }
}

TEST_CASE("MLA decode refuses bad input before writing, naming the parameter",
          "[kernels][mla][errors]") {
  std::mt19937_64 rng(5);
  DenseCase dc = make_dense_case({10, 70}, 0, rng);
  const std::int64_t T = std::int64_t(dc.rows.request.size());
  const std::int64_t H = 2, K = 4;
  const Queries q = make_queries(T, H, T, false, rng);
  const RoundRobinOwnership own(1, 1);
  const RankCache c = build_rank_cache(dc.batch, own, 0, 16, CacheFormat::bf16, rng);
  auto cache = dcpattn::make_view(c.bf16.data(), {c.num_slots, std::int64_t(kQk)});
  auto req = dcpattn::make_view(dc.rows.request.data(), {T});
  auto bound = dcpattn::make_view(dc.rows.bound.data(), {T});
  const MlaDecodeParams good = params(c, 1, 2, T);

  States s(T, H);
  const States untouched(T, H);
  auto dense = [&](const MlaDecodeParams& p, dcpattn::TensorView<const std::int64_t, 1> len) {
    return error_message_of([&] {
      dcpattn::host::mla_decode_dense(q.view(), cache, c.table(), req, len, p, s.o_view(),
                                      s.lse_view());
    });
  };
  MlaDecodeParams p;  // softmax_scale and num_valid_rows left unset
  p.page_size = 16;
  CHECK(contains(dense(p, bound), "num_valid_rows"));
  p.num_valid_rows = int(T);
  CHECK(contains(dense(p, bound), "softmax_scale"));
  p = good;
  p.num_splits = 3;
  CHECK(contains(dense(p, bound), "num_splits"));
  p = good;
  p.interleave = 3;
  CHECK(contains(dense(p, bound), "page_size"));
  p = good;
  p.num_valid_rows = int(T) + 1;
  CHECK(contains(dense(p, bound), "num_valid_rows"));
  std::vector<std::int64_t> too_long = dc.rows.bound;
  too_long[0] = c.max_pages * c.page_size + 1;
  CHECK(contains(dense(good, dcpattn::make_view(too_long.data(), {T})), "block_table"));
  CHECK(contains(dense(good, dcpattn::make_view(too_long.data(), {T - 1})), "row_local_length"));
  std::vector<std::int32_t> bad_req = dc.rows.request;
  bad_req[1] = 5;
  CHECK(contains(error_message_of([&] {
                   dcpattn::host::mla_decode_dense(q.view(), cache, c.table(),
                                                   dcpattn::make_view(bad_req.data(), {T}), bound,
                                                   good, s.o_view(), s.lse_view());
                 }),
                 "row_request"));
  std::vector<float> small_o(std::size_t(T * (H + 1) * kDv));
  CHECK(contains(error_message_of([&] {
                   dcpattn::host::mla_decode_dense(
                       q.view(), cache, c.table(), req, bound, good,
                       dcpattn::make_view(small_o.data(), {T, H + 1, std::int64_t(kDv)}),
                       s.lse_view());
                 }),
                 "o must be"));
  std::vector<bfloat16> short_q(std::size_t(T * H * 512));
  CHECK(contains(error_message_of([&] {
                   dcpattn::host::mla_decode_dense(
                       dcpattn::make_view(short_q.data(), {T, H, std::int64_t(512)}), cache,
                       c.table(), req, bound, good, s.o_view(), s.lse_view());
                 }),
                 "q must have head dim 576"));
  auto narrow = dcpattn::make_view(c.bf16.data(), {c.num_slots, std::int64_t(512)});
  CHECK(contains(error_message_of([&] {
                   dcpattn::host::mla_decode_dense(q.view(), narrow, c.table(), req, bound, good,
                                                   s.o_view(), s.lse_view());
                 }),
                 "cache"));
  CHECK(bitwise_equal(s, untouched));

  // Sparse: a listed position at or beyond the row's bound, or below -1.
  for (std::int32_t bad : {std::int32_t(dc.rows.bound[1]), std::int32_t(-2)}) {
    std::vector<std::int32_t> topk(std::size_t(T * K), -1);
    topk[std::size_t(0 * K + 1)] = 3;
    topk[std::size_t(1 * K + 2)] = bad;
    const std::string msg = error_message_of([&] {
      dcpattn::host::mla_decode_sparse(q.view(), cache, c.table(), req,
                                       dcpattn::make_view(topk.data(), {T, K}), bound, own, 0, good,
                                       s.o_view(), s.lse_view());
    });
    CAPTURE(msg);
    CHECK(contains(msg, "topk_indices[row 1]"));
    CHECK(contains(msg, "= " + std::to_string(bad)));
  }
  std::vector<std::int32_t> topk(std::size_t(T * K), -1);
  CHECK(contains(error_message_of([&] {
                   dcpattn::host::mla_decode_sparse(q.view(), cache, c.table(), req,
                                                    dcpattn::make_view(topk.data(), {T, K}), bound,
                                                    own, 1, good, s.o_view(), s.lse_view());
                 }),
                 "rank"));
  CHECK(bitwise_equal(s, untouched));
}
