// CPU handlers of GistPackMsfp15Encoder and GistPackMsfp15Decoder: one tile at a time.
#include <cstring>

#include "jaxops/checks.h"
#include "jaxops/gist.h"
#include "jaxops/registry.h"

namespace jaxops::gist {
namespace {

ffi::Error encoder(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  if (auto err = check(x, *y, ffi::DataType::F32, ffi::DataType::U8); !err.empty())
    return invalid("gist_pack_msfp15_encoder", err);
  const auto* in = static_cast<const uint8_t*>(x.untyped_data());
  auto* out = static_cast<uint8_t*>(y->untyped_data());
  const int64_t tiles = int64_t(x.element_count()) / kTile;
  for (int64_t t = 0; t < tiles; ++t) {
    uint32_t bits[kTile];
    std::memcpy(bits, in + t * kTile * 4, sizeof(bits));
    msfp15_encode(bits, out + t * kTile);
  }
  return ffi::Error::Success();
}

ffi::Error decoder(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  if (auto err = check(x, *y, ffi::DataType::U8, ffi::DataType::F32); !err.empty())
    return invalid("gist_pack_msfp15_decoder", err);
  const auto* in = static_cast<const uint8_t*>(x.untyped_data());
  auto* out = static_cast<uint8_t*>(y->untyped_data());
  const int64_t tiles = int64_t(x.element_count()) / kTile;
  for (int64_t t = 0; t < tiles; ++t) {
    const uint8_t* tile = in + t * kTile;
    const uint32_t shared = msfp15_shared(tile);
    uint32_t bits[kTile];
    for (int i = 0; i < kTile; ++i) bits[i] = msfp15_decode(tile[i], shared);
    std::memcpy(out + t * kTile * 4, bits, sizeof(bits));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Msfp15EncoderCpu, encoder, bind_args(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(Msfp15DecoderCpu, decoder, bind_args(ffi::Ffi::Bind()));

void register_handlers(Registry& r) {
  r.add("jaxops_gist_pack_msfp15_encoder", Msfp15EncoderCpu);
  r.add("jaxops_gist_pack_msfp15_decoder", Msfp15DecoderCpu);
}

}  // namespace jaxops::gist
