// GatherGrad math, written once for the CPU handler and the CUDA kernels.
//
// dX has shape `shape`; along `axis` it is viewed as [outer, V, inner], dY as [outer, N, inner]
// with N the number of indices (their own shape flattened):
//   dX[o, k(p), i] += dY[o, p, i]   for every index position p,
// k(p) = indices[p], wrapped once when negative (k + V). An index still outside [0, V) is
// dropped: it adds nothing and touches no memory (never clamped). Duplicates accumulate in
// f32 (f64 for f64), in increasing position order on CPU and in a fixed order on CUDA.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "jaxops/checks.h"
#include "jaxops/dtype.h"

namespace jaxops::gather {

struct View {
  int64_t outer = 1, v = 1, n = 0, inner = 1;
};

// The row an index addresses, or -1 when it is dropped.
JAXOPS_HD int64_t wrap_index(int64_t k, int64_t v) {
  if (k < 0) k += v;
  return (k >= 0 && k < v) ? k : -1;
}

// Builds the view from dX's dims, the axis, the number of indices and dY's element count;
// returns an error message, empty when they fit together.
inline std::string make_view(ffi::Span<const int64_t> dx_dims, int64_t axis, int64_t v,
                             int64_t n, int64_t dy_count, View* view) {
  const int64_t rank = static_cast<int64_t>(dx_dims.size());
  if (rank == 0) return "dX must have rank >= 1";
  if (axis < 0 || axis >= rank) return "axis " + std::to_string(axis) + " out of range";
  if (dx_dims[axis] != v) return "v does not match dX's size along axis";
  View w;
  w.n = n;
  for (int64_t d = 0; d < rank; ++d) {
    if (d < axis) w.outer *= dx_dims[d];
    else if (d == axis) w.v = dx_dims[d];
    else w.inner *= dx_dims[d];
  }
  if (w.outer * w.n * w.inner != dy_count)
    return "dY has " + std::to_string(dy_count) + " elements, expected outer * N * inner = " +
           std::to_string(w.outer * w.n * w.inner);
  *view = w;
  return {};
}

// The handler's checks, for both platforms: fills the view, or returns an error message.
inline std::string check_args(const ffi::AnyBuffer& indices, const ffi::AnyBuffer& dy,
                              const ffi::AnyBuffer& dx, int64_t axis, int64_t v, View* w) {
  for (auto err : {check_type("indices", indices.element_type(), kIndexTypes),
                   check_type("dY", dy.element_type(), kFloatTypes)})
    if (!err.empty()) return err;
  if (dy.element_type() != dx.element_type()) return "dY and dX must share one dtype";
  if (auto err = make_view(dx.dimensions(), axis, v, static_cast<int64_t>(indices.element_count()),
                           static_cast<int64_t>(dy.element_count()), w);
      !err.empty())
    return err;
  return {};
}

// The FFI signature both platforms share, appended to a binding (the CUDA one starts with its
// stream and scratch allocator): (indices, dY) -> dX, attributes axis (>= 0) and v = dX's
// size along axis (checked against dX).
template <typename Binding>
auto bind_args(Binding b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Attr<int64_t>("axis")
      .template Attr<int64_t>("v");
}

}  // namespace jaxops::gather
