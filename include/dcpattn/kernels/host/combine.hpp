// SPDX-License-Identifier: Apache-2.0
// Host implementations of the combine steps: packing partial states for the exchange, merging the
// received states, and the rescale of the all-gather/reduce-scatter combiner.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dcpattn/config.hpp"
#include "dcpattn/core/lse.hpp"
#include "dcpattn/core/numeric.hpp"
#include "dcpattn/core/tensor.hpp"
#include "dcpattn/op/config.hpp"

DCPATTN_NAMESPACE_BEGIN

namespace detail {

/// Byte layout of the all-to-all chunk one rank sends to one destination: the o of the
/// destination's heads (T, H_local, Dv) in the partial dtype, then their lse (T, H_local) fp32,
/// each part padded to 16 bytes.
struct A2aChunkLayout {
  std::size_t o_bytes;
  std::size_t lse_offset;
  std::size_t bytes;

  static A2aChunkLayout make(std::int64_t tokens, std::int64_t heads_local, std::int64_t dv,
                             PartialDtype dtype) {
    auto align16 = [](std::size_t x) { return (x + 15) / 16 * 16; };
    const std::size_t esize = dtype == PartialDtype::fp32 ? 4 : 2;
    const std::size_t o = std::size_t(tokens * heads_local * dv) * esize;
    const std::size_t l = std::size_t(tokens * heads_local) * 4;
    return {o, align16(o), align16(o) + align16(l)};
  }
};

}  // namespace detail

namespace detail {
/// State r of N states stored as o (N, dv) and lse (N) arrays (for tree_merge; a functor rather
/// than a lambda so nvcc accepts it in host-device code).
struct StridedStates {
  float* o;
  float* lse;
  std::int64_t dv;
  DCPATTN_HOST_DEVICE TreeStateRef operator()(int r) const { return {o + r * dv, lse + r}; }
};
/// Element r of a strided float array.
struct StridedLse {
  const float* lse;
  std::size_t stride;
  DCPATTN_HOST_DEVICE float operator()(int r) const { return lse[std::size_t(r) * stride]; }
};
}  // namespace detail

namespace host {

/// Packs the local partial state for an all-to-all. o: (T, H, Dv) fp32, lse: (T, H) in the kernel's
/// LSE base (Base: lse_base_e or lse_base_2). Rows t >= num_valid_rows and states whose lse is
/// -inf, +inf or NaN are sent as the neutral element (o = 0, lse = -inf), so neither padding
/// garbage nor an empty row's o crosses the wire. send: N chunks of layout.bytes.
template <class Base>
void combine_pack_a2a(TensorView<const float, 3> o, TensorView<const float, 2> lse,
                      int num_valid_rows, int group_size, PartialDtype dtype,
                      const detail::A2aChunkLayout& layout, std::byte* send) {
  const std::int64_t t_count = o.extent(0), heads = o.extent(1), dv = o.extent(2);
  const std::int64_t hl = heads / group_size;
  for (int d = 0; d < group_size; ++d) {
    std::byte* chunk = send + std::size_t(d) * layout.bytes;
    auto* lse_out = reinterpret_cast<float*>(chunk + layout.lse_offset);
    for (std::int64_t t = 0; t < t_count; ++t) {
      for (std::int64_t hh = 0; hh < hl; ++hh) {
        const std::int64_t h = d * hl + hh;
        const float l = t < num_valid_rows ? sanitize_lse(lse(t, h), Base{}) : lse_neg_inf;
        const std::size_t row = std::size_t(t * hl + hh);
        lse_out[row] = l;
        for (std::int64_t i = 0; i < dv; ++i) {
          const float v = l == lse_neg_inf ? 0.0f : o(t, h, i);
          if (dtype == PartialDtype::fp32)
            reinterpret_cast<float*>(chunk)[row * dv + i] = v;
          else
            reinterpret_cast<bfloat16*>(chunk)[row * dv + i] = bfloat16::from_float(v);
        }
      }
    }
  }
}

/// Merges the N received chunks (chunk r holds rank r's partial for this rank's heads) into the
/// output. Deterministic mode merges along the fixed tree over the rank index (N a power of two);
/// fast mode takes one N-way log-sum-exp (weights fast_weight, summed in rank order). out:
/// (T, H_local, Dv) of OutT; out_lse: (T, H_local) natural log, skipped when its data handle is
/// null.
template <class OutT>
void combine_merge_a2a(const std::byte* recv, int group_size, DcpMode mode, PartialDtype dtype,
                       const detail::A2aChunkLayout& layout, TensorView<OutT, 3> out,
                       TensorView<float, 2> out_lse) {
  const std::int64_t t_count = out.extent(0), hl = out.extent(1), dv = out.extent(2);
  std::vector<float> o_states(static_cast<std::size_t>(group_size * dv));
  std::vector<float> lse_states(static_cast<std::size_t>(group_size));
  std::vector<float> weights(static_cast<std::size_t>(group_size));
  for (std::int64_t t = 0; t < t_count; ++t) {
    for (std::int64_t hh = 0; hh < hl; ++hh) {
      const std::size_t row = std::size_t(t * hl + hh);
      for (int r = 0; r < group_size; ++r) {
        const std::byte* chunk = recv + std::size_t(r) * layout.bytes;
        lse_states[r] = reinterpret_cast<const float*>(chunk + layout.lse_offset)[row];
        for (std::int64_t i = 0; i < dv; ++i)
          o_states[r * dv + i] =
              dtype == PartialDtype::fp32
                  ? reinterpret_cast<const float*>(chunk)[row * dv + i]
                  : reinterpret_cast<const bfloat16*>(chunk)[row * dv + i].to_float();
      }
      float merged_lse;
      if (mode == DcpMode::deterministic) {
        tree_merge(detail::StridedStates{o_states.data(), lse_states.data(), dv}, group_size,
                   int(dv));
        merged_lse = lse_states[0];
        for (std::int64_t i = 0; i < dv; ++i) out(t, hh, i) = from_float<OutT>(o_states[i]);
      } else {
        // One N-way merge: weights exp(lse_r - max) * (1 / sum), the weighted sum in rank order.
        const LseSum sum = fast_sum_n(detail::StridedLse{lse_states.data(), 1}, group_size);
        merged_lse = lse_of(sum);
        for (int r = 0; r < group_size; ++r) weights[r] = fast_weight(lse_states[r], sum);
        for (std::int64_t i = 0; i < dv; ++i) {
          float acc = 0.0f;
          for (int r = 0; r < group_size; ++r) acc += weighted(weights[r], o_states[r * dv + i]);
          out(t, hh, i) = from_float<OutT>(acc);
        }
      }
      if (out_lse.data_handle() != nullptr) out_lse(t, hh) = merged_lse;
    }
  }
}

/// The all-gather/reduce-scatter combiner's local step. lse_all: (N, T, H) sanitized natural-log
/// LSE of every rank; o: (T, H, Dv) this rank's partial. Writes packed (N, T, H_local, Dv) fp32 =
/// exp(lse_mine - L) o, destination-major for the reduce-scatter, and this rank's total LSE of its
/// own heads into out_lse (T, H_local) when non-null.
inline void combine_rescale_agrs(TensorView<const float, 3> o, const float* lse_all, int rank,
                                 int group_size, float* packed, TensorView<float, 2> out_lse) {
  const std::int64_t t_count = o.extent(0), heads = o.extent(1), dv = o.extent(2);
  const std::int64_t hl = heads / group_size;
  const std::size_t plane = std::size_t(t_count * heads);
  for (std::int64_t t = 0; t < t_count; ++t) {
    for (std::int64_t h = 0; h < heads; ++h) {
      const std::size_t idx = std::size_t(t * heads + h);
      const float total = merge_lse_n(detail::StridedLse{lse_all + idx, plane}, group_size);
      const float w = merge_weight(lse_all[std::size_t(rank) * plane + idx], total);
      const std::int64_t d = h / hl, hh = h % hl;
      float* dst = packed + ((std::size_t(d) * t_count + t) * hl + hh) * dv;
      for (std::int64_t i = 0; i < dv; ++i) dst[i] = weighted(w, o(t, h, i));
      if (d == rank && out_lse.data_handle() != nullptr) out_lse(t, hh) = total;
    }
  }
}

}  // namespace host

DCPATTN_NAMESPACE_END
