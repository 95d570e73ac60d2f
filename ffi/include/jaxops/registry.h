// The FFI targets of an extension (_cpu or _cuda). Each op family's file defines
// register_handlers(Registry&), adding its handlers by target name; module.h calls every
// family's (JAXOPS_FAMILIES) and hands the table to Python (jaxops/_src/ffi.py), which checks
// it against kTargets and registers it with XLA.
//
// Explicit calls, not self-registering static objects: a static object's constructor runs only
// if the linker keeps its file, and nothing else refers to a family's file. That worked only
// because the CUDA kernels were an OBJECT library (every file kept); from a STATIC library the
// families would have vanished without an error. Now a family that is not linked is an
// undefined symbol, and its module fails to import.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/c_api.h"

namespace jaxops {

using Handler = XLA_FFI_Error*(XLA_FFI_CallFrame*);

struct Registry {
  std::vector<std::pair<std::string, Handler*>> handlers;
  void add(const char* target, Handler* fn) { handlers.emplace_back(target, fn); }
};

// Every target both extensions must register, the one list Python checks them against: a
// handler forgotten on one platform fails at import, not at the first call on that platform.
inline constexpr const char* kTargets[] = {
    "jaxops_concat_training", "jaxops_split_training",                      // concat
    "jaxops_gather_grad",                                                   // gather
    "jaxops_gist_pack_msfp15_encoder", "jaxops_gist_pack_msfp15_decoder",  // gist
    "jaxops_sce_fwd", "jaxops_sce_fwd_log_prob", "jaxops_sce_bwd",         // loss
    "jaxops_sce_bwd_bias",
    "jaxops_layer_normalization_grad",                                      // norm
    "jaxops_simplified_layer_normalization_grad",
    "jaxops_invertible_layer_normalization_grad", "jaxops_batch_normalization_grad",
    "jaxops_batch_norm_internal",
    "jaxops_adamw_optimizer", "jaxops_lamb_optimizer", "jaxops_sgd_optimizer_v2",  // optim
    "jaxops_softmax_grad", "jaxops_log_softmax_grad",                       // softmax
};
// Targets of the CPU extension alone: a CPU path with no CUDA counterpart (on a GPU the
// convolutions, the pools and the range copies stay XLA's).
inline constexpr const char* kCpuTargets[] = {"jaxops_conv_nhwc", "jaxops_depthwise_conv",
                                              "jaxops_depthwise_conv_dx",
                                              "jaxops_depthwise_conv_dw", "jaxops_max_pool_nhwc",
                                              "jaxops_take_ranges"};

// The op families, each a namespace jaxops::<family> with one file per platform.
#define JAXOPS_FAMILIES(X) X(concat) X(gather) X(gist) X(loss) X(norm) X(optim) X(softmax)
#define JAXOPS_CPU_FAMILIES(X) X(conv) X(depthwise) X(pool) X(ranges)

#define JAXOPS_DECLARE_FAMILY(family) \
  namespace family { void register_handlers(Registry& r); }
JAXOPS_FAMILIES(JAXOPS_DECLARE_FAMILY)
JAXOPS_CPU_FAMILIES(JAXOPS_DECLARE_FAMILY)
#undef JAXOPS_DECLARE_FAMILY

}  // namespace jaxops
