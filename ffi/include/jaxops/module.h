// The body of both extension modules (_cpu, _cuda): registrations() -> {target: capsule} of
// every family's handlers, and expected_targets(), the list Python checks them against.
#pragma once

#include <nanobind/nanobind.h>

#include "jaxops/registry.h"

namespace jaxops {

// cpu: the CPU extension, which also has the CPU-only families and targets.
inline void define_module(nanobind::module_& m, bool cpu) {
  namespace nb = nanobind;
  m.def("registrations", [cpu] {
    Registry r;
#define JAXOPS_REGISTER_FAMILY(family) family::register_handlers(r);
    JAXOPS_FAMILIES(JAXOPS_REGISTER_FAMILY)
    if (cpu) { JAXOPS_CPU_FAMILIES(JAXOPS_REGISTER_FAMILY) }
#undef JAXOPS_REGISTER_FAMILY
    nb::dict out;
    for (auto& [name, fn] : r.handlers) out[name.c_str()] = nb::capsule(reinterpret_cast<void*>(fn));
    return out;
  });
  m.def("expected_targets", [cpu] {
    nb::list out;
    for (const char* name : kTargets) out.append(name);
    if (cpu)
      for (const char* name : kCpuTargets) out.append(name);
    return out;
  });
}

}  // namespace jaxops
