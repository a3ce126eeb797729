// SPDX-License-Identifier: Apache-2.0
// NcclCommunicator: a DCP group over NCCL, on device buffers, ordered on CUDA streams.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>

#include <cuda_runtime_api.h>
#include <mpi.h>
#include <nccl.h>

#include "dcpattn/comm/communicator.hpp"
#include "dcpattn/config.hpp"
#include "dcpattn/core/numeric.hpp"
#include "dcpattn/error.hpp"

#if !defined(NCCL_VERSION_CODE) || NCCL_VERSION_CODE < NCCL_VERSION(2, 18, 0)
#error "dcpattn: NcclCommunicator needs NCCL >= 2.18 (ncclCommSplit)"
#endif

DCPATTN_NAMESPACE_BEGIN

namespace detail {
template <class>
inline constexpr bool no_nccl_data_type = false;
}  // namespace detail

/// The NCCL data type of element type T, as `value`. Shipped for float, bfloat16, std::int32_t,
/// std::uint8_t and std::byte; specialize it for another type of the same width and meaning.
/// The primary template refuses to compile, so an unmapped type never travels as the wrong one.
template <class T>
struct NcclDataType {
  static_assert(detail::no_nccl_data_type<T>,
                "dcpattn: NcclCommunicator has no NCCL data type for this element type: use "
                "float, dcpattn::bfloat16, std::int32_t, std::uint8_t or std::byte, or specialize "
                "dcpattn::NcclDataType");
};
template <>
struct NcclDataType<float> {
  static constexpr ncclDataType_t value = ncclFloat32;
};
template <>
struct NcclDataType<bfloat16> {
  static constexpr ncclDataType_t value = ncclBfloat16;
};
template <>
struct NcclDataType<std::int32_t> {
  static constexpr ncclDataType_t value = ncclInt32;
};
template <>
struct NcclDataType<std::uint8_t> {
  static constexpr ncclDataType_t value = ncclUint8;
};
template <>
struct NcclDataType<std::byte> {
  static constexpr ncclDataType_t value = ncclUint8;
};

/// NcclDataType<T>::value.
template <class T>
inline constexpr ncclDataType_t nccl_data_type_v = NcclDataType<T>::value;

/// The Communicator of a DCP group over NCCL. Buffers are device memory of the communicator's
/// GPU; collectives are enqueued on the given stream and return without waiting (stream-ordered,
/// no allocation, no host synchronization, so they can be captured in a CUDA graph), except
/// all_reduce_max_int, which blocks.
///
/// Either borrows an existing ncclComm_t (never destroyed here) or owns one made by init() or
/// split_dcp_group() (destroyed with the object). Construction allocates a small device buffer
/// on the current device (for barrier and all_reduce_max_int) and records rank() as the rank of
/// later errors (dcpattn::set_error_rank); the communicator's GPU must be current then. Move-only.
class NcclCommunicator {
 public:
  using stream_type = cudaStream_t;

  /// Borrows `comm`: the caller keeps it alive longer than this object and destroys it.
  explicit NcclCommunicator(ncclComm_t comm) : NcclCommunicator(comm, false) {}

  /// Creates an owned NCCL communicator over the ranks of `comm`, with the same ranks: rank 0
  /// makes the ncclUniqueId and broadcasts it over MPI, then every rank calls ncclCommInitRank.
  /// Collective over `comm`; set each rank's device (cudaSetDevice) first.
  static NcclCommunicator init(MPI_Comm comm) {
    DCPATTN_REQUIRE(comm != MPI_COMM_NULL, "comm must not be MPI_COMM_NULL");
    int rank = 0, size = 0;
    DCPATTN_MPI_CHECK(MPI_Comm_rank(comm, &rank));
    DCPATTN_MPI_CHECK(MPI_Comm_size(comm, &size));
    // The status travels with the id, so a failure on rank 0 is raised on every rank instead of
    // leaving the others waiting in ncclCommInitRank.
    struct {
      ncclUniqueId id;
      int status;
    } boot{};
    boot.status = int(ncclSuccess);
    if (rank == 0) boot.status = int(ncclGetUniqueId(&boot.id));
    DCPATTN_MPI_CHECK(MPI_Bcast(&boot, int(sizeof(boot)), MPI_BYTE, 0, comm));
    DCPATTN_REQUIRE(boot.status == int(ncclSuccess),
                    std::string("ncclGetUniqueId failed on rank 0: NCCL: ") +
                        ncclGetErrorString(ncclResult_t(boot.status)));
    ncclComm_t nccl = nullptr;
    DCPATTN_NCCL_CHECK(ncclCommInitRank(&nccl, size, boot.id, rank));
    return NcclCommunicator(nccl, true);
  }

  /// Carves DCP groups of `dcp_size` consecutive ranks out of a tensor-parallel NCCL
  /// communicator: TP rank t joins group t / dcp_size as its rank t mod dcp_size (ncclCommSplit
  /// with color = t / dcp_size, key = t). Collective over `tp_comm`; the result is owned.
  /// @param tp_comm the tensor-parallel communicator (not modified, not owned)
  /// @param dcp_size the DCP group size; must be >= 1 and divide the size of `tp_comm`, else
  ///        dcpattn::Error naming dcp_size (raised on every rank, before any communication)
  static NcclCommunicator split_dcp_group(ncclComm_t tp_comm, int dcp_size) {
    DCPATTN_REQUIRE(tp_comm != nullptr, "tp_comm must not be null");
    int tp_rank = 0, tp_size = 0;
    DCPATTN_NCCL_CHECK(ncclCommUserRank(tp_comm, &tp_rank));
    DCPATTN_NCCL_CHECK(ncclCommCount(tp_comm, &tp_size));
    detail::require_dcp_split(tp_size, dcp_size);
    ncclComm_t group = nullptr;
    DCPATTN_NCCL_CHECK(ncclCommSplit(tp_comm, tp_rank / dcp_size, tp_rank, &group, nullptr));
    return NcclCommunicator(group, true);
  }
  /// split_dcp_group(tp.comm(), dcp_size).
  static NcclCommunicator split_dcp_group(const NcclCommunicator& tp, int dcp_size) {
    return split_dcp_group(tp.comm(), dcp_size);
  }

  NcclCommunicator(NcclCommunicator&& other) noexcept
      : comm_(std::exchange(other.comm_, nullptr)),
        owns_(std::exchange(other.owns_, false)),
        rank_(std::exchange(other.rank_, 0)),
        size_(std::exchange(other.size_, 0)),
        scratch_(std::exchange(other.scratch_, nullptr)),
        blocking_stream_(std::exchange(other.blocking_stream_, nullptr)),
        aborted_(std::exchange(other.aborted_, false)) {}
  NcclCommunicator& operator=(NcclCommunicator&& other) noexcept {
    if (this != &other) {
      release();
      comm_ = std::exchange(other.comm_, nullptr);
      owns_ = std::exchange(other.owns_, false);
      rank_ = std::exchange(other.rank_, 0);
      size_ = std::exchange(other.size_, 0);
      scratch_ = std::exchange(other.scratch_, nullptr);
      blocking_stream_ = std::exchange(other.blocking_stream_, nullptr);
      aborted_ = std::exchange(other.aborted_, false);
    }
    return *this;
  }
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;
  ~NcclCommunicator() { release(); }

  /// This process's rank in the group.
  int rank() const noexcept { return rank_; }
  /// Number of ranks in the group (0 once moved from).
  int size() const noexcept { return size_; }
  /// The NCCL communicator (null once moved from). Borrowed: do not destroy it.
  ncclComm_t comm() const noexcept { return comm_; }
  /// Whether this object destroys comm() (made by init or split_dcp_group).
  bool owns_comm() const noexcept { return owns_; }

  /// Device buffers send (n), recv (size() * n): recv chunk r holds rank r's n elements
  /// (ncclAllGather). Enqueued on `stream`; n == 0 does nothing.
  /// @tparam T an element type with an NcclDataType
  template <class T>
  void all_gather(const T* send, T* recv, std::size_t n, stream_type stream) {
    require_live();
    if (n == 0) return;
    DCPATTN_NCCL_CHECK(ncclAllGather(send, recv, n, nccl_data_type_v<T>, comm_, stream));
  }

  /// Device buffers send (size() * n): chunk d goes to rank d; recv (size() * n): chunk r came
  /// from rank r. One NCCL group of a send and a receive per peer. Enqueued on `stream`;
  /// n == 0 does nothing.
  /// @tparam T an element type with an NcclDataType
  template <class T>
  void all_to_all(const T* send, T* recv, std::size_t n, stream_type stream) {
    require_live();
    if (n == 0) return;
    constexpr ncclDataType_t type = nccl_data_type_v<T>;
    DCPATTN_NCCL_CHECK(ncclGroupStart());
    try {
      for (int peer = 0; peer < size_; ++peer) {
        const std::size_t offset = std::size_t(peer) * n;
        DCPATTN_NCCL_CHECK(ncclSend(send + offset, n, type, peer, comm_, stream));
        DCPATTN_NCCL_CHECK(ncclRecv(recv + offset, n, type, peer, comm_, stream));
      }
    } catch (...) {
      (void)ncclGroupEnd();  // close the group before reporting; the first error is the one raised
      throw;
    }
    DCPATTN_NCCL_CHECK(ncclGroupEnd());
  }

  /// Device buffers send (size() * n), recv (n): elementwise sum over ranks of chunk rank()
  /// (ncclReduceScatter, ncclSum). The summation order is NCCL's, so the result is bitwise
  /// reproducible only where the sums are exact. Enqueued on `stream`; n == 0 does nothing.
  /// @tparam T float or bfloat16 (bfloat16 sums are rounded by NCCL)
  template <class T>
  void reduce_scatter_sum(const T* send, T* recv, std::size_t n, stream_type stream) {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, bfloat16>,
                  "dcpattn: NcclCommunicator::reduce_scatter_sum takes float or bfloat16");
    require_live();
    if (n == 0) return;
    DCPATTN_NCCL_CHECK(
        ncclReduceScatter(send, recv, n, nccl_data_type_v<T>, ncclSum, comm_, stream));
  }

  /// A barrier in stream order (a one-element ncclAllReduce on the object's device buffer): work
  /// enqueued on `stream` after it starts only once every rank has reached its barrier in its
  /// own stream order. The host does not wait.
  void barrier(stream_type stream) {
    require_live();
    DCPATTN_NCCL_CHECK(ncclAllReduce(scratch_, scratch_, 1, ncclInt32, ncclMax, comm_, stream));
  }

  /// The maximum of `value` over the group, returned on every rank. Blocking (it copies through
  /// the device buffer on a private stream and synchronizes that stream): for configuration
  /// checks, not for the hot path, and not during CUDA graph capture.
  int all_reduce_max_int(int value) {
    require_live();
    int* slot = scratch_ + 1;
    int result = value;
    DCPATTN_CUDA_CHECK(
        cudaMemcpyAsync(slot, &value, sizeof(int), cudaMemcpyHostToDevice, blocking_stream_));
    DCPATTN_NCCL_CHECK(ncclAllReduce(slot, slot, 1, ncclInt32, ncclMax, comm_, blocking_stream_));
    DCPATTN_CUDA_CHECK(
        cudaMemcpyAsync(&result, slot, sizeof(int), cudaMemcpyDeviceToHost, blocking_stream_));
    DCPATTN_CUDA_CHECK(cudaStreamSynchronize(blocking_stream_));
    return result;
  }

  /// Opt-in watchdog for a step's collectives: waits until everything enqueued on `stream` so far
  /// has completed, polling ncclCommGetAsyncError meanwhile. On an asynchronous NCCL error, or
  /// when `timeout` passes first (a peer died or never joined), it aborts the communicator
  /// (ncclCommAbort: no rank stays blocked in it), leaves this object unusable, and throws
  /// dcpattn::Error naming this rank and the cause; every later call on this object throws too.
  /// A borrowed communicator is aborted as well: its owner must not destroy it afterwards.
  /// ncclCommAbort ends NCCL's own kernels but waits for other kernels running on the GPU: a
  /// stalled kernel that is not NCCL's delays the throw until it ends.
  /// A peer that joins after the others gave up may still complete the collective they had fed
  /// (measured on two H200s) and fail only at the next one: treat a watchdog error on any rank as
  /// the end of the whole group.
  /// Blocking: call it where the engine would synchronize anyway, not inside a CUDA graph capture.
  void synchronize_with_watchdog(cudaStream_t stream, std::chrono::milliseconds timeout) {
    require_live();
    const int rank = rank_;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      const cudaError_t done = cudaStreamQuery(stream);
      if (done == cudaSuccess) return;
      if (done != cudaErrorNotReady) DCPATTN_CUDA_CHECK(done);
      ncclResult_t async = ncclSuccess;
      DCPATTN_NCCL_CHECK(ncclCommGetAsyncError(comm_, &async));
      if (async != ncclSuccess && async != ncclInProgress) {
        abort_comm();
        throw Error(std::string("NCCL asynchronous error in a collective: ") +
                        ncclGetErrorString(async) + "; communicator aborted",
                    "NcclCommunicator::synchronize_with_watchdog", "", 0, rank);
      }
      if (std::chrono::steady_clock::now() >= deadline) {
        abort_comm();
        throw Error("collectives did not complete within " + std::to_string(timeout.count()) +
                        " ms (a peer may have failed); communicator aborted",
                    "NcclCommunicator::synchronize_with_watchdog", "", 0, rank);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

 private:
  /// ncclCommAbort instead of ncclCommDestroy: returns even while peers are gone.
  void abort_comm() noexcept {
    if (comm_ != nullptr) ncclCommAbort(comm_);
    comm_ = nullptr;
    release();
    aborted_ = true;
  }

  NcclCommunicator(ncclComm_t comm, bool owns) : comm_(comm), owns_(owns) {
    DCPATTN_REQUIRE(comm != nullptr, "comm must not be null");
    try {
      DCPATTN_NCCL_CHECK(ncclCommUserRank(comm_, &rank_));
      DCPATTN_NCCL_CHECK(ncclCommCount(comm_, &size_));
      // Slot 0: barrier (its value is never read); slot 1: all_reduce_max_int. Stream-ordered,
      // so that release() never waits for the device: cudaFree would wait for every kernel on
      // the GPU, a stalled one included, and the watchdog must return while one is.
      DCPATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&blocking_stream_, cudaStreamNonBlocking));
      DCPATTN_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&scratch_), 2 * sizeof(int),
                                         blocking_stream_));
      DCPATTN_CUDA_CHECK(cudaMemsetAsync(scratch_, 0, 2 * sizeof(int), blocking_stream_));
      DCPATTN_CUDA_CHECK(cudaStreamSynchronize(blocking_stream_));
    } catch (...) {
      release();
      throw;
    }
    set_error_rank(rank_);
  }

  void require_live() const {
    DCPATTN_REQUIRE(comm_ != nullptr, aborted_ ? "NcclCommunicator used after its watchdog aborted it"
                                               : "NcclCommunicator used after being moved from");
  }

  void release() noexcept {
    if (scratch_ != nullptr) cudaFreeAsync(scratch_, blocking_stream_);
    if (blocking_stream_ != nullptr) cudaStreamDestroy(blocking_stream_);
    if (owns_ && comm_ != nullptr) ncclCommDestroy(comm_);
    blocking_stream_ = nullptr;
    scratch_ = nullptr;
    comm_ = nullptr;
    owns_ = false;
    rank_ = 0;
    size_ = 0;
  }

  ncclComm_t comm_ = nullptr;
  bool owns_ = false;
  int rank_ = 0;
  int size_ = 0;
  int* scratch_ = nullptr;
  cudaStream_t blocking_stream_ = nullptr;
  bool aborted_ = false;  // by synchronize_with_watchdog
};

static_assert(Communicator<NcclCommunicator>, DCPATTN_COMMUNICATOR_MESSAGE);

DCPATTN_NAMESPACE_END
