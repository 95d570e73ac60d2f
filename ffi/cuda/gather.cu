// CUDA handler of GatherGrad, with the semantics of ffi/cpu/gather.cc (gather.h). Deterministic:
// the same bits every run, no float atomics.
//
//   1. keys[p] = the row index p addresses (wrapped; V when dropped), pos[p] = p, sorted by key
//      with CUB's stable radix sort over the bits V needs: each row's positions end up
//      together, in increasing order (its run).
//   2. row_bounds: row_start[r] = the first sorted entry with key >= r (a binary search per
//      row), so row r's run is [row_start[r], row_start[r + 1]); row_start[V] counts the valid
//      entries. It also zeroes the arrival counters of step 3.
//   3. segment_sum, one launch, blocks of two kinds (and a range of columns each, 16-byte
//      vectors along the row):
//      - units: a run shorter than 2P entries is one unit; a longer run is cut into pieces of P
//        from its start, the last piece taking the remainder (P to 2P - 1 entries). P (32 to
//        256) comes from the shapes only: about N / V, so that uniform ids make whole runs.
//        The sorted entries are cut into chunks of P; a chunk block sums, in sorted order, the
//        units that start in its chunk (fewer than 3P entries) and writes each whole run's dX
//        row. A piece leaves its sum in the chunk's partial slot (a piece covers the rest of
//        its chunk, so a chunk starts at most one piece); the last of a run's piece blocks to
//        arrive (an integer counter) adds the run's partial sums in piece order and writes the
//        row. The order of every sum depends on the ids and shapes only.
//   0. Steps 1-2 run on a second stream of the device, created at the highest priority, while
//      XLA's stream sets dX = 0; XLA's stream waits for them before step 3. The sort is a
//      latency-bound chain of small kernels, the fill a bandwidth-bound grid that fills every
//      SM: kernels of one priority get SMs in launch order, so a sort launched beside the fill
//      at the same priority waits for the fill's blocks; at a higher priority its blocks go
//      first. Where no second stream can be had, everything runs on XLA's stream and step 3
//      adds blocks that write zeros to the rows no index addresses instead.
// Sums are in f32 (f64 for f64). Work buffers come from XLA's scratch allocator (CUB's temp size
// is known only here).
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/dispatch/dispatch_radix_sort.cuh>
#include <string>
#include <tuple>
#include <type_traits>

#include "jaxops/checks.h"
#include "jaxops/cuda_elem.cuh"
#include "jaxops/cuda_launch.h"
#include "jaxops/gather.h"
#include "jaxops/registry.h"

namespace jaxops::gather {
namespace {

constexpr int kUnroll = 8;      // dY rows loaded before they are summed: loads in flight
constexpr int kThreads = 128;   // threads per block, one 16-byte column vector each
constexpr int kMinPiece = 32;   // P's range (powers of two)
constexpr int kMaxPiece = 256;
constexpr int kZeroRows = 8;    // rows per zero-row block

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// CUB's radix sort tuned for the sizes here (N of 10^4 to 10^6): its own Hopper onesweep tile is
// 384 x 23 items, so 16384 keys run on 2 blocks and 65536 on 8 (about 11 us a pass, measured on
// an H100). Tiles of 256 x 8 spread each pass over 4.5x more blocks. Everything else is CUB's.
using SortOffset = cub::detail::choose_offset_t<int>;
struct SortPolicyHub {
  using Hub = cub::detail::radix::policy_hub<uint32_t, int32_t, SortOffset>;
  struct Policy : cub::ChainedPolicy<900, Policy, Policy>,
                  Hub::OnesweepSmallKeyTunedPolicy<
                      cub::detail::radix::sm90_small_key_tuning<4, 4, sizeof(SortOffset)>> {
    using OnesweepPolicy = cub::AgentRadixSortOnesweepPolicy<
        256, 8, uint32_t, 1, cub::RADIX_RANK_MATCH_EARLY_COUNTS_ANY,
        cub::BLOCK_SCAN_RAKING_MEMOIZE, cub::RADIX_SORT_STORE_DIRECT, ONESWEEP_RADIX_BITS>;
  };
  using MaxPolicy = Policy;
};
using Sort = cub::DispatchRadixSort<cub::SortOrder::Ascending, uint32_t, int32_t, SortOffset,
                                    cub::detail::identity_decomposer_t, SortPolicyHub>;

// P: the power of two in [kMinPiece, kMaxPiece] nearest above the mean run length N / V.
int piece_size(int64_t n, int64_t v) {
  int p = kMinPiece;
  while (p < kMaxPiece && p < ceil_div(n, v)) p *= 2;
  return p;
}

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

// row_start[r] for r in [0, V] (lower bound of r in the sorted keys); counters[:ncounters] = 0.
__global__ void row_bounds(const uint32_t* keys, int n, int64_t v, int32_t* row_start,
                           int32_t* counters, int64_t ncounters) {
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r <= v || r < ncounters;
       r += int64_t(gridDim.x) * blockDim.x) {
    if (r <= v) {
      int lo = 0, hi = n;
      while (lo < hi) {
        const int mid = int((unsigned(lo) + unsigned(hi)) / 2);
        if (int64_t(keys[mid]) < r) lo = mid + 1; else hi = mid;
      }
      row_start[r] = lo;
    }
    if (r < ncounters) counters[r] = 0;
  }
}

// Shapes of one call. Columns are VEC-element vectors of the [outer, inner] plane; column j is
// (o, iv) = (j / inner_vecs, j % inner_vecs). dY row p of column j: dy[(o*n + p)*inner + iv*VEC].
struct Dims {
  int64_t n, v, inner_vecs, cols;
  int piece;       // P
  int64_t chunks;  // ceil(n / P): the chunk blocks come first in the grid
};

template <typename T, int VEC>
__device__ void zero_rows(const int32_t* row_start, const Dims& d, int64_t r0, T* dx) {
  const int64_t inner = d.inner_vecs * VEC;
  const int64_t r1 = min(r0 + kZeroRows, d.v);
  acc_t<T> zero[VEC] = {};
  for (int64_t j = blockIdx.y * int64_t(blockDim.x) + threadIdx.x; j < d.cols;
       j += int64_t(gridDim.y) * blockDim.x) {
    const int64_t o = j / d.inner_vecs, iv = j - o * d.inner_vecs;
    T* dst = dx + o * d.v * inner + iv * VEC;
    for (int64_t r = r0; r < r1; ++r)
      if (row_start[r] == row_start[r + 1]) store_row<T, VEC>(dst + r * inner, zero);
  }
}

// At least 6 blocks an SM (5 for 8-wide rows, which would spill at 6): more dY loads in flight.
template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads, VEC >= 8 ? 5 : 6)
segment_sum(const uint32_t* keys, const int32_t* pos, const int32_t* row_start, Dims d,
            const T* dy, T* dx, acc_t<T>* partial, int32_t* counters) {
  using A = acc_t<T>;
  if (blockIdx.x >= d.chunks) {
    zero_rows<T, VEC>(row_start, d, (blockIdx.x - d.chunks) * int64_t(kZeroRows), dx);
    return;
  }
  const int P = d.piece;
  const int64_t c = blockIdx.x;
  const int begin = int(c * P), nvalid = row_start[d.v];
  if (begin >= nvalid) return;  // dropped entries only
  const int cend = min(begin + P, nvalid);

  __shared__ uint8_t s_flag[kMaxPiece];        // s_flag[t]: a unit starts at entry begin + t
  __shared__ uint32_t s_key[3 * kMaxPiece];    // keys and positions of the block's entries
  __shared__ int32_t s_pos[3 * kMaxPiece];
  __shared__ int s_first, s_end;               // first unit start (chunk-local), last unit end
  __shared__ int s_run, s_pieces;              // the run whose piece starts here; 0: no piece
  __shared__ bool s_last;
  if (threadIdx.x == 0) {
    s_first = P;
    s_end = 0;
    s_pieces = 0;
  }
  __syncthreads();
  for (int t = threadIdx.x; t < P; t += blockDim.x) {
    const int e = begin + t;
    bool start = false;
    if (e < cend) {
      const uint32_t k = keys[e];
      const int s = row_start[k], len = row_start[k + 1] - s;
      int end = s + len;
      if (len < 2 * P) {
        start = e == s;
      } else {
        const int m = len / P, jp = (e - s) / P;
        start = (e - s) % P == 0 && jp < m;
        if (jp < m - 1) end = e + P;
        if (start) {
          s_run = s;
          s_pieces = m;
        }
      }
      if (start) {
        atomicMin(&s_first, t);
        atomicMax(&s_end, end);
      }
    }
    s_flag[t] = start;
  }
  __syncthreads();
  if (s_first == P) return;  // inside a piece that started in an earlier chunk
  const int first = begin + s_first, len = s_end - first;  // len < 3P
  for (int l = threadIdx.x; l < len; l += blockDim.x) {
    s_key[l] = keys[first + l];
    s_pos[l] = pos[first + l];
  }
  __syncthreads();
  const int pieces = s_pieces;  // > 0: the last unit is a piece of a long run
  const int64_t inner = d.inner_vecs * VEC;
  for (int64_t j = blockIdx.y * int64_t(blockDim.x) + threadIdx.x; j < d.cols;
       j += int64_t(gridDim.y) * blockDim.x) {
    const int64_t o = j / d.inner_vecs, iv = j - o * d.inner_vecs;
    const T* src = dy + o * d.n * inner + iv * VEC;
    T* dst = dx + o * d.v * inner + iv * VEC;
    A acc[VEC] = {};
    int u = 0;  // start of the current unit
    // Ends the unit [u, e): its dX row, or the chunk's partial slot for a piece.
    auto flush = [&](int e) {
      if (e == len && pieces > 0) {
        A* p = partial + (c * d.cols + j) * VEC;
#pragma unroll
        for (int t = 0; t < VEC; ++t) p[t] = acc[t];
      } else {
        store_row<T, VEC>(dst + int64_t(s_key[u]) * inner, acc);
      }
#pragma unroll
      for (int t = 0; t < VEC; ++t) acc[t] = A(0);
      u = e;
    };
    for (int l0 = 0; l0 < len; l0 += kUnroll) {
      Pack<T, VEC> rows[kUnroll];
#pragma unroll
      for (int q = 0; q < kUnroll; ++q)
        if (l0 + q < len) rows[q] = load_pack<T, VEC>(src + int64_t(s_pos[l0 + q]) * inner);
#pragma unroll
      for (int q = 0; q < kUnroll; ++q) {
        const int l = l0 + q, t = s_first + l;
        if (l < len) {
          if (l > u && t < P && s_flag[t]) flush(l);
#pragma unroll
          for (int i = 0; i < VEC; ++i) acc[i] += to_acc(rows[q].v[i]);
        }
      }
    }
    flush(len);
  }
  if (pieces == 0) return;

  // The last piece block of the run to arrive adds the pieces' sums, in piece order.
  const int64_t c0 = s_run / P;  // piece q of the run sits in chunk c0 + q
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0)
    s_last = atomicAdd(&counters[c0 * gridDim.y + blockIdx.y], 1) == pieces - 1;
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  const uint32_t key = s_key[len - 1];
  for (int64_t j = blockIdx.y * int64_t(blockDim.x) + threadIdx.x; j < d.cols;
       j += int64_t(gridDim.y) * blockDim.x) {
    constexpr int kBatch = VEC >= 8 ? 4 : 8;  // partial rows loaded at once (registers)
    A acc[VEC] = {};
    for (int q0 = 0; q0 < pieces; q0 += kBatch) {
      A part[kBatch][VEC];
#pragma unroll
      for (int q = 0; q < kBatch; ++q)
        if (q0 + q < pieces) {
          const A* p = partial + ((c0 + q0 + q) * d.cols + j) * VEC;
#pragma unroll
          for (int t = 0; t < VEC; ++t) part[q][t] = __ldcg(p + t);  // L2: other SMs wrote it
        }
#pragma unroll
      for (int q = 0; q < kBatch; ++q)
        if (q0 + q < pieces) {
#pragma unroll
          for (int t = 0; t < VEC; ++t) acc[t] += part[q][t];
        }
    }
    const int64_t o = j / d.inner_vecs, iv = j - o * d.inner_vecs;
    store_row<T, VEC>(dx + (o * d.v + key) * inner + iv * VEC, acc);
  }
}

// Scratch: the call's buffers laid out in one ScratchAllocator allocation (the allocator costs
// host time per call: eight allocations a call made GatherGrad host-bound when each call is an
// executable of its own). It is freed after the call, in stream order.
struct Scratch {
  size_t total = 0;
  size_t add(size_t bytes) {  // the offset of a new buffer, 256-byte aligned
    const size_t at = total;
    total += (bytes + 255) / 256 * 256;
    return at;
  }
};

// The second stream of step 0, one per device, with its fork and join events.
struct SideStream {
  cudaStream_t stream = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr;
};
std::mutex side_mu;  // held from the fork until XLA's stream waits on the join

SideStream* side_stream(int dev) {
  static std::map<int, SideStream> streams;
  auto [it, fresh] = streams.try_emplace(dev);
  SideStream& s = it->second;
  if (fresh) {
    int current = 0, least = 0, greatest = 0;
    cudaGetDevice(&current);
    cudaSetDevice(dev);
    if (cudaDeviceGetStreamPriorityRange(&least, &greatest) != cudaSuccess ||
        cudaStreamCreateWithPriority(&s.stream, cudaStreamNonBlocking, greatest) != cudaSuccess ||
        cudaEventCreateWithFlags(&s.fork, cudaEventDisableTiming) != cudaSuccess ||
        cudaEventCreateWithFlags(&s.join, cudaEventDisableTiming) != cudaSuccess)
      s.stream = nullptr;
    cudaSetDevice(current);
    cudaGetLastError();  // a failure here only means: no side stream
  }
  return s.stream ? &s : nullptr;
}

// Where steps 1-2 run: the side stream once it waits for XLA's stream, or XLA's stream.
cudaStream_t fork_to_side(cudaStream_t main, SideStream* side) {
  if (side == nullptr) return main;
  if (cudaEventRecord(side->fork, main) == cudaSuccess &&
      cudaStreamWaitEvent(side->stream, side->fork) == cudaSuccess)
    return side->stream;
  cudaGetLastError();
  return main;
}

// Step 3's launch shape and buffers.
struct Reduce {
  Dims d;
  int threads;
  int64_t col_blocks, ncounters;
  size_t row_start, counters, partial;  // scratch offsets
};

template <typename T, int VEC>
Reduce plan_reduce(const View& w, Scratch& scratch) {
  Reduce r;
  r.d = Dims{w.n, w.v, w.inner / VEC, w.outer * (w.inner / VEC), piece_size(w.n, w.v), 0};
  r.d.chunks = ceil_div(w.n, r.d.piece);
  r.threads = int(r.d.cols >= kThreads ? kThreads : ceil_div(r.d.cols, 32) * 32);
  r.col_blocks = ceil_div(r.d.cols, r.threads) < 65535 ? ceil_div(r.d.cols, r.threads) : 65535;
  r.ncounters = r.d.chunks * r.col_blocks;
  r.row_start = scratch.add((w.v + 1) * sizeof(int32_t));
  r.counters = scratch.add(r.ncounters * sizeof(int32_t));
  // one slot per chunk (it starts at most one piece)
  r.partial = scratch.add(r.d.chunks * w.outer * w.inner * sizeof(acc_t<T>));
  return r;
}

template <typename T, int VEC>
ffi::Error reduce(const char* op, cudaStream_t stream, cudaStream_t sort_stream,
                  SideStream* side, const Reduce& r, char* base, const View& w,
                  const uint32_t* keys, const int32_t* pos, const T* dy, T* dx) {
  const Dims& d = r.d;
  const int threads = r.threads;
  const int64_t col_blocks = r.col_blocks, ncounters = r.ncounters;
  auto* row_start = reinterpret_cast<int32_t*>(base + r.row_start);
  auto* counters = reinterpret_cast<int32_t*>(base + r.counters);
  auto* partial = reinterpret_cast<acc_t<T>*>(base + r.partial);
  const int64_t bound_items = w.v + 1 > ncounters ? w.v + 1 : ncounters;
  const int64_t bound_blocks = ceil_div(bound_items, 256) < 8192 ? ceil_div(bound_items, 256) : 8192;
  row_bounds<<<unsigned(bound_blocks), 256, 0, sort_stream>>>(keys, int(w.n), w.v, row_start,
                                                              counters, ncounters);
  const bool forked = sort_stream != stream;
  if (forked) {
    cudaError_t e = cudaEventRecord(side->join, sort_stream);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(stream, side->join);
    if (e != cudaSuccess) {
      cudaStreamSynchronize(sort_stream);
      return cuda_error(op, e);
    }
  }
  const int64_t zero_blocks = forked ? 0 : ceil_div(w.v, kZeroRows);
  const dim3 grid(unsigned(d.chunks + zero_blocks), unsigned(col_blocks));
  segment_sum<T, VEC><<<grid, threads, 0, stream>>>(keys, pos, row_start, d, dy, dx, partial,
                                                    counters);
  return cuda_error(op, cudaGetLastError());
}

// The sort's temporary bytes for n keys of end_bit bits: CUB's size query costs host time a
// call, so it is asked once per (device, n, end_bit). Guarded by side_mu.
size_t sort_temp_bytes(int dev, int64_t n, int end_bit, cudaStream_t stream, cudaError_t* err) {
  static std::map<std::tuple<int, int64_t, int>, size_t> known;
  const auto key = std::make_tuple(dev, n, end_bit);
  if (auto it = known.find(key); it != known.end()) return it->second;
  size_t bytes = 0;
  cub::DoubleBuffer<uint32_t> keys(nullptr, nullptr);
  cub::DoubleBuffer<int32_t> pos(nullptr, nullptr);
  *err = Sort::Dispatch(nullptr, bytes, keys, pos, SortOffset(n), 0, end_bit, true, stream);
  if (*err == cudaSuccess) known[key] = bytes;
  return bytes;
}

template <typename T, typename I>
ffi::Error run(const char* op, cudaStream_t stream, ffi::ScratchAllocator& alloc, int dev,
               const View& w, const I* idx, const T* dy, T* dx, SideStream* side) {
  constexpr int kVec = 16 / sizeof(T);
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool vec = w.inner % kVec == 0 && aligned(dy) && aligned(dx);

  int end_bit = 1;  // bits that hold every key, V included
  while (end_bit < 32 && (uint64_t(1) << end_bit) <= uint64_t(w.v)) ++end_bit;
  cudaError_t err = cudaSuccess;
  const size_t temp_bytes = sort_temp_bytes(dev, w.n, end_bit, stream, &err);
  if (err != cudaSuccess) return cuda_error(op, err);

  // key and position buffers, two of each (the sort ping-pongs between them), the sort's
  // temporary storage and step 3's buffers, in one allocation
  Scratch scratch;
  const size_t keys0 = scratch.add(w.n * sizeof(uint32_t)), keys1 = scratch.add(w.n * sizeof(uint32_t));
  const size_t pos0 = scratch.add(w.n * sizeof(int32_t)), pos1 = scratch.add(w.n * sizeof(int32_t));
  const size_t temp_at = scratch.add(temp_bytes);
  const Reduce plan = vec ? plan_reduce<T, kVec>(w, scratch) : plan_reduce<T, 1>(w, scratch);
  // XLA's scratch allocator takes alignments of 16 at most here (64 failed on an H100, jax
  // 0.11.2); CUB aligns its temporary storage inside, the other buffers need 16
  auto block = alloc.Allocate(scratch.total, 16);
  if (!block.has_value())
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      std::string(op) + ": out of scratch memory (" +
                          std::to_string(scratch.total) + " bytes)");
  char* base = static_cast<char*>(*block);
  cub::DoubleBuffer<uint32_t> keys(reinterpret_cast<uint32_t*>(base + keys0),
                                   reinterpret_cast<uint32_t*>(base + keys1));
  cub::DoubleBuffer<int32_t> pos(reinterpret_cast<int32_t*>(base + pos0),
                                 reinterpret_cast<int32_t*>(base + pos1));

  // The fill is launched first: the sort's blocks, at a higher priority, go ahead of its rest.
  const cudaStream_t sort_stream = fork_to_side(stream, side);
  if (sort_stream != stream)
    err = cudaMemsetAsync(dx, 0, size_t(w.outer) * w.v * w.inner * sizeof(T), stream);
  const int64_t key_blocks = ceil_div(w.n, 256) < 4096 ? ceil_div(w.n, 256) : 4096;
  if (err == cudaSuccess) {
    make_keys<I><<<unsigned(key_blocks), 256, 0, sort_stream>>>(idx, w.n, w.v, keys.Current(),
                                                                pos.Current());
    size_t bytes = temp_bytes;
    err = Sort::Dispatch(base + temp_at, bytes, keys, pos, SortOffset(w.n), 0, end_bit, true,
                         sort_stream);
  }
  if (err != cudaSuccess) {
    cudaStreamSynchronize(sort_stream);  // never leave the sort racing the scratch's reuse
    return cuda_error(op, err);
  }
  return vec ? reduce<T, kVec>(op, stream, sort_stream, side, plan, base, w, keys.Current(),
                              pos.Current(), dy, dx)
             : reduce<T, 1>(op, stream, sort_stream, side, plan, base, w, keys.Current(),
                            pos.Current(), dy, dx);
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
    if (w.n == 0)  // no index: dX = 0 (otherwise every row is written once below)
      return cuda_error(op, cudaMemsetAsync(dx->untyped_data(), 0, dx->size_bytes(), stream));
    int dev = 0;
    if (cudaError_t e = cudaStreamGetDevice(stream, &dev); e != cudaSuccess)
      return cuda_error(op, e);
    std::lock_guard<std::mutex> lock(side_mu);
    SideStream* side = side_stream(dev);
    if (indices.element_type() == ffi::DataType::S32)
      return run<T>(op, stream, alloc, dev, w, indices.reinterpret_data<int32_t>(),
                    dy.reinterpret_data<T>(), dx->reinterpret_data<T>(), side);
    return run<T>(op, stream, alloc, dev, w, indices.reinterpret_data<int64_t>(),
                  dy.reinterpret_data<T>(), dx->reinterpret_data<T>(), side);
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
