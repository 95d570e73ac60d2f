// CPU handler of take_ranges (jaxops/ops/ranges.py): pieces of a flat buffer, each from its own
// offset, copied by one call. The packed training state (jaxops/onnx/packed.py) takes its weight
// matrices out this way: one thunk where XLA:CPU runs a slice copy each, every one a source of
// its thunk graph that the executor hands to another thread.
#include <cstring>
#include <string>

#include "jaxops/checks.h"
#include "jaxops/registry.h"

namespace jaxops::ranges {
namespace {

ffi::Error take_ranges(ffi::AnyBuffer flat, ffi::RemainingRets outputs,
                       ffi::Span<const int64_t> offsets) {
  const char* op = "take_ranges";
  if (auto err = check_type("flat", flat.element_type(), kWholeByteTypes); !err.empty())
    return invalid(op, err);
  if (flat.dimensions().size() != 1) return invalid(op, "flat must have rank 1");
  if (offsets.size() != outputs.size())
    return invalid(op, std::to_string(offsets.size()) + " offsets for " +
                           std::to_string(outputs.size()) + " outputs");
  const int64_t total = flat.dimensions()[0];
  const size_t item = ffi::ByteWidth(flat.element_type());
  const auto* in = static_cast<const char*>(flat.untyped_data());
  for (size_t k = 0; k < outputs.size(); ++k) {
    auto out = outputs.get<ffi::AnyBuffer>(k);
    if (out.has_error()) return out.error();
    if ((*out)->element_type() != flat.element_type())
      return invalid(op, "outputs must have flat's dtype");
    const int64_t n = static_cast<int64_t>((*out)->element_count());
    if (offsets[k] < 0 || offsets[k] > total - n)
      return invalid(op, "output " + std::to_string(k) + " reaches past flat's end");
    std::memcpy((*out)->untyped_data(), in + offsets[k] * item, n * item);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TakeRangesCpu, take_ranges,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("offsets"));

void register_handlers(Registry& r) { r.add("jaxops_take_ranges", TakeRangesCpu); }

}  // namespace jaxops::ranges
