// Softmax cross-entropy math, written once for the CPU handler and the CUDA kernels.
//
// Every kernel works on rows: logits x [R, C] (classes contiguous), one int32 label per row.
// Python maps ORT's layouts ([N, C, d1..] or [.., C]) onto rows and turns weights,
// ignore_index and reductions into per-row scalars, so the kernels hold only this:
//   forward   lse_r = log(sum_c exp(x[r,c]))          (online max/sum, one pass over x)
//             nll_r = lse_r - x[r, l_r]               (0 when l_r is outside [0, C))
//             log_prob[r,c] = x[r,c] - lse_r          (only the variant that writes it)
//   backward  d[r,c] = g_r * (exp(x[r,c] - lse_r) - [c == l_r]) (+ bias[r,c])
//             x is the logits with their lse, or log_prob with lse = 0.
// A label outside [0, C) is never used to address memory.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>

#include "jaxops/checks.h"
#include "jaxops/dtype.h"

namespace jaxops::loss {

template <typename A> JAXOPS_HD A exp_(A x) {
#if defined(__CUDA_ARCH__)
  return exp(x);
#else
  return std::exp(x);
#endif
}
template <typename A> JAXOPS_HD A log_(A x) {
#if defined(__CUDA_ARCH__)
  return log(x);
#else
  return std::log(x);
#endif
}

// A running (max, sum of exp(x - max)) pair; merging two is associative, so any split of a
// row reduced in a fixed order gives a deterministic result.
template <typename A>
struct MaxSum {
  A m, s;
  JAXOPS_HD static MaxSum empty() { return {-INFINITY, A(0)}; }
  JAXOPS_HD void add(A x) {
    if (x > m) { s = s * exp_(m - x) + A(1); m = x; }
    else if (x != -INFINITY) s += exp_(x - m);  // -inf adds nothing (and -inf - -inf is nan)
  }
  JAXOPS_HD static MaxSum merge(MaxSum a, MaxSum b) {
    if (a.m < b.m) { A t = a.m; a.m = b.m; b.m = t; t = a.s; a.s = b.s; b.s = t; }
    if (b.s == A(0)) return a;  // b empty (or all -inf): nothing to rescale
    return {a.m, a.s + b.s * exp_(b.m - a.m)};
  }
  // log(sum exp(x)); -inf for an all -inf row, nan when the row has a nan.
  JAXOPS_HD A lse() const { return m + log_(s); }
};

JAXOPS_HD bool in_range(int32_t label, int64_t c) { return label >= 0 && label < c; }

template <typename A>
JAXOPS_HD A grad(A g, A x, A lse, bool is_label) {
  return g * (exp_(x - lse) - (is_label ? A(1) : A(0)));
}

// FFI signatures both platforms share, appended to a binding (the CUDA one starts with its
// stream). out_type: the ONNX TensorProto type of log_prob / d (1 f32, 10 f16, 11 f64,
// 16 bf16), checked against the buffer (Python derives the output shapes from it).
//   forward:  (x [R,C], labels i32 [R]) -> (nll [R], lse [R] [, log_prob [R,C]])
//   backward: (g [R], x [R,C], lse [R], labels i32 [R] [, bias [R,C]]) -> d [R,C]
// nll, lse and g are f64 for f64 logits and f32 otherwise; log_prob, bias and d have any
// float dtype (ORT's output_type).
template <typename Binding> auto bind_fwd(Binding b) {
  return std::move(b).template Arg<ffi::AnyBuffer>().template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>().template Ret<ffi::AnyBuffer>();
}
template <typename Binding> auto bind_fwd_log_prob(Binding b) {
  return std::move(b).template Arg<ffi::AnyBuffer>().template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>().template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>().template Attr<int64_t>("out_type");
}
template <typename Binding> auto bind_bwd(Binding b) {
  return std::move(b).template Arg<ffi::AnyBuffer>().template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>().template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>().template Attr<int64_t>("out_type");
}
template <typename Binding> auto bind_bwd_bias(Binding b) {
  return std::move(b).template Arg<ffi::AnyBuffer>().template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>().template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>().template Ret<ffi::AnyBuffer>()
      .template Attr<int64_t>("out_type");
}

// Shape checks shared by both platforms; an empty string when valid.
inline std::string check_rows(const ffi::AnyBuffer& x, const ffi::AnyBuffer& labels,
                              int64_t* rows, int64_t* classes) {
  for (auto err : {check_type("logits", x.element_type(), kFloatTypes),
                   check_type("labels", labels.element_type(), types_of({ffi::DataType::S32}))})
    if (!err.empty()) return err;
  auto d = x.dimensions();
  if (d.size() != 2) return "logits must be [rows, classes]";
  if (labels.dimensions().size() != 1 || labels.dimensions()[0] != d[0])
    return "labels must be [rows]";
  *rows = d[0];
  *classes = d[1];
  return {};
}

inline bool is_vec(const ffi::AnyBuffer& b, int64_t rows) {
  return b.dimensions().size() == 1 && b.dimensions()[0] == rows;
}

inline bool matches_onnx_type(ffi::DataType t, int64_t onnx) {
  switch (onnx) {
    case 1: return t == ffi::DataType::F32;
    case 10: return t == ffi::DataType::F16;
    case 11: return t == ffi::DataType::F64;
    case 16: return t == ffi::DataType::BF16;
    default: return false;
  }
}

inline ffi::DataType acc_dtype(ffi::DataType t) {
  return t == ffi::DataType::F64 ? ffi::DataType::F64 : ffi::DataType::F32;
}

// The forward's buffers, checked once for both platforms; an empty string when valid.
inline std::string check_fwd(const ffi::AnyBuffer& x, const ffi::AnyBuffer& labels,
                             const ffi::AnyBuffer& nll, const ffi::AnyBuffer& lse,
                             const ffi::AnyBuffer* log_prob, int64_t out_type, int64_t* rows,
                             int64_t* classes) {
  if (auto err = check_rows(x, labels, rows, classes); !err.empty()) return err;
  const ffi::DataType a = acc_dtype(x.element_type());
  if (nll.element_type() != a || lse.element_type() != a || !is_vec(nll, *rows) ||
      !is_vec(lse, *rows))
    return "nll and lse must be [rows] in the accumulation dtype";
  if (log_prob && !same_dims(x, *log_prob)) return "log_prob must match logits";
  if (log_prob && !matches_onnx_type(log_prob->element_type(), out_type))
    return "log_prob's dtype does not match out_type";
  return {};
}

// The backward's buffers, likewise.
inline std::string check_bwd(const ffi::AnyBuffer& g, const ffi::AnyBuffer& x,
                             const ffi::AnyBuffer& lse, const ffi::AnyBuffer& labels,
                             const ffi::AnyBuffer* bias, const ffi::AnyBuffer& d,
                             int64_t out_type, int64_t* rows, int64_t* classes) {
  if (auto err = check_rows(x, labels, rows, classes); !err.empty()) return err;
  const ffi::DataType a = acc_dtype(x.element_type());
  if (g.element_type() != a || lse.element_type() != a || !is_vec(g, *rows) ||
      !is_vec(lse, *rows))
    return "g and lse must be [rows] in the accumulation dtype";
  if (!same_dims(x, d)) return "d_logits must match logits";
  if (!matches_onnx_type(d.element_type(), out_type)) return "d_logits' dtype does not match out_type";
  if (bias && (!same_dims(x, *bias) || bias->element_type() != d.element_type()))
    return "bias must match d_logits in shape and dtype";
  return {};
}

}  // namespace jaxops::loss
