// SPDX-License-Identifier: Apache-2.0
// The QueryGatherPolicy concept, the rank-major head layout, and what a gather returns.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>

#include <cuda/std/mdspan>
#include <cuda/std/span>

#include "dcpattn/config.hpp"
#include "dcpattn/core/numeric.hpp"
#include "dcpattn/core/tensor.hpp"
#include "dcpattn/op/config.hpp"

DCPATTN_NAMESPACE_BEGIN

/// mdspan layout of an all-gathered query: extents (T, H, D) over memory laid out
/// (N, T, H_local, D), rank-major, as an all-gather of every rank's contiguous (T, H_local, D)
/// block leaves it. Head h lives in rank h / H_local's block at local head h % H_local, so the
/// attention kernel reads the gathered heads in place, without a transposing copy.
struct LayoutRankMajorHeads {
  template <class Extents>
  class mapping {
   public:
    static_assert(Extents::rank() == 3, "dcpattn: LayoutRankMajorHeads maps (tokens, heads, dim)");
    using extents_type = Extents;
    using index_type = typename Extents::index_type;
    using size_type = typename Extents::size_type;
    using rank_type = typename Extents::rank_type;
    using layout_type = LayoutRankMajorHeads;

    constexpr mapping() noexcept = default;
    /// @param extents (T, H, D) with H a multiple of heads_per_rank
    /// @param heads_per_rank H_local
    constexpr DCPATTN_HOST_DEVICE mapping(const extents_type& extents,
                                          index_type heads_per_rank) noexcept
        : extents_(extents), heads_per_rank_(heads_per_rank) {}

    constexpr DCPATTN_HOST_DEVICE const extents_type& extents() const noexcept { return extents_; }
    constexpr DCPATTN_HOST_DEVICE index_type heads_per_rank() const noexcept {
      return heads_per_rank_;
    }
    constexpr DCPATTN_HOST_DEVICE index_type required_span_size() const noexcept {
      return extents_.extent(0) * extents_.extent(1) * extents_.extent(2);
    }
    template <class I0, class I1, class I2>
    constexpr DCPATTN_HOST_DEVICE index_type operator()(I0 t, I1 h, I2 d) const noexcept {
      const index_type hl = heads_per_rank_;
      const index_type r = index_type(h) / hl;
      const index_type hh = index_type(h) % hl;
      return ((r * extents_.extent(0) + index_type(t)) * hl + hh) * extents_.extent(2) +
             index_type(d);
    }

    static constexpr bool is_always_unique() noexcept { return true; }
    static constexpr bool is_always_exhaustive() noexcept { return true; }
    static constexpr bool is_always_strided() noexcept { return false; }
    static constexpr bool is_unique() noexcept { return true; }
    static constexpr bool is_exhaustive() noexcept { return true; }
    static constexpr bool is_strided() noexcept { return false; }

    friend constexpr bool operator==(const mapping& a, const mapping& b) noexcept {
      return a.extents_ == b.extents_ && a.heads_per_rank_ == b.heads_per_rank_;
    }

   private:
    extents_type extents_{};
    index_type heads_per_rank_ = 1;
  };
};

/// The gathered query as the attention kernel sees it: (T, H, D) bf16, rank-major in memory.
using GatheredQueryView = cuda::std::mdspan<const bfloat16, cuda::std::dextents<std::int64_t, 3>,
                                            LayoutRankMajorHeads>;

/// Result of a gather: the view of all H heads and whether the batch overflowed the direct
/// workspace and went through the all-gather fallback.
template <class View>
struct GatherOutcome {
  View query;
  bool used_fallback = false;
};

/// Requirements on a QueryGatherPolicy G used with communicator C and execution space E:
///   - G::persistent_bytes(config)  -> size_t  bytes the operator allocates once, at construction
///   - G::scratch_bytes(config)     -> size_t  per-forward scratch within the operator workspace
///   - G::query_heads(config)       -> int     heads of the q the caller passes (H_local, or H when
///                                             replicated)
///   - G::gather(comm, exec, q, persistent, scratch, config, stream) -> GatherOutcome<G::view_type>
///     with q: TensorView<const bfloat16, 3> (T, query_heads, D)
/// The returned view has extents (T, H, D) with H = config.num_heads.
template <class G, class C, class E>
concept QueryGatherPolicy =
    requires(C& comm, E& exec, TensorView<const bfloat16, 3> q, cuda::std::span<std::byte> bytes,
             const DcpConfig& config, typename C::stream_type stream) {
      typename G::view_type;
      { G::persistent_bytes(config) } -> std::convertible_to<std::size_t>;
      { G::scratch_bytes(config) } -> std::convertible_to<std::size_t>;
      { G::query_heads(config) } -> std::convertible_to<int>;
      {
        G::gather(comm, exec, q, bytes, bytes, config, stream)
      } -> std::same_as<GatherOutcome<typename G::view_type>>;
    };

#define DCPATTN_QUERY_GATHER_MESSAGE                                                        \
  "dcpattn: the gather policy does not satisfy QueryGatherPolicy for this communicator and " \
  "execution space: it needs view_type, persistent_bytes(config), scratch_bytes(config), "   \
  "query_heads(config) and gather(comm, exec, q, persistent, scratch, config, stream) "       \
  "(see dcpattn/gather/query_gather.hpp)"

namespace detail {
/// True when a rank-3 view is contiguous row-major (extent-1 dims may have any stride).
template <class View>
bool is_contiguous(const View& v) {
  std::int64_t expected = 1;
  for (int i = 2; i >= 0; --i) {
    if (v.extent(i) > 1 && v.stride(i) != expected) return false;
    expected *= v.extent(i);
  }
  return true;
}

/// Bytes of one (T, H, D) bf16 query.
inline std::size_t query_bytes(std::int64_t tokens, std::int64_t heads, std::int64_t dim) {
  return std::size_t(tokens) * std::size_t(heads) * std::size_t(dim) * sizeof(bfloat16);
}

/// All-gathers q (T, H_local, D) into `dst` (N * T * H_local * D bf16, rank-major) and returns the
/// (T, H, D) view of it. A q that is not contiguous row-major (a caller's strided projection
/// output) is first packed into `pack_area` (T * H_local * D bf16).
template <class C, class E>
GatheredQueryView all_gather_query(C& comm, E& exec, TensorView<const bfloat16, 3> q,
                                   bfloat16* dst, bfloat16* pack_area,
                                   typename C::stream_type stream) {
  const std::int64_t t = q.extent(0), hl = q.extent(1), d = q.extent(2);
  const std::size_t count = std::size_t(t * hl * d);
  const bfloat16* send = q.data_handle();
  if (!is_contiguous(q)) {
    exec.pack(q, pack_area, stream);
    send = pack_area;
  }
  comm.all_gather(reinterpret_cast<const std::uint8_t*>(send), reinterpret_cast<std::uint8_t*>(dst),
                  count * sizeof(bfloat16), stream);
  using Ext = cuda::std::dextents<std::int64_t, 3>;
  return GatheredQueryView(dst, LayoutRankMajorHeads::mapping<Ext>(Ext(t, hl * comm.size(), d), hl));
}
}  // namespace detail

DCPATTN_NAMESPACE_END
