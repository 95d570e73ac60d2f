// CPU handler of GatherGrad (gather.h has the semantics). Deterministic: every output row
// sums its dY rows in increasing position order.
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "jaxops/checks.h"
#include "jaxops/gather.h"
#include "jaxops/registry.h"

namespace jaxops::gather {
namespace {

// Accumulates into `acc` ([outer, V, inner] in the accumulation type), then stores dX.
template <typename T, typename I>
void run(const View& w, const I* idx, const T* dy, T* dx) {
  using A = acc_t<T>;
  const int64_t count = w.outer * w.v * w.inner;
  std::vector<A> buffer;
  A* acc;
  if constexpr (std::is_same_v<T, A>) {
    acc = dx;  // f32 / f64 accumulate in place
    std::fill(acc, acc + count, A(0));
  } else {
    buffer.assign(count, A(0));
    acc = buffer.data();
    std::memset(dx, 0, count * sizeof(T));  // +0.0 in f16 and bf16
  }
  std::vector<char> touched(w.v, 0);  // rows some index addresses: the only ones to convert
  for (int64_t o = 0; o < w.outer; ++o)
    for (int64_t p = 0; p < w.n; ++p) {
      const int64_t k = wrap_index(static_cast<int64_t>(idx[p]), w.v);
      if (k < 0) continue;  // out of range: dropped
      touched[k] = 1;
      A* out = acc + (o * w.v + k) * w.inner;
      const int64_t in = (o * w.n + p) * w.inner;
      for (int64_t i = 0; i < w.inner; ++i) out[i] += load(dy, in + i);
    }
  if constexpr (!std::is_same_v<T, A>)
    for (int64_t o = 0; o < w.outer; ++o)
      for (int64_t k = 0; k < w.v; ++k) {
        if (!touched[k]) continue;
        const int64_t row = (o * w.v + k) * w.inner;
        for (int64_t i = 0; i < w.inner; ++i) store(dx, row + i, acc[row + i]);
      }
}

ffi::Error gather_grad(ffi::AnyBuffer indices, ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dx,
                       int64_t axis, int64_t v) {
  const char* op = "gather_grad";
  View w;
  return checked_dispatch(op, check_args(indices, dy, *dx, axis, v, &w), dy.element_type(),
                          [&](auto tag) {
    using T = decltype(tag);
    if (dx->element_count() == 0) return;
    if (indices.element_type() == ffi::DataType::S32)
      run<T>(w, indices.reinterpret_data<int32_t>(), dy.reinterpret_data<T>(),
             dx->reinterpret_data<T>());
    else
      run<T>(w, indices.reinterpret_data<int64_t>(), dy.reinterpret_data<T>(),
             dx->reinterpret_data<T>());
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GatherGradCpu, gather_grad, bind_args(ffi::Ffi::Bind()));

void register_handlers(Registry& r) {
  r.add("jaxops_gather_grad", GatherGradCpu);
}

}  // namespace jaxops::gather
