// SPDX-License-Identifier: Apache-2.0
// MpiStagedCommunicator: MPI collectives on device buffers, staged through pinned host memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>

#include <cuda_runtime_api.h>
#include <mpi.h>

#include "dcpattn/comm/communicator.hpp"
#include "dcpattn/comm/mpi.hpp"
#include "dcpattn/config.hpp"
#include "dcpattn/error.hpp"
#include "dcpattn/kernels/host/combine.hpp"
#include "dcpattn/op/config.hpp"

DCPATTN_NAMESPACE_BEGIN

/// The Communicator of a DCP group over MPI for DEVICE buffers (stream_type cudaStream_t), for
/// MPI libraries that are not CUDA-aware and for several ranks sharing one GPU (which NCCL
/// refuses before 2.30). Each collective copies the device send buffer into a pinned host staging
/// buffer on the stream, SYNCHRONIZES THE STREAM, runs the MpiCommunicator collective on host
/// memory, and enqueues the copy of the result back to the device buffer on the stream (so the
/// host returns before that copy ends; later work on the stream sees the result).
///
/// Because it synchronizes the stream it cannot be captured in a CUDA graph: a collective called
/// on a capturing stream throws dcpattn::Error instead. NcclCommunicator is the capturable,
/// asynchronous path; this one is for tests, development machines and small groups.
///
/// Staging memory: two pinned host buffers (send and receive) of capacity() bytes each, allocated
/// at construction and grown only by reserve(). A collective needs max(send bytes, receive bytes)
/// <= capacity(); a larger one is refused with a dcpattn::Error naming the capacity (nothing is
/// allocated inside a collective). staging_bytes_for(config) gives the capacity DcpAttention
/// needs with the shipped gather and combiner policies.
///
/// Owns an MpiCommunicator (a duplicate of the MPI communicator it is given) and one CUDA event
/// on the device current at construction; use it with streams of that device. Move-only.
class MpiStagedCommunicator {
 public:
  using stream_type = cudaStream_t;

  /// Collective over `comm`: duplicates it (see MpiCommunicator).
  /// @param comm an intra-communicator whose ranks form the group (MPI_COMM_WORLD, MPI_COMM_SELF)
  /// @param staging_bytes capacity of each pinned staging buffer, in bytes
  MpiStagedCommunicator(MPI_Comm comm, std::size_t staging_bytes)
      : MpiStagedCommunicator(MpiCommunicator(comm), staging_bytes) {}

  /// Takes over an existing host communicator (e.g. from MpiCommunicator::split_dcp_group).
  /// @param staging_bytes capacity of each pinned staging buffer, in bytes
  MpiStagedCommunicator(MpiCommunicator&& comm, std::size_t staging_bytes)
      : comm_(std::move(comm)) {
    DCPATTN_CUDA_CHECK(cudaEventCreateWithFlags(&copied_back_, cudaEventDisableTiming));
    try {
      reserve(staging_bytes);
    } catch (...) {
      release();
      throw;
    }
  }

  MpiStagedCommunicator(MpiStagedCommunicator&& other) noexcept
      : comm_(std::move(other.comm_)),
        send_(std::exchange(other.send_, nullptr)),
        recv_(std::exchange(other.recv_, nullptr)),
        capacity_(std::exchange(other.capacity_, 0)),
        copied_back_(std::exchange(other.copied_back_, nullptr)) {}
  MpiStagedCommunicator& operator=(MpiStagedCommunicator&& other) noexcept {
    if (this != &other) {
      release();
      comm_ = std::move(other.comm_);
      send_ = std::exchange(other.send_, nullptr);
      recv_ = std::exchange(other.recv_, nullptr);
      capacity_ = std::exchange(other.capacity_, 0);
      copied_back_ = std::exchange(other.copied_back_, nullptr);
    }
    return *this;
  }
  MpiStagedCommunicator(const MpiStagedCommunicator&) = delete;
  MpiStagedCommunicator& operator=(const MpiStagedCommunicator&) = delete;
  ~MpiStagedCommunicator() { release(); }

  /// Staging capacity DcpAttention needs for `config` with the shipped policies: the largest
  /// single collective among the query all-gather (T * H * head_dim_qk bf16 received), the
  /// AllToAll exchange (N chunks of o and lse) and the AllGatherReduceScatter steps
  /// (N * T * H lse received, T * H * Dv fp32 sent), for T = config.max_tokens.
  static std::size_t staging_bytes_for(const DcpConfig& config) {
    const std::size_t t = std::size_t(config.max_tokens > 0 ? config.max_tokens : 0);
    const std::size_t h = std::size_t(config.num_heads > 0 ? config.num_heads : 0);
    const std::size_t n = std::size_t(config.group_size > 0 ? config.group_size : 1);
    const std::size_t dv = std::size_t(config.head_dim_v > 0 ? config.head_dim_v : 0);
    const std::size_t query = t * h * std::size_t(config.head_dim_qk > 0 ? config.head_dim_qk : 0) * 2;
    const std::size_t a2a =
        n * detail::A2aChunkLayout::make(std::int64_t(t), std::int64_t(h / n), std::int64_t(dv),
                                         config.partial_dtype)
                .bytes;
    const std::size_t lse_all = n * t * h * 4;
    const std::size_t o_all = t * h * dv * 4;
    std::size_t m = query;
    for (std::size_t x : {a2a, lse_all, o_all}) m = x > m ? x : m;
    return m;
  }

  /// This process's rank in the group.
  int rank() const noexcept { return comm_.rank(); }
  /// Number of ranks in the group (0 once moved from).
  int size() const noexcept { return comm_.size(); }
  /// Bytes of each staging buffer.
  std::size_t capacity() const noexcept { return capacity_; }
  /// The wrapped host communicator (host buffers, blocking), e.g. for configuration checks.
  MpiCommunicator& host() noexcept { return comm_; }

  /// Grows both staging buffers to at least `bytes` (never shrinks). Waits for the last
  /// copy-back from the staging memory first. Not for use during graph capture or concurrently
  /// with a collective.
  void reserve(std::size_t bytes) {
    if (bytes <= capacity_) return;
    DCPATTN_REQUIRE(copied_back_ != nullptr, "MpiStagedCommunicator used after being moved from");
    DCPATTN_CUDA_CHECK(cudaEventSynchronize(copied_back_));
    void* s = nullptr;
    void* r = nullptr;
    DCPATTN_CUDA_CHECK(cudaMallocHost(&s, bytes));
    const cudaError_t e = cudaMallocHost(&r, bytes);
    if (e != cudaSuccess) {
      cudaFreeHost(s);
      DCPATTN_CUDA_CHECK(e);
    }
    free_staging();
    send_ = static_cast<std::byte*>(s);
    recv_ = static_cast<std::byte*>(r);
    capacity_ = bytes;
  }

  /// Device buffers send (n), recv (size() * n): recv chunk r holds rank r's n elements.
  /// Synchronizes `stream`; n == 0 does nothing.
  /// @tparam T any trivially copyable element type
  template <class T>
  void all_gather(const T* send, T* recv, std::size_t n, stream_type stream) {
    static_assert(std::is_trivially_copyable_v<T>, DCPATTN_COLLECTIVE_ELEMENT_MESSAGE);
    if (n == 0) return;
    const std::size_t sb = n * sizeof(T), rb = sb * std::size_t(size());
    stage_in("all_gather", send, sb, rb, stream);
    comm_.all_gather(reinterpret_cast<const T*>(send_), reinterpret_cast<T*>(recv_), n);
    stage_out(recv, rb, stream);
  }

  /// Device buffers send (size() * n): chunk d goes to rank d; recv (size() * n): chunk r came
  /// from rank r. Synchronizes `stream`; n == 0 does nothing.
  /// @tparam T any trivially copyable element type
  template <class T>
  void all_to_all(const T* send, T* recv, std::size_t n, stream_type stream) {
    static_assert(std::is_trivially_copyable_v<T>, DCPATTN_COLLECTIVE_ELEMENT_MESSAGE);
    if (n == 0) return;
    const std::size_t b = n * sizeof(T) * std::size_t(size());
    stage_in("all_to_all", send, b, b, stream);
    comm_.all_to_all(reinterpret_cast<const T*>(send_), reinterpret_cast<T*>(recv_), n);
    stage_out(recv, b, stream);
  }

  /// Device buffers send (size() * n) floats, recv (n): elementwise sum over ranks of chunk
  /// rank(), in MPI's order. Synchronizes `stream`; n == 0 does nothing.
  void reduce_scatter_sum(const float* send, float* recv, std::size_t n, stream_type stream) {
    if (n == 0) return;
    const std::size_t rb = n * sizeof(float), sb = rb * std::size_t(size());
    stage_in("reduce_scatter_sum", send, sb, rb, stream);
    comm_.reduce_scatter_sum(reinterpret_cast<const float*>(send_),
                             reinterpret_cast<float*>(recv_), n);
    stage_out(recv, rb, stream);
  }

  /// Synchronizes `stream`, then MPI_Barrier: work enqueued on `stream` afterwards starts after
  /// every rank has reached the barrier.
  void barrier(stream_type stream) {
    require_not_capturing(stream, "barrier");
    DCPATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
    comm_.barrier();
  }

  /// The maximum of `value` over the group, returned on every rank (blocking, host only).
  int all_reduce_max_int(int value) { return comm_.all_reduce_max_int(value); }

 private:
  static void require_not_capturing(stream_type stream, const char* collective) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    DCPATTN_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
    DCPATTN_REQUIRE(status == cudaStreamCaptureStatusNone,
                    std::string("MpiStagedCommunicator::") + collective +
                        " synchronizes the stream and cannot be captured in a CUDA graph; use "
                        "NcclCommunicator (or CudaSelfCommunicator for N = 1) in captured code");
  }

  /// Checks the call, waits until the last copy-back left the receive staging buffer, and copies
  /// `send_bytes` of the device buffer `src` into the send staging buffer.
  void stage_in(const char* collective, const void* src, std::size_t send_bytes,
                std::size_t recv_bytes, stream_type stream) {
    DCPATTN_REQUIRE(comm_.comm() != MPI_COMM_NULL,
                    "MpiStagedCommunicator used after being moved from");
    require_not_capturing(stream, collective);
    const std::size_t need = send_bytes > recv_bytes ? send_bytes : recv_bytes;
    DCPATTN_REQUIRE(need <= capacity_,
                    std::string("MpiStagedCommunicator::") + collective + " needs " +
                        std::to_string(need) + " bytes of staging memory, more than its capacity (" +
                        std::to_string(capacity_) +
                        " bytes); construct it with a larger staging_bytes or call reserve(" +
                        std::to_string(need) + ")");
    DCPATTN_CUDA_CHECK(cudaEventSynchronize(copied_back_));
    DCPATTN_CUDA_CHECK(cudaMemcpyAsync(send_, src, send_bytes, cudaMemcpyDeviceToHost, stream));
    DCPATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
  }

  /// Enqueues the copy of the received bytes to the device buffer `dst` on the stream.
  void stage_out(void* dst, std::size_t bytes, stream_type stream) {
    DCPATTN_CUDA_CHECK(cudaMemcpyAsync(dst, recv_, bytes, cudaMemcpyHostToDevice, stream));
    DCPATTN_CUDA_CHECK(cudaEventRecord(copied_back_, stream));
  }

  void free_staging() noexcept {
    if (send_ != nullptr) cudaFreeHost(send_);
    if (recv_ != nullptr) cudaFreeHost(recv_);
    send_ = nullptr;
    recv_ = nullptr;
    capacity_ = 0;
  }

  void release() noexcept {
    if (copied_back_ != nullptr) {
      cudaEventSynchronize(copied_back_);  // a pending copy-back still reads the staging memory
      cudaEventDestroy(copied_back_);
      copied_back_ = nullptr;
    }
    free_staging();
  }

  MpiCommunicator comm_;
  std::byte* send_ = nullptr;
  std::byte* recv_ = nullptr;
  std::size_t capacity_ = 0;
  cudaEvent_t copied_back_ = nullptr;
};

static_assert(Communicator<MpiStagedCommunicator>, DCPATTN_COMMUNICATOR_MESSAGE);

DCPATTN_NAMESPACE_END
