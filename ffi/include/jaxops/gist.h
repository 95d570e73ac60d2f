// GistPackMsfp15Encoder / GistPackMsfp15Decoder, one 8-element tile at a time, written once for
// the CPU handlers and the CUDA kernels (the format: jaxops/ops/gist.py). The other GIST ops
// are XLA code: elementwise, they fuse; these need the whole tile per element, which XLA
// turns into a reduction kernel plus a second pass over X.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "jaxops/checks.h"
#include "jaxops/dtype.h"

namespace jaxops::gist {

constexpr int kTile = 8;  // element i of a tile carries bit i of the shared exponent

// Position of the highest set bit of m (m > 0).
JAXOPS_HD int leading_bit(uint32_t m) {
#if defined(__CUDA_ARCH__)
  return 31 - __clz(m);
#else
  return 31 - __builtin_clz(m);
#endif
}

// 8 float32 bit patterns -> 8 bytes: bit i of the largest biased exponent Es in byte i's
// bit 7, the sign in bit 6, round-half-up(|x| / 2^(Es - 132)) in bits 0-5 (saturating at 63).
JAXOPS_HD void msfp15_encode(const uint32_t* x, uint8_t* out) {
  uint32_t shared = 0;
  for (int i = 0; i < kTile; ++i) {
    const uint32_t e = (x[i] >> 23) & 0xFF;
    shared = e > shared ? e : shared;
  }
  for (int i = 0; i < kTile; ++i) {
    const uint32_t e = (x[i] >> 23) & 0xFF, diff = shared - e;
    uint32_t m = diff > 31 ? 0 : ((x[i] & 0x007FFFFF) | 0x00800000) >> diff;
    m >>= 17;                      // 7 bits: 6 kept, 1 to round on
    m = (m == 127 ? m : m + 1) >> 1;
    const uint32_t value = e == 0 ? 0 : ((x[i] >> 25) & 0x40) | m;  // denormals: +0
    const uint32_t byte = (((shared >> i) & 1) << 7) | value;
    out[i] = uint8_t(shared == 0xFF ? 0 : byte);  // inf or NaN in the tile: all zeros
  }
}

// The shared exponent Es of a packed tile: bit i is bit 7 of byte i.
JAXOPS_HD uint32_t msfp15_shared(const uint8_t* b) {
  uint32_t shared = 0;
  for (int i = 0; i < kTile; ++i) shared |= uint32_t(b[i] >> 7) << i;
  return shared;
}

// One packed byte -> float32 bits: +-m * 2^(Es - 132); m = 0 gives +0. Es - (5 - lead)
// wraps for tiny tiles, as ORT's uint32 arithmetic does.
JAXOPS_HD uint32_t msfp15_decode(uint8_t b, uint32_t shared) {
  const uint32_t m = b & 0x3F;
  const int diff = 5 - leading_bit(m > 0 ? m : 1);
  const uint32_t exp = shared - uint32_t(diff);
  const uint32_t mant = (m << (18 + diff)) & 0x007FFFFF;
  return m == 0 ? 0 : (uint32_t(b & 0x40) << 25) | (exp << 23) | mant;
}

// The FFI signature of both ops (CPU: as is; CUDA: after its stream): X -> Y, no attributes.
template <typename Binding>
auto bind_args(Binding b) {
  return std::move(b).template Arg<ffi::AnyBuffer>().template Ret<ffi::AnyBuffer>();
}

// Checks shared by the handlers: dtypes, one shape, whole tiles along the last axis.
inline std::string check(const ffi::AnyBuffer& x, const ffi::AnyBuffer& y, ffi::DataType in,
                         ffi::DataType out) {
  for (auto err : {check_type("X", x.element_type(), types_of({in})),
                   check_type("Y", y.element_type(), types_of({out}))})
    if (!err.empty()) return err;
  if (!same_dims(x, y)) return "X and Y must share one shape";
  auto dx = x.dimensions();
  if (dx.size() == 0 || dx[dx.size() - 1] % kTile != 0)
    return "X's last dim must be a multiple of 8";
  return "";
}

}  // namespace jaxops::gist
