// SPDX-License-Identifier: Apache-2.0
// Prints which rank stores each token under round-robin DCP ownership, the local lengths, and one
// LSE merge of two partial states.
//   usage: ownership_table [N=4] [I=2] [L=19]
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "dcpattn/dcpattn.hpp"

int main(int argc, char** argv) {
  const int n = argc > 1 ? std::atoi(argv[1]) : 4;
  const int interleave = argc > 2 ? std::atoi(argv[2]) : 2;
  const long long len = argc > 3 ? std::atoll(argv[3]) : 19;
  const dcpattn::RoundRobinOwnership own(n, interleave);
  if (const char* err = own.validate(); *err) {
    std::fprintf(stderr, "bad configuration: %s\n", err);
    return 2;
  }

  std::printf("round-robin ownership, N = %d, I = %d, L = %lld\n\n token:", n, interleave, len);
  for (long long t = 0; t < len; ++t) std::printf("%3lld", t);
  std::printf("\n owner:");
  for (long long t = 0; t < len; ++t) std::printf("%3d", own.owner(t));
  std::printf("\n local:");
  for (long long t = 0; t < len; ++t) std::printf("%3lld", (long long)own.local_position(t));
  std::printf("\n\n");
  for (int r = 0; r < n; ++r) {
    std::printf(" rank %d holds %lld tokens:", r, (long long)own.local_length(len, r));
    for (long long p = 0; p < own.local_length(len, r); ++p)
      std::printf(" %lld", (long long)own.global_position(p, r));
    std::printf("\n");
  }

  // Two partial states of one head over disjoint key sets, merged by their natural-log LSE.
  float o_a[2] = {1.0f, 0.0f}, o_b[2] = {0.0f, 1.0f};
  float lse_a = std::log(3.0f), lse_b = std::log(1.0f);
  dcpattn::merge_state_into(o_a, lse_a, o_b, lse_b, 2);
  std::printf("\nmerge: (o=[1,0], lse=ln 3) + (o=[0,1], lse=ln 1) = (o=[%.4f,%.4f], lse=%.4f = ln %.1f)\n",
              o_a[0], o_a[1], lse_a, std::exp(lse_a));
  float o_e[2] = {0.0f, 0.0f}, lse_e = dcpattn::lse_neg_inf;
  float garbage[2] = {NAN, INFINITY};
  dcpattn::merge_state_into(o_e, lse_e, garbage, dcpattn::sanitize_lse(INFINITY), 2);
  std::printf("merge of two empty states (one with lse=+inf, o=[nan,inf]): o=[%g,%g], lse=%g\n",
              o_e[0], o_e[1], lse_e);
  return 0;
}
