// Element types shared by the CPU and CUDA handlers: 16-bit floats as raw storage, the one
// conversion API to and from the accumulation type (to_acc, from_acc, load, store; host and
// device), and a dtype dispatcher.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define JAXOPS_HD __host__ __device__ __forceinline__
#else
#define JAXOPS_HD inline
#endif

namespace jaxops {

namespace ffi = xla::ffi;

// Storage-only 16-bit floats. Kernels load them, compute in f32 and store back,
// so neither the host nor the device needs a native half type here.
struct f16 { uint16_t bits; };
struct bf16 { uint16_t bits; };

// Software conversions, bit-exact IEEE with round to nearest even (as XLA converts): the
// host's, which has no native 16-bit float type in C++17 (from_acc/to_acc below are the API).
namespace detail {

inline float bits_to_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t f32_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

inline float bf16_to_f32(bf16 x) { return bits_to_f32(uint32_t(x.bits) << 16); }
inline float f16_to_f32(f16 x) {
  // IEEE half -> single, including subnormals, inf and nan.
  uint32_t h = x.bits, sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_f32(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    float m = float(man) * (1.0f / 16777216.0f);  // man * 2^-24
    return sign ? -m : m;
  }
  return bits_to_f32(sign | ((exp + 112) << 23) | (man << 13));
}

inline bf16 f32_to_bf16(float f) {
  uint32_t u = f32_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{uint16_t((u >> 16) | 0x40)};  // quiet nan
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{uint16_t(u >> 16)};
}
inline f16 f32_to_f16(float f) {
  uint32_t u = f32_to_bits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return f16{uint16_t(sign | 0x7e00u)};      // nan
  if (a >= 0x477ff000u) return f16{uint16_t(sign | 0x7c00u)};      // overflow -> inf
  if (a < 0x38800000u) {                                           // subnormal or zero
    // Scale so the result's ulp (2^-24) becomes 1, then round to nearest even.
    float v = bits_to_f32(a) * 16777216.0f;
    uint32_t m = uint32_t(v);
    float rem = v - float(m);
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
    return f16{uint16_t(sign | m)};
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u) - (112u << 23);
  return f16{uint16_t(sign | (r >> 13))};
}

}  // namespace detail

// The type arithmetic runs in: f64 for f64, f32 for everything else.
template <typename T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };
template <typename T> using acc_t = typename Acc<T>::type;

// The one conversion API: to_acc widens a stored element to acc_t, from_acc<T> rounds back
// (to nearest even). Device code uses the hardware conversions of cuda_fp16.h/cuda_bf16.h
// (one instruction each; the software forms compile to longer sequences, and the tuned
// kernels were measured with these), host code the software ones above. The two agree on
// every value but NaN payloads: a NaN stays NaN, its payload bits may differ.
JAXOPS_HD float to_acc(float x) { return x; }
JAXOPS_HD double to_acc(double x) { return x; }
JAXOPS_HD float to_acc(bf16 x) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(uint32_t(x.bits) << 16);
#else
  return detail::bf16_to_f32(x);
#endif
}
JAXOPS_HD float to_acc(f16 x) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(x.bits));
#else
  return detail::f16_to_f32(x);
#endif
}

template <typename T>
JAXOPS_HD T from_acc(acc_t<T> x) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, bf16>) return bf16{__bfloat16_as_ushort(__float2bfloat16_rn(x))};
  else if constexpr (std::is_same_v<T, f16>) return f16{__half_as_ushort(__float2half_rn(x))};
  else return x;
#else
  if constexpr (std::is_same_v<T, bf16>) return detail::f32_to_bf16(x);
  else if constexpr (std::is_same_v<T, f16>) return detail::f32_to_f16(x);
  else return x;
#endif
}

// Element i of p, in acc_t; and the same, rounded back into p.
template <typename T> JAXOPS_HD acc_t<T> load(const T* p, int64_t i) { return to_acc(p[i]); }
template <typename T> JAXOPS_HD void store(T* p, int64_t i, acc_t<T> v) { p[i] = from_acc<T>(v); }

// Calls f(T{}) with T the storage type of a floating dtype; false if unsupported.
template <typename F>
bool dispatch_float(ffi::DataType dt, F&& f) {
  switch (dt) {
    case ffi::DataType::F32: f(float{}); return true;
    case ffi::DataType::F64: f(double{}); return true;
    case ffi::DataType::F16: f(f16{}); return true;
    case ffi::DataType::BF16: f(bf16{}); return true;
    default: return false;
  }
}

}  // namespace jaxops
