// CUDA kernels of GistPackMsfp15Encoder and GistPackMsfp15Decoder: 16-byte accesses for the
// floats, 8-byte ones for a tile's packed bytes.
#include <string>

#include <cuda_runtime.h>

#include "jaxops/checks.h"
#include "jaxops/cuda_launch.h"
#include "jaxops/gist.h"
#include "jaxops/registry.h"

namespace jaxops::gist {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
encode_kernel(const uint4* __restrict__ x, uint2* __restrict__ y, int64_t tiles) {
  for (int64_t t = blockIdx.x * int64_t(kThreads) + threadIdx.x; t < tiles;
       t += int64_t(gridDim.x) * kThreads) {
    const uint4 a = x[2 * t], b = x[2 * t + 1];
    const uint32_t bits[kTile] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    uint2 out;
    msfp15_encode(bits, reinterpret_cast<uint8_t*>(&out));
    y[t] = out;
  }
}

// Two threads a tile, each writing one 16-byte half, so that a warp's store is 512
// contiguous bytes (a thread writing both halves of its tile gave 72% of copy bandwidth).
__global__ void __launch_bounds__(kThreads)
decode_kernel(const uint2* __restrict__ x, uint4* __restrict__ y, int64_t halves) {
  for (int64_t h = blockIdx.x * int64_t(kThreads) + threadIdx.x; h < halves;
       h += int64_t(gridDim.x) * kThreads) {
    const uint2 in = x[h / 2];  // little-endian: bytes 0-3 in .x, 4-7 in .y
    uint8_t tile[kTile];
#pragma unroll
    for (int i = 0; i < kTile; ++i) tile[i] = uint8_t((i < 4 ? in.x : in.y) >> (8 * (i % 4)));
    const uint32_t shared = msfp15_shared(tile);
    const uint32_t mine = h % 2 ? in.y : in.x;  // this half's 4 bytes (no dynamic indexing)
    y[h] = make_uint4(msfp15_decode(uint8_t(mine), shared), msfp15_decode(uint8_t(mine >> 8), shared),
                      msfp15_decode(uint8_t(mine >> 16), shared),
                      msfp15_decode(uint8_t(mine >> 24), shared));
  }
}

// Enough blocks to fill the GPU several times over; the grid-stride loops cover the rest.
unsigned grid_for(int64_t items) {
  const int64_t blocks = (items + kThreads - 1) / kThreads;
  return unsigned(blocks < 65536 ? (blocks > 0 ? blocks : 1) : 65536);
}

ffi::Error encoder(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  const char* op = "gist_pack_msfp15_encoder";
  if (auto err = check(x, *y, ffi::DataType::F32, ffi::DataType::U8); !err.empty())
    return invalid(op, err);
  const int64_t tiles = int64_t(x.element_count()) / kTile;
  if (tiles == 0) return ffi::Error::Success();
  // XLA's buffers are 16-byte aligned, and a tile is 32 input bytes and 8 output bytes.
  encode_kernel<<<grid_for(tiles), kThreads, 0, stream>>>(
      static_cast<const uint4*>(x.untyped_data()), static_cast<uint2*>(y->untyped_data()), tiles);
  return launched(op);
}

ffi::Error decoder(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  const char* op = "gist_pack_msfp15_decoder";
  if (auto err = check(x, *y, ffi::DataType::U8, ffi::DataType::F32); !err.empty())
    return invalid(op, err);
  const int64_t tiles = int64_t(x.element_count()) / kTile;
  if (tiles == 0) return ffi::Error::Success();
  decode_kernel<<<grid_for(2 * tiles), kThreads, 0, stream>>>(
      static_cast<const uint2*>(x.untyped_data()), static_cast<uint4*>(y->untyped_data()),
      2 * tiles);
  return launched(op);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Msfp15EncoderCuda, encoder,
                              bind_args(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(Msfp15DecoderCuda, decoder,
                              bind_args(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));

void register_handlers(Registry& r) {
  r.add("jaxops_gist_pack_msfp15_encoder", Msfp15EncoderCuda);
  r.add("jaxops_gist_pack_msfp15_decoder", Msfp15DecoderCuda);
}

}  // namespace jaxops::gist
