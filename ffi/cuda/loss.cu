// CUDA handlers of the softmax cross-entropy row kernels, with the semantics of
// ffi/cpu/loss.cc (the math is in loss.h).
//
// Both kernels give each row of x [R, C] to one block (blocks loop over rows), threads
// striding over the row in 16-byte vectors (scalars when a row is not 16-byte aligned),
// several vectors in flight per thread:
//   fwd_kernel  one read of the row: each thread keeps a running (max, sum of exp), merged
//               across the block in a fixed order (deterministic). Thread 0 then reads
//               x[label] (only for a label inside [0, C)). The log_prob variant writes
//               x - lse in a second sweep over the row, which mostly hits L2.
//   bwd_kernel  one read of x (logits with their lse, or log_prob with lse = 0) and one
//               write of d = g * (exp(x - lse) - onehot) (+ bias).
// f16/bf16 (and f32) accumulate in f32, f64 in f64.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "jaxops/checks.h"
#include "jaxops/cuda_elem.cuh"
#include "jaxops/cuda_launch.h"
#include "jaxops/loss.h"
#include "jaxops/registry.h"

namespace jaxops::loss {
namespace {

constexpr int kUnroll = 4;      // vectors in flight per thread
constexpr int kMaxThreads = 512;

// exp in the accumulation type; the 16-bit inputs use the fast hardware exp (its error is
// far below their rounding), f32 and f64 the accurate one.
template <typename T> __device__ __forceinline__ acc_t<T> fexp(acc_t<T> x) {
  if constexpr (std::is_same_v<T, double>) return exp(x);
  else if constexpr (std::is_same_v<T, float>) return expf(x);
  else return __expf(x);
}


// 16-byte (or smaller) words: __ldg/__ldcs/__stcs take only builtin types, so a Pack moves
// as one to four of them.
template <int B> struct Word;
template <> struct Word<2> { using type = unsigned short; };
template <> struct Word<4> { using type = unsigned int; };
template <> struct Word<8> { using type = uint2; };
template <> struct Word<16> { using type = uint4; };
template <typename Vt> constexpr int kWordBytes = sizeof(Vt) < 16 ? int(sizeof(Vt)) : 16;
template <typename Vt> using word_of = typename Word<kWordBytes<Vt>>::type;

template <typename Vt> __device__ __forceinline__ Vt load_ldg(const Vt* p) {
  Vt out;
  auto* o = reinterpret_cast<word_of<Vt>*>(&out);
  const auto* w = reinterpret_cast<const word_of<Vt>*>(p);
#pragma unroll
  for (int i = 0; i < int(sizeof(Vt)) / kWordBytes<Vt>; ++i) o[i] = __ldg(w + i);
  return out;
}
template <typename Vt> __device__ __forceinline__ Vt load_cs(const Vt* p) {
  Vt out;
  auto* o = reinterpret_cast<word_of<Vt>*>(&out);
  const auto* w = reinterpret_cast<const word_of<Vt>*>(p);
#pragma unroll
  for (int i = 0; i < int(sizeof(Vt)) / kWordBytes<Vt>; ++i) o[i] = __ldcs(w + i);
  return out;
}
template <typename Vt> __device__ __forceinline__ void store_cs(Vt* p, const Vt& v) {
  const auto* i_ = reinterpret_cast<const word_of<Vt>*>(&v);
  auto* w = reinterpret_cast<word_of<Vt>*>(p);
#pragma unroll
  for (int i = 0; i < int(sizeof(Vt)) / kWordBytes<Vt>; ++i) __stcs(w + i, i_[i]);
}

// Merges the block's per-thread pairs in a fixed order; every thread gets the result.
template <typename A>
__device__ MaxSum<A> block_merge(MaxSum<A> ms) {
  __shared__ A sm[32], ss[32];
  __shared__ MaxSum<A> result;
  for (int o = 16; o > 0; o >>= 1) {
    MaxSum<A> other{__shfl_down_sync(0xffffffffu, ms.m, o), __shfl_down_sync(0xffffffffu, ms.s, o)};
    ms = MaxSum<A>::merge(ms, other);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  if (lane == 0) { sm[warp] = ms.m; ss[warp] = ms.s; }
  __syncthreads();
  if (warp == 0) {
    ms = lane < warps ? MaxSum<A>{sm[lane], ss[lane]} : MaxSum<A>::empty();
    for (int o = 16; o > 0; o >>= 1) {
      MaxSum<A> other{__shfl_down_sync(0xffffffffu, ms.m, o),
                      __shfl_down_sync(0xffffffffu, ms.s, o)};
      ms = MaxSum<A>::merge(ms, other);
    }
    if (lane == 0) result = ms;
  }
  __syncthreads();
  ms = result;
  __syncthreads();  // the shared slots are reused by the next row
  return ms;
}

template <typename T, typename O, int V, bool kLogProb>
__global__ void __launch_bounds__(kMaxThreads)
fwd_kernel(int64_t rows, int64_t c, const T* __restrict__ x, const int32_t* __restrict__ labels,
           acc_t<T>* __restrict__ nll, acc_t<T>* __restrict__ lse_out, O* __restrict__ log_prob) {
  using A = acc_t<T>;
  const int64_t nvec = c / V;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const Pack<T, V>* xr = reinterpret_cast<const Pack<T, V>*>(x + r * c);
    MaxSum<A> ms = MaxSum<A>::empty();
    for (int64_t i0 = threadIdx.x; i0 < nvec; i0 += int64_t(blockDim.x) * kUnroll) {
      Pack<T, V> buf[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = i0 + int64_t(u) * blockDim.x;
        if (i < nvec) buf[u] = load_ldg(xr + i);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (i0 + int64_t(u) * blockDim.x >= nvec) break;
        A vmax = to_acc(buf[u].v[0]);
#pragma unroll
        for (int k = 1; k < V; ++k) vmax = fmax(vmax, to_acc(buf[u].v[k]));
        if (vmax > ms.m) { ms.s *= fexp<T>(ms.m - vmax); ms.m = vmax; }
        if (ms.m != A(-INFINITY)) {
#pragma unroll
          for (int k = 0; k < V; ++k) ms.s += fexp<T>(to_acc(buf[u].v[k]) - ms.m);
        }
        // a nan anywhere makes the sum nan (fmax skips nans, so add them explicitly)
#pragma unroll
        for (int k = 0; k < V; ++k) if (to_acc(buf[u].v[k]) != to_acc(buf[u].v[k])) ms.s = NAN;
      }
    }
    ms = block_merge(ms);
    const A lse = ms.lse();
    if (threadIdx.x == 0) {
      const int32_t l = labels[r];
      lse_out[r] = lse;
      nll[r] = in_range(l, c) ? lse - to_acc(x[r * c + l]) : A(0);
    }
    if constexpr (kLogProb) {
      Pack<O, V>* out = reinterpret_cast<Pack<O, V>*>(log_prob + r * c);
      for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
        const Pack<T, V> in = load_ldg(xr + i);
        Pack<O, V> o;
#pragma unroll
        for (int k = 0; k < V; ++k) o.v[k] = from_acc<O>(acc_t<O>(to_acc(in.v[k]) - lse));
        out[i] = o;
      }
    }
  }
}

template <typename T, typename O, int V, bool kBias>
__global__ void __launch_bounds__(kMaxThreads)
bwd_kernel(int64_t rows, int64_t c, const acc_t<T>* __restrict__ g, const T* __restrict__ x,
           const acc_t<T>* __restrict__ lse, const int32_t* __restrict__ labels,
           const O* __restrict__ bias, O* __restrict__ d) {
  using A = acc_t<T>;
  const int64_t nvec = c / V;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const Pack<T, V>* xr = reinterpret_cast<const Pack<T, V>*>(x + r * c);
    const Pack<O, V>* br = reinterpret_cast<const Pack<O, V>*>(bias + (kBias ? r * c : 0));
    Pack<O, V>* dr = reinterpret_cast<Pack<O, V>*>(d + r * c);
    const A gr = g[r], lr = lse[r];
    const int32_t l = labels[r];
    for (int64_t i0 = threadIdx.x; i0 < nvec; i0 += int64_t(blockDim.x) * kUnroll) {
      Pack<T, V> buf[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = i0 + int64_t(u) * blockDim.x;
        if (i < nvec) buf[u] = load_cs(xr + i);  // read once: evict first
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = i0 + int64_t(u) * blockDim.x;
        if (i >= nvec) break;
        Pack<O, V> o;
        Pack<O, V> b;
        if constexpr (kBias) b = load_cs(br + i);
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const int64_t col = i * V + k;
          A v = gr * (fexp<T>(to_acc(buf[u].v[k]) - lr) - (col == l ? A(1) : A(0)));
          if constexpr (kBias) v += A(to_acc(b.v[k]));
          o.v[k] = from_acc<O>(acc_t<O>(v));
        }
        store_cs(dr + i, o);
      }
    }
  }
}


// Threads a row: enough for kUnroll vectors each, a whole number of warps, at most 512.
int threads_for(int64_t nvec) {
  int64_t t = (nvec + kUnroll - 1) / kUnroll;
  t = (t + 31) / 32 * 32;
  return int(t < 32 ? 32 : (t > kMaxThreads ? kMaxThreads : t));
}

int grid_for(int64_t rows) {
  constexpr int64_t kMaxBlocks = int64_t(1) << 30;  // blocks loop over the remaining rows
  return int(rows < kMaxBlocks ? rows : kMaxBlocks);
}

template <typename T> bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

template <typename T, typename O, int V, bool kLogProb>
void launch_fwd(cudaStream_t stream, int64_t rows, int64_t c, const T* x, const int32_t* l,
                acc_t<T>* nll, acc_t<T>* lse, O* lp) {
  fwd_kernel<T, O, V, kLogProb><<<grid_for(rows), threads_for(c / V), 0, stream>>>(
      rows, c, x, l, nll, lse, lp);
}

template <typename T, typename O, int V, bool kBias>
void launch_bwd(cudaStream_t stream, int64_t rows, int64_t c, const acc_t<T>* g, const T* x,
                const acc_t<T>* lse, const int32_t* l, const O* bias, O* d) {
  bwd_kernel<T, O, V, kBias><<<grid_for(rows), threads_for(c / V), 0, stream>>>(
      rows, c, g, x, lse, l, bias, d);
}

ffi::Error fwd_impl(const char* op, cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer labels,
                    ffi::Result<ffi::AnyBuffer> nll, ffi::Result<ffi::AnyBuffer> lse,
                    ffi::AnyBuffer* log_prob, int64_t out_type) {
  int64_t rows, c;
  const std::string err = check_fwd(x, labels, *nll, *lse, log_prob, out_type, &rows, &c);
  const ffi::DataType o = log_prob ? log_prob->element_type() : x.element_type();
  return checked_dispatch(op, err, x.element_type(), o, [&](auto tt, auto oo) {
    using T = decltype(tt);
    using O = decltype(oo);
    if (rows == 0) return ffi::Error::Success();
    constexpr int V = 16 / sizeof(T);
    const T* xp = x.reinterpret_data<T>();
    O* lp = log_prob ? log_prob->reinterpret_data<O>() : nullptr;
    const bool vec = c % V == 0 && aligned16<T>(xp) && (!lp || aligned16<O>(lp));
    auto* lab = labels.reinterpret_data<int32_t>();
    auto* n = nll->reinterpret_data<acc_t<T>>();
    auto* s = lse->reinterpret_data<acc_t<T>>();
    if (lp) {
      if (vec) launch_fwd<T, O, V, true>(stream, rows, c, xp, lab, n, s, lp);
      else launch_fwd<T, O, 1, true>(stream, rows, c, xp, lab, n, s, lp);
    } else if constexpr (std::is_same_v<T, O>) {  // no log_prob: one instantiation per T
      if (vec) launch_fwd<T, T, V, false>(stream, rows, c, xp, lab, n, s, nullptr);
      else launch_fwd<T, T, 1, false>(stream, rows, c, xp, lab, n, s, nullptr);
    }
    return launched(op);
  });
}

ffi::Error bwd_impl(const char* op, cudaStream_t stream, ffi::AnyBuffer g, ffi::AnyBuffer x,
                    ffi::AnyBuffer lse, ffi::AnyBuffer labels, const ffi::AnyBuffer* bias,
                    ffi::AnyBuffer* d, int64_t out_type) {
  int64_t rows, c;
  const std::string err = check_bwd(g, x, lse, labels, bias, *d, out_type, &rows, &c);
  return checked_dispatch(op, err, x.element_type(), d->element_type(), [&](auto tt, auto oo) {
    using T = decltype(tt);
    using O = decltype(oo);
    if (d->element_count() == 0) return ffi::Error::Success();
    constexpr int V = 16 / sizeof(T);
    const T* xp = x.reinterpret_data<T>();
    O* dp = d->reinterpret_data<O>();
    const O* bp = bias ? bias->reinterpret_data<O>() : nullptr;
    const bool vec = c % V == 0 && aligned16<T>(xp) && aligned16<O>(dp) && (!bp || aligned16<O>(bp));
    auto* gp = g.reinterpret_data<acc_t<T>>();
    auto* sp = lse.reinterpret_data<acc_t<T>>();
    auto* lab = labels.reinterpret_data<int32_t>();
    if (bp) {
      if (vec) launch_bwd<T, O, V, true>(stream, rows, c, gp, xp, sp, lab, bp, dp);
      else launch_bwd<T, O, 1, true>(stream, rows, c, gp, xp, sp, lab, bp, dp);
    } else {
      if (vec) launch_bwd<T, O, V, false>(stream, rows, c, gp, xp, sp, lab, bp, dp);
      else launch_bwd<T, O, 1, false>(stream, rows, c, gp, xp, sp, lab, bp, dp);
    }
    return launched(op);
  });
}

ffi::Error sce_fwd(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer labels,
                   ffi::Result<ffi::AnyBuffer> nll, ffi::Result<ffi::AnyBuffer> lse) {
  return fwd_impl("softmax_cross_entropy_rows", stream, x, labels, nll, lse, nullptr, 0);
}
ffi::Error sce_fwd_log_prob(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer labels,
                            ffi::Result<ffi::AnyBuffer> nll, ffi::Result<ffi::AnyBuffer> lse,
                            ffi::Result<ffi::AnyBuffer> log_prob, int64_t out_type) {
  return fwd_impl("softmax_cross_entropy_rows_log_prob", stream, x, labels, nll, lse,
                  &*log_prob, out_type);
}
ffi::Error sce_bwd(cudaStream_t stream, ffi::AnyBuffer g, ffi::AnyBuffer x, ffi::AnyBuffer lse,
                   ffi::AnyBuffer labels, ffi::Result<ffi::AnyBuffer> d, int64_t out_type) {
  return bwd_impl("softmax_cross_entropy_rows_grad", stream, g, x, lse, labels, nullptr, &*d,
                  out_type);
}
ffi::Error sce_bwd_bias(cudaStream_t stream, ffi::AnyBuffer g, ffi::AnyBuffer x,
                        ffi::AnyBuffer lse, ffi::AnyBuffer labels, ffi::AnyBuffer bias,
                        ffi::Result<ffi::AnyBuffer> d, int64_t out_type) {
  return bwd_impl("softmax_cross_entropy_rows_grad_bias", stream, g, x, lse, labels, &bias, &*d,
                  out_type);
}

}  // namespace

#define JAXOPS_CUDA_BIND ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()
XLA_FFI_DEFINE_HANDLER_SYMBOL(SceFwdCuda, sce_fwd, bind_fwd(JAXOPS_CUDA_BIND));
XLA_FFI_DEFINE_HANDLER_SYMBOL(SceFwdLogProbCuda, sce_fwd_log_prob, bind_fwd_log_prob(JAXOPS_CUDA_BIND));
XLA_FFI_DEFINE_HANDLER_SYMBOL(SceBwdCuda, sce_bwd, bind_bwd(JAXOPS_CUDA_BIND));
XLA_FFI_DEFINE_HANDLER_SYMBOL(SceBwdBiasCuda, sce_bwd_bias, bind_bwd_bias(JAXOPS_CUDA_BIND));
#undef JAXOPS_CUDA_BIND

void register_handlers(Registry& r) {
  r.add("jaxops_sce_fwd", SceFwdCuda);
  r.add("jaxops_sce_fwd_log_prob", SceFwdLogProbCuda);
  r.add("jaxops_sce_bwd", SceBwdCuda);
  r.add("jaxops_sce_bwd_bias", SceBwdBiasCuda);
}

}  // namespace jaxops::loss
