// SPDX-License-Identifier: Apache-2.0
// The distributed top-k (host: local_topk on every rank, merge_topk of the gathered lists) under
// random N, I, k, causal bounds and scores drawn as arbitrary bit patterns (NaN, infinities, -0,
// denormals) or from a few values (many ties): the merged indices equal a plain sort of all the
// row's keys by (score, position), with NaN ranked as -inf and -0 as +0, on every N.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dcpattn/indexer/distributed_topk.hpp"
#include "dcpattn/ownership/round_robin.hpp"
#include "fuzz_input.hpp"

namespace {

/// The reference: the k first of all positions [0, bound) sorted by descending score (NaN as
/// -inf, ties and -0 == +0 by plain float comparison) then ascending position, returned in
/// ascending position order and -1 padded to k.
std::vector<std::int32_t> reference_topk(const std::vector<float>& scores, std::int64_t bound,
                                         int k) {
  auto score = [&](std::int64_t p) {
    const float s = scores[std::size_t(p)];
    return std::isnan(s) ? -INFINITY : s;
  };
  std::vector<std::int64_t> pos(static_cast<std::size_t>(bound));
  for (std::int64_t p = 0; p < bound; ++p) pos[std::size_t(p)] = p;
  std::stable_sort(pos.begin(), pos.end(),
                   [&](std::int64_t a, std::int64_t b) { return score(a) > score(b); });
  pos.resize(std::min<std::size_t>(pos.size(), std::size_t(k)));
  std::sort(pos.begin(), pos.end());
  std::vector<std::int32_t> out(std::size_t(k), -1);
  for (std::size_t i = 0; i < pos.size(); ++i) out[i] = std::int32_t(pos[i]);
  return out;
}

/// local_topk on each of the n ranks, the rank-major gather, merge_topk: row 0 of topk_indices.
std::vector<std::int32_t> distributed(const std::vector<float>& scores, std::int64_t bound, int k,
                                      int n, int interleave) {
  const dcpattn::RoundRobinOwnership own(n, interleave, 8);
  const std::int64_t columns = std::max<std::int64_t>(1, (bound + n - 1) / n + interleave);
  std::vector<dcpattn::TopkCandidate> gathered(std::size_t(n) * std::size_t(k));
  const std::int64_t bounds[1] = {bound};
  for (int r = 0; r < n; ++r) {
    std::vector<float> local(std::size_t(columns), 0.0f);
    const std::int64_t len = own.local_length(bound, r);
    DCPATTN_FUZZ_CHECK(len <= columns);
    for (std::int64_t p = 0; p < len; ++p)
      local[std::size_t(p)] = scores[std::size_t(own.global_position(p, r))];
    dcpattn::host::local_topk(
        own, r, dcpattn::make_view(static_cast<const float*>(local.data()), {1, columns}),
        dcpattn::make_view(static_cast<const std::int64_t*>(bounds), {1}), 1,
        dcpattn::make_view(gathered.data() + std::size_t(r) * std::size_t(k), {1, std::int64_t(k)}));
  }
  std::vector<std::int32_t> out(std::size_t(k), 7);  // poisoned: every entry must be written
  dcpattn::host::merge_topk(
      dcpattn::make_view(static_cast<const dcpattn::TopkCandidate*>(gathered.data()),
                         {std::int64_t(n), std::int64_t(k)}),
      n, 1, dcpattn::make_view(out.data(), {1, std::int64_t(k)}));
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  dcpattn::fuzz::Input in(data, size);
  const int n = int(in.range(1, 8));
  const int interleave = int(in.range(1, 4));
  const int k = int(in.range(1, 40));
  const std::int64_t bound = in.range(0, 300);
  const bool ties = in.take<std::uint8_t>() & 1;
  const float few[6] = {1.0f, -0.0f, 0.0f, -INFINITY, INFINITY, NAN};
  std::vector<float> scores(static_cast<std::size_t>(bound));
  for (float& s : scores) s = ties ? few[in.range(0, 5)] : in.take<float>();

  const std::vector<std::int32_t> want = reference_topk(scores, bound, k);
  const std::vector<std::int32_t> got = distributed(scores, bound, k, n, interleave);
  DCPATTN_FUZZ_CHECK(got == want);
  // The same on one rank: the result does not depend on the group.
  if (n > 1) DCPATTN_FUZZ_CHECK(distributed(scores, bound, k, 1, 1) == want);
  return 0;
}
