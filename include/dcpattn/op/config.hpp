// SPDX-License-Identifier: Apache-2.0
// Runtime configuration of a DCP attention operator.
#pragma once

#include <cstdint>

#include "dcpattn/config.hpp"

DCPATTN_NAMESPACE_BEGIN

/// Numerical contract of the cross-rank merge.
enum class DcpMode {
  /// Bitwise identical output for every group size N dividing virtual_shards: fixed splits per
  /// virtual shard, fixed merge tree, fp32 partials, one rounding at the end.
  deterministic,
  /// Close to deterministic (not bitwise): bf16 partials and the reduce-scatter combiner allowed.
  fast,
};

/// Element type of the partial outputs exchanged between ranks. With bf16 (fast mode only) the
/// CUDA attention kernels of more than 16 heads on compute capability 9.x also keep their split
/// states' values in bf16 before the local merge (MlaDecodeParams::bf16_split_states).
enum class PartialDtype { fp32, bf16 };

/// Everything an operator needs to know before the first forward(). Shapes use
/// T = tokens (query rows) of one forward, H = heads of the whole group, H_local = H / N.
struct DcpConfig {
  int group_size = 1;         ///< N, ranks in the DCP group (must equal the communicator's size)
  int num_heads = 128;        ///< H, query heads of the group; each rank projects H / N of them
  int head_dim_qk = 576;      ///< q/k head dim (MLA: kv_lora_rank 512 + rope 64)
  int head_dim_v = 512;       ///< v head dim (MLA: kv_lora_rank)
  int page_size = 64;         ///< B, tokens per KV page; a multiple of interleave
  int interleave = 1;         ///< I, consecutive tokens per rank in round-robin ownership
  int virtual_shards = 8;     ///< V, power of two; deterministic mode needs N | V
  int max_tokens = 256;       ///< largest T of any forward(); sizes the workspace
  int gather_capacity = 64;   ///< tokens the persistent direct gather workspace holds
  int topk = 2048;            ///< sparse attention: indices per query row
  float softmax_scale = 0.0f; ///< > 0; DeepSeek-V3.2: 1/sqrt(192) before any YaRN factor
  DcpMode mode = DcpMode::deterministic;
  PartialDtype partial_dtype = PartialDtype::fp32;  ///< bf16 only in fast mode
  /// Before communicating, forward() agrees with the other ranks (one small blocking collective)
  /// on whether every rank accepted its inputs, so a bad input on one rank raises a
  /// dcpattn::Error naming that rank on every rank instead of leaving the others waiting in a
  /// collective. Costs a host round trip per step (a stream sync on the GPU): for debugging and
  /// CI. Needs a communicator with all_reduce_max_int. [optional] (default: false)
  bool validate_collectively = false;
};

DCPATTN_NAMESPACE_END
