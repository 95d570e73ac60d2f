// A CPU convolution for small inference convolutions: x [N, H, W, C] (NHWC) by w [KH, KW, C, O]
// (HWIO), group 1, f32, into y [N, OH, OW, O]. XLA:CPU's own convolution and windowed_conv's
// im2col + matmul run such convolutions in several thunks at well below the core's FMA peak
// (DeepLabV3's 3-channel 7x7 stem ~60% of it); this is one pass that packs a block of MR
// output pixels' patch rows (kernel rows are contiguous runs in NHWC) and multiplies them
// by 16-channel panels of the weights in registers (an MR x 16 tile of FMAs).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define JAXOPS_CONV_X86 1
#endif

namespace jaxops::conv {

struct Geometry {
  int64_t n, h, w, c;              // x
  int64_t kh, kw, o;               // w: [kh, kw, c, o]
  int64_t oh, ow;                  // y: [n, oh, ow, o]
  int64_t sh, sw, dh, dw, ph, pw;  // strides, dilations, begin pads (the end pads are
                                   // implied by oh, ow: a tap outside x reads zero)
  int64_t k() const { return kh * kw * c; }
};

constexpr int kRows = 6;   // MR: output pixels a tile
constexpr int kCols = 16;  // NR: output channels a tile (two AVX2 registers)

// Checks the geometry; an error message, empty when it is valid. Every size is a buffer's
// own, so only the attributes can be out of range.
inline std::string check(const Geometry& g) {
  if (g.sh < 1 || g.sw < 1 || g.dh < 1 || g.dw < 1) return "strides and dilations must be >= 1";
  if (g.ph < 0 || g.pw < 0) return "pads must be >= 0";
  return {};
}

// The weights [K, O] as panels [ceil(O / 16)][K][16], the last zero-padded.
inline void pack_weights(const Geometry& g, const float* w, float* panels) {
  const int64_t k = g.k(), count = (g.o + kCols - 1) / kCols;
  for (int64_t p = 0; p < count; ++p)
    for (int64_t i = 0; i < k; ++i)
      for (int j = 0; j < kCols; ++j) {
        const int64_t oc = p * kCols + j;
        panels[(p * k + i) * kCols + j] = oc < g.o ? w[i * g.o + oc] : 0.f;
      }
}

// A short run of floats: a loop (memcpy's call and size dispatch cost more at these sizes).
inline void copy_run(float* __restrict dst, const float* __restrict src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
}

// The patch rows [kRows][K] of output pixels m0 .. m0 + rows - 1 (rows past the end repeat
// m0); taps outside x are zero.
inline void pack_patches(const Geometry& g, const float* x, int64_t m0, int rows, float* a) {
  const int64_t run = g.kw * g.c;
  for (int r = 0; r < kRows; ++r) {
    float* row = a + r * g.k();
    const int64_t m = m0 + (r < rows ? r : 0);
    const int64_t ox = m % g.ow, t = m / g.ow, oy = t % g.oh, b = t / g.oh;
    const int64_t iy0 = oy * g.sh - g.ph, ix0 = ox * g.sw - g.pw;
    for (int64_t ky = 0; ky < g.kh; ++ky, row += run) {
      const int64_t iy = iy0 + ky * g.dh;
      if (iy < 0 || iy >= g.h) {
        std::memset(row, 0, sizeof(float) * run);
        continue;
      }
      const float* line = x + (b * g.h + iy) * g.w * g.c;
      if (g.dw == 1 && ix0 >= 0 && ix0 + g.kw <= g.w) {  // the kernel row lies inside x
        copy_run(row, line + ix0 * g.c, run);
        continue;
      }
      for (int64_t kx = 0; kx < g.kw; ++kx) {
        const int64_t ix = ix0 + kx * g.dw;
        if (ix >= 0 && ix < g.w) copy_run(row + kx * g.c, line + ix * g.c, g.c);
        else std::memset(row + kx * g.c, 0, sizeof(float) * g.c);
      }
    }
  }
}

// y[r, :] for the tile's rows, from its accumulators [kRows][kCols], the last panel's
// columns cut to what O leaves.
inline void store_tile(const float* acc, int rows, int64_t cols, int64_t o, float* y) {
  if (cols == kCols) {
    for (int r = 0; r < rows; ++r) std::memcpy(y + r * o, acc + r * kCols, sizeof(float) * kCols);
    return;
  }
  for (int r = 0; r < rows; ++r) copy_run(y + r * o, acc + r * kCols, cols);
}

// The tile in plain C++: any CPU.
inline void tile_generic(int64_t k, const float* a, const float* panel, float* acc) {
  for (int i = 0; i < kRows * kCols; ++i) acc[i] = 0.f;
  for (int64_t i = 0; i < k; ++i, panel += kCols)
    for (int r = 0; r < kRows; ++r) {
      const float v = a[r * k + i];
      for (int j = 0; j < kCols; ++j) acc[r * kCols + j] += v * panel[j];
    }
}

#ifdef JAXOPS_CONV_X86
// The tile on AVX2 + FMA: 12 accumulators, two weight loads and six broadcasts a step of K.
__attribute__((target("avx2,fma"))) inline void tile_avx2(int64_t k, const float* a,
                                                          const float* panel, float* acc) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
         c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  const float *a0 = a, *a1 = a + k, *a2 = a + 2 * k, *a3 = a + 3 * k, *a4 = a + 4 * k,
              *a5 = a + 5 * k;
  for (int64_t i = 0; i < k; ++i, panel += kCols) {
    const __m256 b0 = _mm256_loadu_ps(panel), b1 = _mm256_loadu_ps(panel + 8);
    __m256 v = _mm256_broadcast_ss(a0 + i);
    c00 = _mm256_fmadd_ps(v, b0, c00), c01 = _mm256_fmadd_ps(v, b1, c01);
    v = _mm256_broadcast_ss(a1 + i);
    c10 = _mm256_fmadd_ps(v, b0, c10), c11 = _mm256_fmadd_ps(v, b1, c11);
    v = _mm256_broadcast_ss(a2 + i);
    c20 = _mm256_fmadd_ps(v, b0, c20), c21 = _mm256_fmadd_ps(v, b1, c21);
    v = _mm256_broadcast_ss(a3 + i);
    c30 = _mm256_fmadd_ps(v, b0, c30), c31 = _mm256_fmadd_ps(v, b1, c31);
    v = _mm256_broadcast_ss(a4 + i);
    c40 = _mm256_fmadd_ps(v, b0, c40), c41 = _mm256_fmadd_ps(v, b1, c41);
    v = _mm256_broadcast_ss(a5 + i);
    c50 = _mm256_fmadd_ps(v, b0, c50), c51 = _mm256_fmadd_ps(v, b1, c51);
  }
  const __m256 all[] = {c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51};
  for (int i = 0; i < 2 * kRows; ++i) _mm256_storeu_ps(acc + 8 * i, all[i]);
}

inline bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}
#endif

// y = conv(x, w) over the whole batch, on the calling thread.
inline void convolve(const Geometry& g, const float* x, const float* w, float* y) {
  const int64_t k = g.k(), count = (g.o + kCols - 1) / kCols, m = g.n * g.oh * g.ow;
  std::vector<float> panels(count * k * kCols), a(kRows * k);
  alignas(32) float acc[kRows * kCols];
  pack_weights(g, w, panels.data());
  auto tile = tile_generic;
#ifdef JAXOPS_CONV_X86
  if (has_avx2()) tile = tile_avx2;
#endif
  for (int64_t m0 = 0; m0 < m; m0 += kRows) {
    const int rows = int(m - m0 < kRows ? m - m0 : kRows);
    pack_patches(g, x, m0, rows, a.data());
    for (int64_t p = 0; p < count; ++p) {
      tile(k, a.data(), panels.data() + p * k * kCols, acc);
      const int64_t cols = g.o - p * kCols < kCols ? g.o - p * kCols : kCols;
      store_tile(acc, rows, cols, g.o, y + m0 * g.o + p * kCols);
    }
  }
}

}  // namespace jaxops::conv
