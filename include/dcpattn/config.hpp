// SPDX-License-Identifier: Apache-2.0
// Library-wide macros: host/device qualifiers, the versioned namespace, and the version number.
#pragma once

#define DCPATTN_VERSION_MAJOR 0
#define DCPATTN_VERSION_MINOR 1
#define DCPATTN_VERSION_PATCH 0
#define DCPATTN_VERSION \
  (DCPATTN_VERSION_MAJOR * 10000 + DCPATTN_VERSION_MINOR * 100 + DCPATTN_VERSION_PATCH)

// Every public name lives in dcpattn::v0_1 (inline), so two incompatible releases linked into one
// program cannot silently mix definitions.
#define DCPATTN_NAMESPACE_BEGIN \
  namespace dcpattn {           \
  inline namespace v0_1 {
#define DCPATTN_NAMESPACE_END \
  }                           \
  }

// DCPATTN_HOST_DEVICE marks the small math shared by the host reference path and the CUDA kernels.
// Under nvcc it is __host__ __device__ __forceinline__; a plain host compiler (g++, clang++, mpicxx)
// sees `inline`, so host-only consumers include the same headers without the CUDA language.
#if defined(__CUDACC__) || defined(__CUDA_ARCH__)
#define DCPATTN_HOST_DEVICE __host__ __device__ __forceinline__
#define DCPATTN_DEVICE __device__ __forceinline__
#define DCPATTN_IS_CUDA_COMPILER 1
#else
#define DCPATTN_HOST_DEVICE inline
#define DCPATTN_IS_CUDA_COMPILER 0
#endif

#if defined(__CUDA_ARCH__)
#define DCPATTN_IN_DEVICE_CODE 1
#else
#define DCPATTN_IN_DEVICE_CODE 0
#endif
