// Each op family's source file registers its FFI handlers here with JAXOPS_REGISTER;
// module.cc hands the whole table to Python, which registers it with XLA.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/c_api.h"

namespace jaxops {

using Handler = XLA_FFI_Error*(XLA_FFI_CallFrame*);

inline std::vector<std::pair<std::string, Handler*>>& registry() {
  static std::vector<std::pair<std::string, Handler*>> table;
  return table;
}

struct Registration {
  Registration(const char* name, Handler* fn) { registry().emplace_back(name, fn); }
};

}  // namespace jaxops

#define JAXOPS_CONCAT_(a, b) a##b
#define JAXOPS_CONCAT(a, b) JAXOPS_CONCAT_(a, b)
#define JAXOPS_REGISTER(name, symbol) \
  static ::jaxops::Registration JAXOPS_CONCAT(jaxops_reg_, __LINE__)(name, symbol)
