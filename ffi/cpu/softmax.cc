// CPU handlers of SoftmaxGrad(_13) and LogSoftmaxGrad(_13).
#include <algorithm>
#include <vector>

#include "jaxops/checks.h"
#include "jaxops/registry.h"
#include "jaxops/softmax.h"

namespace jaxops::softmax {
namespace {

template <typename Math, typename T>
void run(const View& v, const T* dy, const T* y, T* dx) {
  using A = acc_t<T>;
  if (v.inner == 1) {  // contiguous rows: one running sum, loops the compiler vectorizes
    for (int64_t o = 0; o < v.outer; ++o) {
      const T *dyr = dy + o * v.n, *yr = y + o * v.n;
      A s = 0;
      for (int64_t k = 0; k < v.n; ++k) s += Math::term(load(dyr, k), load(yr, k));
      T* dxr = dx + o * v.n;
      for (int64_t k = 0; k < v.n; ++k) store(dxr, k, Math::out(load(dyr, k), load(yr, k), s));
    }
    return;
  }
  std::vector<A> sums(v.inner);  // strided columns: one sum per inner index, rows in order
  for (int64_t o = 0; o < v.outer; ++o) {
    const int64_t base = o * v.n * v.inner;
    std::fill(sums.begin(), sums.end(), A(0));
    for (int64_t k = 0; k < v.n; ++k)
      for (int64_t j = 0; j < v.inner; ++j) {
        const int64_t i = base + k * v.inner + j;
        sums[j] += Math::term(load(dy, i), load(y, i));
      }
    for (int64_t k = 0; k < v.n; ++k)
      for (int64_t j = 0; j < v.inner; ++j) {
        const int64_t i = base + k * v.inner + j;
        store(dx, i, Math::out(load(dy, i), load(y, i), sums[j]));
      }
  }
}

template <typename Math>
ffi::Error handler(const char* op, ffi::AnyBuffer dy, ffi::AnyBuffer y,
                   ffi::Result<ffi::AnyBuffer> dx, int64_t axis, int64_t through_end) {
  View v;
  return checked_dispatch(op, check_args(dy, y, *dx, axis, through_end != 0, &v),
                          dy.element_type(), [&](auto tag) {
    using T = decltype(tag);
    if (dy.element_count() > 0)
      run<Math>(v, dy.reinterpret_data<T>(), y.reinterpret_data<T>(), dx->reinterpret_data<T>());
  });
}

ffi::Error softmax_grad(ffi::AnyBuffer dy, ffi::AnyBuffer y, ffi::Result<ffi::AnyBuffer> dx,
                        int64_t axis, int64_t through_end) {
  return handler<SoftmaxGrad>("softmax_grad", dy, y, dx, axis, through_end);
}
ffi::Error log_softmax_grad(ffi::AnyBuffer dy, ffi::AnyBuffer y, ffi::Result<ffi::AnyBuffer> dx,
                            int64_t axis, int64_t through_end) {
  return handler<LogSoftmaxGrad>("log_softmax_grad", dy, y, dx, axis, through_end);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SoftmaxGradCpu, softmax_grad, bind_args(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(LogSoftmaxGradCpu, log_softmax_grad, bind_args(ffi::Ffi::Bind()));

void register_handlers(Registry& r) {
  r.add("jaxops_softmax_grad", SoftmaxGradCpu);
  r.add("jaxops_log_softmax_grad", LogSoftmaxGradCpu);
}

}  // namespace jaxops::softmax
