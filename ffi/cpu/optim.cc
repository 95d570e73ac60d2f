// CPU handlers of AdamWOptimizer, SGDOptimizerV2 and LambOptimizer over a whole parameter list.
#include <cmath>
#include <cstring>
#include <memory>

#include "jaxops/checks.h"
#include "jaxops/optim.h"
#include "jaxops/registry.h"

#if defined(__GNUC__) || defined(__clang__)
#define JAXOPS_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define JAXOPS_ALWAYS_INLINE inline
#endif

namespace jaxops::optim {
namespace {

// Copies an operand into its result when XLA did not alias them (it does whenever it can).
void copy_if_distinct(const ffi::AnyBuffer& in, ffi::AnyBuffer out) {
  if (in.untyped_data() != out.untyped_data() && in.size_bytes() > 0)
    std::memcpy(out.untyped_data(), in.untyped_data(), in.size_bytes());
}

// One tensor's update. The buffers never overlap (restrict) and the mode is fixed per loop,
// so the compiler vectorizes it. Inlined into each ISA's copy below (adamw_loop_isa).
template <int Mode, typename A, typename W, typename G>
JAXOPS_ALWAYS_INLINE void adamw_elems(const AdamW<A> c, W* __restrict w, const G* __restrict g,
                                      W* __restrict m1, W* __restrict m2, int64_t n) {
  for (int64_t k = 0; k < n; ++k) {
    A wv = load(w, k), a = load(m1, k), b = load(m2, k);
    c.template update_mode<Mode>(wv, A(load(g, k)), a, b);
    store(w, k, wv);
    store(m1, k, a);
    store(m2, k, b);
  }
}

// Mode 1 tests wd > 0 per element: tested here too, it is known inside each loop, which then
// has no branch (GCC unswitched the f32 loop itself, not the 16-bit ones).
template <int Mode, typename A, typename W, typename G>
JAXOPS_ALWAYS_INLINE void adamw_loop_mode(const AdamW<A>& c, W* w, const G* g, W* m1, W* m2,
                                          int64_t n) {
  if (Mode == 1 && c.wd > A(0)) adamw_elems<Mode>(c, w, g, m1, m2, n);
  else adamw_elems<Mode>(c, w, g, m1, m2, n);
}

// Each element costs a sqrt and one (mode 1) or two (mode 0) divisions, whose throughput
// bounds the loop: 256-bit vectors run it 1.4-2x faster than the baseline's 128-bit ones
// (gpt2_dynamo's 30592 f32 parameters, mode 1: 22 -> 13 us on one Zen 4 core). So x86-64
// builds carry an AVX2 copy, picked at run time; the baseline build stays generic x86-64.
// AVX2 without FMA: no multiply-add is contracted, so both copies round every operation
// alike and give the same bits (ORT's up to its own contractions) on every machine.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define JAXOPS_AVX2_COPY 1
template <int Mode, typename A, typename W, typename G>
__attribute__((target("avx2"))) void adamw_loop_avx2(const AdamW<A>& c, W* w, const G* g, W* m1,
                                                     W* m2, int64_t n) {
  adamw_loop_mode<Mode>(c, w, g, m1, m2, n);
}

bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");  // also checks the OS saves YMM
  return yes;
}
#endif

template <int Mode, typename A, typename W, typename G>
void adamw_loop_isa(const AdamW<A>& c, W* w, const G* g, W* m1, W* m2, int64_t n) {
#ifdef JAXOPS_AVX2_COPY
  if (has_avx2()) return adamw_loop_avx2<Mode>(c, w, g, m1, m2, n);
#endif
  adamw_loop_mode<Mode>(c, w, g, m1, m2, n);
}

template <typename A, typename W, typename G>
void adamw_loop(const AdamW<A>& c, W* w, const G* g, W* m1, W* m2, int64_t n) {
  if (c.mode == 0) adamw_loop_isa<0>(c, w, g, m1, m2, n);
  else adamw_loop_isa<1>(c, w, g, m1, m2, n);
}

ffi::Error adamw(ffi::AnyBuffer lr, ffi::AnyBuffer step, ffi::AnyBuffer signal,
                 ffi::RemainingArgs in, ffi::Result<ffi::AnyBuffer> flag, ffi::RemainingRets out,
                 int64_t count, float alpha, float beta, float eps, float wd,
                 int64_t correct_bias, int64_t mode) {
  const char* op = "adamw_optimizer";
  if (auto err = check_adamw(lr, step, signal, *flag, in, out, count, mode); !err.empty())
    return invalid(op, err);
  const bool update = host_int(signal.untyped_data(), ffi::DataType::PRED) != 0;
  *flag->reinterpret_data<bool>() = update;
  for (int64_t i = 0; i < count; ++i) {
    auto w = *in.get<ffi::AnyBuffer>(i), g = *in.get<ffi::AnyBuffer>(count + i);
    auto m1 = *in.get<ffi::AnyBuffer>(2 * count + i), m2 = *in.get<ffi::AnyBuffer>(3 * count + i);
    auto w_out = **out.get<ffi::AnyBuffer>(i), m1_out = **out.get<ffi::AnyBuffer>(count + i);
    auto m2_out = **out.get<ffi::AnyBuffer>(2 * count + i);
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
      adamw_loop(c, w_out.reinterpret_data<W>(), g.reinterpret_data<G>(),
                 m1_out.reinterpret_data<W>(), m2_out.reinterpret_data<W>(),
                 int64_t(w.element_count()));
    });
    if (!ok) return invalid(op, "unsupported weight/gradient dtypes");
  }
  return ffi::Error::Success();
}

ffi::Error sgd(ffi::AnyBuffer lr, ffi::AnyBuffer signal, ffi::RemainingArgs in,
               ffi::Result<ffi::AnyBuffer> flag, ffi::RemainingRets out, int64_t count) {
  const char* op = "sgd_optimizer_v2";
  if (auto err = check_sgd(lr, signal, *flag, in, out, count); !err.empty()) return invalid(op, err);
  const bool update = host_int(signal.untyped_data(), ffi::DataType::PRED) != 0;
  *flag->reinterpret_data<bool>() = update;
  const float rate = *lr.reinterpret_data<float>();
  for (int64_t i = 0; i < count; ++i) {
    auto w = *in.get<ffi::AnyBuffer>(i), g = *in.get<ffi::AnyBuffer>(count + i);
    auto w_out = **out.get<ffi::AnyBuffer>(i);
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

// f32 weights and moments, one gradient dtype for the list. Two passes per tensor: the
// direction d (kept) and the norms, then the trust-ratio step.
ffi::Error lamb(ffi::AnyBuffer signal, ffi::AnyBuffer loss_scale, ffi::AnyBuffer norm,
                ffi::AnyBuffer lr, ffi::AnyBuffer step, ffi::AnyBuffer hyper,
                ffi::RemainingArgs in, ffi::Result<ffi::AnyBuffer> new_step, ffi::RemainingRets out,
                int64_t count, float ratio_min, float ratio_max, int64_t correct, int64_t has_step,
                int64_t has_norm, int64_t new_gradients) {
  const char* op = "lamb_optimizer";
  const bool grads = new_gradients != 0;
  if (auto err = check_lamb(signal, loss_scale, norm, lr, step, *new_step, hyper, in, out, count,
                            grads);
      !err.empty())
    return invalid(op, err);
  const bool update = host_int(signal.untyped_data(), ffi::DataType::PRED) != 0;
  const int64_t t = host_int(step.untyped_data(), step.element_type());
  const int64_t t_out = update && has_step ? t + 1 : t;
  if (new_step->element_type() == ffi::DataType::S64) *new_step->reinterpret_data<int64_t>() = t_out;
  else *new_step->reinterpret_data<int32_t>() = int32_t(t_out);
  for (int64_t i = 0; i < count; ++i) {
    auto result = [&](int64_t k) { return **out.get<ffi::AnyBuffer>(k * count + i); };
    for (int64_t k = 0; k < 4; ++k)
      if (const int64_t r = lamb_result_list(k, grads); r >= 0)
        copy_if_distinct(*in.get<ffi::AnyBuffer>(k * count + i), result(r));
    if (!update) continue;
    auto g = *in.get<ffi::AnyBuffer>(count + i);
    float* w = result(0).reinterpret_data<float>();
    float* m1 = result(lamb_result_list(2, grads)).reinterpret_data<float>();
    float* m2 = result(lamb_result_list(3, grads)).reinterpret_data<float>();
    const auto c = make_lamb<float>(hyper.reinterpret_data<float>() + kHyper * i,
                                    *lr.reinterpret_data<float>(),
                                    *loss_scale.reinterpret_data<float>(),
                                    *norm.reinterpret_data<float>(), t, ratio_min, ratio_max,
                                    correct && has_step, has_norm != 0);
    const int64_t n = int64_t(g.element_count());
    bool ok = dispatch_float(g.element_type(), [&](auto tag) {
      using G = decltype(tag);
      if constexpr (std::is_same_v<G, double>) return;  // rejected by check_lamb
      else {
        const G* pg = g.reinterpret_data<G>();  // read before g_out (it may alias) is written
        const std::unique_ptr<float[]> dv(new float[size_t(n)]);  // uninitialized: written first
        float* __restrict__ d = dv.get();
        float* __restrict__ pw = w;
        float* __restrict__ p1 = m1;
        float* __restrict__ p2 = m2;
        for (int64_t k = 0; k < n; ++k) d[k] = c.direction(pw[k], load(pg, k), p1[k], p2[k]);
        // The norms in a loop of their own, over kLanes partial sums: float adds are not
        // reassociated, so one running sum (or a loop shared with direction) stays scalar.
        constexpr int kLanes = 16;
        float ww[kLanes] = {}, dd[kLanes] = {};
        int64_t k = 0;
        for (; k + kLanes <= n; k += kLanes)
          for (int j = 0; j < kLanes; ++j) {
            ww[j] += pw[k + j] * pw[k + j];
            dd[j] += d[k + j] * d[k + j];
          }
        for (; k < n; ++k) {
          ww[0] += pw[k] * pw[k];
          dd[0] += d[k] * d[k];
        }
        float sw = 0, sd = 0;
        for (int j = 0; j < kLanes; ++j) {
          sw += ww[j];
          sd += dd[j];
        }
        const float ratio = c.ratio(std::sqrt(sw), std::sqrt(sd));
        if (grads) {
          G* po = result(1).reinterpret_data<G>();
          for (k = 0; k < n; ++k) store(po, k, c.apply(pw[k], d[k], ratio));
        } else {
          for (k = 0; k < n; ++k) c.apply(pw[k], d[k], ratio);
        }
      }
    });
    if (!ok) return invalid(op, "gradients must be f32, f16 or bf16");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AdamWCpu, adamw, bind_adamw(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(SgdV2Cpu, sgd, bind_sgd(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(LambCpu, lamb, bind_lamb(ffi::Ffi::Bind()));

void register_handlers(Registry& r) {
  r.add("jaxops_adamw_optimizer", AdamWCpu);
  r.add("jaxops_lamb_optimizer", LambCpu);
  r.add("jaxops_sgd_optimizer_v2", SgdV2Cpu);
}

}  // namespace jaxops::optim
