// SPDX-License-Identifier: Apache-2.0
// The CUDA combine kernels against the host functions on the same inputs: bitwise for the copies,
// conversions, LSE sanitizing, the all-to-all pack and every merge that needs no exp/log; within
// a few fp32 ulps where the device's approximate exp/log (ex2.approx, lg2.approx, rcp.approx:
// relative errors of about 2^-22) and the host's libm differ. The merges are also
// checked bitwise against the shared dcpattn/core/lse.hpp functions evaluated on the device (what
// the attention kernels' split merges run), which is what DCP invariance on the GPU rests on.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "support/catch.hpp"

#include "dcpattn/dcpattn.hpp"
#include "dcpattn/kernels/cuda/combine.cuh"

using namespace dcpattn;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr int kDv = 512;

#define CUDA_OK(call) REQUIRE((call) == cudaSuccess)

/// Device memory of n elements of T, freed on scope exit.
template <class T>
struct DeviceArray {
  T* ptr = nullptr;
  std::size_t n = 0;
  explicit DeviceArray(std::size_t count) : n(count) {
    CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&ptr), (count ? count : 1) * sizeof(T)));
  }
  DeviceArray(const std::vector<T>& h) : DeviceArray(h.size()) { upload(h); }
  ~DeviceArray() { cudaFree(ptr); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  void upload(const std::vector<T>& h) {
    CUDA_OK(cudaMemcpy(ptr, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<T> h(n);
    CUDA_OK(cudaMemcpy(h.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
  void fill_bytes(int byte) { CUDA_OK(cudaMemset(ptr, byte, (n ? n : 1) * sizeof(T))); }
};

std::uint32_t bits(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
bool same_bits(float a, float b) { return bits(a) == bits(b); }
bool same_bits(bfloat16 a, bfloat16 b) { return a.bits == b.bits; }

template <class T>
std::size_t count_bit_mismatches(const std::vector<T>& a, const std::vector<T>& b) {
  std::size_t bad = a.size() == b.size() ? 0 : 1;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) bad += same_bits(a[i], b[i]) ? 0 : 1;
  return bad;
}

/// A partial lse: mostly finite over a wide range, with empty (-inf) and the foreign empty markers
/// (+inf, NaN) mixed in.
float random_lse(std::mt19937& rng, bool allow_foreign) {
  std::uniform_int_distribution<int> kind(0, 15);
  std::uniform_real_distribution<float> u(-20.0f, 20.0f);
  switch (kind(rng)) {
    case 0:
    case 1: return -kInf;
    case 2: return allow_foreign ? kInf : -kInf;
    case 3: return allow_foreign ? kNaN : -kInf;
    case 4: return u(rng) * 500.0f;  // |lse| ~ 1e4: weights underflow to exactly 0
    default: return u(rng);
  }
}

// ---- device evaluation of the shared reference functions (one thread per row) ---------------

struct DeviceStateAt {
  float* o;    // (N, rows, dv)
  float* lse;  // (N, rows)
  std::int64_t rows;
  int dv;
  std::int64_t row;
  DCPATTN_HOST_DEVICE TreeStateRef operator()(int r) const {
    return TreeStateRef{o + (r * rows + row) * dv, lse + r * rows + row};
  }
};
struct DeviceLseAt {
  const float* lse;
  std::int64_t rows, row;
  DCPATTN_HOST_DEVICE float operator()(int r) const { return lse[r * rows + row]; }
};

/// host::combine_merge_a2a's per-row arithmetic, verbatim, on the device.
template <class OutT>
__global__ void reference_merge_kernel(float* o, float* lse, int n, std::int64_t rows, int dv,
                                       bool deterministic, OutT* out, float* out_lse) {
  const std::int64_t row = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= rows) return;
  if (deterministic) {
    tree_merge(DeviceStateAt{o, lse, rows, dv, row}, n, dv);
    for (int i = 0; i < dv; ++i) out[row * dv + i] = from_float<OutT>(o[row * dv + i]);
    out_lse[row] = lse[row];
  } else {
    const LseSum sum = fast_sum_n(DeviceLseAt{lse, rows, row}, n);
    for (int i = 0; i < dv; ++i) {
      float acc = 0.0f;
      for (int r = 0; r < n; ++r)
        acc += weighted(fast_weight(lse[r * rows + row], sum), o[(r * rows + row) * dv + i]);
      out[row * dv + i] = from_float<OutT>(acc);
    }
    out_lse[row] = lse_of(sum);
  }
}

// ---- the received chunks of a merge --------------------------------------------------------

/// N received chunks (T, H_local) in the a2a layout, and their states as fp32 (N, rows, Dv).
struct Received {
  int n;
  std::int64_t t, hl;
  PartialDtype dtype;
  dcpattn::detail::A2aChunkLayout layout;
  std::vector<std::byte> bytes;
  std::vector<float> o;    // (N, rows, Dv), what the chunk holds, as fp32
  std::vector<float> lse;  // (N, rows)
  std::int64_t rows() const { return t * hl; }
};

/// Builds the received chunks by running the HOST pack on N random partials (so they are what
/// the exchange delivers: sanitized, empty states zeroed). `garbage`: afterwards, overwrite the o
/// of every empty state with NaN (the merge must never read it).
Received make_received(std::mt19937& rng, int n, std::int64_t t, std::int64_t hl,
                       PartialDtype dtype, bool garbage) {
  Received r{n, t, hl, dtype, dcpattn::detail::A2aChunkLayout::make(t, hl, kDv, dtype), {}, {}, {}};
  r.bytes.assign(std::size_t(n) * r.layout.bytes, std::byte{0});
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const std::int64_t h = hl * n;
  std::vector<std::byte> send(r.bytes.size());
  // rank s's partial (T, H, Dv), packed; chunk d of rank s lands in rank d's recv chunk s. This
  // rank is rank 0 of the group: its recv chunk s = send chunk 0 of rank s.
  for (int s = 0; s < n; ++s) {
    std::vector<float> o(std::size_t(t * h * kDv)), lse(std::size_t(t * h));
    for (auto& x : o) x = normal(rng);
    for (auto& x : lse) x = random_lse(rng, true);
    for (std::int64_t i = 0; i < t * h; ++i)  // garbage o where the kernel says "empty"
      if (!(lse[std::size_t(i)] > -kInf && lse[std::size_t(i)] < kInf))
        for (int k = 0; k < kDv; ++k) o[std::size_t(i * kDv + k)] = kNaN;
    host::combine_pack_a2a<lse_base_e>(make_view(static_cast<const float*>(o.data()), {t, h, std::int64_t(kDv)}),
                                       make_view(static_cast<const float*>(lse.data()), {t, h}),
                                       int(t), n, dtype, r.layout, send.data());
    std::memcpy(r.bytes.data() + std::size_t(s) * r.layout.bytes, send.data(), r.layout.bytes);
  }
  const std::int64_t rows = r.rows();
  r.o.resize(std::size_t(n * rows * kDv));
  r.lse.resize(std::size_t(n * rows));
  for (int s = 0; s < n; ++s) {
    std::byte* chunk = r.bytes.data() + std::size_t(s) * r.layout.bytes;
    auto* l = reinterpret_cast<float*>(chunk + r.layout.lse_offset);
    for (std::int64_t i = 0; i < rows; ++i) {
      r.lse[std::size_t(s * rows + i)] = l[i];
      for (int k = 0; k < kDv; ++k) {
        const std::size_t e = std::size_t(i * kDv + k);
        float& v = r.o[std::size_t((s * rows + i) * kDv + k)];
        if (garbage && l[i] == -kInf) {
          if (dtype == PartialDtype::fp32)
            reinterpret_cast<float*>(chunk)[e] = kNaN;
          else
            reinterpret_cast<bfloat16*>(chunk)[e] = bfloat16::from_float(kNaN);
        }
        v = dtype == PartialDtype::fp32 ? reinterpret_cast<float*>(chunk)[e]
                                        : reinterpret_cast<bfloat16*>(chunk)[e].to_float();
      }
    }
  }
  return r;
}

/// Number of states of a row whose lse is finite.
int live_states(const Received& r, std::int64_t row) {
  int live = 0;
  for (int s = 0; s < r.n; ++s) live += r.lse[std::size_t(s * r.rows() + row)] > -kInf ? 1 : 0;
  return live;
}

template <class OutT>
struct MergeResult {
  std::vector<OutT> out;
  std::vector<float> lse;
};

template <class OutT>
MergeResult<OutT> merge_on_host(const Received& r, DcpMode mode) {
  MergeResult<OutT> m{std::vector<OutT>(std::size_t(r.rows() * kDv)),
                      std::vector<float>(std::size_t(r.rows()))};
  host::combine_merge_a2a<OutT>(r.bytes.data(), r.n, mode, r.dtype, r.layout,
                                make_view(m.out.data(), {r.t, r.hl, std::int64_t(kDv)}),
                                make_view(m.lse.data(), {r.t, r.hl}));
  return m;
}

template <class OutT>
MergeResult<OutT> merge_on_device(const Received& r, DcpMode mode) {
  DeviceArray<std::byte> recv(r.bytes);
  DeviceArray<OutT> out(std::size_t(r.rows() * kDv));
  DeviceArray<float> lse(std::size_t(r.rows()));
  out.fill_bytes(0xAB);
  lse.fill_bytes(0xAB);
  cuda_kernels::combine_merge_a2a<OutT>(recv.ptr, r.n, mode, r.dtype, r.layout,
                                        make_view(out.ptr, {r.t, r.hl, std::int64_t(kDv)}),
                                        make_view(lse.ptr, {r.t, r.hl}), nullptr);
  return {out.download(), lse.download()};
}

template <class OutT>
MergeResult<OutT> merge_reference_on_device(const Received& r, DcpMode mode) {
  DeviceArray<float> o(r.o), lse(r.lse);
  DeviceArray<OutT> out(std::size_t(r.rows() * kDv));
  DeviceArray<float> out_lse(std::size_t(r.rows()));
  const std::int64_t rows = r.rows();
  reference_merge_kernel<OutT><<<unsigned((rows + 63) / 64), 64>>>(
      o.ptr, lse.ptr, r.n, rows, kDv, mode == DcpMode::deterministic, out.ptr, out_lse.ptr);
  CUDA_OK(cudaGetLastError());
  return {out.download(), out_lse.download()};
}

/// Tolerance of a device merge against the host merge: the device's approximate exp/log and the
/// host's libm differ by a few ulps (relative 2^-22 per approximation, a few per tree level), which
/// moves each weight by a few fp32 ulps. |d| <= 2^-16 (1 + |ref|)-ish in fp32
/// (about 250 ulps of a value near 1: far below any real defect, e.g. a wrong weight), and one
/// bf16 ulp (<= 2^-7 relative) more for bf16 outputs, whose rounding a last-bit change can flip.
bool close(float got, float ref, bool bf16_out) {
  if (std::isnan(got) || std::isnan(ref)) return false;
  if (std::isinf(ref) || std::isinf(got)) return got == ref;
  const double tol = 1.5e-5 * (1.0 + std::fabs(ref)) + (bf16_out ? std::ldexp(std::fabs(ref), -7) : 0.0);
  return std::fabs(double(got) - double(ref)) <= tol;
}

template <class OutT>
void check_merge(int n, std::int64_t t, std::int64_t hl, DcpMode mode, PartialDtype dtype,
                 bool garbage, std::uint32_t seed) {
  constexpr bool bf16_out = std::is_same_v<OutT, bfloat16>;
  INFO("N = " << n << ", T = " << t << ", H_local = " << hl << ", "
              << (mode == DcpMode::deterministic ? "deterministic" : "fast") << ", partial "
              << (dtype == PartialDtype::fp32 ? "fp32" : "bf16") << ", out "
              << (bf16_out ? "bf16" : "fp32") << (garbage ? ", NaN o under -inf lse" : ""));
  std::mt19937 rng(seed);
  const Received r = make_received(rng, n, t, hl, dtype, garbage);
  const auto dev = merge_on_device<OutT>(r, mode);
  const auto ref = merge_reference_on_device<OutT>(r, mode);

  // 1. Bitwise the shared lse.hpp arithmetic evaluated on the device. For N = 1 with garbage the
  //    kernel outputs the neutral 0 where the reference passes the lone state's o through.
  if (!(garbage && n == 1)) {
    CHECK(count_bit_mismatches(dev.out, ref.out) == 0);
    CHECK(count_bit_mismatches(dev.lse, ref.lse) == 0);
  }

  // 2. Against the host function: bitwise on rows that need no exp/log (at most one live state),
  //    within tolerance elsewhere; never NaN.
  const auto host = merge_on_host<OutT>(r, mode);
  std::size_t bad_exact = 0, bad_close = 0, nan = 0, exact_rows = 0;
  for (std::int64_t row = 0; row < r.rows(); ++row) {
    const int live = live_states(r, row);
    const bool exact = live <= 1;
    exact_rows += exact ? 1 : 0;
    const float got_l = dev.lse[std::size_t(row)], ref_l = host.lse[std::size_t(row)];
    if (exact ? !same_bits(got_l, ref_l) : !close(got_l, ref_l, false)) ++(exact ? bad_exact : bad_close);
    for (int k = 0; k < kDv; ++k) {
      const std::size_t e = std::size_t(row * kDv + k);
      const float got = to_float(dev.out[e]);
      if (std::isnan(got)) ++nan;
      if (garbage && n == 1) {
        if (live == 0 && bits(got) != 0) ++bad_exact;  // neutral output, garbage never read
        if (live == 1 && !same_bits(dev.out[e], host.out[e])) ++bad_exact;
        continue;
      }
      if (exact) {
        if (!same_bits(dev.out[e], host.out[e])) ++bad_exact;
      } else if (!close(got, to_float(host.out[e]), bf16_out)) {
        ++bad_close;
      }
    }
  }
  CAPTURE(exact_rows, r.rows());
  CHECK(nan == 0);
  CHECK(bad_exact == 0);
  CHECK(bad_close == 0);
}

}  // namespace

TEST_CASE("pack: strided bf16 (T, H, D) to contiguous is a bitwise copy", "[cuda][combine]") {
  std::mt19937 rng(1);
  std::uniform_int_distribution<int> u(0, 0xffff);
  for (std::int64_t t : {1, 7, 300}) {
    const std::int64_t h = 8, d = 576;
    // (a) padded rows: 16-byte vector path; (b) every other element: scalar path
    for (int variant = 0; variant < 2; ++variant) {
      INFO("T = " << t << ", variant " << variant);
      const std::int64_t s2 = variant == 0 ? 1 : 2;
      const std::int64_t s1 = variant == 0 ? d + 64 : d * 2;
      const std::int64_t s0 = h * s1 + 8;
      std::vector<bfloat16> src(std::size_t(t * s0));
      for (auto& x : src) x.bits = std::uint16_t(u(rng));
      std::vector<bfloat16> expect(std::size_t(t * h * d));
      HostExecution{}.pack(make_view(static_cast<const bfloat16*>(src.data()), {t, h, d}, {s0, s1, s2}),
                           expect.data(), {});
      DeviceArray<bfloat16> dsrc(src), ddst(std::size_t(t * h * d));
      ddst.fill_bytes(0xAB);
      cuda_kernels::pack(make_view(static_cast<const bfloat16*>(dsrc.ptr), {t, h, d}, {s0, s1, s2}),
                         ddst.ptr, nullptr);
      CHECK(count_bit_mismatches(ddst.download(), expect) == 0);
    }
  }
}

TEST_CASE("row_local_lengths: per-row local bound, 0 on padding rows", "[cuda][combine]") {
  std::mt19937 rng(2);
  std::uniform_int_distribution<std::int64_t> len(0, 5000);
  const RoundRobinOwnership own(4, 3, 8);
  for (std::int64_t t : {1, 7, 300}) {
    std::vector<std::int64_t> bound(static_cast<std::size_t>(t));
    for (auto& b : bound) b = len(rng);
    const int valid = int(t) - int(t / 3);
    for (int rank = 0; rank < 4; ++rank) {
      std::vector<std::int64_t> expect(static_cast<std::size_t>(t));
      HostExecution{}.row_local_lengths(own, rank, make_view(static_cast<const std::int64_t*>(bound.data()), {t}),
                                        valid, expect.data(), {});
      DeviceArray<std::int64_t> dbound(bound), dout(static_cast<std::size_t>(t));
      dout.fill_bytes(0xAB);
      cuda_kernels::row_local_lengths(own, rank, make_view(static_cast<const std::int64_t*>(dbound.ptr), {t}),
                                      valid, dout.ptr, nullptr);
      CHECK(dout.download() == expect);
    }
  }
}

TEST_CASE("sanitize_lse_rows: +inf/NaN -> -inf, base 2 -> e, padding rows -inf, bitwise",
          "[cuda][combine]") {
  std::mt19937 rng(3);
  for (std::int64_t t : {1, 7, 300}) {
    const std::int64_t h = 16;
    std::vector<float> lse(std::size_t(t * h));
    for (auto& x : lse) x = random_lse(rng, true);
    const int valid = int(t) - int(t / 4);
    // a strided (T, H) view: every other column of a (T, 2H) buffer
    const auto host_view = make_view(static_cast<const float*>(lse.data()), {t, h / 2}, {h, 2});
    DeviceArray<float> dlse(lse), dout(std::size_t(t * h / 2));
    const auto dev_view = make_view(static_cast<const float*>(dlse.ptr), {t, h / 2}, {h, 2});
    std::vector<float> expect(std::size_t(t * h / 2));
    HostExecution{}.sanitize_lse_rows<lse_base_e>(host_view, valid, expect.data(), {});
    cuda_kernels::sanitize_lse_rows<lse_base_e>(dev_view, valid, dout.ptr, nullptr);
    CHECK(count_bit_mismatches(dout.download(), expect) == 0);
    HostExecution{}.sanitize_lse_rows<lse_base_2>(host_view, valid, expect.data(), {});
    cuda_kernels::sanitize_lse_rows<lse_base_2>(dev_view, valid, dout.ptr, nullptr);
    CHECK(count_bit_mismatches(dout.download(), expect) == 0);
  }
}

TEST_CASE("convert_rows: fp32 -> bf16 / fp32, contiguous and strided outputs, bitwise",
          "[cuda][combine]") {
  std::mt19937 rng(4);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::uniform_int_distribution<std::uint32_t> any_bits;
  for (std::int64_t t : {1, 7, 300}) {
    const std::int64_t hl = 4;
    std::vector<float> src(std::size_t(t * hl * kDv));
    for (std::size_t i = 0; i < src.size(); ++i) {
      // normal values, raw bit patterns (NaN, inf, subnormals) and exact bf16 ties
      if (i % 7 == 0) {
        const std::uint32_t b = any_bits(rng);
        std::memcpy(&src[i], &b, 4);
      } else if (i % 7 == 1) {
        const std::uint32_t b = (any_bits(rng) & 0xffff0000u) | 0x8000u;
        std::memcpy(&src[i], &b, 4);
      } else {
        src[i] = normal(rng);
      }
    }
    DeviceArray<float> dsrc(src);
    // (a) contiguous: vector stores; (b) row stride Dv + 4: vector stores; (c) Dv + 1: scalar
    for (std::int64_t pad : {0, 4, 1}) {
      INFO("T = " << t << ", row padding " << pad);
      const std::int64_t s1 = kDv + pad, s0 = hl * s1;
      {
        std::vector<bfloat16> expect(std::size_t(t * s0));
        HostExecution{}.convert_rows(src.data(), make_view(expect.data(), {t, hl, std::int64_t(kDv)}, {s0, s1, 1}), {});
        DeviceArray<bfloat16> dout(expect.size());
        dout.fill_bytes(0);  // the padding stays 0 on both sides
        cuda_kernels::convert_rows(dsrc.ptr, make_view(dout.ptr, {t, hl, std::int64_t(kDv)}, {s0, s1, 1}), nullptr);
        CHECK(count_bit_mismatches(dout.download(), expect) == 0);
      }
      {
        std::vector<float> expect(std::size_t(t * s0), 0.0f);
        HostExecution{}.convert_rows(src.data(), make_view(expect.data(), {t, hl, std::int64_t(kDv)}, {s0, s1, 1}), {});
        DeviceArray<float> dout(expect.size());
        dout.fill_bytes(0);
        cuda_kernels::convert_rows(dsrc.ptr, make_view(dout.ptr, {t, hl, std::int64_t(kDv)}, {s0, s1, 1}), nullptr);
        CHECK(count_bit_mismatches(dout.download(), expect) == 0);
      }
    }
  }
}

TEST_CASE("combine_pack_a2a: neutral rows, foreign empty markers, base 2, bitwise",
          "[cuda][combine]") {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int n : {1, 2, 4, 8}) {
    // T = 2100, N >= 2: more than kSpeculativeMaxWarps rows (the pack loads speculatively anyway)
    for (std::int64_t t : {1, 7, 300, 2100}) {
      const std::int64_t hl = t == 7 ? 16 : 2, h = hl * n;
      std::vector<float> o(std::size_t(t * h * kDv)), lse(std::size_t(t * h));
      for (auto& x : o) x = normal(rng);
      for (auto& x : lse) x = random_lse(rng, true);
      const int valid = int(t) - int(t / 5);
      for (std::int64_t i = 0; i < t * h; ++i) {  // garbage where the state is empty or padding
        const bool empty = !(lse[std::size_t(i)] > -kInf && lse[std::size_t(i)] < kInf) ||
                           i / h >= valid;
        if (empty)
          for (int k = 0; k < kDv; ++k) o[std::size_t(i * kDv + k)] = kNaN;
      }
      DeviceArray<float> d_o(o), d_lse(lse);
      const auto ho = make_view(static_cast<const float*>(o.data()), {t, h, std::int64_t(kDv)});
      const auto hlse = make_view(static_cast<const float*>(lse.data()), {t, h});
      const auto dvo = make_view(static_cast<const float*>(d_o.ptr), {t, h, std::int64_t(kDv)});
      const auto dvl = make_view(static_cast<const float*>(d_lse.ptr), {t, h});
      for (PartialDtype dtype : {PartialDtype::fp32, PartialDtype::bf16}) {
        for (int base = 0; base < 2; ++base) {
          INFO("N = " << n << ", T = " << t << ", dtype " << int(dtype) << ", base " << (base ? 2 : 0));
          const auto layout = dcpattn::detail::A2aChunkLayout::make(t, hl, kDv, dtype);
          std::vector<std::byte> expect(std::size_t(n) * layout.bytes, std::byte{0xAB});
          DeviceArray<std::byte> send(expect.size());
          send.fill_bytes(0xAB);
          if (base == 0) {
            host::combine_pack_a2a<lse_base_e>(ho, hlse, valid, n, dtype, layout, expect.data());
            cuda_kernels::combine_pack_a2a<lse_base_e>(dvo, dvl, valid, n, dtype, layout, send.ptr, nullptr);
          } else {
            host::combine_pack_a2a<lse_base_2>(ho, hlse, valid, n, dtype, layout, expect.data());
            cuda_kernels::combine_pack_a2a<lse_base_2>(dvo, dvl, valid, n, dtype, layout, send.ptr, nullptr);
          }
          const auto got = send.download();
          CHECK(std::memcmp(got.data(), expect.data(), expect.size()) == 0);
        }
      }
    }
  }
}

/// merge_lse(a[i], b[i]) and merge_lse(b[i], a[i]) on the device: (lse, w_a, w_b) each.
__global__ void merge_lse_kernel(const float* a, const float* b, int n, float* ab, float* ba) {
  const int i = int(blockIdx.x) * int(blockDim.x) + int(threadIdx.x);
  if (i >= n) return;
  const MergeWeights x = merge_lse(a[i], b[i]);
  const MergeWeights y = merge_lse(b[i], a[i]);
  ab[3 * i] = x.lse, ab[3 * i + 1] = x.w_a, ab[3 * i + 2] = x.w_b;
  ba[3 * i] = y.lse, ba[3 * i + 1] = y.w_a, ba[3 * i + 2] = y.w_b;
}

TEST_CASE(
    "merge_lse on the device (hardware exp and log): within its bound of a long double "
    "reference, symmetric to the bit, exact where promised",
    "[cuda][combine]") {
  std::mt19937 rng(77);
  std::uniform_real_distribution<float> near(-1.0f, 1.0f);
  std::vector<float> ha, hb;
  for (int k = 0; k < 200000; ++k) {
    const float a = sanitize_lse(random_lse(rng, true));
    // half the pairs close together (weights of comparable size), half independent
    const float b = k % 2 && std::isfinite(a) ? a + near(rng) * float(1 << (k % 7))
                                              : sanitize_lse(random_lse(rng, true));
    ha.push_back(a), hb.push_back(b);
  }
  const float big = std::numeric_limits<float>::max();
  for (float x : {0.0f, -0.0f, 1.0f, -7.0f, 1e4f, -1e4f, big, -big})
    for (float y : {x, -kInf, 0.0f, -big}) ha.push_back(x), hb.push_back(y);
  const int n = int(ha.size());
  DeviceArray<float> da(ha), db(hb), dab(3 * std::size_t(n)), dba(3 * std::size_t(n));
  merge_lse_kernel<<<(n + 127) / 128, 128>>>(da.ptr, db.ptr, n, dab.ptr, dba.ptr);
  CUDA_OK(cudaGetLastError());
  const std::vector<float> ab = dab.download(), ba = dba.download();
  int finite = 0;
  for (int i = 0; i < n; ++i) {
    const float a = ha[i], b = hb[i];
    const float lse = ab[3 * i], wa = ab[3 * i + 1], wb = ab[3 * i + 2];
    INFO("(" << a << ", " << b << ") -> lse " << lse << ", w " << wa << ", " << wb);
    // symmetric: swapping the inputs swaps the weights, the lse to the bit
    REQUIRE(bits(ba[3 * i]) == bits(lse));
    REQUIRE(bits(ba[3 * i + 1]) == bits(wb));
    REQUIRE(bits(ba[3 * i + 2]) == bits(wa));
    if (a == -kInf && b == -kInf) {  // the neutral element, exactly
      REQUIRE(lse == -kInf);
      REQUIRE(bits(wa) == bits(0.0f));
      REQUIRE(bits(wb) == bits(0.0f));
      continue;
    }
    if (a == -kInf || b == -kInf) {  // the live side passes through exactly
      const float live = a == -kInf ? b : a;
      REQUIRE(bits(lse) == bits(live));
      REQUIRE((a == -kInf ? wb : wa) == 1.0f);
      REQUIRE(bits(a == -kInf ? wa : wb) == bits(0.0f));
      continue;
    }
    REQUIRE(std::isfinite(lse));
    if (std::max(std::fabs(a), std::fabs(b)) > 1e30f) {
      // Near the largest floats the fp32 sum lse + log 2 rounds back to lse (host and device
      // alike): only finite and in range is promised there.
      REQUIRE(!std::isnan(wa));
      REQUIRE(!std::isnan(wb));
      REQUIRE((wa >= 0.0f && wa <= 1.0f && wb >= 0.0f && wb <= 1.0f));
      continue;
    }
    // Long double reference. The device bound: ex2.approx and lg2.approx carry relative
    // (absolute, for lg2 on [1, 2]) errors of about 2^-22, the products by log2(e) and ln 2 and
    // the roundings of the subtractions add 2^-24 of their magnitudes.
    const long double m = std::max<long double>(a, b);
    const long double ref =
        m + std::log(std::exp((long double)a - m) + std::exp((long double)b - m));
    const long double lse_err = std::fabs((long double)lse - ref);
    REQUIRE(lse_err <= 0x1p-20L + 0x1p-23L * std::fabs(ref));
    for (int side = 0; side < 2; ++side) {
      const float x = side ? b : a;
      const float got = side ? wb : wa;
      const long double want = std::exp((long double)x - ref);
      const long double rel = 0x1p-20L + lse_err + 0x1p-22L * std::fabs((long double)x - ref);
      REQUIRE(got >= 0.0f);
      REQUIRE(got <= 1.0f);
      REQUIRE(std::fabs(got - want) <= want * rel + 0x1p-125L);  // ftz: under 2^-126 gives 0
    }
    ++finite;
  }
  CHECK(finite > 100000);
}

TEST_CASE("combine_merge_a2a deterministic: the shared tree bitwise, the host within ulps",
          "[cuda][combine]") {
  std::uint32_t seed = 100;
  for (int n : {1, 2, 4, 8})
    for (std::int64_t t : {1, 7, 300}) {
      const std::int64_t hl = t == 7 ? 16 : 2;
      check_merge<bfloat16>(n, t, hl, DcpMode::deterministic, PartialDtype::fp32, false, seed++);
      check_merge<float>(n, t, hl, DcpMode::deterministic, PartialDtype::fp32, false, seed++);
    }
  check_merge<bfloat16>(16, 7, 2, DcpMode::deterministic, PartialDtype::fp32, false, seed++);
  check_merge<float>(32, 7, 1, DcpMode::deterministic, PartialDtype::fp32, false, seed++);
  check_merge<float>(4, 7, 2, DcpMode::deterministic, PartialDtype::bf16, false, seed++);
}

TEST_CASE("combine_merge_a2a fast: rank-order sum bitwise on the device, host within ulps",
          "[cuda][combine]") {
  std::uint32_t seed = 200;
  for (int n : {1, 2, 3, 4, 8})
    for (std::int64_t t : {1, 7, 300}) {
      const std::int64_t hl = t == 7 ? 16 : 2;
      check_merge<bfloat16>(n, t, hl, DcpMode::fast, PartialDtype::bf16, false, seed++);
      check_merge<float>(n, t, hl, DcpMode::fast, PartialDtype::fp32, false, seed++);
    }
  check_merge<float>(12, 7, 16, DcpMode::fast, PartialDtype::bf16, false, seed++);  // > 8 states
  check_merge<float>(40, 7, 1, DcpMode::fast, PartialDtype::fp32, false, seed++);   // > 32 states
}

TEST_CASE("combine_merge_a2a: the row kernel and the warp kernels on either side of their boundary",
          "[cuda][combine]") {
  // detail::row_kernel_serves picks merge_row_kernel (one CTA per row) or the warp-per-row
  // kernels; every merge must give the reference's bits whichever kernel runs it.
  using cuda_kernels::detail::row_kernel_serves;
  std::uint32_t seed = 350;
  // deterministic, 8 states: the row kernel up to 64 rows, the warp kernel beyond
  REQUIRE(row_kernel_serves(true, 8, 4, 16));
  REQUIRE_FALSE(row_kernel_serves(true, 8, 5, 16));
  for (std::int64_t t : {4, 5}) {
    check_merge<bfloat16>(8, t, 16, DcpMode::deterministic, PartialDtype::fp32, t == 4, seed++);
    check_merge<float>(8, t, 16, DcpMode::deterministic, PartialDtype::bf16, t == 5, seed++);
  }
  // deterministic, 1, 2 and 4 states: the row kernel at every size; 16 states: the warp kernel
  REQUIRE(row_kernel_serves(true, 2, 300, 16));
  REQUIRE(row_kernel_serves(true, 4, 300, 16));
  REQUIRE_FALSE(row_kernel_serves(true, 16, 1, 1));
  check_merge<float>(4, 300, 16, DcpMode::deterministic, PartialDtype::bf16, true, seed++);
  check_merge<bfloat16>(2, 300, 16, DcpMode::deterministic, PartialDtype::fp32, true, seed++);
  check_merge<float>(1, 300, 16, DcpMode::deterministic, PartialDtype::fp32, false, seed++);
  // fast: the row kernel up to 8 states (plain loads for 2, volatile loads for 4 and 8), the warp
  // kernel (batches of 8) beyond
  REQUIRE(row_kernel_serves(false, 8, 300, 16));
  REQUIRE_FALSE(row_kernel_serves(false, 9, 1, 1));
  for (int n : {2, 8, 9, 16}) {
    check_merge<bfloat16>(n, 7, 16, DcpMode::fast, PartialDtype::fp32, n == 9, seed++);
    check_merge<float>(n, 7, 16, DcpMode::fast, PartialDtype::bf16, n == 16, seed++);
  }
  check_merge<bfloat16>(3, 300, 16, DcpMode::fast, PartialDtype::bf16, true, seed++);
}

TEST_CASE("combine_merge_a2a: NaN o under -inf lse never reaches the output", "[cuda][combine]") {
  std::uint32_t seed = 300;
  for (int n : {1, 2, 4, 8})
    for (DcpMode mode : {DcpMode::deterministic, DcpMode::fast})
      for (PartialDtype dtype : {PartialDtype::fp32, PartialDtype::bf16}) {
        check_merge<bfloat16>(n, 7, 4, mode, dtype, true, seed++);
        check_merge<float>(n, 1, 16, mode, dtype, true, seed++);
      }
}

TEST_CASE("combine_merge_a2a: launches past the speculative-load size give the same results",
          "[cuda][combine]") {
  // The cases above launch at most kSpeculativeMaxWarps warps, which load every state's o with
  // the lse values; larger launches read an o only once its lse says the state is live. 8320
  // rows (4160 with N = 8, whose fp32 kernels take two warps per row) put every kernel used
  // here past that size.
  constexpr std::int64_t kWarps = cuda_kernels::detail::kSpeculativeMaxWarps;
  std::uint32_t seed = 400;
  // Warp kernels only: the deterministic tree of 8 and 16 states, the fast merge of more than 8
  // (merge_row_kernel, which runs the other merges, loads every state whatever its lse).
  using cuda_kernels::detail::row_kernel_serves;
  const std::int64_t t = 520, hl = 16;
  REQUIRE(t * hl > kWarps);
  REQUIRE_FALSE(row_kernel_serves(true, 8, t, hl));
  REQUIRE_FALSE(row_kernel_serves(false, 12, t, hl));
  check_merge<bfloat16>(16, t, hl, DcpMode::deterministic, PartialDtype::fp32, true, seed++);
  check_merge<float>(12, t, hl, DcpMode::fast, PartialDtype::fp32, true, seed++);
  check_merge<bfloat16>(12, t, hl, DcpMode::fast, PartialDtype::bf16, true, seed++);
  REQUIRE(2 * 520 * 8 > kWarps);
  check_merge<bfloat16>(8, 520, 8, DcpMode::deterministic, PartialDtype::fp32, true, seed++);
}

TEST_CASE("combine_rescale_agrs: weights within ulps of the host, exact where trivial",
          "[cuda][combine]") {
  std::mt19937 rng(6);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int n : {1, 2, 4, 8}) {
    // T = 2100, N >= 2: more than kSpeculativeMaxWarps rows, o read only for live states
    for (std::int64_t t : {1, 7, 300, 2100}) {
      const std::int64_t hl = t == 7 ? 16 : 2, h = hl * n;
      for (int rank : {0, n - 1}) {
        INFO("N = " << n << ", T = " << t << ", rank " << rank);
        std::vector<float> o(std::size_t(t * h * kDv)), lse_all(std::size_t(n * t * h));
        for (auto& x : o) x = normal(rng);
        for (auto& x : lse_all) x = random_lse(rng, false);  // sanitized: finite or -inf
        for (std::int64_t i = 0; i < t * h; ++i)              // garbage where this rank is empty
          if (lse_all[std::size_t(rank * t * h + i)] == -kInf)
            for (int k = 0; k < kDv; ++k) o[std::size_t(i * kDv + k)] = kNaN;
        std::vector<float> packed(o.size()), out_lse(std::size_t(t * hl));
        host::combine_rescale_agrs(make_view(static_cast<const float*>(o.data()), {t, h, std::int64_t(kDv)}),
                                   lse_all.data(), rank, n, packed.data(), make_view(out_lse.data(), {t, hl}));
        // T = 7: packed 4 bytes off 16-byte alignment (scalar stores), as the combiner's scratch
        // can place it
        const std::size_t shift = t == 7 ? 1 : 0;
        DeviceArray<float> d_o(o), d_lse(lse_all), d_packed(o.size() + 1), d_out_lse(out_lse.size());
        d_packed.fill_bytes(0xAB);
        cuda_kernels::combine_rescale_agrs(
            make_view(static_cast<const float*>(d_o.ptr), {t, h, std::int64_t(kDv)}), d_lse.ptr, rank, n,
            d_packed.ptr + shift, make_view(d_out_lse.ptr, {t, hl}), nullptr);
        const auto all = d_packed.download();
        const std::vector<float> got(all.begin() + std::ptrdiff_t(shift),
                                     all.begin() + std::ptrdiff_t(shift + o.size()));
        const auto got_lse = d_out_lse.download();
        std::size_t bad = 0, nan = 0;
        for (std::size_t i = 0; i < got.size(); ++i) {
          nan += std::isnan(got[i]) ? 1 : 0;
          bad += (n == 1 ? same_bits(got[i], packed[i]) : close(got[i], packed[i], false)) ? 0 : 1;
        }
        for (std::size_t i = 0; i < got_lse.size(); ++i)
          bad += (n == 1 ? same_bits(got_lse[i], out_lse[i]) : close(got_lse[i], out_lse[i], false)) ? 0 : 1;
        CHECK(nan == 0);
        CHECK(bad == 0);
      }
    }
  }
}

TEST_CASE("combine kernels refuse what they cannot do, before launching", "[cuda][combine]") {
  const auto layout = dcpattn::detail::A2aChunkLayout::make(1, 1, kDv, PartialDtype::fp32);
  DeviceArray<std::byte> recv(3 * layout.bytes + 16);
  DeviceArray<float> out(kDv), lse(1);
  const auto o = make_view(out.ptr, {1, 1, std::int64_t(kDv)});
  const auto l = make_view(lse.ptr, {1, 1});
  // a deterministic tree over 3 ranks does not exist
  CHECK_THROWS_AS(cuda_kernels::combine_merge_a2a<float>(recv.ptr, 3, DcpMode::deterministic,
                                                         PartialDtype::fp32, layout, o, l, nullptr),
                  dcpattn::Error);
  // misaligned exchange buffer
  CHECK_THROWS_AS(cuda_kernels::combine_merge_a2a<float>(recv.ptr + 4, 2, DcpMode::fast,
                                                         PartialDtype::fp32, layout, o, l, nullptr),
                  dcpattn::Error);
  // head_dim_v not a multiple of 4
  CHECK_THROWS_AS(cuda_kernels::combine_merge_a2a<float>(recv.ptr, 2, DcpMode::fast,
                                                         PartialDtype::fp32, layout,
                                                         make_view(out.ptr, {1, 1, 510}), l, nullptr),
                  dcpattn::Error);
  CUDA_OK(cudaDeviceSynchronize());
}
