// SPDX-License-Identifier: Apache-2.0
// Exact top-k of the DSA lightning indexer under DCP: each rank selects the top-k of its own
// keys, the candidate lists are all-gathered, and every rank selects the same global top-k.
//
// Total order. Candidates are ranked by score descending, then by global position ascending. The
// score is first made canonical (topk_canonical_score): NaN becomes -inf and -0 becomes +0, so a
// garbage score can neither break the order (NaN compares false with everything) nor depend on
// its sign bit. Every candidate is distinct (positions are unique within a row), so the order is
// total and the top-k set is unique: for the same scores, the same set whatever N, on the host or
// the GPU.
//
// Why k candidates per rank suffice. Let x be in the global top-k of a row and r its owner. Every
// candidate of rank r ranked above x is also ranked above x globally, and fewer than k candidates
// are, so x is among the k best of rank r. Hence the union of the per-rank top-k lists contains
// the global top-k, and the top-k of that union, under the same order, is the global top-k.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include <cuda/std/bit>
#include <cuda/std/limits>
#include <cuda/std/span>

#include "dcpattn/comm/communicator.hpp"
#include "dcpattn/config.hpp"
#include "dcpattn/core/tensor.hpp"
#include "dcpattn/error.hpp"
#include "dcpattn/ownership/slot_ownership.hpp"

DCPATTN_NAMESPACE_BEGIN

/// Largest k the CUDA top-k supports (the DSA reference value; the host path takes any k >= 1).
inline constexpr int kIndexerMaxTopk = 2048;

/// One entry of a per-rank candidate list: a canonical score and the key's GLOBAL position, or
/// the padding entry {-inf, -1} when the rank has fewer than k candidates. Exchanged as bytes
/// (8 per entry, little-endian fields), so host and GPU ranks agree on the layout.
struct TopkCandidate {
  float score;
  std::int32_t position;
};
static_assert(sizeof(TopkCandidate) == 8 && std::is_trivially_copyable_v<TopkCandidate>,
              "dcpattn: TopkCandidate is exchanged as 8 raw bytes");

/// The padding entry of a candidate list.
constexpr DCPATTN_HOST_DEVICE TopkCandidate topk_padding_candidate() noexcept {
  return TopkCandidate{-cuda::std::numeric_limits<float>::infinity(), -1};
}

/// The score the top-k order uses: NaN -> -inf, -0 -> +0, anything else unchanged. A NaN-scored
/// key stays a candidate, ranked with the -inf ones (after every finite score).
constexpr DCPATTN_HOST_DEVICE float topk_canonical_score(float s) noexcept {
  if (s != s) return -cuda::std::numeric_limits<float>::infinity();
  return s == 0.0f ? 0.0f : s;
}

/// Order-preserving 32-bit image of a canonical score: a > b as floats iff image(a) > image(b).
constexpr DCPATTN_HOST_DEVICE std::uint32_t topk_score_bits(float canonical) noexcept {
  const std::uint32_t u = cuda::std::bit_cast<std::uint32_t>(canonical);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/// The rank of a candidate in the total order as one unsigned 64-bit key: larger is better.
/// High word: the score image; low word: the complement of the tie-break index (a global position,
/// or any index increasing with it), so a smaller index wins a tie. Distinct indices give
/// distinct keys. `index` must be in [0, 2^32).
constexpr DCPATTN_HOST_DEVICE std::uint64_t topk_order_key(float score,
                                                           std::uint32_t index) noexcept {
  return (std::uint64_t(topk_score_bits(topk_canonical_score(score))) << 32) |
         std::uint64_t(0xffffffffu - index);
}

/// True when candidate (score a, position pa) comes before (score b, position pb) in the top-k
/// order. The plain comparator form of topk_order_key.
constexpr DCPATTN_HOST_DEVICE bool topk_before(float a, std::int64_t pa, float b,
                                               std::int64_t pb) noexcept {
  const float ca = topk_canonical_score(a), cb = topk_canonical_score(b);
  if (ca != cb) return ca > cb;
  return pa < pb;
}

/// Bytes of one rank's candidate list for T rows: T * k entries.
constexpr std::size_t topk_candidate_bytes(std::int64_t rows, int k) noexcept {
  return std::size_t(rows > 0 ? rows : 0) * std::size_t(k > 0 ? k : 0) * sizeof(TopkCandidate);
}

namespace detail {
constexpr std::size_t align_workspace(std::size_t x) noexcept {
  return (x + 255) / 256 * 256;
}

/// Where the pieces of a distributed top-k live in its workspace (byte offsets, 256-aligned).
struct DistributedTopkLayout {
  std::size_t local = 0;     ///< this rank's (T, k) candidates
  std::size_t gathered = 0;  ///< (N, T, k) candidates of all ranks, rank-major
  std::size_t total = 0;
};
constexpr DistributedTopkLayout distributed_topk_layout(std::int64_t rows, int k,
                                                        int group_size) noexcept {
  DistributedTopkLayout l{};
  const std::size_t one = topk_candidate_bytes(rows, k);
  l.local = 0;
  l.gathered = align_workspace(one);
  l.total = l.gathered + align_workspace(std::size_t(group_size > 0 ? group_size : 0) * one);
  return l;
}
}  // namespace detail

/// Workspace bytes of distributed_topk (host or CUDA) for up to `max_rows` rows, top-k `k`, and a
/// group of `group_size` ranks: one (T, k) candidate list and the gathered (N, T, k) lists.
constexpr std::size_t distributed_topk_workspace_bytes(std::int64_t max_rows, int k,
                                                       int group_size) noexcept {
  return detail::distributed_topk_layout(max_rows, k, group_size).total;
}

namespace detail {

inline std::string topk_str(std::int64_t v) {
  return std::to_string(v);
}

/// Checks shared by the host and CUDA local top-k; `columns` is scores.extent(1).
inline void validate_local_topk_shape(std::int64_t rows, std::int64_t columns,
                                      std::int64_t bound_rows, int num_valid_rows, int k,
                                      std::int64_t out_rows, std::int64_t out_k) {
  DCPATTN_REQUIRE(k >= 1, "topk (" + topk_str(k) + ") must be >= 1");
  DCPATTN_REQUIRE(num_valid_rows >= 0 && num_valid_rows <= rows,
                  "num_valid_rows (" + topk_str(num_valid_rows) +
                      ") must be in [0, T = " + topk_str(rows) + "]");
  DCPATTN_REQUIRE(bound_rows == rows,
                  "row_bound has " + topk_str(bound_rows) + " rows, scores has " + topk_str(rows));
  DCPATTN_REQUIRE(out_rows == rows && out_k == k,
                  "the candidate list must be (T = " + topk_str(rows) + ", k = " + topk_str(k) +
                      "), got (" + topk_str(out_rows) + ", " + topk_str(out_k) + ")");
  DCPATTN_REQUIRE(columns <= std::int64_t(0xffffffffLL),
                  "scores has " + topk_str(columns) + " columns, more than 2^32 - 1");
}

inline void validate_merge_shape(std::int64_t gathered_rows, std::int64_t gathered_k,
                                 int group_size, int num_valid_rows, std::int64_t out_rows,
                                 std::int64_t out_k) {
  DCPATTN_REQUIRE(group_size >= 1, "group_size (" + topk_str(group_size) + ") must be >= 1");
  DCPATTN_REQUIRE(gathered_k >= 1, "the candidate lists must have k >= 1 columns");
  DCPATTN_REQUIRE(gathered_rows % group_size == 0,
                  "gathered candidates have " + topk_str(gathered_rows) +
                      " rows, not a multiple of group_size (" + topk_str(group_size) + ")");
  const std::int64_t rows = gathered_rows / group_size;
  DCPATTN_REQUIRE(out_rows == rows && out_k == gathered_k,
                  "topk_indices must be (T = " + topk_str(rows) + ", k = " + topk_str(gathered_k) +
                      "), got (" + topk_str(out_rows) + ", " + topk_str(out_k) + ")");
  DCPATTN_REQUIRE(num_valid_rows >= 0 && num_valid_rows <= rows,
                  "num_valid_rows (" + topk_str(num_valid_rows) +
                      ") must be in [0, T = " + topk_str(rows) + "]");
}

/// Keeps the `k` largest of `keys` (any order in, any order out) and drops the rest.
inline void keep_largest(std::vector<std::uint64_t>& keys, std::size_t k) {
  if (keys.size() <= k) return;
  std::nth_element(keys.begin(), keys.begin() + std::ptrdiff_t(k - 1), keys.end(),
                   [](std::uint64_t a, std::uint64_t b) { return a > b; });
  keys.resize(k);
}

}  // namespace detail

namespace host {

/// Per-rank top-k of one batch (host reference).
///
/// Row t's candidates are this rank's keys of its causal prefix: local positions
/// p < own.local_length(row_bound[t], rank), with score scores(t, p) and global position
/// own.global_position(p, rank). Row t of `out` receives the min(k, n_t) best of them (top-k order,
/// see the file comment) in ascending position order, each as {canonical score, global position},
/// followed by padding entries {-inf, -1}. Rows with no candidate (a short prefix, a rank that
/// owns none of it) and padding rows t >= num_valid_rows are all padding; nothing of a padding row
/// is read. Columns of `scores` at or beyond a row's local length are not read.
///
/// @tparam Ownership SlotOwnership model (e.g. RoundRobinOwnership); global_position must increase
///                   with the local position (true of every model: ranks store tokens in ascending
///                   order), and global positions must be < 2^31
/// @param scores    (T, C) fp32 indexer scores of this rank, C >= every valid row's local length
/// @param row_bound (T,) global causal bound of each row
/// @param out       (T, k) candidate list of this rank
/// Throws dcpattn::Error naming the parameter, before writing, on bad extents or a valid row whose
/// local length exceeds C or whose bound exceeds 2^31.
template <class Ownership>
void local_topk(const Ownership& own, int rank, TensorView<const float, 2> scores,
                TensorView<const std::int64_t, 1> row_bound, int num_valid_rows,
                TensorView<TopkCandidate, 2> out) {
  static_assert(SlotOwnership<Ownership>, DCPATTN_SLOT_OWNERSHIP_MESSAGE);
  const std::int64_t rows = scores.extent(0);
  const int k = int(out.extent(1));
  dcpattn::detail::validate_local_topk_shape(rows, scores.extent(1), row_bound.extent(0),
                                             num_valid_rows, k, out.extent(0), out.extent(1));
  DCPATTN_REQUIRE(rank >= 0 && rank < own.group_size(),
                  "rank (" + dcpattn::detail::topk_str(rank) + ") must be in [0, group_size = " +
                      dcpattn::detail::topk_str(own.group_size()) + ")");
  for (std::int64_t t = 0; t < num_valid_rows; ++t) {
    const std::int64_t bound = row_bound(t);
    DCPATTN_REQUIRE(bound >= 0 && bound <= std::int64_t(0x7fffffff),
                    "row_bound[" + dcpattn::detail::topk_str(t) +
                        "] = " + dcpattn::detail::topk_str(bound) + " is outside [0, 2^31)");
    const std::int64_t n = own.local_length(bound, rank);
    DCPATTN_REQUIRE(n <= scores.extent(1),
                    "row " + dcpattn::detail::topk_str(t) + " has " + dcpattn::detail::topk_str(n) +
                        " local keys, more than the " +
                        dcpattn::detail::topk_str(scores.extent(1)) + " columns of scores");
  }

  std::vector<std::uint64_t> keys;
  for (std::int64_t t = 0; t < rows; ++t) {
    std::int64_t written = 0;
    if (t < num_valid_rows) {
      const std::int64_t n = own.local_length(row_bound(t), rank);
      // Within a rank the global position grows with p, so p breaks ties like the position does.
      keys.clear();
      for (std::int64_t p = 0; p < n; ++p)
        keys.push_back(topk_order_key(scores(t, p), std::uint32_t(p)));
      dcpattn::detail::keep_largest(keys, std::size_t(k));
      std::sort(keys.begin(), keys.end(), [](std::uint64_t a, std::uint64_t b) {
        return std::uint32_t(a) > std::uint32_t(b);
      });
      for (const std::uint64_t key : keys) {
        const std::int64_t p = std::int64_t(0xffffffffu - std::uint32_t(key));
        out(t, written++) = TopkCandidate{topk_canonical_score(scores(t, p)),
                                          std::int32_t(own.global_position(p, rank))};
      }
    }
    for (; written < k; ++written) out(t, written) = topk_padding_candidate();
  }
}

/// Global top-k from the gathered candidate lists of all ranks (host reference).
///
/// Row t of `topk_indices` receives the k best candidates of rows t of the N lists (top-k order),
/// as global positions in ascending order, -1 padded at the end when fewer than k candidates exist
/// in total. Padding rows t >= num_valid_rows are all -1. Entries with position -1 are padding and
/// are skipped. The result is the same on every rank and, given the lists of local_topk, the exact
/// top-k over all the row's keys (see the file comment).
///
/// @param gathered     (N * T, k) candidate lists, rank-major: rows [r T, (r + 1) T) are rank r's
/// @param group_size   N
/// @param topk_indices (T, k) int32 output: what the sparse attention reads
inline void merge_topk(TensorView<const TopkCandidate, 2> gathered, int group_size,
                       int num_valid_rows, TensorView<std::int32_t, 2> topk_indices) {
  dcpattn::detail::validate_merge_shape(gathered.extent(0), gathered.extent(1), group_size,
                                        num_valid_rows, topk_indices.extent(0),
                                        topk_indices.extent(1));
  const std::int64_t rows = topk_indices.extent(0);
  const std::int64_t k = topk_indices.extent(1);
  std::vector<std::uint64_t> keys;
  for (std::int64_t t = 0; t < rows; ++t) {
    std::int64_t written = 0;
    if (t < num_valid_rows) {
      keys.clear();
      for (int r = 0; r < group_size; ++r)
        for (std::int64_t i = 0; i < k; ++i) {
          const TopkCandidate c = gathered(r * rows + t, i);
          if (c.position < 0) continue;
          keys.push_back(topk_order_key(c.score, std::uint32_t(c.position)));
        }
      dcpattn::detail::keep_largest(keys, std::size_t(k));
      std::vector<std::int32_t> positions;
      positions.reserve(keys.size());
      for (const std::uint64_t key : keys)
        positions.push_back(std::int32_t(0xffffffffu - std::uint32_t(key)));
      std::sort(positions.begin(), positions.end());
      for (const std::int32_t g : positions) topk_indices(t, written++) = g;
    }
    for (; written < k; ++written) topk_indices(t, written) = -1;
  }
}

/// Exact global top-k of the indexer scores over a DCP group (host reference): local_topk on this
/// rank, one all_gather of the (T, k) candidate lists (as bytes), merge_topk. Every rank of the
/// group calls it with the same T, k and num_valid_rows and obtains the same `topk_indices`, equal
/// to the top-k a single rank holding every key would choose.
///
/// @tparam Comm      Communicator on host buffers (SelfCommunicator, MpiCommunicator)
/// @tparam Ownership SlotOwnership model with group_size() == comm.size()
/// @param scores       (T, C) this rank's scores (see local_topk)
/// @param row_bound    (T,) global causal bound of each row
/// @param topk_indices (T, k) int32 output: ascending global positions, -1 padded
/// @param workspace    >= distributed_topk_workspace_bytes(T, k, N) bytes of host memory
template <class Comm, class Ownership>
void distributed_topk(Comm& comm, const Ownership& own, TensorView<const float, 2> scores,
                      TensorView<const std::int64_t, 1> row_bound, int num_valid_rows,
                      TensorView<std::int32_t, 2> topk_indices,
                      cuda::std::span<std::byte> workspace,
                      typename Comm::stream_type stream = {}) {
  static_assert(Communicator<Comm>, DCPATTN_COMMUNICATOR_MESSAGE);
  static_assert(SlotOwnership<Ownership>, DCPATTN_SLOT_OWNERSHIP_MESSAGE);
  const int n = comm.size();
  DCPATTN_REQUIRE(own.group_size() == n, "the ownership's group_size (" +
                                             dcpattn::detail::topk_str(own.group_size()) +
                                             ") differs from the communicator's size (" +
                                             dcpattn::detail::topk_str(n) + ")");
  const std::int64_t rows = scores.extent(0);
  const int k = int(topk_indices.extent(1));
  DCPATTN_REQUIRE(topk_indices.extent(0) == rows,
                  "topk_indices has " + dcpattn::detail::topk_str(topk_indices.extent(0)) +
                      " rows, scores has " + dcpattn::detail::topk_str(rows));
  const auto layout = dcpattn::detail::distributed_topk_layout(rows, k, n);
  DCPATTN_REQUIRE(workspace.size() >= layout.total,
                  "workspace has " + dcpattn::detail::topk_str(std::int64_t(workspace.size())) +
                      " bytes, distributed_topk_workspace_bytes is " +
                      dcpattn::detail::topk_str(std::int64_t(layout.total)));
  auto* local = reinterpret_cast<TopkCandidate*>(workspace.data() + layout.local);
  auto* gathered = reinterpret_cast<TopkCandidate*>(workspace.data() + layout.gathered);
  local_topk(own, comm.rank(), scores, row_bound, num_valid_rows,
             make_view(local, {rows, std::int64_t(k)}));
  comm.all_gather(reinterpret_cast<const std::uint8_t*>(local),
                  reinterpret_cast<std::uint8_t*>(gathered), topk_candidate_bytes(rows, k), stream);
  merge_topk(make_view(static_cast<const TopkCandidate*>(gathered), {n * rows, std::int64_t(k)}), n,
             num_valid_rows, topk_indices);
}

}  // namespace host

DCPATTN_NAMESPACE_END
