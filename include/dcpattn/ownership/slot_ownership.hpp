// SPDX-License-Identifier: Apache-2.0
// The SlotOwnership concept: which rank of a DCP group stores the KV entry of each token, and where.
#pragma once

#include <concepts>
#include <cstdint>
#include <type_traits>

#include "dcpattn/config.hpp"

DCPATTN_NAMESPACE_BEGIN

/// Requirements on a SlotOwnership model O, for a group of N = o.group_size() ranks. Tokens are
/// 0-based positions t in their request; a rank stores its tokens densely at local positions
/// 0, 1, 2, ... in ascending t.
///   - o.group_size()             -> int      N >= 1
///   - o.owner(t)                 -> int      rank in [0, N) that stores token t
///   - o.local_position(t)        -> int64_t  position of t among the tokens of owner(t)
///   - o.global_position(p, r)    -> int64_t  inverse: the token at local position p of rank r
///   - o.local_length(L, r)       -> int64_t  how many of the tokens [0, L) rank r stores
/// Models must be trivially copyable (they are passed to kernels by value).
template <class O>
concept SlotOwnership =
    std::is_trivially_copyable_v<O> &&
    requires(const O& o, std::int64_t t, std::int64_t p, std::int64_t len, int r) {
      { o.group_size() } -> std::convertible_to<int>;
      { o.owner(t) } -> std::convertible_to<int>;
      { o.local_position(t) } -> std::convertible_to<std::int64_t>;
      { o.global_position(p, r) } -> std::convertible_to<std::int64_t>;
      { o.local_length(len, r) } -> std::convertible_to<std::int64_t>;
    };

/// A SlotOwnership that also partitions tokens into V virtual shards (V a power of two that N
/// divides) with owner(t) = shard(t) mod N. Deterministic mode needs it: a rank computes one
/// partial state per virtual shard it owns, and the shards, unlike the ranks, do not depend on N.
///   - o.num_virtual_shards()            -> int      V
///   - o.virtual_shard(t)                -> int      shard of token t
///   - o.shard_length(L, v)              -> int64_t  tokens of [0, L) in shard v
///   - o.shard_local_position(k, v)      -> int64_t  local position on owner(v) of the k-th token
///                                                   (ascending t) of shard v
template <class O>
concept VirtualShardedOwnership =
    SlotOwnership<O> && requires(const O& o, std::int64_t t, std::int64_t k, std::int64_t len, int v) {
      { o.num_virtual_shards() } -> std::convertible_to<int>;
      { o.virtual_shard(t) } -> std::convertible_to<int>;
      { o.shard_length(len, v) } -> std::convertible_to<std::int64_t>;
      { o.shard_local_position(k, v) } -> std::convertible_to<std::int64_t>;
    };

/// The message every consumer of an ownership policy gives when the policy does not conform.
#define DCPATTN_SLOT_OWNERSHIP_MESSAGE                                                     \
  "dcpattn: the ownership policy does not satisfy SlotOwnership: it must be trivially "     \
  "copyable and provide group_size(), owner(t), local_position(t), global_position(p, r) " \
  "and local_length(L, r) (see dcpattn/ownership/slot_ownership.hpp)"

/// Where the KV entry of token t lives on `rank`: the slot page * page_size + p mod page_size of
/// its paged cache, with p = local_position(t) and page = block_table[p / page_size]; -1 when
/// another rank owns t (writers skip negative slots). `block_table` is the request's row of page
/// ids; it must cover the owner's local length.
template <class O, class BlockTable>
constexpr DCPATTN_HOST_DEVICE std::int64_t paged_slot(const O& o, std::int64_t t, int rank,
                                                      const BlockTable& block_table,
                                                      std::int64_t page_size) noexcept {
  static_assert(SlotOwnership<O>, DCPATTN_SLOT_OWNERSHIP_MESSAGE);
  if (o.owner(t) != rank) return -1;
  const std::int64_t p = o.local_position(t);
  return std::int64_t(block_table[p / page_size]) * page_size + p % page_size;
}

DCPATTN_NAMESPACE_END
