// SPDX-License-Identifier: Apache-2.0
// What a test needs to know about the MPI job it runs in.
#pragma once

#include <mpi.h>

namespace dcpattn::test {

/// Rank of this process in MPI_COMM_WORLD.
inline int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

/// Number of processes in MPI_COMM_WORLD.
inline int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

/// True on every rank when `ok` holds on every rank. Use it where a property is checked on one
/// rank's data but must be reported identically everywhere (so all ranks take the same branches).
inline bool all_ranks(bool ok) {
  int v = ok ? 1 : 0, all = 0;
  MPI_Allreduce(&v, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return all == 1;
}

}  // namespace dcpattn::test
