// CUDA handlers of SoftmaxGrad(_13) and LogSoftmaxGrad(_13), with the semantics of
// ffi/cpu/softmax.cc. Both reduce over n of the [outer, n, inner] view (softmax.h).
//
// The ops are memory bound, so every kernel aims to read dY and Y once and write dX once:
//   row_reg_kernel   rows held in registers: inner == 1 with n up to 16K (f32), 8K (f16, bf16,
//                    f64), and tiny strided columns (inner > 1 with small n and inner). 1 to 512
//                    threads a row, 16-byte accesses when rows are aligned.
//   row_smem_kernel  longer rows (inner == 1): each block caches its span of a row in shared
//                    memory between the sum and the write. On sm_90 a cluster of blocks splits
//                    a row so that enough of it fits, adding the partial sums through DSMEM.
//   col_kernel       inner > 1: threads along inner (coalesced), thread rows split n; the
//                    per-column sums are reduced by warp shuffles, in shared memory and
//                    across the cluster. The slab is cached the same way, in shared memory
//                    and, when a block has an SM to itself, in registers.
// What does not fit in shared memory is read a second time right after the first read, so
// it mostly comes from L2.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <climits>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "jaxops/checks.h"
#include "jaxops/cuda_elem.cuh"
#include "jaxops/cuda_launch.h"
#include "jaxops/registry.h"
#include "jaxops/softmax.h"

namespace jaxops::softmax {
namespace {

namespace cg = cooperative_groups;

// ---------------------------------------------------------------------------------------------
// Arithmetic helpers

template <typename I> constexpr JAXOPS_HD I imin(I a, I b) { return a < b ? a : b; }
template <typename I> constexpr JAXOPS_HD I imax(I a, I b) { return a < b ? b : a; }
JAXOPS_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
JAXOPS_HD int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }
JAXOPS_HD int64_t round_down(int64_t a, int64_t b) { return a / b * b; }

// LogSoftmaxGrad's sum reads only dY: its Y is needed only when writing dX.
template <class Math> constexpr bool kSumReadsY = !std::is_same_v<Math, LogSoftmaxGrad>;

// row_smem_kernel's clusters: 1 / kRowCacheShare of each block's span must fit in shared memory,
// the rest is re-read from L2. Measured on an H100 at [4096,50304]: SoftmaxGrad caching half
// a row in one block beats a pair of blocks caching all of it (bf16 454 against 533 us, f32
// 906 against 1016 us); LogSoftmaxGrad, caching dY alone, is faster all cached (f32 880 against
// 906 us).
template <class Math> constexpr int kRowCacheShare = kSumReadsY<Math> ? 2 : 1;

// ---------------------------------------------------------------------------------------------
// 16-byte memory accesses (element conversions: jaxops/cuda_elem.cuh)

template <int Bytes> struct Word;
template <> struct Word<2> { using type = unsigned short; };
template <> struct Word<4> { using type = unsigned int; };
template <> struct Word<8> { using type = uint2; };
template <> struct Word<16> { using type = uint4; };
template <typename T, int V> using word_t = typename Word<sizeof(T) * V>::type;

template <typename To, typename From>
__device__ __forceinline__ To bits_as(const From& f) {
  static_assert(sizeof(To) == sizeof(From));
  To t;
  memcpy(&t, &f, sizeof(To));
  return t;
}

// Global loads. kOnce: the last read of this data (ld.global.cs, evict first), so it does not
// push out of L2 what is read again; data read again later goes through the read-only path.
template <int V, bool kOnce, typename T>
__device__ __forceinline__ Pack<T, V> ldg(const T* p) {
  const auto* q = reinterpret_cast<const word_t<T, V>*>(p);
  if constexpr (kOnce) return bits_as<Pack<T, V>>(__ldcs(q));
  else return bits_as<Pack<T, V>>(__ldg(q));
}
// dX is never read back: streaming stores.
template <int V, typename T>
__device__ __forceinline__ void stg(T* p, const Pack<T, V>& v) {
  __stcs(reinterpret_cast<word_t<T, V>*>(p), bits_as<word_t<T, V>>(v));
}
// Shared-memory accesses of one pack, spelled out in PTX: through the generic pointers of the
// loops below the compiler splits them or falls back to generic loads. volatile keeps them
// in program order, which is all the per-thread cache needs.
template <int V, typename T>
__device__ __forceinline__ void sts(T* p, const Pack<T, V>& v) {
  const unsigned a = unsigned(__cvta_generic_to_shared(p));
  const auto w = bits_as<word_t<T, V>>(v);
  if constexpr (sizeof(w) == 16)
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};"
                 ::"r"(a), "r"(w.x), "r"(w.y), "r"(w.z), "r"(w.w));
  else if constexpr (sizeof(w) == 8)
    asm volatile("st.shared.v2.u32 [%0], {%1, %2};" ::"r"(a), "r"(w.x), "r"(w.y));
  else if constexpr (sizeof(w) == 4)
    asm volatile("st.shared.u32 [%0], %1;" ::"r"(a), "r"(w));
  else
    asm volatile("st.shared.u16 [%0], %1;" ::"r"(a), "h"(w));
}
template <int V, typename T>
__device__ __forceinline__ Pack<T, V> lds(const T* p) {
  const unsigned a = unsigned(__cvta_generic_to_shared(p));
  word_t<T, V> w;
  if constexpr (sizeof(w) == 16)
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w) : "r"(a));
  else if constexpr (sizeof(w) == 8)
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(w.x), "=r"(w.y) : "r"(a));
  else if constexpr (sizeof(w) == 4)
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(w) : "r"(a));
  else
    asm volatile("ld.shared.u16 %0, [%1];" : "=h"(w) : "r"(a));
  return bits_as<Pack<T, V>>(w);
}

// V elements of dY and Y.
template <typename T, int V>
struct Item { Pack<T, V> d, y; };

// An item as the raw words it was loaded as: the form col_kernel's register cache keeps, four
// registers for 8 bf16 (unpacked, they may take one register each). opaque() hides the words
// from the optimizer, so that it converts them again in the second pass rather than keeping the
// converted values (twice the registers for 16-bit types) from the first.
template <typename T, int V>
struct RawItem {
  word_t<T, V> d, y;
  __device__ static RawItem of(const Item<T, V>& it) {
    return {bits_as<word_t<T, V>>(it.d), bits_as<word_t<T, V>>(it.y)};
  }
  __device__ Item<T, V> item() const { return {bits_as<Pack<T, V>>(d), bits_as<Pack<T, V>>(y)}; }
};

__device__ __forceinline__ void opaque(unsigned short& w) { asm volatile("" : "+h"(w)); }
__device__ __forceinline__ void opaque(unsigned& w) { asm volatile("" : "+r"(w)); }
__device__ __forceinline__ void opaque(uint2& w) { asm volatile("" : "+r"(w.x), "+r"(w.y)); }
__device__ __forceinline__ void opaque(uint4& w) {
  asm volatile("" : "+r"(w.x), "+r"(w.y), "+r"(w.z), "+r"(w.w));
}

template <int V, bool kOnce, bool kY, typename T>
__device__ __forceinline__ Item<T, V> load_item(const T* dy, const T* y, int64_t i) {
  Item<T, V> it{};
  it.d = ldg<V, kOnce>(dy + i);
  if constexpr (kY) it.y = ldg<V, kOnce>(y + i);
  return it;
}

// The sum's contribution of an item: one sum (rows) or one sum per element (columns).
template <class Math, typename T, int V>
__device__ __forceinline__ acc_t<T> item_term(const Item<T, V>& it) {
  acc_t<T> s = 0;
#pragma unroll
  for (int i = 0; i < V; ++i) s += Math::term(to_acc(it.d.v[i]), to_acc(it.y.v[i]));
  return s;
}
template <class Math, typename T, int V>
__device__ __forceinline__ void add_terms(acc_t<T> (&s)[V], const Item<T, V>& it) {
#pragma unroll
  for (int i = 0; i < V; ++i) s[i] += Math::term(to_acc(it.d.v[i]), to_acc(it.y.v[i]));
}

// dX of an item, from the row's sum or from one sum per element.
template <class Math, typename T, int V>
__device__ __forceinline__ Pack<T, V> item_out(const Item<T, V>& it, acc_t<T> s) {
  Pack<T, V> o;
#pragma unroll
  for (int i = 0; i < V; ++i)
    o.v[i] = from_acc<T>(Math::out(to_acc(it.d.v[i]), to_acc(it.y.v[i]), s));
  return o;
}
template <class Math, typename T, int V>
__device__ __forceinline__ Pack<T, V> item_out(const Item<T, V>& it, const acc_t<T> (&s)[V]) {
  Pack<T, V> o;
#pragma unroll
  for (int i = 0; i < V; ++i)
    o.v[i] = from_acc<T>(Math::out(to_acc(it.d.v[i]), to_acc(it.y.v[i]), s[i]));
  return o;
}

// ---------------------------------------------------------------------------------------------
// Loops and reductions

// Visits first, first + step, ... < end. The main loop issues U loads before using any, so
// each thread keeps several requests in flight.
template <int U, class Fetch, class Apply>
__device__ __forceinline__ void strided(int64_t first, int64_t end, int64_t step, Fetch&& fetch,
                                        Apply&& apply) {
  int64_t i = first;
  for (; i + (U - 1) * step < end; i += U * step) {
    decltype(fetch(i)) item[U];
#pragma unroll
    for (int u = 0; u < U; ++u) item[u] = fetch(i + u * step);
#pragma unroll
    for (int u = 0; u < U; ++u) apply(i + u * step, item[u]);
  }
  for (; i < end; i += step) apply(i, fetch(i));
}

// Visits the elements [lo, hi) with the block's threads: V-wide packs from the first V-aligned
// index on, single elements for the unaligned head and tail. fetch(width, i) and
// apply(width, i, item) take the width as a std::integral_constant.
template <int V, int U, class Fetch, class Apply>
__device__ __forceinline__ void visit(int64_t lo, int64_t hi, Fetch&& fetch, Apply&& apply) {
  using One = std::integral_constant<int, 1>;
  using Vec = std::integral_constant<int, V>;
  const int64_t tid = threadIdx.x, nthreads = blockDim.x;
  const int64_t a = imin(hi, round_up(lo, V)), b = imax(a, round_down(hi, V));
  if (tid < a - lo) apply(One{}, lo + tid, fetch(One{}, lo + tid));
  if (tid < hi - b) apply(One{}, b + tid, fetch(One{}, b + tid));
  strided<U>(a + tid * V, b, nthreads * V, [&](int64_t i) { return fetch(Vec{}, i); },
             [&](int64_t i, const auto& item) { apply(Vec{}, i, item); });
}

// Loads in flight a thread: more when they are scalar, fewer for f64 (exp(double) needs registers).
template <typename T, int V> constexpr int kUnroll = sizeof(T) == 8 ? 2 : V == 1 ? 8 : 4;

// Sum over aligned groups of `width` lanes (a power of two <= 32).
template <typename A>
__device__ __forceinline__ A warp_sum(A s, int width) {
  for (int off = width / 2; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
  return s;
}

// Sum over a 1-D block of a multiple of 32 threads; every thread gets the total.
template <typename A>
__device__ __forceinline__ A block_sum(A s, A* buf /* [32] */) {
  s = warp_sum(s, 32);
  if (threadIdx.x % 32 == 0) buf[threadIdx.x / 32] = s;
  __syncthreads();
  A t = 0;
  for (int w = 0; w < int(blockDim.x / 32); ++w) t += buf[w];
  __syncthreads();  // buf is free again on return
  return t;
}

// ---------------------------------------------------------------------------------------------
// Kernels

// Rows held in registers. blockDim.x threads share a row: a power of two up to 32 (blockDim.y
// rows a block, several a warp) or a multiple of 32 (one row a block). Thread x holds packs
// x, x + blockDim.x, ... (PPT of them), so each input is read exactly once.
// With inner > 1 (V == 1 only) row r is the strided column (r / inner, :, r % inner).
//
// Registers a thread's row takes once converted to acc_t (both inputs; the compiler keeps the
// converted values between the passes). kRegMaxData bounds it, which sets the longest rows;
// f64 LogSoftmaxGrad keeps room for exp(double).
template <typename T, int V, int PPT>
constexpr int kRegData = 2 * PPT * V * int(sizeof(acc_t<T>)) / 4;
template <class Math, typename T>
constexpr int kRegMaxData = std::is_same_v<T, double> && !kSumReadsY<Math> ? 32 : 64;
// Threads a block at most (see pick_reg_config): 128 for rows of up to 32 packs (several rows
// a block), up to 512 for longer rows (one row a block).
template <int PPT> constexpr int kRegThreads = PPT == 1 ? 128 : 512;
// Blocks an SM to allow: the register cap (64K / threads / blocks) stays above the data plus
// the rest (addresses of PPT packs, loop state).
template <typename T, int V, int PPT>
constexpr int kRegMinBlocks =
    imax(1, imin(8, 65536 / (kRegThreads<PPT> * (kRegData<T, V, PPT> + 48 + 4 * PPT))));

template <class Math, typename T, int V, int PPT>
__global__ void __launch_bounds__(kRegThreads<PPT>, (kRegMinBlocks<T, V, PPT>))
row_reg_kernel(const T* __restrict__ dy, const T* __restrict__ y, T* __restrict__ dx,
               int64_t rows, int64_t n, int64_t inner) {
  using A = acc_t<T>;
  __shared__ A buf[32];
  const int tpr = blockDim.x, x = threadIdx.x;
  const int64_t npacks = n / V, step = V * inner;  // step: elements from one pack to the next
  // The loop condition is uniform over the block: shuffles and barriers see every thread.
  for (int64_t row0 = int64_t(blockIdx.x) * blockDim.y; row0 < rows;
       row0 += int64_t(gridDim.x) * blockDim.y) {
    const int64_t row = row0 + threadIdx.y;
    const bool live = row < rows;
    const int64_t o = inner == 1 ? row : row / inner;
    const int64_t base = o * n * inner + (row - o * inner);
    // Every slot loads (element 0 stands in for slots past the row) so that all the loads
    // are issued before the first use; the stand-ins are zeroed, adding nothing to the sum.
    // Read once, yet through the read-only path rather than evict-first: 1% faster on an
    // H100 at [8192,4096] (f32 138.3 -> 136.5 us, bf16 71.2 -> 70.2 us, LogSoftmaxGrad).
    Item<T, V> it[PPT];
#pragma unroll
    for (int j = 0; j < PPT; ++j) {
      const int64_t k = x + int64_t(j) * tpr;
      const bool ok = live && k < npacks;
      it[j] = load_item<V, false, true>(dy, y, ok ? base + k * step : 0);
      if (!ok) it[j] = Item<T, V>{};
    }
    A s = 0;
#pragma unroll
    for (int j = 0; j < PPT; ++j) s += item_term<Math>(it[j]);
    s = tpr > 32 ? block_sum(s, buf) : warp_sum(s, tpr);
#pragma unroll
    for (int j = 0; j < PPT; ++j) {
      const int64_t k = x + int64_t(j) * tpr;
      if (live && k < npacks) stg<V>(dx + base + k * step, item_out<Math>(it[j], s));
    }
  }
}

constexpr int kSmemThreads = 512;  // threads a block of row_smem_kernel and col_kernel
constexpr int kMaxCluster = 8;     // the portable cluster size

// Long rows (inner == 1). A cluster of csize blocks (consecutive blockIdx.x) shares a row; the
// block of rank r owns elements [r * seg, (r + 1) * seg) of it and caches the first `cap`
// elements from its span's V-aligned start in dynamic shared memory. Each thread reads back
// only what it cached itself, so the cache needs no barriers.
template <class Math, typename T, int V>
__global__ void __launch_bounds__(kSmemThreads, 2)
row_smem_kernel(const T* __restrict__ dy, const T* __restrict__ y, T* __restrict__ dx,
                int64_t rows, int64_t n, int csize, int64_t seg, int64_t cap) {
  using A = acc_t<T>;
  constexpr bool kY = kSumReadsY<Math>;
  constexpr int U = kUnroll<T, V>;
  extern __shared__ __align__(16) unsigned char smem[];
  T* const cdy = reinterpret_cast<T*>(smem);
  T* const cy = cdy + cap;  // softmax only
  __shared__ A buf[32];
  __shared__ A part;  // this block's partial sum, read by the cluster
  const int rank = blockIdx.x % csize;
  for (int64_t row = blockIdx.x / csize; row < rows; row += gridDim.x / csize) {
    const int64_t g0 = row * n + imin(n, rank * seg), g1 = row * n + imin(n, (rank + 1) * seg);
    const int64_t base = round_down(g0, V);             // element `base` is at cdy[0]
    const int64_t gc = imax(g0, imin(g1, base + cap));  // [g0, gc) is cached

    // Pass 1: the sum. The cached span is read from global memory once; the rest is read
    // again in pass 2, so it is loaded so as to stay in L2.
    A s = 0;
    visit<V, U>(
        g0, gc,
        [&](auto w, int64_t i) { return load_item<decltype(w)::value, true, kY>(dy, y, i); },
        [&](auto w, int64_t i, const auto& it) {
          constexpr int W = decltype(w)::value;
          sts<W>(cdy + (i - base), it.d);
          if constexpr (kY) sts<W>(cy + (i - base), it.y);
          s += item_term<Math>(it);
        });
    visit<V, U>(
        gc, g1,
        [&](auto w, int64_t i) { return load_item<decltype(w)::value, false, kY>(dy, y, i); },
        [&](auto, int64_t, const auto& it) { s += item_term<Math>(it); });

    s = block_sum(s, buf);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (csize > 1) {
      cg::cluster_group cluster = cg::this_cluster();
      if (threadIdx.x == 0) part = s;
      cluster.sync();  // every block's part is written
      s = 0;
      for (int r = 0; r < csize; ++r)  // the same order in every block
        s += *cluster.map_shared_rank(&part, r);
      cluster.sync();  // no block rewrites part (next row) or exits while others read it
    }
#endif

    // Pass 2: dX, the uncached span first, while it is the most recently read.
    visit<V, U>(
        gc, g1,
        [&](auto w, int64_t i) { return load_item<decltype(w)::value, true, true>(dy, y, i); },
        [&](auto w, int64_t i, const auto& it) {
          stg<decltype(w)::value>(dx + i, item_out<Math>(it, s));
        });
    visit<V, U>(
        g0, gc,
        [&](auto w, int64_t i) {
          constexpr int W = decltype(w)::value;
          Item<T, W> it;
          it.d = lds<W>(cdy + (i - base));
          if constexpr (kY) it.y = lds<W>(cy + (i - base));
          else it.y = ldg<W, true>(y + i);
          return it;
        },
        [&](auto w, int64_t i, const auto& it) {
          stg<decltype(w)::value>(dx + i, item_out<Math>(it, s));
        });
  }
}

// col_kernel's thread rows a warp holds: 32 / blockDim.x when the block fills whole warps.
JAXOPS_HD int rows_per_warp(int tx, int ty) { return tx < 32 && tx * ty >= 32 ? 32 / tx : 1; }

// col_kernel's items a thread holds in registers when its block has an SM to itself (R > 0),
// the most that compile without spills within the 128 registers a thread may then use: 48
// registers of data for SoftmaxGrad (dY and Y), 32 for LogSoftmaxGrad (dY: its second pass
// loads Y beside them). Measured on an H100 at axis 1 of [64,4096,64] (2026-11-23): bf16
// SoftmaxGrad 55.1 us without, 51.6 with 4 items, 48.4 with 6, 52.1 with 8 (spilling);
// bf16 LogSoftmaxGrad 47.2 without, 46.7 with 8 and 51.1 with 12 (spilling).
// Single 16-bit elements take a register each; at most 16 items (the loops are unrolled).
template <class Math, typename T, int V>
constexpr int kColRegItems =
    imin(16, (kSumReadsY<Math> ? 48 : 32) /
                 ((kSumReadsY<Math> ? 2 : 1) * imax(1, V * int(sizeof(T)) / 4)));

// inner > 1. A block owns a tile of blockDim.x * V columns of one outer index (a slab); thread x
// owns V adjacent columns and thread row y every blockDim.y-th k of the block's chunk of n (a
// cluster of csize blocks splits n into chunks). The chunk's first R * blockDim.y k stay in
// registers (R items a thread), the next `ncache` k are cached in shared memory, each thread
// reading back only what it cached; the rest is read again. Per-column partial sums are added
// over the thread rows of a warp by shuffles, over the warps in shared memory (blockDim.y is a
// power of two), then over the cluster through DSMEM.
template <class Math, typename T, int V, int R>
__global__ void __launch_bounds__(kSmemThreads, R > 0 ? 1 : 2)
col_kernel(const T* __restrict__ dy, const T* __restrict__ y, T* __restrict__ dx, int64_t outer,
           int64_t n, int64_t inner, int64_t tiles, int csize, int64_t chunk, int64_t ncache) {
  using A = acc_t<T>;
  constexpr bool kY = kSumReadsY<Math>;
  constexpr int U = kUnroll<T, V>;
  extern __shared__ __align__(16) unsigned char smem[];
  const int ty = threadIdx.y, rows = blockDim.y;
  const int w = blockDim.x * V;                     // tile width, elements
  const int c = threadIdx.x * V;                    // this thread's first column in the tile
  const int per_warp = rows_per_warp(blockDim.x, rows);
  A* const red = reinterpret_cast<A*>(smem);        // [rows / per_warp][w] partial sums
  A* const colsum = red + rows / per_warp * w;      // [w] the tile's sums (clusters)
  T* const cdy = reinterpret_cast<T*>(colsum + w);  // [ncache][w] cached dY
  T* const cy = cdy + ncache * w;                   // [ncache][w] cached Y (softmax only)
  const int rank = blockIdx.x % csize;
  const int64_t slabs = outer * tiles;
  for (int64_t slab = blockIdx.x / csize; slab < slabs; slab += gridDim.x / csize) {
    const int64_t o = slab / tiles;
    const int64_t col = (slab - o * tiles) * w + c;
    const bool live = col < inner;  // whole packs: inner % V == 0
    const int64_t k0 = imin(n, rank * chunk), k1 = imin(n, k0 + chunk);
    const int64_t kr = imin(k1, k0 + int64_t(R) * rows), kc = imin(k1, kr + ncache);
    const int64_t off = o * n * inner + col;  // element (o, k, col) is at off + k * inner
    auto cached = [&](int64_t k) { return int(k - kr) * w + c; };  // k - kr < ncache: fits
    auto held = [&](int j) { return k0 + ty + int64_t(j) * rows; };  // register item j's k

    // Pass 1: per-column partial sums; [k0, kr) goes to registers, [kr, kc) to shared memory,
    // [kc, k1) stays in L2. Register items past k1 stay zero, adding nothing.
    A s[V] = {};
    RawItem<T, V> reg[imax(R, 1)] = {};
    if (live) {
#pragma unroll
      for (int j = 0; j < R; ++j)
        if (const int64_t k = held(j); k < kr)
          reg[j] = RawItem<T, V>::of(load_item<V, true, kY>(dy, y, off + k * inner));
#pragma unroll
      for (int j = 0; j < R; ++j) {
        add_terms<Math>(s, reg[j].item());
        opaque(reg[j].d);
        if constexpr (kY) opaque(reg[j].y);
      }
      strided<U>(
          kr + ty, kc, rows,
          [&](int64_t k) { return load_item<V, true, kY>(dy, y, off + k * inner); },
          [&](int64_t k, const Item<T, V>& it) {
            sts<V>(cdy + cached(k), it.d);
            if constexpr (kY) sts<V>(cy + cached(k), it.y);
            add_terms<Math>(s, it);
          });
      strided<U>(
          kc + ty, k1, rows,
          [&](int64_t k) { return load_item<V, false, kY>(dy, y, off + k * inner); },
          [&](int64_t, const Item<T, V>& it) { add_terms<Math>(s, it); });
    }

    // Over the thread rows that share a warp (shuffles), then a tree over the warps' partial
    // rows in shared memory, then over the cluster's blocks.
    for (int o = blockDim.x; o < int(blockDim.x) * per_warp; o *= 2) {
#pragma unroll
      for (int i = 0; i < V; ++i) s[i] += __shfl_xor_sync(0xffffffffu, s[i], o);
    }
    if (ty % per_warp == 0) {
#pragma unroll
      for (int i = 0; i < V; ++i) red[ty / per_warp * w + c + i] = s[i];
    }
    __syncthreads();
    for (int h = rows / per_warp / 2; h > 0; h /= 2) {
      if (ty < h) {
#pragma unroll
        for (int i = 0; i < V; ++i) red[ty * w + c + i] += red[(ty + h) * w + c + i];
      }
      __syncthreads();
    }
    A sum[V];
#pragma unroll
    for (int i = 0; i < V; ++i) sum[i] = red[c + i];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (csize > 1) {
      cg::cluster_group cluster = cg::this_cluster();
      cluster.sync();  // every block's red[0] row is final
      if (ty == 0) {
#pragma unroll
        for (int i = 0; i < V; ++i) {
          A t = 0;
          for (int r = 0; r < csize; ++r) t += cluster.map_shared_rank(red, r)[c + i];
          colsum[c + i] = t;
        }
      }
      cluster.sync();  // colsum is complete; nobody reads red remotely any more
#pragma unroll
      for (int i = 0; i < V; ++i) sum[i] = colsum[c + i];
    }
#endif

    // Pass 2: dX, the uncached k first, while they are the most recently read.
    if (live) {
      strided<U>(
          kc + ty, k1, rows,
          [&](int64_t k) { return load_item<V, true, true>(dy, y, off + k * inner); },
          [&](int64_t k, const Item<T, V>& it) {
            stg<V>(dx + off + k * inner, item_out<Math>(it, sum));
          });
      strided<U>(
          kr + ty, kc, rows,
          [&](int64_t k) {
            Item<T, V> it;
            it.d = lds<V>(cdy + cached(k));
            if constexpr (kY) it.y = lds<V>(cy + cached(k));
            else it.y = ldg<V, true>(y + off + k * inner);
            return it;
          },
          [&](int64_t k, const Item<T, V>& it) {
            stg<V>(dx + off + k * inner, item_out<Math>(it, sum));
          });
#pragma unroll
      for (int j = 0; j < R; ++j) {
        if (const int64_t k = held(j); k < kr) {
          Item<T, V> it = reg[j].item();
          if constexpr (!kY) it.y = ldg<V, true>(y + off + k * inner);
          stg<V>(dx + off + k * inner, item_out<Math>(it, sum));
        }
      }
    }
    __syncthreads();  // red and colsum are rewritten for the next slab
  }
}

// ---------------------------------------------------------------------------------------------
// Host side: configurations and launches

struct DeviceInfo {
  int id = -1, sms = 0, cc_major = 0;
  int64_t smem_budget = 0;  // dynamic shared memory a block may use with two blocks an SM
  int64_t smem_alone = 0;   // ... with one block an SM
  int64_t l2_bytes = 0;
};

// The current device's properties, queried once per device.
cudaError_t device_info(DeviceInfo* out) {
  int dev = 0;
  if (cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
  static std::mutex mu;
  static std::vector<DeviceInfo> cache;
  std::lock_guard<std::mutex> lock(mu);
  if (dev < int(cache.size()) && cache[dev].id == dev) {
    *out = cache[dev];
    return cudaSuccess;
  }
  int sms = 0, major = 0, per_sm = 0, optin = 0, reserved = 0, l2 = 0;
  const std::pair<int*, cudaDeviceAttr> attrs[] = {
      {&sms, cudaDevAttrMultiProcessorCount},
      {&major, cudaDevAttrComputeCapabilityMajor},
      {&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor},
      {&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin},
      {&reserved, cudaDevAttrReservedSharedMemoryPerBlock},
      {&l2, cudaDevAttrL2CacheSize}};
  for (const auto& [value, attr] : attrs)
    if (cudaError_t e = cudaDeviceGetAttribute(value, attr, dev); e != cudaSuccess) return e;
  DeviceInfo info;
  info.id = dev;
  info.sms = imax(sms, 1);
  info.cc_major = major;
  info.l2_bytes = l2;
  // 1 KB is left for the kernels' static shared memory.
  info.smem_budget = imax<int64_t>(0, imin(optin, per_sm / 2 - reserved) - 1024);
  info.smem_alone = imax<int64_t>(0, imin(optin, per_sm - reserved) - 1024);
  if (int(cache.size()) <= dev) cache.resize(dev + 1);
  cache[dev] = info;
  *out = info;
  return cudaSuccess;
}

// Raises a shared-memory kernel's dynamic shared memory limit to what a block alone on an SM
// may use (and asks for the largest carveout), once per device; `done` is the kernel's bitmask
// of prepared devices.
template <typename Kernel>
cudaError_t prepare_smem_kernel(Kernel kernel, const DeviceInfo& dev, std::atomic<uint64_t>& done) {
  const uint64_t bit = dev.id < 64 ? uint64_t(1) << dev.id : 0;
  if (bit != 0 && (done.load(std::memory_order_acquire) & bit)) return cudaSuccess;
  // Never below the 48 KB default: col_kernel's reduction buffer alone may need up to 33 KB.
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(imax<int64_t>(dev.smem_alone, 48 * 1024)));
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                             int(cudaSharedmemCarveoutMaxShared));
  if (e == cudaSuccess) done.fetch_or(bit, std::memory_order_release);
  return e;
}

// A launch configuration with clusters of csize consecutive blocks (csize > 1 needs sm_90).
// cfg points into the object itself: not copyable.
struct ClusterConfig {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1] = {};
  ClusterConfig(dim3 grid, dim3 block, size_t smem, int csize, cudaStream_t stream) {
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = unsigned(csize);
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = csize > 1 ? 1 : 0;
  }
  ClusterConfig(const ClusterConfig&) = delete;
  ClusterConfig& operator=(const ClusterConfig&) = delete;
};

template <typename... Params, typename... Args>
cudaError_t launch_clustered(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                             int csize, cudaStream_t stream, Args... args) {
  const ClusterConfig c(grid, block, smem, csize, stream);
  return cudaLaunchKernelEx(&c.cfg, kernel, args...);
}

int pow2_ceil(int64_t x, int cap) {  // the smallest power of two >= x, at most cap
  int p = 1;
  while (p < x && p < cap) p *= 2;
  return p;
}
int pow2_floor(int64_t x, int cap) {  // the largest power of two <= x (x >= 1), at most cap
  int p = 1;
  while (int64_t(p) * 2 <= x && p * 2 <= cap) p *= 2;
  return p;
}

// row_reg_kernel: packs per thread and threads per row, the fewest packs per thread that keep
// the row within the thread limit of that PPT. Rows of up to 512 * PPT packs fit, PPT the
// largest within kRegMaxData: 4096 packs of f32 and f64 (1024 for f64 LogSoftmaxGrad), 1024
// of f16 and bf16. Many threads with few packs each: at [8192,4096] f32 on an H100, 2 packs
// by 512 threads take 135.0 us (LogSoftmaxGrad) against 136.5 for 4 by 256.
struct RegConfig { int ppt = 0, tpr = 0; };
template <class Math, typename T, int V>
bool pick_reg_config(int64_t npacks, RegConfig* rc) {
  struct Row { int ppt, max_tpr; };
  constexpr Row kTable[] = {{1, 32}, {2, 512}, {8, 512}};
  for (const Row& r : kTable) {
    if (2 * r.ppt * V * int(sizeof(acc_t<T>)) / 4 > kRegMaxData<Math, T>) break;  // kRegData
    const int64_t t = ceil_div(npacks, r.ppt);
    if (t <= r.max_tpr) {
      rc->ppt = r.ppt;
      rc->tpr = t <= 32 ? pow2_ceil(t, 32) : int(round_up(t, 32));
      return true;
    }
  }
  return false;
}

template <class Math, typename T, int V>
cudaError_t launch_reg(const RegConfig& rc, int64_t rows, int64_t n, int64_t inner, const T* dy,
                       const T* y, T* dx, cudaStream_t stream) {
  const int rows_per_block = rc.tpr <= 32 ? 128 / rc.tpr : 1;
  const dim3 block(rc.tpr, rows_per_block);
  const dim3 grid(unsigned(imin<int64_t>(ceil_div(rows, rows_per_block), INT_MAX)));
  auto go = [&](auto kernel) {
    kernel<<<grid, block, 0, stream>>>(dy, y, dx, rows, n, inner);
    return cudaSuccess;  // the handler checks cudaGetLastError
  };
  switch (rc.ppt) {
    case 1: return go(row_reg_kernel<Math, T, V, 1>);
    case 2: return go(row_reg_kernel<Math, T, V, 2>);
    case 8:
      if constexpr (kRegData<T, V, 8> <= kRegMaxData<Math, T>)
        return go(row_reg_kernel<Math, T, V, 8>);
  }
  return cudaErrorInvalidValue;  // not reached: pick_reg_config keeps to kRegMaxData
}

// row_smem_kernel's cluster size for `items` independent rows: at least `fit` (the caller's
// share of the row cached, up to kMaxCluster), more while there are fewer than
// `per_sm` blocks an SM, but not beyond `useful` (so every block has work for its threads).
int pick_cluster(int fit, int64_t items, int64_t useful, int per_sm, const DeviceInfo& dev) {
  const int64_t fill = items < per_sm * dev.sms ? ceil_div(per_sm * dev.sms, items) : 1;
  return int(imin<int64_t>(kMaxCluster, imax<int64_t>(fit, imin(fill, imax<int64_t>(useful, 1)))));
}

template <class Math, typename T, int V>
cudaError_t launch_row_smem(const View& v, const DeviceInfo& dev, const T* dy, const T* y, T* dx,
                            cudaStream_t stream) {
  static std::atomic<uint64_t> prepared{0};
  const auto kernel = row_smem_kernel<Math, T, V>;
  if (cudaError_t e = prepare_smem_kernel(kernel, dev, prepared); e != cudaSuccess) return e;
  const int64_t elem_bytes = int64_t(sizeof(T)) * (kSumReadsY<Math> ? 2 : 1);
  const int64_t budget = round_down(dev.smem_budget / elem_bytes, V);  // cacheable elements
  // Elements a block caches for its span when csize blocks share a row (its span's start
  // is rounded down to V).
  auto need = [&](int csize) { return round_up(ceil_div(v.n, csize), V) + V; };
  auto run = [&](bool clusters) {
    int csize = 1;
    if (clusters) {
      int fit = 1;
      while (fit < kMaxCluster && need(fit) > kRowCacheShare<Math> * budget) ++fit;
      csize = pick_cluster(fit, v.outer, v.n / (kSmemThreads * V), 2, dev);
    }
    const int64_t seg = round_up(ceil_div(v.n, csize), V);
    const int64_t cap = imin(need(csize), budget);
    const int64_t blocks = imin<int64_t>(v.outer, INT_MAX / csize) * csize;
    return launch_clustered(kernel, dim3(unsigned(blocks)), dim3(kSmemThreads),
                            size_t(cap * elem_bytes), csize, stream, dy, y, dx, v.outer, v.n, csize,
                            seg, cap);
  };
  cudaError_t e = run(dev.cc_major >= 9);
  if (e != cudaSuccess && dev.cc_major >= 9) {
    cudaGetLastError();  // the clusters could not be placed: one block a row
    e = run(false);
  }
  return e;
}

// col_kernel's caches: `reg_k` k of each chunk in registers, then up to `budget` k of
// `k_bytes` each in shared memory after `red_bytes` of sums.
struct ColCache {
  int64_t reg_k, budget, k_bytes, red_bytes;
  int64_t ncache(int64_t n, int csize) const {
    return imax<int64_t>(0, imin(ceil_div(n, csize) - reg_k, budget));
  }
  int64_t uncached(int64_t n, int csize) const {  // k a block reads twice
    return imax<int64_t>(0, ceil_div(n, csize) - reg_k - ncache(n, csize));
  }
  size_t smem(int64_t n, int csize) const { return size_t(red_bytes + ncache(n, csize) * k_bytes); }
};

// Clusters of csize blocks that fit on the device at once (0 when the query fails; its error
// is cleared so that the handler's launch check does not report it).
template <typename Kernel>
int active_clusters(Kernel kernel, dim3 block, size_t smem, int csize, const DeviceInfo& dev) {
  int n = 0;
  if (csize == 1) {
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, int(block.x * block.y), smem)) {
      cudaGetLastError();
      return 0;
    }
    return n * dev.sms;
  }
  const ClusterConfig c(dim3(unsigned(csize)), block, smem, csize, nullptr);
  if (cudaOccupancyMaxActiveClusters(&n, kernel, &c.cfg) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

// col_kernel's cluster size and cache. A block that has an SM to itself caches about twice
// the k in shared memory, and more in registers: when that runs every slab in one wave of
// clusters with the uncached k in L2, the largest such size wins (H100, axis 1 of
// [64,4096,64]: bf16 softmax 59.0 -> 54.5 us at size 2, before the registers). Otherwise, at
// two blocks an SM: the fewest waves of clusters, provided the uncached k that one wave's
// blocks re-read fit in L2; among those, the largest size (more of each block's k cached;
// more blocks when slabs are few). Measured on an H100 (2026-11-22, axis 1, sizes 1-8): bf16
// [64,4096,64] softmax runs one wave at size 3 (64 of 79 clusters; 46 MB re-read) in 59 us
// against 63 at the older rule's 5 and 68 at 4 (62 clusters fit: two waves); f32 at 3
// re-reads 56 MB and takes 117 us against 97 at 5 (and 102 caching twice as much a block in
// two waves). The choice is cached per kernel, block, n and slabs: the queries cost
// microseconds.
struct ColChoice { int csize = 1; bool alone = false; };
template <typename Kernel>
ColChoice col_cluster(Kernel two_kernel, Kernel alone_kernel, dim3 block, int64_t slabs, int64_t n,
                      const ColCache& two, const ColCache& alone, const DeviceInfo& dev) {
  struct Key {
    int dev;
    const void* kernel;
    unsigned bx, by;
    int64_t n, slabs;
    bool operator==(const Key& o) const {
      return dev == o.dev && kernel == o.kernel && bx == o.bx && by == o.by && n == o.n &&
             slabs == o.slabs;
    }
  };
  static std::mutex mu;
  static std::vector<std::pair<Key, ColChoice>> chosen;
  const Key key{dev.id, reinterpret_cast<const void*>(two_kernel), block.x, block.y, n, slabs};
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& [k, choice] : chosen)
    if (k == key) return choice;
  // Bytes of uncached k that the blocks of one wave re-read.
  auto reread = [&](const ColCache& c, int size, int active) {
    return imin<int64_t>(slabs, active) * size * c.uncached(n, size) * c.k_bytes;
  };
  const int cap = int(imin<int64_t>(kMaxCluster, imax<int64_t>(1, n / block.y)));
  ColChoice best;
  bool found = false;
  for (int size = cap; size >= 1 && !found; --size) {
    const int active = active_clusters(alone_kernel, block, alone.smem(n, size), size, dev);
    if (active >= slabs && reread(alone, size, active) <= dev.l2_bytes)
      best = {size, true}, found = true;
  }
  std::tuple<bool, int64_t, int> best_rank{true, INT64_MAX, 0};  // (too big for L2, waves, -size)
  for (int size = 1; size <= cap && !found; ++size) {
    const int active = active_clusters(two_kernel, block, two.smem(n, size), size, dev);
    if (active <= 0) continue;
    const std::tuple<bool, int64_t, int> rank{reread(two, size, active) > dev.l2_bytes,
                                              ceil_div(slabs, active), -size};
    if (rank < best_rank) best_rank = rank, best = {size, false};
  }
  if (chosen.size() >= 64) chosen.clear();
  chosen.emplace_back(key, best);
  return best;
}

// col_kernel's block: tile width tx packs (a 128-byte line a k where inner allows, wider when
// n is small), ty thread rows (at most n, a power of two); tx * ty <= kSmemThreads.
struct ColShape { int tx = 1, ty = 1; int64_t tiles = 1; };
ColShape col_shape(int64_t n, int64_t inner, int vec, int elem_size) {
  const int64_t packs = ceil_div(inner, vec);
  ColShape s;
  s.tx = pow2_ceil(packs, imax(1, 128 / (vec * elem_size)));
  s.ty = pow2_floor(n, kSmemThreads / s.tx);
  s.tx = pow2_ceil(packs, kSmemThreads / s.ty);
  s.tiles = ceil_div(packs, s.tx);
  return s;
}

template <class Math, typename T, int V>
cudaError_t launch_col(const View& v, const ColShape& sh, const DeviceInfo& dev, const T* dy,
                       const T* y, T* dx, cudaStream_t stream) {
  constexpr int R = kColRegItems<Math, T, V>;
  static std::atomic<uint64_t> prepared_two{0}, prepared_alone{0};
  const auto two_kernel = col_kernel<Math, T, V, 0>;
  const auto alone_kernel = col_kernel<Math, T, V, R>;
  for (const auto& [kernel, prepared] : {std::pair{two_kernel, &prepared_two},
                                         std::pair{alone_kernel, &prepared_alone}})
    if (cudaError_t e = prepare_smem_kernel(kernel, dev, *prepared); e != cudaSuccess) return e;
  const int64_t w = int64_t(sh.tx) * V;
  const int64_t red_bytes = (sh.ty / rows_per_warp(sh.tx, sh.ty) + 1) * w * int64_t(sizeof(acc_t<T>));
  const int64_t k_bytes = w * int64_t(sizeof(T)) * (kSumReadsY<Math> ? 2 : 1);  // one cached k
  auto cacheable = [&](int64_t smem) { return imax<int64_t>(0, (smem - red_bytes) / k_bytes); };
  const ColCache two{0, cacheable(dev.smem_budget), k_bytes, red_bytes};
  const ColCache alone{int64_t(R) * sh.ty, cacheable(dev.smem_alone), k_bytes, red_bytes};
  const int64_t slabs = v.outer * sh.tiles;
  const dim3 block(sh.tx, sh.ty);
  const ColChoice choice = dev.cc_major >= 9 ? col_cluster(two_kernel, alone_kernel, block, slabs,
                                                           v.n, two, alone, dev)
                                             : ColChoice{};
  const ColCache& cache = choice.alone ? alone : two;
  const auto kernel = choice.alone ? alone_kernel : two_kernel;
  auto run = [&](int csize) {
    const int64_t blocks = imin<int64_t>(slabs, INT_MAX / csize) * csize;
    return launch_clustered(kernel, dim3(unsigned(blocks)), block, cache.smem(v.n, csize), csize,
                            stream, dy, y, dx, v.outer, v.n, v.inner, sh.tiles, csize,
                            ceil_div(v.n, csize), cache.ncache(v.n, csize));
  };
  cudaError_t e = run(choice.csize);
  if (e != cudaSuccess && choice.csize > 1) {
    cudaGetLastError();  // the clusters could not be placed: one block a slab
    e = run(1);
  }
  return e;
}

template <class Math, typename T>
cudaError_t launch(const View& v, const DeviceInfo& dev, const T* dy, const T* y, T* dx,
                   cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  // XLA's buffers are aligned; anything else takes the scalar (V = 1) kernels.
  const uintptr_t addr_bits = reinterpret_cast<uintptr_t>(dy) | reinterpret_cast<uintptr_t>(y) |
                              reinterpret_cast<uintptr_t>(dx);
  const bool aligned = addr_bits % 16 == 0;
  RegConfig rc;
  if (v.inner == 1) {
    const bool vec = aligned && v.n % kVec == 0;
    // A few long rows would leave most SMs idle at one block a row: split them over clusters.
    const bool few_long_rows =
        dev.cc_major >= 9 && v.outer < dev.sms && v.n * int64_t(sizeof(T)) > 16384;
    if (!few_long_rows && (vec ? pick_reg_config<Math, T, kVec>(v.n / kVec, &rc)
                               : pick_reg_config<Math, T, 1>(v.n, &rc)))
      return vec ? launch_reg<Math, T, kVec>(rc, v.outer, v.n, 1, dy, y, dx, stream)
                 : launch_reg<Math, T, 1>(rc, v.outer, v.n, 1, dy, y, dx, stream);
    // Misaligned rows are fine here: each block peels to the first aligned element.
    return aligned ? launch_row_smem<Math, T, kVec>(v, dev, dy, y, dx, stream)
                   : launch_row_smem<Math, T, 1>(v, dev, dy, y, dx, stream);
  }
  const bool vec = aligned && v.inner % kVec == 0;
  const ColShape sh = col_shape(v.n, v.inner, vec ? kVec : 1, int(sizeof(T)));
  // Small n and inner would make tiny blocks: a thread group per strided column instead.
  if (sh.tx * sh.ty < 128 && pick_reg_config<Math, T, 1>(v.n, &rc))
    return launch_reg<Math, T, 1>(rc, v.outer * v.inner, v.n, v.inner, dy, y, dx, stream);
  return vec ? launch_col<Math, T, kVec>(v, sh, dev, dy, y, dx, stream)
             : launch_col<Math, T, 1>(v, sh, dev, dy, y, dx, stream);
}

template <class Math>
ffi::Error handler(const char* op, cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer y,
                   ffi::Result<ffi::AnyBuffer> dx, int64_t axis, int64_t through_end) {
  View v;
  return checked_dispatch(op, check_args(dy, y, *dx, axis, through_end != 0, &v),
                          dy.element_type(), [&](auto tag) {
    using T = decltype(tag);
    if (dy.element_count() == 0) return ffi::Error::Success();
    DeviceInfo dev;
    cudaError_t err = device_info(&dev);
    if (err == cudaSuccess)
      err = launch<Math>(v, dev, dy.reinterpret_data<T>(), y.reinterpret_data<T>(),
                         dx->reinterpret_data<T>(), stream);
    return launched(op, err);
  });
}

ffi::Error softmax_grad_cuda(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer y,
                             ffi::Result<ffi::AnyBuffer> dx, int64_t axis, int64_t through_end) {
  return handler<SoftmaxGrad>("softmax_grad", stream, dy, y, dx, axis, through_end);
}
ffi::Error log_softmax_grad_cuda(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer y,
                                 ffi::Result<ffi::AnyBuffer> dx, int64_t axis,
                                 int64_t through_end) {
  return handler<LogSoftmaxGrad>("log_softmax_grad", stream, dy, y, dx, axis, through_end);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SoftmaxGradCuda, softmax_grad_cuda,
                              bind_args(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(LogSoftmaxGradCuda, log_softmax_grad_cuda,
                              bind_args(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));

void register_handlers(Registry& r) {
  r.add("jaxops_softmax_grad", SoftmaxGradCuda);
  r.add("jaxops_log_softmax_grad", LogSoftmaxGradCuda);
}

}  // namespace jaxops::softmax
