// SPDX-License-Identifier: Apache-2.0
// Ownership math under random N, I, V, page size and lengths: either the configuration is refused
// with a message, or every invariant of docs/semantics.md holds.
#include <cstdint>
#include <vector>

#include "dcpattn/ownership/round_robin.hpp"
#include "fuzz_input.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  dcpattn::fuzz::Input in(data, size);
  const int n = int(in.range(-1, 16));
  const int interleave = int(in.range(-1, 130));
  const int v = int(in.range(0, 40));
  const std::int64_t len = in.range(0, 3000);
  const dcpattn::RoundRobinOwnership own(n, interleave, v);
  if (*own.validate() != '\0') return 0;  // refused with a message: nothing else to check
  DCPATTN_FUZZ_CHECK(n >= 1 && interleave >= 1);

  std::vector<std::int64_t> count(std::size_t(n), 0);
  for (std::int64_t t = 0; t < len; ++t) {
    const int r = own.owner(t);
    DCPATTN_FUZZ_CHECK(r >= 0 && r < n);
    DCPATTN_FUZZ_CHECK(own.local_position(t) == count[std::size_t(r)]);  // dense, ascending
    DCPATTN_FUZZ_CHECK(own.global_position(own.local_position(t), r) == t);
    ++count[std::size_t(r)];
  }
  std::int64_t total = 0;
  for (int r = 0; r < n; ++r) {
    DCPATTN_FUZZ_CHECK(own.local_length(len, r) == count[std::size_t(r)]);
    total += own.local_length(len, r);
  }
  DCPATTN_FUZZ_CHECK(total == len);

  // paged slots: a page size that is a multiple of I, a block table that maps page p to 2p + 1
  const int page = interleave * int(in.range(1, 4));
  const std::int64_t t = len > 0 ? in.range(0, len - 1) : 0;
  std::vector<std::int32_t> table(std::size_t(len / page + 2));
  for (std::size_t p = 0; p < table.size(); ++p) table[p] = std::int32_t(2 * p + 1);
  for (int r = 0; r < n && len > 0; ++r) {
    const std::int64_t slot = dcpattn::paged_slot(own, t, r, table.data(), page);
    if (own.owner(t) != r) {
      DCPATTN_FUZZ_CHECK(slot == -1);
    } else {
      const std::int64_t p = own.local_position(t);
      DCPATTN_FUZZ_CHECK(slot == (2 * (p / page) + 1) * page + p % page);
    }
  }

  // virtual shards, when usable
  if (*own.validate_virtual_shards() == '\0') {
    const int vs = own.num_virtual_shards();
    std::vector<std::int64_t> k_of(std::size_t(vs), 0);
    for (std::int64_t u = 0; u < len; ++u) {
      const int s = own.virtual_shard(u);
      DCPATTN_FUZZ_CHECK(s >= 0 && s < vs && s % n == own.owner(u));
      const std::int64_t k = k_of[std::size_t(s)]++;
      DCPATTN_FUZZ_CHECK(own.shard_global_position(k, s) == u);
      DCPATTN_FUZZ_CHECK(own.shard_local_position(k, s) == own.local_position(u));
    }
    for (int s = 0; s < vs; ++s) DCPATTN_FUZZ_CHECK(own.shard_length(len, s) == k_of[std::size_t(s)]);
  }
  return 0;
}
