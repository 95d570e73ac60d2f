// The _cuda extension: hands Python every handler registered by the op-family files.
#include <nanobind/nanobind.h>

#include "jaxops/registry.h"

namespace nb = nanobind;

NB_MODULE(_cuda, m) {
  m.def("registrations", [] {
    nb::dict out;
    for (auto& [name, fn] : jaxops::registry())
      out[name.c_str()] = nb::capsule(reinterpret_cast<void*>(fn));
    return out;
  });
}
