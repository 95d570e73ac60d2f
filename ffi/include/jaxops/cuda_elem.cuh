// Device-side element helpers shared by the CUDA kernels (include from .cu files only).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "jaxops/dtype.h"

namespace jaxops {

// Element conversions to and from the accumulation type (hardware, round to nearest even).
__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(bf16 x) { return __uint_as_float(uint32_t(x.bits) << 16); }
__device__ __forceinline__ float to_acc(f16 x) { return __half2float(__ushort_as_half(x.bits)); }

template <typename T>
__device__ __forceinline__ T from_acc(acc_t<T> x) {
  if constexpr (std::is_same_v<T, bf16>) return bf16{__bfloat16_as_ushort(__float2bfloat16_rn(x))};
  else if constexpr (std::is_same_v<T, f16>) return f16{__half_as_ushort(__float2half_rn(x))};
  else return x;
}

// V consecutive elements, moved with one access of V * sizeof(T) bytes.
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack { T v[V]; };

}  // namespace jaxops
