// SPDX-License-Identifier: Apache-2.0
// The operator's configuration check on random configurations: each one is either refused with a
// message naming a parameter, or it runs (one rank, small random problem) and agrees with a plain
// double-precision attention.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "dcpattn/dcpattn.hpp"
#include "fuzz_input.hpp"

namespace {
using namespace dcpattn;

bool names_a_parameter(const std::string& m) {
  for (const char* p : {"group_size", "num_heads", "head_dim_qk", "head_dim_v", "interleave",
                        "page_size", "virtual_shards", "max_tokens", "gather_capacity",
                        "softmax_scale", "topk", "mode", "partial_dtype"})
    if (m.find(p) != std::string::npos) return true;
  return false;
}

template <bool Sparse>
void run(fuzz::Input& in, DcpConfig c) {
  using Op = DcpAttention<RoundRobinOwnership, DirectWorkspace, std::conditional_t<Sparse, SparseMla<CacheFormat::bf16>, DenseMla<CacheFormat::bf16>>,
                          AllToAll, SelfCommunicator, HostExecution>;
  const Status st = Op::can_implement(c);
  if (!st.ok()) {
    DCPATTN_FUZZ_CHECK(names_a_parameter(st.message()));
    return;
  }
  if (c.group_size != 1) return;  // one process: other group sizes are refused at construction
  SelfCommunicator self;
  Op op(self, c);
  const std::int64_t t = in.range(1, c.max_tokens), h = c.num_heads, b = c.page_size;
  const std::int64_t len = in.range(0, 40);
  const int valid = int(in.range(0, t));
  auto value = [&] { return float(int(in.take<std::uint8_t>()) - 128) / 64.0f; };
  const std::int64_t pages = len / b + 1;
  std::vector<bfloat16> cache(std::size_t(pages * b * kMlaQkDim));
  for (auto& x : cache) x = bfloat16::from_float(value());
  std::vector<std::int32_t> table(static_cast<std::size_t>(pages));
  for (std::int64_t p = 0; p < pages; ++p) table[std::size_t(p)] = std::int32_t(pages - 1 - p);
  std::vector<bfloat16> q(std::size_t(t * h * kMlaQkDim));
  for (auto& x : q) x = bfloat16::from_float(value());
  std::vector<std::int32_t> req(std::size_t(t), 0);
  std::vector<std::int64_t> bound(static_cast<std::size_t>(t));
  for (auto& x : bound) x = in.range(0, len);
  if (!Sparse) c.topk = 1;  // dense kernels ignore topk (and can_implement does not check it)
  std::vector<std::int32_t> topk(std::size_t(t * c.topk), -1);
  for (std::int64_t r = 0; r < t; ++r)
    for (int k = 0; k < c.topk; ++k)
      if (bound[std::size_t(r)] > 0 && (in.take<std::uint8_t>() & 1))
        topk[std::size_t(r * c.topk + k)] = std::int32_t(in.range(0, bound[std::size_t(r)] - 1));
  std::vector<bfloat16> out(std::size_t(t * h * kMlaVDim));
  std::vector<float> lse(std::size_t(t * h));
  typename Op::Arguments a;
  a.q = make_view(static_cast<const bfloat16*>(q.data()), {t, h, std::int64_t(kMlaQkDim)});
  a.cache = make_view(static_cast<const bfloat16*>(cache.data()), {pages * b, std::int64_t(kMlaQkDim)});
  a.block_table = make_view(static_cast<const std::int32_t*>(table.data()), {1, pages});
  a.row_request = make_view(static_cast<const std::int32_t*>(req.data()), {t});
  a.row_bound = make_view(static_cast<const std::int64_t*>(bound.data()), {t});
  a.topk = make_view(static_cast<const std::int32_t*>(topk.data()), {t, std::int64_t(c.topk)});
  a.num_valid_rows = valid;
  a.out = make_view(out.data(), {t, h, std::int64_t(kMlaVDim)});
  a.out_lse = make_view(lse.data(), {t, h});
  std::vector<std::byte> ws(Op::workspace_bytes(c));
  op.forward(a, ws);

  for (std::int64_t r = 0; r < t; ++r) {
    std::vector<std::int64_t> keys;  // global positions the row attends (N = 1: slot = position)
    if (r < valid) {
      if (Sparse) {
        for (int k = 0; k < c.topk; ++k)
          if (topk[std::size_t(r * c.topk + k)] >= 0) keys.push_back(topk[std::size_t(r * c.topk + k)]);
      } else {
        for (std::int64_t g = 0; g < bound[std::size_t(r)]; ++g) keys.push_back(g);
      }
    }
    for (std::int64_t hh = 0; hh < h; ++hh) {
      const float got_lse = lse[std::size_t(r * h + hh)];
      if (keys.empty()) {
        DCPATTN_FUZZ_CHECK(std::isinf(got_lse) && got_lse < 0);
        for (int i = 0; i < kMlaVDim; ++i) DCPATTN_FUZZ_CHECK(out[std::size_t((r * h + hh) * kMlaVDim + i)].bits == 0);
        continue;
      }
      std::vector<double> s;
      double m = -1e300;
      for (auto g : keys) {
        const std::int64_t slot = std::int64_t(table[std::size_t(g / b)]) * b + g % b;
        double d = 0;
        for (int i = 0; i < kMlaQkDim; ++i)
          d += double(q[std::size_t((r * h + hh) * kMlaQkDim + i)].to_float()) *
               cache[std::size_t(slot * kMlaQkDim + i)].to_float();
        s.push_back(d * c.softmax_scale);
        m = std::max(m, s.back());
      }
      double l = 0;
      for (double x : s) l += std::exp(x - m);
      DCPATTN_FUZZ_CHECK(std::fabs(got_lse - (m + std::log(l))) <= 1e-3 * (1 + std::fabs(m)));
      for (int i = 0; i < kMlaVDim; i += 37) {
        double o = 0;
        for (std::size_t j = 0; j < keys.size(); ++j) {
          const std::int64_t g = keys[j];
          const std::int64_t slot = std::int64_t(table[std::size_t(g / b)]) * b + g % b;
          o += std::exp(s[j] - m) / l * cache[std::size_t(slot * kMlaQkDim + i)].to_float();
        }
        const double got = out[std::size_t((r * h + hh) * kMlaVDim + i)].to_float();
        DCPATTN_FUZZ_CHECK(std::fabs(got - o) <= 1e-2 + 1e-2 * std::fabs(o));
      }
    }
  }
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::Input in(data, size);
  DcpConfig c;
  c.group_size = int(in.range(0, 3));
  c.num_heads = int(in.range(0, 4));
  c.head_dim_qk = in.take<std::uint8_t>() < 8 ? int(in.range(0, 1024)) : kMlaQkDim;
  c.head_dim_v = in.take<std::uint8_t>() < 8 ? int(in.range(0, 1024)) : kMlaVDim;
  c.interleave = int(in.range(-1, 8));
  c.page_size = int(in.range(-1, 32));
  c.virtual_shards = int(in.range(0, 17));
  c.max_tokens = int(in.range(-1, 3));
  c.gather_capacity = int(in.range(-1, 3));
  c.topk = int(in.range(-1, 8));
  const std::uint8_t scale_kind = in.take<std::uint8_t>();
  c.softmax_scale = scale_kind < 16 ? in.take<float>() : 0.05f;
  c.mode = (in.take<std::uint8_t>() & 1) ? DcpMode::fast : DcpMode::deterministic;
  c.partial_dtype = (in.take<std::uint8_t>() < 32) ? PartialDtype::bf16 : PartialDtype::fp32;
  if (in.take<std::uint8_t>() & 1)
    run<true>(in, c);
  else
    run<false>(in, c);
  return 0;
}
