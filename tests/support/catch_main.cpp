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

#if DCPATTN_TEST_CUDA
#include <cuda_runtime_api.h>

namespace {
/// Binds this rank to GPU (node-local rank mod device count). Returns false on every rank when
/// any rank sees no usable GPU, so all ranks skip together.
bool bind_gpu(int rank) {
  int count = 0;
  const bool have = cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
  int all_have = 0, mine = have ? 1 : 0;
  MPI_Allreduce(&mine, &all_have, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!all_have) return false;
  MPI_Comm node;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
  int local = 0;
  MPI_Comm_rank(node, &local);
  MPI_Comm_free(&node);
  return cudaSetDevice(local % count) == cudaSuccess;
}
}  // namespace
#endif

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  dcpattn::set_error_rank(rank);

#if DCPATTN_TEST_CUDA
  if (!bind_gpu(rank)) {
    if (rank == 0) std::printf("dcpattn GPU tests: no CUDA device, skipped\n");
    MPI_Finalize();
    return 77;  // ctest SKIP_RETURN_CODE
  }
#endif

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
