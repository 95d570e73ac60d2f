// CUDA handler of GatherGrad, with the semantics of ffi/cpu/gather.cc (gather.h). Deterministic:
// the same bits every run, no float atomics.
//
//   1. dX = 0 (cudaMemsetAsync); rows no index addresses stay zero.
//   2. keys[p] = the row index p addresses (wrapped; V when dropped), pos[p] = p, sorted by key
//      with CUB's stable radix sort: each row's positions end up together, in increasing order.
//   3. chunk_sum: the sorted entries are cut into chunks of kChunk. A block takes one chunk (and
//      a range of columns, 16-byte vectors along the row) and sums the dY rows of each run of
//      equal keys in sorted order, in f32 (f64 for f64). A run wholly inside the chunk is written
//      to dX; a run crossing the chunk's start or end leaves its partial sum in the workspace.
//      Every block reads the same number of rows, however skewed the ids are (Zipf heads).
//   4. combine: for each run that crosses chunks, the chunk where it starts adds the partial
//      sums of the chunks it spans, in chunk order, and writes the dX row.
// The grouping depends on shapes only, so results are reproducible across runs and devices.
// Work buffers come from XLA's scratch allocator (CUB's temp size is known only here).
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <cstring>
#include <cub/device/device_radix_sort.cuh>
#include <string>
#include <type_traits>

#include "jaxops/checks.h"
#include "jaxops/cuda_elem.cuh"
#include "jaxops/cuda_launch.h"
#include "jaxops/gather.h"
#include "jaxops/registry.h"

namespace jaxops::gather {
namespace {

constexpr int kChunk = 32;     // sorted entries per chunk_sum block
constexpr int kUnroll = 8;     // dY rows loaded before they are summed: loads in flight
constexpr int kThreads = 128;  // threads per block, one 16-byte column vector each
constexpr uint32_t kNoKey = UINT32_MAX;  // never a row index (V < INT32_MAX)

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// dY is read once: 16-byte loads bypass L1 and are evicted first from L2.
template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> load_pack(const T* p) {
  if constexpr (sizeof(Pack<T, VEC>) == 16) {
    const uint4 w = __ldcs(reinterpret_cast<const uint4*>(p));
    Pack<T, VEC> r;
    memcpy(&r, &w, 16);
    return r;
  } else {
    return *reinterpret_cast<const Pack<T, VEC>*>(p);
  }
}

template <typename T, int VEC>
__device__ __forceinline__ void store_row(T* p, const acc_t<T> (&acc)[VEC]) {
  Pack<T, VEC> out;
#pragma unroll
  for (int t = 0; t < VEC; ++t) out.v[t] = from_acc<T>(acc[t]);
  *reinterpret_cast<Pack<T, VEC>*>(p) = out;
}

template <typename I>
__global__ void make_keys(const I* idx, int64_t n, int64_t v, uint32_t* keys, int32_t* pos) {
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < n;
       p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t k = wrap_index(static_cast<int64_t>(idx[p]), v);
    keys[p] = k < 0 ? uint32_t(v) : uint32_t(k);  // dropped: key V, sorted last, never written
    pos[p] = int32_t(p);
  }
}

// Shapes of one call. Columns are VEC-element vectors of the [outer, inner] plane; column j is
// (o, iv) = (j / inner_vecs, j % inner_vecs). dY row p of column j: dy[(o*n + p)*inner + iv*VEC].
struct Dims {
  int64_t n, v, inner_vecs, cols;
};

// Workspace of partial sums: [chunk][slot][column][VEC]; slot 0 holds the chunk's first run when
// it started in an earlier chunk, slot 1 its last run when it starts here and goes on.
template <typename A, int VEC>
__device__ __forceinline__ A* partial_at(A* partial, int64_t chunk, int slot, int64_t j,
                                         int64_t cols) {
  return partial + ((chunk * 2 + slot) * cols + j) * VEC;
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads)
chunk_sum(const uint32_t* keys, const int32_t* pos, Dims d, const T* dy, T* dx,
          acc_t<T>* partial) {
  using A = acc_t<T>;
  // s_key[0]: the key before the chunk, s_key[1..len]: the chunk's, s_key[len+1]: the one after
  __shared__ uint32_t s_key[kChunk + 2];
  __shared__ int32_t s_pos[kChunk];
  const int64_t chunk = blockIdx.x, begin = chunk * kChunk;
  const int len = int(min(int64_t(kChunk), d.n - begin));
  for (int t = threadIdx.x; t < len; t += blockDim.x) {
    s_key[t + 1] = keys[begin + t];
    s_pos[t] = pos[begin + t];
  }
  if (threadIdx.x == 0) {
    s_key[0] = begin > 0 ? keys[begin - 1] : kNoKey;
    s_key[len + 1] = begin + len < d.n ? keys[begin + len] : kNoKey;
  }
  __syncthreads();

  const int64_t inner = d.inner_vecs * VEC;
  for (int64_t j = blockIdx.y * int64_t(blockDim.x) + threadIdx.x; j < d.cols;
       j += int64_t(gridDim.y) * blockDim.x) {
    const int64_t o = j / d.inner_vecs, iv = j - o * d.inner_vecs;
    const T* src = dy + o * d.n * inner + iv * VEC;
    T* dst = dx + o * d.v * inner + iv * VEC;
    A acc[VEC] = {};
    int run_start = 0;
    // Ends the run [run_start, e) of key `key`: to dX when whole, else to its partial slot.
    auto flush = [&](int e, uint32_t key) {
      if (key < uint32_t(d.v)) {
        const bool before = run_start == 0 && s_key[0] == key;
        const bool after = e == len && s_key[len + 1] == key;
        if (!before && !after) {
          store_row<T, VEC>(dst + int64_t(key) * inner, acc);
        } else {
          A* p = partial_at<A, VEC>(partial, chunk, before ? 0 : 1, j, d.cols);
#pragma unroll
          for (int t = 0; t < VEC; ++t) p[t] = acc[t];
        }
      }
#pragma unroll
      for (int t = 0; t < VEC; ++t) acc[t] = A(0);
      run_start = e;
    };
    for (int e0 = 0; e0 < len; e0 += kUnroll) {
      Pack<T, VEC> rows[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (e0 + u < len) rows[u] = load_pack<T, VEC>(src + int64_t(s_pos[e0 + u]) * inner);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int e = e0 + u;
        if (e < len) {
          if (e > run_start && s_key[e + 1] != s_key[e]) flush(e, s_key[e]);
#pragma unroll
          for (int t = 0; t < VEC; ++t) acc[t] += to_acc(rows[u].v[t]);
        }
      }
    }
    flush(len, s_key[len]);
  }
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads)
combine(const uint32_t* keys, Dims d, const acc_t<T>* partial, T* dx) {
  using A = acc_t<T>;
  const int64_t chunk = blockIdx.x, begin = chunk * kChunk;
  const int64_t end = min(begin + kChunk, d.n);
  const uint32_t key = keys[end - 1];
  // Only a run that goes on past this chunk and starts in it is combined here.
  if (key >= uint32_t(d.v) || end >= d.n || keys[end] != key) return;
  if (begin > 0 && keys[begin - 1] == key) return;
  // The last chunk the run reaches: the largest c with keys[c * kChunk] == key (keys are
  // sorted; chunk + 1 starts inside the run). A binary search, so that the partial-sum loads
  // below do not wait on one another.
  int64_t last = chunk + 1, hi = (d.n - 1) / kChunk;
  while (last < hi) {
    const int64_t mid = (last + hi + 1) / 2;
    if (keys[mid * kChunk] == key) last = mid; else hi = mid - 1;
  }
  const int64_t inner = d.inner_vecs * VEC;
  for (int64_t j = blockIdx.y * int64_t(blockDim.x) + threadIdx.x; j < d.cols;
       j += int64_t(gridDim.y) * blockDim.x) {
    A acc[VEC];
    const A* p = partial_at<const A, VEC>(partial, chunk, 1, j, d.cols);
#pragma unroll
    for (int t = 0; t < VEC; ++t) acc[t] = p[t];
#pragma unroll 8
    for (int64_t c = chunk + 1; c <= last; ++c) {  // the chunks the run spans, in order
      const A* q = partial_at<const A, VEC>(partial, c, 0, j, d.cols);
#pragma unroll
      for (int t = 0; t < VEC; ++t) acc[t] += q[t];
    }
    const int64_t o = j / d.inner_vecs, iv = j - o * d.inner_vecs;
    store_row<T, VEC>(dx + (o * d.v + key) * inner + iv * VEC, acc);
  }
}

// Scratch buffers; the ScratchAllocator frees them after the call, in stream order.
struct Scratch {
  ffi::ScratchAllocator& alloc;
  bool failed = false;
  template <typename P>
  P* get(size_t bytes) {
    // XLA refuses alignments above 64 bytes; CUB aligns its own temp storage inside
    auto p = alloc.Allocate(bytes > 0 ? bytes : 1, 16);
    if (!p.has_value()) failed = true;
    return p.has_value() ? static_cast<P*>(*p) : nullptr;
  }
};

template <typename T, int VEC>
cudaError_t reduce(const uint32_t* keys, const int32_t* pos, Dims d, const T* dy, T* dx,
                   acc_t<T>* partial, cudaStream_t stream) {
  const int threads = int(d.cols >= kThreads ? kThreads : ceil_div(d.cols, 32) * 32);
  const dim3 grid(unsigned(ceil_div(d.n, kChunk)),
                  unsigned(ceil_div(d.cols, threads) < 65535 ? ceil_div(d.cols, threads) : 65535));
  chunk_sum<T, VEC><<<grid, threads, 0, stream>>>(keys, pos, d, dy, dx, partial);
  combine<T, VEC><<<grid, threads, 0, stream>>>(keys, d, partial, dx);
  return cudaGetLastError();
}

template <typename T, typename I>
ffi::Error run(const char* op, cudaStream_t stream, Scratch& scratch, const View& w,
               const I* idx, const T* dy, T* dx) {
  constexpr int kVec = 16 / sizeof(T);
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool vec = w.inner % kVec == 0 && aligned(dy) && aligned(dx);
  const int width = vec ? kVec : 1;
  const Dims d{w.n, w.v, w.inner / width, w.outer * (w.inner / width)};
  const int64_t chunks = ceil_div(w.n, kChunk);

  auto* keys_in = scratch.get<uint32_t>(w.n * sizeof(uint32_t));
  auto* keys = scratch.get<uint32_t>(w.n * sizeof(uint32_t));
  auto* pos_in = scratch.get<int32_t>(w.n * sizeof(int32_t));
  auto* pos = scratch.get<int32_t>(w.n * sizeof(int32_t));
  auto* partial = scratch.get<acc_t<T>>(chunks * 2 * w.outer * w.inner * sizeof(acc_t<T>));
  if (scratch.failed) return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                                        std::string(op) + ": out of scratch memory");

  const int64_t key_blocks = ceil_div(w.n, 256) < 4096 ? ceil_div(w.n, 256) : 4096;
  make_keys<I><<<unsigned(key_blocks), 256, 0, stream>>>(idx, w.n, w.v, keys_in, pos_in);
  int end_bit = 1;  // bits that hold every key, V included
  while (end_bit < 32 && (uint64_t(1) << end_bit) <= uint64_t(w.v)) ++end_bit;
  size_t temp_bytes = 0;
  cudaError_t err = cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys_in, keys, pos_in,
                                                    pos, int(w.n), 0, end_bit, stream);
  void* temp = scratch.get<void>(temp_bytes);
  if (scratch.failed) return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                                        std::string(op) + ": out of scratch memory");
  if (err == cudaSuccess)
    err = cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, keys, pos_in, pos, int(w.n),
                                          0, end_bit, stream);
  if (err == cudaSuccess)
    err = vec ? reduce<T, kVec>(keys, pos, d, dy, dx, partial, stream)
              : reduce<T, 1>(keys, pos, d, dy, dx, partial, stream);
  return cuda_error(op, err);
}

ffi::Error gather_grad_cuda(cudaStream_t stream, ffi::ScratchAllocator alloc,
                            ffi::AnyBuffer indices, ffi::AnyBuffer dy,
                            ffi::Result<ffi::AnyBuffer> dx, int64_t axis, int64_t v) {
  const char* op = "gather_grad";
  View w;
  std::string err = check_args(indices, dy, *dx, axis, v, &w);
  if (err.empty() && (w.n >= INT32_MAX || w.v >= INT32_MAX))
    err = "the number of indices and dX's size along axis must be < 2^31 - 1";
  return checked_dispatch(op, err, dy.element_type(), [&](auto tag) {
    using T = decltype(tag);
    if (dx->element_count() == 0) return ffi::Error::Success();
    cudaError_t e = cudaMemsetAsync(dx->untyped_data(), 0, dx->size_bytes(), stream);
    if (e != cudaSuccess) return cuda_error(op, e);
    if (w.n == 0 || w.outer * w.inner == 0) return ffi::Error::Success();
    Scratch scratch{alloc};
    if (indices.element_type() == ffi::DataType::S32)
      return run<T>(op, stream, scratch, w, indices.reinterpret_data<int32_t>(),
                    dy.reinterpret_data<T>(), dx->reinterpret_data<T>());
    return run<T>(op, stream, scratch, w, indices.reinterpret_data<int64_t>(),
                  dy.reinterpret_data<T>(), dx->reinterpret_data<T>());
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GatherGradCuda, gather_grad_cuda,
                              bind_args(ffi::Ffi::Bind()
                                            .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                            .Ctx<ffi::ScratchAllocator>()));

void register_handlers(Registry& r) {
  r.add("jaxops_gather_grad", GatherGradCuda);
}

}  // namespace jaxops::gather
