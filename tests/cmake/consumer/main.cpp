// SPDX-License-Identifier: Apache-2.0
// Uses a little of everything a host-only consumer sees; exits non-zero on a wrong answer.
#include <cmath>
#include <cstdio>

#include "dcpattn/dcpattn.hpp"

int main() {
  const dcpattn::RoundRobinOwnership own(/*group_size=*/2, /*interleave=*/1);
  // The spec-decode example of docs/semantics.md: rank 1 of 2 holds 4, 4, 5 tokens of 8, 9, 10.
  const bool lengths_ok =
      own.local_length(8, 1) == 4 && own.local_length(9, 1) == 4 && own.local_length(10, 1) == 5;
  const auto w = dcpattn::merge_lse(0.0f, 0.0f);
  const bool merge_ok = std::fabs(w.lse - std::log(2.0f)) < 1e-6f && w.w_a == w.w_b;
  std::printf("dcpattn %d consumer: lengths %s, merge %s\n", DCPATTN_VERSION,
              lengths_ok ? "ok" : "WRONG", merge_ok ? "ok" : "WRONG");
  return lengths_ok && merge_ok ? 0 : 1;
}
