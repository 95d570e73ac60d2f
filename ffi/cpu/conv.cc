// CPU handler of the channels-last inference convolution (jaxops/conv.h). CPU only: on a GPU
// the convolution stays XLA's.
#include <utility>

#include "jaxops/checks.h"
#include "jaxops/conv.h"
#include "jaxops/registry.h"

namespace jaxops::conv {
namespace {

constexpr const char* kOp = "conv_nhwc";

// y = clamp(conv(x, w) * scale + shift, lo, hi) per output channel; scale and shift [O] are
// read where `affine` is 1, shift alone (y = clamp(conv(x, w) + shift)) where it is 2. w is
// [KH, KW, C / groups, O], or (rank 5) its panels as pack_weights lays them out,
// [groups, panels of O / groups, KH, KW * C / groups, 16]. threads: 1, or (more) the calling
// thread and up to threads - 1 of the process's helper threads (jaxops/helper.h) share a
// large one.
ffi::Error conv_nhwc(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scale,
                     ffi::AnyBuffer shift, ffi::Result<ffi::AnyBuffer> y, int64_t sh, int64_t sw,
                     int64_t dh, int64_t dw, int64_t ph, int64_t pw, int64_t groups,
                     int64_t affine, float lo, float hi, int64_t isa, int64_t threads) {
  // types first: a registered target is public (jaxops/checks.h)
  constexpr Types kF32 = types_of({DataType::F32});
  for (auto [what, t] : {std::pair{"x", x.element_type()}, std::pair{"w", w.element_type()},
                         std::pair{"scale", scale.element_type()},
                         std::pair{"shift", shift.element_type()},
                         std::pair{"y", y->element_type()}})
    if (auto err = check_type(what, t, kF32); !err.empty()) return invalid(kOp, err);
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  const bool packed = wd.size() == 5;
  if (xd.size() != 4 || !(wd.size() == 4 || packed) || yd.size() != 4)
    return invalid(kOp, "x and y must have rank 4 (NHWC), w rank 4 (HWIO) or 5 (packed)");
  if (groups < 1 || groups > xd[3] || xd[3] % groups || yd[0] != xd[0])
    return invalid(kOp, "x [N, H, W, C] and y [N, OH, OW, O] do not agree with groups");
  const int64_t cg = xd[3] / groups;
  if (packed ? (wd[0] != groups || wd[3] % cg || wd[4] != kCols || yd[3] % groups ||
                wd[1] != (yd[3] / groups + kCols - 1) / kCols)
             : (wd[2] != cg || yd[3] != wd[3]))
    return invalid(kOp, "x [N, H, W, C], w [KH, KW, C / groups, O] (or its panels) and y "
                        "[N, OH, OW, O] do not agree");
  const Geometry g{xd[0], xd[1], xd[2], xd[3], packed ? wd[2] : wd[0],
                   packed ? wd[3] / cg : wd[1], yd[3], yd[1], yd[2],
                   sh,    sw,    dh,    dw,    ph,    pw,    groups};
  if (auto err = check(g); !err.empty()) return invalid(kOp, err);
  if (affine < 0 || affine > 2) return invalid(kOp, "affine must be 0, 1 or 2");
  if (affine && (scale.dimensions().size() != 1 || shift.dimensions().size() != 1 ||
                 scale.dimensions()[0] != g.o || shift.dimensions()[0] != g.o))
    return invalid(kOp, "scale and shift must be [O]");
  if (!(lo <= hi)) return invalid(kOp, "the clamp needs lo <= hi");
  Epilogue e;
  if (affine == 1) e.scale = scale.reinterpret_data<float>();
  if (affine) e.shift = shift.reinterpret_data<float>();
  e.lo = lo, e.hi = hi;
  if (isa < 0 || isa > int64_t(Isa::kAvx512))
    return invalid(kOp, "isa must be 0 (the best the CPU has), 1 (generic), 2 (AVX2), 3 (AVX-512)");
  if (threads < 1) return invalid(kOp, "threads must be >= 1");
  if (y->element_count() > 0)
    convolve(g, x.reinterpret_data<float>(), w.reinterpret_data<float>(),
             y->reinterpret_data<float>(), e, Isa(isa), packed, threads);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ConvNhwcCpu, conv_nhwc,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("sh")
                                  .Attr<int64_t>("sw")
                                  .Attr<int64_t>("dh")
                                  .Attr<int64_t>("dw")
                                  .Attr<int64_t>("ph")
                                  .Attr<int64_t>("pw")
                                  .Attr<int64_t>("groups")
                                  .Attr<int64_t>("affine")
                                  .Attr<float>("lo")
                                  .Attr<float>("hi")
                                  .Attr<int64_t>("isa")
                                  .Attr<int64_t>("threads"));

void register_handlers(Registry& r) { r.add("jaxops_conv_nhwc", ConvNhwcCpu); }

}  // namespace jaxops::conv
