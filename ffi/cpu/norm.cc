// CPU handlers of LayerNormalizationGrad, SimplifiedLayerNormalizationGrad,
// InvertibleLayerNormalizationGrad, BatchNormalizationGrad and BatchNormInternal (training).
// Sums run in a fixed order, so results are deterministic.
#include <vector>

#include "jaxops/checks.h"
#include "jaxops/norm.h"
#include "jaxops/registry.h"

namespace jaxops::norm {
namespace {

// Pointers of one layer-norm-gradient call; unused ones are null (mean for RMSNorm and the
// invertible op, bias for all but the invertible op, dbias for RMSNorm).
template <typename T>
struct LnArgs {
  const T *dy, *x;
  const acc_t<T> *scale, *bias, *mean, *inv;
  T* dx;
  acc_t<T> *dscale, *dbias;
};

template <int kMode, typename T>
void ln_grad(const LnView& v, const LnArgs<T>& a) {
  using A = acc_t<T>;
  const int64_t n = v.cols;
  std::vector<A> ds(n), db(n);
  for (int64_t g = 0; g < v.groups; ++g) {
    const A* scale = a.scale + g * n;
    const A* bias = a.bias ? a.bias + g * n : nullptr;
    std::fill(ds.begin(), ds.end(), A(0));
    std::fill(db.begin(), db.end(), A(0));
    for (int64_t r = 0; r < v.rows; ++r) {
      const int64_t row = g * v.rows + r, base = row * n;
      const A mean = a.mean ? a.mean[row] : A(0), inv = a.inv[row];
      A sum_b = 0, sum_bx = 0;
      for (int64_t j = 0; j < n; ++j) {
        const A dy = load(a.dy, base + j);
        const A xh = xhat<kMode>(load(a.x, base + j), mean, inv, scale[j], bias ? bias[j] : A(0));
        const A b = dy * scale[j] * inv;
        sum_b += b;
        sum_bx += b * xh;
        ds[j] += dy * xh;
        db[j] += dy;
      }
      const A mean_b = sum_b / A(n), mean_bx = sum_bx / A(n);
      for (int64_t j = 0; j < n; ++j) {
        const A dy = load(a.dy, base + j);
        const A xh = xhat<kMode>(load(a.x, base + j), mean, inv, scale[j], bias ? bias[j] : A(0));
        store(a.dx, base + j, x_grad<kMode>(dy * scale[j] * inv, xh, mean_b, mean_bx));
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      a.dscale[g * n + j] = ds[j];
      if (a.dbias) a.dbias[g * n + j] = db[j];
    }
  }
}

// The handler body shared by the three layer-norm gradients: `small` lists scale, [bias],
// [mean], inv_std in that order, then the reduced outputs.
template <int kMode>
ffi::Error ln_handler(const char* op, ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer scale,
                      const ffi::AnyBuffer* bias, const ffi::AnyBuffer* mean, ffi::AnyBuffer inv,
                      ffi::AnyBuffer* dx, ffi::AnyBuffer* dscale, ffi::AnyBuffer* dbias,
                      int64_t axis, int64_t batch) {
  LnView v;
  const std::string err =
      check_ln(dy, x, scale, bias, mean, inv, dx, dscale, dbias, axis, batch, &v);
  return checked_dispatch(op, err, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    auto cp = [](const ffi::AnyBuffer* b) { return b ? b->reinterpret_data<A>() : nullptr; };
    LnArgs<T> a{dy.reinterpret_data<T>(), x.reinterpret_data<T>(), scale.reinterpret_data<A>(),
                cp(bias), cp(mean), inv.reinterpret_data<A>(), dx->reinterpret_data<T>(),
                dscale->reinterpret_data<A>(),
                dbias ? dbias->reinterpret_data<A>() : nullptr};
    ln_grad<kMode>(v, a);
  });
}

ffi::Error layer_grad(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::AnyBuffer mean,
                      ffi::AnyBuffer inv, ffi::Result<ffi::AnyBuffer> dx,
                      ffi::Result<ffi::AnyBuffer> dscale, ffi::Result<ffi::AnyBuffer> dbias,
                      int64_t axis, int64_t batch) {
  return ln_handler<kLayer>("layer_normalization_grad", dy, x, scale, nullptr, &mean, inv,
                            &*dx, &*dscale, &*dbias, axis, batch);
}
ffi::Error simplified_grad(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer scale,
                           ffi::AnyBuffer inv, ffi::Result<ffi::AnyBuffer> dx,
                           ffi::Result<ffi::AnyBuffer> dscale, int64_t axis, int64_t batch) {
  return ln_handler<kSimplified>("simplified_layer_normalization_grad", dy, x, scale, nullptr,
                                 nullptr, inv, &*dx, &*dscale, nullptr, axis, batch);
}
ffi::Error invertible_grad(ffi::AnyBuffer dy, ffi::AnyBuffer y, ffi::AnyBuffer scale,
                           ffi::AnyBuffer bias, ffi::AnyBuffer inv, ffi::Result<ffi::AnyBuffer> dx,
                           ffi::Result<ffi::AnyBuffer> dscale, ffi::Result<ffi::AnyBuffer> dbias,
                           int64_t axis, int64_t batch) {
  return ln_handler<kInvertible>("invertible_layer_normalization_grad", dy, y, scale, &bias,
                                 nullptr, inv, &*dx, &*dscale, &*dbias, axis, batch);
}

// ------------------------------------------------------------------------------------------
// BatchNorm: channel c of group g holds x[((g * n + i) * c + ch) * s + k] for i < n, k < s.

// Where image i's run of channel ch of group g starts (s elements long).
inline int64_t run_start(const BnView& v, int64_t g, int64_t i, int64_t ch) {
  return ((g * v.n + i) * v.c + ch) * v.s;
}

template <typename F>
void for_channel(const BnView& v, int64_t g, int64_t ch, F&& f) {
  for (int64_t i = 0; i < v.n; ++i) {
    const int64_t base = run_start(v, g, i, ch);
    for (int64_t k = 0; k < v.s; ++k) f(base + k);
  }
}

// The sum of term(i) over channel ch of group g in kLanes partial sums (element k of each
// contiguous spatial run in lane k % kLanes), added pairwise at the end: a fixed order, in
// lanes the compiler keeps in vector registers. A serial sum waits on each add: RegNet's train
// step (one core) spent 47 us in its nine BatchNormInternal calls and 33 in the gradients' with
// one, 25 and 26 with lanes (2026-12-01).
constexpr int64_t kLanes = 16;
template <typename A, typename F>
A channel_sum(const BnView& v, int64_t g, int64_t ch, F&& term) {
  A lanes[kLanes] = {};
  for (int64_t i = 0; i < v.n; ++i) {
    const int64_t base = run_start(v, g, i, ch);
    int64_t k = 0;
    for (; k + kLanes <= v.s; k += kLanes)
      for (int64_t l = 0; l < kLanes; ++l) lanes[l] += term(base + k + l);
    for (int64_t l = 0; k < v.s; ++k, ++l) lanes[l] += term(base + k);
  }
  for (int64_t w = kLanes / 2; w > 0; w /= 2)
    for (int64_t l = 0; l < w; ++l) lanes[l] += lanes[l + w];
  return lanes[0];
}

template <typename T>
void bn_grad(const BnView& v, const T* dy, const T* x, const acc_t<T>* scale,
             const acc_t<T>* mean, const acc_t<T>* inv, T* dx, acc_t<T>* dscale, acc_t<T>* dbias) {
  using A = acc_t<T>;
  const A m = A(v.n * v.s);
  for (int64_t g = 0; g < v.groups; ++g)
    for (int64_t ch = 0; ch < v.c; ++ch) {
      const int64_t j = g * v.c + ch;
      const A mu = mean[j], is = inv[j];
      const A sum_dy = channel_sum<A>(v, g, ch, [&](int64_t i) { return A(load(dy, i)); });
      const A sum_dyx = channel_sum<A>(v, g, ch, [&](int64_t i) {
        return A(load(dy, i)) * (A(load(x, i)) - mu) * is;
      });
      for_channel(v, g, ch, [&](int64_t i) {
        const A xh = (load(x, i) - mu) * is;
        store(dx, i, bn_x_grad(load(dy, i), xh, scale[j], is, sum_dy, sum_dyx, m));
      });
      dscale[j] = sum_dyx;
      dbias[j] = sum_dy;
    }
}

template <typename T>
void bn_train(const BnView& v, const T* x, const acc_t<T>* scale, const acc_t<T>* b,
              const acc_t<T>* in_mean, const acc_t<T>* in_var, float epsilon, float momentum, T* y,
              acc_t<T>* run_mean, acc_t<T>* run_var, acc_t<T>* saved_mean, acc_t<T>* saved_inv) {
  using A = acc_t<T>;
  const A m = A(v.n * v.s), mom = A(momentum);
  for (int64_t g = 0; g < v.groups; ++g)
    for (int64_t ch = 0; ch < v.c; ++ch) {
      const int64_t j = g * v.c + ch;
      const A mean = channel_sum<A>(v, g, ch, [&](int64_t i) { return A(load(x, i)); }) / m;
      // two passes: the variance without cancellation
      const A sq = channel_sum<A>(v, g, ch, [&](int64_t i) {
        const A d = load(x, i) - mean;
        return d * d;
      });
      const A var = sq / m, inv = rsqrt_of(var + A(epsilon));
      for_channel(v, g, ch, [&](int64_t i) {
        store(y, i, scale[j] * (load(x, i) - mean) * inv + b[j]);
      });
      run_mean[j] = mom * in_mean[j] + (A(1) - mom) * mean;
      run_var[j] = mom * in_var[j] + (A(1) - mom) * var;
      saved_mean[j] = mean;
      saved_inv[j] = inv;
    }
}

ffi::Error batch_norm_grad(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer scale,
                           ffi::AnyBuffer mean, ffi::AnyBuffer inv, ffi::Result<ffi::AnyBuffer> dx,
                           ffi::Result<ffi::AnyBuffer> dscale, ffi::Result<ffi::AnyBuffer> dbias,
                           int64_t batch) {
  const char* op = "batch_normalization_grad";
  BnView v;
  const std::string err = check_bn_grad(dy, x, scale, mean, inv, *dx, *dscale, *dbias, batch, &v);
  return checked_dispatch(op, err, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    bn_grad(v, dy.reinterpret_data<T>(), x.reinterpret_data<T>(), scale.reinterpret_data<A>(),
            mean.reinterpret_data<A>(), inv.reinterpret_data<A>(), dx->reinterpret_data<T>(),
            dscale->reinterpret_data<A>(), dbias->reinterpret_data<A>());
  });
}

ffi::Error batch_norm_train(ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::AnyBuffer b,
                            ffi::AnyBuffer in_mean, ffi::AnyBuffer in_var,
                            ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> run_mean,
                            ffi::Result<ffi::AnyBuffer> run_var,
                            ffi::Result<ffi::AnyBuffer> saved_mean,
                            ffi::Result<ffi::AnyBuffer> saved_inv, float epsilon, float momentum,
                            int64_t batch) {
  const char* op = "batch_norm_internal";
  BnView v;
  const std::string err = check_bn_train(x, scale, b, in_mean, in_var, *y, *run_mean, *run_var,
                                         *saved_mean, *saved_inv, batch, &v);
  return checked_dispatch(op, err, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    bn_train(v, x.reinterpret_data<T>(), scale.reinterpret_data<A>(), b.reinterpret_data<A>(),
             in_mean.reinterpret_data<A>(), in_var.reinterpret_data<A>(), epsilon, momentum,
             y->reinterpret_data<T>(), run_mean->reinterpret_data<A>(),
             run_var->reinterpret_data<A>(), saved_mean->reinterpret_data<A>(),
             saved_inv->reinterpret_data<A>());
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LayerNormGradCpu, layer_grad, bind_layer(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(SimplifiedNormGradCpu, simplified_grad, bind_simplified(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(InvertibleNormGradCpu, invertible_grad, bind_layer(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(BatchNormGradCpu, batch_norm_grad, bind_bn_grad(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(BatchNormTrainCpu, batch_norm_train, bind_bn_train(ffi::Ffi::Bind()));

void register_handlers(Registry& r) {
  r.add("jaxops_layer_normalization_grad", LayerNormGradCpu);
  r.add("jaxops_simplified_layer_normalization_grad", SimplifiedNormGradCpu);
  r.add("jaxops_invertible_layer_normalization_grad", InvertibleNormGradCpu);
  r.add("jaxops_batch_normalization_grad", BatchNormGradCpu);
  r.add("jaxops_batch_norm_internal", BatchNormTrainCpu);
}

}  // namespace jaxops::norm
