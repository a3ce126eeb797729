// SPDX-License-Identifier: Apache-2.0
// MpiCommunicator: a DCP group over an MPI communicator, on host buffers.
#pragma once

#include <climits>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include <mpi.h>

#include "dcpattn/comm/communicator.hpp"
#include "dcpattn/config.hpp"
#include "dcpattn/error.hpp"

DCPATTN_NAMESPACE_BEGIN

namespace detail {

/// Refuses a per-rank count that MPI's int counts cannot express.
inline void require_int_count(std::size_t n, const char* collective) {
  DCPATTN_REQUIRE(n <= std::size_t(INT_MAX),
                  std::string(collective) + ": per-rank count n (" + std::to_string(n) +
                      ") exceeds INT_MAX, the largest count MPI accepts; split the call");
}

/// The MPI datatype that moves one T. Collectives other than reductions only move bits, so an
/// unsigned integer of T's size stands in for T when T is aligned like it; any other trivially
/// copyable T gets a contiguous byte type, committed here and freed on destruction.
template <class T>
class MpiElementType {
  static_assert(std::is_trivially_copyable_v<T>, DCPATTN_COLLECTIVE_ELEMENT_MESSAGE);

 public:
  MpiElementType() {
    if constexpr (std::is_same_v<T, float>) {
      type_ = MPI_FLOAT;
    } else if constexpr (sizeof(T) == 1) {
      type_ = MPI_BYTE;
    } else if constexpr (sizeof(T) == 2 && alignof(T) == 2) {
      type_ = MPI_UINT16_T;
    } else if constexpr (sizeof(T) == 4 && alignof(T) == 4) {
      type_ = MPI_UINT32_T;
    } else if constexpr (sizeof(T) == 8 && alignof(T) == 8) {
      type_ = MPI_UINT64_T;
    } else {
      static_assert(sizeof(T) <= std::size_t(INT_MAX), "dcpattn: element type too large for MPI");
      DCPATTN_MPI_CHECK(MPI_Type_contiguous(int(sizeof(T)), MPI_BYTE, &type_));
      try {
        DCPATTN_MPI_CHECK(MPI_Type_commit(&type_));
      } catch (...) {
        MPI_Type_free(&type_);
        throw;
      }
      derived_ = true;
    }
  }
  ~MpiElementType() {
    if (derived_) MPI_Type_free(&type_);
  }
  MpiElementType(const MpiElementType&) = delete;
  MpiElementType& operator=(const MpiElementType&) = delete;

  MPI_Datatype get() const noexcept { return type_; }

 private:
  MPI_Datatype type_ = MPI_DATATYPE_NULL;
  bool derived_ = false;
};

}  // namespace detail

/// The Communicator of a DCP group over MPI, on host buffers. Collectives block until this rank's
/// part is done; the stream is ignored.
///
/// Owns a duplicate (MPI_Comm_dup) of the communicator it is given, so its traffic never matches
/// the caller's, and frees it on destruction (unless MPI is already finalized). The duplicate
/// returns errors as codes (MPI_ERRORS_RETURN), which the collectives raise as dcpattn::Error.
/// Construction records rank() as the rank of later errors (dcpattn::set_error_rank).
/// Move-only. Counts are per rank and must be <= INT_MAX (MPI's int counts); larger ones are
/// refused with a dcpattn::Error.
class MpiCommunicator {
 public:
  using stream_type = HostStream;

  /// Collective over `comm`: duplicates it.
  /// @param comm an intra-communicator whose ranks form the group, e.g. MPI_COMM_WORLD
  explicit MpiCommunicator(MPI_Comm comm) {
    require_initialized();
    DCPATTN_REQUIRE(comm != MPI_COMM_NULL, "comm must not be MPI_COMM_NULL");
    MPI_Comm dup = MPI_COMM_NULL;
    DCPATTN_MPI_CHECK(MPI_Comm_dup(comm, &dup));
    adopt(dup);
  }

  /// Carves DCP groups of `dcp_size` consecutive ranks out of a tensor-parallel communicator:
  /// TP rank t joins group t / dcp_size as its rank t mod dcp_size (MPI_Comm_split with
  /// color = t / dcp_size, key = t). Collective over `tp_comm`.
  /// @param tp_comm the tensor-parallel communicator (not modified, not owned)
  /// @param dcp_size the DCP group size; must be >= 1 and divide the size of `tp_comm`, else
  ///        dcpattn::Error naming dcp_size (raised on every rank, before any communication)
  static MpiCommunicator split_dcp_group(MPI_Comm tp_comm, int dcp_size) {
    require_initialized();
    DCPATTN_REQUIRE(tp_comm != MPI_COMM_NULL, "tp_comm must not be MPI_COMM_NULL");
    int tp_rank = 0, tp_size = 0;
    DCPATTN_MPI_CHECK(MPI_Comm_rank(tp_comm, &tp_rank));
    DCPATTN_MPI_CHECK(MPI_Comm_size(tp_comm, &tp_size));
    detail::require_dcp_split(tp_size, dcp_size);
    MPI_Comm group = MPI_COMM_NULL;
    DCPATTN_MPI_CHECK(MPI_Comm_split(tp_comm, tp_rank / dcp_size, tp_rank, &group));
    MpiCommunicator c;
    c.adopt(group);
    return c;
  }

  MpiCommunicator(MpiCommunicator&& other) noexcept
      : comm_(std::exchange(other.comm_, MPI_COMM_NULL)),
        rank_(std::exchange(other.rank_, 0)),
        size_(std::exchange(other.size_, 0)) {}
  MpiCommunicator& operator=(MpiCommunicator&& other) noexcept {
    if (this != &other) {
      release();
      comm_ = std::exchange(other.comm_, MPI_COMM_NULL);
      rank_ = std::exchange(other.rank_, 0);
      size_ = std::exchange(other.size_, 0);
    }
    return *this;
  }
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;
  ~MpiCommunicator() { release(); }

  /// This process's rank in the group.
  int rank() const noexcept { return rank_; }
  /// Number of ranks in the group (0 once moved from).
  int size() const noexcept { return size_; }
  /// The owned communicator (MPI_COMM_NULL once moved from). Borrowed: do not free it.
  MPI_Comm comm() const noexcept { return comm_; }

  /// send (n), recv (size() * n): recv chunk r holds rank r's n elements. n == 0 does nothing.
  /// @tparam T any trivially copyable element type
  template <class T>
  void all_gather(const T* send, T* recv, std::size_t n, stream_type = {}) {
    static_assert(std::is_trivially_copyable_v<T>, DCPATTN_COLLECTIVE_ELEMENT_MESSAGE);
    const MPI_Comm comm = handle();
    if (n == 0) return;
    detail::require_int_count(n, "MpiCommunicator::all_gather");
    const detail::MpiElementType<T> type;
    DCPATTN_MPI_CHECK(MPI_Allgather(send, int(n), type.get(), recv, int(n), type.get(), comm));
  }

  /// send (size() * n): chunk d goes to rank d; recv (size() * n): chunk r came from rank r.
  /// n == 0 does nothing.
  /// @tparam T any trivially copyable element type
  template <class T>
  void all_to_all(const T* send, T* recv, std::size_t n, stream_type = {}) {
    static_assert(std::is_trivially_copyable_v<T>, DCPATTN_COLLECTIVE_ELEMENT_MESSAGE);
    const MPI_Comm comm = handle();
    if (n == 0) return;
    detail::require_int_count(n, "MpiCommunicator::all_to_all");
    const detail::MpiElementType<T> type;
    DCPATTN_MPI_CHECK(MPI_Alltoall(send, int(n), type.get(), recv, int(n), type.get(), comm));
  }

  /// send (size() * n) floats; recv (n): elementwise sum over ranks of chunk rank()
  /// (MPI_Reduce_scatter_block). The summation order is MPI's, so the result is bitwise
  /// reproducible only where the sums are exact. n == 0 does nothing.
  void reduce_scatter_sum(const float* send, float* recv, std::size_t n, stream_type = {}) {
    const MPI_Comm comm = handle();
    if (n == 0) return;
    detail::require_int_count(n, "MpiCommunicator::reduce_scatter_sum");
    DCPATTN_MPI_CHECK(MPI_Reduce_scatter_block(send, recv, int(n), MPI_FLOAT, MPI_SUM, comm));
  }

  /// MPI_Barrier on the group.
  void barrier(stream_type = {}) { DCPATTN_MPI_CHECK(MPI_Barrier(handle())); }

  /// The maximum of `value` over the group, returned on every rank (blocking; used to check
  /// that all ranks agree on a configuration).
  int all_reduce_max_int(int value) {
    int result = value;
    DCPATTN_MPI_CHECK(MPI_Allreduce(&value, &result, 1, MPI_INT, MPI_MAX, handle()));
    return result;
  }

 private:
  MpiCommunicator() = default;

  static void require_initialized() {
    int initialized = 0;
    DCPATTN_MPI_CHECK(MPI_Initialized(&initialized));
    DCPATTN_REQUIRE(initialized != 0, "MPI must be initialized (MPI_Init) first");
  }

  /// Takes ownership of `owned`; frees it if it cannot be set up.
  void adopt(MPI_Comm owned) {
    comm_ = owned;
    try {
      DCPATTN_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
      DCPATTN_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
      DCPATTN_MPI_CHECK(MPI_Comm_size(comm_, &size_));
    } catch (...) {
      release();
      throw;
    }
    set_error_rank(rank_);
  }

  MPI_Comm handle() const {
    DCPATTN_REQUIRE(comm_ != MPI_COMM_NULL, "MpiCommunicator used after being moved from");
    return comm_;
  }

  void release() noexcept {
    if (comm_ == MPI_COMM_NULL) return;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
    comm_ = MPI_COMM_NULL;
    rank_ = 0;
    size_ = 0;
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 0;
};

static_assert(Communicator<MpiCommunicator>, DCPATTN_COMMUNICATOR_MESSAGE);

DCPATTN_NAMESPACE_END
