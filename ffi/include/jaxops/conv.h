// A CPU convolution for small inference convolutions: x [N, H, W, C] (NHWC) by w
// [KH, KW, C / G, O] (HWIO, G groups: output channel j reads input channels of group
// j / (O / G)), f32, into y [N, OH, OW, O]. XLA:CPU's own convolution and windowed_conv's
// im2col + matmul run such convolutions in several thunks at well below the core's FMA peak
// (DeepLabV3's 3-channel 7x7 stem ~60% of it); this is one pass that multiplies a block of
// MR output pixels' patch rows (kernel rows are contiguous runs in NHWC: read where they lie
// in x or a zero-bordered copy of it, packed where groups or dilations split them) by
// 16-channel panels of the weights in registers (a tile of FMAs: 6 pixels x 16 channels
// on AVX2, 12 x 32 on AVX-512, picked at run time). Where the pads cost much (a dilated 3x3
// on a small map reads pads at most of its taps, a 7x7 stem at a tenth), the outputs go in
// bands of those whose taps inside x are the same, and a tile computes only its bands' taps.
// A large one may be shared with helper threads (helper.h), chunk by chunk of its outputs.
#pragma once

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "jaxops/helper.h"

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
  int64_t groups = 1;
  int64_t cg() const { return c / groups; }  // input channels of a group
  int64_t og() const { return o / groups; }  // output channels of a group
  int64_t k() const { return kh * kw * cg(); }  // what one output sums
  int64_t patch() const { return kh * kw * c; }  // a patch row: the taps of every group
};

constexpr int kCols = 16;     // a weight panel's output channels (one AVX-512 register)
constexpr int kMaxRows = 12;  // the most output pixels a tile (AVX-512's)
constexpr int kMaxCols = 32;  // the most output channels a tile: two panels (AVX-512's);
                              // the accumulators are [kMaxRows][kMaxCols] whatever the tile

// Which tile code runs: the best the CPU has, or a lower one (tests cover every path).
enum class Isa : int64_t { kBest = 0, kGeneric = 1, kAvx2 = 2, kAvx512 = 3 };

// Checks the geometry; an error message, empty when it is valid. Every size is a buffer's
// own, so only the attributes can be out of range.
inline std::string check(const Geometry& g) {
  if (g.sh < 1 || g.sw < 1 || g.dh < 1 || g.dw < 1) return "strides and dilations must be >= 1";
  if (g.ph < 0 || g.pw < 0) return "pads must be >= 0";
  if (g.groups < 1 || g.c % g.groups || g.o % g.groups)
    return "groups must be >= 1 and divide the input and output channels";
  return {};
}

// A run of floats: memcpy for long ones, a loop for short ones (memcpy's call and size
// dispatch cost more there). The loop stays one where conv.cc is built with
// -fno-tree-loop-distribute-patterns: GCC otherwise made it a memcpy call or `rep movsq`
// (RegNet's 3-channel 3x3 stem 10.1 -> 6.6 us, one AVX-512 core).
inline void copy_run(float* __restrict dst, const float* __restrict src, int64_t n) {
  if (n >= 64) {
    std::memcpy(dst, src, sizeof(float) * n);
    return;
  }
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
}

// How the packs copy runs: copy_run, or (CopyAvx512) whole and masked 16-float moves
// (DeepLabV3's 7x7 stem's runs of 21 floats: 51.2 -> 46.6 us, one AVX-512 core).
struct CopyLoop {
  static void run(float* __restrict dst, const float* __restrict src, int64_t n) {
    copy_run(dst, src, n);
  }
};
#ifdef JAXOPS_CONV_X86
struct CopyAvx512 {  // for packs compiled for AVX-512 (the Avx512 pack wrappers below)
  __attribute__((target("avx512f"))) static void run(float* __restrict dst,
                                                     const float* __restrict src, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, _mm512_loadu_ps(src + i));
    if (i < n) {
      const __mmask16 m = __mmask16((1u << (n - i)) - 1);
      _mm512_mask_storeu_ps(dst + i, m, _mm512_maskz_loadu_ps(m, src + i));
    }
  }
};
#endif

// Weight panels a group (16 output channels each, the last zero-padded).
inline int64_t panels_of(const Geometry& g) { return (g.og() + kCols - 1) / kCols; }

// The weights [K, O] as panels [G][panels_of(g)][K][16] (K in (ky, kx, c) order). A caller
// may pass them so (convolve's `packed`): a program's constant weights, packed once by XLA's
// constant folding instead of every call (ops/conv_cpu.py's pack_weights).
inline void pack_weights(const Geometry& g, const float* w, float* panels) {
  const int64_t k = g.k(), count = panels_of(g);
  for (int64_t gi = 0; gi < g.groups; ++gi)
    for (int64_t p = 0; p < count; ++p) {
      const int64_t col = gi * g.og() + p * kCols;
      const int64_t width = std::min<int64_t>(kCols, g.og() - p * kCols);
      for (int64_t i = 0; i < k; ++i, panels += kCols) {
        copy_run(panels, w + i * g.o + col, width);
        for (int64_t j = width; j < kCols; ++j) panels[j] = 0.f;
      }
    }
}

// pack_weights into `buf` (grown as needed) at a 64-byte boundary, as XLA places a packed
// constant: a tile's 16-float loads then each read one cache line (DeepLabV3's stem with its
// panels 16 bytes off a line took 54.6 us against 47.9, one AVX-512 core, 2026-12-04).
inline const float* pack_aligned(const Geometry& g, const float* w, std::vector<float>& buf) {
  const size_t size = size_t(g.groups * panels_of(g) * g.k() * kCols) + kCols;
  if (buf.size() < size) buf.resize(size);
  const uintptr_t at = reinterpret_cast<uintptr_t>(buf.data());
  float* const panels = reinterpret_cast<float*>((at + 63) & ~uintptr_t(63));
  pack_weights(g, w, panels);
  return panels;
}

// How far the taps of `out` outputs reach along one axis (stride s, kernel k, dilation d),
// in doubles: the attributes could be any size, and their products must not wrap.
inline double extent(int64_t out, int64_t s, int64_t k, int64_t d) {
  return double(out - 1) * double(s) + double(k - 1) * double(d) + 1;
}

// The outputs of one axis whose taps inside x are the same, [o0, o1), and those taps, [k0, k1)
// (none where k0 == k1: pads wider than the kernel's reach). A whole axis is {0, OH, 0, KH}.
struct Span {
  int64_t o0, o1, k0, k1;
};

// A block of outputs, all images by y's rows and x's columns of the two spans, which reads
// the taps of the spans' ranges.
struct Band {
  Span y, x;
  int64_t pixels(int64_t n) const { return n * (y.o1 - y.o0) * (x.o1 - x.o0); }
  int64_t taps() const { return (y.k1 - y.k0) * (x.k1 - x.k0); }
};

// tile's taps widened to also cover other's (a band without taps adds none; a tile without
// any takes other's): a tile across bands computes the union of theirs.
inline void unite(Band& tile, const Band& other) {
  if (other.taps() == 0) return;
  if (tile.taps() == 0) {
    tile = other;
    return;
  }
  tile.y.k0 = std::min(tile.y.k0, other.y.k0), tile.y.k1 = std::max(tile.y.k1, other.y.k1);
  tile.x.k0 = std::min(tile.x.k0, other.x.k0), tile.x.k1 = std::max(tile.x.k1, other.x.k1);
}

// Where an output pixel's first tap of its band reads x: image, row and column (outside x
// where the taps are checked).
struct Tap {
  int64_t b, iy, ix;
};

// The patch rows [tile_rows][taps * C] of the pixels whose first taps are at[0 .. rows - 1]
// (rows past them repeat at[0]): the band's taps of every input channel, (ky, kx, c) in
// order. kChecked: taps outside x read zero (else every one lies inside: padded()'s copy, or
// the exact spans of both axes).
template <class Copy, bool kChecked>
void pack_band(const Geometry& g, const Band& band, const float* x, const Tap* at, int rows,
               int tile_rows, float* a) {
  const int64_t nkx = band.x.k1 - band.x.k0, nky = band.y.k1 - band.y.k0, run = nkx * g.c,
                len = nky * run, step = g.dh * g.w * g.c;
  for (int r = 0; r < tile_rows; ++r, a += len) {
    const auto [b, iy0, ix0] = at[r < rows ? r : 0];
    float* row = a;
    // one run a kernel row, no checks: the common case, tight (DeepLabV3's stem on its
    // zero-bordered copy: 12.6 -> 7.5 us to pack against checking each row, one AVX-512 core)
    if (!kChecked && g.dw == 1) {
      const float* p = x + ((b * g.h + iy0) * g.w + ix0) * g.c;
      for (int64_t ky = 0; ky < nky; ++ky, row += run, p += step) Copy::run(row, p, run);
      continue;
    }
    for (int64_t ky = 0; ky < nky; ++ky, row += run) {
      const int64_t iy = iy0 + ky * g.dh;
      if (kChecked && (iy < 0 || iy >= g.h)) {
        std::memset(row, 0, sizeof(float) * run);
        continue;
      }
      const float* line = x + (b * g.h + iy) * g.w * g.c;
      if (g.dw == 1 && ix0 >= 0 && ix0 + nkx <= g.w) {  // the kernel row lies inside x
        Copy::run(row, line + ix0 * g.c, run);
        continue;
      }
      for (int64_t kx = 0; kx < nkx; ++kx) {
        const int64_t ix = ix0 + kx * g.dw;
        if (!kChecked || (ix >= 0 && ix < g.w)) Copy::run(row + kx * g.c, line + ix * g.c, g.c);
        else std::memset(row + kx * g.c, 0, sizeof(float) * g.c);
      }
    }
  }
}

// What follows the sums, per output channel j: y = clamp(sum * scale[j] + shift[j], lo, hi)
// (scale null: sum + shift[j]; both null: the sum itself; lo, hi -inf, inf: no clamp). A NaN
// sum stays NaN.
struct Epilogue {
  const float* scale = nullptr;
  const float* shift = nullptr;
  float lo = -__builtin_inff(), hi = __builtin_inff();
};

// Where a tile stores: row r at y + at[r] (a band's pixels need not be adjacent in y), `cols`
// columns of `rows` rows; scale and shift from the tile's first column.
struct Store {
  float* y;
  const int64_t* at;
  int rows;
  int64_t cols;
  Epilogue e;
};

inline float finish(float v, const Epilogue& e, int64_t j) {
  if (e.scale) v = v * e.scale[j] + e.shift[j];
  else if (e.shift) v += e.shift[j];
  v = v < e.lo ? e.lo : v;  // (written so that NaN passes)
  return v > e.hi ? e.hi : v;
}

// The tile's accumulators [kMaxRows][kMaxCols] through the epilogue into y.
inline void store_tile(const float* acc, const Store& out) {
  for (int r = 0; r < out.rows; ++r)
    for (int64_t j = 0; j < out.cols; ++j)
      out.y[out.at[r] + j] = finish(acc[r * kMaxCols + j], out.e, j);
}

// Where a tile reads one group's patch rows and weights: row r's value i of tap t is
// a[r * row + t * tap + i] (packed), or in place in x, rows[r][t * tap + i] (`rows` given),
// for t < taps, i < cg, and its weights are the panel's row t * panel_tap / 16 + i (one
// group: kernel rows of the band's taps; else tap by tap).
struct Patches {
  const float* a;
  int64_t row, taps, tap, cg, panel_tap;
  const float* const* rows = nullptr;
  const float* at(int r, int64_t t) const { return (rows ? rows[r] : a + r * row) + t * tap; }
};

// A tile: y[r][j] = finish(sum_i a[r][i] * panels[i][j]) for the tiling's rows and the columns
// of its `panels` adjacent weight panels (each K x 16, the next one k * 16 floats on), stored
// as `out` says.
using TileFn = void (*)(const Patches& s, int64_t k, const float* panel, const Store& out);

// The tile in plain C++: any CPU; 6 rows, one panel.
inline void tile_generic(const Patches& s, int64_t, const float* panel, const Store& out) {
  float c[6][kCols] = {};
  for (int64_t t = 0; t < s.taps; ++t) {
    const float* b = panel + t * s.panel_tap;
    for (int64_t i = 0; i < s.cg; ++i, b += kCols)
      for (int r = 0; r < 6; ++r) {
        const float v = s.at(r, t)[i];
        for (int j = 0; j < kCols; ++j) c[r][j] += v * b[j];
      }
  }
  alignas(64) float acc[kMaxRows * kMaxCols];
  for (int r = 0; r < 6; ++r) std::memcpy(acc + r * kMaxCols, c[r], sizeof c[r]);
  store_tile(acc, out);
}

#ifdef JAXOPS_CONV_X86
// AVX2 + FMA: 6 rows, one panel; 12 accumulators, two weight loads and six broadcasts a step.
// Written out: as arrays of registers in loops GCC 12 ran it at half the speed.
__attribute__((target("avx2,fma"))) inline void tile_avx2(const Patches& s, int64_t,
                                                          const float* panel,
                                                          const Store& out) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
         c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t t = 0; t < s.taps; ++t) {
    const float *a0 = s.at(0, t), *a1 = s.at(1, t), *a2 = s.at(2, t), *a3 = s.at(3, t),
                *a4 = s.at(4, t), *a5 = s.at(5, t);
    const float* b = panel + t * s.panel_tap;
    for (int64_t i = 0; i < s.cg; ++i, b += kCols) {
      const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
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
  }
  const __m256 all[] = {c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51};
  alignas(64) float acc[kMaxRows * kMaxCols];
  for (int i = 0; i < 12; ++i) _mm256_storeu_ps(acc + (i / 2) * kMaxCols + (i % 2) * 8, all[i]);
  store_tile(acc, out);
}

// AVX-512: 12 rows, `P` panels (1 or 2): 12 * P accumulators, P weight loads and 12 broadcasts
// a step. Two panels run at ~2x the AVX2 tile's FLOP rate on a core with 512-bit FMA units
// (259 against 127 GFLOP/s at K = 147, one core of the dev VM's AMD EPYC, 2026-11-27).
template <int P>
__attribute__((target("avx512f"))) inline void tile_avx512(const Patches& s, int64_t k,
                                                           const float* panel,
                                                           const Store& out) {
  __m512 c[12][P];
  for (auto& row : c)
    for (auto& v : row) v = _mm512_setzero_ps();
  // i counts up to 0 from -cg, the row pointers placed at their ends: the loop needs no
  // register for its bound, and with the stores' `continue` below (not a break) GCC keeps
  // the 12 row pointers, i and w in registers; before, the one-panel tile moved four of them
  // between general and vector registers every step, on the FMA ports (in L1, one core:
  // 193 -> 203 GFLOP/s at 3 taps of 192, 171 -> 187 at 3 of 48; two panels 207 -> 213)
  const int64_t n = s.cg;
  for (int64_t t = 0; t < s.taps; ++t) {
    const float* a[12];
#pragma GCC unroll 12
    for (int r = 0; r < 12; ++r) a[r] = s.at(r, t) + n;
    const float* w = panel + t * s.panel_tap;
    for (int64_t i = -n; i < 0; ++i, w += kCols) {
      __m512 b[P];
      for (int p = 0; p < P; ++p) b[p] = _mm512_loadu_ps(w + p * k * kCols);
#pragma GCC unroll 12
      for (int r = 0; r < 12; ++r) {
        const __m512 v = _mm512_set1_ps(a[r][i]);
        for (int p = 0; p < P; ++p) c[r][p] = _mm512_fmadd_ps(v, b[p], c[r][p]);
      }
    }
  }
  // straight from the registers into y: the epilogue's factors once a tile, masked stores
  // for the columns O leaves (unrolled: indexed by a variable, c would live in memory)
  __m512 scale[P], shift[P];
  __mmask16 mask[P];
  const __m512 lo = _mm512_set1_ps(out.e.lo), hi = _mm512_set1_ps(out.e.hi);
  for (int p = 0; p < P; ++p) {
    const int64_t n = std::clamp<int64_t>(out.cols - p * kCols, 0, kCols);
    mask[p] = __mmask16((1u << n) - 1);
    if (out.e.scale) scale[p] = _mm512_maskz_loadu_ps(mask[p], out.e.scale + p * kCols);
    if (out.e.shift) shift[p] = _mm512_maskz_loadu_ps(mask[p], out.e.shift + p * kCols);
  }
#pragma GCC unroll 12
  for (int r = 0; r < 12; ++r) {
    if (r >= out.rows) continue;
    for (int p = 0; p < P; ++p) {
      __m512 v = c[r][p];
      if (out.e.scale) v = _mm512_fmadd_ps(v, scale[p], shift[p]);
      else if (out.e.shift) v = _mm512_add_ps(v, shift[p]);
      // lo, hi first: where v is NaN, max and min return it
      v = _mm512_min_ps(hi, _mm512_max_ps(lo, v));
      _mm512_mask_storeu_ps(out.y + out.at[r] + p * kCols, mask[p], v);
    }
  }
}
#endif

#ifdef JAXOPS_CONV_X86
// The packs with CopyAvx512's moves inlined (flatten: compiled for AVX-512 as a whole).
template <bool kChecked>
__attribute__((target("avx512f"), flatten)) void pack_band_avx512(
    const Geometry& g, const Band& band, const float* x, const Tap* at, int rows,
    int tile_rows, float* a) {
  pack_band<CopyAvx512, kChecked>(g, band, x, at, rows, tile_rows, a);
}
#endif

// The tile code for `isa`: rows a tile, panels a full tile (`full`), the one-panel tile for an
// odd last panel (`one`), and the packs that copy as it does best.
using PackFn = void (*)(const Geometry& g, const Band& band, const float* x, const Tap* at,
                        int rows, int tile_rows, float* a);
struct Tiling {
  int rows, panels;
  TileFn full, one;
  PackFn checked, unchecked;
};

inline Tiling tiling(Isa isa) {
#ifdef JAXOPS_CONV_X86
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx512 && (isa == Isa::kBest || isa == Isa::kAvx512))
    return {12, 2, tile_avx512<2>, tile_avx512<1>, pack_band_avx512<true>,
            pack_band_avx512<false>};
  if (avx2 && isa != Isa::kGeneric)
    return {6, 1, tile_avx2, tile_avx2, pack_band<CopyLoop, true>, pack_band<CopyLoop, false>};
#endif
  (void)isa;
  return {6, 1, tile_generic, tile_generic, pack_band<CopyLoop, true>,
          pack_band<CopyLoop, false>};
}

// padded()'s copy: its height and width (doubles, as extent), and whether it is no larger than
// the patch rows the convolution packs anyway.
inline double padded_h(const Geometry& g) {
  return std::max(double(g.h) + double(g.ph), extent(g.oh, g.sh, g.kh, g.dh));
}
inline double padded_w(const Geometry& g) {
  return std::max(double(g.w) + double(g.pw), extent(g.ow, g.sw, g.kw, g.dw));
}
inline bool copy_pays(const Geometry& g) {
  return double(g.n) * padded_h(g) * padded_w(g) * double(g.c) <=
         double(g.n) * double(g.oh) * double(g.ow) * double(g.patch());
}

// The geometry of reading padded()'s copy of x: no pads, x as large as every tap of g needs.
inline Geometry padded_geometry(const Geometry& g) {
  Geometry p = g;
  p.ph = p.pw = 0;
  p.h = int64_t(padded_h(g));  // exact: copy_pays bounded them by the patch rows' size
  p.w = int64_t(padded_w(g));
  return p;
}

// x copied into a zero border wide enough for every tap of g (its pads and the end overhang
// oh, ow imply), read as padded_geometry(g): the patch rows then come from whole kernel
// rows, where at the image border pack_patches copied tap by tap (DeepLabV3's 3-channel 7x7
// stem: 62.9 -> 56.9 us on one AVX-512 core, the copy included).
inline void padded(const Geometry& g, const float* x, std::vector<float>& copy) {
  const Geometry p = padded_geometry(g);
  const int64_t line = p.w * p.c, left = g.pw * g.c, inner = g.w * g.c;
  copy.resize(p.n * p.h * line);
  float* out = copy.data();
  for (int64_t b = 0; b < g.n; ++b)
    for (int64_t y = 0; y < p.h; ++y, out += line) {  // only the border is zeroed
      const int64_t iy = y - g.ph;
      if (iy < 0 || iy >= g.h) {
        std::fill(out, out + line, 0.f);
        continue;
      }
      std::fill(out, out + left, 0.f);
      std::memcpy(out + left, x + (b * g.h + iy) * inner, sizeof(float) * inner);
      std::fill(out + left + inner, out + line, 0.f);
    }
}

// The spans of one axis (outputs `out`, stride s, begin pad p, dilation d, kernel k, input
// `size`): output o's tap t reads o * s - p + t * d, inside x for a range of t that changes
// only near the borders. Appended to `all`, which is cleared first.
inline void spans(int64_t out, int64_t s, int64_t p, int64_t d, int64_t k, int64_t size,
                  std::vector<Span>& all) {
  all.clear();
  const uint64_t ud = uint64_t(d);
  for (int64_t o = 0; o < out; ++o) {
    int64_t at, k0 = 0, k1 = 0;  // where tap 0 reads; out of int64's range: no tap inside
    if (!__builtin_mul_overflow(o, s, &at) && !__builtin_sub_overflow(at, p, &at) &&
        at < size) {
      // ceil(-at / d) and ceil((size - at) / d) in uint64, where both differences fit
      if (at < 0) k0 = int64_t(std::min<uint64_t>((0 - uint64_t(at) - 1) / ud + 1, k));
      k1 = int64_t(std::min<uint64_t>((uint64_t(size) - uint64_t(at) - 1) / ud + 1, k));
    }
    if (k0 >= k1) k0 = k1 = 0;  // no tap inside: one kind of span, whichever side
    if (!all.empty() && all.back().k0 == k0 && all.back().k1 == k1) all.back().o1 = o + 1;
    else all.push_back({o, o + 1, k0, k1});
  }
}

// What tiling the outputs by bands of these spans costs: per tile its patch rows' length
// plus kTileCost, the packing and storing of a tile in the same units, plus kPartCost where it
// computes part of the kernel (its loops then run other trip counts than the whole kernel's
// tiles: a 3-channel 3x3 stem of 27 values a patch row ran 7% slower split, one core,
// 2026-12-01). With `merged`, the bands' pixels are one sequence (band after band, ys outer)
// cut into whole tiles, a tile computing the taps of every band it holds (their union); else
// each band is cut into tiles of its own, the last one part-filled. Merged tiles save the
// part-filled ones where bands are small (DeepLabV3's 7x7 stem: 16 bands, up to 2 pixels at
// the corners); bands of their own save the union's taps where they are large (its dilated
// 3x3s at 4x4).
constexpr double kTileCost = 48, kPartCost = 16;
constexpr int64_t kChunk = 960;  // pixels at a time: whole tiles (6 and 12 rows)
inline double cost(const Geometry& g, const Span* ys, size_t ny, const Span* xs, size_t nx,
                   int rows, bool merged) {
  double sum = 0;
  int64_t fill = 0;
  Band open{};  // the open merged tile's taps
  const auto tile = [&](int64_t taps) {
    return double(taps * g.c) + kTileCost + (taps < g.kh * g.kw ? kPartCost : 0);
  };
  const auto close = [&] {
    sum += tile(open.taps());
    fill = 0, open = Band{};
  };
  for (size_t i = 0; i < ny; ++i)
    for (size_t j = 0; j < nx; ++j) {
      const Band band{ys[i], xs[j]};
      if (!merged) {
        const double tiles = std::ceil(double(band.pixels(g.n)) / rows);
        sum += tiles * tile(band.taps());
        continue;
      }
      for (int64_t left = band.pixels(g.n); left > 0;) {
        unite(open, band);
        const int64_t take = std::min<int64_t>(rows - fill, left);
        fill += take, left -= take;
        if (fill == rows) close();
      }
    }
  if (merged && fill > 0) close();
  return sum;
}

// Where a tile reads group gi's patch rows of `band` from `a` (pack_band's layout), and
// (`first`) the band's first weight row in the group's panels: one group, the kernel rows of
// the band's taps (one run where they are whole); else tap by tap, C apart, C / G of each.
inline Patches band_patches(const Geometry& g, const Band& band, int64_t gi, const float* a,
                            int64_t& first) {
  const int64_t nkx = band.x.k1 - band.x.k0, nky = band.y.k1 - band.y.k0;
  const int64_t len = band.taps() * g.c, cg = g.cg();
  if (g.groups > 1) {
    first = band.y.k0 * g.kw * cg;
    return {a + gi * cg, len, nky * g.kw, g.c, cg, cg * kCols};
  }
  first = (band.y.k0 * g.kw + band.x.k0) * g.c;
  if (nkx == g.kw) return {a, len, 1, 0, len, 0};
  return {a, len, nky, nkx * g.c, nkx * g.c, g.kw * g.c * kCols};
}

// Where a tile reads the patch rows of `band` in place (one group, kernel rows contiguous in
// x): kernel row t of row r at rows[r] + t * dh * W * C, the band's taps of it in one run.
inline Patches in_place_patches(const Geometry& g, const Band& band, const float* const* rows,
                                int64_t& first) {
  first = (band.y.k0 * g.kw + band.x.k0) * g.c;
  return {nullptr, 0, band.y.k1 - band.y.k0, g.dh * g.w * g.c, (band.x.k1 - band.x.k0) * g.c,
          g.kw * g.c * kCols, rows};
}

// How much cheaper (cost) than computing every tap a tiling by bands must be to be taken.
constexpr double kSplitGain = 0.97;

// Where a chunk of pixels starts: band bi's c-th pixel.
struct Start {
  size_t bi;
  int64_t c;
};

// The chunk of at most `size` pixels from s (images, rows, columns of a band, band after band
// where merged; size whole tiles), s moved past it; its pixels' first taps, where they go in y
// and their bands written where `base` is given. Returns its pixel count.
inline int64_t next_chunk(const Geometry& g, const Band* bands, size_t count, bool merged,
                          int64_t size, Start& s, Tap* base, int64_t* outs, int64_t* owner) {
  int64_t chunk = 0;
  while (chunk < size && s.bi < count) {
    const Band& band = bands[s.bi];
    const int64_t width = band.x.o1 - band.x.o0, height = band.y.o1 - band.y.o0;
    const int64_t pixels = band.pixels(g.n), take = std::min<int64_t>(size - chunk, pixels - s.c);
    if (base) {
      int64_t b = s.c / width / height, oy = band.y.o0 + s.c / width % height,
              ox = band.x.o0 + s.c % width;
      for (int64_t q = chunk; q < chunk + take;) {
        const int64_t iy = oy * g.sh - g.ph + band.y.k0 * g.dh, y0 = (b * g.oh + oy) * g.ow;
        const int64_t end = std::min(band.x.o1, ox + chunk + take - q);
        for (; ox < end; ++ox, ++q)
          base[q] = {b, iy, ox * g.sw - g.pw + band.x.k0 * g.dw}, outs[q] = (y0 + ox) * g.o,
          owner[q] = int64_t(s.bi);
        ox = band.x.o0;
        if (++oy == band.y.o1) oy = band.y.o0, ++b;
      }
    }
    chunk += take, s.c += take;
    if (s.c == pixels) {
      ++s.bi, s.c = 0;
      if (!merged) break;  // a band's tiles of its own
    }
  }
  return chunk;
}

// What a thread's chunks use: the pixels' first taps, outputs and bands, the packed rows, and
// its own zero-bordered copy of x (made at its first chunk of call `copied`: where the helper
// read the caller's copy, both threads ran their halves of DeepLabV3's stem 1.45x slower
// than one thread its whole, 2026-12-03, the copy's lines moving between the cores).
struct Scratch {
  std::vector<Tap> base = std::vector<Tap>(kChunk);
  std::vector<int64_t> outs = std::vector<int64_t>(kChunk), owner = std::vector<int64_t>(kChunk);
  std::vector<float> a, copy;
  uint64_t copied = 0;

  static Scratch& mine() {
    thread_local Scratch scratch;
    return scratch;
  }
  static void trim() {  // a thread keeps at most 1 MiB of each between calls
    Scratch& s = mine();
    for (auto* v : {&s.a, &s.copy})
      if (v->capacity() > (size_t(1) << 18)) std::vector<float>().swap(*v), s.copied = 0;
  }
};

// The FLOPs a convolution needs for each thread it runs on (the smallest shared with a helper
// has kShareFlops: a thread more for each kShareFlops more), and the pixels a claim of a
// shared one. Header bench, one AVX-512 core against two, 2026-12-03: DeepLabV3's 7x7 stem
// (9.6 MFLOP) 55.4 -> 33.5 us, its 3x3 of 64 -> 16 channels on 8x8 (2.4 MFLOP) 16.7 -> 11.3
// us; smaller ones gain less than the hand-over and the other core's copy of x cost.
constexpr int64_t kShareFlops = 1 << 21, kShareChunk = 24;

// y = conv(x, w) over the whole batch, on the calling thread (and, `threads` > 1, up to
// threads - 1 helper threads, one for each kShareFlops: helper.h), with the tile code of
// `isa`; w [KH, KW, C / G, O], or (`packed`) already pack_weights' panels. Every output is
// computed by the same tile whatever the threads. The outputs go in bands whose taps inside x are the same, on the axes where that saves work
// over computing the taps that read the zero pads (cost), and a tile computes the taps of its
// bands: DeepLabV3's dilated 3x3s at 4x4 read x at 4 of their 9 taps, its 7x7 stem at 9 of 10.
inline void convolve(const Geometry& geometry, const float* x, const float* w, float* y,
                     const Epilogue& e = {}, Isa isa = Isa::kBest, bool packed = false,
                     int64_t threads = 1) {
  // the scratch of this thread's last call, kept: allocating and zeroing it every call cost
  // ~1 us of DeepLabV3's 3x3s (every element is written before it is read) ...
  thread_local std::vector<float> panels;
  thread_local std::vector<Span> ys, xs;
  thread_local std::vector<Band> bands;
  thread_local std::vector<Start> starts;
  struct Trim {  // ... unless large: a thread keeps at most 1 MiB of it between calls
    ~Trim() {
      if (panels.capacity() > (size_t(1) << 18)) std::vector<float>().swap(panels);
      Scratch::trim();
      for (auto* v : {&ys, &xs})
        if (v->capacity() > 1024) std::vector<Span>().swap(*v);
      if (bands.capacity() > 1024) std::vector<Band>().swap(bands);
      if (starts.capacity() > 1024) std::vector<Start>().swap(starts);
    }
  } trim;
  const Geometry& o = geometry;  // as given; g below: as read (padded()'s where it copies)
  const Tiling t = tiling(isa);
  // the axes' spans, or an axis whole (grouped: x whole, so that a group's taps stay evenly
  // spaced in the patch rows), whichever tiling costs least; in_y, in_x: every tap of a band
  // lies inside x
  spans(o.oh, o.sh, o.ph, o.dh, o.kh, o.h, ys);
  spans(o.ow, o.sw, o.pw, o.dw, o.kw, o.w, xs);
  bool in_y = ys.size() == 1 && ys[0].k1 - ys[0].k0 == o.kh;
  bool in_x = xs.size() == 1 && xs[0].k1 - xs[0].k0 == o.kw;
  bool merged = false;
  if (!in_x || !in_y) {
    const Span wy{0, o.oh, 0, o.kh}, wx{0, o.ow, 0, o.kw};
    double best = cost(o, &wy, 1, &wx, 1, t.rows, false);
    int split = 0;  // bit 0: ys, bit 1: xs
    for (int s = 1; s < 4; ++s) {
      if (((s & 1) && in_y) || ((s & 2) && (in_x || o.groups > 1))) continue;
      const bool sy = s & 1, sx = s & 2;
      for (const bool m : {false, true}) {
        const double c = cost(o, sy ? ys.data() : &wy, sy ? ys.size() : 1,
                              sx ? xs.data() : &wx, sx ? xs.size() : 1, t.rows, m) /
                         kSplitGain;
        if (c < best) best = c, split = s, merged = m;
      }
    }
    if (split & 1) in_y = true;
    else ys.assign(1, wy);
    if (split & 2) in_x = true;
    else xs.assign(1, wx);
  }
  // The zero-bordered copy where taps still read the pads (a band's, or a merged tile's of
  // another band), but not for dilated kernel rows (copied tap by tap anyway: there the copy
  // only costs), nor where the copy would outgrow the patch rows (copy_pays). Then every tap
  // reads inside the copy. every_inside: every tile's taps lie inside x or its copy (a merged
  // tile of one band's pixels may also, without the copy).
  const bool bands_inside = in_y && in_x && !merged;
  const bool pad = o.dw == 1 && !bands_inside && copy_pays(o), every_inside = pad || bands_inside;
  const Geometry g = pad ? padded_geometry(o) : o;
  static std::atomic<uint64_t> calls{0};
  const uint64_t call = pad ? calls.fetch_add(1, std::memory_order_relaxed) + 1 : 0;
  // One group, undilated kernel rows, every tap of a tile inside x (or its copy): the tile
  // reads its patch rows where they lie, unpacked (one AVX-512 core, 2026-11-29: DeepLabV3's
  // 3x3 of 64 channels on 8x8 28.6 -> 24.4 us, MobileNetV3's 3-channel 3x3 stem 9.6 -> 7.4 us)
  const bool rows_in_place = g.groups == 1 && g.dw == 1;
  const bool packs = !(rows_in_place && every_inside);
  const int64_t k = g.k(), count = panels_of(g);
  bands.clear();
  for (const Span sy : ys)
    for (const Span sx : xs) bands.push_back({sy, sx});
  const Band* const band_list = bands.data();
  const size_t band_count = bands.size();
  const float* const weights = packed ? w : pack_aligned(g, w, panels);
  // the chunks: claimed one by one where they are shared, large otherwise
  const double flops = 2 * double(g.n) * double(g.oh) * double(g.ow) * double(g.o) * double(k);
  const int64_t workers = int64_t(std::min(double(threads), 1 + flops / double(kShareFlops)));
  const bool shared = workers > 1;
  const int64_t size = shared ? kShareChunk : kChunk;
  starts.clear();
  for (Start s{0, 0}; s.bi < band_count;) {
    starts.push_back(s);
    next_chunk(g, band_list, band_count, merged, size, s, nullptr, nullptr, nullptr);
  }
  const Start* const chunk_starts = starts.data();
  const auto run_chunk = [&](int64_t i) {
    Scratch& scratch = Scratch::mine();
    if (packs && scratch.a.size() < size_t(t.rows * g.patch()))
      scratch.a.resize(t.rows * g.patch());
    if (pad && scratch.copied != call) padded(o, x, scratch.copy), scratch.copied = call;
    const float* const x_read = pad ? scratch.copy.data() : x;
    // the scratch as plain pointers in the loops (in a shared library a thread_local may be
    // looked up through __tls_get_addr where it is used)
    Tap* const base_at = scratch.base.data();
    int64_t *const out_at = scratch.outs.data(), *const band_of = scratch.owner.data();
    float* const rows_packed = scratch.a.data();
    Start s = chunk_starts[i];
    const int64_t chunk =
        next_chunk(g, band_list, band_count, merged, size, s, base_at, out_at, band_of);
    const float* rows_at[kMaxRows];
    for (int64_t q0 = 0; q0 < chunk; q0 += t.rows) {
      const int rows = int(std::min<int64_t>(t.rows, chunk - q0));
      // the tile's taps: its band's, or the union of its bands' that have any (a band's
      // pixels are adjacent in the chunk), and where each pixel's first one reads x
      const int64_t first_band = band_of[q0], last_band = band_of[q0 + rows - 1];
      const bool exact = first_band == last_band;
      Band tile = band_list[first_band];
      const Tap* at = base_at + q0;
      Tap moved[kMaxRows];
      if (!exact) {
        for (int64_t bj = first_band + 1; bj <= last_band; ++bj) unite(tile, band_list[bj]);
        for (int r = 0; r < rows; ++r) {
          const Band& own = band_list[band_of[q0 + r]];
          moved[r] = {at[r].b, at[r].iy + (tile.y.k0 - own.y.k0) * g.dh,
                      at[r].ix + (tile.x.k0 - own.x.k0) * g.dw};
        }
        at = moved;
      }
      const bool inside = every_inside || (in_y && in_x && exact),
                 in_place = rows_in_place && inside;
      if (in_place) {
        for (int r = 0; r < t.rows; ++r) {
          const Tap& p = at[r < rows ? r : 0];
          rows_at[r] = x_read + ((p.b * g.h + p.iy) * g.w + p.ix) * g.c;
        }
      } else if (tile.taps()) {
        (inside ? t.unchecked : t.checked)(g, tile, x_read, at, rows, t.rows, rows_packed);
      }
      for (int64_t gi = 0; gi < g.groups; ++gi) {
        int64_t first;
        const Patches s = in_place ? in_place_patches(g, tile, rows_at, first)
                                   : band_patches(g, tile, gi, rows_packed, first);
        for (int64_t p = 0; p < count; p += t.panels) {
          const bool full = p + t.panels <= count;
          const int64_t col = gi * g.og() + p * kCols, left = g.og() - p * kCols,
                        cols = full ? t.panels * kCols : kCols;
          Epilogue ep = e;
          if (e.scale) ep.scale += col;
          if (e.shift) ep.shift += col;
          (full ? t.full : t.one)(s, k, weights + ((gi * count + p) * k + first) * kCols,
                                  Store{y + col, out_at + q0, rows, std::min(left, cols), ep});
        }
      }
    }
  };
  helper::share(int64_t(starts.size()), run_chunk, workers, Scratch::trim);
}

}  // namespace jaxops::conv
