// The _cuda extension: hands Python every op family's CUDA handlers (jaxops/module.h).
#include "jaxops/module.h"

NB_MODULE(_cuda, m) { jaxops::define_module</*kCpu=*/false>(m); }
