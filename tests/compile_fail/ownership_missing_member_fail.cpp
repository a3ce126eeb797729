// SPDX-License-Identifier: Apache-2.0
// A SlotOwnership model without local_length() must be rejected where it is consumed, with
// dcpattn's message. With DCPATTN_COMPILE_FAIL_CONTROL the member exists and the file compiles.
#include <cstdint>

#include "dcpattn/ownership/slot_ownership.hpp"

struct HalfOwnership {
  int group_size() const { return 2; }
  int owner(std::int64_t t) const { return int(t % 2); }
  std::int64_t local_position(std::int64_t t) const { return t / 2; }
  std::int64_t global_position(std::int64_t p, int r) const { return 2 * p + r; }
#if DCPATTN_COMPILE_FAIL_CONTROL
  std::int64_t local_length(std::int64_t len, int r) const { return (len + 1 - r) / 2; }
#endif
};

int main() {
  const int block_table[4] = {3, 1, 2, 0};
  return int(dcpattn::paged_slot(HalfOwnership{}, 5, 1, block_table, 64) < 0);
}
