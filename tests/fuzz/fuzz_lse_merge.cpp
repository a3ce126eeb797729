// SPDX-License-Identifier: Apache-2.0
// The LSE merge on arbitrary bit patterns (NaN, infinities, denormals, huge values): the neutral
// element is respected bit for bit, finite o never turns into NaN, and the merge is commutative.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "dcpattn/core/lse.hpp"
#include "fuzz_input.hpp"

namespace {
constexpr int kDv = 4;
bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }
/// Bit-identical, or both NaN (a signalling NaN multiplied by 1 comes back quiet).
bool same_value(float a, float b) { return same_bits(a, b) || (std::isnan(a) && std::isnan(b)); }
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  dcpattn::fuzz::Input in(data, size);
  const bool base2 = in.take<std::uint8_t>() & 1;
  const float raw_a = in.take<float>(), raw_b = in.take<float>();
  float o_a[kDv], o_b[kDv];
  for (float& x : o_a) x = in.take<float>();
  for (float& x : o_b) x = in.take<float>();
  const float la = base2 ? dcpattn::sanitize_lse(raw_a, dcpattn::lse_base_2{}) : dcpattn::sanitize_lse(raw_a);
  const float lb = base2 ? dcpattn::sanitize_lse(raw_b, dcpattn::lse_base_2{}) : dcpattn::sanitize_lse(raw_b);
  DCPATTN_FUZZ_CHECK(!std::isnan(la) && !std::isnan(lb));
  DCPATTN_FUZZ_CHECK(!(la > 0 && std::isinf(la)) && !(lb > 0 && std::isinf(lb)));

  float x[kDv], y[kDv];
  std::memcpy(x, o_a, sizeof x);
  std::memcpy(y, o_b, sizeof y);
  float lx = la, ly = lb;
  dcpattn::merge_state_into(x, lx, o_b, lb, kDv);  // a (+) b
  dcpattn::merge_state_into(y, ly, o_a, la, kDv);  // b (+) a

  DCPATTN_FUZZ_CHECK(same_bits(lx, ly));                        // commutative
  for (int i = 0; i < kDv; ++i) DCPATTN_FUZZ_CHECK(same_value(x[i], y[i]));
  DCPATTN_FUZZ_CHECK(!std::isnan(lx));
  if (la == dcpattn::lse_neg_inf && lb == dcpattn::lse_neg_inf) {  // two empties: neutral
    DCPATTN_FUZZ_CHECK(lx == dcpattn::lse_neg_inf);
    for (float v : x) DCPATTN_FUZZ_CHECK(v == 0.0f);
  } else if (lb == dcpattn::lse_neg_inf) {  // b empty: a passes through bit for bit
    DCPATTN_FUZZ_CHECK(same_bits(lx, la));
    for (int i = 0; i < kDv; ++i) DCPATTN_FUZZ_CHECK(same_value(x[i], o_a[i]));
  } else if (la == dcpattn::lse_neg_inf) {
    DCPATTN_FUZZ_CHECK(same_bits(lx, lb));
    for (int i = 0; i < kDv; ++i) DCPATTN_FUZZ_CHECK(same_value(x[i], o_b[i]));
  } else {
    DCPATTN_FUZZ_CHECK(lx >= (la > lb ? la : lb));  // log(e^a + e^b) >= max(a, b)
  }
  // finite inputs never give NaN (an overflow to inf is possible only near FLT_MAX)
  bool finite = true;
  for (int i = 0; i < kDv; ++i) finite = finite && std::isfinite(o_a[i]) && std::isfinite(o_b[i]);
  if (finite)
    for (float v : x) DCPATTN_FUZZ_CHECK(!std::isnan(v));
  return 0;
}
