// SPDX-License-Identifier: Apache-2.0
// The frame of the benchmarks that run one MPI process per GPU over NCCL (bench_comm, bench_step):
// MPI start and end, one GPU per rank, the communicator, a stream, errors named by rank.
#pragma once

#include <cstdio>
#include <exception>

#include <cuda_runtime.h>
#include <mpi.h>

#include "dcpattn/comm/nccl.cuh"
#include "dcpattn/error.hpp"

namespace dcpattn::bench {

/// Maximum over the ranks of MPI_COMM_WORLD of a per-rank value (a time: a step ends when the
/// slowest rank ends).
inline double max_over_ranks(double v) {
  double m = v;
  MPI_Allreduce(&v, &m, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return m;
}

/// Runs body(comm, stream) on every rank of MPI_COMM_WORLD: rank r on GPU r, `comm` an
/// NcclCommunicator over all ranks, `stream` a non-blocking stream. `accepts(size)` says whether
/// the benchmark runs at that many ranks; where it does not, or where there are fewer GPUs than
/// ranks, rank 0 prints why (`requirement`) and nothing is measured. Returns main's exit status:
/// 1 when the body throws on this rank (the message names the benchmark and the rank), else 0.
template <class Accepts, class Body>
int run_per_gpu(int argc, char** argv, const char* name, const char* requirement, Accepts&& accepts,
                Body&& body) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1, devices = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  int rc = 0;
  try {
    if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;  // no driver or no GPU
    if (devices < size || !accepts(size)) {
      if (rank == 0) std::printf("%s: %d ranks on %d GPUs; %s\n", name, size, devices, requirement);
    } else {
      DCPATTN_CUDA_CHECK(cudaSetDevice(rank));
      NcclCommunicator comm = NcclCommunicator::init(MPI_COMM_WORLD);
      cudaStream_t stream = nullptr;
      DCPATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      try {
        body(comm, stream);
      } catch (...) {
        cudaStreamDestroy(stream);
        throw;
      }
      cudaStreamDestroy(stream);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s [rank %d]: %s\n", name, rank, e.what());
    rc = 1;
  }
  MPI_Finalize();
  return rc;
}

}  // namespace dcpattn::bench
