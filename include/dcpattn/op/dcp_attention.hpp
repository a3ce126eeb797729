// SPDX-License-Identifier: Apache-2.0
// DcpAttention: the DCP decode attention operator composed from its policies.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

#include <cuda/std/span>

#include "dcpattn/combine/lse_combiner.hpp"
#include "dcpattn/comm/communicator.hpp"
#include "dcpattn/config.hpp"
#include "dcpattn/core/lse.hpp"
#include "dcpattn/core/tensor.hpp"
#include "dcpattn/error.hpp"
#include "dcpattn/gather/query_gather.hpp"
#include "dcpattn/kernels/cache_layout.hpp"
#include "dcpattn/kernels/mla_kernel.hpp"
#include "dcpattn/op/config.hpp"
#include "dcpattn/ownership/slot_ownership.hpp"

DCPATTN_NAMESPACE_BEGIN

/// What forward() reports about one call.
struct ForwardInfo {
  /// The batch exceeded the direct gather workspace and went through the all-gather fallback.
  bool gather_fell_back = false;
  /// Local splits the attention kernel ran on this rank (DcpAttention::splits_for).
  int num_splits = 0;
};

/// Decode context parallel attention over one DCP group.
///
/// Per forward, on every rank: gather the query heads (Gather), attend all H heads over this
/// rank's KV shard (Kernel, run by Exec), and merge the partial states across ranks (Combiner)
/// into this rank's H_local heads. Gather and combine are always part of the call: with N = 1 they
/// reduce to copies, with N > 1 nothing can skip them.
///
/// @tparam Ownership  SlotOwnership model (RoundRobinOwnership); VirtualShardedOwnership for
///                    deterministic mode
/// @tparam Gather     QueryGatherPolicy: DirectWorkspace, AllGather or Replicated
/// @tparam Kernel     AttentionKernel: DenseMla<F> or SparseMla<F>
/// @tparam Combiner   LseCombiner: AllToAll or AllGatherReduceScatter
/// @tparam Comm       Communicator: SelfCommunicator, MpiCommunicator, NcclCommunicator
/// @tparam Exec       execution space: HostExecution (or the CUDA one), matching Comm's stream type
template <class Ownership, class Gather, class Kernel, class Combiner, class Comm, class Exec>
class DcpAttention {
  static_assert(SlotOwnership<Ownership>, DCPATTN_SLOT_OWNERSHIP_MESSAGE);
  static_assert(Communicator<Comm>, DCPATTN_COMMUNICATOR_MESSAGE);
  static_assert(AttentionKernel<Kernel>, DCPATTN_ATTENTION_KERNEL_MESSAGE);
  static_assert(QueryGatherPolicy<Gather, Comm, Exec>, DCPATTN_QUERY_GATHER_MESSAGE);
  static_assert(LseCombiner<Combiner, Comm, Exec>, DCPATTN_LSE_COMBINER_MESSAGE);
  static_assert(std::is_same_v<typename Comm::stream_type, typename Exec::stream_type>,
                "dcpattn: the communicator and the execution space must use the same stream type "
                "(host communicators go with HostExecution, NCCL with the CUDA execution space)");

 public:
  using stream_type = typename Exec::stream_type;
  using cache_view = typename Kernel::cache_view;
  static constexpr bool deterministic_capable = VirtualShardedOwnership<Ownership>;

  /// Inputs and outputs of one forward. T = rows of this batch (<= config.max_tokens).
  struct Arguments {
    /// (T, H_local, 576) this rank's query heads (Replicated: (T, H, 576)), any strides
    TensorView<const bfloat16, 3> q;
    /// this rank's paged cache (see mla_cache_view_t in dcpattn/kernels/cache_layout.hpp)
    cache_view cache;
    /// (num_requests, max_pages) LOCAL page ids of each request's shard on this rank
    TensorView<const std::int32_t, 2> block_table;
    /// (T) request of each row
    TensorView<const std::int32_t, 1> row_request;
    /// (T) global causal bound of each row: it attends to positions [0, bound)
    TensorView<const std::int64_t, 1> row_bound;
    /// (T, K) sparse kernels only: global positions each row attends to, -1 = none
    TensorView<const std::int32_t, 2> topk{};
    /// rows >= num_valid_rows are padding (CUDA-graph batches): output 0, nothing read
    int num_valid_rows = 0;
    /// (T, H_local, 512) output of this rank's heads [rank H_local, (rank + 1) H_local)
    TensorView<bfloat16, 3> out;
    /// (T, H_local) merged natural-log LSE, optional (null data handle = not written)
    TensorView<float, 2> out_lse{};
  };

  /// Checks a configuration without building anything. A failure names the offending parameter.
  static Status can_implement(const DcpConfig& c) {
    auto fail = [](std::string m) { return Status::failure(std::move(m)); };
    auto s = [](auto v) { return std::to_string(v); };
    if (c.group_size < 1) return fail("group_size (" + s(c.group_size) + ") must be >= 1");
    if (c.num_heads < 1) return fail("num_heads (" + s(c.num_heads) + ") must be >= 1");
    if (c.num_heads % c.group_size != 0)
      return fail("num_heads (" + s(c.num_heads) + ") is not divisible by the DCP group size (" +
                  s(c.group_size) + ")");
    if (c.head_dim_qk != kMlaQkDim)
      return fail("head_dim_qk (" + s(c.head_dim_qk) + ") must be " + s(kMlaQkDim) +
                  " for MLA (kv_lora_rank 512 + rope 64)");
    if (c.head_dim_v != kMlaVDim)
      return fail("head_dim_v (" + s(c.head_dim_v) + ") must be " + s(kMlaVDim) + " for MLA");
    if (c.interleave < 1) return fail("interleave (" + s(c.interleave) + ") must be >= 1");
    if (c.page_size < 1 || c.page_size % c.interleave != 0)
      return fail("page_size (" + s(c.page_size) + ") must be a positive multiple of interleave (" +
                  s(c.interleave) + ")");
    if (!is_power_of_two(c.virtual_shards))
      return fail("virtual_shards (" + s(c.virtual_shards) + ") must be a power of two");
    if (c.max_tokens < 1) return fail("max_tokens (" + s(c.max_tokens) + ") must be >= 1");
    if (c.gather_capacity < 0)
      return fail("gather_capacity (" + s(c.gather_capacity) + ") must be >= 0");
    if (!(c.softmax_scale > 0.0f) || !std::isfinite(c.softmax_scale))
      return fail("softmax_scale (" + s(c.softmax_scale) + ") must be finite and > 0");
    if (Kernel::is_sparse && c.topk < 1) return fail("topk (" + s(c.topk) + ") must be >= 1");
    if (c.mode == DcpMode::deterministic) {
      if (!deterministic_capable)
        return fail("mode: deterministic mode needs a VirtualShardedOwnership policy");
      if (c.virtual_shards % c.group_size != 0)
        return fail("virtual_shards (" + s(c.virtual_shards) +
                    ") is not divisible by the DCP group size (" + s(c.group_size) +
                    ") in deterministic mode");
      if (c.partial_dtype != PartialDtype::fp32)
        return fail("partial_dtype: deterministic mode exchanges fp32 partials");
    }
    if (c.validate_collectively && !comm_can_agree)
      return fail(
          "validate_collectively: the communicator has no all_reduce_max_int to agree with");
    if (!Combiner::supports(c.mode))
      return fail(
          "mode: the combiner does not support this mode (AllGatherReduceScatter is "
          "fast-mode only)");
    return Status::success();
  }

  /// Bytes of the per-forward workspace forward() needs for this configuration.
  static std::size_t workspace_bytes(const DcpConfig& c) { return layout(c).total; }

  /// Builds the operator for this rank. Throws dcpattn::Error when can_implement fails, when the
  /// communicator's size differs from config.group_size, or the ownership disagrees with it.
  DcpAttention(Comm& comm, const DcpConfig& config, Ownership ownership, Exec exec = {})
      : comm_(&comm), config_(config), own_(ownership), exec_(std::move(exec)) {
    can_implement(config).throw_if_failed("DcpAttention");
    DCPATTN_REQUIRE(comm.size() == config.group_size,
                    "config.group_size (" + std::to_string(config.group_size) +
                        ") differs from the communicator's size (" + std::to_string(comm.size()) +
                        ")");
    DCPATTN_REQUIRE(own_.group_size() == config.group_size,
                    "the ownership policy's group_size (" + std::to_string(own_.group_size()) +
                        ") differs from config.group_size (" + std::to_string(config.group_size) +
                        ")");
    if constexpr (deterministic_capable) {
      if (config.mode == DcpMode::deterministic)
        DCPATTN_REQUIRE(own_.num_virtual_shards() == config.virtual_shards,
                        "the ownership policy's virtual shards differ from config.virtual_shards");
    }
    check_same_config_on_all_ranks();
    persistent_ = Exec::allocate(Gather::persistent_bytes(config));
  }

  /// Builds the operator with Ownership(group_size, interleave, virtual_shards) from the config
  /// (RoundRobinOwnership).
  DcpAttention(Comm& comm, const DcpConfig& config,
               Exec exec = {}) requires std::is_constructible_v<Ownership, int, int, int>
      : DcpAttention(comm, config,
                     Ownership(config.group_size, config.interleave, config.virtual_shards),
                     std::move(exec)) {}

  const DcpConfig& config() const noexcept { return config_; }
  const Ownership& ownership() const noexcept { return own_; }
  int rank() const { return comm_->rank(); }

  /// One decode step. Every rank of the group must call it with the same T and
  /// num_valid_rows. workspace: at least workspace_bytes(config()) bytes in the execution
  /// space's memory, 256-byte aligned. Throws dcpattn::Error on inputs that do not match the
  /// configuration, before any communication.
  ForwardInfo forward(const Arguments& a, cuda::std::span<std::byte> workspace,
                      stream_type stream = {}) {
    if (config_.validate_collectively) {
      check_arguments_collectively(a, workspace);
    } else {
      check_arguments(a, workspace);
    }
    const DcpConfig& c = config_;
    const Layout w = layout(c);
    std::byte* base = workspace.data();
    const std::int64_t t = a.q.extent(0);
    const std::int64_t h = c.num_heads;

    // 1. every rank needs every head's query
    const auto outcome =
        Gather::gather(*comm_, exec_, a.q,
                       cuda::std::span<std::byte>(persistent_.get(), Gather::persistent_bytes(c)),
                       cuda::std::span<std::byte>(base + w.gather, w.gather_bytes), c, stream);

    // 2. attend all H heads over the local shard: one partial state per (row, head)
    float* o_ptr = reinterpret_cast<float*>(base + w.partial_o);
    float* lse_ptr = reinterpret_cast<float*>(base + w.partial_lse);
    auto o = make_view(o_ptr, {t, h, std::int64_t(c.head_dim_v)});
    auto lse = make_view(lse_ptr, {t, h});
    MlaDecodeParams p{};
    p.softmax_scale = c.softmax_scale;
    p.page_size = c.page_size;
    p.interleave = split_interleave(c);
    if constexpr (Kernel::is_sparse)
      p.num_splits = splits_for(c, t, w.attention_bytes, a.topk.extent(1));
    else
      p.num_splits = splits_for(c, t, w.attention_bytes);
    p.num_valid_rows = a.num_valid_rows;
    p.error_flags = reinterpret_cast<std::uint32_t*>(base + w.errors);
    // bf16 partials (fast mode only, checked above): the kernel's split states too.
    p.bf16_split_states = c.partial_dtype == PartialDtype::bf16;
    // Fast mode, sparse: each split scans its run of the top-k list, not all of it.
    p.split_topk_list = Kernel::is_sparse && c.mode == DcpMode::fast;
    exec_.clear_input_errors(p.error_flags, stream);
    const cuda::std::span<std::byte> attention_scratch(base + w.attention, w.attention_bytes);
    // The attention stage sits between two collectives and can throw on data (the host kernels
    // check top-k entries, requests and pages as they read them). In validate_collectively mode a
    // throw on one rank is agreed on before the combine, so every rank raises instead of the
    // others waiting in it.
    std::string attention_error;
    try {
      if constexpr (Kernel::is_sparse) {
        exec_.mla_decode_sparse(outcome.query, a.cache, a.block_table, a.row_request, a.topk,
                                a.row_bound, own_, comm_->rank(), p, o, lse, attention_scratch,
                                stream);
      } else {
        auto* local_len = reinterpret_cast<std::int64_t*>(base + w.row_lengths);
        exec_.row_local_lengths(own_, comm_->rank(), a.row_bound, a.num_valid_rows, local_len,
                                stream);
        exec_.mla_decode_dense(outcome.query, a.cache, a.block_table, a.row_request,
                               make_view(static_cast<const std::int64_t*>(local_len), {t}), p, o,
                               lse, attention_scratch, stream);
      }
    } catch (const Error& e) {
      if (!config_.validate_collectively) throw;
      attention_error = e.message();
    }
    if (config_.validate_collectively)
      agree_on_failure(attention_error, "failed in the attention stage; no rank combined");

    // 3. merge the N partial states of this rank's heads
    CombineArgs ca{};
    ca.o = make_view(static_cast<const float*>(o_ptr), {t, h, std::int64_t(c.head_dim_v)});
    ca.lse = make_view(static_cast<const float*>(lse_ptr), {t, h});
    ca.num_valid_rows = a.num_valid_rows;
    ca.out = a.out;
    ca.out_lse = a.out_lse;
    Combiner::template combine<typename Kernel::lse_base>(
        *comm_, exec_, ca, cuda::std::span<std::byte>(base + w.combine, w.combine_bytes), c,
        stream);
    if (config_.validate_collectively) check_input_errors(workspace, stream);
    return ForwardInfo{outcome.used_fallback, p.num_splits};
  }

  /// Throws dcpattn::Error (naming this rank and the input) when the last forward() that used
  /// `workspace` met data-dependent bad input that its kernels skipped instead of throwing: the
  /// CUDA kernels cannot throw without a host synchronization, so an out-of-range top-k entry
  /// (< -1 or >= its row's bound) is left out of the attention and recorded in the workspace
  /// (the host kernels throw from forward() itself). Reads that record back: synchronizes
  /// `stream`, so call it where the engine synchronizes anyway, outside graph capture (forward()
  /// calls it itself when config.validate_collectively is set). The outputs of such a step
  /// exclude the bad entries and nothing outside the tensors was read or written.
  void check_input_errors(cuda::std::span<const std::byte> workspace,
                          stream_type stream = {}) const {
    const Layout w = layout(config_);
    DCPATTN_REQUIRE(workspace.size() >= w.total,
                    "workspace has " + std::to_string(workspace.size()) + " bytes, " +
                        std::to_string(w.total) + " needed (workspace_bytes)");
    const std::uint32_t flags = exec_.read_input_errors(
        reinterpret_cast<const std::uint32_t*>(workspace.data() + w.errors), stream);
    if (flags != 0)
      throw Error(describe_input_errors(flags), "DcpAttention::check_input_errors", __FILE__,
                  __LINE__, comm_->rank());
  }

  /// Whether Exec chooses the split count of fast mode itself (CudaExecution does; see
  /// docs/policies.md): `static int fast_mode_splits(const DcpConfig&, std::int64_t tokens)` and
  /// `static std::size_t fast_mode_scratch_bytes(const DcpConfig&)`, an upper bound of
  /// attention_scratch_bytes over every batch of up to max_tokens rows at those split counts.
  /// fast_mode_splits may also take a third argument, `std::int64_t attended`: the most tokens a
  /// row attends as the host knows it, the top-k list's width for a sparse kernel and -1
  /// (unknown) for a dense one (exec_splits_take_attended; CudaExecution's does).
  static constexpr bool exec_splits_take_attended =
      requires(const DcpConfig& c, std::int64_t tokens) {
    { Exec::fast_mode_splits(c, tokens, tokens) } -> std::convertible_to<int>;
  };
  static constexpr bool exec_picks_fast_splits =
      (exec_splits_take_attended ||
       requires(const DcpConfig& c, std::int64_t tokens) {
         { Exec::fast_mode_splits(c, tokens) } -> std::convertible_to<int>;
       }) &&
      requires(const DcpConfig& c) {
    { Exec::fast_mode_scratch_bytes(c) } -> std::convertible_to<std::size_t>;
  };

  /// Local splits of a forward of `tokens` rows whose workspace has `attention_bytes` of
  /// attention scratch; `attended` as in exec_splits_take_attended. Deterministic mode: V / N
  /// (part of the numerical contract). Fast mode: Exec's choice when it makes one (the CUDA
  /// kernels: the most splits that run in one wave, none under 128 of the `attended` tokens),
  /// halved until its split states fit `attention_bytes`; else as deterministic mode when N
  /// divides V, 1 otherwise.
  static int splits_for(const DcpConfig& c, std::int64_t tokens, std::size_t attention_bytes,
                        std::int64_t attended = -1) {
    if constexpr (exec_picks_fast_splits) {
      if (c.mode == DcpMode::fast) {
        int s = 1;
        if constexpr (exec_splits_take_attended)
          s = int(Exec::fast_mode_splits(c, tokens, attended));
        else
          s = int(Exec::fast_mode_splits(c, tokens));
        if (s < 1) s = 1;
        DcpConfig batch = c;
        batch.max_tokens = int(tokens);
        while (s > 1 && Exec::attention_scratch_bytes(batch, s) > attention_bytes) s /= 2;
        return s;
      }
    }
    return num_splits(c);
  }

  /// Local tokens per split block of the dense kernel (MlaDecodeParams::interleave). Deterministic
  /// mode: the ownership's interleave, so that local split j is virtual shard j N + r (part of
  /// the numerical contract). Fast mode: a whole page, so a split reads whole pages; with pages of
  /// a multiple of 64 tokens the CUDA kernel of 64 heads then copies whole tiles with the tensor
  /// memory accelerator (on the H200, 128 heads: 1 x 128K 127 -> 111-113 us, 8 x 128K 788 ->
  /// 650-656 us; docs/performance.md, run 13). Sparse: always the ownership's interleave (the
  /// kernel maps each top-k position to its split through the ownership).
  static int split_interleave(const DcpConfig& c) noexcept {
    if constexpr (Kernel::is_sparse) return c.interleave;
    return c.mode == DcpMode::fast ? c.page_size : c.interleave;  // c is validated: page_size >= 1
  }

  /// Local splits per rank: V / N (the virtual shards this rank owns) when N divides V, else 1
  /// (fast mode only). In fast mode the execution space may choose per batch (splits_for).
  int num_splits() const noexcept { return num_splits(config_); }
  static int num_splits(const DcpConfig& c) noexcept {
    return c.group_size > 0 && c.virtual_shards % c.group_size == 0
               ? c.virtual_shards / c.group_size
               : 1;
  }

 private:
  struct Layout {
    std::size_t gather, gather_bytes, partial_o, partial_lse, row_lengths, attention,
        attention_bytes, combine, combine_bytes, errors, total;
  };
  static Layout layout(const DcpConfig& c) {
    auto align = [](std::size_t x) { return (x + 255) / 256 * 256; };
    const std::size_t t = std::size_t(c.max_tokens > 0 ? c.max_tokens : 0);
    const std::size_t h = std::size_t(c.num_heads > 0 ? c.num_heads : 0);
    Layout l{};
    std::size_t at = 0;
    l.gather = at;
    l.gather_bytes = c.group_size > 0 ? Gather::scratch_bytes(c) : 0;
    at += align(l.gather_bytes);
    l.partial_o = at;
    at += align(t * h * std::size_t(c.head_dim_v) * sizeof(float));
    l.partial_lse = at;
    at += align(t * h * sizeof(float));
    l.row_lengths = at;
    at += align(t * sizeof(std::int64_t));
    l.attention = at;
    l.attention_bytes = 0;
    if (c.group_size > 0) {
      l.attention_bytes = Exec::attention_scratch_bytes(c, num_splits(c));
      if constexpr (exec_picks_fast_splits) {
        if (c.mode == DcpMode::fast) l.attention_bytes = Exec::fast_mode_scratch_bytes(c);
      }
    }
    at += align(l.attention_bytes);
    l.combine = at;
    l.combine_bytes = c.group_size > 0 ? Combiner::scratch_bytes(c) : 0;
    at += align(l.combine_bytes);
    l.errors = at;  // one std::uint32_t: MlaDecodeParams::error_flags of the last forward
    at += align(sizeof(std::uint32_t));
    l.total = at;
    return l;
  }

  static constexpr bool comm_can_agree = requires(Comm & c) {
    { c.all_reduce_max_int(0) } -> std::convertible_to<int>;
  };

  /// Refuses, on every rank, a configuration that differs between ranks (a deployment error that
  /// would otherwise deadlock or corrupt the exchange). One pair of small collectives compares a
  /// hash; only on a mismatch are fields compared one by one, to name the first that differs.
  void check_same_config_on_all_ranks() {
    if constexpr (comm_can_agree) {
      const DcpConfig& c = config_;
      std::uint32_t bits = 0;
      std::memcpy(&bits, &c.softmax_scale, sizeof bits);
      const std::pair<const char*, long long> fields[] = {
          {"group_size", c.group_size},
          {"num_heads", c.num_heads},
          {"head_dim_qk", c.head_dim_qk},
          {"head_dim_v", c.head_dim_v},
          {"page_size", c.page_size},
          {"interleave", c.interleave},
          {"virtual_shards", c.virtual_shards},
          {"max_tokens", c.max_tokens},
          {"gather_capacity", c.gather_capacity},
          {"topk", c.topk},
          {"softmax_scale", (long long)bits},
          {"mode", (long long)c.mode},
          {"partial_dtype", (long long)c.partial_dtype},
          {"validate_collectively", (long long)c.validate_collectively}};
      auto agree = [&](int v) {  // true on every rank iff v is the same on every rank
        const int hi = comm_->all_reduce_max_int(v);
        const int lo = -comm_->all_reduce_max_int(-v);
        return hi == v && lo == v;
      };
      std::uint32_t h = 2166136261u;
      for (const auto& f : fields) h = (h ^ std::uint32_t(f.second)) * 16777619u;
      if (agree(int(h & 0x3fffffffu))) return;
      for (const auto& f : fields)
        if (!agree(int(f.second & 0x3fffffff)))
          throw Error(std::string("config.") + f.first + " (" + std::to_string(f.second) +
                          " on this rank) differs across the DCP group; every rank must use the "
                          "same configuration",
                      "DcpAttention");
      throw Error("the configuration differs across the DCP group", "DcpAttention");
    }
  }

  /// check_arguments, agreed across the group: if any rank refuses its inputs, every rank throws
  /// an Error naming the lowest such rank (and its message, on that rank).
  void check_arguments_collectively(const Arguments& a, cuda::std::span<std::byte> workspace) {
    std::string mine;
    try {
      check_arguments(a, workspace);
    } catch (const Error& e) {
      mine = e.message();
    }
    agree_on_failure(mine, "refused its inputs; no rank communicated");
  }

  /// One small collective: when any rank's `mine` is non-empty (its failure), every rank throws
  /// an Error: the failing rank with its own message, the others naming the lowest failing rank
  /// and `what` ("rank 2 of the DCP group <what>").
  void agree_on_failure(const std::string& mine, const char* what) {
    if constexpr (!comm_can_agree) {
      if (!mine.empty()) throw Error(mine, "DcpAttention::forward");  // unreachable, see
      return;                                                         // can_implement
    } else {
      const int me = comm_->rank();
      const int n = comm_->size();
      // the lowest failing rank r reports as n - r, so max() picks it; 0 = everyone succeeded
      const int worst = comm_->all_reduce_max_int(mine.empty() ? 0 : n - me);
      if (worst == 0) return;
      const int culprit = n - worst;
      throw Error(
          culprit == me ? mine : "rank " + std::to_string(culprit) + " of the DCP group " + what,
          "DcpAttention::forward");
    }
  }

  void check_arguments(const Arguments& a, cuda::std::span<std::byte> workspace) const {
    const DcpConfig& c = config_;
    const std::int64_t t = a.q.extent(0);
    const std::int64_t hl = c.num_heads / c.group_size;
    auto s = [](auto v) { return std::to_string(v); };
    DCPATTN_REQUIRE(t <= c.max_tokens, "q has " + s(t) + " rows, more than config.max_tokens (" +
                                           s(c.max_tokens) + ")");
    DCPATTN_REQUIRE(a.q.extent(1) == Gather::query_heads(c) && a.q.extent(2) == c.head_dim_qk,
                    "q must be (T, " + s(Gather::query_heads(c)) + ", " + s(c.head_dim_qk) +
                        "), got (" + s(a.q.extent(0)) + ", " + s(a.q.extent(1)) + ", " +
                        s(a.q.extent(2)) + ")");
    DCPATTN_REQUIRE(
        a.num_valid_rows >= 0 && a.num_valid_rows <= t,
        "num_valid_rows (" + s(a.num_valid_rows) + ") must be in [0, T = " + s(t) + "]");
    DCPATTN_REQUIRE(a.row_request.extent(0) == t,
                    "row_request has " + s(a.row_request.extent(0)) + " rows, q has " + s(t));
    DCPATTN_REQUIRE(a.row_bound.extent(0) == t,
                    "row_bound has " + s(a.row_bound.extent(0)) + " rows, q has " + s(t));
    DCPATTN_REQUIRE(
        a.out.extent(0) == t && a.out.extent(1) == hl && a.out.extent(2) == c.head_dim_v,
        "out must be (T, " + s(hl) + ", " + s(c.head_dim_v) + ")");
    DCPATTN_REQUIRE(a.out_lse.data_handle() == nullptr ||
                        (a.out_lse.extent(0) == t && a.out_lse.extent(1) == hl),
                    "out_lse must be (T, " + s(hl) + ") or empty");
    if constexpr (Kernel::is_sparse)
      DCPATTN_REQUIRE(a.topk.extent(0) == t && a.topk.extent(1) >= 1,
                      "topk must be (T, K) with K >= 1 for a sparse kernel");
    DCPATTN_REQUIRE(workspace.size() >= workspace_bytes(c),
                    "workspace has " + s(workspace.size()) + " bytes, workspace_bytes(config) is " +
                        s(workspace_bytes(c)));
  }

  Comm* comm_;
  DcpConfig config_;
  Ownership own_;
  Exec exec_;
  typename Exec::buffer_type persistent_;
};

DCPATTN_NAMESPACE_END
