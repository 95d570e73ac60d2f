// CPU handler of the channels-last max pool (jaxops/pool.h). CPU only: on a GPU the pool
// stays XLA's.
#include <utility>

#include "jaxops/checks.h"
#include "jaxops/pool.h"
#include "jaxops/registry.h"

namespace jaxops::pool {
namespace {

constexpr const char* kOp = "max_pool_nhwc";

// y [N, OH, OW, C] = the max of each window's taps inside x [N, H, W, C] (-inf where none).
ffi::Error max_pool_nhwc(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y, int64_t kh,
                         int64_t kw, int64_t sh, int64_t sw, int64_t dh, int64_t dw, int64_t ph,
                         int64_t pw, int64_t isa) {
  constexpr Types kF32 = types_of({DataType::F32});
  for (auto [what, t] : {std::pair{"x", x.element_type()}, std::pair{"y", y->element_type()}})
    if (auto err = check_type(what, t, kF32); !err.empty()) return invalid(kOp, err);
  auto xd = x.dimensions(), yd = y->dimensions();
  if (xd.size() != 4 || yd.size() != 4 || yd[0] != xd[0] || yd[3] != xd[3])
    return invalid(kOp, "x [N, H, W, C] and y [N, OH, OW, C] must have rank 4 and agree");
  const Geometry g{xd[0], xd[1], xd[2], xd[3], kh, kw, yd[1], yd[2], sh, sw, dh, dw, ph, pw};
  if (auto err = check(g); !err.empty()) return invalid(kOp, err);
  if (isa < 0 || isa > int64_t(Isa::kAvx512))
    return invalid(kOp, "isa must be 0 (the best the CPU has), 1 (generic), 2 (AVX2), 3 (AVX-512)");
  if (y->element_count() > 0)
    max_pool(g, x.reinterpret_data<float>(), y->reinterpret_data<float>(), Isa(isa));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MaxPoolNhwcCpu, max_pool_nhwc,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("kh")
                                  .Attr<int64_t>("kw")
                                  .Attr<int64_t>("sh")
                                  .Attr<int64_t>("sw")
                                  .Attr<int64_t>("dh")
                                  .Attr<int64_t>("dw")
                                  .Attr<int64_t>("ph")
                                  .Attr<int64_t>("pw")
                                  .Attr<int64_t>("isa"));

void register_handlers(Registry& r) { r.add("jaxops_max_pool_nhwc", MaxPoolNhwcCpu); }

}  // namespace jaxops::pool
