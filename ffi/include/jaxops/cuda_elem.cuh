// Device-side element helpers shared by the CUDA kernels (include from .cu files only).
// Element conversions are dtype.h's to_acc/from_acc, one API for host and device.
#pragma once

#include "jaxops/dtype.h"

namespace jaxops {

// V consecutive elements, moved with one access of V * sizeof(T) bytes.
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack { T v[V]; };

}  // namespace jaxops
