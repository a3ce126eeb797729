// SPDX-License-Identifier: Apache-2.0
// Host fused prologue against plain double-precision references: query RMSNorm on every row (a
// rank that stores none of the batch's tokens included), KV RMSNorm + RoPE into the bf16 and the
// fp8 ds_mla cache, indexer LayerNorm + RoPE + fp8 into the paged indexer cache, only at valid
// slots, the top-k reset, and refusal of bad slot_mapping / positions before anything is written.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "support/catch.hpp"

#include "dcpattn/core/numeric.hpp"
#include "dcpattn/core/rope.hpp"
#include "dcpattn/core/tensor.hpp"
#include "dcpattn/error.hpp"
#include "dcpattn/kernels/cache_layout.hpp"
#include "dcpattn/kernels/host/prologue.hpp"
#include "dcpattn/kernels/input_errors.hpp"

namespace {

using dcpattn::bfloat16;
using dcpattn::CacheFormat;

constexpr int kQ = 1536;
constexpr int kLatent = 512;
constexpr int kRope = 64;
constexpr int kIdx = 128;
constexpr int kEntry = 656;
constexpr int kIdxBytes = 132;
constexpr int kPageSize = 16;
constexpr std::int64_t kMaxPosition = 256;
constexpr std::uint8_t kSentinel = 0xa5;
constexpr double kEps = 1e-6;

double bf16_plain(std::uint16_t bits) {
  const std::uint32_t u = std::uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
double bf(bfloat16 x) {
  return bf16_plain(x.bits);
}

double e4m3_plain(std::uint8_t b) {
  const int e = (b >> 3) & 15;
  const int m = b & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double mag = e == 0 ? std::ldexp(double(m), -9) : std::ldexp(1.0 + m / 8.0, e - 7);
  return (b & 0x80) ? -mag : mag;
}
double f32_at(const std::uint8_t* p) {
  float f;
  std::memcpy(&f, p, 4);  // little-endian hosts only, like the caches themselves
  return f;
}

bfloat16 random_bf16(std::mt19937_64& rng, float lo, float hi) {
  return bfloat16::from_float(std::uniform_real_distribution<float>(lo, hi)(rng));
}
std::vector<bfloat16> random_vec(std::size_t n, std::mt19937_64& rng, float lo, float hi) {
  std::vector<bfloat16> v(n);
  for (auto& x : v) x = random_bf16(rng, lo, hi);
  return v;
}

// One batch of prologue inputs, and the caches and buffers it writes.
struct Batch {
  std::int64_t T = 0;
  std::vector<bfloat16> q_c, q_w, kv_c, kv_w, k_pe, index_k, ik_w, ik_b;
  std::vector<std::int64_t> positions, slot_mapping;
  std::vector<float> cos_sin;  // (kMaxPosition, 64): 32 cos then 32 sin

  std::int64_t num_slots = 3 * kPageSize;
  std::int64_t index_pages = 3;
  std::vector<bfloat16> q_out;
  std::vector<std::uint8_t> kv_cache;     // bf16 (num_slots, 576) or fp8 (num_slots, 656) bytes
  std::vector<std::uint8_t> index_cache;  // (index_pages, kPageSize * 132)
  std::int64_t K = 8;
  std::vector<std::int32_t> topk;

  void reset_outputs(CacheFormat f) {
    q_out.assign(std::size_t(T * kQ), bfloat16{});  // zeros: a skipped query norm shows
    kv_cache.assign(std::size_t(num_slots * (f == CacheFormat::bf16 ? 576 * 2 : kEntry)),
                    kSentinel);
    index_cache.assign(std::size_t(index_pages * kPageSize * kIdxBytes), kSentinel);
    topk.assign(std::size_t(T * K), 7);
  }
};

Batch make_batch(std::int64_t T, std::vector<std::int64_t> slots, std::mt19937_64& rng) {
  Batch b;
  b.T = T;
  b.q_c = random_vec(std::size_t(T * kQ), rng, -2.0f, 2.0f);
  b.q_w = random_vec(kQ, rng, 0.5f, 1.5f);
  b.kv_c = random_vec(std::size_t(T * kLatent), rng, -3.0f, 3.0f);
  b.kv_w = random_vec(kLatent, rng, 0.5f, 1.5f);
  b.k_pe = random_vec(std::size_t(T * kRope), rng, -1.0f, 1.0f);
  b.index_k = random_vec(std::size_t(T * kIdx), rng, -2.0f, 3.0f);
  b.ik_w = random_vec(kIdx, rng, 0.5f, 1.5f);
  b.ik_b = random_vec(kIdx, rng, -0.2f, 0.2f);
  for (std::int64_t t = 0; t < T; ++t)
    b.positions.push_back(std::int64_t(rng() % std::uint64_t(kMaxPosition)));
  b.slot_mapping = std::move(slots);
  b.cos_sin.resize(std::size_t(kMaxPosition * kRope));
  for (std::int64_t p = 0; p < kMaxPosition; ++p)
    for (int i = 0; i < kRope / 2; ++i) {
      const double angle = double(p) * std::pow(10000.0, -2.0 * i / kRope);
      b.cos_sin[std::size_t(p * kRope + i)] = float(std::cos(angle));
      b.cos_sin[std::size_t(p * kRope + kRope / 2 + i)] = float(std::sin(angle));
    }
  return b;
}

template <CacheFormat F>
dcpattn::PrologueArgs<dcpattn::mla_cache_out_view_t<F>> make_args(Batch& b, bool indexer,
                                                                  bool in_place = false) {
  using dcpattn::make_view;
  dcpattn::PrologueArgs<dcpattn::mla_cache_out_view_t<F>> a;
  const std::int64_t T = b.T;
  if (in_place) {
    b.q_out = b.q_c;
    a.q_c = make_view(static_cast<const bfloat16*>(b.q_out.data()), {T, std::int64_t(kQ)});
  } else {
    a.q_c = make_view(b.q_c.data(), {T, std::int64_t(kQ)});
  }
  a.q_c_out = make_view(b.q_out.data(), {T, std::int64_t(kQ)});
  a.q_norm_weight = make_view(b.q_w.data(), {std::int64_t(kQ)});
  a.kv_c = make_view(b.kv_c.data(), {T, std::int64_t(kLatent)});
  a.kv_norm_weight = make_view(b.kv_w.data(), {std::int64_t(kLatent)});
  a.k_pe = make_view(b.k_pe.data(), {T, std::int64_t(kRope)});
  a.positions = make_view(b.positions.data(), {std::int64_t(b.positions.size())});
  a.cos_sin_cache = make_view(b.cos_sin.data(), {kMaxPosition, std::int64_t(kRope)});
  a.slot_mapping = make_view(b.slot_mapping.data(), {std::int64_t(b.slot_mapping.size())});
  if constexpr (F == CacheFormat::bf16)
    a.kv_cache =
        make_view(reinterpret_cast<bfloat16*>(b.kv_cache.data()), {b.num_slots, std::int64_t(576)});
  else
    a.kv_cache = make_view(b.kv_cache.data(), {b.num_slots, std::int64_t(kEntry)});
  if (indexer) {
    a.index_k = make_view(b.index_k.data(), {T, std::int64_t(kIdx)});
    a.index_k_norm_weight = make_view(b.ik_w.data(), {std::int64_t(kIdx)});
    a.index_k_norm_bias = make_view(b.ik_b.data(), {std::int64_t(kIdx)});
    a.index_k_cache =
        make_view(b.index_cache.data(), {b.index_pages, std::int64_t(kPageSize * kIdxBytes)});
  }
  a.topk_indices = make_view(b.topk.data(), {T, b.K});
  return a;
}

// ---- plain double references ----

std::vector<double> rms_norm_ref(const bfloat16* x, const std::vector<bfloat16>& w, int n) {
  double ss = 0.0;
  for (int i = 0; i < n; ++i) ss += bf(x[i]) * bf(x[i]);
  const double r = 1.0 / std::sqrt(ss / n + kEps);
  std::vector<double> out(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) out[std::size_t(i)] = bf(x[i]) * r * bf(w[std::size_t(i)]);
  return out;
}

std::vector<double> layer_norm_ref(const bfloat16* x, const std::vector<bfloat16>& w,
                                   const std::vector<bfloat16>& bias, int n) {
  double mean = 0.0;
  for (int i = 0; i < n; ++i) mean += bf(x[i]);
  mean /= n;
  double var = 0.0;
  for (int i = 0; i < n; ++i) var += (bf(x[i]) - mean) * (bf(x[i]) - mean);
  var /= n;
  std::vector<double> out(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i)
    out[std::size_t(i)] = (bf(x[i]) - mean) / std::sqrt(var + kEps) * bf(w[std::size_t(i)]) +
                          bf(bias[std::size_t(i)]);
  return out;
}

// Rotates the first 64 values of x at `pos`: pair i is (2i, 2i+1) interleaved or (i, i+32) neox.
std::vector<double> rope_ref(std::vector<double> x, const Batch& b, std::int64_t pos, bool neox) {
  for (int i = 0; i < kRope / 2; ++i) {
    const int a = neox ? i : 2 * i, c = neox ? i + kRope / 2 : 2 * i + 1;
    const double cs = b.cos_sin[std::size_t(pos * kRope + i)];
    const double sn = b.cos_sin[std::size_t(pos * kRope + kRope / 2 + i)];
    const double x0 = x[std::size_t(a)], x1 = x[std::size_t(c)];
    x[std::size_t(a)] = x0 * cs - x1 * sn;
    x[std::size_t(c)] = x0 * sn + x1 * cs;
  }
  return x;
}
// |x0| + |x1| of the pair each of the first 64 dims belongs to (bounds the RoPE rounding error).
std::vector<double> pair_magnitude(const std::vector<double>& x, bool neox) {
  std::vector<double> m(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) m[i] = std::fabs(x[i]);
  for (int i = 0; i < kRope / 2; ++i) {
    const int a = neox ? i : 2 * i, c = neox ? i + kRope / 2 : 2 * i + 1;
    m[std::size_t(a)] = m[std::size_t(c)] =
        std::fabs(x[std::size_t(a)]) + std::fabs(x[std::size_t(c)]);
  }
  return m;
}

// bf16 rounding of a value computed in fp32: half an ulp is at most 2^-8 of the value; fp32
// arithmetic adds ~1e-6 relative to the magnitudes involved.
constexpr double kBf16Rel = 1.0 / 256.0;

void check_queries(const Batch& b, const std::vector<bfloat16>& q_in) {
  double worst = 0.0;
  for (std::int64_t t = 0; t < b.T; ++t) {
    const auto ref = rms_norm_ref(&q_in[std::size_t(t * kQ)], b.q_w, kQ);
    for (int i = 0; i < kQ; ++i) {
      const double got = bf(b.q_out[std::size_t(t * kQ + i)]);
      const double r = ref[std::size_t(i)];
      REQUIRE(std::fabs(got - r) <= kBf16Rel * std::fabs(r) + 1e-6);
      worst = std::max(worst, std::fabs(got - r) / (std::fabs(r) + 1e-30));
    }
  }
  INFO("worst relative query error " << worst);
  CHECK(worst <= kBf16Rel);
}

void check_topk_reset(const Batch& b) {
  for (std::int32_t v : b.topk) REQUIRE(v == -1);
}

// Checks the MLA cache entry of row t at `slot` against RMSNorm(kv_c) * w and RoPE(k_pe).
void check_kv_entry(const Batch& b, CacheFormat f, std::int64_t t, std::int64_t slot) {
  const auto latent = rms_norm_ref(&b.kv_c[std::size_t(t * kLatent)], b.kv_w, kLatent);
  std::vector<double> pe(kRope);
  for (int i = 0; i < kRope; ++i) pe[std::size_t(i)] = bf(b.k_pe[std::size_t(t * kRope + i)]);
  const auto pe_mag = pair_magnitude(pe, false);
  const auto rope = rope_ref(pe, b, b.positions[std::size_t(t)], /*neox=*/false);
  if (f == CacheFormat::bf16) {
    const std::uint8_t* e = &b.kv_cache[std::size_t(slot * 576 * 2)];
    auto at = [&](int i) { return bf16_plain(std::uint16_t(e[2 * i] | (e[2 * i + 1] << 8))); };
    for (int i = 0; i < kLatent; ++i) {
      const double r = latent[std::size_t(i)];
      REQUIRE(std::fabs(at(i) - r) <= kBf16Rel * std::fabs(r) + 1e-6);
    }
    for (int i = 0; i < kRope; ++i) {
      const double r = rope[std::size_t(i)];
      REQUIRE(std::fabs(at(kLatent + i) - r) <=
              kBf16Rel * std::fabs(r) + 1e-6 * pe_mag[std::size_t(i)]);
    }
    return;
  }
  // fp8 ds_mla: the bf16-rounded latent quantized per group of 128 with scale amax / 448.
  // e4m3 keeps 3 mantissa bits: a normal value is off by at most 2^-4 of itself, a subnormal one
  // (below 2^-6 scale) by at most half a step, 2^-10 scale.
  const std::uint8_t* e = &b.kv_cache[std::size_t(slot * kEntry)];
  for (int g = 0; g < 4; ++g) {
    const double scale = f32_at(e + 512 + 4 * g);
    double amax = 0.0;
    for (int i = g * 128; i < (g + 1) * 128; ++i)
      amax = std::max(amax, std::fabs(latent[std::size_t(i)]));
    REQUIRE(std::fabs(scale * 448.0 - amax) <= (kBf16Rel + 1e-6) * amax);
    for (int i = g * 128; i < (g + 1) * 128; ++i) {
      const double r = latent[std::size_t(i)];
      const double v_err = kBf16Rel * std::fabs(r) + 1e-6;  // ref -> bf16 latent
      const double tol = (std::fabs(r) + v_err) / 16.0 + v_err + scale / 1024.0 + 1e-6;
      REQUIRE(std::fabs(e4m3_plain(e[i]) * scale - r) <= tol);
    }
  }
  for (int i = 0; i < kRope; ++i) {
    const double got = bf16_plain(std::uint16_t(e[528 + 2 * i] | (e[529 + 2 * i] << 8)));
    const double r = rope[std::size_t(i)];
    REQUIRE(std::fabs(got - r) <= kBf16Rel * std::fabs(r) + 1e-6 * pe_mag[std::size_t(i)]);
  }
}

// Checks the indexer key of row t at `slot`: LayerNorm, neox RoPE on dims [0, 64), e4m3 with one
// fp32 scale, laid out as 128 values per token then one scale per token within the page.
void check_index_entry(const Batch& b, std::int64_t t, std::int64_t slot) {
  const auto ln = layer_norm_ref(&b.index_k[std::size_t(t * kIdx)], b.ik_w, b.ik_b, kIdx);
  const auto mag = pair_magnitude(ln, true);
  const auto ref = rope_ref(ln, b, b.positions[std::size_t(t)], /*neox=*/true);
  const std::int64_t page = slot / kPageSize, s = slot % kPageSize;
  const std::uint8_t* base = &b.index_cache[std::size_t(page * kPageSize * kIdxBytes)];
  const double scale = f32_at(base + kPageSize * 128 + s * 4);
  double amax = 0.0, pre_err_max = 0.0;
  std::vector<double> pre_err(kIdx);
  for (int i = 0; i < kIdx; ++i) {
    // LayerNorm output and the rotated value are each rounded to bf16.
    pre_err[std::size_t(i)] =
        kBf16Rel * (std::fabs(ref[std::size_t(i)]) + mag[std::size_t(i)]) + 1e-5;
    amax = std::max(amax, std::fabs(ref[std::size_t(i)]));
    pre_err_max = std::max(pre_err_max, pre_err[std::size_t(i)]);
  }
  REQUIRE(std::fabs(scale * 448.0 - amax) <= pre_err_max);
  for (int i = 0; i < kIdx; ++i) {
    const double r = ref[std::size_t(i)];
    const double e = pre_err[std::size_t(i)];
    const double tol = (std::fabs(r) + e) / 16.0 + e + scale / 1024.0 + 1e-6;
    REQUIRE(std::fabs(e4m3_plain(base[s * 128 + i]) * scale - r) <= tol);
  }
}

// Every byte of both caches outside the entries of `written` slots still holds the sentinel.
void check_untouched(const Batch& b, CacheFormat f, const std::vector<std::int64_t>& written,
                     bool indexer) {
  const std::size_t entry = f == CacheFormat::bf16 ? 576 * 2 : kEntry;
  std::vector<char> kv_mask(b.kv_cache.size(), 0), idx_mask(b.index_cache.size(), 0);
  for (std::int64_t slot : written) {
    std::fill_n(kv_mask.begin() + std::ptrdiff_t(std::size_t(slot) * entry), entry, 1);
    if (!indexer) continue;
    const std::size_t page = std::size_t(slot / kPageSize) * kPageSize * kIdxBytes;
    const std::size_t s = std::size_t(slot % kPageSize);
    std::fill_n(idx_mask.begin() + std::ptrdiff_t(page + s * 128), 128, 1);
    std::fill_n(idx_mask.begin() + std::ptrdiff_t(page + kPageSize * 128 + s * 4), 4, 1);
  }
  for (std::size_t i = 0; i < b.kv_cache.size(); ++i)
    if (!kv_mask[i]) REQUIRE(b.kv_cache[i] == kSentinel);
  for (std::size_t i = 0; i < b.index_cache.size(); ++i)
    if (!idx_mask[i]) REQUIRE(b.index_cache[i] == kSentinel);
}

template <CacheFormat F>
void run(Batch& b, bool indexer, bool in_place = false) {
  dcpattn::host::fused_prologue(make_args<F>(b, indexer, in_place));
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

}  // namespace

TEST_CASE("prologue on a rank storing none of the tokens still normalizes every query",
          "[kernels][prologue]") {
  std::mt19937_64 rng(11);
  Batch b = make_batch(5, std::vector<std::int64_t>(5, -1), rng);
  for (bool in_place : {false, true}) {
    CAPTURE(in_place);
    b.reset_outputs(CacheFormat::bf16);
    run<CacheFormat::bf16>(b, true, in_place);
    check_queries(b, b.q_c);
    check_topk_reset(b);
    check_untouched(b, CacheFormat::bf16, {}, true);

    b.reset_outputs(CacheFormat::fp8_ds_mla);
    run<CacheFormat::fp8_ds_mla>(b, true, in_place);
    check_queries(b, b.q_c);
    check_topk_reset(b);
    check_untouched(b, CacheFormat::fp8_ds_mla, {}, true);
  }
}

TEST_CASE("prologue writes normalized, rotated and quantized entries at valid slots only",
          "[kernels][prologue]") {
  std::mt19937_64 rng(12);
  // Slots across pages, first and last slot of the cache included, mixed with other ranks' rows.
  const std::vector<std::int64_t> slots{5, -1, 47, 16, -1, 30, 0};
  Batch b = make_batch(std::int64_t(slots.size()), slots, rng);
  std::vector<std::int64_t> written;
  for (std::int64_t s : slots)
    if (s >= 0) written.push_back(s);
  for (CacheFormat f : {CacheFormat::bf16, CacheFormat::fp8_ds_mla}) {
    CAPTURE(int(f));
    b.reset_outputs(f);
    if (f == CacheFormat::bf16)
      run<CacheFormat::bf16>(b, true);
    else
      run<CacheFormat::fp8_ds_mla>(b, true);
    check_queries(b, b.q_c);
    check_topk_reset(b);
    for (std::int64_t t = 0; t < b.T; ++t) {
      if (slots[std::size_t(t)] < 0) continue;
      check_kv_entry(b, f, t, slots[std::size_t(t)]);
      check_index_entry(b, t, slots[std::size_t(t)]);
    }
    check_untouched(b, f, written, true);

    // Without the indexer the MLA cache gets the same bytes and the indexer cache stays untouched.
    const std::vector<std::uint8_t> with_indexer = b.kv_cache;
    b.reset_outputs(f);
    if (f == CacheFormat::bf16)
      run<CacheFormat::bf16>(b, false);
    else
      run<CacheFormat::fp8_ds_mla>(b, false);
    CHECK(b.kv_cache == with_indexer);
    check_untouched(b, f, written, false);
  }
}

TEST_CASE("prologue refuses bad slot_mapping and positions before writing anything",
          "[kernels][prologue][errors]") {
  std::mt19937_64 rng(13);
  const std::vector<std::int64_t> good{3, -1, 20, 9};
  Batch b = make_batch(4, good, rng);
  auto expect_refused = [&](const std::string& name) {
    for (CacheFormat f : {CacheFormat::bf16, CacheFormat::fp8_ds_mla}) {
      b.reset_outputs(f);
      const std::string msg = error_message_of([&] {
        if (f == CacheFormat::bf16)
          run<CacheFormat::bf16>(b, true);
        else
          run<CacheFormat::fp8_ds_mla>(b, true);
      });
      CAPTURE(int(f), msg);
      CHECK(contains(msg, name));
      // Nothing written: queries still zero, caches all sentinel, top-k untouched.
      CHECK(std::all_of(b.q_out.begin(), b.q_out.end(), [](bfloat16 x) { return x.bits == 0; }));
      check_untouched(b, f, {}, true);
      CHECK(std::all_of(b.topk.begin(), b.topk.end(), [](std::int32_t v) { return v == 7; }));
    }
  };
  b.slot_mapping = good;
  b.slot_mapping[2] = b.num_slots;  // one past the cache
  expect_refused("slot_mapping[2]");
  b.slot_mapping = good;
  b.slot_mapping[3] = -2;
  expect_refused("slot_mapping[3]");
  b.slot_mapping = good;
  b.slot_mapping[3] = b.slot_mapping[0];  // two rows writing one slot
  expect_refused("are both");
  b.slot_mapping = good;
  b.index_pages = 1;  // slot 20 lies in page 1 of the indexer cache
  expect_refused("index_k_cache");
  b.index_pages = 3;
  b.slot_mapping = {3, -1, 20};  // one entry short
  expect_refused("slot_mapping");
  b.slot_mapping = good;
  b.positions.pop_back();
  expect_refused("positions");
  b.positions.push_back(kMaxPosition);  // row 3 has a slot: its position must be in the table
  expect_refused("positions[3]");
}

TEST_CASE("input-error bits: distinct, each described by the parameter it concerns",
          "[kernels][prologue][errors]") {
  using dcpattn::describe_input_errors;
  const std::uint32_t bits[] = {dcpattn::input_error_topk, dcpattn::input_error_slot,
                                dcpattn::input_error_position};
  std::uint32_t all = 0;
  for (std::uint32_t b : bits) {
    CHECK((b != 0 && (b & (b - 1)) == 0));  // one bit each
    CHECK((all & b) == 0);                  // distinct
    all |= b;
  }
  CHECK(describe_input_errors(0).empty());
  CHECK(describe_input_errors(dcpattn::input_error_topk).find("topk_indices") != std::string::npos);
  CHECK(describe_input_errors(dcpattn::input_error_slot).find("slot_mapping") != std::string::npos);
  CHECK(describe_input_errors(dcpattn::input_error_position).find("positions") !=
        std::string::npos);
  const std::string every = describe_input_errors(all | 64u);
  CHECK(every.find("topk_indices") < every.find("slot_mapping"));
  CHECK(every.find("slot_mapping") < every.find("positions"));
  CHECK(every.find("; unknown error bits 64") != std::string::npos);
  CHECK(describe_input_errors(64u) == "unknown error bits 64");
}
