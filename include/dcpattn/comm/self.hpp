// SPDX-License-Identifier: Apache-2.0
// SelfCommunicator: the group of one rank (N = 1), where every collective is a copy.
#pragma once

#include <cstddef>
#include <cstring>
#include <type_traits>

#include "dcpattn/comm/communicator.hpp"
#include "dcpattn/config.hpp"

DCPATTN_NAMESPACE_BEGIN

/// The Communicator of a DCP group of size 1, on host buffers: rank() = 0, size() = 1, and every
/// collective copies its n send elements to recv (the N = 1 case of each definition). Stateless;
/// needs no MPI. Blocking; the stream is ignored.
class SelfCommunicator {
 public:
  using stream_type = HostStream;

  constexpr int rank() const noexcept { return 0; }
  constexpr int size() const noexcept { return 1; }

  /// recv (n) = send (n).
  /// @tparam T any trivially copyable element type
  template <class T>
  void all_gather(const T* send, T* recv, std::size_t n, stream_type = {}) {
    copy(send, recv, n);
  }

  /// recv (n) = send (n): the one chunk goes to, and comes from, rank 0.
  /// @tparam T any trivially copyable element type
  template <class T>
  void all_to_all(const T* send, T* recv, std::size_t n, stream_type = {}) {
    copy(send, recv, n);
  }

  /// recv (n) = send (n): the sum over one rank.
  void reduce_scatter_sum(const float* send, float* recv, std::size_t n, stream_type = {}) {
    copy(send, recv, n);
  }

  /// Returns at once.
  void barrier(stream_type = {}) {}

  /// Returns `value`, the maximum over one rank. (Host-side; used to check that all ranks agree on
  /// a configuration.)
  int all_reduce_max_int(int value) noexcept { return value; }

 private:
  template <class T>
  static void copy(const T* send, T* recv, std::size_t n) {
    static_assert(std::is_trivially_copyable_v<T>, DCPATTN_COLLECTIVE_ELEMENT_MESSAGE);
    if (n == 0 || send == recv) return;
    std::memcpy(static_cast<void*>(recv), static_cast<const void*>(send), n * sizeof(T));
  }
};

static_assert(Communicator<SelfCommunicator>, DCPATTN_COMMUNICATOR_MESSAGE);
static_assert(std::is_empty_v<SelfCommunicator>);

DCPATTN_NAMESPACE_END
