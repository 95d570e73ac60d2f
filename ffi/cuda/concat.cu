// CUDA handlers of ConcatTraining and SplitTraining, with the semantics of ffi/cpu/concat.cc.
//
// One launch copies every piece: a table of the pieces (pointer, row length and column offset,
// see concat.h) travels by value as a kernel parameter, and blockIdx.y picks the piece. Each
// thread walks its piece contiguously (coalesced on the piece's side) and maps element j of
// the piece to row j / row, column offset + j % row of the whole tensor (coalesced along each
// row segment there). Elements are moved as the widest word (16, 8, 4, 2 or 1 bytes) that
// divides every row, offset and base address, so dtype does not matter. A table holds
// kMaxPieces pieces; more pieces take one launch per kMaxPieces.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "jaxops/checks.h"
#include "jaxops/concat.h"
#include "jaxops/cuda_launch.h"
#include "jaxops/registry.h"

namespace jaxops::concat {
namespace {

constexpr int kMaxPieces = 128;  // 128 * 24 B + 8 B: well inside the 4 KB parameter space
constexpr int kThreads = 256;
constexpr int kUnroll = 4;       // loads in flight per thread

struct Table {
  void* data[kMaxPieces];
  int64_t row[kMaxPieces];     // words per row of the piece
  int64_t offset[kMaxPieces];  // word column of the piece in the whole tensor
};

// Word loads: read once, so streaming (evict-first) loads.
template <typename W>
__device__ __forceinline__ W load(const W* p) { return __ldcs(p); }

// I: the index type, 32-bit when every index fits (cheaper division), else 64-bit.
template <typename W, typename I, bool kSplit>
__global__ void __launch_bounds__(kThreads) copy_kernel(const __grid_constant__ Table t,
                                                        W* whole, I outer, I whole_row) {
  const int k = blockIdx.y;
  const I row = static_cast<I>(t.row[k]);
  const I off = static_cast<I>(t.offset[k]);
  const I n = outer * row;
  W* piece = static_cast<W*>(t.data[k]);
  const I step = static_cast<I>(gridDim.x) * kThreads;
  auto at_whole = [&](I j) {
    const I r = j / row;
    return r * whole_row + off + (j - r * row);
  };
  I i = static_cast<I>(blockIdx.x) * kThreads + threadIdx.x;
  for (; i + (kUnroll - 1) * step < n; i += kUnroll * step) {
    W v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const I j = i + u * step;
      v[u] = kSplit ? load(whole + at_whole(j)) : load(piece + j);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const I j = i + u * step;
      if (kSplit) piece[j] = v[u];
      else whole[at_whole(j)] = v[u];
    }
  }
  for (; i < n; i += step) {
    if (kSplit) piece[i] = load(whole + at_whole(i));
    else whole[at_whole(i)] = load(piece + i);
  }
}

template <typename W, typename I, bool kSplit>
void launch(const Plan& plan, void* whole, int sms, cudaStream_t stream) {
  const int64_t w = sizeof(W);
  for (size_t first = 0; first < plan.pieces.size(); first += kMaxPieces) {
    const int count = static_cast<int>(std::min<size_t>(kMaxPieces, plan.pieces.size() - first));
    Table t{};
    int64_t most = 0;  // words of the largest piece
    for (int k = 0; k < count; ++k) {
      const Piece& p = plan.pieces[first + k];
      t.data[k] = const_cast<void*>(p.data);
      t.row[k] = p.row / w;
      t.offset[k] = p.offset / w;
      most = std::max(most, plan.outer * t.row[k]);
    }
    // About two waves of resident blocks over all pieces, enough for the largest piece.
    const int64_t wanted = (int64_t(sms) * 16 + count - 1) / count;
    const int64_t needed = (most + int64_t(kThreads) * kUnroll - 1) / (int64_t(kThreads) * kUnroll);
    const unsigned bx = static_cast<unsigned>(std::max<int64_t>(1, std::min(wanted, needed)));
    copy_kernel<W, I, kSplit><<<dim3(bx, count), kThreads, 0, stream>>>(
        t, static_cast<W*>(whole), static_cast<I>(plan.outer),
        static_cast<I>(plan.whole_row / w));
  }
}

template <typename W, bool kSplit>
void launch_word(const Plan& plan, void* whole, int sms, cudaStream_t stream) {
  // 32-bit indices when every whole-tensor word index (and the unrolled loop bound) fits
  const int64_t words = plan.outer * (plan.whole_row / int64_t(sizeof(W)));
  if (words + int64_t(kUnroll) * sms * 16 * kThreads < (int64_t(1) << 31))
    launch<W, uint32_t, kSplit>(plan, whole, sms, stream);
  else
    launch<W, int64_t, kSplit>(plan, whole, sms, stream);
}

template <bool kSplit>
void launch_plan(const Plan& plan, void* whole, int sms, cudaStream_t stream) {
  // The widest word dividing every row, offset and address.
  uint64_t bits = uint64_t(plan.whole_row) | reinterpret_cast<uintptr_t>(whole) | 16;
  for (const Piece& p : plan.pieces)
    bits |= uint64_t(p.row) | uint64_t(p.offset) | reinterpret_cast<uintptr_t>(p.data);
  switch (bits & (~bits + 1)) {  // lowest set bit
    case 16: return launch_word<uint4, kSplit>(plan, whole, sms, stream);
    case 8: return launch_word<uint2, kSplit>(plan, whole, sms, stream);
    case 4: return launch_word<unsigned int, kSplit>(plan, whole, sms, stream);
    case 2: return launch_word<unsigned short, kSplit>(plan, whole, sms, stream);
    default: return launch_word<unsigned char, kSplit>(plan, whole, sms, stream);
  }
}

ffi::Error run(const char* op, cudaStream_t stream, const ffi::AnyBuffer& whole,
               const std::vector<std::pair<ffi::AnyBuffer, const void*>>& pieces, int64_t axis,
               bool split) {
  Plan plan;
  if (auto err = make_plan(whole, pieces, axis, &plan); !err.empty()) return invalid(op, err);
  if (plan.outer == 0 || plan.pieces.empty()) return ffi::Error::Success();
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    sms = 132;  // the query failed: any positive count gives a correct launch
  sms = std::max(sms, 1);
  if (split) launch_plan<true>(plan, whole.untyped_data(), sms, stream);
  else launch_plan<false>(plan, whole.untyped_data(), sms, stream);
  return launched(op);
}

ffi::Error concat_training_cuda(cudaStream_t stream, ffi::RemainingArgs inputs,
                                ffi::Result<ffi::AnyBuffer> out, int64_t axis) {
  std::vector<std::pair<ffi::AnyBuffer, const void*>> pieces;
  if (auto err = concat_pieces(inputs, &pieces); !err.empty())
    return invalid("concat_training", err);
  return run("concat_training", stream, *out, pieces, axis, false);
}

ffi::Error split_training_cuda(cudaStream_t stream, ffi::AnyBuffer in, ffi::RemainingRets outputs,
                               int64_t axis) {
  std::vector<std::pair<ffi::AnyBuffer, const void*>> pieces;
  if (auto err = split_pieces(outputs, &pieces); !err.empty())
    return invalid("split_training", err);
  return run("split_training", stream, in, pieces, axis, true);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ConcatTrainingCuda, concat_training_cuda,
                              bind_concat(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(SplitTrainingCuda, split_training_cuda,
                              bind_split(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));

void register_handlers(Registry& r) {
  r.add("jaxops_concat_training", ConcatTrainingCuda);
  r.add("jaxops_split_training", SplitTrainingCuda);
}

}  // namespace jaxops::concat
