// The body of both extension modules (_cpu, _cuda): registrations() -> {target: capsule} of
// every family's handlers, and expected_targets(), the list Python checks them against.
#pragma once

#include <nanobind/nanobind.h>

#include "jaxops/registry.h"

namespace jaxops {

// kCpu: the CPU extension, which also has the CPU-only families and targets. A template, so
// that the CUDA extension does not refer to the CPU-only families' functions at all (a
// runtime branch left them an undefined symbol there, and _cuda failed to import).
template <bool kCpu>
void define_module(nanobind::module_& m) {
  namespace nb = nanobind;
  m.def("registrations", [] {
    Registry r;
#define JAXOPS_REGISTER_FAMILY(family) family::register_handlers(r);
    JAXOPS_FAMILIES(JAXOPS_REGISTER_FAMILY)
    if constexpr (kCpu) { JAXOPS_CPU_FAMILIES(JAXOPS_REGISTER_FAMILY) }
#undef JAXOPS_REGISTER_FAMILY
    nb::dict out;
    for (auto& [name, fn] : r.handlers) out[name.c_str()] = nb::capsule(reinterpret_cast<void*>(fn));
    return out;
  });
  m.def("expected_targets", [] {
    nb::list out;
    for (const char* name : kTargets) out.append(name);
    if constexpr (kCpu)
      for (const char* name : kCpuTargets) out.append(name);
    return out;
  });
}

}  // namespace jaxops
