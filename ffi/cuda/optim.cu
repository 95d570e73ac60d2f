// CUDA multi-tensor kernels of AdamWOptimizer and SGDOptimizerV2: one launch updates a whole
// parameter list (up to kMaxTensors tensors; a longer list takes one launch per kMaxTensors).
// LambOptimizer takes one launch too, over a queue of norm and update work (see LambQueue).
//
// The tensor table (pointers, sizes, first chunk of each tensor) is passed by value as the
// kernel argument (CUDA >= 12.1 allows 32 KiB of arguments on sm_70+), so no device table has
// to be filled and no host memory has to outlive the launch. Each block updates one chunk of
// one tensor (LAMB: one work item at a time); it finds its tensor by binary search over the
// chunk prefix sums.
#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include <cuda_runtime.h>

#include "jaxops/checks.h"
#include "jaxops/cuda_launch.h"
#include "jaxops/cuda_elem.cuh"
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
  int32_t id[kMaxTensors];                // the tensor's index in the op's lists
  int32_t count;

  // Whether every pointer is 16-byte aligned (XLA's buffers are), so chunks can be moved in
  // 16-byte accesses: a chunk starts a multiple of kChunk elements into its tensor.
  bool aligned() const {
    for (int l = 0; l < Lists; ++l)
      for (int k = 0; k < count; ++k)
        if (reinterpret_cast<uintptr_t>(ptr[l][k]) % 16 != 0) return false;
    return true;
  }
};

// Elements per access for element types of S and T bytes: 16 bytes of the wider, at most 4
// (more would take too many registers at kUnroll groups a thread).
constexpr int group_size(int s, int t) { return std::min(4, 16 / std::max(s, t)); }

// The last of the n ascending `starts` that is <= x (starts[0] <= x).
__device__ __forceinline__ int last_at_or_before(const int32_t* starts, int n, int32_t x) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (starts[mid] <= x) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// The block's tensor and the element range [begin, end) of its chunk.
template <int Lists>
__device__ __forceinline__ int locate(const Table<Lists>& t, int64_t* begin, int64_t* end) {
  const int32_t chunk = int32_t(blockIdx.x);
  const int lo = last_at_or_before(t.first_chunk, t.count, chunk);
  *begin = int64_t(chunk - t.first_chunk[lo]) * kChunk;
  *end = min(*begin + kChunk, t.size[lo]);
  return lo;
}

// N contiguous elements of T as one memory access (cuda_elem.cuh's Pack), in the
// accumulation type.
template <int N, typename T>
__device__ __forceinline__ void load_n(const T* p, int64_t i, acc_t<T>* out) {
  const Pack<T, N> k = *reinterpret_cast<const Pack<T, N>*>(p + i);
#pragma unroll
  for (int j = 0; j < N; ++j) out[j] = load(k.v, j);
}

template <int N, typename T>
__device__ __forceinline__ void store_n(T* p, int64_t i, const acc_t<T>* in) {
  Pack<T, N> k;
#pragma unroll
  for (int j = 0; j < N; ++j) store(k.v, j, in[j]);
  *reinterpret_cast<Pack<T, N>*>(p + i) = k;
}

// Visits [begin, end) in groups of N contiguous elements: load(n, i, u) for kUnroll groups
// first, then finish(n, i, u) (compute and store), with n a std::integral_constant holding N.
// The compiler cannot move a load above a store to another array it might alias, so this
// order is what keeps kUnroll groups' loads in flight at once. begin - (the tensor's start)
// must be a multiple of N.
template <int N, typename Load, typename Finish>
__device__ __forceinline__ void visit_groups(int64_t begin, int64_t end, Load& load_u,
                                             Finish& finish_u) {
  constexpr std::integral_constant<int, N> n;
  constexpr int64_t kStride = int64_t(kThreads) * N;
  for (int64_t base = begin + threadIdx.x * N; base < end; base += kStride * kUnroll) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * kStride;
      if (i < end) load_u(n, i, u);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * kStride;
      if (i < end) finish_u(n, i, u);
    }
  }
}

// The block's chunk [begin, end): groups of N (16-byte accesses where the host found every
// pointer aligned), then the last (end - begin) % N elements one at a time.
template <int N, typename Load, typename Finish>
__device__ __forceinline__ void for_chunk(int64_t begin, int64_t end, Load&& load_u,
                                          Finish&& finish_u) {
  const int64_t mid = begin + (end - begin) / N * N;
  visit_groups<N>(begin, mid, load_u, finish_u);
  if constexpr (N > 1) visit_groups<1>(mid, end, load_u, finish_u);
}

// Lists: 0 weights, 1 gradients, 2 m1, 3 m2 (updated in place: results alias operands).
template <typename W, typename G, int N>
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
  A wv[kUnroll][N], a[kUnroll][N], b[kUnroll][N];
  acc_t<G> gv[kUnroll][N];
  for_chunk<N>(
      begin, end,
      [&](auto n, int64_t i, int u) {
        load_n<decltype(n)::value>(w, i, wv[u]);
        load_n<decltype(n)::value>(g, i, gv[u]);
        load_n<decltype(n)::value>(m1, i, a[u]);
        load_n<decltype(n)::value>(m2, i, b[u]);
      },
      [&](auto n, int64_t i, int u) {
#pragma unroll
        for (int j = 0; j < decltype(n)::value; ++j) c.update(wv[u][j], A(gv[u][j]), a[u][j], b[u][j]);
        store_n<decltype(n)::value>(w, i, wv[u]);
        store_n<decltype(n)::value>(m1, i, a[u]);
        store_n<decltype(n)::value>(m2, i, b[u]);
      });
}

// Lists: 0 weights (in place), 1 gradients.
template <typename W, typename G, int N>
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
  A wv[kUnroll][N];
  acc_t<G> gv[kUnroll][N];
  for_chunk<N>(
      begin, end,
      [&](auto n, int64_t i, int u) {
        load_n<decltype(n)::value>(w, i, wv[u]);
        load_n<decltype(n)::value>(g, i, gv[u]);
      },
      [&](auto n, int64_t i, int u) {
#pragma unroll
        for (int j = 0; j < decltype(n)::value; ++j) wv[u][j] -= rate * A(gv[u][j]);
        store_n<decltype(n)::value>(w, i, wv[u]);
      });
}

// Sum of v over the block (kThreads threads), returned to every thread.
__device__ __forceinline__ float2 block_sum(float2 v) {
  __shared__ float2 part[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) {
    v.x += __shfl_xor_sync(0xffffffffu, v.x, o);
    v.y += __shfl_xor_sync(0xffffffffu, v.y, o);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // part may still be read by a previous call
  if (lane == 0) part[warp] = v;
  __syncthreads();
  v = make_float2(0.f, 0.f);
  for (int k = 0; k < kThreads / 32; ++k) {  // every thread sums the warps in one order
    v.x += part[k].x;
    v.y += part[k].y;
  }
  return v;
}

struct LambArgs {
  const bool* signal;
  const float *loss_scale, *norm, *lr, *hyper;
  const void* step;
  bool step64;
  float ratio_min, ratio_max;
  bool correct, has_norm, has_step;

  __device__ int64_t step_value() const {
    return step64 ? *static_cast<const int64_t*>(step) : *static_cast<const int32_t*>(step);
  }
  __device__ Lamb<float> consts(int id) const {
    return make_lamb<float>(hyper + kHyper * id, *lr, *loss_scale, *norm, step_value(), ratio_min,
                            ratio_max, correct && has_step, has_norm);
  }
};

// LAMB's work queue over one Table (lists: 0 weights, 1 gradients (in), 2 m1, 3 m2, 4 new
// gradients or null). Items are chunks, taken in order from a global counter: a chunk's share
// of its tensor's norms, or its update, which needs the whole tensor's norms first. Tensor k's
// update is queued after its norms and `lead` more norm items (of the next tensors), which keep
// the GPU busy while k's last norm chunks finish: one launch covers the list, with no drain
// between tensors. The block that finishes a tensor's last norm chunk sums its partials in a
// fixed order (deterministic) and publishes the trust ratio; an update item waits for it. Norm
// items never wait and precede their tensor's updates in the queue, so nothing can deadlock,
// whatever the blocks' residency.
// A norm item writes the new moments and d (the update direction, to scratch: 4 bytes a
// parameter), so an update item reads w and d only: 10 accesses an element, not the 11 of
// re-reading w, g, m1, m2. Measured on an H100 (GPT-2 small, ncu): the kernel runs at 99% of copy
// bandwidth, and the update's re-reads do not hit L2. Queueing updates sooner (no lead, smaller
// chunks, last chunk first) made about half of them hit, but the waits cost more.
struct LambQueue {
  Table<5> t;
  int32_t first_item[3 * kMaxTensors + 1];  // prefix sums of the segments' items
  int32_t first_chunk[3 * kMaxTensors];     // the segment's first chunk in its tensor
  int32_t segment[3 * kMaxTensors];         // 2 * tensor + 1 for its update, + 0 for its norms
  int32_t segments;
};

// This thread's share of the sums of w^2 and d^2 over [begin, end) of tensor k. It writes the
// new moments (final: they do not depend on the trust ratio) and d, so the update reads 2
// arrays, not 4.
template <typename G, int N>
__device__ __forceinline__ float2 lamb_chunk_norms(const Lamb<float>& c, const Table<5>& t, int k,
                                                   float* d_out, int64_t begin, int64_t end) {
  const float* w = static_cast<const float*>(t.ptr[0][k]);
  const G* g = static_cast<const G*>(t.ptr[1][k]);
  float* m1 = static_cast<float*>(t.ptr[2][k]);
  float* m2 = static_cast<float*>(t.ptr[3][k]);
  float2 s = make_float2(0.f, 0.f);
  float wv[kUnroll][N], gv[kUnroll][N], n1[kUnroll][N], n2[kUnroll][N];
  for_chunk<N>(
      begin, end,
      [&](auto n, int64_t i, int u) {
        load_n<decltype(n)::value>(w, i, wv[u]);
        load_n<decltype(n)::value>(g, i, gv[u]);
        load_n<decltype(n)::value>(m1, i, n1[u]);
        load_n<decltype(n)::value>(m2, i, n2[u]);
      },
      [&](auto n, int64_t i, int u) {
#pragma unroll
        for (int j = 0; j < decltype(n)::value; ++j) {
          gv[u][j] = c.direction(wv[u][j], gv[u][j], n1[u][j], n2[u][j]);
          s.x += wv[u][j] * wv[u][j];
          s.y += gv[u][j] * gv[u][j];
        }
        store_n<decltype(n)::value>(d_out, i, gv[u]);
        store_n<decltype(n)::value>(m1, i, n1[u]);
        store_n<decltype(n)::value>(m2, i, n2[u]);
      });
  return s;
}

// The update of [begin, end) of tensor k from its d by the trust ratio.
template <typename G, int N>
__device__ __forceinline__ void lamb_chunk_update(const Lamb<float>& c, float* w, const float* d,
                                                  G* g_out, int64_t begin, int64_t end,
                                                  float ratio) {
  float wv[kUnroll][N], dv[kUnroll][N];
  for_chunk<N>(
      begin, end,
      [&](auto n, int64_t i, int u) {
        load_n<decltype(n)::value>(w, i, wv[u]);
        load_n<decltype(n)::value>(d, i, dv[u]);
      },
      [&](auto n, int64_t i, int u) {
#pragma unroll
        for (int j = 0; j < decltype(n)::value; ++j) dv[u][j] = c.apply(wv[u][j], dv[u][j], ratio);
        if (g_out != nullptr) store_n<decltype(n)::value>(g_out, i, dv[u]);
        store_n<decltype(n)::value>(w, i, wv[u]);
      });
}

// d: kChunk floats a chunk (tensor k's from chunk first_chunk[k]); partials: one per chunk;
// ratios and done: one per tensor of the table (done counts finished norm chunks, plus one once
// the ratio is out); next: the queue's counter. done and next start at 0.
template <typename G, int N>
__global__ void __launch_bounds__(kThreads)
lamb_kernel(const __grid_constant__ LambQueue q, LambArgs a, float* d, float2* partials,
            float* ratios, unsigned* done, unsigned* next, void* new_step, bool new_step64) {
  if (blockIdx.x == 0 && threadIdx.x == 0 && new_step != nullptr) {
    const int64_t s = a.step_value() + ((*a.signal && a.has_step) ? 1 : 0);
    if (new_step64) *static_cast<int64_t*>(new_step) = s;
    else *static_cast<int32_t*>(new_step) = int32_t(s);
  }
  if (!*a.signal) return;
  const Table<5>& t = q.t;
  const int32_t items = q.first_item[q.segments];
  __shared__ int32_t item_s;
  __shared__ bool last_s;
  __shared__ float ratio_s;
  int prev = -1;  // the tensor of the block's previous item, whose constants c holds
  Lamb<float> c{};
  for (;;) {
    __syncthreads();  // every thread is done with the previous item's shared values
    if (threadIdx.x == 0) item_s = int32_t(atomicAdd(next, 1u));
    __syncthreads();
    const int32_t item = item_s;
    if (item >= items) return;
    const int lo = last_at_or_before(q.first_item, q.segments, item);  // the item's segment
    const int k = q.segment[lo] >> 1;
    const bool update = q.segment[lo] & 1;
    const unsigned chunks = unsigned(t.first_chunk[k + 1] - t.first_chunk[k]);
    const int32_t chunk = q.first_chunk[lo] + item - q.first_item[lo];
    const int64_t begin = int64_t(chunk) * kChunk, end = min(begin + kChunk, t.size[k]);
    if (k != prev) c = a.consts(t.id[k]);
    prev = k;
    const int64_t offset = int64_t(t.first_chunk[k]) * kChunk;  // tensor k's d in d
    if (update) {
      if (threadIdx.x == 0) {
        while (*static_cast<volatile unsigned*>(done + k) <= chunks) __nanosleep(100);
        __threadfence();
        ratio_s = __ldcg(ratios + k);
      }
      __syncthreads();
      lamb_chunk_update<G, N>(c, static_cast<float*>(t.ptr[0][k]), d + offset,
                              static_cast<G*>(t.ptr[4][k]), begin, end, ratio_s);
      continue;
    }
    float2 s = block_sum(lamb_chunk_norms<G, N>(c, t, k, d + offset, begin, end));
    if (threadIdx.x == 0) {
      partials[t.first_chunk[k] + chunk] = s;
      __threadfence();  // the partial is visible before the count that announces it
      last_s = atomicAdd(done + k, 1u) == chunks - 1;
    }
    __syncthreads();
    if (!last_s) continue;
    __threadfence();
    s = make_float2(0.f, 0.f);
    for (int32_t j = t.first_chunk[k] + threadIdx.x; j < t.first_chunk[k + 1]; j += kThreads) {
      const float2 p = __ldcg(partials + j);
      s.x += p.x;
      s.y += p.y;
    }
    s = block_sum(s);
    if (threadIdx.x == 0) {
      ratios[k] = c.ratio(sqrtf(s.x), sqrtf(s.y));
      __threadfence();
      atomicAdd(done + k, 1u);  // chunks + 1: the ratio is out
    }
  }
}

// Fills q's segments: the norms of tensor 0, `lead` more norm items, the update of tensor 0;
// the rest of tensor 1's norms, `lead` more, the update of tensor 1; and so on. (GPT-2 small
// on an H100: a lead of one item a resident block ran at 64% of copy; none, 60%; a quarter,
// 63%; two, 63%. Chunks smaller than kChunk were slower.)
void queue_items(LambQueue& q, int32_t lead) {
  const Table<5>& t = q.t;
  q.segments = 0;
  int32_t item = 0;
  int nk = 0;          // the norm items queued so far: those of tensors < nk, and of tensor nk
  int32_t nchunk = 0;  // ... its chunks < nchunk
  auto add = [&](int k, int update, int32_t first, int32_t n) {
    if (n <= 0) return;
    q.first_item[q.segments] = item;
    q.first_chunk[q.segments] = first;
    q.segment[q.segments++] = 2 * k + update;
    item += n;
  };
  auto norms = [&](int32_t n) {  // n more norm items, or up to the end of tensor `n` if n < 0
    while (nk < t.count && n != 0) {
      const int32_t left = t.first_chunk[nk + 1] - t.first_chunk[nk] - nchunk;
      const int32_t take = n > 0 ? std::min(n, left) : left;
      add(nk, 0, nchunk, take);
      nchunk += take;
      if (n > 0) n -= take;
      if (nchunk == t.first_chunk[nk + 1] - t.first_chunk[nk]) {
        ++nk;
        nchunk = 0;
        if (n < 0) break;
      }
    }
  };
  for (int k = 0; k < t.count; ++k) {
    if (nk <= k) norms(-1);  // the rest of tensor k's norms
    norms(lead);
    add(k, 1, 0, t.first_chunk[k + 1] - t.first_chunk[k]);
  }
  q.first_item[q.segments] = item;
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
      t.id[t.count] = int32_t(i);
      t.first_chunk[t.count] = chunks;
      chunks += int32_t((n + kChunk - 1) / kChunk);
      ++t.count;
    }
    t.first_chunk[t.count] = chunks;
    launch(t, chunks, first);  // chunks == 0 only writes the flag
    first = false;
  }
}

ffi::Error adamw(cudaStream_t stream, ffi::AnyBuffer lr, ffi::AnyBuffer step,
                 ffi::AnyBuffer signal, ffi::RemainingArgs in, ffi::Result<ffi::AnyBuffer> flag,
                 ffi::RemainingRets out, int64_t count, float alpha, float beta, float eps,
                 float wd, int64_t correct_bias, int64_t mode) {
  const char* op = "adamw_optimizer";
  if (auto err = check_adamw(lr, step, signal, *flag, in, out, count, mode); !err.empty())
    return invalid(op, err);
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
    return cuda_error(op, e);
  const int result_list[] = {0, -1, 1, 2};
  auto ptrs = [&](int l, int64_t i) -> void* {
    if (l == 1) return in.get<ffi::AnyBuffer>(count + i)->untyped_data();
    return (*out.get<ffi::AnyBuffer>(result_list[l] * count + i))->untyped_data();
  };
  bool ok = dispatch_wg(wt, gt, [&](auto w_tag, auto g_tag) {
    using W = decltype(w_tag);
    using G = decltype(g_tag);
    for_groups<4>(count, in, ptrs, [&](const Table<4>& t, int32_t blocks, bool first) {
      constexpr int N = group_size(sizeof(W), sizeof(G));
      auto kernel = t.aligned() ? adamw_kernel<W, G, N> : adamw_kernel<W, G, 1>;
      kernel<<<std::max(blocks, 1), kThreads, 0, stream>>>(
          t, lr.reinterpret_data<float>(), step.untyped_data(), step.element_type() == ffi::DataType::S64,
          signal.reinterpret_data<bool>(), first ? flag->reinterpret_data<bool>() : nullptr,
          alpha, beta, eps, wd, correct_bias != 0, int(mode));
    });
  });
  if (!ok) return invalid(op, "unsupported weight/gradient dtypes");
  return launched(op);
}

ffi::Error sgd(cudaStream_t stream, ffi::AnyBuffer lr, ffi::AnyBuffer signal,
               ffi::RemainingArgs in, ffi::Result<ffi::AnyBuffer> flag, ffi::RemainingRets out,
               int64_t count) {
  const char* op = "sgd_optimizer_v2";
  if (auto err = check_sgd(lr, signal, *flag, in, out, count); !err.empty()) return invalid(op, err);
  const ffi::DataType wt = count ? in.get<ffi::AnyBuffer>(0)->element_type() : ffi::DataType::F32;
  const ffi::DataType gt = count ? in.get<ffi::AnyBuffer>(count)->element_type() : wt;
  for (int64_t i = 0; i < count; ++i)
    if ((*out.get<ffi::AnyBuffer>(i))->element_type() != wt)
      return invalid(op, "results must have the weights' dtype");
  const int lists[] = {0};
  if (cudaError_t e = copy_if_distinct(stream, in, out, count, lists, 1); e != cudaSuccess)
    return cuda_error(op, e);
  auto ptrs = [&](int l, int64_t i) -> void* {
    if (l == 1) return in.get<ffi::AnyBuffer>(count + i)->untyped_data();
    return (*out.get<ffi::AnyBuffer>(i))->untyped_data();
  };
  bool ok = dispatch_wg(wt, gt, [&](auto w_tag, auto g_tag) {
    using W = decltype(w_tag);
    using G = decltype(g_tag);
    for_groups<2>(count, in, ptrs, [&](const Table<2>& t, int32_t blocks, bool first) {
      constexpr int N = group_size(sizeof(W), sizeof(G));
      auto kernel = t.aligned() ? sgd_kernel<W, G, N> : sgd_kernel<W, G, 1>;
      kernel<<<std::max(blocks, 1), kThreads, 0, stream>>>(
          t, lr.reinterpret_data<float>(), signal.reinterpret_data<bool>(),
          first ? flag->reinterpret_data<bool>() : nullptr);
    });
  });
  if (!ok) return invalid(op, "unsupported weight/gradient dtypes");
  return launched(op);
}

ffi::Error lamb(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer signal,
                ffi::AnyBuffer loss_scale, ffi::AnyBuffer norm, ffi::AnyBuffer lr,
                ffi::AnyBuffer step, ffi::AnyBuffer hyper, ffi::RemainingArgs in,
                ffi::Result<ffi::AnyBuffer> new_step, ffi::RemainingRets out, int64_t count,
                float ratio_min, float ratio_max, int64_t correct, int64_t has_step,
                int64_t has_norm, int64_t new_gradients) {
  const char* op = "lamb_optimizer";
  const bool grads = new_gradients != 0;
  if (auto err = check_lamb(signal, loss_scale, norm, lr, step, *new_step, hyper, in, out, count,
                            grads);
      !err.empty())
    return invalid(op, err);
  const ffi::DataType gt = count ? in.get<ffi::AnyBuffer>(count)->element_type() : ffi::DataType::F32;
  if (gt == ffi::DataType::F64) return invalid(op, "gradients must be f32, f16 or bf16");
  const int all[] = {0, 1, 2, 3}, no_grads[] = {0, 2, 3};  // operand lists with a result list
  if (cudaError_t e = copy_if_distinct(stream, in, out, count, grads ? all : no_grads, grads ? 4 : 3);
      e != cudaSuccess)
    return cuda_error(op, e);
  int64_t chunks = 0;
  for (int64_t i = 0; i < count; ++i)
    chunks += (int64_t(in.get<ffi::AnyBuffer>(i)->element_count()) + kChunk - 1) / kChunk;
  const int64_t counters = count + count / kMaxTensors + 1;  // done per tensor, next per table
  auto d_mem = scratch.Allocate(sizeof(float) * kChunk * std::max<int64_t>(chunks, 1), 16);
  auto part_mem = scratch.Allocate(sizeof(float2) * std::max<int64_t>(chunks, 1), alignof(float2));
  auto ratio_mem = scratch.Allocate(sizeof(float) * std::max<int64_t>(count, 1), alignof(float));
  auto count_mem = scratch.Allocate(sizeof(unsigned) * counters, alignof(unsigned));
  if (!d_mem.has_value() || !part_mem.has_value() || !ratio_mem.has_value() ||
      !count_mem.has_value())
    return ffi::Error::Internal(std::string(op) + ": no scratch memory");
  unsigned* done = static_cast<unsigned*>(*count_mem);
  if (cudaError_t e = cudaMemsetAsync(done, 0, sizeof(unsigned) * counters, stream); e != cudaSuccess)
    return cuda_error(op, e);
  int dev = 0, sms = 0;
  if (cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return cuda_error(op, e);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  LambArgs a{signal.reinterpret_data<bool>(), loss_scale.reinterpret_data<float>(),
             norm.reinterpret_data<float>(), lr.reinterpret_data<float>(),
             hyper.reinterpret_data<float>(), step.untyped_data(),
             step.element_type() == ffi::DataType::S64, ratio_min, ratio_max, correct != 0,
             has_norm != 0, has_step != 0};
  auto ptrs = [&](int l, int64_t i) -> void* {
    if (l == 1) return in.get<ffi::AnyBuffer>(count + i)->untyped_data();
    const int64_t r = lamb_result_list(l == 4 ? 1 : l, grads);  // list 4: the new gradients
    return r < 0 ? nullptr : (*out.get<ffi::AnyBuffer>(r * count + i))->untyped_data();
  };
  bool ok = dispatch_float(gt, [&](auto g_tag) {
    using G = decltype(g_tag);
    if constexpr (!std::is_same_v<G, double>) {
      float* d = static_cast<float*>(*d_mem);
      float2* partials = static_cast<float2*>(*part_mem);
      float* ratios = static_cast<float*>(*ratio_mem);
      unsigned* next = done + count;
      LambQueue q;
      for_groups<5>(count, in, ptrs, [&](const Table<5>& t, int32_t blocks, bool first) {
        constexpr int N = group_size(sizeof(float), sizeof(G));
        auto kernel = t.aligned() ? lamb_kernel<G, N> : lamb_kernel<G, 1>;
        int per_sm = 1;
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0);
        const int64_t resident = int64_t(std::max(per_sm, 1)) * sms;
        const int grid = int(std::min<int64_t>(2 * int64_t(blocks), resident));
        q.t = t;
        queue_items(q, int32_t(resident));  // one item a resident block
        kernel<<<std::max(grid, 1), kThreads, 0, stream>>>(
            q, a, d, partials, ratios, done, next, first ? new_step->untyped_data() : nullptr,
            step.element_type() == ffi::DataType::S64);
        d += int64_t(blocks) * kChunk;  // each table's chunks, tensors and counter follow the
        partials += blocks;             // previous one's
        ratios += t.count;
        done += t.count;
        ++next;
      });
    }
  });
  if (!ok) return invalid(op, "gradients must be f32, f16 or bf16");
  return launched(op);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AdamWCuda, adamw,
                              bind_adamw(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(SgdV2Cuda, sgd,
                              bind_sgd(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    LambCuda, lamb,
    bind_lamb(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::ScratchAllocator>()));
JAXOPS_REGISTER("jaxops_adamw_optimizer", AdamWCuda);
JAXOPS_REGISTER("jaxops_lamb_optimizer", LambCuda);
JAXOPS_REGISTER("jaxops_sgd_optimizer_v2", SgdV2Cuda);

}  // namespace jaxops::optim
