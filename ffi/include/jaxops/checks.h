// Argument checks shared by handlers. Python validates first; these keep a handler
// safe if it is ever called with something else (they return errors, never assert).
#pragma once

#include <string>

#include "xla/ffi/api/ffi.h"

namespace jaxops {

inline bool same_dims(const xla::ffi::AnyBuffer& a, const xla::ffi::AnyBuffer& b) {
  auto da = a.dimensions(), db = b.dimensions();
  if (da.size() != db.size()) return false;
  for (size_t i = 0; i < da.size(); ++i)
    if (da[i] != db[i]) return false;
  return true;
}

inline xla::ffi::Error invalid(const std::string& op, const std::string& msg) {
  return xla::ffi::Error::InvalidArgument(op + ": " + msg);
}

}  // namespace jaxops
