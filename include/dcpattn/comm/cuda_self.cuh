// SPDX-License-Identifier: Apache-2.0
// CudaSelfCommunicator: the group of one rank (N = 1) on device buffers, stream-ordered.
#pragma once

#include <cstddef>
#include <type_traits>

#include <cuda_runtime_api.h>

#include "dcpattn/comm/communicator.hpp"
#include "dcpattn/config.hpp"
#include "dcpattn/error.hpp"

DCPATTN_NAMESPACE_BEGIN

/// The Communicator of a DCP group of size 1 on device buffers: rank() = 0, size() = 1, and every
/// collective is a device-to-device cudaMemcpyAsync of its n send elements to recv on the given
/// stream (the N = 1 case of each definition). No allocation, no host synchronization, so a
/// forward that uses it can be captured in a CUDA graph; the device counterpart of
/// SelfCommunicator, and what the CUDA execution space pairs with where no NCCL group exists.
/// Stateless; needs no MPI.
class CudaSelfCommunicator {
 public:
  using stream_type = cudaStream_t;

  constexpr int rank() const noexcept { return 0; }
  constexpr int size() const noexcept { return 1; }

  /// recv (n) = send (n), enqueued on `stream`.
  /// @tparam T any trivially copyable element type
  template <class T>
  void all_gather(const T* send, T* recv, std::size_t n, stream_type stream) {
    copy(send, recv, n, stream);
  }

  /// recv (n) = send (n): the one chunk goes to, and comes from, rank 0.
  /// @tparam T any trivially copyable element type
  template <class T>
  void all_to_all(const T* send, T* recv, std::size_t n, stream_type stream) {
    copy(send, recv, n, stream);
  }

  /// recv (n) = send (n): the sum over one rank.
  void reduce_scatter_sum(const float* send, float* recv, std::size_t n, stream_type stream) {
    copy(send, recv, n, stream);
  }

  /// Enqueues nothing: one rank has always reached the barrier.
  void barrier(stream_type) {}

  /// Returns `value`, the maximum over one rank.
  int all_reduce_max_int(int value) noexcept { return value; }

 private:
  template <class T>
  static void copy(const T* send, T* recv, std::size_t n, stream_type stream) {
    static_assert(std::is_trivially_copyable_v<T>, DCPATTN_COLLECTIVE_ELEMENT_MESSAGE);
    if (n == 0 || send == recv) return;
    DCPATTN_CUDA_CHECK(cudaMemcpyAsync(static_cast<void*>(recv), static_cast<const void*>(send),
                                       n * sizeof(T), cudaMemcpyDeviceToDevice, stream));
  }
};

static_assert(Communicator<CudaSelfCommunicator>, DCPATTN_COMMUNICATOR_MESSAGE);
static_assert(std::is_empty_v<CudaSelfCommunicator>);

DCPATTN_NAMESPACE_END
