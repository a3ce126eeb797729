// SPDX-License-Identifier: Apache-2.0
// Shared pieces of the GPU benchmarks: CUDA-event timing with warm-up and medians, the device's
// measured copy bandwidth (the memory ceiling every figure is set against), and JSON output.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime.h>
#include <dlfcn.h>

#include "dcpattn/core/numeric.hpp"
#include "dcpattn/error.hpp"

namespace dcpattn::bench {

/// A device allocation for one benchmark case; `fill` >= 0 sets every byte (e.g. 0x3c: bf16 and
/// fp32 values near 0.0115, finite and nonzero, for buffers whose values do not matter).
/// The contents are in place when the constructor returns: the memset and the copy run on the
/// legacy stream (a pageable copy may return before it has landed), which the benchmarks'
/// non-blocking streams do not wait for, so the constructor synchronizes the device.
struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(std::size_t bytes, int fill = -1) {
    DCPATTN_CUDA_CHECK(cudaMalloc(&ptr, bytes ? bytes : 1));
    if (fill >= 0) {
      DCPATTN_CUDA_CHECK(cudaMemset(ptr, fill, bytes ? bytes : 1));
      DCPATTN_CUDA_CHECK(cudaDeviceSynchronize());
    }
  }
  /// A device copy of a host vector.
  template <class T>
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size() * sizeof(T)) {
    DCPATTN_CUDA_CHECK(
        cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
    DCPATTN_CUDA_CHECK(cudaDeviceSynchronize());
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { cudaFree(ptr); }
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr);
  }
};

/// A 64-bit mix to 32 random bits, for filling inputs on the device.
__device__ inline std::uint32_t hash32(std::uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return std::uint32_t(x);
}
/// Uniform in [0, 1) from (seed, i).
__device__ inline float uniform(std::uint64_t seed, std::size_t i) {
  return float(hash32(seed * 0x9e3779b97f4a7c15ull + i) >> 8) * (1.0f / 16777216.0f);
}
/// Random bf16 in [lo, hi) (never all zeros: zeros hide wrong indexing and can run faster).
static __global__ void fill_bf16(bfloat16* p, std::size_t n, std::uint64_t seed, float lo,
                                 float hi) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x)
    p[i] = bfloat16::from_float(lo + (hi - lo) * uniform(seed, i));
}

/// Median time in microseconds of `fn()` (which enqueues work on `stream`), after `warmup` calls,
/// over `reps` calls timed one by one with CUDA events.
template <class Fn>
double median_us(Fn&& fn, cudaStream_t stream, int warmup = 10, int reps = 50) {
  for (int i = 0; i < warmup; ++i) fn();
  DCPATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
  cudaEvent_t a, b;
  DCPATTN_CUDA_CHECK(cudaEventCreate(&a));
  DCPATTN_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<double> us(static_cast<std::size_t>(reps));
  for (int i = 0; i < reps; ++i) {
    DCPATTN_CUDA_CHECK(cudaEventRecord(a, stream));
    fn();
    DCPATTN_CUDA_CHECK(cudaEventRecord(b, stream));
    DCPATTN_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    DCPATTN_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    us[static_cast<std::size_t>(i)] = 1000.0 * ms;
  }
  DCPATTN_CUDA_CHECK(cudaGetLastError());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

/// Median time per call in microseconds of `fn()` (which enqueues capturable work on `stream`)
/// captured `calls_per_graph` times back to back into one CUDA graph: `warmup` replays, then
/// `reps` replays timed one by one with events, the median over calls_per_graph. Each timed
/// replay is enqueued behind an untimed one, so the GPU is busy while the host launches it: no
/// host launch work is measured (what a graph-captured decode step sees), only the launch gaps
/// inside the graph. A fn that rotates input sets walks them in order at capture time.
template <class Fn>
double median_us_graph(Fn&& fn, cudaStream_t stream, int calls_per_graph, int warmup = 3,
                       int reps = 20) {
  cudaGraph_t graph = nullptr;
  DCPATTN_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  try {
    for (int i = 0; i < calls_per_graph; ++i) fn();
  } catch (...) {
    (void)cudaStreamEndCapture(stream, &graph);
    if (graph) cudaGraphDestroy(graph);
    throw;
  }
  DCPATTN_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  DCPATTN_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < warmup; ++i) DCPATTN_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  DCPATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
  cudaEvent_t a, b;
  DCPATTN_CUDA_CHECK(cudaEventCreate(&a));
  DCPATTN_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<double> us(static_cast<std::size_t>(reps));
  for (int i = 0; i < reps; ++i) {
    DCPATTN_CUDA_CHECK(cudaGraphLaunch(exec, stream));  // untimed: keeps the GPU ahead of the host
    DCPATTN_CUDA_CHECK(cudaEventRecord(a, stream));
    DCPATTN_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    DCPATTN_CUDA_CHECK(cudaEventRecord(b, stream));
    DCPATTN_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    DCPATTN_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    us[static_cast<std::size_t>(i)] = 1000.0 * ms / calls_per_graph;
  }
  DCPATTN_CUDA_CHECK(cudaGetLastError());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

/// How median_us_flushed empties the L2 cache before each timed call.
enum class Flush {
  /// cudaMemsetAsync over the buffer, as triton.testing.do_bench: the L2 is left full of dirty
  /// lines, whose write-back to HBM can land in the timed call (under 3 us on the H200's batch-1
  /// MLA decode calls).
  write,
  /// A kernel reads the buffer: the L2 is left full of clean lines, none of them fn's inputs.
  read,
};

/// The GPU's global nanosecond timer (%globaltimer).
__device__ __forceinline__ unsigned long long globaltimer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

/// Reads n 16-byte words; stores to *sink only if their XOR is a value no fill produces, so the
/// reads cannot be elided and nothing is written. With `end_ns`, each block also raises *end_ns
/// to the %globaltimer value at its end (bench_launch_gap).
__global__ void read_flush_kernel(const uint4* __restrict__ p, std::size_t n, unsigned* sink,
                                  unsigned long long* end_ns = nullptr) {
  unsigned x = 0;
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x) {
    const uint4 v = p[i];
    x ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (x == 0x9e3779b9u && sink != nullptr) *sink = x;
  if (end_ns != nullptr) {
    __syncthreads();
    if (threadIdx.x == 0) atomicMax(end_ns, globaltimer_ns());
  }
}

/// Empties the L2 by writing or reading `bytes` bytes of `buf` (a multiple of 16) on `stream`.
inline void flush_l2(void* buf, std::size_t bytes, Flush mode, int fill, cudaStream_t stream) {
  if (mode == Flush::write) {
    DCPATTN_CUDA_CHECK(cudaMemsetAsync(buf, fill, bytes, stream));
  } else {
    read_flush_kernel<<<1024, 256, 0, stream>>>(static_cast<const uint4*>(buf), bytes / 16,
                                                nullptr);
    DCPATTN_CUDA_CHECK(cudaGetLastError());
  }
}

/// Median time in microseconds of one call of `fn()` enqueued behind a flush of `flush_bytes`
/// bytes of `flush` (256 MiB in triton.testing.do_bench; see Flush): the L2 cache holds none of
/// fn's inputs, and the GPU is busy while the host launches fn, so host launch work is not
/// measured. The method of triton.testing.do_bench: events around each call, `reps` calls
/// enqueued back to back, one synchronization at the end.
template <class Fn>
double median_us_flushed(Fn&& fn, cudaStream_t stream, void* flush, std::size_t flush_bytes,
                         int warmup = 10, int reps = 50, Flush mode = Flush::write) {
  for (int i = 0; i < warmup; ++i) fn();
  DCPATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<cudaEvent_t> ev(static_cast<std::size_t>(2 * reps));
  for (auto& e : ev) DCPATTN_CUDA_CHECK(cudaEventCreate(&e));
  for (int i = 0; i < reps; ++i) {
    flush_l2(flush, flush_bytes, mode, i & 0xff, stream);
    DCPATTN_CUDA_CHECK(cudaEventRecord(ev[std::size_t(2 * i)], stream));
    fn();
    DCPATTN_CUDA_CHECK(cudaEventRecord(ev[std::size_t(2 * i + 1)], stream));
  }
  DCPATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
  DCPATTN_CUDA_CHECK(cudaGetLastError());
  std::vector<double> us(static_cast<std::size_t>(reps));
  for (int i = 0; i < reps; ++i) {
    float ms = 0;
    DCPATTN_CUDA_CHECK(
        cudaEventElapsedTime(&ms, ev[std::size_t(2 * i)], ev[std::size_t(2 * i + 1)]));
    us[static_cast<std::size_t>(i)] = 1000.0 * ms;
  }
  for (auto& e : ev) cudaEventDestroy(e);
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

/// Median time in microseconds of one call of `fn()` enqueued right behind a flush, with no event
/// between the two: each repetition times [flush] and [flush, fn] (events around each) and takes
/// the difference. median_us_flushed's start event sits between the flush and fn, and an event
/// there delays the next kernel's first block (bench_launch_gap: 3.1 us on the H200, against
/// 0.8 us for a kernel enqueued right behind another); here fn starts as it would behind any
/// kernel. Each timed flush follows an untimed one, so that neither pays for writing back fn's
/// dirty lines. For fn of several hundred us the sustained load of a flush and fn back to back
/// lowers the SM clock, and this figure exceeds median_us_flushed's.
template <class Fn>
double median_us_behind_flush(Fn&& fn, cudaStream_t stream, void* flush, std::size_t flush_bytes,
                              int warmup = 5, int reps = 30, Flush mode = Flush::read) {
  for (int i = 0; i < warmup; ++i) fn();
  DCPATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<cudaEvent_t> ev(static_cast<std::size_t>(4 * reps));
  for (auto& e : ev) DCPATTN_CUDA_CHECK(cudaEventCreate(&e));
  for (int i = 0; i < reps; ++i) {
    cudaEvent_t* e = &ev[std::size_t(4 * i)];
    flush_l2(flush, flush_bytes, mode, i & 0xff, stream);  // untimed
    DCPATTN_CUDA_CHECK(cudaEventRecord(e[0], stream));
    flush_l2(flush, flush_bytes, mode, i & 0xff, stream);
    DCPATTN_CUDA_CHECK(cudaEventRecord(e[1], stream));
    flush_l2(flush, flush_bytes, mode, i & 0xff, stream);  // untimed
    DCPATTN_CUDA_CHECK(cudaEventRecord(e[2], stream));
    flush_l2(flush, flush_bytes, mode, i & 0xff, stream);
    fn();
    DCPATTN_CUDA_CHECK(cudaEventRecord(e[3], stream));
  }
  DCPATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
  DCPATTN_CUDA_CHECK(cudaGetLastError());
  std::vector<double> us(static_cast<std::size_t>(reps));
  for (int i = 0; i < reps; ++i) {
    const cudaEvent_t* e = &ev[std::size_t(4 * i)];
    float flush_ms = 0, both_ms = 0;
    DCPATTN_CUDA_CHECK(cudaEventElapsedTime(&flush_ms, e[0], e[1]));
    DCPATTN_CUDA_CHECK(cudaEventElapsedTime(&both_ms, e[2], e[3]));
    us[static_cast<std::size_t>(i)] = 1000.0 * (double(both_ms) - double(flush_ms));
  }
  for (auto& e : ev) cudaEventDestroy(e);
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

/// One thread counts clock64() cycles over `ns` nanoseconds of %globaltimer; *mhz = the ratio.
static __global__ void sm_clock_kernel(double* mhz, unsigned long long ns) {
  const unsigned long long t0 = globaltimer_ns();
  const long long c0 = clock64();
  unsigned long long t1 = t0;
  while (t1 - t0 < ns) t1 = globaltimer_ns();
  const long long c1 = clock64();
  *mhz = 1e3 * double(c1 - c0) / double(t1 - t0);
}

/// The SM clock in MHz at this point of `stream` (about 200 us of one thread spinning; the power
/// manager moves the clock on a scale of 100 ms, so right behind timed calls this is the clock
/// they ran at).
inline double sm_clock_mhz(cudaStream_t stream) {
  double* d = nullptr;
  DCPATTN_CUDA_CHECK(cudaMalloc(&d, sizeof(double)));
  sm_clock_kernel<<<1, 1, 0, stream>>>(d, 200000ull);
  double mhz = 0;
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess)
    DCPATTN_CUDA_CHECK(cudaMemcpyAsync(&mhz, d, sizeof(double), cudaMemcpyDeviceToHost, stream));
  DCPATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
  cudaFree(d);
  DCPATTN_CUDA_CHECK(e);
  return mhz;
}

/// What sustain did: the calls it made and the milliseconds they took.
struct Sustained {
  long calls = 0;
  double ms = 0.0;
};
/// Keeps the GPU busy with `fn()` for about `ms` milliseconds of wall time (batches of 8 calls,
/// a synchronization between batches). Within 100-200 ms of a heavy load the H200's power manager
/// lowers the SM clock (reason: software power cap, 700 W): the dense bf16 MLA decode kernels at
/// 128 heads settle at 1.5-1.7 GHz instead of 1.98, while lighter kernels keep 1.98 GHz. A
/// benchmark that times a case in its first milliseconds measures the unthrottled clock, or,
/// in a sweep, whatever clock the cases before it left (docs/performance.md, run 28).
template <class Fn>
Sustained sustain(Fn&& fn, cudaStream_t stream, double ms) {
  Sustained r;
  const auto t0 = std::chrono::steady_clock::now();
  while (r.ms < ms) {
    for (int i = 0; i < 8; ++i) fn();
    r.calls += 8;
    DCPATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
    r.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }
  return r;
}

/// The GPU's energy counter (NVML's total energy consumption, mJ), reached through the driver's
/// libnvidia-ml.so.1 at run time so that the benchmarks neither link nor need NVML: where the
/// library, a symbol or the device is missing, available() is false and mj() returns -1.
class EnergyCounter {
 public:
  explicit EnergyCounter(int cuda_device) {
    lib_ = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib_ == nullptr) return;
    using Init = int (*)();
    using ByPci = int (*)(const char*, void**);
    const auto init = reinterpret_cast<Init>(dlsym(lib_, "nvmlInit_v2"));
    const auto by_pci = reinterpret_cast<ByPci>(dlsym(lib_, "nvmlDeviceGetHandleByPciBusId_v2"));
    get_ = reinterpret_cast<Get>(dlsym(lib_, "nvmlDeviceGetTotalEnergyConsumption"));
    char bus[32] = {};
    if (init == nullptr || by_pci == nullptr || get_ == nullptr || init() != 0 ||
        cudaDeviceGetPCIBusId(bus, int(sizeof(bus)), cuda_device) != cudaSuccess ||
        by_pci(bus, &device_) != 0) {
      get_ = nullptr;
      return;
    }
    unsigned long long e = 0;
    if (get_(device_, &e) != 0) get_ = nullptr;  // no counter on this GPU (before Volta)
  }
  EnergyCounter(const EnergyCounter&) = delete;
  EnergyCounter& operator=(const EnergyCounter&) = delete;
  ~EnergyCounter() {
    if (lib_ != nullptr) dlclose(lib_);
  }
  bool available() const { return get_ != nullptr; }
  /// Millijoules since the driver was loaded, or -1.
  double mj() const {
    unsigned long long e = 0;
    return get_ != nullptr && get_(device_, &e) == 0 ? double(e) : -1.0;
  }

 private:
  using Get = int (*)(void*, unsigned long long*);
  void* lib_ = nullptr;
  void* device_ = nullptr;
  Get get_ = nullptr;
};

/// Calls back to back: `fn()` for about `ms` milliseconds (sustain), the energy counter read at
/// the window's two ends. `us_per_call` is the window's wall time over its calls: the steady-state
/// time of a call that nothing separates from the next (no flush, no event; a busy GPU's clock),
/// what a serving loop sees; it is measured with or without a counter. The counter advances in
/// steps of tens of milliseconds, so windows of several hundred milliseconds are needed.
/// {us per call, mJ per call, mean W, calls}; -1 for what was not measured (ms <= 0, or no
/// counter for the energy).
struct BackToBack {
  double us_per_call = -1.0, mj_per_call = -1.0, watts = -1.0;
  long calls = 0;
};
template <class Fn>
BackToBack back_to_back(Fn&& fn, cudaStream_t stream, double ms, const EnergyCounter& ec) {
  BackToBack r;
  if (ms <= 0) return r;
  DCPATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
  const double e0 = ec.available() ? ec.mj() : -1.0;
  const Sustained run = sustain(fn, stream, ms);
  const double e1 = ec.available() ? ec.mj() : -1.0;
  r.calls = run.calls;
  r.us_per_call = 1e3 * run.ms / double(run.calls);
  if (e0 < 0 || e1 < 0) return r;
  r.mj_per_call = (e1 - e0) / double(run.calls);
  r.watts = (e1 - e0) / run.ms;  // mJ / ms
  return r;
}

/// Device-to-device copy bandwidth in GB/s (bytes read + bytes written), measured on a buffer
/// several times the L2 size: the practical memory ceiling of this GPU.
inline double measure_copy_bandwidth_gbs(cudaStream_t stream, std::size_t bytes = std::size_t(2)
                                                                                  << 30) {
  void *src = nullptr, *dst = nullptr;
  DCPATTN_CUDA_CHECK(cudaMalloc(&src, bytes));
  DCPATTN_CUDA_CHECK(cudaMalloc(&dst, bytes));
  DCPATTN_CUDA_CHECK(cudaMemsetAsync(src, 1, bytes, stream));
  const double us = median_us(
      [&] {
        DCPATTN_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
      },
      stream, 3, 20);
  cudaFree(src);
  cudaFree(dst);
  return 2.0 * double(bytes) / (us * 1e3);
}

/// Input sets a benchmark rotates over for a call that moves `bytes` bytes: enough that 3x the L2
/// size passes between two uses of one set, at most 64 (the rule the Python peers use too).
inline int rotation_sets(double bytes, std::size_t l2_bytes) {
  return int(std::clamp<double>(std::ceil(3.0 * double(l2_bytes) / bytes), 1.0, 64.0));
}

/// dst[i] = src[i], 16 bytes per thread: the copy a memory-bound kernel is set against.
static __global__ void copy16_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                     std::size_t n) {
  const std::size_t i = std::size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = src[i];
}

/// Per-call time in microseconds of a copy that moves `bytes` bytes (bytes / 2 read, bytes / 2
/// written, one 16-byte vector per thread), timed as the benchmarks time a kernel: CUDA-graph
/// replays of back-to-back calls, rotating over rotation_sets buffer pairs. A kernel that moves few
/// bytes cannot reach the copy bandwidth of 2 GiB buffers (launch, ramp-up and drain weigh); this
/// is the ceiling at its size.
inline double same_size_copy_us(double bytes, std::size_t l2_bytes, cudaStream_t stream) {
  const std::size_t half = std::max<std::size_t>(std::size_t(bytes / 2) / 16 * 16, 16);
  const int sets = rotation_sets(2.0 * double(half), l2_bytes);
  void *src = nullptr, *dst = nullptr;
  DCPATTN_CUDA_CHECK(cudaMalloc(&src, sets * half));
  DCPATTN_CUDA_CHECK(cudaMalloc(&dst, sets * half));
  DCPATTN_CUDA_CHECK(cudaMemsetAsync(src, 1, sets * half, stream));
  const std::size_t n = half / 16;
  int it = 0;
  auto call = [&] {
    const std::size_t i = std::size_t(it++ % sets);
    copy16_kernel<<<unsigned((n + 255) / 256), 256, 0, stream>>>(
        reinterpret_cast<const uint4*>(static_cast<const std::byte*>(src) + i * half),
        reinterpret_cast<uint4*>(static_cast<std::byte*>(dst) + i * half), n);
  };
  call();  // loads the kernel before the capture
  DCPATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
  it = 0;
  const int calls = (std::max(20, sets) + sets - 1) / sets * sets;
  const double us = median_us_graph(call, stream, calls);
  cudaFree(src);
  cudaFree(dst);
  return us;
}

/// Collects flat records and writes them as a JSON array: [{"key": value, ...}, ...].
class JsonRecords {
 public:
  JsonRecords& begin() {
    rows_.emplace_back();
    return *this;
  }
  JsonRecords& field(const std::string& k, double v) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.10g", v);  // integers up to 2^33 exactly (lengths, bytes)
    rows_.back().emplace_back(k, buf);
    return *this;
  }
  JsonRecords& field(const std::string& k, const std::string& v) {
    rows_.back().emplace_back(k, "\"" + v + "\"");
    return *this;
  }
  void write(const std::string& path) const {
    FILE* f = std::fopen(path.c_str(), "w");
    if (!f) throw dcpattn::Error("cannot open " + path + " for writing");
    std::fprintf(f, "[\n");
    for (std::size_t r = 0; r < rows_.size(); ++r) {
      std::fprintf(f, "  {");
      for (std::size_t i = 0; i < rows_[r].size(); ++i)
        std::fprintf(f, "%s\"%s\": %s", i ? ", " : "", rows_[r][i].first.c_str(),
                     rows_[r][i].second.c_str());
      std::fprintf(f, "}%s\n", r + 1 < rows_.size() ? "," : "");
    }
    std::fprintf(f, "]\n");
    std::fclose(f);
  }

 private:
  std::vector<std::vector<std::pair<std::string, std::string>>> rows_;
};

/// Output path for a benchmark's JSON: argv[1] if given, else `fallback`.
inline std::string json_path(int argc, char** argv, const char* fallback) {
  return argc > 1 ? std::string(argv[1]) : std::string(fallback);
}

}  // namespace dcpattn::bench
