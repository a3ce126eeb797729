// SPDX-License-Identifier: Apache-2.0
// Register conversions the CUDA kernels share: two floats to a bf16 pair in one instruction, a
// bf16 half of a word back to a float, and an e4m3 pair to two floats through the hardware
// fp8 -> f16 conversion. Both give the values of
// the library's scalar routines (bfloat16::from_float, fp8_e4m3::decode) for non-NaN inputs.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "dcpattn/config.hpp"
#include "dcpattn/core/numeric.hpp"

DCPATTN_NAMESPACE_BEGIN

namespace cuda_kernels::detail {

/// bfloat16::from_float(lo) | bfloat16::from_float(hi) << 16 for non-NaN lo and hi (round to
/// nearest even, subnormals kept, overflow to infinity: what from_float computes on the bits).
DCPATTN_DEVICE std::uint32_t cvt_bf16x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  std::uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));  // first source: high half
  return r;
#else
  return std::uint32_t(bfloat16::from_float(lo).bits) |
         (std::uint32_t(bfloat16::from_float(hi).bits) << 16);
#endif
}

/// The bfloat16 in the low / high half of a word, as fp32 (bfloat16::to_float).
DCPATTN_DEVICE float bf16_lo(std::uint32_t u) {
  return __uint_as_float(u << 16);
}
DCPATTN_DEVICE float bf16_hi(std::uint32_t u) {
  return __uint_as_float(u & 0xffff0000u);
}

/// The two e4m3 codes in the low 16 bits of `two` (low byte first) as floats, exactly: every e4m3
/// value is an f16 value, and every f16 value a float (fp8_e4m3::decode of each byte).
DCPATTN_DEVICE float2 e4m3x2_to_float2(std::uint32_t two) {
  return __half22float2(
      __half2(__nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(two & 0xffffu), __NV_E4M3)));
}

}  // namespace cuda_kernels::detail

DCPATTN_NAMESPACE_END
