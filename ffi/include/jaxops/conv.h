// A CPU convolution for small inference convolutions: x [N, H, W, C] (NHWC) by w
// [KH, KW, C / G, O] (HWIO, G groups: output channel j reads input channels of group
// j / (O / G)), f32, into y [N, OH, OW, O]. XLA:CPU's own convolution and windowed_conv's
// im2col + matmul run such convolutions in several thunks at well below the core's FMA peak
// (DeepLabV3's 3-channel 7x7 stem ~60% of it); this is one pass that packs a block of MR
// output pixels' patch rows (kernel rows are contiguous runs in NHWC) and multiplies them
// by 16-channel panels of the weights in registers (a tile of FMAs: 6 pixels x 16 channels
// on AVX2, 12 x 32 on AVX-512, picked at run time).
#pragma once

#include <algorithm>
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

// The weights [K, O] as panels [G][panels_of(g)][K][16].
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

// The patch rows [tile_rows][KH * KW * C] of output pixels m0 .. m0 + rows - 1 (rows past the
// end repeat m0); taps outside x are zero.
template <class Copy>
void pack_patches(const Geometry& g, const float* x, int64_t m0, int rows, int tile_rows,
                  float* a) {
  const int64_t run = g.kw * g.c;
  for (int r = 0; r < tile_rows; ++r) {
    float* row = a + r * g.patch();
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
        Copy::run(row, line + ix0 * g.c, run);
        continue;
      }
      for (int64_t kx = 0; kx < g.kw; ++kx) {
        const int64_t ix = ix0 + kx * g.dw;
        if (ix >= 0 && ix < g.w) Copy::run(row + kx * g.c, line + ix * g.c, g.c);
        else std::memset(row + kx * g.c, 0, sizeof(float) * g.c);
      }
    }
  }
}

// How far the taps of `out` outputs reach along one axis (stride s, kernel k, dilation d),
// in doubles: the attributes could be any size, and their products must not wrap.
inline double extent(int64_t out, int64_t s, int64_t k, int64_t d) {
  return double(out - 1) * double(s) + double(k - 1) * double(d) + 1;
}

// Whether every tap of g lies inside x with kernel rows contiguous (no pads, dw 1: padded()'s
// geometry, or a window that fits): pack_inside's case.
inline bool inside(const Geometry& g) {
  return g.ph == 0 && g.pw == 0 && g.dw == 1 && extent(g.oh, g.sh, g.kh, g.dh) <= double(g.h) &&
         extent(g.ow, g.sw, g.kw, g.dw) <= double(g.w);
}

// pack_patches for inside(g): one run of KW * C floats a kernel row, no bounds checks
// (DeepLabV3's stem on its zero-bordered copy: 12.6 -> 7.5 us to pack, one AVX-512 core).
template <class Copy>
void pack_inside(const Geometry& g, const float* x, int64_t m0, int rows, int tile_rows,
                 float* a) {
  const int64_t run = g.kw * g.c, line = g.dh * g.w * g.c;
  for (int r = 0; r < tile_rows; ++r) {
    const int64_t m = m0 + (r < rows ? r : 0);
    const int64_t ox = m % g.ow, t = m / g.ow, oy = t % g.oh, b = t / g.oh;
    const float* p = x + ((b * g.h + oy * g.sh) * g.w + ox * g.sw) * g.c;
    float* row = a + r * g.patch();
    for (int64_t ky = 0; ky < g.kh; ++ky, row += run, p += line) Copy::run(row, p, run);
  }
}

// What follows the sums, per output channel j: y = clamp(sum * scale[j] + shift[j], lo, hi)
// (scale and shift null: the sum itself; lo, hi -inf, inf: no clamp). A NaN sum stays NaN.
struct Epilogue {
  const float* scale = nullptr;
  const float* shift = nullptr;
  float lo = -__builtin_inff(), hi = __builtin_inff();
};

// Where a tile stores: `rows` rows `ld` floats apart from y, `cols` columns; scale and shift
// from the tile's first column.
struct Store {
  float* y;
  int64_t ld;
  int rows;
  int64_t cols;
  Epilogue e;
};

inline float finish(float v, const Epilogue& e, int64_t j) {
  if (e.scale) v = v * e.scale[j] + e.shift[j];
  v = v < e.lo ? e.lo : v;  // (written so that NaN passes)
  return v > e.hi ? e.hi : v;
}

// The tile's accumulators [kMaxRows][kMaxCols] through the epilogue into y.
inline void store_tile(const float* acc, const Store& out) {
  for (int r = 0; r < out.rows; ++r)
    for (int64_t j = 0; j < out.cols; ++j)
      out.y[r * out.ld + j] = finish(acc[r * kMaxCols + j], out.e, j);
}

// Where a tile reads one group's patch rows: row r's value i of tap t is
// a[r * row + t * tap + i] for t < taps, i < cg (one group: a single tap of all K values).
struct Patches {
  const float* a;
  int64_t row, taps, tap, cg;
};

// A tile: y[r][j] = finish(sum_i a[r][i] * panels[i][j]) for the tiling's rows and the columns
// of its `panels` adjacent weight panels (each K x 16, the next one k * 16 floats on), stored
// as `out` says.
using TileFn = void (*)(const Patches& s, int64_t k, const float* panel, const Store& out);

// The tile in plain C++: any CPU; 6 rows, one panel.
inline void tile_generic(const Patches& s, int64_t, const float* panel, const Store& out) {
  float c[6][kCols] = {};
  for (int64_t t = 0; t < s.taps; ++t)
    for (int64_t i = 0; i < s.cg; ++i, panel += kCols)
      for (int r = 0; r < 6; ++r) {
        const float v = s.a[r * s.row + t * s.tap + i];
        for (int j = 0; j < kCols; ++j) c[r][j] += v * panel[j];
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
    const float *a0 = s.a + t * s.tap, *a1 = a0 + s.row, *a2 = a1 + s.row, *a3 = a2 + s.row,
                *a4 = a3 + s.row, *a5 = a4 + s.row;
    for (int64_t i = 0; i < s.cg; ++i, panel += kCols) {
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
  for (int64_t t = 0; t < s.taps; ++t) {
    const float* a = s.a + t * s.tap;
    for (int64_t i = 0; i < s.cg; ++i, panel += kCols) {
      __m512 b[P];
      for (int p = 0; p < P; ++p) b[p] = _mm512_loadu_ps(panel + p * k * kCols);
#pragma GCC unroll 12
      for (int r = 0; r < 12; ++r) {
        const __m512 v = _mm512_set1_ps(a[r * s.row + i]);
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
    if (out.e.scale) {
      scale[p] = _mm512_maskz_loadu_ps(mask[p], out.e.scale + p * kCols);
      shift[p] = _mm512_maskz_loadu_ps(mask[p], out.e.shift + p * kCols);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < 12; ++r) {
    if (r >= out.rows) break;
    for (int p = 0; p < P; ++p) {
      __m512 v = c[r][p];
      if (out.e.scale) v = _mm512_fmadd_ps(v, scale[p], shift[p]);
      // lo, hi first: where v is NaN, max and min return it
      v = _mm512_min_ps(hi, _mm512_max_ps(lo, v));
      _mm512_mask_storeu_ps(out.y + r * out.ld + p * kCols, mask[p], v);
    }
  }
}
#endif

#ifdef JAXOPS_CONV_X86
// The packs with CopyAvx512's moves inlined (flatten: compiled for AVX-512 as a whole).
#define JAXOPS_CONV_PACK_AVX512(name)                                                      \
  __attribute__((target("avx512f"), flatten)) inline void name##_avx512(                   \
      const Geometry& g, const float* x, int64_t m0, int rows, int tile_rows, float* a) {  \
    name<CopyAvx512>(g, x, m0, rows, tile_rows, a);                                        \
  }
JAXOPS_CONV_PACK_AVX512(pack_patches)
JAXOPS_CONV_PACK_AVX512(pack_inside)
#undef JAXOPS_CONV_PACK_AVX512
#endif

// The tile code for `isa`: rows a tile, panels a full tile (`full`), the one-panel tile for an
// odd last panel (`one`), and the packs that copy as it does best.
using PackFn = void (*)(const Geometry& g, const float* x, int64_t m0, int rows, int tile_rows,
                        float* a);
struct Tiling {
  int rows, panels;
  TileFn full, one;
  PackFn patches, inside;
};

inline Tiling tiling(Isa isa) {
#ifdef JAXOPS_CONV_X86
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx512 && (isa == Isa::kBest || isa == Isa::kAvx512))
    return {12, 2, tile_avx512<2>, tile_avx512<1>, pack_patches_avx512, pack_inside_avx512};
  if (avx2 && isa != Isa::kGeneric)
    return {6, 1, tile_avx2, tile_avx2, pack_patches<CopyLoop>, pack_inside<CopyLoop>};
#endif
  (void)isa;
  return {6, 1, tile_generic, tile_generic, pack_patches<CopyLoop>, pack_inside<CopyLoop>};
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

// x copied into a zero border wide enough for every tap of g (its pads and the end overhang
// oh, ow imply), and the geometry of reading that copy without pads: the patch rows then come
// from whole kernel rows, where at the image border pack_patches copied tap by tap (DeepLabV3's
// 3-channel 7x7 stem: 62.9 -> 56.9 us on one AVX-512 core, the copy included).
inline Geometry padded(const Geometry& g, const float* x, std::vector<float>& copy) {
  Geometry p = g;
  p.ph = p.pw = 0;
  p.h = int64_t(padded_h(g));  // exact: copy_pays bounded them by the patch rows' size
  p.w = int64_t(padded_w(g));
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
  return p;
}

// y = conv(x, w) over the whole batch, on the calling thread, with the tile code of `isa`.
inline void convolve(const Geometry& geometry, const float* x, const float* w, float* y,
                     const Epilogue& e = {}, Isa isa = Isa::kBest) {
  // the scratch of this thread's last call, kept: allocating and zeroing it every call cost
  // ~1 us of DeepLabV3's 3x3s (every element is written before it is read) ...
  thread_local std::vector<float> copy, panels, a;
  struct Trim {  // ... unless large: a thread keeps at most 1 MiB of it between calls
    ~Trim() {
      for (auto* v : {&copy, &panels, &a})
        if (v->capacity() > (size_t(1) << 18)) std::vector<float>().swap(*v);
    }
  } trim;
  // Not for dilated kernel rows (copied tap by tap anyway: there the copy only costs), nor
  // where the copy would outgrow the patch rows (copy_pays).
  const bool pad = geometry.dw == 1 && (geometry.ph || geometry.pw) && copy_pays(geometry);
  const Geometry g = pad ? padded(geometry, x, copy) : geometry;
  if (pad) x = copy.data();
  const Tiling t = tiling(isa);
  const int64_t k = g.k(), count = panels_of(g), m = g.n * g.oh * g.ow;
  if (panels.size() < size_t(g.groups * count * k * kCols))
    panels.resize(g.groups * count * k * kCols);
  if (a.size() < size_t(t.rows * g.patch())) a.resize(t.rows * g.patch());
  pack_weights(g, w, panels.data());
  const PackFn pack = inside(g) ? t.inside : t.patches;
  for (int64_t m0 = 0; m0 < m; m0 += t.rows) {
    const int rows = int(m - m0 < t.rows ? m - m0 : t.rows);
    pack(g, x, m0, rows, t.rows, a.data());
    for (int64_t gi = 0; gi < g.groups; ++gi) {
      // one group: its K values as one run; else KH * KW runs of C / G, C apart
      const Patches s = g.groups == 1 ? Patches{a.data(), k, 1, 0, k}
                                      : Patches{a.data() + gi * g.cg(), g.patch(), g.kh * g.kw,
                                                g.c, g.cg()};
      for (int64_t p = 0; p < count; p += t.panels) {
        const bool full = p + t.panels <= count;
        const int64_t col = gi * g.og() + p * kCols, left = g.og() - p * kCols,
                      width = full ? t.panels * kCols : kCols;
        Epilogue at = e;
        if (e.scale) at.scale += col, at.shift += col;
        (full ? t.full : t.one)(s, k, panels.data() + (gi * count + p) * k * kCols,
                                Store{y + m0 * g.o + col, g.o, rows, std::min(left, width), at});
      }
    }
  }
}

}  // namespace jaxops::conv
