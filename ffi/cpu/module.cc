// The _cpu extension: hands Python every op family's CPU handlers (jaxops/module.h).
#include "jaxops/module.h"

NB_MODULE(_cpu, m) { jaxops::define_module</*kCpu=*/true>(m); }
