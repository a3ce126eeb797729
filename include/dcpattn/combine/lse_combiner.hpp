// SPDX-License-Identifier: Apache-2.0
// The LseCombiner concept: merge every rank's partial (o, lse) of all heads into the final output
// of this rank's heads.
#pragma once

#include <concepts>
#include <cstddef>

#include <cuda/std/span>

#include "dcpattn/config.hpp"
#include "dcpattn/core/lse.hpp"
#include "dcpattn/core/numeric.hpp"
#include "dcpattn/core/tensor.hpp"
#include "dcpattn/op/config.hpp"

DCPATTN_NAMESPACE_BEGIN

/// What a combiner consumes and produces. Shapes: T tokens, H heads of the group, H_local = H / N.
struct CombineArgs {
  TensorView<const float, 3> o;    ///< (T, H, Dv) this rank's partial over its shard, fp32
  TensorView<const float, 2> lse;  ///< (T, H) its LSE, in the kernel's base; +inf/NaN = empty
  int num_valid_rows = 0;          ///< rows >= this are padding: they count as empty everywhere
  TensorView<bfloat16, 3> out;     ///< (T, H_local, Dv) merged output of heads [r H_local, ...)
  TensorView<float, 2> out_lse;    ///< (T, H_local) merged natural-log LSE; null handle = skip
};

/// Requirements on an LseCombiner K used with communicator C and execution space E:
///   - K::scratch_bytes(config)  -> size_t  per-forward scratch within the operator workspace
///   - K::supports(mode)         -> bool    whether it can honour the DcpMode
///   - K::template combine<LseBase>(comm, exec, args, scratch, config, stream)
/// combine() must treat rows >= num_valid_rows and lse of +inf/NaN/-inf as the neutral element
/// and, for N = 1, reduce to a copy (up to the final rounding).
template <class K, class C, class E>
concept LseCombiner = requires(C& comm, E& exec, const CombineArgs& args,
                               cuda::std::span<std::byte> scratch, const DcpConfig& config,
                               DcpMode mode, typename C::stream_type stream) {
  { K::scratch_bytes(config) } -> std::convertible_to<std::size_t>;
  { K::supports(mode) } -> std::convertible_to<bool>;
  K::template combine<lse_base_e>(comm, exec, args, scratch, config, stream);
};

#define DCPATTN_LSE_COMBINER_MESSAGE                                                          \
  "dcpattn: the combiner does not satisfy LseCombiner for this communicator and execution "    \
  "space: it needs scratch_bytes(config), supports(mode) and "                                 \
  "combine<LseBase>(comm, exec, args, scratch, config, stream) (see dcpattn/combine/lse_combiner.hpp)"

DCPATTN_NAMESPACE_END
