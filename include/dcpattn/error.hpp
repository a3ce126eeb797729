// SPDX-License-Identifier: Apache-2.0
// dcpattn::Error, the Status returned by configuration checks, and the checking macros.
#pragma once

#include <atomic>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include "dcpattn/config.hpp"

DCPATTN_NAMESPACE_BEGIN

namespace detail {
/// Rank of this process in its DCP group, -1 while unknown. Communicators set it on construction so
/// that every error names the rank that raised it.
inline std::atomic<int>& error_rank_slot() noexcept {
  static std::atomic<int> rank{-1};
  return rank;
}
}  // namespace detail

/// Records the rank reported by every later dcpattn::Error of this process.
inline void set_error_rank(int rank) noexcept { detail::error_rank_slot().store(rank); }
/// The rank recorded by set_error_rank, or -1.
inline int error_rank() noexcept { return detail::error_rank_slot().load(); }

/// The one exception type of the library. what() reads
/// "dcpattn error [rank R] at file:line: <call>: <message>".
class Error : public std::runtime_error {
 public:
  Error(std::string message, std::string call = {}, const char* file = "", int line = 0,
        int rank = error_rank())
      : std::runtime_error(format(message, call, file, line, rank)),
        message_(std::move(message)),
        call_(std::move(call)),
        file_(file ? file : ""),
        line_(line),
        rank_(rank) {}

  /// The library's or backend's description of the failure, without location.
  const std::string& message() const noexcept { return message_; }
  /// The text of the failing call or condition ("" when raised directly).
  const std::string& call() const noexcept { return call_; }
  const std::string& file() const noexcept { return file_; }
  int line() const noexcept { return line_; }
  /// DCP rank of the raising process, -1 when unknown.
  int rank() const noexcept { return rank_; }

 private:
  static std::string format(const std::string& message, const std::string& call, const char* file,
                            int line, int rank) {
    std::string s = "dcpattn error";
    if (rank >= 0) s += " [rank " + std::to_string(rank) + "]";
    if (file && *file) s += std::string(" at ") + file + ":" + std::to_string(line);
    s += ": ";
    if (!call.empty()) s += call + ": ";
    s += message;
    return s;
  }

  std::string message_;
  std::string call_;
  std::string file_;
  int line_;
  int rank_;
};

/// Outcome of a configuration check (`can_implement`). A failed status names the offending
/// parameter in its message, e.g. "num_heads (6) is not divisible by the DCP size (4)".
class Status {
 public:
  static Status success() { return Status{}; }
  static Status failure(std::string message) { return Status{std::move(message)}; }

  bool ok() const noexcept { return !failed_; }
  explicit operator bool() const noexcept { return ok(); }
  /// Empty on success.
  const std::string& message() const noexcept { return message_; }

  /// Throws dcpattn::Error carrying the message when the status is a failure.
  void throw_if_failed(const char* context = "") const {
    if (failed_) throw Error(message_, context ? context : "");
  }

 private:
  Status() = default;
  explicit Status(std::string m) : message_(std::move(m)), failed_(true) {}
  std::string message_;
  bool failed_ = false;
};

namespace detail {
[[noreturn]] inline void throw_error(const char* file, int line, const char* call,
                                     std::string message) {
  throw Error(std::move(message), call, file, line);
}
}  // namespace detail

DCPATTN_NAMESPACE_END

/// Throws dcpattn::Error with `message` (a std::string expression) when `cond` is false.
/// Used for argument checks; the message must name the parameter.
#define DCPATTN_REQUIRE(cond, message)                                       \
  do {                                                                       \
    if (!(cond)) ::dcpattn::detail::throw_error(__FILE__, __LINE__, #cond, (message)); \
  } while (0)

/// Checks a CUDA runtime call; needs <cuda_runtime_api.h> where it is used.
#define DCPATTN_CUDA_CHECK(call)                                                              \
  do {                                                                                        \
    const cudaError_t dcpattn_status_ = (call);                                               \
    if (dcpattn_status_ != cudaSuccess)                                                       \
      ::dcpattn::detail::throw_error(__FILE__, __LINE__, #call,                               \
                                     std::string(cudaGetErrorName(dcpattn_status_)) + ": " + \
                                         cudaGetErrorString(dcpattn_status_));                \
  } while (0)

/// Checks an NCCL call; needs <nccl.h> where it is used.
#define DCPATTN_NCCL_CHECK(call)                                                          \
  do {                                                                                    \
    const ncclResult_t dcpattn_status_ = (call);                                          \
    if (dcpattn_status_ != ncclSuccess && dcpattn_status_ != ncclInProgress)              \
      ::dcpattn::detail::throw_error(__FILE__, __LINE__, #call,                           \
                                     std::string("NCCL: ") + ncclGetErrorString(dcpattn_status_)); \
  } while (0)

/// Checks an MPI call; needs <mpi.h> where it is used.
#define DCPATTN_MPI_CHECK(call)                                                        \
  do {                                                                                 \
    const int dcpattn_status_ = (call);                                                \
    if (dcpattn_status_ != MPI_SUCCESS) {                                              \
      char dcpattn_buf_[MPI_MAX_ERROR_STRING];                                         \
      int dcpattn_len_ = 0;                                                            \
      MPI_Error_string(dcpattn_status_, dcpattn_buf_, &dcpattn_len_);                  \
      ::dcpattn::detail::throw_error(__FILE__, __LINE__, #call,                        \
                                     std::string("MPI: ") +                            \
                                         std::string(dcpattn_buf_, dcpattn_len_));     \
    }                                                                                  \
  } while (0)
