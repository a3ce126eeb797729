// SPDX-License-Identifier: Apache-2.0
// Properties of the current CUDA device that the kernels' launchers and the executor read.
#pragma once

#include <cuda_runtime.h>

#include "dcpattn/config.hpp"
#include "dcpattn/error.hpp"

DCPATTN_NAMESPACE_BEGIN

namespace cuda_kernels::detail {

/// The current device's number of multiprocessors.
inline int device_sm_count() {
  int device = 0, count = 0;
  DCPATTN_CUDA_CHECK(cudaGetDevice(&device));
  DCPATTN_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

/// The current device's compute capability major number.
inline int device_cc_major() {
  int device = 0, major = 0;
  DCPATTN_CUDA_CHECK(cudaGetDevice(&device));
  DCPATTN_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  return major;
}

}  // namespace cuda_kernels::detail

DCPATTN_NAMESPACE_END
