// CPU handlers of AdamWOptimizer and SGDOptimizerV2 over a whole parameter list.
#include <cstring>

#include "jaxops/checks.h"
#include "jaxops/optim.h"
#include "jaxops/registry.h"

namespace jaxops::optim {
namespace {

// lr: one f32; step: one int32/int64; update_signal: one bool; flag: one bool.
std::string check_scalar(const ffi::AnyBuffer& x, const char* name, ffi::DataType a,
                         ffi::DataType b) {
  if (x.element_count() != 1) return std::string(name) + " must hold one element";
  if (x.element_type() != a && x.element_type() != b) return std::string(name) + " has the wrong dtype";
  return {};
}

// Copies an operand into its result when XLA did not alias them (it does whenever it can).
void copy_if_distinct(const ffi::AnyBuffer& in, ffi::AnyBuffer out) {
  if (in.untyped_data() != out.untyped_data() && in.size_bytes() > 0)
    std::memcpy(out.untyped_data(), in.untyped_data(), in.size_bytes());
}

ffi::Error adamw(ffi::AnyBuffer lr, ffi::AnyBuffer step, ffi::AnyBuffer signal,
                 ffi::RemainingArgs in, ffi::Result<ffi::AnyBuffer> flag, ffi::RemainingRets out,
                 int64_t count, float alpha, float beta, float eps, float wd,
                 int64_t correct_bias, int64_t mode) {
  const char* op = "adamw_optimizer";
  for (auto err : {check_scalar(lr, "lr", ffi::DataType::F32, ffi::DataType::F32),
                   check_scalar(step, "step", ffi::DataType::S64, ffi::DataType::S32),
                   check_scalar(signal, "update_signal", ffi::DataType::PRED, ffi::DataType::PRED),
                   check_scalar(*flag, "flag", ffi::DataType::PRED, ffi::DataType::PRED),
                   check_lists(in, out, count, 4, 3)})
    if (!err.empty()) return invalid(op, err);
  if (mode != 0 && mode != 1) return invalid(op, "adam_mode must be 0 or 1");
  const bool update = host_int(signal.untyped_data(), ffi::DataType::PRED) != 0;
  *flag->reinterpret_data<bool>() = update;
  for (int64_t i = 0; i < count; ++i) {
    auto w = *in.get<ffi::AnyBuffer>(i), g = *in.get<ffi::AnyBuffer>(count + i);
    auto m1 = *in.get<ffi::AnyBuffer>(2 * count + i), m2 = *in.get<ffi::AnyBuffer>(3 * count + i);
    auto w_out = **out.get<ffi::AnyBuffer>(i), m1_out = **out.get<ffi::AnyBuffer>(count + i);
    auto m2_out = **out.get<ffi::AnyBuffer>(2 * count + i);
    if (m1.element_type() != w.element_type() || m2.element_type() != w.element_type() ||
        w_out.element_type() != w.element_type() || m1_out.element_type() != w.element_type() ||
        m2_out.element_type() != w.element_type())
      return invalid(op, "weights, moments and results must share one dtype");
    copy_if_distinct(w, w_out);
    copy_if_distinct(m1, m1_out);
    copy_if_distinct(m2, m2_out);
    if (!update) continue;
    bool ok = dispatch_wg(w.element_type(), g.element_type(), [&](auto wt, auto gt) {
      using W = decltype(wt);
      using G = decltype(gt);
      using A = acc_t<W>;
      AdamW<A> c{A(alpha), A(beta), A(eps), A(wd), A(*lr.reinterpret_data<float>())};
      c.mode = mode;
      c.set_step(host_int(step.untyped_data(), step.element_type()), correct_bias != 0);
      W *pw = w_out.reinterpret_data<W>(), *p1 = m1_out.reinterpret_data<W>(),
        *p2 = m2_out.reinterpret_data<W>();
      const G* pg = g.reinterpret_data<G>();
      for (int64_t k = 0, n = int64_t(w.element_count()); k < n; ++k) {
        A wv = load(pw, k), a = load(p1, k), b = load(p2, k);
        c.update(wv, A(load(pg, k)), a, b);
        store(pw, k, wv);
        store(p1, k, a);
        store(p2, k, b);
      }
    });
    if (!ok) return invalid(op, "unsupported weight/gradient dtypes");
  }
  return ffi::Error::Success();
}

ffi::Error sgd(ffi::AnyBuffer lr, ffi::AnyBuffer signal, ffi::RemainingArgs in,
               ffi::Result<ffi::AnyBuffer> flag, ffi::RemainingRets out, int64_t count) {
  const char* op = "sgd_optimizer_v2";
  for (auto err : {check_scalar(lr, "lr", ffi::DataType::F32, ffi::DataType::F32),
                   check_scalar(signal, "update_signal", ffi::DataType::PRED, ffi::DataType::PRED),
                   check_scalar(*flag, "flag", ffi::DataType::PRED, ffi::DataType::PRED),
                   check_lists(in, out, count, 2, 1)})
    if (!err.empty()) return invalid(op, err);
  const bool update = host_int(signal.untyped_data(), ffi::DataType::PRED) != 0;
  *flag->reinterpret_data<bool>() = update;
  const float rate = *lr.reinterpret_data<float>();
  for (int64_t i = 0; i < count; ++i) {
    auto w = *in.get<ffi::AnyBuffer>(i), g = *in.get<ffi::AnyBuffer>(count + i);
    auto w_out = **out.get<ffi::AnyBuffer>(i);
    if (w_out.element_type() != w.element_type())
      return invalid(op, "weights and results must share one dtype");
    copy_if_distinct(w, w_out);
    if (!update) continue;
    bool ok = dispatch_wg(w.element_type(), g.element_type(), [&](auto wt, auto gt) {
      using W = decltype(wt);
      using G = decltype(gt);
      using A = acc_t<W>;
      W* pw = w_out.reinterpret_data<W>();
      const G* pg = g.reinterpret_data<G>();
      for (int64_t k = 0, n = int64_t(w.element_count()); k < n; ++k)
        store(pw, k, load(pw, k) - A(rate) * A(load(pg, k)));
    });
    if (!ok) return invalid(op, "unsupported weight/gradient dtypes");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AdamWCpu, adamw, bind_adamw(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(SgdV2Cpu, sgd, bind_sgd(ffi::Ffi::Bind()));
JAXOPS_REGISTER("jaxops_adamw_optimizer", AdamWCpu);
JAXOPS_REGISTER("jaxops_sgd_optimizer_v2", SgdV2Cpu);

}  // namespace jaxops::optim
