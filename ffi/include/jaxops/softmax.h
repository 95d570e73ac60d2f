// SoftmaxGrad / LogSoftmaxGrad math, written once for the CPU handler and the CUDA kernels.
//
// Both ops reduce over the middle dim of a [outer, n, inner] view of dY and Y:
//   opset-13 ops (one axis a):        outer = prod(d[:a]), n = d[a],        inner = prod(d[a+1:])
//   pre-13 ops (all dims from a on):  outer = prod(d[:a]), n = prod(d[a:]), inner = 1
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>

#include "jaxops/checks.h"
#include "jaxops/dtype.h"

namespace jaxops::softmax {

// dX = Y * (dY - sum(dY * Y))
struct SoftmaxGrad {
  template <typename A> JAXOPS_HD static A term(A dy, A y) { return dy * y; }
  template <typename A> JAXOPS_HD static A out(A dy, A y, A s) { return y * (dy - s); }
};

// dX = dY - exp(Y) * sum(dY), Y the log-softmax output
struct LogSoftmaxGrad {
  template <typename A> JAXOPS_HD static A term(A dy, A) { return dy; }
  template <typename A> JAXOPS_HD static A out(A dy, A y, A s) {
#if defined(__CUDA_ARCH__)
    return dy - exp(y) * s;
#else
    return dy - std::exp(y) * s;
#endif
  }
};

struct View {
  int64_t outer = 1, n = 1, inner = 1;
};

// Builds the view; returns an error message, empty when the arguments are valid.
inline std::string make_view(ffi::Span<const int64_t> dims, int64_t axis, bool through_end,
                             View* v) {
  const int64_t rank = static_cast<int64_t>(dims.size());
  if (rank == 0) return "input must have rank >= 1";
  if (axis < 0 || axis >= rank) return "axis " + std::to_string(axis) + " out of range";
  *v = View{};
  for (int64_t i = 0; i < rank; ++i) {
    if (i < axis) v->outer *= dims[i];
    else if (i == axis || through_end) v->n *= dims[i];
    else v->inner *= dims[i];
  }
  return {};
}

// The handlers' checks, for both platforms: types first, then shapes; fills the view.
inline std::string check_args(const ffi::AnyBuffer& dy, const ffi::AnyBuffer& y,
                              const ffi::AnyBuffer& dx, int64_t axis, bool through_end, View* v) {
  if (auto err = check_type("dY", dy.element_type(), kFloatTypes); !err.empty()) return err;
  if (y.element_type() != dy.element_type() || dx.element_type() != dy.element_type())
    return "dY, Y and dX must share one dtype";
  if (!same_dims(dy, y) || !same_dims(dy, dx)) return "dY, Y and dX must share one shape";
  return make_view(dy.dimensions(), axis, through_end, v);
}

}  // namespace jaxops::softmax

namespace jaxops::softmax {

// The FFI signature both platforms share, appended to a binding (the CUDA one starts with
// its stream): (dY, Y) -> dX, attributes axis (>= 0) and through_end (1: reduce over all
// dims from axis on, the pre-opset-13 rule).
template <typename Binding>
auto bind_args(Binding b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Attr<int64_t>("axis")
      .template Attr<int64_t>("through_end");
}

}  // namespace jaxops::softmax
