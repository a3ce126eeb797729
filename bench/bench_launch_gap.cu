// SPDX-License-Identifier: Apache-2.0
// How long a kernel enqueued behind the benchmarks' L2 flush waits before its first block starts,
// with and without a CUDA event recorded between the two (the start event of median_us_flushed
// sits there). The flush kernel stamps %globaltimer as its blocks finish, the kernel behind it as
// its blocks start; the gap is the latest flush stamp to the earliest kernel stamp, the median
// over 35 calls. The kernel behind is a grid of 128 blocks of 512 threads that does nothing else
// (with 0 and with 220 KiB of dynamic shared memory, as the MLA decode kernels take, and launched
// with and without the programmatic-stream-serialization attribute, as they are). Also the
// event-bracketed time of that empty kernel: what median_us_flushed charges every call on top
// of its own work. JSON records go to argv[1] (default launch_gap.json).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "bench_common.cuh"

namespace {

__device__ unsigned long long g_first_start;

/// Each block's start time; nothing else (waits for the previous grid first, as the MLA decode
/// kernels do when launched as programmatic dependents).
__global__ void empty_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  if (threadIdx.x == 0) atomicMin(&g_first_start, dcpattn::bench::globaltimer_ns());
}

struct Variant {
  const char* name;
  int smem;
  bool programmatic;
  bool event_between;
};

}  // namespace

int main(int argc, char** argv) {
  try {
    using namespace dcpattn::bench;
    cudaStream_t stream;
    DCPATTN_CUDA_CHECK(cudaStreamCreate(&stream));
    const std::size_t flush_bytes = std::size_t(256) << 20;
    DeviceBuffer flush(flush_bytes, 1);
    DeviceBuffer flush_end_buf(sizeof(unsigned long long));  // the end of the flush's last block
    auto* flush_end_ns = static_cast<unsigned long long*>(flush_end_buf.ptr);
    DCPATTN_CUDA_CHECK(
        cudaFuncSetAttribute(empty_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 220 << 10));
    cudaEvent_t e0, e1;
    DCPATTN_CUDA_CHECK(cudaEventCreate(&e0));
    DCPATTN_CUDA_CHECK(cudaEventCreate(&e1));
    const Variant variants[] = {
        {"event between", 0, false, true},
        {"event between, 220 KiB shared", 220 << 10, false, true},
        {"event between, 220 KiB shared, programmatic", 220 << 10, true, true},
        {"no event between", 0, false, false},
        {"no event between, 220 KiB shared, programmatic", 220 << 10, true, false},
    };
    JsonRecords json;
    for (const Variant& v : variants) {
      std::vector<double> gap, bracketed;
      for (int rep = 0; rep < 40; ++rep) {
        const unsigned long long zero = 0, top = ~0ull;
        DCPATTN_CUDA_CHECK(cudaMemcpy(flush_end_ns, &zero, sizeof zero, cudaMemcpyHostToDevice));
        DCPATTN_CUDA_CHECK(cudaMemcpyToSymbol(g_first_start, &top, sizeof top));
        DCPATTN_CUDA_CHECK(cudaDeviceSynchronize());
        read_flush_kernel<<<1024, 256, 0, stream>>>(static_cast<const uint4*>(flush.ptr),
                                                    flush_bytes / 16, nullptr, flush_end_ns);
        if (v.event_between) DCPATTN_CUDA_CHECK(cudaEventRecord(e0, stream));
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(128);
        cfg.blockDim = dim3(512);
        cfg.dynamicSmemBytes = std::size_t(v.smem);
        cfg.stream = stream;
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = attr;
        cfg.numAttrs = v.programmatic ? 1 : 0;
        DCPATTN_CUDA_CHECK(cudaLaunchKernelEx(&cfg, empty_kernel));
        DCPATTN_CUDA_CHECK(cudaEventRecord(e1, stream));
        DCPATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
        unsigned long long flush_end = 0, first_start = 0;
        DCPATTN_CUDA_CHECK(
            cudaMemcpy(&flush_end, flush_end_ns, sizeof flush_end, cudaMemcpyDeviceToHost));
        DCPATTN_CUDA_CHECK(cudaMemcpyFromSymbol(&first_start, g_first_start, sizeof first_start));
        if (rep < 5) continue;  // warm-up
        gap.push_back((double(first_start) - double(flush_end)) / 1e3);
        if (v.event_between) {
          float ms = 0;
          DCPATTN_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
          bracketed.push_back(1e3 * double(ms));
        }
      }
      const auto median = [](std::vector<double> x) {
        std::sort(x.begin(), x.end());
        return x.empty() ? -1.0 : x[x.size() / 2];
      };
      const double g = median(gap), b = median(bracketed);
      std::printf("%-48s flush end -> first block %5.2f us", v.name, g);
      if (b >= 0) std::printf("   empty kernel between events %5.2f us", b);
      std::printf("\n");
      json.begin()
          .field("variant", v.name)
          .field("smem_bytes", v.smem)
          .field("programmatic", v.programmatic ? 1 : 0)
          .field("event_between", v.event_between ? 1 : 0)
          .field("gap_us", g)
          .field("bracketed_us", b);
    }
    json.write(json_path(argc, argv, "launch_gap.json"));
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaStreamDestroy(stream);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_launch_gap: %s\n", e.what());
    return 1;
  }
  return 0;
}
