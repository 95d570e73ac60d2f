// Multi-tensor optimizer math (AdamWOptimizer, SGDOptimizerV2, LambOptimizer), written once for the CPU
// handler and the CUDA kernel. One call updates every tensor of the parameter list.
//
// The scalar inputs (lr, step, update_signal) stay in device memory on GPU: the kernel reads
// them itself, so a step never waits for a device-to-host copy.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

#include "jaxops/checks.h"
#include "jaxops/dtype.h"

namespace jaxops::optim {

#if defined(__CUDA_ARCH__)
#define JAXOPS_SQRT sqrt
#define JAXOPS_POW pow
#else
#define JAXOPS_SQRT std::sqrt
#define JAXOPS_POW std::pow
#endif

// ORT AdamWOptimizer attributes and the per-step constants derived from lr and step.
template <typename A>
struct AdamW {
  A alpha, beta, eps, wd, lr;
  A bias1 = 1, bias2 = 1;  // 1 - alpha^step, 1 - beta^step (1 without bias correction)
  int64_t mode = 0;        // 0: PyTorch AdamW, 1: HuggingFace AdamW

  // step is used as given (ORT's 1-based step; the op never increments it).
  JAXOPS_HD void set_step(int64_t step, bool correct_bias) {
    if (correct_bias) {
      bias1 = A(1) - JAXOPS_POW(alpha, A(step));
      bias2 = A(1) - JAXOPS_POW(beta, A(step));
    }
  }

  // One element: w, m1, m2 updated in place from gradient g.
  JAXOPS_HD void update(A& w, A g, A& m1, A& m2) const {
    if (mode == 0) update_mode<0>(w, g, m1, m2);
    else update_mode<1>(w, g, m1, m2);
  }

  template <int Mode>
  JAXOPS_HD void update_mode(A& w, A g, A& m1, A& m2) const {
    if constexpr (Mode == 0) {
      w -= lr * wd * w;  // decay first
      m1 = alpha * m1 + (A(1) - alpha) * g;
      m2 = beta * m2 + (A(1) - beta) * g * g;
      const A denom = JAXOPS_SQRT(m2) / JAXOPS_SQRT(bias2) + eps;
      w -= (lr / bias1) * (m1 / denom);
    } else {
      m1 = alpha * m1 + (A(1) - alpha) * g;
      m2 = beta * m2 + (A(1) - beta) * g * g;
      const A denom = JAXOPS_SQRT(m2) + eps;
      w -= (lr * JAXOPS_SQRT(bias2) / bias1) * (m1 / denom);
      if (wd > A(0)) w -= lr * wd * w;  // decay last
    }
  }
};

// ORT LambOptimizer, one group (tensor): the direction d and the trust-ratio step.
template <typename A>
struct Lamb {
  A alpha, beta, lambda, eps, lr;
  A ratio_min, ratio_max;
  A grad_scale = 1;        // the divisor of the gradient (loss scale or norm / max_norm_clip)
  A bias1 = 1, bias2 = 1;  // 1 - alpha^step, 1 - beta^step (1 without correction or step <= 0)

  JAXOPS_HD void set_step(int64_t step) {
    if (step > 0) {
      bias1 = A(1) - JAXOPS_POW(alpha, A(step));
      bias2 = A(1) - JAXOPS_POW(beta, A(step));
    }
  }

  // Loss scale s (1 when absent); a global norm above s * max_norm_clip divides by
  // norm / max_norm_clip instead.
  JAXOPS_HD void set_grad_scale(A loss_scale, bool has_norm, A norm, A max_norm_clip) {
    grad_scale = loss_scale;
    if (has_norm && norm / loss_scale > max_norm_clip) grad_scale = norm / max_norm_clip;
  }

  // d from one element; m1, m2 become the new moments. A non-finite d is 0 and keeps the moments.
  JAXOPS_HD A direction(A w, A g, A& m1, A& m2) const {
    g = g / grad_scale;
    const A n1 = alpha * m1 + (A(1) - alpha) * g;
    const A n2 = beta * m2 + (A(1) - beta) * g * g;
    const A d = lambda * w + (n1 / bias1) / (JAXOPS_SQRT(n2 / bias2) + eps);
    const bool ok = finite(d);
    m1 = blend(ok, n1, m1);
    m2 = blend(ok, n2, m2);
    return ok ? d : A(0);
  }

  // lr * clip(||w|| / ||d||, ratio_min, ratio_max), or lr when either norm is 0.
  JAXOPS_HD A ratio(A w_norm, A d_norm) const {
    if (w_norm == A(0) || d_norm == A(0)) return lr;
    A r = w_norm / d_norm;
    r = r < ratio_min ? ratio_min : r;
    r = r > ratio_max ? ratio_max : r;
    return lr * r;
  }

  // w += -ratio * d unless that is not finite (w kept, new gradient 0); returns the new gradient.
  JAXOPS_HD A apply(A& w, A d, A ratio) const {
    const A delta = -ratio * d;
    const A next = w + delta;
    const bool ok = finite(next);
    w = blend(ok, next, w);
    return ok ? delta : A(0);
  }

  // x - x is 0 for finite x and NaN for inf or NaN; unlike std::isfinite it vectorizes.
  static JAXOPS_HD bool finite(A x) { return x - x == A(0); }

  // ok ? a : b. On the CPU by bit masks: GCC turns `x = ok ? a : x` into a conditional store,
  // which keeps the loop scalar (no masked stores in baseline x86-64).
  static JAXOPS_HD A blend(bool ok, A a, A b) {
#if defined(__CUDA_ARCH__)
    return ok ? a : b;
#else
    using U = std::conditional_t<sizeof(A) == 8, uint64_t, uint32_t>;
    static_assert(sizeof(U) == sizeof(A));
    const U m = U(0) - U(ok);
    U ua, ub;
    std::memcpy(&ua, &a, sizeof(A));
    std::memcpy(&ub, &b, sizeof(A));
    const U r = (ua & m) | (ub & ~m);
    A out;
    std::memcpy(&out, &r, sizeof(A));
    return out;
#endif
  }
};

// Reads a one-element integer (int32/int64) or bool buffer's value from host memory.
inline int64_t host_int(const void* p, ffi::DataType dt) {
  switch (dt) {
    case ffi::DataType::S64: return *static_cast<const int64_t*>(p);
    case ffi::DataType::S32: return *static_cast<const int32_t*>(p);
    case ffi::DataType::PRED: return *static_cast<const bool*>(p) ? 1 : 0;
    default: return 0;
  }
}

// Calls f(W{}, G{}) for the supported (weight, gradient) storage types: equal types, or f32
// weights with f16/bf16 gradients (mixed precision). False if unsupported.
template <typename F>
bool dispatch_wg(ffi::DataType w, ffi::DataType g, F&& f) {
  if (w == g) return dispatch_float(w, [&](auto t) { f(t, t); });
  if (w != ffi::DataType::F32) return false;
  if (g == ffi::DataType::F16) { f(float{}, f16{}); return true; }
  if (g == ffi::DataType::BF16) { f(float{}, bf16{}); return true; }
  return false;
}

// Checks the flattened lists: `in` operands as `lists` lists of `count` tensors each, `out`
// results as `out_lists` lists (the results' list k must match operand list k's shapes).
// Returns an error message, empty when valid.
inline std::string check_lists(const ffi::RemainingArgs& in, const ffi::RemainingRets& out,
                               int64_t count, int64_t lists, int64_t out_lists) {
  if (count < 0 || int64_t(in.size()) != lists * count || int64_t(out.size()) != out_lists * count)
    return "list lengths do not match count " + std::to_string(count);
  for (int64_t i = 0; i < count; ++i) {
    auto w = in.get<ffi::AnyBuffer>(i);
    if (w.has_error()) return "bad operand";
    for (int64_t k = 0; k < lists; ++k) {
      auto x = in.get<ffi::AnyBuffer>(k * count + i);
      if (x.has_error() || x->element_count() != w->element_count())
        return "tensor " + std::to_string(i) + " differs in size between the lists";
      if (x->element_type() != in.get<ffi::AnyBuffer>(k * count)->element_type())
        return "the tensors of one list must share one dtype";
    }
    for (int64_t k = 0; k < out_lists; ++k) {
      auto y = out.get<ffi::AnyBuffer>(k * count + i);
      if (y.has_error() || (*y)->element_count() != w->element_count())
        return "result " + std::to_string(i) + " has the wrong size";
    }
  }
  return {};
}

// The FFI signatures both platforms share (the CUDA binding starts with its stream).
// AdamW: (lr, step, update_signal, weights..., grads..., m1..., m2...) ->
//        (flag, weights..., m1..., m2...)
template <typename Binding>
auto bind_adamw(Binding b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .RemainingArgs()
      .template Ret<ffi::AnyBuffer>()
      .RemainingRets()
      .template Attr<int64_t>("count")
      .template Attr<float>("alpha")
      .template Attr<float>("beta")
      .template Attr<float>("epsilon")
      .template Attr<float>("weight_decay")
      .template Attr<int64_t>("correct_bias")
      .template Attr<int64_t>("adam_mode");
}

// SGDOptimizerV2: (lr, update_signal, weights..., grads...) -> (flag, weights...)
template <typename Binding>
auto bind_sgd(Binding b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .RemainingArgs()
      .template Ret<ffi::AnyBuffer>()
      .RemainingRets()
      .template Attr<int64_t>("count");
}

// LambOptimizer (f32 weights and moments; gradients f32/f16/bf16):
// (update_signal, loss_scale, gradient_norm, R, step, hyper, weights..., grads..., m1..., m2...)
//   -> (new_step, weights..., new_gradients..., m1..., m2...), without the new_gradients lists
//   when the attribute new_gradients is 0 (a caller that drops them saves a write per element).
// loss_scale, gradient_norm, R: one f32 each; step: one int32/int64; hyper: f32 [count, 5], per
// tensor (alpha, beta, lambda, epsilon, max_norm_clip) (an operand: a per-tensor attribute
// array would not fit JAX's hashable primitive params).
enum LambHyper { kAlpha, kBeta, kLambda, kEps, kMaxNorm, kHyper };

template <typename Binding>
auto bind_lamb(Binding b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .RemainingArgs()
      .template Ret<ffi::AnyBuffer>()
      .RemainingRets()
      .template Attr<int64_t>("count")
      .template Attr<float>("ratio_min")
      .template Attr<float>("ratio_max")
      .template Attr<int64_t>("do_bias_correction")
      .template Attr<int64_t>("has_step")
      .template Attr<int64_t>("has_norm")
      .template Attr<int64_t>("new_gradients");
}

// The result list of LAMB's operand list k (0 weights, 1 gradients, 2 m1, 3 m2), or -1 for the
// gradients when the new gradients are not returned.
inline int64_t lamb_result_list(int64_t k, bool new_gradients) {
  if (new_gradients || k == 0) return k;
  return k == 1 ? -1 : k - 1;
}

// The per-tensor constants of LAMB from the scalar inputs (host or device values).
template <typename A>
JAXOPS_HD Lamb<A> make_lamb(const float* hyper, float lr, float loss_scale, float norm,
                            int64_t step, float ratio_min, float ratio_max, bool correct,
                            bool has_norm) {
  Lamb<A> c{A(hyper[kAlpha]), A(hyper[kBeta]), A(hyper[kLambda]), A(hyper[kEps]), A(lr),
            A(ratio_min), A(ratio_max)};
  if (correct) c.set_step(step);
  c.set_grad_scale(A(loss_scale), has_norm, A(norm), A(hyper[kMaxNorm]));
  return c;
}

// lr: one f32; step: one int32/int64; update_signal and flags: one bool each.
inline std::string check_scalar(const ffi::AnyBuffer& x, const char* name, ffi::DataType a,
                                ffi::DataType b) {
  if (auto err = check_type(name, x.element_type(), types_of({a, b})); !err.empty()) return err;
  if (x.element_count() != 1) return std::string(name) + " must hold one element";
  return {};
}

// The AdamW and SGD handlers' checks, for both platforms; an empty string when valid.
// AdamW's and SGD's dtypes, once check_lists passed (each list shares one dtype): the operand
// lists but the gradients (list 1) and every result have the weights' dtype, and the
// (weights, gradients) pair is one dispatch_wg takes.
inline std::string check_weight_dtypes(const ffi::RemainingArgs& in, const ffi::RemainingRets& out,
                                       int64_t count, int64_t lists) {
  if (count == 0) return {};
  const ffi::DataType w = in.get<ffi::AnyBuffer>(0)->element_type();
  for (int64_t l = 2; l < lists; ++l)
    if (in.get<ffi::AnyBuffer>(l * count)->element_type() != w)
      return "weights and moments must share one dtype";
  for (size_t i = 0; i < out.size(); ++i)
    if ((*out.get<ffi::AnyBuffer>(i))->element_type() != w)
      return "results must have the weights' dtype";
  if (!dispatch_wg(w, in.get<ffi::AnyBuffer>(count)->element_type(), [](auto, auto) {}))
    return "unsupported weight/gradient dtypes";
  return {};
}

inline std::string check_adamw(const ffi::AnyBuffer& lr, const ffi::AnyBuffer& step,
                               const ffi::AnyBuffer& signal, const ffi::AnyBuffer& flag,
                               const ffi::RemainingArgs& in, const ffi::RemainingRets& out,
                               int64_t count, int64_t mode) {
  for (auto err : {check_scalar(lr, "lr", ffi::DataType::F32, ffi::DataType::F32),
                   check_scalar(step, "step", ffi::DataType::S64, ffi::DataType::S32),
                   check_scalar(signal, "update_signal", ffi::DataType::PRED, ffi::DataType::PRED),
                   check_scalar(flag, "flag", ffi::DataType::PRED, ffi::DataType::PRED),
                   check_list_types("operand", in, kFloatTypes),
                   check_list_types("result", out, kFloatTypes),
                   check_lists(in, out, count, 4, 3)})
    if (!err.empty()) return err;
  if (mode != 0 && mode != 1) return "adam_mode must be 0 or 1";
  return check_weight_dtypes(in, out, count, 4);  // after check_lists: indexes the lists
}

inline std::string check_sgd(const ffi::AnyBuffer& lr, const ffi::AnyBuffer& signal,
                             const ffi::AnyBuffer& flag, const ffi::RemainingArgs& in,
                             const ffi::RemainingRets& out, int64_t count) {
  for (auto err : {check_scalar(lr, "lr", ffi::DataType::F32, ffi::DataType::F32),
                   check_scalar(signal, "update_signal", ffi::DataType::PRED, ffi::DataType::PRED),
                   check_scalar(flag, "flag", ffi::DataType::PRED, ffi::DataType::PRED),
                   check_list_types("operand", in, kFloatTypes),
                   check_list_types("result", out, kFloatTypes),
                   check_lists(in, out, count, 2, 1)})
    if (!err.empty()) return err;
  return check_weight_dtypes(in, out, count, 2);  // after check_lists: indexes the lists
}

// The LAMB handlers' checks (f32 weights and moments, one gradient dtype), for both platforms.
inline std::string check_lamb(const ffi::AnyBuffer& signal, const ffi::AnyBuffer& loss_scale,
                              const ffi::AnyBuffer& norm, const ffi::AnyBuffer& lr,
                              const ffi::AnyBuffer& step, const ffi::AnyBuffer& new_step,
                              const ffi::AnyBuffer& hyper, const ffi::RemainingArgs& in,
                              const ffi::RemainingRets& out, int64_t count, bool new_gradients) {
  for (auto err : {check_scalar(signal, "update_signal", ffi::DataType::PRED, ffi::DataType::PRED),
                   check_scalar(loss_scale, "loss_scale", ffi::DataType::F32, ffi::DataType::F32),
                   check_scalar(norm, "gradient_norm", ffi::DataType::F32, ffi::DataType::F32),
                   check_scalar(lr, "R", ffi::DataType::F32, ffi::DataType::F32),
                   check_scalar(step, "step", ffi::DataType::S64, ffi::DataType::S32),
                   check_scalar(new_step, "new_step", step.element_type(), step.element_type()),
                   check_list_types("operand", in, kFloatTypes),
                   check_list_types("result", out, kFloatTypes),
                   check_lists(in, out, count, 4, new_gradients ? 4 : 3)})
    if (!err.empty()) return err;
  if (hyper.element_type() != ffi::DataType::F32 || int64_t(hyper.element_count()) != kHyper * count)
    return "hyper must be f32 [count, 5]";
  for (int64_t k = 0; k < 4 && count > 0; ++k) {
    const auto want = k == 1 ? in.get<ffi::AnyBuffer>(count)->element_type() : ffi::DataType::F32;
    const int64_t r = lamb_result_list(k, new_gradients);
    for (int64_t i = 0; i < count; ++i)
      if (in.get<ffi::AnyBuffer>(k * count + i)->element_type() != want ||
          (r >= 0 && (*out.get<ffi::AnyBuffer>(r * count + i))->element_type() != want))
        return "weights and moments must be float32, results of their operands' dtypes";
  }
  if (count > 0 && in.get<ffi::AnyBuffer>(count)->element_type() == ffi::DataType::F64)
    return "gradients must be f32, f16 or bf16";
  return {};
}

}  // namespace jaxops::optim
