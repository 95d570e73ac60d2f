// CUDA handlers of the layer-norm gradients (LayerNormalizationGrad, SimplifiedLayerNormalizationGrad,
// InvertibleLayerNormalizationGrad), BatchNormalizationGrad and training-mode BatchNormInternal,
// with the semantics of ffi/cpu/norm.cc and the math of jaxops/norm.h.
//
// Layer norms, memory bound: read dY and X once, write dX once.
//   ln_rows_cached  a block owns every `chunks`-th row of one group; each thread keeps its own
//                   columns of scale (and bias) and its column partials of scale_grad/bias_grad
//                   in registers across those rows, and one row's dY/X in registers between the
//                   row sums and the dX write, while the next row's loads are in flight. Rows up
//                   to 256 * 4 * 16 bytes, aligned, width a multiple of the 16-byte vector.
//   ln_rows_stream  any other shape: rows read twice (the second read mostly from L1/L2),
//                   column partials accumulated in the block's own rows of the workspace.
//   col_sums        scale_grad/bias_grad: the chunks' partials summed in chunk order.
// No float atomics: every sum has a fixed order, so results are deterministic run to run.
// BatchNorm: one block a channel sums dY and dY * xhat (or X and the squared deviations) in a
// fixed order, then an elementwise kernel writes dX (or Y).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "jaxops/checks.h"
#include "jaxops/cuda_elem.cuh"
#include "jaxops/cuda_launch.h"
#include "jaxops/norm.h"
#include "jaxops/registry.h"

namespace jaxops::norm {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxCache = 4;  // 16-byte vectors per thread a cached row holds (more would spill)

// Sums x and y over the block; every thread gets the same totals (butterfly shuffles, then
// the warps' sums in warp order). `red` is reused, so the trailing barrier is needed.
template <typename A>
__device__ __forceinline__ void block_sum2(A& x, A& y, A (*red)[kWarps]) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    x += __shfl_xor_sync(0xffffffffu, x, off);
    y += __shfl_xor_sync(0xffffffffu, y, off);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) { red[0][warp] = x; red[1][warp] = y; }
  __syncthreads();
  x = 0; y = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) { x += red[0][w]; y += red[1][w]; }
  __syncthreads();
}

// ---------------------------------------------------------------------------------------------
// Layer norms

template <typename T>
struct LnArgs {
  const T *dy, *x;
  const acc_t<T> *scale, *bias, *mean, *inv;  // bias: invertible only; mean: layer only
  T* dx;
  acc_t<T> *dscale, *dbias;                   // dbias: null for RMSNorm
};

// Workspace layout: part[((g * chunks + p) * 2 + w) * n + c], w = 0: scale_grad, 1: bias_grad.
// Two resident blocks an SM where the registers allow (K <= 2): a block stalls at its barriers.
template <int kMode, typename T, int V, int K>
__global__ void __launch_bounds__(kThreads, K <= 2 ? 2 : 1)
ln_rows_cached(LnArgs<T> a, int64_t groups, int64_t rows, int64_t n, int chunks, acc_t<T>* part) {
  using A = acc_t<T>;
  __shared__ A red[2][kWarps];
  const int64_t g = blockIdx.x / chunks;
  const int p = blockIdx.x % chunks;
  A sc[K][V], bi[K][V], cs[K][V], cb[K][V];
  bool valid[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t c0 = (int64_t(k) * kThreads + threadIdx.x) * V;
    valid[k] = c0 < n;  // n is a multiple of V
#pragma unroll
    for (int j = 0; j < V; ++j) {
      sc[k][j] = valid[k] ? a.scale[g * n + c0 + j] : A(0);
      bi[k][j] = (kMode == kInvertible && valid[k]) ? a.bias[g * n + c0 + j] : A(0);
      cs[k][j] = 0;
      cb[k][j] = 0;
    }
  }
  // The next row's X and dY (raw storage, few registers), loaded before this row's reduction.
  Pack<T, V> next_x[K], next_dy[K];
  A next_mean = 0, next_inv = 0;
  auto load_row = [&](int64_t r) {
    const int64_t row = g * rows + r, base = row * n;
    next_mean = kMode == kLayer ? a.mean[row] : A(0);
    next_inv = a.inv[row];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (!valid[k]) continue;
      const int64_t c0 = (int64_t(k) * kThreads + threadIdx.x) * V;
      next_x[k] = *reinterpret_cast<const Pack<T, V>*>(a.x + base + c0);
      next_dy[k] = *reinterpret_cast<const Pack<T, V>*>(a.dy + base + c0);
    }
  };
  if (p < rows) load_row(p);
  for (int64_t r = p; r < rows; r += chunks) {
    const int64_t row = g * rows + r, base = row * n;
    const A mean = next_mean, inv = next_inv;
    Pack<T, V> xv[K], dv[K];
#pragma unroll
    for (int k = 0; k < K; ++k) { xv[k] = next_x[k]; dv[k] = next_dy[k]; }
    if (r + chunks < rows) load_row(r + chunks);
    A sum_b = 0, sum_bx = 0;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (!valid[k]) continue;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const A d = to_acc(dv[k].v[j]);
        const A xh = xhat<kMode>(to_acc(xv[k].v[j]), mean, inv, sc[k][j], bi[k][j]);
        const A b = d * sc[k][j] * inv;
        sum_b += b;
        sum_bx += b * xh;
        cs[k][j] += d * xh;
        cb[k][j] += d;
      }
    }
    block_sum2(sum_b, sum_bx, red);
    const A mean_b = sum_b / A(n), mean_bx = sum_bx / A(n);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (!valid[k]) continue;
      const int64_t c0 = (int64_t(k) * kThreads + threadIdx.x) * V;
      Pack<T, V> out;
#pragma unroll
      for (int j = 0; j < V; ++j) {  // xhat and b again from the 16-bit row: fewer registers
        const A xh = xhat<kMode>(to_acc(xv[k].v[j]), mean, inv, sc[k][j], bi[k][j]);
        const A b = to_acc(dv[k].v[j]) * sc[k][j] * inv;
        out.v[j] = from_acc<T>(x_grad<kMode>(b, xh, mean_b, mean_bx));
      }
      *reinterpret_cast<Pack<T, V>*>(a.dx + base + c0) = out;
    }
  }
  A* ps = part + (int64_t(g) * chunks + p) * 2 * n;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    if (!valid[k]) continue;
    const int64_t c0 = (int64_t(k) * kThreads + threadIdx.x) * V;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      ps[c0 + j] = cs[k][j];
      ps[n + c0 + j] = cb[k][j];
    }
  }
}

template <int kMode, typename T>
__global__ void __launch_bounds__(kThreads)
ln_rows_stream(LnArgs<T> a, int64_t groups, int64_t rows, int64_t n, int chunks, acc_t<T>* part) {
  using A = acc_t<T>;
  __shared__ A red[2][kWarps];
  const int64_t g = blockIdx.x / chunks;
  const int p = blockIdx.x % chunks;
  const A* scale = a.scale + g * n;
  const A* bias = kMode == kInvertible ? a.bias + g * n : nullptr;
  A* ps = part + (int64_t(g) * chunks + p) * 2 * n;  // this block's own partials
  for (int64_t c = threadIdx.x; c < n; c += kThreads) { ps[c] = 0; ps[n + c] = 0; }
  for (int64_t r = p; r < rows; r += chunks) {
    const int64_t row = g * rows + r, base = row * n;
    const A mean = kMode == kLayer ? a.mean[row] : A(0), inv = a.inv[row];
    A sum_b = 0, sum_bx = 0;
    for (int64_t c = threadIdx.x; c < n; c += kThreads) {
      const A d = to_acc(a.dy[base + c]);
      const A xh = xhat<kMode>(to_acc(a.x[base + c]), mean, inv, scale[c], bias ? bias[c] : A(0));
      const A b = d * scale[c] * inv;
      sum_b += b;
      sum_bx += b * xh;
      ps[c] += d * xh;  // only this thread touches column c of this block's partials
      ps[n + c] += d;
    }
    block_sum2(sum_b, sum_bx, red);
    const A mean_b = sum_b / A(n), mean_bx = sum_bx / A(n);
    for (int64_t c = threadIdx.x; c < n; c += kThreads) {
      const A d = to_acc(a.dy[base + c]);
      const A xh = xhat<kMode>(to_acc(a.x[base + c]), mean, inv, scale[c], bias ? bias[c] : A(0));
      a.dx[base + c] = from_acc<T>(x_grad<kMode>(d * scale[c] * inv, xh, mean_b, mean_bx));
    }
  }
}

// One block: 32 columns of one group; its 8 thread rows split the chunks, then row 0 adds
// the 8 partial sums in order.
template <typename A>
__global__ void __launch_bounds__(kThreads)
col_sums(const A* part, int64_t groups, int chunks, int64_t n, A* dscale, A* dbias) {
  __shared__ A sh[2][8][33];
  const int64_t tiles = (n + 31) / 32;
  const int64_t g = blockIdx.x / tiles, c = (blockIdx.x % tiles) * 32 + threadIdx.x;
  A s = 0, b = 0;
  if (c < n)
    for (int p = threadIdx.y; p < chunks; p += 8) {
      const A* ps = part + (g * chunks + p) * 2 * n;
      s += ps[c];
      b += ps[n + c];
    }
  sh[0][threadIdx.y][threadIdx.x] = s;
  sh[1][threadIdx.y][threadIdx.x] = b;
  __syncthreads();
  if (threadIdx.y != 0 || c >= n) return;
  s = 0; b = 0;
#pragma unroll
  for (int y = 0; y < 8; ++y) { s += sh[0][y][threadIdx.x]; b += sh[1][y][threadIdx.x]; }
  dscale[g * n + c] = s;
  if (dbias) dbias[g * n + c] = b;
}

template <typename Kernel>
cudaError_t chunks_for(Kernel kernel, int64_t groups, int64_t rows, int* chunks) {
  int dev = 0, sms = 0, per_sm = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (e == cudaSuccess) e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0);
  if (e != cudaSuccess) return e;
  // One wave of blocks over the whole grid; each block a share of its group's rows.
  const int64_t want = (int64_t(sms) * (per_sm > 0 ? per_sm : 1) + groups - 1) / groups;
  *chunks = int(want < rows ? want : rows);
  if (*chunks > 65535) *chunks = 65535;
  return cudaSuccess;
}

template <int kMode, typename T, int V, int K>
cudaError_t launch_cached(const LnArgs<T>& a, const LnView& v, ffi::ScratchAllocator& scratch,
                          cudaStream_t stream, int* chunks, acc_t<T>** part) {
  auto kernel = ln_rows_cached<kMode, T, V, K>;
  if (cudaError_t e = chunks_for(kernel, v.groups, v.rows, chunks); e != cudaSuccess) return e;
  auto mem = scratch.Allocate(size_t(v.groups) * *chunks * 2 * v.cols * sizeof(acc_t<T>), 16);
  if (!mem) return cudaErrorMemoryAllocation;
  *part = static_cast<acc_t<T>*>(*mem);
  kernel<<<v.groups * *chunks, kThreads, 0, stream>>>(a, v.groups, v.rows, v.cols, *chunks, *part);
  return cudaSuccess;
}

template <int kMode, typename T>
cudaError_t launch_ln(const LnArgs<T>& a, const LnView& v, ffi::ScratchAllocator& scratch,
                      cudaStream_t stream) {
  using A = acc_t<T>;
  constexpr int V = 16 / sizeof(T);
  int chunks = 0;
  A* part = nullptr;
  cudaError_t e = cudaSuccess;
  if (v.rows > 0 && v.cols > 0) {
    const uintptr_t bits = reinterpret_cast<uintptr_t>(a.dy) | reinterpret_cast<uintptr_t>(a.x) |
                           reinterpret_cast<uintptr_t>(a.dx);
    const int64_t vecs = v.cols / V, per_thread = (vecs + kThreads - 1) / kThreads;
    const bool cached = bits % 16 == 0 && v.cols % V == 0 && per_thread <= kMaxCache;
    if (cached && per_thread <= 1) e = launch_cached<kMode, T, V, 1>(a, v, scratch, stream, &chunks, &part);
    else if (cached && per_thread <= 2) e = launch_cached<kMode, T, V, 2>(a, v, scratch, stream, &chunks, &part);
    else if (cached && per_thread <= 4) e = launch_cached<kMode, T, V, 4>(a, v, scratch, stream, &chunks, &part);
    else if (cached) e = launch_cached<kMode, T, V, kMaxCache>(a, v, scratch, stream, &chunks, &part);
    else {
      auto kernel = ln_rows_stream<kMode, T>;
      e = chunks_for(kernel, v.groups, v.rows, &chunks);
      if (e != cudaSuccess) return e;
      auto mem = scratch.Allocate(size_t(v.groups) * chunks * 2 * v.cols * sizeof(A), 16);
      if (!mem) return cudaErrorMemoryAllocation;
      part = static_cast<A*>(*mem);
      kernel<<<v.groups * chunks, kThreads, 0, stream>>>(a, v.groups, v.rows, v.cols, chunks, part);
    }
    if (e != cudaSuccess) return e;
  }
  if (v.cols > 0 && v.groups > 0)  // chunks == 0 (no rows): the sums are zeros
    col_sums<A><<<v.groups * ((v.cols + 31) / 32), dim3(32, 8), 0, stream>>>(
        part, v.groups, chunks, v.cols, a.dscale, a.dbias);
  return cudaSuccess;
}

// ---------------------------------------------------------------------------------------------
// BatchNorm: channel j = g * c + ch holds the elements ((g * n + i) * c + ch) * s + k.

// Walks channel j's elements e = threadIdx.x, + kThreads, ... (e = i * s + k) without a
// division per element: (i, k) advance by kThreads = q * s + rem with one carry.
struct ChannelWalk {
  int64_t base, i, k, q, rem;
  __device__ ChannelWalk(const BnView& v, int64_t j) {
    base = ((j / v.c) * v.n * v.c + j % v.c) * v.s;  // element (i=0, k=0) of channel j
    i = threadIdx.x / v.s; k = threadIdx.x % v.s;
    q = kThreads / v.s; rem = kThreads % v.s;
  }
  __device__ int64_t index(const BnView& v) const { return base + i * v.c * v.s + k; }
  __device__ void next(const BnView& v) {
    i += q; k += rem;
    if (k >= v.s) { k -= v.s; ++i; }
  }
};
JAXOPS_HD int64_t bn_channel(const BnView& v, int64_t idx) {
  return (idx / (v.n * v.c * v.s)) * v.c + (idx / v.s) % v.c;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
bn_grad_sums(BnView v, const T* dy, const T* x, const acc_t<T>* mean, const acc_t<T>* inv,
             acc_t<T>* dscale, acc_t<T>* dbias) {
  using A = acc_t<T>;
  __shared__ A red[2][kWarps];
  const int64_t j = blockIdx.x, m = v.n * v.s;
  A sum_dy = 0, sum_dyx = 0;
  ChannelWalk w(v, j);
  for (int64_t e = threadIdx.x; e < m; e += kThreads, w.next(v)) {
    const int64_t i = w.index(v);
    const A d = to_acc(dy[i]);
    sum_dy += d;
    sum_dyx += d * (to_acc(x[i]) - mean[j]) * inv[j];
  }
  block_sum2(sum_dy, sum_dyx, red);
  if (threadIdx.x == 0) { dscale[j] = sum_dyx; dbias[j] = sum_dy; }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
bn_grad_dx(BnView v, const T* dy, const T* x, const acc_t<T>* scale, const acc_t<T>* mean,
           const acc_t<T>* inv, const acc_t<T>* dscale, const acc_t<T>* dbias, T* dx) {
  using A = acc_t<T>;
  const int64_t total = v.groups * v.n * v.c * v.s;
  const A m = A(v.n * v.s);
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * kThreads) {
    const int64_t j = bn_channel(v, i);
    const A xh = (to_acc(x[i]) - mean[j]) * inv[j];
    dx[i] = from_acc<T>(bn_x_grad(to_acc(dy[i]), xh, scale[j], inv[j], dbias[j], dscale[j], m));
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
bn_train_stats(BnView v, const T* x, const acc_t<T>* in_mean, const acc_t<T>* in_var,
               float epsilon, float momentum, acc_t<T>* run_mean, acc_t<T>* run_var,
               acc_t<T>* saved_mean, acc_t<T>* saved_inv) {
  using A = acc_t<T>;
  __shared__ A red[2][kWarps];
  const int64_t j = blockIdx.x, count = v.n * v.s;
  const A m = A(count);
  A sum = 0, unused = 0;
  const ChannelWalk start(v, j);
  ChannelWalk w = start;
  for (int64_t e = threadIdx.x; e < count; e += kThreads, w.next(v)) sum += to_acc(x[w.index(v)]);
  block_sum2(sum, unused, red);
  const A mean = sum / m;
  A sq = 0;  // second pass: the variance without cancellation (the channel is in L2 by now)
  unused = 0;
  w = start;
  for (int64_t e = threadIdx.x; e < count; e += kThreads, w.next(v)) {
    const A d = to_acc(x[w.index(v)]) - mean;
    sq += d * d;
  }
  block_sum2(sq, unused, red);
  if (threadIdx.x != 0) return;
  const A var = sq / m, mom = A(momentum);
  run_mean[j] = mom * in_mean[j] + (A(1) - mom) * mean;
  run_var[j] = mom * in_var[j] + (A(1) - mom) * var;
  saved_mean[j] = mean;
  saved_inv[j] = rsqrt_of(var + A(epsilon));
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
bn_train_y(BnView v, const T* x, const acc_t<T>* scale, const acc_t<T>* b, const acc_t<T>* mean,
           const acc_t<T>* inv, T* y) {
  const int64_t total = v.groups * v.n * v.c * v.s;
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * kThreads) {
    const int64_t j = bn_channel(v, i);
    y[i] = from_acc<T>(scale[j] * (to_acc(x[i]) - mean[j]) * inv[j] + b[j]);
  }
}

int elementwise_blocks(int64_t total) {
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  return int(blocks < 65536 ? blocks : 65536);
}

// ---------------------------------------------------------------------------------------------
// Handlers

template <int kMode>
ffi::Error ln_handler(const char* op, cudaStream_t stream, ffi::ScratchAllocator& scratch,
                      ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer scale,
                      const ffi::AnyBuffer* bias, const ffi::AnyBuffer* mean, ffi::AnyBuffer inv,
                      ffi::AnyBuffer* dx, ffi::AnyBuffer* dscale, ffi::AnyBuffer* dbias,
                      int64_t axis, int64_t batch) {
  LnView v;
  const std::string err =
      check_ln(dy, x, scale, bias, mean, inv, dx, dscale, dbias, axis, batch, &v);
  return checked_dispatch(op, err, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    auto cp = [](const ffi::AnyBuffer* b) { return b ? b->reinterpret_data<A>() : nullptr; };
    LnArgs<T> a{dy.reinterpret_data<T>(), x.reinterpret_data<T>(), scale.reinterpret_data<A>(),
                cp(bias), cp(mean), inv.reinterpret_data<A>(), dx->reinterpret_data<T>(),
                dscale->reinterpret_data<A>(), dbias ? dbias->reinterpret_data<A>() : nullptr};
    return launched(op, launch_ln<kMode, T>(a, v, scratch, stream));
  });
}

ffi::Error layer_grad(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer dy,
                      ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::AnyBuffer mean,
                      ffi::AnyBuffer inv, ffi::Result<ffi::AnyBuffer> dx,
                      ffi::Result<ffi::AnyBuffer> dscale, ffi::Result<ffi::AnyBuffer> dbias,
                      int64_t axis, int64_t batch) {
  return ln_handler<kLayer>("layer_normalization_grad", stream, scratch, dy, x, scale, nullptr,
                            &mean, inv, &*dx, &*dscale, &*dbias, axis, batch);
}
ffi::Error simplified_grad(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer dy,
                           ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::AnyBuffer inv,
                           ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dscale,
                           int64_t axis, int64_t batch) {
  return ln_handler<kSimplified>("simplified_layer_normalization_grad", stream, scratch, dy, x,
                                 scale, nullptr, nullptr, inv, &*dx, &*dscale, nullptr, axis, batch);
}
ffi::Error invertible_grad(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer dy,
                           ffi::AnyBuffer y, ffi::AnyBuffer scale, ffi::AnyBuffer bias,
                           ffi::AnyBuffer inv, ffi::Result<ffi::AnyBuffer> dx,
                           ffi::Result<ffi::AnyBuffer> dscale, ffi::Result<ffi::AnyBuffer> dbias,
                           int64_t axis, int64_t batch) {
  return ln_handler<kInvertible>("invertible_layer_normalization_grad", stream, scratch, dy, y,
                                 scale, &bias, nullptr, inv, &*dx, &*dscale, &*dbias, axis, batch);
}

ffi::Error batch_norm_grad(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                           ffi::AnyBuffer scale, ffi::AnyBuffer mean, ffi::AnyBuffer inv,
                           ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dscale,
                           ffi::Result<ffi::AnyBuffer> dbias, int64_t batch) {
  const char* op = "batch_normalization_grad";
  BnView v;
  const std::string err = check_bn_grad(dy, x, scale, mean, inv, *dx, *dscale, *dbias, batch, &v);
  const int64_t ch = v.groups * v.c;  // one block per channel
  return checked_dispatch(op, err, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    if (ch == 0) return launched(op);
    const T *dyp = dy.reinterpret_data<T>(), *xp = x.reinterpret_data<T>();
    const A *mp = mean.reinterpret_data<A>(), *ip = inv.reinterpret_data<A>();
    A *ds = dscale->reinterpret_data<A>(), *db = dbias->reinterpret_data<A>();
    bn_grad_sums<T><<<ch, kThreads, 0, stream>>>(v, dyp, xp, mp, ip, ds, db);
    const int64_t total = ch * v.n * v.s;
    if (total > 0)
      bn_grad_dx<T><<<elementwise_blocks(total), kThreads, 0, stream>>>(
          v, dyp, xp, scale.reinterpret_data<A>(), mp, ip, ds, db, dx->reinterpret_data<T>());
    return launched(op);
  });
}

ffi::Error batch_norm_train(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer scale,
                            ffi::AnyBuffer b, ffi::AnyBuffer in_mean, ffi::AnyBuffer in_var,
                            ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> run_mean,
                            ffi::Result<ffi::AnyBuffer> run_var,
                            ffi::Result<ffi::AnyBuffer> saved_mean,
                            ffi::Result<ffi::AnyBuffer> saved_inv, float epsilon, float momentum,
                            int64_t batch) {
  const char* op = "batch_norm_internal";
  BnView v;
  const std::string err = check_bn_train(x, scale, b, in_mean, in_var, *y, *run_mean, *run_var,
                                         *saved_mean, *saved_inv, batch, &v);
  const int64_t ch = v.groups * v.c;  // one block per channel
  return checked_dispatch(op, err, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    if (ch == 0) return launched(op);
    const T* xp = x.reinterpret_data<T>();
    A *sm = saved_mean->reinterpret_data<A>(), *si = saved_inv->reinterpret_data<A>();
    bn_train_stats<T><<<ch, kThreads, 0, stream>>>(
        v, xp, in_mean.reinterpret_data<A>(), in_var.reinterpret_data<A>(), epsilon, momentum,
        run_mean->reinterpret_data<A>(), run_var->reinterpret_data<A>(), sm, si);
    const int64_t total = ch * v.n * v.s;
    if (total > 0)
      bn_train_y<T><<<elementwise_blocks(total), kThreads, 0, stream>>>(
          v, xp, scale.reinterpret_data<A>(), b.reinterpret_data<A>(), sm, si,
          y->reinterpret_data<T>());
    return launched(op);
  });
}

}  // namespace

#define JAXOPS_CUDA_BIND ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()
XLA_FFI_DEFINE_HANDLER_SYMBOL(LayerNormGradCuda, layer_grad,
                              bind_layer(JAXOPS_CUDA_BIND.Ctx<ffi::ScratchAllocator>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(SimplifiedNormGradCuda, simplified_grad,
                              bind_simplified(JAXOPS_CUDA_BIND.Ctx<ffi::ScratchAllocator>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(InvertibleNormGradCuda, invertible_grad,
                              bind_layer(JAXOPS_CUDA_BIND.Ctx<ffi::ScratchAllocator>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(BatchNormGradCuda, batch_norm_grad, bind_bn_grad(JAXOPS_CUDA_BIND));
XLA_FFI_DEFINE_HANDLER_SYMBOL(BatchNormTrainCuda, batch_norm_train, bind_bn_train(JAXOPS_CUDA_BIND));
#undef JAXOPS_CUDA_BIND

void register_handlers(Registry& r) {
  r.add("jaxops_layer_normalization_grad", LayerNormGradCuda);
  r.add("jaxops_simplified_layer_normalization_grad", SimplifiedNormGradCuda);
  r.add("jaxops_invertible_layer_normalization_grad", InvertibleNormGradCuda);
  r.add("jaxops_batch_normalization_grad", BatchNormGradCuda);
  r.add("jaxops_batch_norm_internal", BatchNormTrainCuda);
}

}  // namespace jaxops::norm
