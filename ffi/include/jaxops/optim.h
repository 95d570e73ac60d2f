// Multi-tensor optimizer math (AdamWOptimizer, SGDOptimizerV2), written once for the CPU
// handler and the CUDA kernel. One call updates every tensor of the parameter list.
//
// The scalar inputs (lr, step, update_signal) stay in device memory on GPU: the kernel reads
// them itself, so a step never waits for a device-to-host copy.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>

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
    if (mode == 0) {
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

}  // namespace jaxops::optim
