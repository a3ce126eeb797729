// SPDX-License-Identifier: Apache-2.0
// The CUDA fused prologue against host::fused_prologue on the same inputs, for the bf16 and the
// fp8 ds_mla cache, with and without the indexer, T in {1, 5, 300}, contiguous, fused-projection
// (strided) and misaligned views (element-wise paths). What is compared, and how closely:
//   - q_c_out: every element within 1 bf16 ulp of the host, and at least 99% bitwise equal. The
//     two compute the same formula and differ only in the order of the fp32 sum of squares (tree
//     here, sequential on the host): the scale then differs by a few fp32 ulps (~2^-22 relative),
//     which can move a bf16 rounding (steps of 2^-8..2^-7 relative) by one step, never two.
//   - bf16 MLA entries: latent within 1 ulp (same argument); the 64 rotated k_pe values bitwise
//     (no reduction involved: same operations, each rounded separately).
//   - fp8 ds_mla entries: the 64 bf16 RoPE values bitwise; the 512 latent codes equal or adjacent
//     (same sign, magnitude codes at most 1 apart): the bf16 latent differs by at most 1 ulp
//     (<= 2^-7 relative) and the group scale, amax / 448, by at most 2^-7 relative (when the amax
//     element is the one that differs), so value / scale moves by < 2^-6 relative, less than one
//     e4m3 step (>= 2^-4 relative for normals, and far less than the 2^-9 step of subnormals);
//     each scale bitwise equal or within 2^-7 relative (+ 1 fp32 ulp).
//   - indexer keys: bitwise equal (codes and scale) for at least 90% of the written entries (at
//     most one differing entry in small batches); the others within, per value,
//     2^-5 * m + 0.14 * |value| + 2^-8 * scale, m the pair magnitude (|x0| + |x1|) of the exact
//     LayerNorm output: a 1-ulp LayerNorm difference (2^-7 relative) carried through RoPE moves a
//     rotated value by up to 2^-7 of its pair's magnitude, plus the two bf16 roundings, and then
//     the e4m3 rounding of either side (half a step each, 2^-4 relative, 2^-10 scale subnormal).
//   - bytes outside the written entries of both caches (guard bands before and after the cache
//     included), padding between rows of every output: untouched (sentinel). top-k rows: all -1.
// And the DCP rule of the seed bug: a rank with every slot -1 normalizes every query row, writes
// nothing to either cache, and resets the top-k rows. Out-of-range slot and position values are
// skipped (the row behaves as slot -1) without writing out of bounds.
// Large batches (several rows per warp) are checked the same way, and the rows of a small batch
// must come out bitwise equal to the same rows inside a large one (the kernel's sums have one
// fixed order whatever the launch shape). The kernel's float -> bf16 and float -> e4m3
// conversions are checked against bfloat16::from_float and fp8_e4m3::encode on all 2^32 inputs.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "support/catch.hpp"

#include "dcpattn/core/numeric.hpp"
#include "dcpattn/core/rope.hpp"
#include "dcpattn/core/tensor.hpp"
#include "dcpattn/error.hpp"
#include "dcpattn/kernels/cache_layout.hpp"
#include "dcpattn/kernels/cuda/prologue.cuh"
#include "dcpattn/kernels/host/prologue.hpp"

namespace {

using dcpattn::bfloat16;
using dcpattn::CacheFormat;
using dcpattn::RopeStyle;

#define CUDA_OK(call) REQUIRE((call) == cudaSuccess)

constexpr int kQ = 1536;
constexpr int kLatent = 512;
constexpr int kRope = 64;
constexpr int kQkv = kQ + kLatent + kRope;  // one row of a fused q_c | kv_c | k_pe projection
constexpr int kIdx = 128;
constexpr int kEntry = 656;
constexpr int kIdxBytes = 132;
constexpr std::uint8_t kSentinel = 0xa5;
constexpr std::int64_t kGuard = 64;  // elements of sentinel before and after each cache

// ---- buffers that exist on the host and on the device with the same layout ----

/// `bytes` bytes on the host (the reference runs there) and on the device (the kernel runs there).
struct Mirror {
  std::vector<std::uint8_t> host;
  std::uint8_t* dev = nullptr;
  Mirror() = default;
  explicit Mirror(std::size_t bytes) : host(bytes, kSentinel) {
    CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&dev), bytes ? bytes : 1));
  }
  Mirror(const Mirror&) = delete;
  Mirror& operator=(const Mirror&) = delete;
  Mirror(Mirror&& o) noexcept : host(std::move(o.host)), dev(o.dev) { o.dev = nullptr; }
  Mirror& operator=(Mirror&& o) noexcept {
    std::swap(host, o.host);
    std::swap(dev, o.dev);
    return *this;
  }
  ~Mirror() { cudaFree(dev); }
  std::uint8_t* ptr(bool device) { return device ? dev : host.data(); }
  void upload() {
    CUDA_OK(cudaMemcpy(dev, host.data(), host.size(), cudaMemcpyHostToDevice));
  }
  std::vector<std::uint8_t> download() const {
    std::vector<std::uint8_t> out(host.size());
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(out.data(), dev, out.size(), cudaMemcpyDeviceToHost));
    return out;
  }
};

/// Where a rank-R tensor of T lives in its Mirror: element offset, extents and strides (elements).
template <class T, std::size_t R>
struct Place {
  std::int64_t offset = 0;
  std::int64_t ext[R] = {};
  std::int64_t str[R] = {};

  /// Bytes from the buffer start through the last element (plus `tail` elements).
  std::size_t bytes(std::int64_t tail = 0) const {
    std::int64_t last = offset;
    for (std::size_t r = 0; r < R; ++r)
      if (ext[r] > 0) last += (ext[r] - 1) * str[r];
    return std::size_t(last + 1 + tail) * sizeof(T);
  }
  std::int64_t index(std::int64_t i0, std::int64_t i1 = 0) const {
    if constexpr (R == 1) return offset + i0 * str[0];
    else return offset + i0 * str[0] + i1 * str[1];
  }
  template <class V = T>
  dcpattn::TensorView<V, R> view(std::uint8_t* base) const {
    return dcpattn::make_view(reinterpret_cast<V*>(base) + offset, ext, str);
  }
};

template <class T>
T load_at(const std::vector<std::uint8_t>& buf, std::int64_t elem) {
  T v;
  std::memcpy(&v, buf.data() + std::size_t(elem) * sizeof(T), sizeof(T));
  return v;
}
template <class T>
void store_at(std::vector<std::uint8_t>& buf, std::int64_t elem, T v) {
  std::memcpy(buf.data() + std::size_t(elem) * sizeof(T), &v, sizeof(T));
}

// ---- numeric helpers ----

double bf16_value(std::uint16_t bits) {
  const std::uint32_t u = std::uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
/// Distance in bf16 steps (signed-magnitude order; +0 and -0 are the same point).
int bf16_ulps(std::uint16_t a, std::uint16_t b) {
  auto key = [](std::uint16_t x) { return (x & 0x8000) ? -int(x & 0x7fff) : int(x & 0x7fff); };
  return std::abs(key(a) - key(b));
}
/// Distance in e4m3 codes (signed-magnitude order; +0 and -0 are the same point).
int fp8_steps(std::uint8_t a, std::uint8_t b) {
  auto key = [](std::uint8_t x) { return (x & 0x80) ? -int(x & 0x7f) : int(x & 0x7f); };
  return std::abs(key(a) - key(b));
}
double e4m3_value(std::uint8_t b) { return dcpattn::fp8_e4m3::decode(b); }
float f32_of(const std::uint8_t* p) {
  float f;
  std::memcpy(&f, p, 4);  // little-endian, like the caches
  return f;
}

// ---- one problem: inputs, outputs, their placements ----

struct Options {
  std::int64_t T = 5;
  CacheFormat format = CacheFormat::bf16;
  bool indexer = true;
  bool bias = true;
  bool topk = true;
  bool fused_qkv = false;   // q_c | kv_c | k_pe are slices of one (T, 2112) projection output
  bool misaligned = false;  // every view one element off 16 bytes, odd strides: element-wise paths
  bool in_place = false;    // q_c_out aliases q_c
  RopeStyle kv_style = RopeStyle::interleaved;
  RopeStyle index_style = RopeStyle::neox;
  std::int64_t page_size = 64;
  std::int64_t index_pages = 6;
  std::int64_t num_slots = -1;  // default: page_size * index_pages
  std::int64_t K = 64;
  std::int64_t topk_stride = -1;  // default: K (+ 3 when misaligned)
  std::int64_t max_position = 4096;
  double own_fraction = 0.6;  // rows with a slot on this rank; the others get -1
  std::uint64_t seed = 1;
};

struct Problem {
  Options o;
  std::int64_t num_slots = 0;
  Mirror qkv, q_c, q_out, q_w, kv_c, kv_w, k_pe, positions, slots, cos_sin, kv_cache, index_k,
      ik_w, ik_b, index_cache, topk;
  Place<bfloat16, 2> p_q_c, p_q_out, p_kv_c, p_k_pe, p_index_k;
  Place<bfloat16, 1> p_q_w, p_kv_w, p_ik_w, p_ik_b;
  Place<std::int64_t, 1> p_positions, p_slots;
  Place<float, 2> p_cos_sin;
  Place<std::uint8_t, 2> p_cache_bytes;  // kv_cache as bytes (bf16: 2 bytes per element)
  Place<bfloat16, 2> p_cache_bf16;
  Place<std::uint8_t, 2> p_index_cache;
  Place<std::int32_t, 2> p_topk;
  std::vector<std::int64_t> slot_values;  // what the kernel sees (may hold invalid values)

  Mirror& q_c_buf() { return o.fused_qkv ? qkv : q_c; }
  Mirror& kv_c_buf() { return o.fused_qkv ? qkv : kv_c; }
  Mirror& k_pe_buf() { return o.fused_qkv ? qkv : k_pe; }
  Mirror& q_out_buf() { return o.in_place ? q_c_buf() : q_out; }

  /// True where row t's cache entries are written: the slot is in range (also of the indexer
  /// cache, with the indexer) and so is the position.
  bool writes(std::int64_t t) const {
    const std::int64_t s = slot_values[std::size_t(t)];
    if (s < 0 || s >= num_slots) return false;
    if (o.indexer && s / o.page_size >= o.index_pages) return false;
    const auto p = load_at<std::int64_t>(positions.host, p_positions.index(t));
    return p >= 0 && p < o.max_position;
  }
};

std::uint16_t random_bf16_bits(std::mt19937_64& rng, float lo, float hi) {
  return bfloat16::from_float(std::uniform_real_distribution<float>(lo, hi)(rng)).bits;
}
template <std::size_t R>
void fill_bf16(Mirror& m, const Place<bfloat16, R>& p, std::mt19937_64& rng, float lo, float hi) {
  if constexpr (R == 1) {
    for (std::int64_t i = 0; i < p.ext[0]; ++i)
      store_at<std::uint16_t>(m.host, p.index(i), random_bf16_bits(rng, lo, hi));
  } else {
    for (std::int64_t i = 0; i < p.ext[0]; ++i)
      for (std::int64_t j = 0; j < p.ext[1]; ++j)
        store_at<std::uint16_t>(m.host, p.index(i, j), random_bf16_bits(rng, lo, hi));
  }
}

/// Builds a problem: random inputs (never zeros), sentinel-filled outputs, and a slot mapping
/// where about own_fraction of the rows hold distinct slots spread over all pages (slot 0 and the
/// last slot included when there are enough rows) and the others -1.
Problem make_problem(const Options& opt) {
  Problem pb;
  pb.o = opt;
  const Options& o = pb.o;
  const std::int64_t T = o.T;
  pb.num_slots = o.num_slots >= 0 ? o.num_slots : o.page_size * o.index_pages;
  std::mt19937_64 rng(o.seed);
  const std::int64_t pad = o.misaligned ? 1 : 0;    // elements before a view's first element
  const std::int64_t extra = o.misaligned ? 3 : 0;  // elements added to each row stride

  auto rows2 = [&](std::int64_t rows, std::int64_t cols, std::int64_t offset) {
    Place<bfloat16, 2> p;
    p.offset = offset;
    p.ext[0] = rows, p.ext[1] = cols;
    p.str[0] = cols + extra, p.str[1] = 1;
    return p;
  };
  auto vec1 = [&](std::int64_t n) {
    Place<bfloat16, 1> p;
    p.offset = pad;
    p.ext[0] = n;
    p.str[0] = 1;
    return p;
  };

  if (o.fused_qkv) {
    pb.p_q_c = rows2(T, kQ, pad);
    pb.p_q_c.str[0] = kQkv + extra;
    pb.p_kv_c = pb.p_q_c, pb.p_kv_c.offset = pad + kQ, pb.p_kv_c.ext[1] = kLatent;
    pb.p_k_pe = pb.p_q_c, pb.p_k_pe.offset = pad + kQ + kLatent, pb.p_k_pe.ext[1] = kRope;
    pb.qkv = Mirror(pb.p_q_c.bytes(kQkv));
  } else {
    pb.p_q_c = rows2(T, kQ, pad);
    pb.p_kv_c = rows2(T, kLatent, pad);
    pb.p_k_pe = rows2(T, kRope, pad);
    pb.q_c = Mirror(pb.p_q_c.bytes());
    pb.kv_c = Mirror(pb.p_kv_c.bytes());
    pb.k_pe = Mirror(pb.p_k_pe.bytes());
  }
  fill_bf16(pb.q_c_buf(), pb.p_q_c, rng, -2.0f, 2.0f);
  fill_bf16(pb.kv_c_buf(), pb.p_kv_c, rng, -3.0f, 3.0f);
  fill_bf16(pb.k_pe_buf(), pb.p_k_pe, rng, -1.0f, 1.0f);
  if (o.in_place) {
    pb.p_q_out = pb.p_q_c;
  } else {
    pb.p_q_out = rows2(T, kQ, pad);
    pb.q_out = Mirror(pb.p_q_out.bytes());
  }

  pb.p_q_w = vec1(kQ), pb.p_kv_w = vec1(kLatent), pb.p_ik_w = vec1(kIdx), pb.p_ik_b = vec1(kIdx);
  pb.q_w = Mirror(pb.p_q_w.bytes());
  pb.kv_w = Mirror(pb.p_kv_w.bytes());
  fill_bf16(pb.q_w, pb.p_q_w, rng, 0.5f, 1.5f);
  fill_bf16(pb.kv_w, pb.p_kv_w, rng, 0.5f, 1.5f);

  // Positions and slots.
  pb.p_positions.offset = pad, pb.p_positions.ext[0] = T, pb.p_positions.str[0] = 1;
  pb.p_slots = pb.p_positions;
  pb.positions = Mirror(pb.p_positions.bytes());
  pb.slots = Mirror(pb.p_slots.bytes());
  std::vector<std::int64_t> perm(std::size_t(pb.num_slots));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  if (pb.num_slots >= 2) {  // the first and the last slot of the cache are handed out first
    std::iter_swap(perm.begin(), std::find(perm.begin(), perm.end(), 0));
    std::iter_swap(perm.begin() + 1, std::find(perm.begin(), perm.end(), pb.num_slots - 1));
  }
  std::size_t next = 0;
  pb.slot_values.assign(std::size_t(T), -1);
  for (std::int64_t t = 0; t < T; ++t) {
    const bool own = std::uniform_real_distribution<double>(0, 1)(rng) < o.own_fraction;
    if (own && next < perm.size()) pb.slot_values[std::size_t(t)] = perm[next++];
    store_at<std::int64_t>(pb.positions.host, pb.p_positions.index(t),
                           std::int64_t(rng() % std::uint64_t(o.max_position)));
  }
  for (std::int64_t t = 0; t < T; ++t)
    store_at<std::int64_t>(pb.slots.host, pb.p_slots.index(t), pb.slot_values[std::size_t(t)]);

  pb.p_cos_sin.offset = pad;
  pb.p_cos_sin.ext[0] = o.max_position, pb.p_cos_sin.ext[1] = kRope;
  pb.p_cos_sin.str[0] = kRope + extra, pb.p_cos_sin.str[1] = 1;
  pb.cos_sin = Mirror(pb.p_cos_sin.bytes());
  for (std::int64_t p = 0; p < o.max_position; ++p)
    for (int i = 0; i < kRope / 2; ++i) {
      const double angle = double(p) * std::pow(10000.0, -2.0 * i / kRope);
      store_at<float>(pb.cos_sin.host, pb.p_cos_sin.index(p, i), float(std::cos(angle)));
      store_at<float>(pb.cos_sin.host, pb.p_cos_sin.index(p, kRope / 2 + i), float(std::sin(angle)));
    }

  // The MLA cache, with kGuard elements of sentinel before and after.
  if (o.format == CacheFormat::bf16) {
    pb.p_cache_bf16.offset = kGuard + pad;
    pb.p_cache_bf16.ext[0] = pb.num_slots, pb.p_cache_bf16.ext[1] = dcpattn::kMlaQkDim;
    pb.p_cache_bf16.str[0] = dcpattn::kMlaQkDim + extra, pb.p_cache_bf16.str[1] = 1;
    pb.kv_cache = Mirror(pb.p_cache_bf16.bytes(kGuard));
  } else {
    pb.p_cache_bytes.offset = kGuard + pad;
    pb.p_cache_bytes.ext[0] = pb.num_slots, pb.p_cache_bytes.ext[1] = kEntry;
    pb.p_cache_bytes.str[0] = kEntry + extra, pb.p_cache_bytes.str[1] = 1;
    pb.kv_cache = Mirror(pb.p_cache_bytes.bytes(kGuard));
  }

  if (o.indexer) {
    pb.p_index_k = rows2(T, kIdx, pad);
    pb.index_k = Mirror(pb.p_index_k.bytes());
    fill_bf16(pb.index_k, pb.p_index_k, rng, -2.0f, 3.0f);
    pb.ik_w = Mirror(pb.p_ik_w.bytes());
    fill_bf16(pb.ik_w, pb.p_ik_w, rng, 0.5f, 1.5f);
    if (o.bias) {
      pb.ik_b = Mirror(pb.p_ik_b.bytes());
      fill_bf16(pb.ik_b, pb.p_ik_b, rng, -0.2f, 0.2f);
    }
    pb.p_index_cache.offset = kGuard + pad;
    pb.p_index_cache.ext[0] = o.index_pages, pb.p_index_cache.ext[1] = o.page_size * kIdxBytes;
    pb.p_index_cache.str[0] = o.page_size * kIdxBytes + extra, pb.p_index_cache.str[1] = 1;
    pb.index_cache = Mirror(pb.p_index_cache.bytes(kGuard));
  }
  if (o.topk) {
    pb.p_topk.offset = pad;
    pb.p_topk.ext[0] = T, pb.p_topk.ext[1] = o.K;
    pb.p_topk.str[0] = o.topk_stride >= 0 ? o.topk_stride : o.K + extra;
    pb.p_topk.str[1] = 1;
    pb.topk = Mirror(pb.p_topk.bytes());
  }
  return pb;
}

template <CacheFormat F>
using Args = dcpattn::PrologueArgs<dcpattn::mla_cache_out_view_t<F>>;

/// The arguments over the host (device = false) or the device (device = true) copies.
template <CacheFormat F>
Args<F> make_args(Problem& pb, bool device) {
  Args<F> a;
  a.q_c = pb.p_q_c.view<const bfloat16>(pb.q_c_buf().ptr(device));
  a.q_c_out = pb.p_q_out.view(pb.q_out_buf().ptr(device));
  a.q_norm_weight = pb.p_q_w.view<const bfloat16>(pb.q_w.ptr(device));
  a.kv_c = pb.p_kv_c.view<const bfloat16>(pb.kv_c_buf().ptr(device));
  a.kv_norm_weight = pb.p_kv_w.view<const bfloat16>(pb.kv_w.ptr(device));
  a.k_pe = pb.p_k_pe.view<const bfloat16>(pb.k_pe_buf().ptr(device));
  a.positions = pb.p_positions.view<const std::int64_t>(pb.positions.ptr(device));
  a.cos_sin_cache = pb.p_cos_sin.view<const float>(pb.cos_sin.ptr(device));
  a.kv_rope_style = pb.o.kv_style;
  a.slot_mapping = pb.p_slots.view<const std::int64_t>(pb.slots.ptr(device));
  if constexpr (F == CacheFormat::bf16)
    a.kv_cache = pb.p_cache_bf16.view(pb.kv_cache.ptr(device));
  else
    a.kv_cache = pb.p_cache_bytes.view(pb.kv_cache.ptr(device));
  if (pb.o.indexer) {
    a.index_k = pb.p_index_k.view<const bfloat16>(pb.index_k.ptr(device));
    a.index_k_norm_weight = pb.p_ik_w.view<const bfloat16>(pb.ik_w.ptr(device));
    if (pb.o.bias) a.index_k_norm_bias = pb.p_ik_b.view<const bfloat16>(pb.ik_b.ptr(device));
    a.index_rope_style = pb.o.index_style;
    a.index_k_cache = pb.p_index_cache.view(pb.index_cache.ptr(device));
  }
  if (pb.o.topk) a.topk_indices = pb.p_topk.view(pb.topk.ptr(device));
  return a;
}

std::vector<Mirror*> all_buffers(Problem& pb) {
  return {&pb.qkv,       &pb.q_c,   &pb.q_out, &pb.q_w,      &pb.kv_c, &pb.kv_w,
          &pb.k_pe,      &pb.positions, &pb.slots, &pb.cos_sin, &pb.kv_cache, &pb.index_k,
          &pb.ik_w,      &pb.ik_b,  &pb.index_cache, &pb.topk};
}

/// The outputs of one GPU run, downloaded.
struct GpuOut {
  std::vector<std::uint8_t> q_out, kv_cache, index_cache, topk;
};

GpuOut download_outputs(Problem& pb) {
  GpuOut g;
  g.q_out = pb.q_out_buf().download();
  g.kv_cache = pb.kv_cache.download();
  if (pb.o.indexer) g.index_cache = pb.index_cache.download();
  if (pb.o.topk) g.topk = pb.topk.download();
  return g;
}

/// Uploads every buffer, runs the CUDA prologue on `stream`, then the host reference on the host
/// copies (where out-of-range slots are replaced by -1, the behaviour the kernel promises for
/// them), and returns the GPU outputs.
GpuOut run_both(Problem& pb, cudaStream_t stream = nullptr,
                std::uint32_t* error_flags = nullptr) {
  for (Mirror* m : all_buffers(pb))
    if (!m->host.empty()) m->upload();
  if (pb.o.format == CacheFormat::bf16) {
    auto a = make_args<CacheFormat::bf16>(pb, true);
    a.error_flags = error_flags;
    dcpattn::cuda_kernels::fused_prologue(a, stream);
  } else {
    auto a = make_args<CacheFormat::fp8_ds_mla>(pb, true);
    a.error_flags = error_flags;
    dcpattn::cuda_kernels::fused_prologue(a, stream);
  }
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaStreamSynchronize(stream));

  for (std::int64_t t = 0; t < pb.o.T; ++t)
    store_at<std::int64_t>(pb.slots.host, pb.p_slots.index(t),
                           pb.writes(t) ? pb.slot_values[std::size_t(t)] : -1);
  if (pb.o.format == CacheFormat::bf16)
    dcpattn::host::fused_prologue(make_args<CacheFormat::bf16>(pb, false));
  else
    dcpattn::host::fused_prologue(make_args<CacheFormat::fp8_ds_mla>(pb, false));
  return download_outputs(pb);
}

// ---- comparisons ----

/// q_c_out: every element within 1 bf16 ulp of the host, >= 99% bitwise; padding untouched.
void check_queries(Problem& pb, const GpuOut& g) {
  const auto& h = pb.q_out_buf().host;
  REQUIRE(g.q_out.size() == h.size());
  std::vector<char> elem(h.size(), 0);
  std::size_t total = 0, differ = 0;
  int worst = 0;
  for (std::int64_t t = 0; t < pb.o.T; ++t)
    for (int i = 0; i < kQ; ++i) {
      const std::int64_t e = pb.p_q_out.index(t, i);
      const auto a = load_at<std::uint16_t>(g.q_out, e), b = load_at<std::uint16_t>(h, e);
      const int u = bf16_ulps(a, b);
      worst = std::max(worst, u);
      differ += u != 0;
      ++total;
      elem[std::size_t(e) * 2] = elem[std::size_t(e) * 2 + 1] = 1;
    }
  INFO("q_c_out: " << differ << " of " << total << " elements differ from the host, worst by "
                   << worst << " bf16 ulp");
  REQUIRE(worst <= 1);
  CHECK(double(differ) <= 0.01 * double(total));
  if (!pb.o.in_place) {  // in place, the rest of the buffer is the input's padding
    std::size_t touched = 0;
    for (std::size_t i = 0; i < h.size(); ++i)
      if (!elem[i] && g.q_out[i] != kSentinel) ++touched;
    CHECK(touched == 0);
  }
}

void check_topk(Problem& pb, const GpuOut& g) {
  if (!pb.o.topk) return;
  std::vector<char> elem(g.topk.size(), 0);
  std::size_t not_reset = 0, touched = 0;
  for (std::int64_t t = 0; t < pb.o.T; ++t)
    for (std::int64_t k = 0; k < pb.o.K; ++k) {
      const std::int64_t e = pb.p_topk.index(t, k);
      not_reset += load_at<std::int32_t>(g.topk, e) != -1;
      std::fill_n(elem.begin() + std::ptrdiff_t(e * 4), 4, 1);
    }
  for (std::size_t i = 0; i < g.topk.size(); ++i)
    if (!elem[i] && g.topk[i] != kSentinel) ++touched;
  CHECK(not_reset == 0);
  CHECK(touched == 0);
}

/// Pair magnitude |x0| + |x1| (or |x| outside the rotated dims) of the exact LayerNorm output of
/// row t of index_k: bounds what a 1-ulp LayerNorm difference becomes after RoPE.
std::vector<double> index_pair_magnitude(Problem& pb, std::int64_t t) {
  std::vector<double> x(kIdx), w(kIdx), b(kIdx, 0.0);
  for (int i = 0; i < kIdx; ++i) {
    x[std::size_t(i)] = bf16_value(load_at<std::uint16_t>(pb.index_k.host, pb.p_index_k.index(t, i)));
    w[std::size_t(i)] = bf16_value(load_at<std::uint16_t>(pb.ik_w.host, pb.p_ik_w.index(i)));
    if (pb.o.bias)
      b[std::size_t(i)] = bf16_value(load_at<std::uint16_t>(pb.ik_b.host, pb.p_ik_b.index(i)));
  }
  double mean = 0.0, var = 0.0;
  for (double v : x) mean += v;
  mean /= kIdx;
  for (double v : x) var += (v - mean) * (v - mean);
  var /= kIdx;
  std::vector<double> ln(kIdx), m(kIdx);
  for (int i = 0; i < kIdx; ++i)
    ln[std::size_t(i)] =
        (x[std::size_t(i)] - mean) / std::sqrt(var + 1e-6) * w[std::size_t(i)] + b[std::size_t(i)];
  for (int i = 0; i < kIdx; ++i) m[std::size_t(i)] = std::fabs(ln[std::size_t(i)]);
  for (int i = 0; i < kRope / 2; ++i) {
    const auto idx = dcpattn::rope_pair_index(pb.o.index_style, i, kRope);
    m[std::size_t(idx.first)] = m[std::size_t(idx.second)] =
        std::fabs(ln[std::size_t(idx.first)]) + std::fabs(ln[std::size_t(idx.second)]);
  }
  return m;
}

/// The caches: written entries against the host (bounds in the file comment), every other byte
/// (guards and row padding included) still the sentinel.
void check_caches(Problem& pb, const GpuOut& g) {
  const auto& hk = pb.kv_cache.host;
  REQUIRE(g.kv_cache.size() == hk.size());
  std::vector<char> kv_mask(hk.size(), 0);
  std::size_t written = 0, latent_differ = 0, rope_differ = 0, scale_differ = 0;
  int worst_latent = 0, worst_rope = 0, worst_code = 0;
  double worst_scale_rel = 0.0;

  std::vector<char> idx_mask(pb.index_cache.host.size(), 0);
  std::size_t idx_entries = 0, idx_differ = 0;
  double worst_idx_excess = -1.0;

  for (std::int64_t t = 0; t < pb.o.T; ++t) {
    if (!pb.writes(t)) continue;
    const std::int64_t slot = pb.slot_values[std::size_t(t)];
    ++written;
    if (pb.o.format == CacheFormat::bf16) {
      for (int i = 0; i < dcpattn::kMlaQkDim; ++i) {
        const std::int64_t e = pb.p_cache_bf16.index(slot, i);
        const int u = bf16_ulps(load_at<std::uint16_t>(g.kv_cache, e), load_at<std::uint16_t>(hk, e));
        if (i < kLatent) {
          worst_latent = std::max(worst_latent, u);
          latent_differ += u != 0;
        } else {
          worst_rope = std::max(worst_rope, u);
          rope_differ += u != 0;
        }
        kv_mask[std::size_t(e) * 2] = kv_mask[std::size_t(e) * 2 + 1] = 1;
      }
    } else {
      const std::int64_t base = pb.p_cache_bytes.index(slot, 0);
      const std::uint8_t* ge = g.kv_cache.data() + base;
      const std::uint8_t* he = hk.data() + base;
      for (int i = 0; i < kLatent; ++i) {
        const int s = fp8_steps(ge[i], he[i]);
        worst_code = std::max(worst_code, s);
        latent_differ += s != 0;
      }
      for (int gi = 0; gi < 4; ++gi) {
        const float a = f32_of(ge + 512 + 4 * gi), b = f32_of(he + 512 + 4 * gi);
        if (std::memcmp(&a, &b, 4) != 0) {
          ++scale_differ;
          worst_scale_rel = std::max(worst_scale_rel, std::fabs(double(a) - b) / std::fabs(double(b)));
        }
      }
      for (int i = 0; i < kRope; ++i) {
        const auto a = std::uint16_t(ge[528 + 2 * i] | (ge[529 + 2 * i] << 8));
        const auto b = std::uint16_t(he[528 + 2 * i] | (he[529 + 2 * i] << 8));
        const int u = bf16_ulps(a, b);
        worst_rope = std::max(worst_rope, u);
        rope_differ += u != 0;
      }
      std::fill_n(kv_mask.begin() + std::ptrdiff_t(base), kEntry, 1);
    }

    if (!pb.o.indexer) continue;
    ++idx_entries;
    const std::int64_t ps = pb.o.page_size;
    const std::int64_t page = slot / ps, s = slot % ps;
    const std::int64_t vbase = pb.p_index_cache.index(page, s * kIdx);
    const std::int64_t sbase = pb.p_index_cache.index(page, ps * kIdx + 4 * s);
    const auto& hi = pb.index_cache.host;
    const float sg = f32_of(g.index_cache.data() + sbase), sh = f32_of(hi.data() + sbase);
    bool same = std::memcmp(&sg, &sh, 4) == 0 &&
                std::equal(hi.begin() + vbase, hi.begin() + vbase + kIdx,
                           g.index_cache.begin() + vbase);
    std::fill_n(idx_mask.begin() + std::ptrdiff_t(vbase), kIdx, 1);
    std::fill_n(idx_mask.begin() + std::ptrdiff_t(sbase), 4, 1);
    if (same) continue;
    ++idx_differ;
    const auto m = index_pair_magnitude(pb, t);
    for (int i = 0; i < kIdx; ++i) {
      const double dg = e4m3_value(g.index_cache[std::size_t(vbase + i)]) * sg;
      const double dh = e4m3_value(hi[std::size_t(vbase + i)]) * sh;
      const double tol = std::ldexp(m[std::size_t(i)], -5) +
                         0.14 * std::max(std::fabs(dg), std::fabs(dh)) +
                         std::ldexp(double(std::max(sg, sh)), -8) + 1e-6;
      worst_idx_excess = std::max(worst_idx_excess, std::fabs(dg - dh) - tol);
    }
  }

  INFO(written << " entries written; latent: " << latent_differ << " values differ (worst "
               << (pb.o.format == CacheFormat::bf16 ? worst_latent : worst_code)
               << (pb.o.format == CacheFormat::bf16 ? " bf16 ulp" : " e4m3 steps") << "), "
               << scale_differ << " fp8 scales differ (worst relative " << worst_scale_rel
               << "), RoPE: " << rope_differ << " values differ (worst " << worst_rope
               << " ulp); indexer: " << idx_differ << " of " << idx_entries
               << " entries not bitwise equal (worst excess over the bound " << worst_idx_excess
               << ")");
  if (pb.o.format == CacheFormat::bf16) {
    REQUIRE(worst_latent <= 1);
  } else {
    REQUIRE(worst_code <= 1);
    REQUIRE(worst_scale_rel <= std::ldexp(1.0, -7) + std::ldexp(1.0, -23));
  }
  REQUIRE(worst_rope <= 1);
  CHECK(rope_differ == 0);  // k_pe RoPE involves no reduction: bitwise
  REQUIRE(worst_idx_excess <= 0.0);
  CHECK(idx_differ <= std::max<std::size_t>(1, idx_entries / 10));

  std::size_t kv_touched = 0, idx_touched = 0;
  for (std::size_t i = 0; i < hk.size(); ++i)
    if (!kv_mask[i] && (g.kv_cache[i] != kSentinel || hk[i] != kSentinel)) ++kv_touched;
  for (std::size_t i = 0; i < idx_mask.size(); ++i)
    if (!idx_mask[i] &&
        (g.index_cache[i] != kSentinel || pb.index_cache.host[i] != kSentinel))
      ++idx_touched;
  CHECK(kv_touched == 0);
  CHECK(idx_touched == 0);
}

void check_all(Problem& pb, const GpuOut& g) {
  check_queries(pb, g);
  check_topk(pb, g);
  check_caches(pb, g);
}

/// Bytes of `v` that are not the sentinel (a count, so a failure does not print the buffer).
std::size_t non_sentinel(const std::vector<std::uint8_t>& v) {
  return std::size_t(std::count_if(v.begin(), v.end(), [](std::uint8_t b) { return b != kSentinel; }));
}
/// Bytes that differ between two buffers (size mismatch counts as all).
std::size_t bytes_differ(const std::vector<std::uint8_t>& a, const std::vector<std::uint8_t>& b) {
  if (a.size() != b.size()) return std::max(a.size(), b.size());
  std::size_t n = 0;
  for (std::size_t i = 0; i < a.size(); ++i) n += a[i] != b[i];
  return n;
}
bool contains(const std::string& s, const std::string& sub) { return s.find(sub) != std::string::npos; }

const char* format_name(CacheFormat f) { return f == CacheFormat::bf16 ? "bf16" : "fp8_ds_mla"; }

// ---- the kernel's conversions against the library, on every float ----

/// Counts the inputs u (all 2^32 float bit patterns) where the kernel's pack_bf16x8 or
/// encode_e4m3x8 differ from bfloat16::from_float or fp8_e4m3::encode, in chunks of 8 holding
/// f and -f alternately (every position of both halves of each pair), and the same chunk with a
/// NaN (sign and payload from u) at position u % 8 (the chunk's library path, NaN included).
__global__ void conversions_vs_library(unsigned long long* mismatches, unsigned* first_bad) {
  namespace d = dcpattn::cuda_kernels::detail::prologue;
  const std::uint64_t n = std::uint64_t(1) << 32;
  for (std::uint64_t i = blockIdx.x * std::uint64_t(blockDim.x) + threadIdx.x; i < n;
       i += std::uint64_t(gridDim.x) * blockDim.x) {
    const std::uint32_t u = std::uint32_t(i);
    const float f = __uint_as_float(u);
    unsigned bad = 0;
    for (int variant = 0; variant < 2; ++variant) {
      float x[8];
#pragma unroll
      for (int k = 0; k < 8; ++k)
        x[k] = variant == 1 && k == int(u & 7) ? __uint_as_float((u & 0x803fffffu) | 0x7fc00000u)
               : (k & 1)                        ? -f
                                                : f;
      const uint4 b = d::pack_bf16x8(x);
      std::uint32_t e[2];
      d::encode_e4m3x8(x, e);
      const std::uint32_t bw[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        bad += ((bw[k / 2] >> (16 * (k % 2))) & 0xffffu) != bfloat16::from_float(x[k]).bits;
        bad += ((e[k / 4] >> (8 * (k % 4))) & 0xffu) != dcpattn::fp8_e4m3::encode(x[k]);
      }
    }
    if (bad) {
      atomicAdd(mismatches, 1ull);
      atomicMin(first_bad, u);
    }
  }
}

// ---- batch-size invariance ----

/// The same arguments restricted to their first n rows (same data, same strides).
template <CacheFormat F>
Args<F> first_rows(Args<F> a, std::int64_t n) {
  auto rows2 = [n](auto v) {
    return dcpattn::make_view(v.data_handle(), {n, std::int64_t(v.extent(1))},
                              {std::int64_t(v.stride(0)), std::int64_t(v.stride(1))});
  };
  auto rows1 = [n](auto v) {
    return dcpattn::make_view(v.data_handle(), {n}, {std::int64_t(v.stride(0))});
  };
  a.q_c = rows2(a.q_c);
  a.q_c_out = rows2(a.q_c_out);
  a.kv_c = rows2(a.kv_c);
  a.k_pe = rows2(a.k_pe);
  a.positions = rows1(a.positions);
  a.slot_mapping = rows1(a.slot_mapping);
  if (a.index_k.data_handle() != nullptr) a.index_k = rows2(a.index_k);
  if (a.topk_indices.data_handle() != nullptr) a.topk_indices = rows2(a.topk_indices);
  return a;
}

/// Runs the first n rows of `pb` alone on the device (outputs reset to the sentinel first) and
/// counts the bytes of those rows' outputs (query rows, top-k rows, cache entries) that differ
/// from `whole`, the outputs of the whole batch; and the bytes written outside them.
void check_first_rows_alone(Problem& pb, const GpuOut& whole, std::int64_t n) {
  for (Mirror* m : {&pb.q_out_buf(), &pb.kv_cache, &pb.index_cache, &pb.topk})
    if (!m->host.empty()) CUDA_OK(cudaMemset(m->dev, kSentinel, m->host.size()));
  if (pb.o.format == CacheFormat::bf16)
    dcpattn::cuda_kernels::fused_prologue(
        first_rows<CacheFormat::bf16>(make_args<CacheFormat::bf16>(pb, true), n), nullptr);
  else
    dcpattn::cuda_kernels::fused_prologue(
        first_rows<CacheFormat::fp8_ds_mla>(make_args<CacheFormat::fp8_ds_mla>(pb, true), n),
        nullptr);
  CUDA_OK(cudaGetLastError());
  const GpuOut part = download_outputs(pb);

  std::size_t q_differ = 0, topk_differ = 0, kv_differ = 0, idx_differ = 0, entries = 0;
  for (std::int64_t t = 0; t < n; ++t)
    for (int i = 0; i < kQ; ++i)
      for (int b = 0; b < 2; ++b) {
        const std::size_t at = std::size_t(pb.p_q_out.index(t, i)) * 2 + std::size_t(b);
        q_differ += part.q_out[at] != whole.q_out[at];
      }
  if (pb.o.topk)
    for (std::int64_t t = 0; t < n; ++t)
      for (std::int64_t k = 0; k < pb.o.K; ++k)
        for (int b = 0; b < 4; ++b) {
          const std::size_t at = std::size_t(pb.p_topk.index(t, k)) * 4 + std::size_t(b);
          topk_differ += part.topk[at] != whole.topk[at];
        }
  std::vector<char> kv_mask(part.kv_cache.size(), 0), idx_mask(part.index_cache.size(), 0);
  for (std::int64_t t = 0; t < n; ++t) {
    if (!pb.writes(t)) continue;
    ++entries;
    const std::int64_t slot = pb.slot_values[std::size_t(t)];
    std::size_t begin = 0, bytes = 0;
    if (pb.o.format == CacheFormat::bf16)
      begin = std::size_t(pb.p_cache_bf16.index(slot, 0)) * 2, bytes = dcpattn::kMlaQkDim * 2;
    else
      begin = std::size_t(pb.p_cache_bytes.index(slot, 0)), bytes = kEntry;
    for (std::size_t b = begin; b < begin + bytes; ++b) {
      kv_differ += part.kv_cache[b] != whole.kv_cache[b];
      kv_mask[b] = 1;
    }
    if (!pb.o.indexer) continue;
    const std::int64_t ps = pb.o.page_size, page = slot / ps, s = slot % ps;
    const auto vbase = std::size_t(pb.p_index_cache.index(page, s * kIdx));
    const auto sbase = std::size_t(pb.p_index_cache.index(page, ps * kIdx + 4 * s));
    for (std::size_t b = vbase; b < vbase + kIdx; ++b) {
      idx_differ += part.index_cache[b] != whole.index_cache[b];
      idx_mask[b] = 1;
    }
    for (std::size_t b = sbase; b < sbase + 4; ++b) {
      idx_differ += part.index_cache[b] != whole.index_cache[b];
      idx_mask[b] = 1;
    }
  }
  std::size_t touched = 0;
  for (std::size_t i = 0; i < kv_mask.size(); ++i)
    touched += !kv_mask[i] && part.kv_cache[i] != kSentinel;
  for (std::size_t i = 0; i < idx_mask.size(); ++i)
    touched += !idx_mask[i] && part.index_cache[i] != kSentinel;
  INFO("first " << n << " rows alone vs inside the batch of " << pb.o.T << ": q_c_out "
                << q_differ << ", top-k " << topk_differ << ", MLA cache " << kv_differ
                << ", indexer cache " << idx_differ << " bytes differ (" << entries
                << " entries); " << touched << " cache bytes written outside them");
  CHECK(entries > 0);
  CHECK(q_differ == 0);
  CHECK(topk_differ == 0);
  CHECK(kv_differ == 0);
  CHECK(idx_differ == 0);
  CHECK(touched == 0);
}

}  // namespace

/// A zeroed device word for PrologueArgs::error_flags.
struct ErrorWord {
  std::uint32_t* ptr = nullptr;
  ErrorWord() {
    CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&ptr), sizeof(std::uint32_t)));
    CUDA_OK(cudaMemset(ptr, 0, sizeof(std::uint32_t)));
  }
  ~ErrorWord() { cudaFree(ptr); }
  ErrorWord(const ErrorWord&) = delete;
  ErrorWord& operator=(const ErrorWord&) = delete;
  std::uint32_t read() const {
    std::uint32_t v = 0;
    CUDA_OK(cudaMemcpy(&v, ptr, sizeof(v), cudaMemcpyDeviceToHost));
    return v;
  }
};

TEST_CASE("CUDA prologue matches the host: both cache formats, with and without the indexer",
          "[kernels][prologue][cuda]") {
  for (CacheFormat f : {CacheFormat::bf16, CacheFormat::fp8_ds_mla})
    for (bool indexer : {true, false})
      for (std::int64_t T : {1, 5, 300}) {
        Options o;
        o.T = T;
        o.format = f;
        o.indexer = indexer;
        o.seed = std::uint64_t(100 + T + (indexer ? 7 : 0) + (f == CacheFormat::bf16 ? 0 : 13));
        CAPTURE(format_name(f), indexer, T);
        Problem pb = make_problem(o);
        ErrorWord flags;
        const GpuOut g = run_both(pb, nullptr, flags.ptr);
        check_all(pb, g);
        CHECK(flags.read() == 0u);  // valid values (other ranks' rows included): nothing recorded
      }
}

TEST_CASE("CUDA prologue on strided, misaligned and in-place views", "[kernels][prologue][cuda]") {
  for (CacheFormat f : {CacheFormat::bf16, CacheFormat::fp8_ds_mla}) {
    SECTION(std::string("fused q_c | kv_c | k_pe projection rows, K = 2050, ") + format_name(f)) {
      Options o;
      // 16-byte top-k stores with a tail of 2 (rows 2052 apart keep every row start aligned).
      o.T = 300, o.format = f, o.fused_qkv = true, o.K = 2050, o.topk_stride = 2052, o.seed = 21;
      Problem pb = make_problem(o);
      check_all(pb, run_both(pb));
    }
    SECTION(std::string("misaligned views, odd strides, page size 5, K = 7, ") + format_name(f)) {
      Options o;
      o.T = 300, o.format = f, o.misaligned = true, o.page_size = 5, o.index_pages = 70,
      o.K = 7, o.seed = 22;
      Problem pb = make_problem(o);
      check_all(pb, run_both(pb));
    }
    SECTION(std::string("q_c_out aliases q_c, ") + format_name(f)) {
      Options o;
      o.T = 300, o.format = f, o.in_place = true, o.seed = 23;
      Problem pb = make_problem(o);
      check_all(pb, run_both(pb));
    }
    SECTION(std::string("neox k_pe, interleaved indexer RoPE, no bias, ") + format_name(f)) {
      Options o;
      o.T = 300, o.format = f, o.kv_style = RopeStyle::neox,
      o.index_style = RopeStyle::interleaved, o.bias = false, o.seed = 24;
      Problem pb = make_problem(o);
      check_all(pb, run_both(pb));
    }
  }
}

TEST_CASE("CUDA prologue on a rank storing none of the tokens still normalizes every query",
          "[kernels][prologue][cuda][dcp]") {
  // The seed bug: the fused kernel returned on a negative slot before normalizing the query, so
  // every non-owner rank attended with unnormalized (here: never written) queries.
  for (CacheFormat f : {CacheFormat::bf16, CacheFormat::fp8_ds_mla})
    for (std::int64_t T : {1, 5, 300}) {
      CAPTURE(format_name(f), T);
      Options o;
      o.T = T, o.format = f, o.own_fraction = 0.0, o.seed = std::uint64_t(300 + T);
      Problem pb = make_problem(o);
      const GpuOut g = run_both(pb);
      // Every query row written and normalized: equal to the host's, and no longer the sentinel.
      check_queries(pb, g);
      std::size_t sentinel_rows = 0;
      for (std::int64_t t = 0; t < T; ++t) {
        bool all_sentinel = true;
        for (int i = 0; i < kQ && all_sentinel; ++i)
          all_sentinel = load_at<std::uint16_t>(g.q_out, pb.p_q_out.index(t, i)) == 0xa5a5;
        sentinel_rows += all_sentinel;
      }
      CHECK(sentinel_rows == 0);
      // Both caches bytewise untouched, every top-k row reset.
      CHECK(non_sentinel(g.kv_cache) == 0);
      CHECK(non_sentinel(g.index_cache) == 0);
      check_topk(pb, g);
    }
}

TEST_CASE("CUDA prologue skips rows whose slot or position is out of range, and records them",
          "[kernels][prologue][cuda][errors]") {
  // The host refuses these batches; the kernel cannot without a synchronization, so such a row
  // must behave exactly like a row of another rank (slot -1) and write nothing out of bounds.
  for (CacheFormat f : {CacheFormat::bf16, CacheFormat::fp8_ds_mla})
    for (bool indexer : {true, false}) {
      CAPTURE(format_name(f), indexer);
      Options o;
      o.T = 12, o.format = f, o.indexer = indexer, o.own_fraction = 1.0, o.seed = 41;
      o.index_pages = 4;
      o.num_slots = 5 * o.page_size;  // the last page of the MLA cache has no indexer page
      Problem pb = make_problem(o);
      const std::int64_t n = pb.num_slots, maxpos = o.max_position;
      auto set_slot = [&](std::int64_t t, std::int64_t s) {
        pb.slot_values[std::size_t(t)] = s;
        store_at<std::int64_t>(pb.slots.host, pb.p_slots.index(t), s);
      };
      auto set_pos = [&](std::int64_t t, std::int64_t p) {
        store_at<std::int64_t>(pb.positions.host, pb.p_positions.index(t), p);
      };
      set_slot(0, n);                                           // one past the cache
      set_slot(1, -2);                                          // negative, not -1
      set_slot(2, std::numeric_limits<std::int64_t>::max());
      set_slot(3, std::numeric_limits<std::int64_t>::min());
      set_slot(4, 10), set_pos(4, maxpos);                      // position one past the table
      set_slot(5, 11), set_pos(5, -1);                          // negative position
      set_slot(6, 4 * o.page_size + 3);                         // MLA slot without indexer page
      set_slot(7, (indexer ? o.index_pages * o.page_size : n) - 1);  // valid: last usable slot
      set_slot(8, 0);                                           // valid: first slot
      set_slot(9, -1), set_pos(9, -12345);                      // another rank's row: never read
      set_slot(10, 20);                                         // valid
      set_slot(11, o.page_size + 7);                            // valid, second page
      CHECK_FALSE(pb.writes(0));
      CHECK(pb.writes(6) == !indexer);  // without the indexer that slot is valid
      CHECK(pb.writes(7));
      ErrorWord flags;
      const GpuOut g = run_both(pb, nullptr, flags.ptr);
      check_all(pb, g);
      // Recorded: rows 0..3 (and 6 with the indexer) by their slot, rows 4 and 5 by their
      // position; row 9 (slot -1) is another rank's and no error.
      CHECK(flags.read() == (dcpattn::input_error_slot | dcpattn::input_error_position));
      // Each kind alone: only the slot rows bad, then only a position. (run_both leaves -1 in
      // the host slot buffer for rows that write nothing: every slot is stored again first.)
      for (std::int64_t t = 0; t < o.T; ++t)
        set_slot(t, t != 1 && !pb.writes(t) ? -1 : pb.slot_values[std::size_t(t)]);
      ErrorWord slot_only;
      check_all(pb, run_both(pb, nullptr, slot_only.ptr));
      CHECK(slot_only.read() == dcpattn::input_error_slot);
      for (std::int64_t t = 0; t < o.T; ++t) set_slot(t, pb.slot_values[std::size_t(t)]);
      set_slot(1, -1), set_slot(4, 10), set_pos(4, maxpos);
      ErrorWord position_only;
      check_all(pb, run_both(pb, nullptr, position_only.ptr));
      CHECK(position_only.read() == dcpattn::input_error_position);
      CHECK(dcpattn::describe_input_errors(dcpattn::input_error_position).find("positions") !=
            std::string::npos);
    }
}

TEST_CASE("CUDA prologue is deterministic and CUDA-graph capturable", "[kernels][prologue][cuda]") {
  Options o;
  o.T = 300, o.format = CacheFormat::fp8_ds_mla, o.seed = 51;
  Problem pb = make_problem(o);
  const GpuOut direct = run_both(pb);
  check_all(pb, direct);

  // Same inputs again, this time through a captured graph on a non-default stream.
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (Mirror* m : {&pb.q_out, &pb.kv_cache, &pb.index_cache, &pb.topk}) {
    CUDA_OK(cudaMemset(m->dev, kSentinel, m->host.size()));
  }
  for (std::int64_t t = 0; t < o.T; ++t)  // the kernel sees the raw slot values again
    store_at<std::int64_t>(pb.slots.host, pb.p_slots.index(t), pb.slot_values[std::size_t(t)]);
  pb.slots.upload();
  CUDA_OK(cudaDeviceSynchronize());
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  dcpattn::cuda_kernels::fused_prologue(make_args<CacheFormat::fp8_ds_mla>(pb, true), stream);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_OK(cudaGraphLaunch(exec, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  const GpuOut replay = download_outputs(pb);
  CHECK(bytes_differ(replay.q_out, direct.q_out) == 0);
  CHECK(bytes_differ(replay.kv_cache, direct.kv_cache) == 0);
  CHECK(bytes_differ(replay.index_cache, direct.index_cache) == 0);
  CHECK(bytes_differ(replay.topk, direct.topk) == 0);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST_CASE("CUDA prologue refuses bad extents before enqueuing anything, and accepts T = 0",
          "[kernels][prologue][cuda][errors]") {
  Options o;
  o.T = 5, o.format = CacheFormat::fp8_ds_mla, o.seed = 61;
  Problem pb = make_problem(o);
  for (Mirror* m : all_buffers(pb))
    if (!m->host.empty()) m->upload();
  auto message_of = [&](auto&& mutate) {
    auto a = make_args<CacheFormat::fp8_ds_mla>(pb, true);
    mutate(a);
    try {
      dcpattn::cuda_kernels::fused_prologue(a, nullptr);
    } catch (const dcpattn::Error& e) {
      return e.message();
    }
    return std::string("<no dcpattn::Error thrown>");
  };
  using A = Args<CacheFormat::fp8_ds_mla>;
  std::string msg = message_of([](A& a) {
    a.q_c_out = dcpattn::make_view(a.q_c_out.data_handle(), {4, kQ});
  });
  CHECK(contains(msg, "q_c_out"));
  msg = message_of([](A& a) {
    a.kv_cache = dcpattn::make_view(a.kv_cache.data_handle(), {a.kv_cache.extent(0), 655});
  });
  CHECK(contains(msg, "kv_cache"));
  msg = message_of([](A& a) {
    a.index_k_cache = dcpattn::make_view(a.index_k_cache.data_handle(), {2, 131});
  });
  CHECK(contains(msg, "index_k_cache"));
  msg = message_of([](A& a) { a.positions = dcpattn::make_view(a.positions.data_handle(), {4}); });
  CHECK(contains(msg, "positions"));
  msg = message_of([](A& a) {
    a.topk_indices = dcpattn::make_view(a.topk_indices.data_handle(), {6, 64});
  });
  CHECK(contains(msg, "topk_indices"));
  // Nothing was enqueued: every output still holds the sentinel.
  CHECK(non_sentinel(pb.q_out.download()) == 0);
  CHECK(non_sentinel(pb.kv_cache.download()) == 0);
  CHECK(non_sentinel(pb.topk.download()) == 0);

  // An empty batch is valid and does nothing.
  auto empty = make_args<CacheFormat::fp8_ds_mla>(pb, true);
  empty.q_c = dcpattn::make_view(empty.q_c.data_handle(), {0, kQ});
  empty.q_c_out = dcpattn::make_view(empty.q_c_out.data_handle(), {0, kQ});
  empty.kv_c = dcpattn::make_view(empty.kv_c.data_handle(), {0, kLatent});
  empty.k_pe = dcpattn::make_view(empty.k_pe.data_handle(), {0, kRope});
  empty.positions = dcpattn::make_view(empty.positions.data_handle(), {0});
  empty.slot_mapping = dcpattn::make_view(empty.slot_mapping.data_handle(), {0});
  empty.index_k = dcpattn::make_view(empty.index_k.data_handle(), {0, kIdx});
  empty.topk_indices = dcpattn::make_view(empty.topk_indices.data_handle(), {0, 64});
  CHECK_NOTHROW(dcpattn::cuda_kernels::fused_prologue(empty, nullptr));
  CHECK(non_sentinel(pb.kv_cache.download()) == 0);
  CHECK(non_sentinel(pb.q_out.download()) == 0);
}

TEST_CASE("CUDA prologue on large batches (one warp per row), and the rows of a small batch "
          "(three warps per row) give the same bytes as inside a large one",
          "[kernels][prologue][cuda]") {
  for (CacheFormat f : {CacheFormat::bf16, CacheFormat::fp8_ds_mla}) {
    SECTION(std::string("T = 5000, ") + format_name(f)) {
      Options o;
      o.T = 5000, o.format = f, o.indexer = f == CacheFormat::fp8_ds_mla, o.index_pages = 100;
      o.K = f == CacheFormat::fp8_ds_mla ? 2048 : 64;
      o.seed = std::uint64_t(f == CacheFormat::bf16 ? 71 : 72);
      Problem pb = make_problem(o);
      const GpuOut g = run_both(pb);
      check_all(pb, g);
      check_first_rows_alone(pb, g, 200);
    }
    SECTION(std::string("T = 3000, misaligned views, odd strides, page size 5, K = 7, ") +
            format_name(f)) {
      Options o;
      o.T = 3000, o.format = f, o.misaligned = true, o.page_size = 5, o.index_pages = 500,
      o.K = 7, o.own_fraction = 0.8, o.seed = 73;
      Problem pb = make_problem(o);
      const GpuOut g = run_both(pb);
      check_all(pb, g);
      check_first_rows_alone(pb, g, 100);
    }
  }
}

TEST_CASE("CUDA prologue's float -> bf16 and float -> e4m3 conversions equal the library's on "
          "every input",
          "[kernels][prologue][cuda]") {
  unsigned long long* mismatches = nullptr;
  unsigned* first_bad = nullptr;
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&mismatches), sizeof(unsigned long long)));
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&first_bad), sizeof(unsigned)));
  CUDA_OK(cudaMemset(mismatches, 0, sizeof(unsigned long long)));
  CUDA_OK(cudaMemset(first_bad, 0xff, sizeof(unsigned)));
  int sms = 0;
  CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  conversions_vs_library<<<unsigned(8 * sms), 256>>>(mismatches, first_bad);
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaDeviceSynchronize());
  unsigned long long n_bad = 0;
  unsigned bad = 0;
  CUDA_OK(cudaMemcpy(&n_bad, mismatches, sizeof n_bad, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(&bad, first_bad, sizeof bad, cudaMemcpyDeviceToHost));
  cudaFree(mismatches);
  cudaFree(first_bad);
  INFO(n_bad << " float bit patterns convert differently; the first is 0x" << std::hex << bad);
  CHECK(n_bad == 0);
}
