// LayerNormalizationGrad family and BatchNorm math, written once for the CPU handlers and the
// CUDA kernels.
//
// Layer norms view X (or Y for the invertible op) as [groups, rows, cols]: `batch` leading
// group dims (vmap's batch dims; 0 for a direct call), the rows up to `axis`, the normalised
// dims from `axis` on. scale/bias hold groups*cols values, mean/inv_std groups*rows.
//   xhat = (X - mean) * inv_std    (LayerNormalizationGrad)
//        = X * inv_std             (SimplifiedLayerNormalizationGrad, RMSNorm)
//        = (Y - bias) / scale      (InvertibleLayerNormalizationGrad)
//   B = dY * scale * inv_std;  X_grad = B - mean_row(B) - xhat * mean_row(B * xhat)
//   (RMSNorm drops the mean_row(B) term); scale_grad = sum_rows(dY * xhat), bias_grad = sum_rows(dY).
// BatchNorm views X as [groups, n, c, s] (channel axis 1 of ORT's NCHW) and reduces over n, s.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>

#include "jaxops/checks.h"
#include "jaxops/dtype.h"

namespace jaxops::norm {

enum Mode : int { kLayer = 0, kSimplified = 1, kInvertible = 2 };

template <int kMode, typename A>
JAXOPS_HD A xhat(A x, A mean, A inv_std, A scale, A bias) {
  if constexpr (kMode == kInvertible) return (x - bias) / scale;
  else if constexpr (kMode == kSimplified) return x * inv_std;
  else return (x - mean) * inv_std;
}

// b = dY * scale * inv_std; mean_b, mean_bx: row means of b and b * xhat.
template <int kMode, typename A>
JAXOPS_HD A x_grad(A b, A xh, A mean_b, A mean_bx) {
  if constexpr (kMode == kSimplified) return b - xh * mean_bx;
  else return b - mean_b - xh * mean_bx;
}

// BatchNormalizationGrad: sum_dy, sum_dyx are the channel sums of dY and dY * xhat over m values.
template <typename A>
JAXOPS_HD A bn_x_grad(A dy, A xh, A scale, A inv_std, A sum_dy, A sum_dyx, A m) {
  return scale * inv_std * (dy - sum_dy / m - xh * sum_dyx / m);
}

template <typename A> JAXOPS_HD A rsqrt_of(A v) {
#if defined(__CUDA_ARCH__)
  return A(1) / sqrt(v);
#else
  return A(1) / std::sqrt(v);
#endif
}

struct LnView { int64_t groups = 1, rows = 1, cols = 1; };
struct BnView { int64_t groups = 1, n = 1, c = 1, s = 1; };

// Returns an error message, empty when the arguments are valid.
inline std::string make_ln_view(ffi::Span<const int64_t> dims, int64_t axis, int64_t batch,
                                LnView* v) {
  const int64_t rank = static_cast<int64_t>(dims.size());
  if (batch < 0 || batch > axis || axis > rank)
    return "axis " + std::to_string(axis) + " out of range";
  *v = LnView{};
  for (int64_t i = 0; i < rank; ++i)
    (i < batch ? v->groups : i < axis ? v->rows : v->cols) *= dims[i];
  return {};
}

inline std::string make_bn_view(ffi::Span<const int64_t> dims, int64_t batch, BnView* v) {
  const int64_t rank = static_cast<int64_t>(dims.size());
  if (batch < 0 || rank < batch + 2) return "X must have rank >= 2 (N, C, ...)";
  *v = BnView{};
  for (int64_t i = 0; i < rank; ++i) {
    if (i < batch) v->groups *= dims[i];
    else if (i == batch) v->n = dims[i];
    else if (i == batch + 1) v->c = dims[i];
    else v->s *= dims[i];
  }
  return {};
}

inline ffi::DataType acc_dtype(ffi::DataType dt) {
  return dt == ffi::DataType::F64 ? ffi::DataType::F64 : ffi::DataType::F32;
}

// Checks shared by the handlers: `big` buffers share X's dtype and dims; each `small` buffer
// has acc_t's dtype and `count` elements. Returns an error message, empty when valid.
struct Small { const ffi::AnyBuffer* buf; int64_t count; const char* what; };

template <size_t NB, size_t NS>
std::string check_buffers(const ffi::AnyBuffer* const (&big)[NB], const Small (&small)[NS]) {
  const ffi::AnyBuffer& x = *big[0];
  for (const ffi::AnyBuffer* b : big) {
    if (b->element_type() != x.element_type()) return "dY, X and X_grad must share one dtype";
    auto d = b->dimensions(), dx = x.dimensions();
    if (d.size() != dx.size()) return "dY, X and X_grad must share one shape";
    for (size_t i = 0; i < d.size(); ++i)
      if (d[i] != dx[i]) return "dY, X and X_grad must share one shape";
  }
  const ffi::DataType acc = acc_dtype(x.element_type());
  for (const Small& s : small) {
    if (s.buf->element_type() != acc) return std::string(s.what) + " has the wrong dtype";
    if (static_cast<int64_t>(s.buf->element_count()) != s.count)
      return std::string(s.what) + " has the wrong number of elements";
  }
  return {};
}

// Each handler's full check, for both platforms: fills the view, or returns an error message.
// Layer norms: `bias` and `mean` may be absent (RMSNorm, the invertible op); so may dbias.
inline std::string check_ln(const ffi::AnyBuffer& dy, const ffi::AnyBuffer& x,
                            const ffi::AnyBuffer& scale, const ffi::AnyBuffer* bias,
                            const ffi::AnyBuffer* mean, const ffi::AnyBuffer& inv,
                            const ffi::AnyBuffer* dx, const ffi::AnyBuffer* dscale,
                            const ffi::AnyBuffer* dbias, int64_t axis, int64_t batch, LnView* v) {
  if (auto err = check_type("X", x.element_type(), kFloatTypes); !err.empty()) return err;
  if (auto err = make_ln_view(x.dimensions(), axis, batch, v); !err.empty()) return err;
  const int64_t feat = v->groups * v->cols, rows = v->groups * v->rows;
  const ffi::AnyBuffer* big[] = {&x, &dy, dx};
  const Small small[] = {{&scale, feat, "scale"}, {bias ? bias : &scale, feat, "bias"},
                         {mean ? mean : &inv, rows, "mean"}, {&inv, rows, "inv_std"},
                         {dscale, feat, "scale_grad"}, {dbias ? dbias : dscale, feat, "bias_grad"}};
  return check_buffers(big, small);
}

inline std::string check_bn_grad(const ffi::AnyBuffer& dy, const ffi::AnyBuffer& x,
                                 const ffi::AnyBuffer& scale, const ffi::AnyBuffer& mean,
                                 const ffi::AnyBuffer& inv, const ffi::AnyBuffer& dx,
                                 const ffi::AnyBuffer& dscale, const ffi::AnyBuffer& dbias,
                                 int64_t batch, BnView* v) {
  if (auto err = check_type("X", x.element_type(), kFloatTypes); !err.empty()) return err;
  if (auto err = make_bn_view(x.dimensions(), batch, v); !err.empty()) return err;
  const int64_t ch = v->groups * v->c;
  const ffi::AnyBuffer* big[] = {&x, &dy, &dx};
  const Small small[] = {{&scale, ch, "scale"}, {&mean, ch, "mean"}, {&inv, ch, "inv_std"},
                         {&dscale, ch, "scale_grad"}, {&dbias, ch, "bias_grad"}};
  return check_buffers(big, small);
}

inline std::string check_bn_train(const ffi::AnyBuffer& x, const ffi::AnyBuffer& scale,
                                  const ffi::AnyBuffer& b, const ffi::AnyBuffer& in_mean,
                                  const ffi::AnyBuffer& in_var, const ffi::AnyBuffer& y,
                                  const ffi::AnyBuffer& run_mean, const ffi::AnyBuffer& run_var,
                                  const ffi::AnyBuffer& saved_mean,
                                  const ffi::AnyBuffer& saved_inv, int64_t batch, BnView* v) {
  if (auto err = check_type("X", x.element_type(), kFloatTypes); !err.empty()) return err;
  if (auto err = make_bn_view(x.dimensions(), batch, v); !err.empty()) return err;
  const int64_t ch = v->groups * v->c;
  const ffi::AnyBuffer* big[] = {&x, &y};
  const Small small[] = {{&scale, ch, "scale"}, {&b, ch, "B"}, {&in_mean, ch, "input_mean"},
                         {&in_var, ch, "input_var"}, {&run_mean, ch, "running_mean"},
                         {&run_var, ch, "running_var"}, {&saved_mean, ch, "saved_mean"},
                         {&saved_inv, ch, "saved_inv_std"}};
  return check_buffers(big, small);
}

// FFI signatures both platforms share, appended to a binding (CUDA's starts with its stream).
// Big operands (dY, X/Y, X_grad) share one dtype T; the small ones (scale, bias, statistics and
// the reduced outputs) are acc_t<T> (Python casts them).
// Layer: (dY, X, scale, mean, inv_std) -> (dX, dscale, dbias); invertible: the same with
// (dY, Y, scale, bias, inv_std).
template <typename B> auto bind_layer(B b) {
  return std::move(b).template Arg<ffi::AnyBuffer>().template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>().template Arg<ffi::AnyBuffer>().template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>().template Ret<ffi::AnyBuffer>().template Ret<ffi::AnyBuffer>()
      .template Attr<int64_t>("axis").template Attr<int64_t>("batch");
}
template <typename B> auto bind_simplified(B b) {  // (dY, X, scale, inv_std) -> (dX, dscale)
  return std::move(b).template Arg<ffi::AnyBuffer>().template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>().template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>().template Ret<ffi::AnyBuffer>()
      .template Attr<int64_t>("axis").template Attr<int64_t>("batch");
}
template <typename B> auto bind_bn_grad(B b) {  // (dY, X, scale, mean, inv_std) -> (dX, dscale, dbias)
  return std::move(b).template Arg<ffi::AnyBuffer>().template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>().template Arg<ffi::AnyBuffer>().template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>().template Ret<ffi::AnyBuffer>().template Ret<ffi::AnyBuffer>()
      .template Attr<int64_t>("batch");
}
// (X, scale, B, input_mean, input_var) -> (Y, running_mean, running_var, saved_mean, saved_inv_std)
template <typename B> auto bind_bn_train(B b) {
  return std::move(b).template Arg<ffi::AnyBuffer>().template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>().template Arg<ffi::AnyBuffer>().template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>().template Ret<ffi::AnyBuffer>().template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>().template Ret<ffi::AnyBuffer>()
      .template Attr<float>("epsilon").template Attr<float>("momentum")
      .template Attr<int64_t>("batch");
}

}  // namespace jaxops::norm
