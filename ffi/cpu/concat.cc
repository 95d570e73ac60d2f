// CPU handlers of ConcatTraining and SplitTraining: one memcpy per row of each piece.
#include <vector>

#include "jaxops/checks.h"
#include "jaxops/concat.h"
#include "jaxops/registry.h"

namespace jaxops::concat {
namespace {

ffi::Error run(const char* op, const ffi::AnyBuffer& whole,
               const std::vector<std::pair<ffi::AnyBuffer, const void*>>& pieces, int64_t axis,
               bool split) {
  Plan plan;
  if (auto err = make_plan(whole, pieces, axis, &plan); !err.empty()) return invalid(op, err);
  for (const Piece& p : plan.pieces)
    for (int64_t r = 0; r < plan.outer; ++r)
      copy_row_host(plan, p, r, split, whole.untyped_data());
  return ffi::Error::Success();
}

ffi::Error concat_training(ffi::RemainingArgs inputs, ffi::Result<ffi::AnyBuffer> out,
                           int64_t axis) {
  std::vector<std::pair<ffi::AnyBuffer, const void*>> pieces;
  if (auto err = concat_pieces(inputs, &pieces); !err.empty())
    return invalid("concat_training", err);
  return run("concat_training", *out, pieces, axis, false);
}

ffi::Error split_training(ffi::AnyBuffer in, ffi::RemainingRets outputs, int64_t axis) {
  std::vector<std::pair<ffi::AnyBuffer, const void*>> pieces;
  if (auto err = split_pieces(outputs, &pieces); !err.empty())
    return invalid("split_training", err);
  return run("split_training", in, pieces, axis, true);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ConcatTrainingCpu, concat_training, bind_concat(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(SplitTrainingCpu, split_training, bind_split(ffi::Ffi::Bind()));

void register_handlers(Registry& r) {
  r.add("jaxops_concat_training", ConcatTrainingCpu);
  r.add("jaxops_split_training", SplitTrainingCpu);
}

}  // namespace jaxops::concat
