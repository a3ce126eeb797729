// SPDX-License-Identifier: Apache-2.0
// The GPU record of bad input values. CUDA kernels cannot throw on data-dependent bad input
// without a host synchronization: they skip it (never reading or writing outside the views) and
// OR one of these bits into an optional word in device memory that the caller zeroes before the
// launch and reads after it (MlaDecodeParams::error_flags, PrologueArgs::error_flags; the
// operator's word: DcpAttention::check_input_errors). The host kernels throw instead.
#pragma once

#include <cstdint>
#include <string>

#include "dcpattn/config.hpp"

DCPATTN_NAMESPACE_BEGIN

/// A top-k entry < -1 or >= its row's causal bound (MLA decode, sparse).
inline constexpr std::uint32_t input_error_topk = 1u;
/// A slot_mapping entry < -1 or >= the cache's slots, or a slot whose indexer-cache page does not
/// exist (fused prologue); the row wrote nothing.
inline constexpr std::uint32_t input_error_slot = 2u;
/// A position outside [0, max_position) on a row with a slot (fused prologue); the row wrote
/// nothing.
inline constexpr std::uint32_t input_error_position = 4u;

/// What a nonzero error word means, for an Error message.
inline std::string describe_input_errors(std::uint32_t flags) {
  std::string s;
  auto add = [&s](const char* what) {
    if (!s.empty()) s += "; ";
    s += what;
  };
  if (flags & input_error_topk)
    add("topk_indices had entries outside [-1, row_bound) (< -1 or >= the row's causal bound); "
        "they were skipped");
  if (flags & input_error_slot)
    add("slot_mapping had entries outside [-1, num_slots) or without an indexer-cache page; "
        "those rows wrote nothing");
  if (flags & input_error_position)
    add("positions had entries outside [0, max_position) on rows with a slot; those rows wrote "
        "nothing");
  const std::uint32_t known = input_error_topk | input_error_slot | input_error_position;
  if (flags & ~known) add(("unknown error bits " + std::to_string(flags & ~known)).c_str());
  return s;
}

DCPATTN_NAMESPACE_END
