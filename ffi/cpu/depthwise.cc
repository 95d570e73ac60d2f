// CPU depthwise convolution for training steps, and its two transposes: x [N, C, H, W] (NCHW,
// as the training graphs lay out activations) by w [C * M, 1, KH, KW] (M: the channel
// multiplier; output channel j reads input channel j / M), stride 1, any dilations and pads,
// f32. CPU only: on a GPU these stay XLA's.
//
// XLA:CPU ran windowed_conv's form of them as one slice a kernel tap, thunk by thunk, plus a
// stack of the 49 windows of a 7x7 for the filter gradient (ConvNeXt's [2, 16, 8, 8]: forward
// 11, dx 13, dw 77 us a call beyond a call's cost, one core). Here each plane is copied once
// into a zero-bordered scratch and every tap is a run of contiguous multiply-adds over the
// plane read flat at the scratch's row pitch: the columns past a row's end are computed and
// dropped (a 7x7 over an 8x8 plane: 14 columns a row for 8), so a tap is one long loop where
// the rows were loops of 4-8 lanes. Outputs go in blocks of 64 kept in registers across the
// taps: eight independent chains of 8-lane multiply-adds (one chain of 16 waited on the FMA's
// latency: 3-4x slower). The filter gradient sums each tap over every image in a register of
// its own, eight taps a pass, the lanes added pairwise at the end.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "jaxops/checks.h"
#include "jaxops/registry.h"

#if defined(__x86_64__) || defined(_M_X64)
#define JAXOPS_DEPTHWISE_X86 1
#endif

namespace jaxops::depthwise {
namespace {

constexpr int kLanes = 64;  // a block of outputs (eight AVX2 registers)

struct Geometry {
  int64_t n, c, m;       // images, input channels, multiplier (C * M output channels)
  int64_t h, w;          // x's plane
  int64_t kh, kw;        // the kernel
  int64_t oh, ow;        // y's plane (stride 1: the end pads are implied by them)
  int64_t dh, dw, ph, pw;  // dilations, begin pads
  int64_t reach_h() const { return (kh - 1) * dh; }  // how far the taps reach past a pixel
  int64_t reach_w() const { return (kw - 1) * dw; }
  int64_t taps() const { return kh * kw; }
};

// A zero-bordered plane of `rows` rows at row pitch `pitch`, with room past its end for the
// flat loops' last block (they read up to a pitch and a block further).
struct Plane {
  int64_t rows, pitch;
  int64_t size() const { return (rows + 1) * pitch + kLanes; }
};

// src [sh, sw] into dst (zeroed, `p`'s shape) with its pixel (0, 0) at (r0, c0); what falls
// outside dst is dropped. The region is the same for every plane of a call, so the zero
// border written once stays zero.
void place(const float* src, int64_t sh, int64_t sw, float* dst, const Plane& p, int64_t r0,
           int64_t c0) {
  const int64_t y0 = std::max<int64_t>(0, -r0), y1 = std::min(sh, p.rows - r0);
  const int64_t x0 = std::max<int64_t>(0, -c0), x1 = std::min(sw, p.pitch - c0);
  if (x1 <= x0) return;
  for (int64_t y = y0; y < y1; ++y)
    std::memcpy(dst + (y + r0) * p.pitch + x0 + c0, src + y * sw + x0,
                sizeof(float) * (x1 - x0));
}

// 8 floats as one value (GCC's and Clang's vector extension): a register on AVX2, two on SSE;
// eight make a block. (A float[64]'s loops the compiler kept scalar; 16-float vectors it kept
// on the stack on AVX2.) Inlined always: no vector crosses a call, whatever the ISA, and the
// ABI note -Wpsabi gives for that does not apply.
typedef float V __attribute__((vector_size(32)));
constexpr int kV = 8, kBlock = kLanes / kV;
constexpr int kGroup = 8;  // dw's taps a pass
#pragma GCC diagnostic ignored "-Wpsabi"
#define JAXOPS_INLINE inline __attribute__((always_inline))
JAXOPS_INLINE V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
JAXOPS_INLINE void store(float* p, V v) { std::memcpy(p, &v, sizeof v); }

// out[q] = (accumulate ? out[q] : 0) + sum_t wt[t] * src[off[t] + q] for q < `length` rounded
// up to a block, taps in order, each block's sums in registers.
JAXOPS_INLINE void correlate(const float* __restrict src, const int64_t* off, const float* wt,
                             int64_t taps, int64_t length, bool accumulate,
                             float* __restrict out) {
  for (int64_t q = 0; q < length; q += kLanes) {
    float* o = out + q;
    V acc[kBlock] = {};
    if (accumulate)
      for (int i = 0; i < kBlock; ++i) acc[i] = load(o + i * kV);
    for (int64_t t = 0; t < taps; ++t) {
      const float a = wt[t];
      const float* p = src + off[t] + q;
      for (int i = 0; i < kBlock; ++i) acc[i] += a * load(p + i * kV);
    }
    for (int i = 0; i < kBlock; ++i) store(o + i * kV, acc[i]);
  }
}

// lanes[t] (8 lanes) = sum over the n images' planes and the 8-float blocks of q < `length`
// rounded up to a block of dy[q + l] * x[off[t] + q + l] (dy zero past `length`; image b's
// planes `dy_stride` and `x_stride` floats apart). Taps go in groups of 8, each tap's sum in a
// register of its own: one load of dy serves 8 taps (taps past the last ones of off read
// off's padding and are dropped by the caller).
JAXOPS_INLINE void tap_sums(const float* __restrict dy, const float* __restrict x, int64_t n,
                            int64_t dy_stride, int64_t x_stride, const int64_t* off,
                            int64_t groups, int64_t length, float* __restrict lanes) {
  for (int64_t gi = 0; gi < groups; ++gi) {
    const int64_t* o = off + gi * kGroup;
    V acc[kGroup] = {};
    for (int64_t b = 0; b < n; ++b) {
      const float *d = dy + b * dy_stride, *xs = x + b * x_stride;
      for (int64_t q = 0; q < length; q += kV) {
        const V dv = load(d + q);
        for (int i = 0; i < kGroup; ++i) acc[i] += dv * load(xs + o[i] + q);
      }
    }
    for (int i = 0; i < kGroup; ++i) store(lanes + (gi * kGroup + i) * kV, acc[i]);
  }
}

// The plane loops as the CPU runs them best, or a lower ISA's (tests run each): compiled for
// AVX2 and FMA, or for the baseline (8-float vectors as two SSE registers).
struct Loops {
  void (*correlate)(const float*, const int64_t*, const float*, int64_t, int64_t, bool, float*);
  void (*tap_sums)(const float*, const float*, int64_t, int64_t, int64_t, const int64_t*,
                   int64_t, int64_t, float*);
};
void correlate_plain(const float* src, const int64_t* off, const float* wt, int64_t taps,
                     int64_t length, bool accumulate, float* out) {
  correlate(src, off, wt, taps, length, accumulate, out);
}
void tap_sums_plain(const float* dy, const float* x, int64_t n, int64_t dy_stride,
                    int64_t x_stride, const int64_t* off, int64_t groups, int64_t length,
                    float* lanes) {
  tap_sums(dy, x, n, dy_stride, x_stride, off, groups, length, lanes);
}
#ifdef JAXOPS_DEPTHWISE_X86
__attribute__((target("avx2,fma"))) void correlate_avx2(const float* src, const int64_t* off,
                                                        const float* wt, int64_t taps,
                                                        int64_t length, bool accumulate,
                                                        float* out) {
  correlate(src, off, wt, taps, length, accumulate, out);
}
__attribute__((target("avx2,fma"))) void tap_sums_avx2(const float* dy, const float* x,
                                                       int64_t n, int64_t dy_stride,
                                                       int64_t x_stride, const int64_t* off,
                                                       int64_t groups, int64_t length,
                                                       float* lanes) {
  tap_sums(dy, x, n, dy_stride, x_stride, off, groups, length, lanes);
}
#endif

// isa: 0 the best the CPU has, 1 the baseline, 2 (or higher) AVX2 where the CPU has it.
Loops loops(int64_t isa) {
#ifdef JAXOPS_DEPTHWISE_X86
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2 && isa != 1) return {correlate_avx2, tap_sums_avx2};
#endif
  (void)isa;
  return {correlate_plain, tap_sums_plain};
}

// A register's lanes added pairwise (a fixed order).
float lane_sum(float* v) {
  for (int width = kV / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) v[l] += v[l + width];
  return v[0];
}

// The [rows, cols] corner of `full` (row pitch `pitch`) into dst [rows, cols].
void take(const float* full, int64_t pitch, int64_t rows, int64_t cols, float* dst) {
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(dst + r * cols, full + r * pitch, sizeof(float) * cols);
}

// The flat offset of each tap (ky, kx) in a plane of row pitch `pitch`; flipped: the tap
// (KH - 1 - ky, KW - 1 - kx)'s (the transpose reads dy the other way round).
void offsets(const Geometry& g, int64_t pitch, bool flipped, std::vector<int64_t>& off) {
  off.resize(g.taps());
  for (int64_t ky = 0; ky < g.kh; ++ky)
    for (int64_t kx = 0; kx < g.kw; ++kx) {
      const int64_t y = flipped ? g.kh - 1 - ky : ky, x = flipped ? g.kw - 1 - kx : kx;
      off[ky * g.kw + kx] = y * g.dh * pitch + x * g.dw;
    }
}

// Scratch of the calling thread, kept between calls (every call zeroes what it reads), unless
// large: a thread keeps at most 1 MiB.
struct Scratch {
  std::vector<float> plane, full, lanes;
  std::vector<int64_t> off;
  static Scratch& get() {
    thread_local Scratch s;
    return s;
  }
  void trim() {
    for (auto* v : {&plane, &full, &lanes})
      if (v->capacity() > (size_t(1) << 18)) std::vector<float>().swap(*v);
  }
};

void zeroed(std::vector<float>& v, int64_t size) { v.assign(size_t(size), 0.f); }

// The correlation both ways. Forward (transpose false): y [N, C * M, OH, OW] = x (*) w, each x
// plane read for its M outputs. dx (transpose true): the transpose in x at dy, dx [N, C, H, W]:
// dx[i] = sum over the taps t and the M outputs of w[t] * dy[i + pad - t * dilation], dy read
// as zero outside it: a correlation of dy, zero-bordered by the taps' reach less the pads, with
// the flipped kernel, the M planes summed into one.
void correlation(const Geometry& g, const Loops& f, bool transpose, const float* src,
                 const float* w, float* dst) {
  Scratch& s = Scratch::get();
  const int64_t rows = transpose ? g.h : g.oh, cols = transpose ? g.w : g.ow;  // a dst plane
  const int64_t src_rows = transpose ? g.oh : g.h, src_cols = transpose ? g.ow : g.w;
  const int64_t r0 = transpose ? g.reach_h() - g.ph : g.ph,  // where src's pixel (0, 0) lies
      c0 = transpose ? g.reach_w() - g.pw : g.pw;
  const Plane p{rows + g.reach_h(), cols + g.reach_w()};
  const int64_t length = rows * p.pitch;
  zeroed(s.plane, p.size());
  s.full.resize(size_t(length + kLanes));
  offsets(g, p.pitch, transpose, s.off);
  for (int64_t b = 0; b < g.n; ++b)
    for (int64_t ci = 0; ci < g.c; ++ci) {
      for (int64_t mi = 0; mi < g.m; ++mi) {
        const int64_t j = ci * g.m + mi;  // the output channel
        if (transpose || mi == 0)
          place(src + (transpose ? b * g.c * g.m + j : b * g.c + ci) * src_rows * src_cols,
                src_rows, src_cols, s.plane.data(), p, r0, c0);
        f.correlate(s.plane.data(), s.off.data(), w + j * g.taps(), g.taps(), length,
                    transpose && mi > 0, s.full.data());
        if (!transpose)
          take(s.full.data(), p.pitch, rows, cols, dst + (b * g.c * g.m + j) * rows * cols);
      }
      if (transpose)
        take(s.full.data(), p.pitch, rows, cols, dst + (b * g.c + ci) * rows * cols);
    }
  s.trim();
}

bool all_finite(const float* v, int64_t n) {
  bool ok = true;
  for (int64_t i = 0; i < n; ++i) ok &= std::isfinite(v[i]);
  return ok;
}

// dw [C * M, 1, KH, KW] = the transpose of forward in w at dy: dw[j, t] = sum over the images
// and outputs of dy[j] times the x pixel that tap t reads for it. An input channel's planes of
// every image are placed first (x's, and dy's of its M outputs), then each tap sums them all in
// one register. The flat loops multiply the zeros past each dy row's end by x pixels no output
// of that tap reads: where a channel's x holds an inf or a NaN, its products go row by row
// instead (as the reference sums them).
void dw(const Geometry& g, const Loops& f, const float* dy, const float* x, float* dw_out) {
  Scratch& s = Scratch::get();
  const Plane p{g.oh + g.reach_h(), g.ow + g.reach_w()}, d{g.oh, p.pitch};
  const int64_t length = g.oh * p.pitch, taps = g.taps(), groups = (taps + kGroup - 1) / kGroup;
  zeroed(s.plane, g.n * p.size());
  zeroed(s.full, g.m * g.n * d.size());
  s.lanes.resize(size_t(groups * kGroup * kV));
  offsets(g, p.pitch, false, s.off);
  s.off.resize(size_t(groups * kGroup), 0);  // the last group's padding: tap 0 again
  for (int64_t ci = 0; ci < g.c; ++ci) {
    bool finite = true;
    for (int64_t b = 0; b < g.n; ++b) {
      const float* plane = x + (b * g.c + ci) * g.h * g.w;
      place(plane, g.h, g.w, s.plane.data() + b * p.size(), p, g.ph, g.pw);
      finite &= all_finite(plane, g.h * g.w);
      for (int64_t mi = 0; mi < g.m; ++mi)
        place(dy + (b * g.c * g.m + ci * g.m + mi) * g.oh * g.ow, g.oh, g.ow,
              s.full.data() + (mi * g.n + b) * d.size(), d, 0, 0);
    }
    for (int64_t mi = 0; mi < g.m; ++mi) {
      const float* grads = s.full.data() + mi * g.n * d.size();
      float* lanes = s.lanes.data();
      if (finite) {
        f.tap_sums(grads, s.plane.data(), g.n, d.size(), p.size(), s.off.data(), groups,
                   length, lanes);
      } else {
        std::fill(s.lanes.begin(), s.lanes.end(), 0.f);
        for (int64_t b = 0; b < g.n; ++b)
          for (int64_t t = 0; t < taps; ++t)
            for (int64_t oy = 0; oy < g.oh; ++oy)
              for (int64_t ox = 0; ox < g.ow; ++ox)
                lanes[t * kV + ox % kV] += grads[b * d.size() + oy * p.pitch + ox] *
                                           s.plane[b * p.size() + s.off[t] + oy * p.pitch + ox];
      }
      for (int64_t t = 0; t < taps; ++t)
        dw_out[(ci * g.m + mi) * taps + t] = lane_sum(lanes + t * kV);
    }
  }
  s.trim();
}

constexpr const char* kOp = "depthwise_conv";

// The geometry of x [N, C, H, W], w [C * M, 1, KH, KW] and y [N, C * M, OH, OW] (in whichever
// role each buffer has), or an error. Every size is a buffer's own; with the attributes they
// bound the scratch, checked before anything is allocated.
ffi::Error geometry(ffi::Span<const int64_t> xd, ffi::Span<const int64_t> wd,
                    ffi::Span<const int64_t> yd, int64_t dh, int64_t dw, int64_t ph,
                    int64_t pw, Geometry& g) {
  if (xd.size() != 4 || wd.size() != 4 || yd.size() != 4)
    return invalid(kOp, "x, w and y must have rank 4 (NCHW, [C * M, 1, KH, KW], NCHW)");
  if (dh < 1 || dw < 1 || ph < 0 || pw < 0)
    return invalid(kOp, "dilations must be >= 1 and pads >= 0");
  if (xd[1] < 1 || wd[1] != 1 || wd[0] % xd[1] || yd[0] != xd[0] || yd[1] != wd[0])
    return invalid(kOp, "x [N, C, H, W], w [C * M, 1, KH, KW] and y [N, C * M, OH, OW] do "
                        "not agree");
  g = Geometry{xd[0], xd[1], wd[0] / xd[1], xd[2], xd[3], wd[2], wd[3], yd[2], yd[3],
               dh,    dw,    ph,           pw};
  // (stride 1: the end pads are whatever makes OH and OW, negative ones crops.) The scratch:
  // at most N * (M + 1) planes (dw's: every image's x plane and its M dy planes), each at most
  // rows x pitch and a block
  const double rows = double(std::max(g.oh, g.h)) + double(g.kh - 1) * double(dh) + 1,
               pitch = double(std::max(g.ow, g.w)) + double(g.kw - 1) * double(dw);
  if (double(g.n) * double(g.m + 1) * (rows * pitch + kLanes) > double(int64_t(1) << 31))
    return invalid(kOp, "the kernel's scratch planes must fit 2**31 elements");
  return ffi::Error::Success();
}

enum class Role { kForward, kDx, kDw };

// One handler for the three: (a, b) -> out is (x, w) -> y, (dy, w) -> dx or (dy, x) -> dw.
template <Role kRole>
ffi::Error convolve(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Result<ffi::AnyBuffer> out,
                   int64_t dh, int64_t dw_, int64_t ph, int64_t pw, int64_t isa) {
  // types first: a registered target is public (jaxops/checks.h)
  constexpr Types kF32 = types_of({DataType::F32});
  for (auto [what, t] : {std::pair{"first operand", a.element_type()},
                         std::pair{"second operand", b.element_type()},
                         std::pair{"result", out->element_type()}})
    if (auto err = check_type(what, t, kF32); !err.empty()) return invalid(kOp, err);
  const ffi::AnyBuffer::Dimensions x = kRole == Role::kForward ? a.dimensions()
                                       : kRole == Role::kDx    ? out->dimensions()
                                                               : b.dimensions();
  const ffi::AnyBuffer::Dimensions w = kRole == Role::kDw ? out->dimensions() : b.dimensions();
  const ffi::AnyBuffer::Dimensions y = kRole == Role::kForward ? out->dimensions() : a.dimensions();
  Geometry g;
  if (auto err = geometry(x, w, y, dh, dw_, ph, pw, g); err.failure()) return err;
  if (isa < 0 || isa > 3)
    return invalid(kOp, "isa must be 0 (the best the CPU has), 1 (generic), 2 or 3 (AVX2)");
  const float* pa = a.reinterpret_data<float>();
  const float* pb = b.reinterpret_data<float>();
  float* po = out->reinterpret_data<float>();
  if (a.element_count() == 0 || b.element_count() == 0) {  // an empty sum is zero
    std::fill_n(po, out->element_count(), 0.f);
    return ffi::Error::Success();
  }
  const Loops f = loops(isa);
  if constexpr (kRole == Role::kDw) dw(g, f, pa, pb, po);
  else correlation(g, f, kRole == Role::kDx, pa, pb, po);
  return ffi::Error::Success();
}

}  // namespace

#define JAXOPS_DEPTHWISE_BINDING                                                      \
  ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>() \
      .Attr<int64_t>("dh").Attr<int64_t>("dw").Attr<int64_t>("ph").Attr<int64_t>("pw") \
      .Attr<int64_t>("isa")
XLA_FFI_DEFINE_HANDLER_SYMBOL(DepthwiseForward, convolve<Role::kForward>, JAXOPS_DEPTHWISE_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(DepthwiseDx, convolve<Role::kDx>, JAXOPS_DEPTHWISE_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(DepthwiseDw, convolve<Role::kDw>, JAXOPS_DEPTHWISE_BINDING);
#undef JAXOPS_DEPTHWISE_BINDING

void register_handlers(Registry& r) {
  r.add("jaxops_depthwise_conv", DepthwiseForward);
  r.add("jaxops_depthwise_conv_dx", DepthwiseDx);
  r.add("jaxops_depthwise_conv_dw", DepthwiseDw);
}

}  // namespace jaxops::depthwise
