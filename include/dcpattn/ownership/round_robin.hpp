// SPDX-License-Identifier: Apache-2.0
// Round-robin token ownership with interleave I: tokens go to ranks I at a time, cycling.
#pragma once

#include <cstdint>

#include "dcpattn/config.hpp"
#include "dcpattn/ownership/slot_ownership.hpp"

DCPATTN_NAMESPACE_BEGIN

/// Round-robin ownership over N ranks with interleave I (tokens per rank before moving on), the
/// layout of vLLM/SGLang DCP. With V virtual shards (a power of two, a multiple of N; default 8):
///   owner(t)            = (t / I) mod N
///   local_position(t)   = (t / (N I)) I + t mod I
///   local_length(L, r)  = (L / (N I)) I + clamp(L mod (N I) - r I, 0, I)
///   virtual_shard(t)    = (t / I) mod V,  so owner(t) = virtual_shard(t) mod N
/// Example, N = 4, I = 2: tokens 0 1 -> rank 0, 2 3 -> rank 1, ..., 8 9 -> rank 0 (local 2, 3).
/// Construction does not validate; call validate() (the operator does) before trusting a
/// configuration from outside.
class RoundRobinOwnership {
 public:
  constexpr RoundRobinOwnership() = default;
  /// @param group_size N >= 1
  /// @param interleave I >= 1
  /// @param virtual_shards V [optional] (default: 8, raised to N when N is larger)
  constexpr RoundRobinOwnership(int group_size, int interleave, int virtual_shards = 8) noexcept
      : n_(group_size),
        i_(interleave),
        v_(virtual_shards < group_size ? group_size : virtual_shards) {}

  constexpr DCPATTN_HOST_DEVICE int group_size() const noexcept { return n_; }
  constexpr DCPATTN_HOST_DEVICE int interleave() const noexcept { return i_; }
  constexpr DCPATTN_HOST_DEVICE int num_virtual_shards() const noexcept { return v_; }

  // owner and local_position divide in 32 bits where every operand fits (the same values): on a
  // GPU a 64-bit division is a long subroutine, and the sparse kernels call these for every top-k
  // entry they scan.
  constexpr DCPATTN_HOST_DEVICE int owner(std::int64_t t) const noexcept {
    if (t >= 0 && t <= kMax32)
      return int((std::uint32_t(t) / std::uint32_t(i_)) % std::uint32_t(n_));
    return int((t / i_) % n_);
  }
  constexpr DCPATTN_HOST_DEVICE std::int64_t local_position(std::int64_t t) const noexcept {
    const std::int64_t span = std::int64_t(n_) * i_;
    if (t >= 0 && t <= kMax32) {
      const std::uint32_t u = std::uint32_t(t), i = std::uint32_t(i_);
      const std::uint32_t blocks = span > kMax32 ? 0u : u / std::uint32_t(span);  // t < span
      return std::int64_t(blocks * i + u % i);
    }
    return (t / span) * i_ + t % i_;
  }
  constexpr DCPATTN_HOST_DEVICE std::int64_t global_position(std::int64_t p,
                                                             int rank) const noexcept {
    return ((p / i_) * n_ + rank) * i_ + p % i_;
  }
  constexpr DCPATTN_HOST_DEVICE std::int64_t local_length(std::int64_t len,
                                                          int rank) const noexcept {
    return group_local_length(len, rank, n_);
  }

  constexpr DCPATTN_HOST_DEVICE int virtual_shard(std::int64_t t) const noexcept {
    return int((t / i_) % v_);
  }
  /// Tokens of [0, len) in virtual shard v: the local length of "rank" v in a group of V.
  constexpr DCPATTN_HOST_DEVICE std::int64_t shard_length(std::int64_t len, int v) const noexcept {
    return group_local_length(len, v, v_);
  }
  /// Local position on owner(v) = v mod N of the k-th token of shard v. Shard v = j N + r holds
  /// the local blocks of rank r whose index is j modulo V / N.
  constexpr DCPATTN_HOST_DEVICE std::int64_t shard_local_position(std::int64_t k,
                                                                  int v) const noexcept {
    const std::int64_t j = v / n_;
    const std::int64_t local_block = (k / i_) * (v_ / n_) + j;
    return local_block * i_ + k % i_;
  }
  /// Global position of the k-th token of shard v.
  constexpr DCPATTN_HOST_DEVICE std::int64_t shard_global_position(std::int64_t k,
                                                                   int v) const noexcept {
    return ((k / i_) * v_ + v) * i_ + k % i_;
  }

  /// Empty when N and I are usable, else a message naming the offending parameter.
  /// (A C string, so the check stays usable in constant expressions.)
  constexpr const char* validate() const noexcept {
    if (n_ < 1) return "group_size must be >= 1";
    if (i_ < 1) return "interleave must be >= 1";
    return "";
  }
  /// Empty when the virtual shards are usable (deterministic mode needs them), else a message.
  constexpr const char* validate_virtual_shards() const noexcept {
    if (n_ < 1) return "group_size must be >= 1";  // checked first: V mod N needs N >= 1
    if (v_ < 1 || (v_ & (v_ - 1)) != 0) return "virtual_shards must be a power of two";
    if (v_ % n_ != 0) return "group_size must divide virtual_shards";
    return "";
  }

  friend constexpr bool operator==(const RoundRobinOwnership&,
                                   const RoundRobinOwnership&) = default;

 private:
  static constexpr std::int64_t kMax32 = 0x7fffffff;  // operands below this divide in 32 bits

  constexpr DCPATTN_HOST_DEVICE std::int64_t group_local_length(std::int64_t len, int r,
                                                                int n) const noexcept {
    const std::int64_t span = std::int64_t(n) * i_;
    const std::int64_t tail = len % span - std::int64_t(r) * i_;
    const std::int64_t clamped = tail < 0 ? 0 : (tail > i_ ? i_ : tail);
    return (len / span) * i_ + clamped;
  }

  int n_ = 1;
  int i_ = 1;
  int v_ = 8;
};

static_assert(SlotOwnership<RoundRobinOwnership>,
              "dcpattn: RoundRobinOwnership must satisfy SlotOwnership");
static_assert(VirtualShardedOwnership<RoundRobinOwnership>,
              "dcpattn: RoundRobinOwnership must satisfy VirtualShardedOwnership");

DCPATTN_NAMESPACE_END
