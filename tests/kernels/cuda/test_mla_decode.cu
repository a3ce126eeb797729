// SPDX-License-Identifier: Apache-2.0
// CUDA MLA decode kernels (dcpattn/kernels/cuda/mla_decode.cuh), dense and sparse, bf16 and fp8
// ds_mla caches:
//   - against the host reference kernels on the same inputs and against plain double-precision
//     attention (tolerances below, with their reasons);
//   - query views (row-major, head-major strided, unaligned rows, rank-major gathered, float) and
//     cache views (vector and scalar load paths) give bitwise the same result;
//   - data-dependent checks done in the kernel: bad page ids, requests, lengths, top-k entries;
//   - DCP invariance on the GPU: N ranks with V / N splits give bitwise the split states of one
//     rank with V splits, and their outputs merged in rank order (with the kernels' merge, the
//     arithmetic of the CUDA combine) equal the one-rank output bit for bit;
//   - CUDA-graph capture, and argument checks that throw before anything is launched.
// Every output (and the scratch) is poisoned with NaN before each run.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "support/catch.hpp"

#include "dcpattn/core/fp8_cache.hpp"
#include "dcpattn/core/lse.hpp"
#include "dcpattn/core/numeric.hpp"
#include "dcpattn/core/tensor.hpp"
#include "dcpattn/error.hpp"
#include "dcpattn/gather/query_gather.hpp"
#include "dcpattn/kernels/cache_layout.hpp"
#include "dcpattn/kernels/cuda/mla_decode.cuh"
#include "dcpattn/kernels/host/mla_decode.hpp"
#include "dcpattn/ownership/round_robin.hpp"

namespace {
/// Runs the enclosing test case once per MLA kernel: the warpgroup kernel (what a compute
/// capability 9.x device selects) and the mma.sync kernel (what 8.x devices run).
struct KernelChoice {
  explicit KernelChoice(bool mma_sync) {
    dcpattn::cuda_kernels::detail::mla::force_mma_sync_kernel.store(mma_sync);
  }
  ~KernelChoice() { dcpattn::cuda_kernels::detail::mla::force_mma_sync_kernel.store(false); }
  KernelChoice(const KernelChoice&) = delete;
  KernelChoice& operator=(const KernelChoice&) = delete;
};
}  // namespace

namespace {

using dcpattn::bfloat16;
using dcpattn::CacheFormat;
using dcpattn::MlaDecodeParams;
using dcpattn::RoundRobinOwnership;
using dcpattn::TensorView;

constexpr int kQk = 576;
constexpr int kDv = 512;
constexpr int kEntry = 656;
constexpr int kVirtualShards = 8;
constexpr float kSoftmaxScale = 0.07216878364870322f;  // 1 / sqrt(192)
constexpr double kInf = std::numeric_limits<double>::infinity();

// ---------------------------------------------------------------------------------------------
// Tolerances (per (row, head): relative L2 error of o, absolute error of lse).
//
// The kernel multiplies bf16 operands exactly and accumulates in fp32 on the tensor cores; the
// query and the bf16 cache are exact in bf16, so the scores are fp32-accurate (~1e-6) and so is
// lse (the softmax sum uses the unrounded fp32 probabilities). The probabilities enter P V rounded
// to bf16: relative error <= 2^-9 per weight, ~1.1e-3 RMS, so o is off by ~1e-3 relative (the
// error is a weighted average of the per-weight errors, it does not grow with the length).
// For the fp8 cache the dequantized key (e4m3 * scale) is also rounded to bf16: 2^-9 relative
// per element, i.e. a score error of ~6e-4 RMS (0.072 * sqrt(512) * E|q k| * 2^-9 / sqrt(3)),
// up to ~3e-3 at the tail over thousands of (token, head) pairs, which moves lse by at most that.
// The bounds leave 5-10x; a missing, extra or wrong token moves o by >= 3% relative (one of 1000
// random value vectors of an average whose norm shrinks as 1/sqrt(n)), NaN never passes, and
// neutral states must be exact.
constexpr double kTolO = 1e-2;
constexpr double kTolLseBf16 = 1e-4;
constexpr double kTolLseFp8 = 1e-2;

double lse_tolerance(CacheFormat f) {
  return f == CacheFormat::bf16 ? kTolLseBf16 : kTolLseFp8;
}

// ---------------------------------------------------------------------------------------------
// Device memory

template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t n) : n_(n) {
    DCPATTN_CUDA_CHECK(cudaMalloc(&p_, (n == 0 ? 1 : n) * sizeof(T)));
  }
  explicit DeviceBuffer(const std::vector<T>& h) : DeviceBuffer(h.size()) { upload(h); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(o.n_) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    return *this;
  }
  ~DeviceBuffer() {
    if (p_ != nullptr) cudaFree(p_);
  }
  T* get() const { return p_; }
  std::size_t size() const { return n_; }
  void upload(const std::vector<T>& h) {
    REQUIRE(h.size() == n_);
    if (n_ > 0)
      DCPATTN_CUDA_CHECK(cudaMemcpy(p_, h.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> h(n_);
    if (n_ > 0)
      DCPATTN_CUDA_CHECK(cudaMemcpy(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
  /// All bytes 0xff: NaN for float, -1 for integers.
  void poison() {
    if (n_ > 0) DCPATTN_CUDA_CHECK(cudaMemset(p_, 0xff, n_ * sizeof(T)));
  }

 private:
  T* p_ = nullptr;
  std::size_t n_ = 0;
};

template <class T>
TensorView<const T, 1> view1(const DeviceBuffer<T>& b) {
  return dcpattn::make_view(static_cast<const T*>(b.get()), {std::int64_t(b.size())});
}

void sync_and_check() {
  DCPATTN_CUDA_CHECK(cudaDeviceSynchronize());
  DCPATTN_CUDA_CHECK(cudaGetLastError());
}

// ---------------------------------------------------------------------------------------------
// Plain decoders, written independently of the library.

double bf16_plain(std::uint16_t bits) {
  const std::uint32_t u = std::uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

double e4m3_plain(std::uint8_t b) {
  const int e = (b >> 3) & 15;
  const int m = b & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double mag = e == 0 ? std::ldexp(double(m), -9) : std::ldexp(1.0 + m / 8.0, e - 7);
  return (b & 0x80) ? -mag : mag;
}

double fp8_entry_key_plain(const std::uint8_t* e, int i) {
  if (i < 512) {
    float scale;
    std::memcpy(&scale, e + 512 + 4 * (i / 128), 4);
    return e4m3_plain(e[i]) * double(scale);
  }
  const int j = i - 512;
  return bf16_plain(std::uint16_t(e[528 + 2 * j] | (e[529 + 2 * j] << 8)));
}

bfloat16 random_bf16(std::mt19937_64& rng, float lo, float hi) {
  return bfloat16::from_float(std::uniform_real_distribution<float>(lo, hi)(rng));
}

// ---------------------------------------------------------------------------------------------
// Test data: keys per request, each rank's paged cache built from them.

struct Batch {
  std::vector<std::int64_t> lengths;
  std::vector<std::vector<bfloat16>> tokens;  // per request: (length, 576)
};

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
  CacheFormat format = CacheFormat::bf16;
  int page_size = 64;
  std::int64_t num_slots = 0;
  std::vector<bfloat16> bf16;     // (num_slots, 576)
  std::vector<std::uint8_t> fp8;  // (num_slots, 656)
  std::int64_t num_requests = 0, max_pages = 0;
  std::vector<std::int32_t> block_table;

  dcpattn::TensorView<const std::int32_t, 2> table() const {
    return dcpattn::make_view(block_table.data(), {num_requests, max_pages});
  }
  std::int64_t slot(std::int64_t req, std::int64_t local_pos) const {
    return std::int64_t(block_table[std::size_t(req * max_pages + local_pos / page_size)]) *
               page_size +
           local_pos % page_size;
  }
  double key(std::int64_t s, int i) const {
    return format == CacheFormat::bf16 ? bf16_plain(bf16[std::size_t(s * kQk + i)].bits)
                                       : fp8_entry_key_plain(&fp8[std::size_t(s * kEntry)], i);
  }
};

// Token t of a request goes to rank own.owner(t) at local position own.local_position(t), through
// shuffled pages. Unused slots hold NaN, so reading one shows.
RankCache build_rank_cache(const Batch& b, const RoundRobinOwnership& own, int rank, int page_size,
                           CacheFormat format, std::mt19937_64& rng) {
  RankCache c;
  c.format = format;
  c.page_size = page_size;
  c.num_requests = std::int64_t(b.lengths.size());
  std::vector<std::int64_t> pages_of;
  std::int64_t total_pages = 3;
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

// The device copy of a rank cache. row_stride (elements) > the natural width pads every row, which
// sends the kernel down its scalar load path.
struct DeviceCache {
  CacheFormat format;
  std::int64_t num_slots, row_stride, num_requests, max_pages;
  DeviceBuffer<bfloat16> bf16;
  DeviceBuffer<std::uint8_t> fp8;
  DeviceBuffer<std::int32_t> table;

  explicit DeviceCache(const RankCache& c, std::int64_t stride = 0)
      : format(c.format),
        num_slots(c.num_slots),
        row_stride(stride > 0 ? stride : (c.format == CacheFormat::bf16 ? kQk : kEntry)),
        num_requests(c.num_requests),
        max_pages(c.max_pages),
        table(c.block_table) {
    const int width = format == CacheFormat::bf16 ? kQk : kEntry;
    if (format == CacheFormat::bf16) {
      std::vector<bfloat16> padded(std::size_t(num_slots * row_stride), bfloat16{0x7fc0});
      for (std::int64_t s = 0; s < num_slots; ++s)
        std::copy_n(&c.bf16[std::size_t(s * width)], width, &padded[std::size_t(s * row_stride)]);
      bf16 = DeviceBuffer<bfloat16>(padded);
    } else {
      std::vector<std::uint8_t> padded(std::size_t(num_slots * row_stride), 0xff);
      for (std::int64_t s = 0; s < num_slots; ++s)
        std::copy_n(&c.fp8[std::size_t(s * width)], width, &padded[std::size_t(s * row_stride)]);
      fp8 = DeviceBuffer<std::uint8_t>(padded);
    }
  }
  dcpattn::mla_cache_view_t<CacheFormat::bf16> bf16_view() const {
    return dcpattn::make_view(static_cast<const bfloat16*>(bf16.get()),
                              {num_slots, std::int64_t(kQk)}, {row_stride, std::int64_t(1)});
  }
  dcpattn::mla_cache_view_t<CacheFormat::fp8_ds_mla> fp8_view() const {
    return dcpattn::make_view(static_cast<const std::uint8_t*>(fp8.get()),
                              {num_slots, std::int64_t(kEntry)}, {row_stride, std::int64_t(1)});
  }
  dcpattn::TensorView<const std::int32_t, 2> table_view() const {
    return dcpattn::make_view(static_cast<const std::int32_t*>(table.get()),
                              {num_requests, max_pages});
  }
};

template <class Fn>
void with_device_cache(const DeviceCache& c, Fn&& fn) {
  if (c.format == CacheFormat::bf16)
    fn(c.bf16_view());
  else
    fn(c.fp8_view());
}
template <class Fn>
void with_host_cache(const RankCache& c, Fn&& fn) {
  if (c.format == CacheFormat::bf16)
    fn(dcpattn::make_view(c.bf16.data(), {c.num_slots, std::int64_t(kQk)}));
  else
    fn(dcpattn::make_view(c.fp8.data(), {c.num_slots, std::int64_t(kEntry)}));
}

// ---------------------------------------------------------------------------------------------
// Queries (T, H, 576) in several memory layouts.

enum class QLayout {
  row_major,   // (T, H, 576) contiguous
  head_major,  // (H, T, 576) memory, a strided view
  unaligned,   // row-major with 577-element head rows: rows not 16-byte aligned (scalar path)
  rank_major,  // (N, T, H / N, 576) memory, a GatheredQueryView (the query gather's layout)
};

struct Queries {
  std::int64_t T = 0, H = 0, heads_per_rank = 1;
  QLayout layout = QLayout::row_major;
  std::vector<bfloat16> data;
  DeviceBuffer<bfloat16> device;

  std::int64_t head_stride() const { return layout == QLayout::unaligned ? kQk + 1 : kQk; }
  std::size_t index(std::int64_t t, std::int64_t h, int d) const {
    switch (layout) {
      case QLayout::row_major:
        return std::size_t((t * H + h) * kQk + d);
      case QLayout::head_major:
        return std::size_t((h * T + t) * kQk + d);
      case QLayout::unaligned:
        return std::size_t((t * H + h) * head_stride() + d);
      case QLayout::rank_major: {
        const std::int64_t r = h / heads_per_rank, hh = h % heads_per_rank;
        return std::size_t(((r * T + t) * heads_per_rank + hh) * kQk + d);
      }
    }
    return 0;
  }
  double at(std::int64_t t, std::int64_t h, int d) const {
    return bf16_plain(data[index(t, h, d)].bits);
  }
  // Calls fn(view) with the view of `base` (host or device memory) that matches the layout.
  template <class Fn>
  void with_view(const bfloat16* base, Fn&& fn) const {
    using Ext = cuda::std::dextents<std::int64_t, 3>;
    switch (layout) {
      case QLayout::row_major:
        fn(dcpattn::make_view(base, {T, H, std::int64_t(kQk)}));
        break;
      case QLayout::head_major:
        fn(dcpattn::make_view(base, {T, H, std::int64_t(kQk)},
                              {std::int64_t(kQk), T * kQk, std::int64_t(1)}));
        break;
      case QLayout::unaligned:
        fn(dcpattn::make_view(base, {T, H, std::int64_t(kQk)},
                              {H * head_stride(), head_stride(), std::int64_t(1)}));
        break;
      case QLayout::rank_major:
        fn(dcpattn::GatheredQueryView(
            base, dcpattn::LayoutRankMajorHeads::mapping<Ext>(Ext(T, H, kQk), heads_per_rank)));
        break;
    }
  }
  template <class Fn>
  void with_host_view(Fn&& fn) const {
    with_view(data.data(), fn);
  }
  template <class Fn>
  void with_device_view(Fn&& fn) const {
    with_view(device.get(), fn);
  }
};

// Random queries in [-1, 1]; rows t >= num_valid are NaN (padding must never be read). The random
// values depend on (seed, t, h, d) only, so every layout holds the same query.
Queries make_queries(std::int64_t T, std::int64_t H, std::int64_t num_valid, QLayout layout,
                     std::uint64_t seed, std::int64_t heads_per_rank = 1) {
  Queries q;
  q.T = T;
  q.H = H;
  q.layout = layout;
  q.heads_per_rank = heads_per_rank;
  const std::size_t size = layout == QLayout::unaligned ? std::size_t(T * H * q.head_stride())
                                                        : std::size_t(T * H * kQk);
  q.data.assign(size, bfloat16{0x7fc0});
  std::mt19937_64 rng(seed);
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t h = 0; h < H; ++h)
      for (int d = 0; d < kQk; ++d) {
        const bfloat16 v = random_bf16(rng, -1.0f, 1.0f);
        q.data[q.index(t, h, d)] = t < num_valid ? v : bfloat16{0x7fc0};
      }
  q.device = DeviceBuffer<bfloat16>(q.data);
  return q;
}

// ---------------------------------------------------------------------------------------------
// Rows of a test batch: request and global causal bound of each row, then padding rows.

struct Rows {
  std::vector<std::int32_t> request;
  std::vector<std::int64_t> bound;
  std::int64_t num_valid = 0;
};

struct DenseCase {
  Batch batch;
  Rows rows;
};

// Ragged requests with multi-token rows (speculative: bounds len-2, len-1, len on every other
// request), then padding rows whose request and bound are garbage.
DenseCase make_dense_case(const std::vector<std::int64_t>& lengths, std::int64_t padding,
                          std::mt19937_64& rng) {
  DenseCase c;
  c.batch = make_batch(lengths, rng);
  for (std::size_t r = 0; r < lengths.size(); ++r) {
    const std::int64_t len = lengths[r];
    const int mtp = len >= 3 && r % 2 == 0 ? 3 : 1;
    for (int k = mtp - 1; k >= 0; --k) {
      c.rows.request.push_back(std::int32_t(r));
      c.rows.bound.push_back(len - k);
    }
  }
  c.rows.num_valid = std::int64_t(c.rows.request.size());
  for (std::int64_t i = 0; i < padding; ++i) {
    c.rows.request.push_back(987654);
    c.rows.bound.push_back(-7);
  }
  return c;
}

MlaDecodeParams params(int page_size, int interleave, int num_splits, std::int64_t num_valid) {
  MlaDecodeParams p;
  p.softmax_scale = kSoftmaxScale;
  p.page_size = page_size;
  p.interleave = interleave;
  p.num_splits = num_splits;
  p.num_valid_rows = int(num_valid);
  return p;
}

// Top-k lists: random positions below the bound in random order, with duplicates and -1 gaps;
// row `empty_row` lists nothing.
std::vector<std::int32_t> make_topk(const Rows& rows, std::int64_t T, std::int64_t K,
                                    std::mt19937_64& rng, std::int64_t empty_row = -1) {
  std::vector<std::int32_t> topk(std::size_t(T * K), -1);
  for (std::int64_t t = 0; t < rows.num_valid; ++t) {
    const std::int64_t bound = rows.bound[std::size_t(t)];
    if (bound == 0 || t == empty_row) continue;
    for (std::int64_t k = 0; k < K; ++k) {
      const auto u = rng() % 16;
      std::int32_t g;
      if (u == 0)
        g = -1;
      else if (u == 1 && k > 0)
        g = topk[std::size_t(t * K + std::int64_t(rng() % std::uint64_t(k)))];
      else
        g = std::int32_t(rng() % std::uint64_t(bound));
      topk[std::size_t(t * K + k)] = g;
    }
  }
  return topk;
}

// The list the GPU gets: some -1 entries replaced by values it must treat as -1 (negative, at or
// beyond the row's bound). The host reference gets the clean list (it throws on these).
std::vector<std::int32_t> dirty_topk(const std::vector<std::int32_t>& clean, const Rows& rows,
                                     std::int64_t K, std::mt19937_64& rng) {
  std::vector<std::int32_t> d = clean;
  for (std::int64_t t = 0; t < rows.num_valid; ++t)
    for (std::int64_t k = 0; k < K; ++k) {
      auto& g = d[std::size_t(t * K + k)];
      if (g != -1 || rng() % 2 != 0) continue;
      switch (rng() % 4) {
        case 0:
          g = std::int32_t(rows.bound[std::size_t(t)]);
          break;  // == bound
        case 1:
          g = std::int32_t(rows.bound[std::size_t(t)] + 1 + std::int64_t(rng() % 50));
          break;
        case 2:
          g = -2 - std::int32_t(rng() % 100);
          break;
        default:
          g = std::numeric_limits<std::int32_t>::max();
          break;
      }
    }
  return d;
}

std::vector<std::int64_t> listed_positions(const std::vector<std::int32_t>& topk, std::int64_t t,
                                           std::int64_t K) {
  std::vector<std::int64_t> pos;
  for (std::int64_t k = 0; k < K; ++k)
    if (topk[std::size_t(t * K + k)] >= 0) pos.push_back(topk[std::size_t(t * K + k)]);
  return pos;
}

// ---------------------------------------------------------------------------------------------
// Outputs and references

struct Out {
  std::int64_t T = 0, H = 0;
  std::vector<float> o, lse;
  const float* o_at(std::int64_t t, std::int64_t h) const {
    return &o[std::size_t((t * H + h) * kDv)];
  }
  float lse_at(std::int64_t t, std::int64_t h) const { return lse[std::size_t(t * H + h)]; }
};

bool bitwise_equal(const Out& a, const Out& b) {
  return a.o.size() == b.o.size() && a.lse.size() == b.lse.size() &&
         std::memcmp(a.o.data(), b.o.data(), a.o.size() * sizeof(float)) == 0 &&
         std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float)) == 0;
}

using OutView = TensorView<float, 3>;
using LseView = TensorView<float, 2>;
using Scratch = cuda::std::span<std::byte>;

// Runs `launch(o, lse, scratch)` on NaN-poisoned device outputs and scratch, synchronizes, checks
// for errors and returns the outputs.
template <class Launch>
Out run_gpu(std::int64_t T, std::int64_t H, int num_splits, Launch&& launch) {
  DeviceBuffer<float> o(std::size_t(T * H * kDv)), lse(std::size_t(T * H));
  const std::size_t bytes = dcpattn::cuda_kernels::mla_decode_scratch_bytes(T, int(H), num_splits);
  DeviceBuffer<std::byte> scratch(bytes);
  o.poison();
  lse.poison();
  scratch.poison();
  launch(dcpattn::make_view(o.get(), {T, H, std::int64_t(kDv)}),
         dcpattn::make_view(lse.get(), {T, H}), Scratch(scratch.get(), bytes));
  sync_and_check();
  return Out{T, H, o.download(), lse.download()};
}

struct DeviceRows {
  DeviceBuffer<std::int32_t> request;
  DeviceBuffer<std::int64_t> bound;
  explicit DeviceRows(const Rows& r) : request(r.request), bound(r.bound) {}
};

Out gpu_dense(const Queries& q, const DeviceCache& c, const DeviceRows& rows,
              const DeviceBuffer<std::int64_t>& local_length, const MlaDecodeParams& p) {
  return run_gpu(q.T, q.H, p.num_splits, [&](OutView o, LseView lse, Scratch s) {
    q.with_device_view([&](const auto& qv) {
      with_device_cache(c, [&](const auto& cache) {
        dcpattn::cuda_kernels::mla_decode_dense(qv, cache, c.table_view(), view1(rows.request),
                                                view1(local_length), p, o, lse, s, nullptr);
      });
    });
  });
}

Out gpu_sparse(const Queries& q, const DeviceCache& c, const DeviceRows& rows,
               const DeviceBuffer<std::int32_t>& topk, std::int64_t K,
               const RoundRobinOwnership& own, int rank, const MlaDecodeParams& p) {
  auto tk = dcpattn::make_view(static_cast<const std::int32_t*>(topk.get()), {q.T, K});
  return run_gpu(q.T, q.H, p.num_splits, [&](OutView o, LseView lse, Scratch s) {
    q.with_device_view([&](const auto& qv) {
      with_device_cache(c, [&](const auto& cache) {
        dcpattn::cuda_kernels::mla_decode_sparse(qv, cache, c.table_view(), view1(rows.request), tk,
                                                 view1(rows.bound), own, rank, p, o, lse, s,
                                                 nullptr);
      });
    });
  });
}

Out host_dense(const Queries& q, const RankCache& c, const Rows& rows,
               const std::vector<std::int64_t>& local_length, const MlaDecodeParams& p) {
  Out s{q.T, q.H, std::vector<float>(std::size_t(q.T * q.H * kDv)),
        std::vector<float>(std::size_t(q.T * q.H))};
  auto req = dcpattn::make_view(rows.request.data(), {std::int64_t(rows.request.size())});
  auto len = dcpattn::make_view(local_length.data(), {std::int64_t(local_length.size())});
  q.with_host_view([&](const auto& qv) {
    with_host_cache(c, [&](const auto& cache) {
      dcpattn::host::mla_decode_dense(qv, cache, c.table(), req, len, p,
                                      dcpattn::make_view(s.o.data(), {q.T, q.H, std::int64_t(kDv)}),
                                      dcpattn::make_view(s.lse.data(), {q.T, q.H}));
    });
  });
  return s;
}

Out host_sparse(const Queries& q, const RankCache& c, const Rows& rows,
                const std::vector<std::int32_t>& topk, std::int64_t K,
                const RoundRobinOwnership& own, int rank, const MlaDecodeParams& p) {
  Out s{q.T, q.H, std::vector<float>(std::size_t(q.T * q.H * kDv)),
        std::vector<float>(std::size_t(q.T * q.H))};
  auto req = dcpattn::make_view(rows.request.data(), {std::int64_t(rows.request.size())});
  auto bound = dcpattn::make_view(rows.bound.data(), {std::int64_t(rows.bound.size())});
  auto tk = dcpattn::make_view(topk.data(), {q.T, K});
  q.with_host_view([&](const auto& qv) {
    with_host_cache(c, [&](const auto& cache) {
      dcpattn::host::mla_decode_sparse(
          qv, cache, c.table(), req, tk, bound, own, rank, p,
          dcpattn::make_view(s.o.data(), {q.T, q.H, std::int64_t(kDv)}),
          dcpattn::make_view(s.lse.data(), {q.T, q.H}));
    });
  });
  return s;
}

// Plain double-precision attention of row t over explicit positions of an N = 1 cache.
struct RefState {
  std::vector<double> o;    // (H, 512)
  std::vector<double> lse;  // (H,), -inf when the list is empty
};

RefState reference_row(const RankCache& c1, const Queries& q, std::int64_t t, std::int64_t req,
                       const std::vector<std::int64_t>& positions) {
  const std::size_t n = positions.size();
  std::vector<double> keys(n * kQk);
  for (std::size_t k = 0; k < n; ++k) {
    const std::int64_t s = c1.slot(req, positions[k]);
    for (int d = 0; d < kQk; ++d) keys[k * kQk + d] = c1.key(s, d);
  }
  RefState r;
  r.o.assign(std::size_t(q.H * kDv), 0.0);
  r.lse.assign(std::size_t(q.H), -kInf);
  if (n == 0) return r;
  std::vector<double> sc(n), qh(kQk);
  for (std::int64_t h = 0; h < q.H; ++h) {
    for (int d = 0; d < kQk; ++d) qh[std::size_t(d)] = q.at(t, h, d);
    double m = -kInf;
    for (std::size_t k = 0; k < n; ++k) {
      double dot = 0.0;
      for (int d = 0; d < kQk; ++d) dot += qh[std::size_t(d)] * keys[k * kQk + d];
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

// Worst errors seen and counts of hard failures (checked once per test case: a REQUIRE per
// element would dominate the run time).
struct Stats {
  double o = 0.0, lse = 0.0;
  std::int64_t bad_neutral = 0, non_finite = 0, compared = 0;
};

// Compares the GPU state (t, h) with a reference state: an empty reference (lse = -inf) must be
// met by exactly the neutral state; otherwise everything must be finite, and the errors are
// recorded.
template <class RefT>
void compare_state(const Out& g, std::int64_t t, std::int64_t h, const RefT* o_ref, double lse_ref,
                   Stats& st) {
  const float* o = g.o_at(t, h);
  const float lse = g.lse_at(t, h);
  ++st.compared;
  if (std::isinf(lse_ref) && lse_ref < 0) {
    bool ok = lse == dcpattn::lse_neg_inf;
    for (int d = 0; d < kDv; ++d) ok = ok && o[d] == 0.0f;
    if (!ok) ++st.bad_neutral;
    return;
  }
  bool finite = std::isfinite(lse);
  double num = 0.0, den = 0.0;
  for (int d = 0; d < kDv; ++d) {
    finite = finite && std::isfinite(o[d]);
    const double e = double(o[d]) - double(o_ref[d]);
    num += e * e;
    den += double(o_ref[d]) * double(o_ref[d]);
  }
  if (!finite) {
    ++st.non_finite;
    return;
  }
  st.o = std::max(st.o, std::sqrt(num) / std::max(std::sqrt(den), 1e-30));
  st.lse = std::max(st.lse, std::fabs(double(lse) - lse_ref));
}

void compare_with_host(const Out& g, const Out& host, std::int64_t num_valid, Stats& st) {
  for (std::int64_t t = 0; t < num_valid; ++t)
    for (std::int64_t h = 0; h < g.H; ++h)
      compare_state(g, t, h, host.o_at(t, h), double(host.lse_at(t, h)), st);
}
void compare_with_reference(const Out& g, std::int64_t t, const RefState& r, Stats& st) {
  for (std::int64_t h = 0; h < g.H; ++h)
    compare_state(g, t, h, &r.o[std::size_t(h * kDv)], r.lse[std::size_t(h)], st);
}
// Padding rows must hold exactly the neutral state.
void check_padding(const Out& g, std::int64_t num_valid, Stats& st) {
  const RefState empty{std::vector<double>(std::size_t(g.H * kDv), 0.0),
                       std::vector<double>(std::size_t(g.H), -kInf)};
  for (std::int64_t t = num_valid; t < g.T; ++t) compare_with_reference(g, t, empty, st);
}

// One GPU call checked three ways: against the host kernel, against the double-precision
// reference of each valid row, and the padding rows against the neutral state.
void check_call(const Out& g, const Out& host, std::int64_t num_valid,
                const std::vector<RefState>& ref, Stats& vs_host, Stats& vs_ref) {
  compare_with_host(g, host, num_valid, vs_host);
  for (std::int64_t t = 0; t < num_valid; ++t)
    compare_with_reference(g, t, ref[std::size_t(t)], vs_ref);
  check_padding(g, num_valid, vs_ref);
}

// The double-precision reference of every valid dense row of `dc` (positions 0 .. bound - 1).
std::vector<RefState> dense_reference(const RankCache& c, const Queries& q, const DenseCase& dc) {
  std::vector<RefState> ref;
  for (std::int64_t t = 0; t < dc.rows.num_valid; ++t) {
    std::vector<std::int64_t> pos(static_cast<std::size_t>(dc.rows.bound[std::size_t(t)]));
    std::iota(pos.begin(), pos.end(), 0);
    ref.push_back(reference_row(c, q, t, dc.rows.request[std::size_t(t)], pos));
  }
  return ref;
}

// The GPU and host dense kernels at each of `splits` (pages of 64 tokens, `interleave`), checked
// against each other and the reference.
void check_dense_splits(const Queries& q, const RankCache& c, const DeviceCache& dcache,
                        const DenseCase& dc, const DeviceRows& drows,
                        const std::vector<std::int64_t>& local_length,
                        const DeviceBuffer<std::int64_t>& dlen, int interleave,
                        std::initializer_list<int> splits, const std::vector<RefState>& ref,
                        Stats& vs_host, Stats& vs_ref) {
  for (int num_splits : splits) {
    CAPTURE(q.H, interleave, num_splits);
    const MlaDecodeParams p = params(64, interleave, num_splits, dc.rows.num_valid);
    const Out g = gpu_dense(q, dcache, drows, dlen, p);
    const Out h = host_dense(q, c, dc.rows, local_length, p);
    check_call(g, h, dc.rows.num_valid, ref, vs_host, vs_ref);
  }
}

void require_stats(const char* what, const Stats& st, double tol_o, double tol_lse) {
  std::printf("  %-44s %8lld states: max rel L2(o) = %.3e, max |dlse| = %.3e\n", what,
              static_cast<long long>(st.compared), st.o, st.lse);
  INFO(what << ": max rel L2(o) = " << st.o << ", max |lse - ref| = " << st.lse
            << ", bad neutral states = " << st.bad_neutral << ", non-finite = " << st.non_finite);
  CHECK(st.bad_neutral == 0);
  CHECK(st.non_finite == 0);
  CHECK(st.o <= tol_o);
  CHECK(st.lse <= tol_lse);
}

const char* format_name(CacheFormat f) {
  return f == CacheFormat::bf16 ? "bf16" : "fp8";
}

}  // namespace

// =============================================================================================

TEST_CASE("CUDA dense MLA decode matches the host kernel and double-precision attention",
          "[cuda][mla][dense]") {
  const bool mma_sync = GENERATE(false, true);
  const KernelChoice kernel_choice(mma_sync);
  INFO("kernel: " << (mma_sync ? "mma.sync" : "wgmma"));
  std::mt19937_64 rng(20260301);
  const std::vector<std::int64_t> lengths{0, 1, 63, 64, 65, 1000};
  const DenseCase dc = make_dense_case(lengths, 2, rng);
  const std::int64_t T = std::int64_t(dc.rows.request.size());
  const DeviceRows drows(dc.rows);
  std::vector<std::int64_t> local_length = dc.rows.bound;  // N = 1: local = global; padding -7
  const DeviceBuffer<std::int64_t> dlen(local_length);
  for (CacheFormat format : {CacheFormat::bf16, CacheFormat::fp8_ds_mla}) {
    Stats vs_host, vs_ref;
    // H <= 16 runs the narrow (transposed) wgmma kernel, 24 the wide one with 40 padding rows.
    for (std::int64_t H : {1, 16, 24, 128}) {
      // H = 16 reads a head-major strided view, the others row-major.
      const Queries q = make_queries(T, H, dc.rows.num_valid,
                                     H == 16 ? QLayout::head_major : QLayout::row_major, rng());
      const std::vector<RefState> ref = dense_reference(
          build_rank_cache(dc.batch, RoundRobinOwnership(1, 1), 0, 64, format, rng), q, dc);
      for (int page_size : {64, 16}) {
        const RankCache c1 =
            build_rank_cache(dc.batch, RoundRobinOwnership(1, 1), 0, page_size, format, rng);
        const DeviceCache d1(c1);
        for (int interleave : {1, 16}) {
          if (H > 16 && interleave != 1) continue;  // keeps the host reference time down
          for (int num_splits : {1, 2, 8}) {
            CAPTURE(format_name(format), H, page_size, interleave, num_splits);
            const MlaDecodeParams p = params(page_size, interleave, num_splits, dc.rows.num_valid);
            const Out g = gpu_dense(q, d1, drows, dlen, p);
            const Out h = host_dense(q, c1, dc.rows, local_length, p);
            check_call(g, h, dc.rows.num_valid, ref, vs_host, vs_ref);
          }
        }
      }
    }
    CAPTURE(format_name(format));
    require_stats(format == CacheFormat::bf16 ? "dense bf16 vs host" : "dense fp8 vs host", vs_host,
                  kTolO, lse_tolerance(format));
    require_stats(format == CacheFormat::bf16 ? "dense bf16 vs double" : "dense fp8 vs double",
                  vs_ref, kTolO, lse_tolerance(format));
  }
}

// The narrow fp8 kernel applies the group scales outside its products: in fp32 to the scores,
// and folded into f16 weights with a running largest scale exponent per group, whose growth
// rescales the accumulated values. Uniform keys give every token the same scale exponent, so this
// case spreads them: the latent groups of token t are scaled by 2^(t / 64 mod 9 - 6 + g - 2)
// (growing from tile to tile within a split, and different per group), every 7th token's group 3
// by 2^-20 more (weights below f16's normal range), every 11th token's group 1 is zero (scale 0);
// the query heads' latent parts are scaled by 2^(h mod 5 - 2) (a different f16 factor per head).
TEST_CASE("CUDA dense fp8 MLA decode with scales and query magnitudes over many octaves",
          "[cuda][mla][dense][fp8]") {
  if (!dcpattn::cuda_kernels::detail::mla::use_wgmma_kernel()) {
    // The mma.sync kernel (8.x) rounds each key to bf16: its score errors grow with these
    // magnitudes beyond the tolerances, and it has no folded scales to test.
    std::printf("  narrow fp8 kernel not used on this device: case not applicable\n");
    return;
  }
  std::mt19937_64 rng(20261130);
  const std::vector<std::int64_t> lengths{1, 65, 700, 1000};
  DenseCase dc = make_dense_case(lengths, 1, rng);
  for (std::size_t r = 0; r < lengths.size(); ++r) {
    auto& toks = dc.batch.tokens[r];
    for (std::int64_t t = 0; t < lengths[r]; ++t) {
      for (int g = 0; g < 4; ++g) {
        int e = int((t / 64) % 9) - 6 + g - 2;
        if (g == 3 && t % 7 == 0) e -= 20;
        for (int d = 128 * g; d < 128 * g + 128; ++d) {
          bfloat16& x = toks[std::size_t(t * kQk + d)];
          x = bfloat16::from_float(g == 1 && t % 11 == 0 ? 0.0f : std::ldexp(x.to_float(), e));
        }
      }
    }
  }
  const std::int64_t T = std::int64_t(dc.rows.request.size());
  const DeviceRows drows(dc.rows);
  std::vector<std::int64_t> local_length = dc.rows.bound;
  const DeviceBuffer<std::int64_t> dlen(local_length);
  Stats vs_host, vs_ref;
  for (std::int64_t H : {1, 16}) {
    Queries q = make_queries(T, H, dc.rows.num_valid, QLayout::row_major, rng());
    for (std::int64_t t = 0; t < dc.rows.num_valid; ++t)
      for (std::int64_t h = 0; h < H; ++h)
        for (int d = 0; d < 512; ++d) {
          bfloat16& x = q.data[q.index(t, h, d)];
          x = bfloat16::from_float(std::ldexp(x.to_float(), int(h % 5) - 2));
        }
    q.device = DeviceBuffer<bfloat16>(q.data);
    const RankCache c1 =
        build_rank_cache(dc.batch, RoundRobinOwnership(1, 1), 0, 64, CacheFormat::fp8_ds_mla, rng);
    const DeviceCache d1(c1);
    check_dense_splits(q, c1, d1, dc, drows, local_length, dlen, 1, {1, 2, 8},
                       dense_reference(c1, q, dc), vs_host, vs_ref);
  }
  require_stats("dense fp8, spread scales vs host", vs_host, kTolO, kTolLseFp8);
  require_stats("dense fp8, spread scales vs double", vs_ref, kTolO, kTolLseFp8);
}

// Many splits over a grid that covers the GPU: the 16-head fp8 kernel then copies each split's
// block-table entries into shared memory ahead, four tiles' at a time (mla_wg_kernel's kTableRing
// instantiation: tiles of one page, entries 8 pages apart or more, CTAs for at least 3/4 of the
// multiprocessors). 6 requests give 12 rows (three per even request): 192 CTAs at S = 16, 768 at
// S = 64 (the ring on a GPU of up to 256 multiprocessors), 96 at S = 8; partial tiles included.
// The 12000-token request's splits at S = 16 have 12 tiles, so the ring's eight entries are
// refilled and read again.
TEST_CASE("CUDA dense fp8 MLA decode at 16 heads over many splits and a full grid",
          "[cuda][mla][dense][fp8]") {
  std::mt19937_64 rng(20261201);
  const std::vector<std::int64_t> lengths{5000, 4200, 4097, 1100, 6000, 12000};
  const DenseCase dc = make_dense_case(lengths, 1, rng);
  const std::int64_t T = std::int64_t(dc.rows.request.size());
  const DeviceRows drows(dc.rows);
  std::vector<std::int64_t> local_length = dc.rows.bound;
  const DeviceBuffer<std::int64_t> dlen(local_length);
  const RankCache c1 =
      build_rank_cache(dc.batch, RoundRobinOwnership(1, 1), 0, 64, CacheFormat::fp8_ds_mla, rng);
  const DeviceCache d1(c1);
  Stats vs_host, vs_ref;
  for (std::int64_t H : {16, 5}) {
    const Queries q = make_queries(T, H, dc.rows.num_valid, QLayout::row_major, rng());
    check_dense_splits(q, c1, d1, dc, drows, local_length, dlen, 64, {16, 8, 64},
                       dense_reference(c1, q, dc), vs_host, vs_ref);
  }
  require_stats("dense fp8, many splits vs host", vs_host, kTolO, kTolLseFp8);
  require_stats("dense fp8, many splits vs double", vs_ref, kTolO, kTolLseFp8);
}

// bf16 split states (MlaDecodeParams::bf16_split_states, fast mode). Where they apply (the 64-head
// warpgroup kernels: wgmma and more than 16 heads) the kernel writes each split's values as bf16
// and both merge kernels read them (2, 8 states: the row kernel; 16, 64: the many-state kernel);
// 100 heads leave a partial head block, whose rows past the heads write nothing. The merged lse
// comes from the same fp32 lse values, so it must equal the fp32-state call's bit for bit; o may
// differ by the bf16 rounding of each state (relative error 2^-9 a value). Elsewhere (16 heads,
// the mma.sync kernel) the option changes nothing: the outputs are bitwise the same.
TEST_CASE("CUDA MLA decode with bf16 split states: the same lse, o within bf16 rounding",
          "[cuda][mla][bf16_states]") {
  const bool mma_sync = GENERATE(false, true);
  const KernelChoice kernel_choice(mma_sync);
  INFO("kernel: " << (mma_sync ? "mma.sync" : "wgmma"));
  std::mt19937_64 rng(20261202);
  const DenseCase dc = make_dense_case({1, 64, 700, 3000}, 1, rng);
  const std::int64_t T = std::int64_t(dc.rows.request.size());
  const std::int64_t K = 300;
  const std::vector<std::int32_t> topk = make_topk(dc.rows, T, K, rng);
  const DeviceBuffer<std::int32_t> dtopk(topk);
  const DeviceRows drows(dc.rows);
  const DeviceBuffer<std::int64_t> dlen(dc.rows.bound);
  const RoundRobinOwnership own1(1, 64, kVirtualShards);
  double worst_o = 0.0;
  for (CacheFormat format : {CacheFormat::bf16, CacheFormat::fp8_ds_mla}) {
    const RankCache c1 = build_rank_cache(dc.batch, own1, 0, 64, format, rng);
    const DeviceCache d1(c1);
    for (std::int64_t H : {16, 100, 128}) {
      const Queries q = make_queries(T, H, dc.rows.num_valid, QLayout::row_major, rng());
      const bool applies = !mma_sync && H > 16;
      for (bool sparse : {false, true}) {
        for (int num_splits : {2, 8, 16, 64}) {
          if (sparse && num_splits > kVirtualShards) continue;
          CAPTURE(format_name(format), H, sparse, num_splits);
          MlaDecodeParams p = params(64, 64, num_splits, dc.rows.num_valid);
          const auto call = [&](const MlaDecodeParams& pp) {
            return sparse ? gpu_sparse(q, d1, drows, dtopk, K, own1, 0, pp)
                          : gpu_dense(q, d1, drows, dlen, pp);
          };
          const Out f32 = call(p);
          p.bf16_split_states = true;
          const Out b16 = call(p);
          if (!applies) {
            REQUIRE(bitwise_equal(f32, b16));
            continue;
          }
          std::int64_t lse_differs = 0, not_finite = 0;
          double worst_here = 0.0;
          for (std::int64_t t = 0; t < T; ++t)
            for (std::int64_t h = 0; h < H; ++h) {
              const float l32 = f32.lse_at(t, h), l16 = b16.lse_at(t, h);
              if (std::memcmp(&l32, &l16, sizeof l32) != 0) ++lse_differs;
              double num = 0.0, den = 0.0;
              for (int d = 0; d < kDv; ++d) {
                const double x = f32.o_at(t, h)[d], y = b16.o_at(t, h)[d];
                if (!std::isfinite(y)) ++not_finite;
                num += (x - y) * (x - y);
                den += x * x;
              }
              worst_here = std::max(worst_here, den > 0.0 ? std::sqrt(num / den) : std::sqrt(num));
            }
          CHECK(lse_differs == 0);
          CHECK(not_finite == 0);
          CHECK(worst_here <= 4e-3);
          worst_o = std::max(worst_o, worst_here);
        }
      }
    }
  }
  if (!mma_sync) {
    std::printf("  bf16 split states: max rel L2(o) against fp32 states = %.3e\n", worst_o);
    REQUIRE(worst_o > 0.0);  // the states were rounded: the option took effect
  }
}

TEST_CASE("CUDA sparse MLA decode matches the host kernel and double-precision attention",
          "[cuda][mla][sparse]") {
  const bool mma_sync = GENERATE(false, true);
  const KernelChoice kernel_choice(mma_sync);
  INFO("kernel: " << (mma_sync ? "mma.sync" : "wgmma"));
  std::mt19937_64 rng(99);
  const std::vector<std::int64_t> lengths{0, 1, 63, 64, 65, 1000};
  const DenseCase dc = make_dense_case(lengths, 1, rng);
  const std::int64_t T = std::int64_t(dc.rows.request.size());
  // 600 entries: with one split a row keeps ~560, i.e. 9 tiles, 3 gather rounds and a wrap of
  // the kernel's 512-entry ring; short rows list the same few positions many times.
  const std::int64_t K = 600;
  // Row 1 (request 1, bound 1) lists nothing: the neutral state.
  const std::vector<std::int32_t> topk = make_topk(dc.rows, T, K, rng, /*empty_row=*/1);
  const std::vector<std::int32_t> gpu_list = dirty_topk(topk, dc.rows, K, rng);
  const DeviceBuffer<std::int32_t> dtopk(gpu_list);
  const DeviceRows drows(dc.rows);
  for (CacheFormat format : {CacheFormat::bf16, CacheFormat::fp8_ds_mla}) {
    Stats vs_host, vs_ref;
    for (std::int64_t H : {1, 16, 24, 128}) {
      const Queries q = make_queries(T, H, dc.rows.num_valid,
                                     H == 1 ? QLayout::head_major : QLayout::row_major, rng());
      std::vector<RefState> ref;
      {
        const RankCache c =
            build_rank_cache(dc.batch, RoundRobinOwnership(1, 1), 0, 64, format, rng);
        for (std::int64_t t = 0; t < dc.rows.num_valid; ++t)
          ref.push_back(reference_row(c, q, t, dc.rows.request[std::size_t(t)],
                                      listed_positions(topk, t, K)));
      }
      for (int page_size : {64, 16}) {
        for (int interleave : {1, 16}) {
          if (H > 16 && interleave != 1) continue;
          const RoundRobinOwnership own1(1, interleave, kVirtualShards);
          const RankCache c1 = build_rank_cache(dc.batch, own1, 0, page_size, format, rng);
          const DeviceCache d1(c1);
          // Splits of positions (deterministic mode), and runs of the list (fast mode's
          // split_topk_list; 64 splits: runs of 10 entries, one tile's worth or less).
          for (const auto& [num_splits, list_splits] :
               {std::pair{1, false}, std::pair{2, false}, std::pair{8, false}, std::pair{8, true},
                std::pair{64, true}}) {
            if (H > 16 && num_splits == 2) continue;
            CAPTURE(format_name(format), H, page_size, interleave, num_splits, list_splits);
            MlaDecodeParams p = params(page_size, interleave, num_splits, dc.rows.num_valid);
            p.split_topk_list = list_splits;
            const Out g = gpu_sparse(q, d1, drows, dtopk, K, own1, 0, p);
            const Out h = host_sparse(q, c1, dc.rows, topk, K, own1, 0, p);
            check_call(g, h, dc.rows.num_valid, ref, vs_host, vs_ref);
          }
        }
      }
    }
    require_stats(format == CacheFormat::bf16 ? "sparse bf16 vs host" : "sparse fp8 vs host",
                  vs_host, kTolO, lse_tolerance(format));
    require_stats(format == CacheFormat::bf16 ? "sparse bf16 vs double" : "sparse fp8 vs double",
                  vs_ref, kTolO, lse_tolerance(format));
  }
}

TEST_CASE("CUDA MLA decode gives the same bits for every query and cache layout",
          "[cuda][mla][layout]") {
  const bool mma_sync = GENERATE(false, true);
  const KernelChoice kernel_choice(mma_sync);
  INFO("kernel: " << (mma_sync ? "mma.sync" : "wgmma"));
  // The arithmetic reads q and the cache through shared memory, so the layout (strided, rank-major
  // gathered, unaligned rows on the scalar path, float q rounded to bf16, padded cache rows on the
  // scalar load path, pages of 64 whose full tiles 64 heads copy with the tensor memory
  // accelerator) must not change a single bit.
  std::mt19937_64 rng(4242);
  const DenseCase dc = make_dense_case({1, 64, 130, 300}, 1, rng);
  const std::int64_t T = std::int64_t(dc.rows.request.size());
  const std::int64_t K = 100;
  const std::vector<std::int32_t> topk = make_topk(dc.rows, T, K, rng);
  const DeviceBuffer<std::int32_t> dtopk(topk);
  const DeviceRows drows(dc.rows);
  const DeviceBuffer<std::int64_t> dlen(dc.rows.bound);
  const RoundRobinOwnership own1(1, 1, kVirtualShards);
  const std::uint64_t seed = rng();
  for (std::int64_t H : {16, 64}) {
    const std::int64_t hl = H / 4;
    const Queries q_row = make_queries(T, H, dc.rows.num_valid, QLayout::row_major, seed);
    const Queries q_head = make_queries(T, H, dc.rows.num_valid, QLayout::head_major, seed);
    const Queries q_unal = make_queries(T, H, dc.rows.num_valid, QLayout::unaligned, seed);
    const Queries q_rank = make_queries(T, H, dc.rows.num_valid, QLayout::rank_major, seed, hl);
    // float copy of the row-major query (exactly representable, so the bf16 rounding is exact)
    std::vector<float> qf(q_row.data.size());
    for (std::size_t i = 0; i < qf.size(); ++i) qf[i] = q_row.data[i].to_float();
    const DeviceBuffer<float> dqf(qf);
    const auto qf_view =
        dcpattn::make_view(static_cast<const float*>(dqf.get()), {T, H, std::int64_t(kQk)});
    for (CacheFormat format : {CacheFormat::bf16, CacheFormat::fp8_ds_mla}) {
      const RankCache c1 = build_rank_cache(dc.batch, own1, 0, 16, format, rng);
      const DeviceCache d1(c1);
      const DeviceCache d1_padded(c1, format == CacheFormat::bf16 ? kQk + 4 : kEntry + 4);
      // The same tokens in pages of 64 (the cache's contents come from the batch, not from rng).
      const DeviceCache d64(build_rank_cache(dc.batch, own1, 0, 64, format, rng));
      for (int num_splits : {1, 4}) {
        CAPTURE(H, format_name(format), num_splits);
        const MlaDecodeParams p = params(16, 1, num_splits, dc.rows.num_valid);
        const Out dense = gpu_dense(q_row, d1, drows, dlen, p);
        CHECK(bitwise_equal(dense, gpu_dense(q_head, d1, drows, dlen, p)));
        CHECK(bitwise_equal(dense, gpu_dense(q_unal, d1, drows, dlen, p)));
        CHECK(bitwise_equal(dense, gpu_dense(q_rank, d1, drows, dlen, p)));
        CHECK(bitwise_equal(dense, gpu_dense(q_row, d1_padded, drows, dlen, p)));
        CHECK(bitwise_equal(dense, gpu_dense(q_row, d64, drows, dlen,
                                             params(64, 1, num_splits, dc.rows.num_valid))));
        if (format == CacheFormat::bf16) {
          const Out f = run_gpu(T, H, num_splits, [&](OutView o, LseView lse, Scratch s) {
            dcpattn::cuda_kernels::mla_decode_dense(qf_view, d1.bf16_view(), d1.table_view(),
                                                    view1(drows.request), view1(dlen), p, o, lse, s,
                                                    nullptr);
          });
          CHECK(bitwise_equal(dense, f));
        }
        const Out sparse = gpu_sparse(q_row, d1, drows, dtopk, K, own1, 0, p);
        CHECK(bitwise_equal(sparse, gpu_sparse(q_rank, d1, drows, dtopk, K, own1, 0, p)));
        CHECK(bitwise_equal(sparse, gpu_sparse(q_unal, d1_padded, drows, dtopk, K, own1, 0, p)));
        // The rank-major view also against the host reference reading the same layout.
        Stats st;
        compare_with_host(gpu_dense(q_rank, d1, drows, dlen, p),
                          host_dense(q_rank, c1, dc.rows, dc.rows.bound, p), dc.rows.num_valid, st);
        require_stats("rank-major q vs host", st, kTolO, lse_tolerance(format));
      }
    }
  }
}

TEST_CASE("CUDA MLA decode skips bad page ids, requests and lengths without reading them",
          "[cuda][mla][bounds]") {
  const bool mma_sync = GENERATE(false, true);
  const KernelChoice kernel_choice(mma_sync);
  INFO("kernel: " << (mma_sync ? "mma.sync" : "wgmma"));
  std::mt19937_64 rng(77);
  const int page = 64;
  // req 0: 256 tokens (4 pages), req 1: 128 tokens (2 pages).
  const Batch batch = make_batch({256, 128}, rng);
  RankCache c1 =
      build_rank_cache(batch, RoundRobinOwnership(1, 1), 0, page, CacheFormat::bf16, rng);
  REQUIRE(c1.max_pages == 5);
  const RankCache clean = c1;  // the reference reads keys through the clean table
  c1.block_table[std::size_t(0 * c1.max_pages + 1)] = 1 << 30;  // req 0 page 1: beyond the cache
  c1.block_table[std::size_t(1 * c1.max_pages + 1)] = -3;       // req 1 page 1: negative
  // 16 heads run the narrow kernel; 64 the wide one, whose full tiles of pages of 64 at one split
  // are tensor copies: a bad page must send its tiles down the checked path.
  const std::int64_t H = GENERATE(16, 64);
  CAPTURE(H);
  Rows rows;
  rows.request = {0, 0, 1, 7, 1, -1};
  rows.bound = {256, 400, 128, 10, -5, 50};  // 400: pages 4.. (table entry -1) and beyond max_pages
  rows.num_valid = 6;
  const std::int64_t T = 6;
  std::vector<std::vector<std::int64_t>> expected(static_cast<std::size_t>(T));
  for (std::int64_t p = 0; p < 256; ++p)
    if (p / page != 1) expected[0].push_back(p);
  expected[1] = expected[0];
  for (std::int64_t p = 0; p < 64; ++p) expected[2].push_back(p);
  // rows 3 (request 7 of 2), 4 (negative length), 5 (request -1): neutral.
  const Queries q = make_queries(T, H, T, QLayout::row_major, rng());
  const DeviceCache d1(c1);
  const DeviceRows drows(rows);
  const DeviceBuffer<std::int64_t> dlen(rows.bound);
  // Sparse: each row lists every position below its bound once, in a shuffled order.
  const std::int64_t K = 420;
  std::vector<std::int32_t> topk(std::size_t(T * K), -1);
  for (std::int64_t t = 0; t < T; ++t) {
    std::vector<std::int32_t> all;
    for (std::int64_t p = 0; p < std::min<std::int64_t>(rows.bound[std::size_t(t)], K); ++p)
      all.push_back(std::int32_t(p));
    std::shuffle(all.begin(), all.end(), rng);
    std::copy(all.begin(), all.end(), &topk[std::size_t(t * K)]);
  }
  const DeviceBuffer<std::int32_t> dtopk(topk);
  Stats st;
  for (int num_splits : {1, 2}) {
    CAPTURE(num_splits);
    const MlaDecodeParams p = params(page, 1, num_splits, T);
    const Out gd = gpu_dense(q, d1, drows, dlen, p);
    const Out gs = gpu_sparse(q, d1, drows, dtopk, K, RoundRobinOwnership(1, 1), 0, p);
    for (std::int64_t t = 0; t < T; ++t) {
      const std::int64_t req = rows.request[std::size_t(t)];
      const RefState r =
          reference_row(clean, q, t, req < 0 || req > 1 ? 0 : req, expected[std::size_t(t)]);
      compare_with_reference(gd, t, r, st);
      // Sparse row 1 lists positions 0..399 but its bound (400) leaves the out-of-table ones to
      // the page check, as in the dense row: same expected set.
      compare_with_reference(gs, t, r, st);
    }
  }
  require_stats("bad pages / requests / lengths vs double", st, kTolO, kTolLseBf16);
}

TEST_CASE("CUDA MLA decode reads a tile that spans pages page by page", "[cuda][mla][bounds]") {
  // With pages of 16, a tile of 64 positions spans 4 pages. Here they are pages A, B, C, A + 3:
  // the tile's first and last slots are 63 apart, as in a run of one page, but its middle comes
  // from B and C. The kernels copy a tile whole (tensor or bulk copies) only where the launch
  // makes every tile a run of one page (pages of a multiple of 64), never on that check alone:
  // this layout must read B and C.
  std::mt19937_64 rng(2024);
  const Batch batch = make_batch({256}, rng);
  for (CacheFormat format : {CacheFormat::bf16, CacheFormat::fp8_ds_mla}) {
    CAPTURE(format_name(format));
    RankCache c1 = build_rank_cache(batch, RoundRobinOwnership(1, 1), 0, 16, format, rng);
    std::vector<std::int32_t> pages(c1.block_table.begin(), c1.block_table.begin() + 16);
    REQUIRE(std::find(pages.begin(), pages.end(), -1) == pages.end());
    std::int32_t a = -1;
    for (std::int32_t pg : pages)
      if (pg != 0 && std::find(pages.begin(), pages.end(), pg + 3) != pages.end() &&
          std::find(pages.begin(), pages.end(), pg + 1) != pages.end() &&
          std::find(pages.begin(), pages.end(), pg + 2) != pages.end())
        a = pg;
    REQUIRE(a >= 0);  // pages a .. a + 3 all hold tokens of the request
    // Table: a, a + 1 and a + 2 swapped for two others, a + 3; then the rest.
    std::vector<std::int32_t> others;
    for (std::int32_t pg : pages)
      if (pg < a || pg > a + 3) others.push_back(pg);
    std::vector<std::int32_t> table{a, others[0], others[1], a + 3, a + 1, a + 2};
    table.insert(table.end(), others.begin() + 2, others.end());
    REQUIRE(table.size() == 16);
    std::copy(table.begin(), table.end(), c1.block_table.begin());
    const std::int64_t T = 1;
    Rows rows;
    rows.request = {0};
    rows.bound = {256};
    rows.num_valid = 1;
    std::vector<std::int64_t> all(256);
    std::iota(all.begin(), all.end(), std::int64_t(0));
    const DeviceCache d1(c1);
    const DeviceRows drows(rows);
    const DeviceBuffer<std::int64_t> dlen(rows.bound);
    Stats st;
    for (std::int64_t H : {16, 64}) {  // the narrow kernel and the 64-head one
      const Queries q = make_queries(T, H, T, QLayout::row_major, rng());
      const RefState r = reference_row(c1, q, 0, 0, all);
      for (int num_splits : {1, 2}) {
        const Out g = gpu_dense(q, d1, drows, dlen, params(16, 1, num_splits, T));
        compare_with_reference(g, 0, r, st);
      }
    }
    require_stats("tile across pages A, B, C, A + 3 vs double", st, kTolO, lse_tolerance(format));
  }
}

namespace {

// The split stage alone (scratch states, S > 1), downloaded: (S, T, H, 512) o and (S, T, H) lse.
struct SplitStates {
  std::int64_t S = 0, T = 0, H = 0;
  std::vector<float> o, lse;
  const float* o_at(std::int64_t v, std::int64_t t, std::int64_t h) const {
    return &o[std::size_t(((v * T + t) * H + h) * kDv)];
  }
  float lse_at(std::int64_t v, std::int64_t t, std::int64_t h) const {
    return lse[std::size_t((v * T + t) * H + h)];
  }
};

template <class Launch>
SplitStates run_splits(std::int64_t T, std::int64_t H, int S, Launch&& launch) {
  const std::size_t bytes = dcpattn::cuda_kernels::mla_decode_scratch_bytes(T, int(H), S);
  DeviceBuffer<float> scratch(bytes / sizeof(float));
  DeviceBuffer<float> o(std::size_t(T * H * kDv)), lse(std::size_t(T * H));
  scratch.poison();
  o.poison();
  lse.poison();
  launch(dcpattn::make_view(o.get(), {T, H, std::int64_t(kDv)}),
         dcpattn::make_view(lse.get(), {T, H}),
         Scratch(reinterpret_cast<std::byte*>(scratch.get()), bytes));
  sync_and_check();
  const std::vector<float> all = scratch.download();
  const std::size_t n_o = std::size_t(S * T * H * kDv);
  SplitStates s{S, T, H, std::vector<float>(all.begin(), all.begin() + std::ptrdiff_t(n_o)),
                std::vector<float>(all.begin() + std::ptrdiff_t(n_o), all.end())};
  return s;
}

// States of rank r split j (S_r = V / N splits) against N = 1 split v = j N + r: bitwise equal for
// every valid row and head. Returns the number of differing states.
std::int64_t split_mismatches(const SplitStates& rank, const SplitStates& one, int N, int r,
                              std::int64_t num_valid) {
  std::int64_t bad = 0;
  for (std::int64_t j = 0; j < rank.S; ++j)
    for (std::int64_t t = 0; t < num_valid; ++t)
      for (std::int64_t h = 0; h < rank.H; ++h) {
        const std::int64_t v = j * N + r;
        const float a = rank.lse_at(j, t, h), b = one.lse_at(v, t, h);
        if (std::memcmp(&a, &b, 4) != 0 ||
            std::memcmp(rank.o_at(j, t, h), one.o_at(v, t, h), kDv * sizeof(float)) != 0)
          ++bad;
      }
  return bad;
}

// Rank states (each (T, H, 512) + (T, H)) stacked on the device and merged by the kernels' merge
// (the arithmetic of the CUDA combine) in rank order.
Out gpu_merge_ranks(const std::vector<Out>& ranks, std::int64_t num_valid) {
  const int n = int(ranks.size());
  const std::int64_t T = ranks[0].T, H = ranks[0].H;
  std::vector<float> o, lse;
  for (const Out& r : ranks) {
    o.insert(o.end(), r.o.begin(), r.o.end());
    lse.insert(lse.end(), r.lse.begin(), r.lse.end());
  }
  DeviceBuffer<float> so(o), sl(lse);
  DeviceBuffer<float> mo(std::size_t(T * H * kDv)), ml(std::size_t(T * H));
  mo.poison();
  ml.poison();
  dcpattn::cuda_kernels::detail::mla::merge_states(
      so.get(), sl.get(), n, T, int(H), int(num_valid),
      dcpattn::make_view(mo.get(), {T, H, std::int64_t(kDv)}), dcpattn::make_view(ml.get(), {T, H}),
      nullptr);
  sync_and_check();
  return Out{T, H, mo.download(), ml.download()};
}

// State v of n stacked (512,) states, for tree_merge (a functor: callable from its host+device
// body under nvcc).
struct StackedStates {
  float* o;
  float* lse;
  DCPATTN_HOST_DEVICE dcpattn::TreeStateRef operator()(int v) const noexcept {
    return dcpattn::TreeStateRef{o + std::size_t(v) * kDv, lse + v};
  }
};

// The same merge with dcpattn::tree_merge on the host (host libm exp/log).
Out host_merge_ranks(const std::vector<Out>& ranks) {
  const int n = int(ranks.size());
  Out out{ranks[0].T, ranks[0].H, std::vector<float>(ranks[0].o.size()),
          std::vector<float>(ranks[0].lse.size())};
  std::vector<float> o(static_cast<std::size_t>(n) * kDv), lse(static_cast<std::size_t>(n));
  for (std::int64_t t = 0; t < out.T; ++t)
    for (std::int64_t h = 0; h < out.H; ++h) {
      for (int r = 0; r < n; ++r) {
        std::copy_n(ranks[std::size_t(r)].o_at(t, h), kDv, &o[std::size_t(r) * kDv]);
        lse[std::size_t(r)] = ranks[std::size_t(r)].lse_at(t, h);
      }
      dcpattn::tree_merge(StackedStates{o.data(), lse.data()}, n, kDv);
      std::copy_n(o.begin(), kDv, &out.o[std::size_t((t * out.H + h) * kDv)]);
      out.lse[std::size_t(t * out.H + h)] = lse[0];
    }
  return out;
}

// The host-merged result against the GPU one: not bitwise (CUDA's expf/logf vs the host libm's
// differ by an ulp now and then), but within a few ulp.
void check_host_merge_close(const Out& host_merged, const Out& one, std::int64_t num_valid) {
  double worst_o = 0.0, worst_lse = 0.0;
  std::int64_t identical = 0, total = 0, not_finite = 0;
  for (std::int64_t t = 0; t < num_valid; ++t)
    for (std::int64_t h = 0; h < one.H; ++h) {
      const float* a = host_merged.o_at(t, h);
      const float* b = one.o_at(t, h);
      double num = 0.0, den = 0.0;
      for (int d = 0; d < kDv; ++d) {
        num += (double(a[d]) - double(b[d])) * (double(a[d]) - double(b[d]));
        den += double(b[d]) * double(b[d]);
      }
      const float la = host_merged.lse_at(t, h), lb = one.lse_at(t, h);
      if (std::isinf(lb)) {
        CHECK(la == lb);
        continue;
      }
      if (!std::isfinite(num) || !std::isfinite(den) || std::isnan(lb) || !std::isfinite(la)) {
        ++not_finite;  // a NaN or inf in a live state, which std::max below would pass over
        continue;
      }
      worst_o = std::max(worst_o, std::sqrt(num) / std::max(std::sqrt(den), 1e-30));
      worst_lse = std::max(worst_lse, std::fabs(double(la) - double(lb)));
      identical += std::memcmp(a, b, kDv * sizeof(float)) == 0 && la == lb;
      ++total;
    }
  INFO("host tree_merge vs GPU: max rel L2(o) = " << worst_o << ", max |dlse| = " << worst_lse
                                                  << ", bitwise-identical states " << identical
                                                  << " / " << total);
  CHECK(not_finite == 0);
  CHECK(worst_o <= 1e-5);
  CHECK(worst_lse <= 1e-5);
}

}  // namespace

TEST_CASE("CUDA sparse MLA decode skips out-of-range top-k entries and flags them",
          "[cuda][mla][bounds]") {
  const bool mma_sync = GENERATE(false, true);
  const KernelChoice kernel_choice(mma_sync);
  INFO("kernel: " << (mma_sync ? "mma.sync" : "wgmma"));
  std::mt19937_64 rng(4242);
  const Batch batch = make_batch({300, 200}, rng);
  const RankCache c1 =
      build_rank_cache(batch, RoundRobinOwnership(1, 1), 0, 64, CacheFormat::bf16, rng);
  const std::int64_t T = 3, H = 16, K = 256;
  Rows rows;
  rows.request = {0, 1, 0};
  rows.bound = {300, 150, 280};
  rows.num_valid = 3;
  const Queries q = make_queries(T, H, T, QLayout::row_major, rng());
  const DeviceCache d1(c1);
  const DeviceRows drows(rows);
  // Clean lists: distinct positions below the bound, then -1. Bad lists: a few -1 slots hold
  // entries >= the bound or < -1 instead (the kernels must leave them out).
  std::vector<std::int32_t> clean(std::size_t(T * K), -1);
  for (std::int64_t t = 0; t < T; ++t) {
    std::vector<std::int32_t> all(static_cast<std::size_t>(rows.bound[std::size_t(t)]));
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    const std::int64_t n = std::min<std::int64_t>(std::int64_t(all.size()), K - 8);
    for (std::int64_t k = 0; k < n; ++k) clean[std::size_t(t * K + k)] = all[std::size_t(k)];
  }
  std::vector<std::int32_t> bad = clean;
  bad[std::size_t(0 * K + K - 1)] = 300;      // == bound
  bad[std::size_t(1 * K + K - 2)] = 1 << 30;  // far beyond
  bad[std::size_t(2 * K + K - 3)] = -2;       // < -1
  bad[std::size_t(2 * K + K - 1)] = -2147483647;
  const DeviceBuffer<std::int32_t> dclean(clean), dbad(bad);
  DeviceBuffer<std::uint32_t> flags(1);
  for (int num_splits : {1, 4}) {
    CAPTURE(num_splits);
    MlaDecodeParams p = params(64, 1, num_splits, T);
    p.error_flags = flags.get();
    DCPATTN_CUDA_CHECK(cudaMemset(flags.get(), 0, sizeof(std::uint32_t)));
    const Out good = gpu_sparse(q, d1, drows, dclean, K, RoundRobinOwnership(1, 1), 0, p);
    CHECK(flags.download()[0] == 0u);
    const Out skipped = gpu_sparse(q, d1, drows, dbad, K, RoundRobinOwnership(1, 1), 0, p);
    CHECK(flags.download()[0] == dcpattn::input_error_topk);
    CHECK(bitwise_equal(good, skipped));
    // Without a flag word the bad entries are skipped all the same.
    p.error_flags = nullptr;
    CHECK(bitwise_equal(good, gpu_sparse(q, d1, drows, dbad, K, RoundRobinOwnership(1, 1), 0, p)));
  }
  CHECK(dcpattn::describe_input_errors(dcpattn::input_error_topk).find("topk_indices") !=
        std::string::npos);
}

TEST_CASE("CUDA dense MLA decode: N ranks with V/N splits merge bitwise to one rank with V splits",
          "[cuda][mla][dense][invariance]") {
  const bool mma_sync = GENERATE(false, true);
  const KernelChoice kernel_choice(mma_sync);
  INFO("kernel: " << (mma_sync ? "mma.sync" : "wgmma"));
  std::mt19937_64 rng(7);
  // Lengths around tile, block and span boundaries: V I = 8 (I = 1) and 512 (I = 64), tiles of 64.
  const std::vector<std::int64_t> lengths{0, 1, 5, 63, 64, 65, 515, 1100};
  const DenseCase dc = make_dense_case(lengths, 1, rng);
  const std::int64_t T = std::int64_t(dc.rows.request.size());
  const DeviceRows drows(dc.rows);
  for (std::int64_t H : {16, 128}) {
    const Queries q = make_queries(T, H, dc.rows.num_valid, QLayout::row_major, rng());
    for (CacheFormat format : {CacheFormat::bf16, CacheFormat::fp8_ds_mla}) {
      for (int interleave : {1, 64}) {
        const int page_size = interleave == 1 ? 16 : 64;
        const RoundRobinOwnership own1(1, interleave, kVirtualShards);
        const RankCache c1 = build_rank_cache(dc.batch, own1, 0, page_size, format, rng);
        const DeviceCache d1(c1);
        const DeviceBuffer<std::int64_t> len1(dc.rows.bound);
        const MlaDecodeParams p1 = params(page_size, interleave, kVirtualShards, dc.rows.num_valid);
        const Out one = gpu_dense(q, d1, drows, len1, p1);
        const SplitStates one_splits =
            run_splits(T, H, kVirtualShards, [&](OutView o, LseView l, Scratch s) {
              q.with_device_view([&](const auto& qv) {
                with_device_cache(d1, [&](const auto& cache) {
                  dcpattn::cuda_kernels::detail::mla::dense_splits(
                      qv, cache, d1.table_view(), view1(drows.request), view1(len1), p1, o, l, s,
                      nullptr);
                });
              });
            });
        // Sensitivity control: a different split structure rounds differently on these data.
        const Out other =
            gpu_dense(q, d1, drows, len1,
                      params(page_size, interleave, kVirtualShards / 2, dc.rows.num_valid));
        CHECK_FALSE(bitwise_equal(one, other));
        for (int N : {2, 4}) {
          CAPTURE(H, format_name(format), interleave, N);
          const RoundRobinOwnership own(N, interleave, kVirtualShards);
          const int S = kVirtualShards / N;
          std::vector<Out> ranks;
          for (int r = 0; r < N; ++r) {
            const RankCache cr = build_rank_cache(dc.batch, own, r, page_size, format, rng);
            const DeviceCache dr(cr);
            std::vector<std::int64_t> local_length;
            for (std::int64_t t = 0; t < T; ++t)
              local_length.push_back(
                  t < dc.rows.num_valid ? own.local_length(dc.rows.bound[std::size_t(t)], r) : -7);
            const DeviceBuffer<std::int64_t> lenr(local_length);
            const MlaDecodeParams pr = params(page_size, interleave, S, dc.rows.num_valid);
            const SplitStates rs = run_splits(T, H, S, [&](OutView o, LseView l, Scratch s) {
              q.with_device_view([&](const auto& qv) {
                with_device_cache(dr, [&](const auto& cache) {
                  dcpattn::cuda_kernels::detail::mla::dense_splits(
                      qv, cache, dr.table_view(), view1(drows.request), view1(lenr), pr, o, l, s,
                      nullptr);
                });
              });
            });
            CAPTURE(r);
            CHECK(split_mismatches(rs, one_splits, N, r, dc.rows.num_valid) == 0);
            ranks.push_back(gpu_dense(q, dr, drows, lenr, pr));
          }
          CHECK(bitwise_equal(gpu_merge_ranks(ranks, dc.rows.num_valid), one));
          check_host_merge_close(host_merge_ranks(ranks), one, dc.rows.num_valid);
        }
      }
    }
  }
}

TEST_CASE("CUDA sparse MLA decode: N ranks with V/N splits merge bitwise to one rank with V splits",
          "[cuda][mla][sparse][invariance]") {
  const bool mma_sync = GENERATE(false, true);
  const KernelChoice kernel_choice(mma_sync);
  INFO("kernel: " << (mma_sync ? "mma.sync" : "wgmma"));
  std::mt19937_64 rng(1234);
  const std::vector<std::int64_t> lengths{0, 1, 70, 600, 1100};
  const DenseCase dc = make_dense_case(lengths, 1, rng);
  const std::int64_t T = std::int64_t(dc.rows.request.size());
  const std::int64_t K = 300;
  const std::vector<std::int32_t> topk = make_topk(dc.rows, T, K, rng);
  const DeviceBuffer<std::int32_t> dtopk(topk);
  const DeviceRows drows(dc.rows);
  auto tk = dcpattn::make_view(static_cast<const std::int32_t*>(dtopk.get()), {T, K});
  for (std::int64_t H : {16, 128}) {
    const Queries q = make_queries(T, H, dc.rows.num_valid, QLayout::row_major, rng());
    for (CacheFormat format : {CacheFormat::bf16, CacheFormat::fp8_ds_mla}) {
      for (int interleave : {1, 64}) {
        const int page_size = interleave == 1 ? 16 : 64;
        const RoundRobinOwnership own1(1, interleave, kVirtualShards);
        const RankCache c1 = build_rank_cache(dc.batch, own1, 0, page_size, format, rng);
        const DeviceCache d1(c1);
        const MlaDecodeParams p1 = params(page_size, interleave, kVirtualShards, dc.rows.num_valid);
        const Out one = gpu_sparse(q, d1, drows, dtopk, K, own1, 0, p1);
        const SplitStates one_splits =
            run_splits(T, H, kVirtualShards, [&](OutView o, LseView l, Scratch s) {
              q.with_device_view([&](const auto& qv) {
                with_device_cache(d1, [&](const auto& cache) {
                  dcpattn::cuda_kernels::detail::mla::sparse_splits(
                      qv, cache, d1.table_view(), view1(drows.request), tk, view1(drows.bound),
                      own1, 0, p1, o, l, s, nullptr);
                });
              });
            });
        const Out other = gpu_sparse(q, d1, drows, dtopk, K, own1, 0,
                                     params(page_size, interleave, 1, dc.rows.num_valid));
        CHECK_FALSE(bitwise_equal(one, other));
        for (int N : {2, 4}) {
          CAPTURE(H, format_name(format), interleave, N);
          const RoundRobinOwnership own(N, interleave, kVirtualShards);
          const int S = kVirtualShards / N;
          std::vector<Out> ranks;
          for (int r = 0; r < N; ++r) {
            const RankCache cr = build_rank_cache(dc.batch, own, r, page_size, format, rng);
            const DeviceCache dr(cr);
            const MlaDecodeParams pr = params(page_size, interleave, S, dc.rows.num_valid);
            const SplitStates rs = run_splits(T, H, S, [&](OutView o, LseView l, Scratch s) {
              q.with_device_view([&](const auto& qv) {
                with_device_cache(dr, [&](const auto& cache) {
                  dcpattn::cuda_kernels::detail::mla::sparse_splits(
                      qv, cache, dr.table_view(), view1(drows.request), tk, view1(drows.bound), own,
                      r, pr, o, l, s, nullptr);
                });
              });
            });
            CAPTURE(r);
            CHECK(split_mismatches(rs, one_splits, N, r, dc.rows.num_valid) == 0);
            ranks.push_back(gpu_sparse(q, dr, drows, dtopk, K, own, r, pr));
          }
          CHECK(bitwise_equal(gpu_merge_ranks(ranks, dc.rows.num_valid), one));
          check_host_merge_close(host_merge_ranks(ranks), one, dc.rows.num_valid);
        }
      }
    }
  }
}

TEST_CASE("CUDA split-state merge of 2 to 64 states matches the host tree merge",
          "[cuda][mla][merge]") {
  // The merge kernel of every split count fast mode can pick (up to 64 at batch 1), with empty
  // states and a padding row, against dcpattn::tree_merge on the host (libm exp/log: close, not
  // bitwise).
  std::mt19937_64 rng(11);
  const std::int64_t T = 3, H = 5;
  const int num_valid = 2;  // row 2 is padding: the neutral state, its states not read
  std::uniform_real_distribution<float> uo(-2.0f, 2.0f), ul(-6.0f, 6.0f);
  for (int S : {2, 4, 8, 16, 32, 64}) {
    CAPTURE(S);
    std::vector<Out> states;
    for (int k = 0; k < S; ++k) {
      Out st{T, H, std::vector<float>(std::size_t(T * H * kDv)),
             std::vector<float>(std::size_t(T * H))};
      for (float& x : st.o) x = uo(rng);
      for (float& x : st.lse) x = ul(rng);
      if (k % 3 == 1) {  // an empty state (a split with no tokens) in a varying row
        const std::size_t r = std::size_t(k % (T * H));
        st.lse[r] = -std::numeric_limits<float>::infinity();
        std::fill_n(st.o.begin() + std::ptrdiff_t(r * kDv), kDv, 0.0f);
      }
      if (k == S - 1) {
        // A finite lse so far below the others that its weight underflows to 0, in row (1, 3)
        // (flat row H + 3 = 8, which no empty state above falls in): its o, NaN here, must not
        // be read into the result.
        const std::size_t r = std::size_t(H + 3);
        st.lse[r] = -300.0f;
        std::fill_n(st.o.begin() + std::ptrdiff_t(r * kDv), kDv,
                    std::numeric_limits<float>::quiet_NaN());
      }
      states.push_back(std::move(st));
    }
    // The states stacked (S, T, H, 512) + (S, T, H) and merged by merge_states.
    const Out merged = gpu_merge_ranks(states, num_valid);
    check_host_merge_close(host_merge_ranks(states), merged, num_valid);
    CHECK(std::all_of(merged.o_at(1, 3), merged.o_at(1, 3) + kDv,
                      [](float x) { return std::isfinite(x); }));  // the NaN state not read
    for (std::int64_t h = 0; h < H; ++h) {  // the padding row
      CHECK(std::isinf(merged.lse_at(2, h)));
      CHECK(merged.lse_at(2, h) < 0.0f);
      CHECK(std::all_of(merged.o_at(2, h), merged.o_at(2, h) + kDv,
                        [](float x) { return x == 0.0f; }));
    }
  }
}

namespace {

// `count` stacked states of values V (fp32, or bf16 bits) merged by the kernel that takes one
// value dim a thread (mla_merge_kernel, launched directly), or as the launcher runs them
// (launch_merge: 2, 4 and 8 states by mla_merge_row_kernel, four dims a thread).
template <class V>
Out gpu_merge_stacked(const std::vector<V>& o, const std::vector<float>& lse, int count,
                      std::int64_t T, std::int64_t H, int num_valid, bool per_dim) {
  namespace mla = dcpattn::cuda_kernels::detail::mla;
  DeviceBuffer<V> so(o);
  DeviceBuffer<float> sl(lse);
  DeviceBuffer<float> mo(std::size_t(T * H * kDv)), ml(std::size_t(T * H));
  mo.poison();
  ml.poison();
  const auto ov = dcpattn::make_view(mo.get(), {T, H, std::int64_t(kDv)});
  const auto lv = dcpattn::make_view(ml.get(), {T, H});
  if (per_dim) {
    const dim3 grid(unsigned(T * H));
    const auto run = [&](auto kernel) {
      kernel<<<grid, kDv>>>(so.get(), sl.get(), T, int(H), num_valid, ov, lv);
    };
    switch (count) {
      case 2:
        run(mla::mla_merge_kernel<2, V>);
        break;
      case 4:
        run(mla::mla_merge_kernel<4, V>);
        break;
      default:
        REQUIRE(count == 8);
        run(mla::mla_merge_kernel<8, V>);
    }
  } else {
    mla::launch_merge(reinterpret_cast<const float*>(so.get()), sl.get(), count, T, int(H),
                      num_valid, ov, lv, nullptr, false, sizeof(V) == 2);
  }
  sync_and_check();
  return Out{T, H, mo.download(), ml.download()};
}

}  // namespace

TEST_CASE("CUDA split merge: bf16 states as the host tree merge; both kernels give the same bits",
          "[cuda][mla][merge]") {
  // Fast mode's bf16 split states, merged as the launcher runs them for 2 to 64 states, against
  // dcpattn::tree_merge on the host over the same bf16 values (close, not bitwise: libm exp/log);
  // and for 2, 4 and 8 states, where the launcher takes the row kernel (four dims a thread), that
  // kernel against the one-dim-a-thread kernel, which must give the same bits, fp32 and bf16. With
  // empty states, a weight that underflows to 0 (its state's values NaN, never read), a row with
  // every state empty, and a padding row.
  std::mt19937_64 rng(24);
  const std::int64_t T = 3, H = 5;
  const int num_valid = 2;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  std::uniform_real_distribution<float> uo(-2.0f, 2.0f), ul(-6.0f, 6.0f);
  for (int S : {2, 4, 8, 16, 32, 64}) {
    CAPTURE(S);
    const std::size_t n_o = std::size_t(S * T * H * kDv), n_l = std::size_t(S * T * H);
    std::vector<float> o(n_o), lse(n_l);
    for (float& x : o) x = uo(rng);
    for (float& x : lse) x = ul(rng);
    const auto row_of = [&](int k, std::int64_t r) {
      return std::size_t(k) * std::size_t(T * H) + std::size_t(r);
    };
    for (int k = 0; k < S; ++k) {
      if (k % 3 == 1) {  // an empty state in a varying row
        const std::size_t r = row_of(k, k % (T * H));
        lse[r] = -kInf;
        std::fill_n(o.begin() + std::ptrdiff_t(r * kDv), kDv, 0.0f);
      }
      const std::size_t all_empty = row_of(k, H + 1);  // row (1, 1): every state empty
      lse[all_empty] = -kInf;
      std::fill_n(o.begin() + std::ptrdiff_t(all_empty * kDv), kDv, 0.0f);
    }
    {  // row (0, 4): the last state's weight underflows to 0; its values, NaN, must not be read
      const std::size_t r = row_of(S - 1, 4);
      lse[r] = -300.0f;
      std::fill_n(o.begin() + std::ptrdiff_t(r * kDv), kDv,
                  std::numeric_limits<float>::quiet_NaN());
    }
    std::vector<std::uint16_t> o16(n_o);
    std::vector<float> o16f(n_o);  // the bf16 values as floats, for the host merge
    for (std::size_t i = 0; i < n_o; ++i) {
      o16[i] = bfloat16::from_float(o[i]).bits;
      o16f[i] = bfloat16{o16[i]}.to_float();
    }
    const Out b16 = gpu_merge_stacked(o16, lse, S, T, H, num_valid, false);
    std::vector<Out> states;  // the bf16 values as S separate states, for host_merge_ranks
    for (int k = 0; k < S; ++k)
      states.push_back(
          Out{T, H,
              std::vector<float>(o16f.begin() + std::ptrdiff_t(row_of(k, 0) * kDv),
                                 o16f.begin() + std::ptrdiff_t(row_of(k + 1, 0) * kDv)),
              std::vector<float>(lse.begin() + std::ptrdiff_t(row_of(k, 0)),
                                 lse.begin() + std::ptrdiff_t(row_of(k + 1, 0)))});
    check_host_merge_close(host_merge_ranks(states), b16, num_valid);
    std::vector<Out> merged{b16};
    if (S <= 8) {
      const Out f32 = gpu_merge_stacked(o, lse, S, T, H, num_valid, false);
      CHECK(bitwise_equal(f32, gpu_merge_stacked(o, lse, S, T, H, num_valid, true)));
      CHECK(bitwise_equal(b16, gpu_merge_stacked(o16, lse, S, T, H, num_valid, true)));
      merged.push_back(f32);
    }
    for (const Out& m : merged) {
      CHECK(
          std::all_of(m.o_at(0, 4), m.o_at(0, 4) + kDv, [](float x) { return std::isfinite(x); }));
      CHECK(m.lse_at(1, 1) == -kInf);  // every state empty: the neutral state
      CHECK(std::all_of(m.o_at(1, 1), m.o_at(1, 1) + kDv, [](float x) { return x == 0.0f; }));
      for (std::int64_t h = 0; h < H; ++h) {  // the padding row
        CHECK(m.lse_at(2, h) == -kInf);
        CHECK(std::all_of(m.o_at(2, h), m.o_at(2, h) + kDv, [](float x) { return x == 0.0f; }));
      }
    }
  }
}

TEST_CASE("CUDA MLA decode replays bitwise from a captured CUDA graph", "[cuda][mla][graph]") {
  const bool mma_sync = GENERATE(false, true);
  const KernelChoice kernel_choice(mma_sync);
  INFO("kernel: " << (mma_sync ? "mma.sync" : "wgmma"));
  std::mt19937_64 rng(31);
  const DenseCase dc = make_dense_case({1, 70, 200}, 1, rng);
  const std::int64_t T = std::int64_t(dc.rows.request.size()), H = 16;
  const Queries q = make_queries(T, H, dc.rows.num_valid, QLayout::row_major, rng());
  const RankCache c1 =
      build_rank_cache(dc.batch, RoundRobinOwnership(1, 1), 0, 64, CacheFormat::fp8_ds_mla, rng);
  const DeviceCache d1(c1);
  const DeviceRows drows(dc.rows);
  const DeviceBuffer<std::int64_t> dlen(dc.rows.bound);
  const MlaDecodeParams p = params(64, 1, 4, dc.rows.num_valid);
  const std::size_t bytes = dcpattn::cuda_kernels::mla_decode_scratch_bytes(T, int(H), 4);
  DeviceBuffer<float> o(std::size_t(T * H * kDv)), lse(std::size_t(T * H));
  DeviceBuffer<std::byte> scratch(bytes);
  cudaStream_t stream;
  DCPATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto launch = [&] {
    q.with_device_view([&](const auto& qv) {
      dcpattn::cuda_kernels::mla_decode_dense(
          qv, d1.fp8_view(), d1.table_view(), view1(drows.request), view1(dlen), p,
          dcpattn::make_view(o.get(), {T, H, std::int64_t(kDv)}),
          dcpattn::make_view(lse.get(), {T, H}), Scratch(scratch.get(), bytes), stream);
    });
  };
  // The poisoning memsets run on the legacy stream, which a non-blocking stream does not wait for.
  o.poison();
  lse.poison();
  sync_and_check();
  launch();  // eager (and first) launch
  DCPATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
  const Out eager{T, H, o.download(), lse.download()};
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  DCPATTN_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  launch();
  DCPATTN_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  DCPATTN_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < 2; ++rep) {
    o.poison();
    lse.poison();
    scratch.poison();
    sync_and_check();
    DCPATTN_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    DCPATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
    CHECK(bitwise_equal(eager, Out{T, H, o.download(), lse.download()}));
  }
  DCPATTN_CUDA_CHECK(cudaGraphExecDestroy(exec));
  DCPATTN_CUDA_CHECK(cudaGraphDestroy(graph));
  DCPATTN_CUDA_CHECK(cudaStreamDestroy(stream));
  // A padding-only batch (num_valid_rows = 0) is all neutral.
  Stats st;
  check_padding(gpu_dense(q, d1, drows, dlen, params(64, 1, 4, 0)), 0, st);
  check_padding(gpu_dense(q, d1, drows, dlen, params(64, 1, 1, 0)), 0, st);
  CHECK(st.bad_neutral == 0);
}

namespace {
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const dcpattn::Error& e) {
    return e.message();
  }
  return "<no dcpattn::Error thrown>";
}
bool has(const std::string& s, const std::string& sub) {
  return s.find(sub) != std::string::npos;
}
}  // namespace

TEST_CASE("CUDA MLA decode refuses bad arguments before launching", "[cuda][mla][errors]") {
  const bool mma_sync = GENERATE(false, true);
  const KernelChoice kernel_choice(mma_sync);
  INFO("kernel: " << (mma_sync ? "mma.sync" : "wgmma"));
  std::mt19937_64 rng(5);
  const DenseCase dc = make_dense_case({10, 20}, 1, rng);
  const std::int64_t T = std::int64_t(dc.rows.request.size()), H = 4;
  const Queries q = make_queries(T, H, dc.rows.num_valid, QLayout::row_major, rng());
  const RankCache c1 =
      build_rank_cache(dc.batch, RoundRobinOwnership(1, 1), 0, 16, CacheFormat::bf16, rng);
  const DeviceCache d1(c1);
  const DeviceRows drows(dc.rows);
  const DeviceBuffer<std::int64_t> dlen(dc.rows.bound);
  const DeviceBuffer<std::int32_t> dtopk(std::vector<std::int32_t>(std::size_t(T * 8), -1));
  DeviceBuffer<float> o(std::size_t(T * H * kDv)), lse(std::size_t(T * H));
  const std::size_t big = dcpattn::cuda_kernels::mla_decode_scratch_bytes(T, int(H), 8);
  DeviceBuffer<std::byte> scratch(big);
  auto qv =
      dcpattn::make_view(static_cast<const bfloat16*>(q.device.get()), {T, H, std::int64_t(kQk)});
  auto ov = dcpattn::make_view(o.get(), {T, H, std::int64_t(kDv)});
  auto lv = dcpattn::make_view(lse.get(), {T, H});
  auto dense = [&](const MlaDecodeParams& p, auto qview, TensorView<float, 3> oview,
                   std::size_t scratch_bytes) {
    return error_of([&] {
      dcpattn::cuda_kernels::mla_decode_dense(qview, d1.bf16_view(), d1.table_view(),
                                              view1(drows.request), view1(dlen), p, oview, lv,
                                              Scratch(scratch.get(), scratch_bytes), nullptr);
    });
  };
  const MlaDecodeParams good = params(16, 1, 2, dc.rows.num_valid);
  CHECK(has(dense(params(16, 1, 3, dc.rows.num_valid), qv, ov, big), "num_splits"));
  CHECK(has(dense(params(16, 1, 128, dc.rows.num_valid), qv, ov, big), "num_splits"));
  CHECK(has(dense(params(24, 16, 2, dc.rows.num_valid), qv, ov, big), "page_size"));
  CHECK(has(dense(params(16, 0, 2, dc.rows.num_valid), qv, ov, big), "interleave"));
  MlaDecodeParams unset = good;
  unset.num_valid_rows = -1;
  CHECK(has(dense(unset, qv, ov, big), "num_valid_rows"));
  MlaDecodeParams noscale = good;
  noscale.softmax_scale = std::numeric_limits<float>::quiet_NaN();
  CHECK(has(dense(noscale, qv, ov, big), "softmax_scale"));
  CHECK(has(dense(good, qv, ov, dcpattn::cuda_kernels::mla_decode_scratch_bytes(T, int(H), 2) - 4),
            "scratch"));
  CHECK(has(dense(good,
                  dcpattn::make_view(static_cast<const bfloat16*>(q.device.get()),
                                     {T, H, std::int64_t(512)}),
                  ov, big),
            "head dim"));
  CHECK(has(dense(good, qv, dcpattn::make_view(o.get(), {T, H - 1, std::int64_t(kDv)}), big),
            "o must be"));
  CHECK(has(error_of([] { (void)dcpattn::cuda_kernels::mla_decode_scratch_bytes(4, 4, 6); }),
            "num_splits"));
  CHECK(dcpattn::cuda_kernels::mla_decode_scratch_bytes(4, 4, 1) == 0);
  CHECK(dcpattn::cuda_kernels::mla_decode_scratch_bytes(3, 5, 2) ==
        std::size_t(2 * 3 * 5 * 513 * 4));
  auto sparse = [&](const RoundRobinOwnership& own, int rank, const MlaDecodeParams& p) {
    return error_of([&] {
      dcpattn::cuda_kernels::mla_decode_sparse(
          qv, d1.bf16_view(), d1.table_view(), view1(drows.request),
          dcpattn::make_view(static_cast<const std::int32_t*>(dtopk.get()), {T, std::int64_t(8)}),
          view1(drows.bound), own, rank, p, ov, lv, Scratch(scratch.get(), big), nullptr);
    });
  };
  CHECK(has(sparse(RoundRobinOwnership(2, 1), 2, good), "rank"));
  CHECK(
      has(sparse(RoundRobinOwnership(2, 4), 0, params(16, 1, 2, dc.rows.num_valid)), "interleave"));
  CHECK(sparse(RoundRobinOwnership(2, 1), 1, good) == "<no dcpattn::Error thrown>");
  sync_and_check();
}

TEST_CASE("mla_decode_fast_splits: the most splits that run in one wave, none under 128 tokens",
          "[cuda][mla][splits]") {
  using dcpattn::cuda_kernels::mla_decode_fast_splits;
  for (std::int64_t tokens : {0, 1, 3, 8, 64, 128, 1000})
    for (int heads : {1, 16, 64, 128, 256})
      for (std::int64_t attended : {0, 100, 255, 256, 511, 512, 2048, 4096, 131072})
        for (int sms : {1, 78, 132}) {
          const int s = mla_decode_fast_splits(tokens, heads, attended, sms);
          CAPTURE(tokens, heads, attended, sms, s);
          REQUIRE((s >= 1 && s <= 64 && (s & (s - 1)) == 0));
          const std::int64_t blocks = tokens * ((heads + 63) / 64);
          if (s > 1) {
            CHECK(blocks * s <= sms);       // one wave of CTAs
            CHECK(attended >= s * 128LL);   // no split under 128 tokens
          }
          // One more doubling would pass a wave, cut splits under 128 tokens, or pass the limit.
          CHECK((blocks * 2 * s > sms || attended < 2LL * s * 128 || s == 64));
        }
  CHECK(mla_decode_fast_splits(1, 128, 32768, 132) == 64);  // 128 CTAs
  CHECK(mla_decode_fast_splits(8, 128, 32768, 132) == 8);   // 128 CTAs, not 256
  CHECK(mla_decode_fast_splits(64, 128, 32768, 132) == 1);  // 128 CTAs
  CHECK(mla_decode_fast_splits(8, 16, 32768, 132) == 16);   // 128 CTAs
  CHECK(mla_decode_fast_splits(1, 128, 4096, 132) == 32);   // splits of 128 tokens
  CHECK(mla_decode_fast_splits(1, 128, 2048, 132) == 16);   // a top-2048 list in runs of 128
  CHECK_THROWS_AS(mla_decode_fast_splits(1, 0, 100, 132), dcpattn::Error);
  CHECK_THROWS_AS(mla_decode_fast_splits(-1, 16, 100, 132), dcpattn::Error);
}
