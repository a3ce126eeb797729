// SPDX-License-Identifier: Apache-2.0
// The Catch2 main of every dcpattn test executable: MPI_Init, one Catch session per rank with the
// test cases in declaration order (so collectives inside tests pair up across ranks), and an
// MPI_Allreduce so the process exit code reports a failure on any rank.
#include <cstdio>

#include <mpi.h>

#if DCPATTN_CATCH2_V3
#include <catch2/catch_session.hpp>
#else
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#endif

#include "dcpattn/error.hpp"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  dcpattn::set_error_rank(rank);

  int failed = 0;
  {
    Catch::Session session;
    int rc = session.applyCommandLine(argc, argv);
    if (rc == 0) {
      // Every rank must run the same cases in the same order, or collectives deadlock.
#if DCPATTN_CATCH2_V3
      session.configData().runOrder = Catch::TestRunOrder::Declared;
#else
      session.configData().runOrder = Catch::RunTests::InDeclarationOrder;
#endif
      rc = session.run();
    }
    failed = rc != 0 ? 1 : 0;
  }

  int any_failed = 0;
  MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (any_failed && rank == 0) std::fprintf(stderr, "dcpattn tests: failure on at least one of %d rank(s)\n", size);
  MPI_Finalize();
  return any_failed ? 1 : 0;
}
