// A CPU max pool over channels-last x [N, H, W, C] f32 into y [N, OH, OW, C]: each output
// pixel's C maxima over the window taps that lie inside x, C contiguous values a tap. XLA:CPU
// ran a max pool as one loop fusion of one strided slice a tap at ~0.8 ns an output element
// (DeepLabV3's 3x3 stride-2 pool of its 7x7 stem, 8192 outputs x 9 taps: 6.7 us, one AVX-512
// core); a tap here is a run of C floats, taken 16 at a time.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define JAXOPS_POOL_X86 1
#endif

namespace jaxops::pool {

struct Geometry {
  int64_t n, h, w, c;              // x
  int64_t kh, kw;                  // the window
  int64_t oh, ow;                  // y: [n, oh, ow, c]
  int64_t sh, sw, dh, dw, ph, pw;  // strides, dilations, begin pads (the end pads are
                                   // implied by oh, ow: a tap outside x is skipped)
};

constexpr int64_t kMaxTaps = 64;  // the largest window (pool_cpu.applies' bound)

// Which code runs: the best the CPU has, or a lower one (tests cover every path).
enum class Isa : int64_t { kBest = 0, kGeneric = 1, kAvx2 = 2, kAvx512 = 3 };

// An error message for attributes out of range, empty when valid (sizes are the buffers').
inline std::string check(const Geometry& g) {
  if (g.kh < 1 || g.kw < 1 || g.kh > kMaxTaps || g.kw > kMaxTaps || g.kh * g.kw > kMaxTaps)
    return "the window must have 1 to 64 taps";
  if (g.sh < 1 || g.sw < 1 || g.dh < 1 || g.dw < 1) return "strides and dilations must be >= 1";
  if (g.ph < 0 || g.pw < 0) return "pads must be >= 0";
  return {};
}

// The taps [k0, k1) of output o along one axis that read inside x (size `size`): tap t reads
// o * s - p + t * d. Attributes of any size: where o * s - p leaves int64, no tap reads x.
// `reach`: (k - 1) * d, or -1 where that overflows; an output whose window lies inside takes
// every tap without the divisions (two 64-bit divisions a pixel were most of DeepLabV3's pool).
inline void inside(int64_t o, int64_t s, int64_t p, int64_t d, int64_t k, int64_t reach,
                   int64_t size, int64_t& k0, int64_t& k1) {
  int64_t at;
  k0 = k1 = 0;
  if (__builtin_mul_overflow(o, s, &at) || __builtin_sub_overflow(at, p, &at) || at >= size)
    return;
  if (at >= 0 && reach >= 0 && reach <= size - 1 - at) {
    k1 = k;
    return;
  }
  const uint64_t ud = uint64_t(d);  // ceil(-at / d), ceil((size - at) / d) in uint64
  const int64_t first = at < 0 ? int64_t(std::min<uint64_t>((0 - uint64_t(at) - 1) / ud + 1, k)) : 0;
  const int64_t stop = int64_t(std::min<uint64_t>((uint64_t(size) - uint64_t(at) - 1) / ud + 1, k));
  if (first < stop) k0 = first, k1 = stop;
}

inline int64_t reach(int64_t k, int64_t d) {
  int64_t r;
  return __builtin_mul_overflow(k - 1, d, &r) ? -1 : r;
}

// Where tap t of output o reads along an axis, for a tap inside (the true value lies in
// [0, size): uint64's wrap-around gives it exactly, whatever the attributes' sizes).
inline int64_t tap_at(int64_t o, int64_t s, int64_t p, int64_t t, int64_t d) {
  return int64_t(uint64_t(o) * uint64_t(s) - uint64_t(p) + uint64_t(t) * uint64_t(d));
}

// One output pixel's C maxima over its taps: tap t's C floats at base + off[t]. A NaN in a
// window makes its maximum NaN (XLA's max); no tap: -inf. The fast loops return false (out
// unfinished) where the window holds a NaN or an infinity: then pixel_exact.
using PixelFn = bool (*)(const float* base, const int64_t* off, int64_t taps, int64_t c,
                         float* out);

inline void pixel_exact(const float* base, const int64_t* off, int64_t taps, int64_t c,
                        float* out) {
  for (int64_t j = 0; j < c; ++j) {
    float m = -__builtin_inff();
    for (int64_t t = 0; t < taps; ++t) {
      const float v = base[off[t] + j];
      m = (v > m || v != v) ? v : m;  // once NaN, m stays NaN (v > NaN is false)
    }
    out[j] = m;
  }
}

// The fast loops: the taps outer, the running maxima in registers (or a local array), two a
// channel for the even and the odd taps (one chain of dependent max operations runs at their
// latency), and a sum of v * 0 (0 while every v is finite, NaN from a NaN or an infinity):
// the plain max drops NaNs, and a NaN check on every value (compare, mask, or) costs as much
// as the max. DeepLabV3's pool in C++, one AVX-512 core: 4.2-5.5 us; a scalar loop, 39 us.
inline bool pixel_generic(const float* base, const int64_t* off, int64_t taps, int64_t c,
                          float* out) {
  typedef float V __attribute__((vector_size(16)));  // 4 floats: any CPU's vectors
  int64_t j = 0;
  for (; j + 16 <= c; j += 16) {
    V m[4], zero[4];
    for (int v = 0; v < 4; ++v) m[v] = V{} - __builtin_inff(), zero[v] = V{};
    for (int64_t t = 0; t < taps; ++t)
      for (int v = 0; v < 4; ++v) {
        V x;
        std::memcpy(&x, base + off[t] + j + 4 * v, sizeof x);
        m[v] = x > m[v] ? x : m[v], zero[v] += x * 0.f;
      }
    for (int v = 0; v < 4; ++v)
      for (int i = 0; i < 4; ++i)
        if (zero[v][i] != 0.f) return false;
    std::memcpy(out + j, m, sizeof m);
  }
  if (j < c) {  // the last channels: the exact loop
    int64_t rest[kMaxTaps];
    for (int64_t t = 0; t < taps; ++t) rest[t] = off[t] + j;
    pixel_exact(base, rest, taps, c - j, out + j);
  }
  return true;
}

#ifdef JAXOPS_POOL_X86
// AVX2: 32 channels at a time.
__attribute__((target("avx2,fma"))) inline bool pixel_avx2(const float* base, const int64_t* off,
                                                           int64_t taps, int64_t c, float* out) {
  const __m256 none = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= c; j += 32) {
    __m256 m0[4], m1[4], zero[4];
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) m0[v] = m1[v] = _mm256_set1_ps(-__builtin_inff()), zero[v] = none;
    for (int64_t t = 0; t < taps; t += 2) {
      const float *a = base + off[t] + j, *b = base + off[t + 1 < taps ? t + 1 : t] + j;
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
        const __m256 p = _mm256_loadu_ps(a + 8 * v), q = _mm256_loadu_ps(b + 8 * v);
        m0[v] = _mm256_max_ps(m0[v], p), m1[v] = _mm256_max_ps(m1[v], q);
        zero[v] = _mm256_fmadd_ps(p, none, _mm256_fmadd_ps(q, none, zero[v]));
      }
    }
    const __m256 all = _mm256_add_ps(_mm256_add_ps(zero[0], zero[1]), _mm256_add_ps(zero[2], zero[3]));
    if (_mm256_movemask_ps(_mm256_cmp_ps(all, none, _CMP_NEQ_UQ))) return false;
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) _mm256_storeu_ps(out + j + 8 * v, _mm256_max_ps(m0[v], m1[v]));
  }
  return j == c || pixel_generic(base + j, off, taps, c - j, out + j);
}

// AVX-512: 64 channels at a time (masked past C).
__attribute__((target("avx512f"))) inline bool pixel_avx512(const float* base, const int64_t* off,
                                                            int64_t taps, int64_t c, float* out) {
  const __m512 none = _mm512_setzero_ps();
  for (int64_t j = 0; j < c; j += 64) {
    __m512 m0[4], m1[4], zero[4];
    __mmask16 mask[4];
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) {
      const int64_t n = std::clamp<int64_t>(c - j - 16 * v, 0, 16);
      mask[v] = __mmask16((1u << n) - 1);
      m0[v] = m1[v] = _mm512_set1_ps(-__builtin_inff()), zero[v] = none;
    }
    for (int64_t t = 0; t < taps; t += 2) {  // (an odd last tap taken twice)
      const float *a = base + off[t] + j, *b = base + off[t + 1 < taps ? t + 1 : t] + j;
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
        const __m512 p = _mm512_maskz_loadu_ps(mask[v], a + 16 * v),
                     q = _mm512_maskz_loadu_ps(mask[v], b + 16 * v);
        m0[v] = _mm512_max_ps(m0[v], p), m1[v] = _mm512_max_ps(m1[v], q);
        zero[v] = _mm512_fmadd_ps(p, none, _mm512_fmadd_ps(q, none, zero[v]));
      }
    }
    const __m512 all = _mm512_add_ps(_mm512_add_ps(zero[0], zero[1]), _mm512_add_ps(zero[2], zero[3]));
    if (_mm512_cmp_ps_mask(all, none, _CMP_NEQ_UQ)) return false;
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v)
      _mm512_mask_storeu_ps(out + j + 16 * v, mask[v], _mm512_max_ps(m0[v], m1[v]));
  }
  return true;
}
#endif

// y = max_pool(x) over the whole batch, on the calling thread.
inline void max_pool(const Geometry& g, const float* x, float* y, Isa isa = Isa::kBest) {
  PixelFn pixel = pixel_generic;
#ifdef JAXOPS_POOL_X86
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx512 && (isa == Isa::kBest || isa == Isa::kAvx512)) pixel = pixel_avx512;
  else if (avx2 && isa != Isa::kGeneric) pixel = pixel_avx2;
#endif
  (void)isa;
  const int64_t reach_y = reach(g.kh, g.dh), reach_x = reach(g.kw, g.dw), image = g.h * g.w * g.c;
  // a whole window's offsets from its first tap, where a window fits in x at all (then every
  // offset lies inside an image: no overflow)
  int64_t whole[kMaxTaps], off[kMaxTaps];
  const bool fits = reach_y >= 0 && reach_y < g.h && reach_x >= 0 && reach_x < g.w;
  if (fits)
    for (int64_t ky = 0, t = 0; ky < g.kh; ++ky)
      for (int64_t kx = 0; kx < g.kw; ++kx) whole[t++] = (ky * g.dh * g.w + kx * g.dw) * g.c;
  for (int64_t b = 0; b < g.n; ++b)
    for (int64_t oy = 0; oy < g.oh; ++oy) {
      int64_t y0, y1;
      inside(oy, g.sh, g.ph, g.dh, g.kh, reach_y, g.h, y0, y1);
      for (int64_t ox = 0; ox < g.ow; ++ox) {
        int64_t x0, x1;
        inside(ox, g.sw, g.pw, g.dw, g.kw, reach_x, g.w, x0, x1);
        float* out = y + ((b * g.oh + oy) * g.ow + ox) * g.c;
        const float* img = x + b * image;
        if (fits && y1 - y0 == g.kh && x1 - x0 == g.kw) {  // the whole window inside
          const float* first =
              img + (tap_at(oy, g.sh, g.ph, 0, g.dh) * g.w + tap_at(ox, g.sw, g.pw, 0, g.dw)) * g.c;
          if (!pixel(first, whole, g.kh * g.kw, g.c, out))
            pixel_exact(first, whole, g.kh * g.kw, g.c, out);
          continue;
        }
        int64_t t = 0;
        for (int64_t ky = y0; ky < y1; ++ky) {
          const int64_t row = tap_at(oy, g.sh, g.ph, ky, g.dh) * g.w;
          for (int64_t kx = x0; kx < x1; ++kx) off[t++] = (row + tap_at(ox, g.sw, g.pw, kx, g.dw)) * g.c;
        }
        if (!pixel(img, off, t, g.c, out)) pixel_exact(img, off, t, g.c, out);
      }
    }
}

}  // namespace jaxops::pool
