// Host-side CUDA error checks shared by the CUDA handlers.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "xla/ffi/api/ffi.h"

namespace jaxops {

inline xla::ffi::Error cuda_error(const char* op, cudaError_t e) {
  if (e == cudaSuccess) return xla::ffi::Error::Success();
  return xla::ffi::Error::Internal(std::string(op) + ": " + cudaGetErrorString(e));
}

// A failed launch (bad configuration, too much shared memory) shows only through
// cudaGetLastError, which also clears it; a handler must return it, never crash.
inline xla::ffi::Error launched(const char* op) { return cuda_error(op, cudaGetLastError()); }

// The same after host calls that returned `earlier`: that error if it failed, else a launch
// error (cleared either way).
inline xla::ffi::Error launched(const char* op, cudaError_t earlier) {
  xla::ffi::Error last = launched(op);
  return earlier != cudaSuccess ? cuda_error(op, earlier) : last;
}

}  // namespace jaxops
