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
#include <optional>
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
  // 16-byte accesses: a chunk starts a multiple of the chunk size (a multiple of 4) into its
  // tensor.
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

// Sum of v over the block (kThreads threads), returned to every thread. Calls alternate between
// two buffers (`flip` toggles), so one barrier a call is enough: a thread can only write a
// buffer again after the next call's barrier, which waits for every thread's reads.
__device__ __forceinline__ float2 block_sum(float2 v, bool& flip) {
  __shared__ float2 parts[2][kThreads / 32];
  float2* part = parts[flip];
  flip = !flip;
  for (int o = 16; o > 0; o >>= 1) {
    v.x += __shfl_xor_sync(0xffffffffu, v.x, o);
    v.y += __shfl_xor_sync(0xffffffffu, v.y, o);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
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

// LAMB's kept chunks: kLambChunk elements (one work item); a block keeps up to kLambSlots of
// them on chip. Spilled chunks are kChunk elements. GPT-2 small on an H100, GPU time a step
// (2 blocks an SM, bound by registers): 4096 x 3 slots, 75% of copy bandwidth; 2048 x 6, 64%
// (the work per item costs); 8192 x 1 or 4096 x 2, 66% (the 2.4M-element tensors spill); 1024
// x 12, 46%; every tensor spilled, 69%. More blocks an SM (fewer registers) spilled registers
// and ran slower.
constexpr int64_t kLambChunk = 4096;
constexpr int kLambSlots = 3;
enum LambItem { kSpilledNorms, kSpilledUpdate, kKeptNorms };

// LAMB's work queue over one Table (lists: 0 weights, 1 gradients (in), 2 m1, 3 m2, 4 new
// gradients or null). Items are chunks, taken in order from a global counter. A norm item reads
// w, g, m1, m2, writes the new moments (final: they do not depend on the trust ratio) and its
// share of the tensor's sums of w^2 and d^2 (d: the update direction). The update,
// w -= ratio * d, needs the whole tensor's sums first. Two ways:
// - kept: the block keeps the chunk's w and d in a shared-memory slot and writes w once the
//   tensor's last chunk is summed: 7 accesses an element, the least there can be. A block
//   takes its next item while working on one if a slot is left for it; with every slot full
//   it waits for its oldest.
// - spilled (a tensor of more chunks than all blocks' slots hold): d goes to scratch, and an
//   update item, queued after the tensor's norms and `lead` more norm items, reads w and d
//   back: 10 accesses an element.
// Nothing waits for an item that is not yet taken, except a full block for its oldest slot's
// tensor; every chunk of that tensor fits in the slots of the blocks once they all are
// resident, so the queue always moves on. Whoever needs a tensor's ratio sums its partials
// in one fixed order: results are deterministic.
struct LambQueue {
  Table<5> t;
  int32_t first_item[3 * kMaxTensors + 1];  // prefix sums of the segments' items
  int32_t first_chunk[3 * kMaxTensors];     // the segment's first chunk in its tensor
  int32_t segment[3 * kMaxTensors];         // 4 * tensor + LambItem
  int64_t spill_first[kMaxTensors];         // where a spilled tensor's d starts in scratch
  int32_t chunk[kMaxTensors];               // the tensor's elements a chunk
  int32_t segments;
};

// This thread's share of the sums of w^2 and d^2 over [begin, end) of tensor k. It writes the
// new moments, and d (and w, when w_keep is not null) at [i - base].
template <typename G, int N>
__device__ __forceinline__ float2 lamb_chunk_norms(const Lamb<float>& c, const Table<5>& t, int k,
                                                   float* d_out, float* w_keep, int64_t base,
                                                   int64_t begin, int64_t end) {
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
        store_n<decltype(n)::value>(d_out, i - base, gv[u]);
        if (w_keep != nullptr) store_n<decltype(n)::value>(w_keep, i - base, wv[u]);
        store_n<decltype(n)::value>(m1, i, n1[u]);
        store_n<decltype(n)::value>(m2, i, n2[u]);
      });
  return s;
}

// The update of [begin, end) of w by the trust ratio, from w and d at [i - base] of w_in, d_in.
template <typename G, int N>
__device__ __forceinline__ void lamb_chunk_update(const Lamb<float>& c, float* w, const float* w_in,
                                                  const float* d_in, G* g_out, int64_t base,
                                                  int64_t begin, int64_t end, float ratio) {
  float wv[kUnroll][N], dv[kUnroll][N];
  for_chunk<N>(
      begin, end,
      [&](auto n, int64_t i, int u) {
        load_n<decltype(n)::value>(w_in, i - base, wv[u]);
        load_n<decltype(n)::value>(d_in, i - base, dv[u]);
      },
      [&](auto n, int64_t i, int u) {
#pragma unroll
        for (int j = 0; j < decltype(n)::value; ++j) dv[u][j] = c.apply(wv[u][j], dv[u][j], ratio);
        if (g_out != nullptr) store_n<decltype(n)::value>(g_out, i, dv[u]);
        store_n<decltype(n)::value>(w, i, wv[u]);
      });
}

// A chunk's partial sums before they are written (memset bytes 0xff: a NaN that no sum gives,
// since sums are written with NaN made canonical).
constexpr unsigned kUnsummed = 0xffffffffu;

// d: the spilled chunks' directions; partials: one per chunk (kUnsummed at first); done: one
// per tensor of the table, counting its summed chunks (a hint: a kept chunk's count may land
// before its partial); next: the queue's counter. done and next start at 0. Dynamic shared
// memory: kLambSlots slots of w then d, kLambChunk floats each.
template <typename G, int N>
__global__ void __launch_bounds__(kThreads)
lamb_kernel(const __grid_constant__ LambQueue q, LambArgs a, float* d, float2* partials,
            unsigned* done, unsigned* next, void* new_step, bool new_step64) {
  if (blockIdx.x == 0 && threadIdx.x == 0 && new_step != nullptr) {
    const int64_t s = a.step_value() + ((*a.signal && a.has_step) ? 1 : 0);
    if (new_step64) *static_cast<int64_t*>(new_step) = s;
    else *static_cast<int32_t*>(new_step) = int32_t(s);
  }
  if (!*a.signal) return;
  extern __shared__ float4 slot_mem[];
  const Table<5>& t = q.t;
  const int32_t items = q.first_item[q.segments];
  // Thread 0's word to the block; item and ready alternate between two copies by iteration, so
  // thread 0 can write the next one while slower threads read the last.
  __shared__ int32_t claim_s, item_s[2];
  __shared__ bool ready_s[2];
  int parity = 0;
  // Block-uniform state: the held slots (a ring from `head`), the last tensor's constants, the
  // last ratio summed, the next item when taken ahead (else -1), whether the oldest slot's
  // tensor was summed when last looked.
  int held_k[kLambSlots];
  int32_t held_chunk[kLambSlots];
  int head = 0, held = 0, prev = -1, ratio_k = -1;
  float ratio = 0.f;
  int32_t item = -1;
  bool oldest_ready = false, flip = false;
  Lamb<float> c{};
  auto chunks = [&](int k) { return unsigned(t.first_chunk[k + 1] - t.first_chunk[k]); };
  auto slot = [&](int s) { return reinterpret_cast<float*>(slot_mem) + 2 * kLambChunk * s; };
  auto range = [&](int k, int32_t chunk, int64_t* begin, int64_t* end) {
    *begin = int64_t(chunk) * q.chunk[k];
    *end = min(*begin + q.chunk[k], t.size[k]);
  };
  auto ratio_of = [&](int k) {  // waits for tensor k's partials, then sums them in one order
    if (k == ratio_k) return ratio;
    if (threadIdx.x == 0)
      while (*static_cast<volatile unsigned*>(done + k) < chunks(k)) __nanosleep(64);
    __syncthreads();
    float2 s = make_float2(0.f, 0.f);
    for (int32_t j = t.first_chunk[k] + threadIdx.x; j < t.first_chunk[k + 1]; j += kThreads) {
      float2 p;
      do p = __ldcv(partials + j); while (__float_as_uint(p.y) == kUnsummed);
      s.x += p.x;
      s.y += p.y;
    }
    __threadfence();  // a spilled tensor's d, written before its partials, is read after them
    s = block_sum(s, flip);
    ratio_k = k;
    ratio = a.consts(t.id[k]).ratio(sqrtf(s.x), sqrtf(s.y));
    return ratio;
  };
  auto flush_oldest = [&]() {
    const int k = held_k[head];
    int64_t begin, end;
    range(k, held_chunk[head], &begin, &end);
    const float r = ratio_of(k);
    // Each thread reads back the slot elements it wrote: no barrier needed.
    lamb_chunk_update<G, N>(c, static_cast<float*>(t.ptr[0][k]), slot(head),
                            slot(head) + kLambChunk, static_cast<G*>(t.ptr[4][k]), begin, begin,
                            end, r);
    head = head + 1 == kLambSlots ? 0 : head + 1;
    --held;
    oldest_ready = false;
  };
  for (;;) {
    // Flush the oldest slot once its tensor is summed, or when a new item needs its slot.
    if (held > 0 && (oldest_ready || (held == kLambSlots && item < 0))) flush_oldest();
    if (item < 0) {
      __syncthreads();  // every thread is done with the previous item's shared values
      if (threadIdx.x == 0) claim_s = int32_t(atomicAdd(next, 1u));
      __syncthreads();
      item = claim_s;
    }
    if (item >= items) break;
    const int lo = last_at_or_before(q.first_item, q.segments, item);  // the item's segment
    const int k = q.segment[lo] >> 2;
    const int kind = q.segment[lo] & 3;
    const int32_t chunk = q.first_chunk[lo] + item - q.first_item[lo];
    int64_t begin, end;
    range(k, chunk, &begin, &end);
    if (k != prev) c = a.consts(t.id[k]);
    prev = k;
    float* kept = nullptr;  // the slot for w, then d
    if (kind == kKeptNorms) {
      const int free = head + held >= kLambSlots ? head + held - kLambSlots : head + held;
      kept = slot(free);
      held_k[free] = k;
      held_chunk[free] = chunk;
      ++held;
    }
    // Take the next item now, its wait hidden behind this one, if a slot is left for it; and
    // look whether the oldest slot's tensor is summed.
    const bool ahead = held < kLambSlots;
    unsigned next_item = 0, oldest_done = 0;
    if (threadIdx.x == 0) {
      if (ahead) next_item = atomicAdd(next, 1u);
      if (held > 0) oldest_done = *static_cast<volatile unsigned*>(done + held_k[head]);
    }
    auto tell = [&]() {  // the block learns these at its next barrier
      if (threadIdx.x == 0) {
        item_s[parity] = ahead ? int32_t(next_item) : -1;
        ready_s[parity] = held > 0 && oldest_done >= chunks(held_k[head]);
      }
    };
    float* spilled = d + q.spill_first[k];  // tensor k's d, if spilled
    if (kind == kSpilledUpdate) {
      const float r = ratio_of(k);
      float* w = static_cast<float*>(t.ptr[0][k]);
      lamb_chunk_update<G, N>(c, w, w, spilled, static_cast<G*>(t.ptr[4][k]), 0, begin, end, r);
      tell();
      __syncthreads();
    } else {
      const float2 part =
          kept ? lamb_chunk_norms<G, N>(c, t, k, kept + kLambChunk, kept, begin, begin, end)
               : lamb_chunk_norms<G, N>(c, t, k, spilled, nullptr, 0, begin, end);
      tell();
      float2 s = block_sum(part, flip);
      if (threadIdx.x == 0) {
        if (s.x != s.x) s.x = __int_as_float(0x7fffffff);  // never kUnsummed
        if (s.y != s.y) s.y = __int_as_float(0x7fffffff);
        if (!kept) __threadfence();  // d is visible before the partial that announces it
        __stcg(partials + t.first_chunk[k] + chunk, s);
        atomicAdd(done + k, 1u);
      }
    }
    item = item_s[parity];
    oldest_ready = ready_s[parity];
    parity ^= 1;
  }
  while (held > 0) flush_oldest();
}

// Fills q's segments, tensor by tensor: a kept tensor's norms; a spilled tensor's norms, `lead`
// more norm items (of the next tensors), then its update. Needs q.t and q.chunk. (GPT-2 small on an H100, all tensors
// spilled: a lead of one item a resident block ran at 64% of copy; none, 60%.)
int64_t queue_items(LambQueue& q, int32_t lead) {
  const Table<5>& t = q.t;
  auto kept = [&](int k) { return q.chunk[k] == kLambChunk; };
  q.segments = 0;
  int32_t item = 0;
  int64_t spilled = 0;
  int nk = 0;          // the norm items queued so far: those of tensors < nk, and of tensor nk
  int32_t nchunk = 0;  // ... its chunks < nchunk
  auto chunks = [&](int k) { return t.first_chunk[k + 1] - t.first_chunk[k]; };
  auto add = [&](int k, int kind, int32_t first, int32_t n) {
    if (n <= 0) return;
    q.first_item[q.segments] = item;
    q.first_chunk[q.segments] = first;
    q.segment[q.segments++] = 4 * k + kind;
    item += n;
  };
  auto norms = [&](int32_t n) {  // n more norm items, or up to the end of tensor `n` if n < 0
    while (nk < t.count && n != 0) {
      const int32_t left = chunks(nk) - nchunk;
      const int32_t take = n > 0 ? std::min(n, left) : left;
      add(nk, kept(nk) ? kKeptNorms : kSpilledNorms, nchunk, take);
      nchunk += take;
      if (n > 0) n -= take;
      if (nchunk == chunks(nk)) {
        ++nk;
        nchunk = 0;
        if (n < 0) break;
      }
    }
  };
  for (int k = 0; k < t.count; ++k) {
    q.spill_first[k] = spilled;
    if (nk <= k) norms(-1);  // the rest of tensor k's norms
    if (kept(k)) continue;
    spilled += int64_t(chunks(k)) * q.chunk[k];
    norms(lead);
    add(k, kSpilledUpdate, 0, chunks(k));
  }
  q.first_item[q.segments] = item;
  return spilled;  // scratch d's floats
}

int64_t fixed_chunk(int64_t) { return kChunk; }

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
// tensors, a tensor of n elements in chunks of chunk(n) elements (a multiple of 4). ptrs(l, i)
// gives list l's pointer for tensor i (the results for updated lists).
template <int Lists, typename Ptr, typename Chunk, typename Launch>
void for_groups(int64_t count, const ffi::RemainingArgs& in, Ptr ptrs, Chunk chunk,
                Launch launch) {
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
      chunks += int32_t((n + chunk(n) - 1) / chunk(n));
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
    for_groups<4>(count, in, ptrs, fixed_chunk, [&](const Table<4>& t, int32_t blocks, bool first) {
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
    for_groups<2>(count, in, ptrs, fixed_chunk, [&](const Table<2>& t, int32_t blocks, bool first) {
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
  const int all[] = {0, 1, 2, 3}, no_grads[] = {0, 2, 3};  // operand lists with a result list
  if (cudaError_t e = copy_if_distinct(stream, in, out, count, grads ? all : no_grads, grads ? 4 : 3);
      e != cudaSuccess)
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
  constexpr int smem = int(sizeof(float)) * 2 * kLambChunk * kLambSlots;
  std::optional<ffi::Error> failed;
  bool ok = dispatch_float(gt, [&](auto g_tag) {
    using G = decltype(g_tag);
    if constexpr (!std::is_same_v<G, double>) {
      constexpr int N = group_size(sizeof(float), sizeof(G));
      auto pick = [](bool aligned) { return aligned ? lamb_kernel<G, N> : lamb_kernel<G, 1>; };
      cudaError_t e = cudaSuccess;
      for (auto kernel : {pick(true), pick(false)})
        if (e == cudaSuccess)
          e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      int per_sm = 1;
      if (e == cudaSuccess)
        e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, pick(true), kThreads, smem);
      if (e != cudaSuccess) return void(failed = cuda_error(op, e));
      const int64_t resident = int64_t(std::max(per_sm, 1)) * sms;
      // A tensor is kept if its chunks fit in all blocks' slots.
      auto chunk_of = [&](int64_t n) {
        return (n + kLambChunk - 1) / kLambChunk <= resident * kLambSlots ? kLambChunk : kChunk;
      };
      int64_t chunks = 0, spilled = 0;
      for (int64_t i = 0; i < count; ++i) {
        const int64_t n = int64_t(in.get<ffi::AnyBuffer>(i)->element_count()), c = chunk_of(n);
        chunks += (n + c - 1) / c;
        spilled += c == kChunk ? (n + c - 1) / c * c : 0;
      }
      const int64_t counters = count + count / kMaxTensors + 1;  // done per tensor, next per table
      auto d_mem = scratch.Allocate(sizeof(float) * std::max<int64_t>(spilled, 1), 16);
      auto part_mem = scratch.Allocate(sizeof(float2) * std::max<int64_t>(chunks, 1), alignof(float2));
      auto count_mem = scratch.Allocate(sizeof(unsigned) * counters, alignof(unsigned));
      if (!d_mem.has_value() || !part_mem.has_value() || !count_mem.has_value())
        return void(failed = ffi::Error::Internal(std::string(op) + ": no scratch memory"));
      unsigned* done = static_cast<unsigned*>(*count_mem);
      e = cudaMemsetAsync(done, 0, sizeof(unsigned) * counters, stream);
      if (e == cudaSuccess)  // kUnsummed
        e = cudaMemsetAsync(*part_mem, 0xff, sizeof(float2) * std::max<int64_t>(chunks, 1), stream);
      if (e != cudaSuccess) return void(failed = cuda_error(op, e));
      float* d = static_cast<float*>(*d_mem);
      float2* partials = static_cast<float2*>(*part_mem);
      unsigned* next = done + count;
      LambQueue q;
      for_groups<5>(count, in, ptrs, chunk_of, [&](const Table<5>& t, int32_t blocks, bool first) {
        q.t = t;
        for (int k = 0; k < t.count; ++k) q.chunk[k] = int32_t(chunk_of(t.size[k]));
        const int64_t spilled_here = queue_items(q, int32_t(resident));  // lead: an item a block
        const int grid = int(std::min<int64_t>(2 * int64_t(blocks), resident));
        pick(t.aligned())<<<std::max(grid, 1), kThreads, smem, stream>>>(
            q, a, d, partials, done, next, first ? new_step->untyped_data() : nullptr,
            step.element_type() == ffi::DataType::S64);
        d += spilled_here;  // each table's scratch and counters follow the last's
        partials += blocks;
        done += t.count;
        ++next;
      });
    }
  });
  if (failed) return *failed;
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

void register_handlers(Registry& r) {
  r.add("jaxops_adamw_optimizer", AdamWCuda);
  r.add("jaxops_lamb_optimizer", LambCuda);
  r.add("jaxops_sgd_optimizer_v2", SgdV2Cuda);
}

}  // namespace jaxops::optim
