// CPU handlers of the softmax cross-entropy row kernels (loss.h): forward (nll, lse and
// optionally log_prob) and backward (d_logits, optionally plus a bias).
#include <cmath>
#include <string>

#include "jaxops/checks.h"
#include "jaxops/loss.h"
#include "jaxops/registry.h"

namespace jaxops::loss {
namespace {

// Two sweeps over a row (max, then the sum of exponentials, added in f64 so that long rows
// keep f32 accuracy); the CUDA kernel merges the same quantities online in one read.
template <typename T, typename O>
void forward(int64_t rows, int64_t c, const T* x, const int32_t* labels, acc_t<T>* nll_out,
             acc_t<T>* lse_out, O* log_prob) {
  using A = acc_t<T>;
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * c;
    A m = -INFINITY;
    bool nan = false;
    for (int64_t k = 0; k < c; ++k) {
      const A v = load(xr, k);
      m = v > m ? v : m;
      nan |= v != v;
    }
    double s = 0;
    if (m != A(-INFINITY))
      for (int64_t k = 0; k < c; ++k) s += double(exp_(load(xr, k) - m));
    const A lse = nan ? A(NAN) : m == A(-INFINITY) ? m : A(double(m) + std::log(s));
    const int32_t l = labels[r];
    lse_out[r] = lse;
    nll_out[r] = in_range(l, c) ? lse - load(xr, l) : A(0);
    if (log_prob)
      for (int64_t k = 0; k < c; ++k) store(log_prob + r * c, k, acc_t<O>(load(xr, k) - lse));
  }
}

template <typename T, typename O>
void backward(int64_t rows, int64_t c, const acc_t<T>* g, const T* x, const acc_t<T>* lse,
              const int32_t* labels, const O* bias, O* d) {
  using A = acc_t<T>;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t base = r * c;
    const int32_t l = labels[r];
    for (int64_t k = 0; k < c; ++k) {
      A v = grad(g[r], load(x, base + k), lse[r], k == l);
      if (bias) v += A(load(bias, base + k));
      store(d, base + k, acc_t<O>(v));
    }
  }
}

ffi::Error fwd_impl(const char* op, ffi::AnyBuffer x, ffi::AnyBuffer labels,
                    ffi::Result<ffi::AnyBuffer> nll, ffi::Result<ffi::AnyBuffer> lse,
                    ffi::AnyBuffer* log_prob, int64_t out_type) {
  int64_t rows, c;
  const std::string err = check_fwd(x, labels, *nll, *lse, log_prob, out_type, &rows, &c);
  const ffi::DataType o = log_prob ? log_prob->element_type() : x.element_type();
  return checked_dispatch(op, err, x.element_type(), o, [&](auto tt, auto oo) {
    using T = decltype(tt);
    using O = decltype(oo);
    if (rows > 0)
      forward<T, O>(rows, c, x.reinterpret_data<T>(), labels.reinterpret_data<int32_t>(),
                    nll->reinterpret_data<acc_t<T>>(), lse->reinterpret_data<acc_t<T>>(),
                    log_prob ? log_prob->reinterpret_data<O>() : nullptr);
  });
}

ffi::Error bwd_impl(const char* op, ffi::AnyBuffer g, ffi::AnyBuffer x, ffi::AnyBuffer lse,
                    ffi::AnyBuffer labels, const ffi::AnyBuffer* bias, ffi::AnyBuffer* d,
                    int64_t out_type) {
  int64_t rows, c;
  const std::string err = check_bwd(g, x, lse, labels, bias, *d, out_type, &rows, &c);
  return checked_dispatch(op, err, x.element_type(), d->element_type(), [&](auto tt, auto oo) {
    using T = decltype(tt);
    using O = decltype(oo);
    if (d->element_count() > 0)
      backward<T, O>(rows, c, g.reinterpret_data<acc_t<T>>(), x.reinterpret_data<T>(),
                     lse.reinterpret_data<acc_t<T>>(), labels.reinterpret_data<int32_t>(),
                     bias ? bias->reinterpret_data<O>() : nullptr, d->reinterpret_data<O>());
  });
}

ffi::Error sce_fwd(ffi::AnyBuffer x, ffi::AnyBuffer labels, ffi::Result<ffi::AnyBuffer> nll,
                   ffi::Result<ffi::AnyBuffer> lse) {
  return fwd_impl("softmax_cross_entropy_rows", x, labels, nll, lse, nullptr, 0);
}
ffi::Error sce_fwd_log_prob(ffi::AnyBuffer x, ffi::AnyBuffer labels,
                            ffi::Result<ffi::AnyBuffer> nll, ffi::Result<ffi::AnyBuffer> lse,
                            ffi::Result<ffi::AnyBuffer> log_prob, int64_t out_type) {
  return fwd_impl("softmax_cross_entropy_rows_log_prob", x, labels, nll, lse, &*log_prob,
                  out_type);
}
ffi::Error sce_bwd(ffi::AnyBuffer g, ffi::AnyBuffer x, ffi::AnyBuffer lse, ffi::AnyBuffer labels,
                   ffi::Result<ffi::AnyBuffer> d, int64_t out_type) {
  return bwd_impl("softmax_cross_entropy_rows_grad", g, x, lse, labels, nullptr, &*d, out_type);
}
ffi::Error sce_bwd_bias(ffi::AnyBuffer g, ffi::AnyBuffer x, ffi::AnyBuffer lse,
                        ffi::AnyBuffer labels, ffi::AnyBuffer bias,
                        ffi::Result<ffi::AnyBuffer> d, int64_t out_type) {
  return bwd_impl("softmax_cross_entropy_rows_grad_bias", g, x, lse, labels, &bias, &*d,
                  out_type);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SceFwdCpu, sce_fwd, bind_fwd(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(SceFwdLogProbCpu, sce_fwd_log_prob, bind_fwd_log_prob(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(SceBwdCpu, sce_bwd, bind_bwd(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(SceBwdBiasCpu, sce_bwd_bias, bind_bwd_bias(ffi::Ffi::Bind()));

void register_handlers(Registry& r) {
  r.add("jaxops_sce_fwd", SceFwdCpu);
  r.add("jaxops_sce_fwd_log_prob", SceFwdLogProbCpu);
  r.add("jaxops_sce_bwd", SceBwdCpu);
  r.add("jaxops_sce_bwd_bias", SceBwdBiasCpu);
}

}  // namespace jaxops::loss
