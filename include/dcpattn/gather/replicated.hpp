// SPDX-License-Identifier: Apache-2.0
// Replicated: every rank already projected all H query heads; nothing to gather.
#pragma once

#include <cstddef>

#include "dcpattn/config.hpp"
#include "dcpattn/gather/query_gather.hpp"

DCPATTN_NAMESPACE_BEGIN

/// QueryGatherPolicy for engines that compute all H heads on every rank (replicated q
/// projection): the caller passes q (T, H, D) and the kernel reads it as given, strides included.
struct Replicated {
  using view_type = TensorView<const bfloat16, 3>;

  static std::size_t persistent_bytes(const DcpConfig&) { return 0; }
  static std::size_t scratch_bytes(const DcpConfig&) { return 0; }
  static int query_heads(const DcpConfig& c) { return c.num_heads; }

  template <class C, class E>
  static GatherOutcome<view_type> gather(C&, E&, TensorView<const bfloat16, 3> q,
                                         cuda::std::span<std::byte>, cuda::std::span<std::byte>,
                                         const DcpConfig&, typename C::stream_type) {
    return {q, false};
  }
};

DCPATTN_NAMESPACE_END
