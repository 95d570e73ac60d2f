// CUDA multi-tensor kernels of AdamWOptimizer and SGDOptimizerV2: one launch updates a whole
// parameter list (up to kMaxTensors tensors; a longer list takes one launch per kMaxTensors).
//
// The tensor table (pointers, sizes, first chunk of each tensor) is passed by value as the
// kernel argument (CUDA >= 12.1 allows 32 KiB of arguments on sm_70+), so no device table has
// to be filled and no host memory has to outlive the launch. Each block updates one chunk of
// one tensor; it finds its tensor by binary search over the chunk prefix sums.
#include <algorithm>
#include <string>

#include <cuda_runtime.h>

#include "jaxops/checks.h"
#include "jaxops/optim.h"
#include "jaxops/registry.h"

namespace jaxops::optim {
namespace {

constexpr int kMaxTensors = 192;
constexpr int kThreads = 256;
constexpr int kUnroll = 4;
constexpr int64_t kChunk = 16384;  // elements per block

template <int Lists>
struct Table {
  void* ptr[Lists][kMaxTensors];
  int64_t size[kMaxTensors];
  int32_t first_chunk[kMaxTensors + 1];  // prefix sums of chunks per tensor
  int32_t count;
};

// The block's tensor and the element range [begin, end) of its chunk.
template <int Lists>
__device__ __forceinline__ int locate(const Table<Lists>& t, int64_t* begin, int64_t* end) {
  const int32_t chunk = int32_t(blockIdx.x);
  int lo = 0, hi = t.count - 1;  // last tensor whose first_chunk <= chunk
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (t.first_chunk[mid] <= chunk) lo = mid; else hi = mid - 1;
  }
  *begin = int64_t(chunk - t.first_chunk[lo]) * kChunk;
  *end = min(*begin + kChunk, t.size[lo]);
  return lo;
}

// Visits the block's elements: f(index) for each, kUnroll independent elements per thread
// per iteration so that enough loads are in flight.
template <typename F>
__device__ __forceinline__ void for_chunk(int64_t begin, int64_t end, F&& f) {
  for (int64_t base = begin + threadIdx.x; base < end; base += int64_t(kThreads) * kUnroll) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + int64_t(u) * kThreads;
      if (i < end) f(i);
    }
  }
}

// Lists: 0 weights, 1 gradients, 2 m1, 3 m2 (updated in place: results alias operands).
template <typename W, typename G>
__global__ void __launch_bounds__(kThreads)
adamw_kernel(const __grid_constant__ Table<4> t, const float* lr, const void* step, bool step64,
             const bool* signal, bool* flag, float alpha, float beta, float eps, float wd,
             bool correct_bias, int mode) {
  if (blockIdx.x == 0 && threadIdx.x == 0 && flag != nullptr) *flag = *signal;
  if (!*signal || t.count == 0) return;
  using A = acc_t<W>;
  AdamW<A> c{A(alpha), A(beta), A(eps), A(wd), A(*lr)};
  c.mode = mode;
  c.set_step(step64 ? *static_cast<const int64_t*>(step) : *static_cast<const int32_t*>(step),
             correct_bias);
  int64_t begin, end;
  const int k = locate(t, &begin, &end);
  W* w = static_cast<W*>(t.ptr[0][k]);
  const G* g = static_cast<const G*>(t.ptr[1][k]);
  W* m1 = static_cast<W*>(t.ptr[2][k]);
  W* m2 = static_cast<W*>(t.ptr[3][k]);
  for_chunk(begin, end, [&](int64_t i) {
    A wv = load(w, i), a = load(m1, i), b = load(m2, i);
    c.update(wv, A(load(g, i)), a, b);
    store(w, i, wv);
    store(m1, i, a);
    store(m2, i, b);
  });
}

// Lists: 0 weights (in place), 1 gradients.
template <typename W, typename G>
__global__ void __launch_bounds__(kThreads)
sgd_kernel(const __grid_constant__ Table<2> t, const float* lr, const bool* signal, bool* flag) {
  if (blockIdx.x == 0 && threadIdx.x == 0 && flag != nullptr) *flag = *signal;
  if (!*signal || t.count == 0) return;
  using A = acc_t<W>;
  const A rate = A(*lr);
  int64_t begin, end;
  const int k = locate(t, &begin, &end);
  W* w = static_cast<W*>(t.ptr[0][k]);
  const G* g = static_cast<const G*>(t.ptr[1][k]);
  for_chunk(begin, end, [&](int64_t i) { store(w, i, load(w, i) - rate * A(load(g, i))); });
}

std::string check_scalar(const ffi::AnyBuffer& x, const char* name, ffi::DataType a,
                         ffi::DataType b) {
  if (x.element_count() != 1) return std::string(name) + " must hold one element";
  if (x.element_type() != a && x.element_type() != b) return std::string(name) + " has the wrong dtype";
  return {};
}

// Copies each operand of `lists` into its result where XLA gave them distinct buffers, so the
// kernel can update the results in place.
cudaError_t copy_if_distinct(cudaStream_t stream, const ffi::RemainingArgs& in,
                             const ffi::RemainingRets& out, int64_t count, const int* lists,
                             int n_lists) {
  for (int l = 0; l < n_lists; ++l)
    for (int64_t i = 0; i < count; ++i) {
      auto a = *in.get<ffi::AnyBuffer>(lists[l] * count + i);
      auto r = **out.get<ffi::AnyBuffer>(l * count + i);
      if (a.untyped_data() != r.untyped_data() && a.size_bytes() > 0)
        if (cudaError_t e = cudaMemcpyAsync(r.untyped_data(), a.untyped_data(), a.size_bytes(),
                                            cudaMemcpyDeviceToDevice, stream);
            e != cudaSuccess)
          return e;
    }
  return cudaSuccess;
}

// Launches `launch(table, blocks, first)` once per group of up to kMaxTensors non-empty
// tensors. ptrs(l, i) gives list l's pointer for tensor i (the results for updated lists).
template <int Lists, typename Ptr, typename Launch>
void for_groups(int64_t count, const ffi::RemainingArgs& in, Ptr ptrs, Launch launch) {
  Table<Lists> t;
  int64_t i = 0;
  bool first = true;
  while (i < count || first) {
    t.count = 0;
    int32_t chunks = 0;
    for (; i < count && t.count < kMaxTensors; ++i) {
      const int64_t n = int64_t(in.get<ffi::AnyBuffer>(i)->element_count());
      if (n == 0) continue;
      for (int l = 0; l < Lists; ++l) t.ptr[l][t.count] = ptrs(l, i);
      t.size[t.count] = n;
      t.first_chunk[t.count] = chunks;
      chunks += int32_t((n + kChunk - 1) / kChunk);
      ++t.count;
    }
    t.first_chunk[t.count] = chunks;
    launch(t, chunks, first);  // chunks == 0 only writes the flag
    first = false;
  }
}

ffi::Error finish(const char* op) {
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess)
    return ffi::Error::Internal(std::string(op) + ": " + cudaGetErrorString(e));
  return ffi::Error::Success();
}

ffi::Error adamw(cudaStream_t stream, ffi::AnyBuffer lr, ffi::AnyBuffer step,
                 ffi::AnyBuffer signal, ffi::RemainingArgs in, ffi::Result<ffi::AnyBuffer> flag,
                 ffi::RemainingRets out, int64_t count, float alpha, float beta, float eps,
                 float wd, int64_t correct_bias, int64_t mode) {
  const char* op = "adamw_optimizer";
  for (auto err : {check_scalar(lr, "lr", ffi::DataType::F32, ffi::DataType::F32),
                   check_scalar(step, "step", ffi::DataType::S64, ffi::DataType::S32),
                   check_scalar(signal, "update_signal", ffi::DataType::PRED, ffi::DataType::PRED),
                   check_scalar(*flag, "flag", ffi::DataType::PRED, ffi::DataType::PRED),
                   check_lists(in, out, count, 4, 3)})
    if (!err.empty()) return invalid(op, err);
  if (mode != 0 && mode != 1) return invalid(op, "adam_mode must be 0 or 1");
  const ffi::DataType wt = count ? in.get<ffi::AnyBuffer>(0)->element_type() : ffi::DataType::F32;
  const ffi::DataType gt = count ? in.get<ffi::AnyBuffer>(count)->element_type() : wt;
  for (int l : {2, 3})
    if (count && in.get<ffi::AnyBuffer>(l * count)->element_type() != wt)
      return invalid(op, "weights and moments must share one dtype");
  for (int64_t i = 0; i < 3 * count; ++i)
    if ((*out.get<ffi::AnyBuffer>(i))->element_type() != wt)
      return invalid(op, "results must have the weights' dtype");
  const int lists[] = {0, 2, 3};
  if (cudaError_t e = copy_if_distinct(stream, in, out, count, lists, 3); e != cudaSuccess)
    return ffi::Error::Internal(std::string(op) + ": " + cudaGetErrorString(e));
  const int result_list[] = {0, -1, 1, 2};
  auto ptrs = [&](int l, int64_t i) -> void* {
    if (l == 1) return in.get<ffi::AnyBuffer>(count + i)->untyped_data();
    return (*out.get<ffi::AnyBuffer>(result_list[l] * count + i))->untyped_data();
  };
  bool ok = dispatch_wg(wt, gt, [&](auto w_tag, auto g_tag) {
    using W = decltype(w_tag);
    using G = decltype(g_tag);
    for_groups<4>(count, in, ptrs, [&](const Table<4>& t, int32_t blocks, bool first) {
      adamw_kernel<W, G><<<std::max(blocks, 1), kThreads, 0, stream>>>(
          t, lr.reinterpret_data<float>(), step.untyped_data(), step.element_type() == ffi::DataType::S64,
          signal.reinterpret_data<bool>(), first ? flag->reinterpret_data<bool>() : nullptr,
          alpha, beta, eps, wd, correct_bias != 0, int(mode));
    });
  });
  if (!ok) return invalid(op, "unsupported weight/gradient dtypes");
  return finish(op);
}

ffi::Error sgd(cudaStream_t stream, ffi::AnyBuffer lr, ffi::AnyBuffer signal,
               ffi::RemainingArgs in, ffi::Result<ffi::AnyBuffer> flag, ffi::RemainingRets out,
               int64_t count) {
  const char* op = "sgd_optimizer_v2";
  for (auto err : {check_scalar(lr, "lr", ffi::DataType::F32, ffi::DataType::F32),
                   check_scalar(signal, "update_signal", ffi::DataType::PRED, ffi::DataType::PRED),
                   check_scalar(*flag, "flag", ffi::DataType::PRED, ffi::DataType::PRED),
                   check_lists(in, out, count, 2, 1)})
    if (!err.empty()) return invalid(op, err);
  const ffi::DataType wt = count ? in.get<ffi::AnyBuffer>(0)->element_type() : ffi::DataType::F32;
  const ffi::DataType gt = count ? in.get<ffi::AnyBuffer>(count)->element_type() : wt;
  for (int64_t i = 0; i < count; ++i)
    if ((*out.get<ffi::AnyBuffer>(i))->element_type() != wt)
      return invalid(op, "results must have the weights' dtype");
  const int lists[] = {0};
  if (cudaError_t e = copy_if_distinct(stream, in, out, count, lists, 1); e != cudaSuccess)
    return ffi::Error::Internal(std::string(op) + ": " + cudaGetErrorString(e));
  auto ptrs = [&](int l, int64_t i) -> void* {
    if (l == 1) return in.get<ffi::AnyBuffer>(count + i)->untyped_data();
    return (*out.get<ffi::AnyBuffer>(i))->untyped_data();
  };
  bool ok = dispatch_wg(wt, gt, [&](auto w_tag, auto g_tag) {
    using W = decltype(w_tag);
    using G = decltype(g_tag);
    for_groups<2>(count, in, ptrs, [&](const Table<2>& t, int32_t blocks, bool first) {
      sgd_kernel<W, G><<<std::max(blocks, 1), kThreads, 0, stream>>>(
          t, lr.reinterpret_data<float>(), signal.reinterpret_data<bool>(),
          first ? flag->reinterpret_data<bool>() : nullptr);
    });
  });
  if (!ok) return invalid(op, "unsupported weight/gradient dtypes");
  return finish(op);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AdamWCuda, adamw,
                              bind_adamw(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(SgdV2Cuda, sgd,
                              bind_sgd(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));
JAXOPS_REGISTER("jaxops_adamw_optimizer", AdamWCuda);
JAXOPS_REGISTER("jaxops_sgd_optimizer_v2", SgdV2Cuda);

}  // namespace jaxops::optim
