// The expert permutation's kernels: the stable expert-major layout (CUB radix sort by expert),
// row gathers and scatters in both directions (the scatter optionally writing the rows' MX
// values), and the weighted sums of a token's rows and of sorted segments (the exchange's layouts
// are exchange_layout.cu). Deterministic: sums run in a fixed order, counts are integer atomics.
#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include "ops/cuda/common.cuh"
#include "ops/cuda/fp8.cuh"
#include "ops/cuda/mx.cuh"
#include "ops/cuda/permute.h"
#include "ops/cuda/route.h"

namespace mt::cuda {

namespace {

__global__ void iota_kernel(int32_t* v, int64_t n) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i < n) v[i] = static_cast<int32_t>(i);
}

// Sorted position i of a choice -> its row: i itself when dense; padded, i moved from its
// expert's dense offset to its segment.
__global__ void permutation_kernel(const int32_t* sorted_choice, const int32_t* sorted_expert,
                                   const int64_t* offsets, const int64_t* segments, int64_t m,
                                   int k, int32_t* source_token, int32_t* row_of_choice) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i >= m) return;
  const int32_t choice = sorted_choice[i];
  const int32_t e = sorted_expert[i];
  if (e < 0) {  // not routed here: sorted after every expert's choices
    row_of_choice[choice] = -1;
    return;
  }
  int64_t row = i;
  if (segments) row += segments[e] - offsets[e];
  source_token[row] = choice / k;
  row_of_choice[choice] = static_cast<int32_t>(row);
}

// counts (e) -> each rounded up to a multiple of align, for the segments' scan.
__global__ void align_counts_kernel(const int64_t* counts, int e, int64_t align, int64_t* out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < e) out[i] = (counts[i] + align - 1) / align * align;
  if (i == e) out[i] = 0;
}

__global__ void histogram_kernel(const int32_t* expert_index, int64_t m, int64_t* counts) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i < m && expert_index[i] >= 0)
    atomicAdd(reinterpret_cast<unsigned long long*>(counts + expert_index[i]), 1ull);
}

// The same for few bins (experts, not the vocabulary): a shared histogram per block, then one
// global atomic per bin and block.
__global__ void histogram_shared_kernel(const int32_t* expert_index, int64_t m, int e,
                                        int64_t* counts) {
  extern __shared__ int hist[];
  zero_block_histogram(hist, e);
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < m;
       i += int64_t{gridDim.x} * blockDim.x)
    if (expert_index[i] >= 0) atomicAdd(&hist[expert_index[i]], 1);
  flush_block_histogram(hist, e, counts);
}

// dst[i] = src[index[i]] rows of `width` elements (16-byte chunks when aligned).
template <class T>
__global__ void gather_rows_kernel(const T* src, const int32_t* index, T* dst, int64_t rows,
                                   int64_t width) {
  const int64_t row = blockIdx.x;
  if (row >= rows) return;
  T* d = dst + row * width;
  if (index[row] < 0) {  // a choice not routed here
    for (int64_t c = threadIdx.x; c < width; c += blockDim.x) d[c] = T{};
    return;
  }
  const T* s = src + static_cast<int64_t>(index[row]) * width;
  for (int64_t c = threadIdx.x; c < width; c += blockDim.x) d[c] = s[c];
}

// Rows narrower than this many elements (a routing weight per row) are moved a thread per
// element: a block per row would leave nearly all its threads idle.
constexpr int64_t kNarrowRow = 32;

template <class T>
__global__ void gather_narrow_rows_kernel(const T* src, const int32_t* index, T* dst, int64_t rows,
                                          int64_t width) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < rows * width;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = i / width;
    const int32_t from = index[row];
    dst[i] = from < 0 ? T{} : src[static_cast<int64_t>(from) * width + (i - row * width)];
  }
}

template <class T>
__global__ void scatter_narrow_rows_kernel(const T* src, const int32_t* row_of_choice, int k,
                                           T* dst, int64_t tokens, int64_t width) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < tokens * width;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / width, c = i - t * width;
    const T v = src[i];
    for (int j = 0; j < k; ++j) {
      const int32_t row = row_of_choice[t * k + j];
      if (row >= 0) dst[static_cast<int64_t>(row) * width + c] = v;
    }
  }
}

// dst[row_of_choice[t, j]] = src[t] for j < k: one block per token, each source row read once
// and written k times (the expert-major permutation; a gather by destination row would read
// every token k times).
template <class T>
__global__ void scatter_token_rows_kernel(const T* src, const int32_t* row_of_choice, int k, T* dst,
                                          int64_t width) {
  const int64_t t = blockIdx.x;
  const int32_t* rows = row_of_choice + t * k;
  for (int64_t c = threadIdx.x; c < width; c += blockDim.x) {
    const T v = src[t * width + c];
    for (int j = 0; j < k; ++j)
      if (rows[j] >= 0) dst[static_cast<int64_t>(rows[j]) * width + c] = v;
  }
}

// The scatter that also writes the rows in a second form: with kFp8 their FP8 copies in 1 x 128
// blocks (kernels::Fp8RowsOut), else their MX values along dim0 (kernels::MxValuesOut; in place
// of the rows when mx.values is dst). A token's row is rounded once for its k copies. A thread
// moves 16 bytes of the row per step; every lane runs every step (a block's lanes shuffle its
// amax: four or eight for MX, 16 or 32 for FP8).
template <class T, bool kFp8>
__global__ void scatter_token_rows_quantized_kernel(const T* src, const int32_t* row_of_choice,
                                                    int k, T* dst, int64_t width,
                                                    kernels::MxValuesOut mx,
                                                    kernels::Fp8RowsOut fp8) {
  constexpr int P = Pack<T>::kSize;
  const int64_t t = blockIdx.x;
  const int32_t* rows = row_of_choice + t * k;
  T* values = static_cast<T*>(mx.values);
  for (int64_t c0 = 0; c0 < width; c0 += int64_t{blockDim.x} * P) {
    const int64_t c = c0 + threadIdx.x * P;
    const bool active = c < width;
    float v[P];
    if (active) {
      const uint4 raw = *reinterpret_cast<const uint4*>(src + t * width + c);
      if (kFp8 || values != dst)
        for (int j = 0; j < k; ++j)
          if (rows[j] >= 0) *reinterpret_cast<uint4*>(dst + rows[j] * width + c) = raw;
      const T* packed = reinterpret_cast<const T*>(&raw);  // the row's pack, read once
#pragma unroll
      for (int i = 0; i < P; ++i) v[i] = to_float(packed[i]);
    }
    if constexpr (kFp8) {
      const Fp8Lane<P> lane = fp8_lane<P>(v, active, fp8.rule);
      if (!active) continue;
      for (int j = 0; j < k; ++j)
        if (rows[j] >= 0) store_fp8_lane<P>(lane, rows[j], c, width, fp8);
    } else {
      mx_round_trip_lanes<P>(v, mx.rule, active);
      if (!active) continue;
      for (int j = 0; j < k; ++j)
        if (rows[j] >= 0) store_n<T, P>(values + static_cast<int64_t>(rows[j]) * width + c, v);
    }
  }
}

// out[t] = residual[t] + sum_j rows[row_of_choice[t, j]] (residual null: 0), fp32 math, one
// rounding; one block per token, P columns per step (16-byte packs when aligned).
template <class T, int P>
__global__ void token_sum_kernel(const T* rows, const int32_t* row_of_choice, const T* residual,
                                 int k, T* out, int64_t width) {
  const int64_t t = blockIdx.x;
  for (int64_t c = threadIdx.x * P; c < width; c += blockDim.x * P) {
    float acc[P] = {};
    if (residual) load_n<T, P>(residual + t * width + c, acc);
    for (int j = 0; j < k; ++j) {
      const int32_t row = row_of_choice[t * k + j];
      if (row < 0) continue;  // not routed here
      float x[P];
      load_n<T, P>(rows + static_cast<int64_t>(row) * width + c, x);
#pragma unroll
      for (int i = 0; i < P; ++i) acc[i] += x[i];
    }
    store_n<T, P>(out + t * width + c, acc);
  }
}

// out[s] += sum of rows[order[r]] for r in [offsets[s], offsets[s+1]), in order; one block per
// segment (empty segments return at once).
template <class T, class TOut>
__global__ void segment_sum_kernel(const T* rows, const int32_t* order, const int64_t* offsets,
                                   TOut* out, int64_t width) {
  const int64_t seg = blockIdx.x;
  const int64_t begin = offsets[seg], end = offsets[seg + 1];
  if (begin == end) return;
  for (int64_t c = threadIdx.x; c < width; c += blockDim.x) {
    float acc = to_float(out[seg * width + c]);
    for (int64_t r = begin; r < end; ++r)
      acc += to_float(rows[static_cast<int64_t>(order[r]) * width + c]);
    out[seg * width + c] = from_float<TOut>(acc);
  }
}

}  // namespace

namespace kernels {

// Workspace layout: counts, aligned counts i64 (e + 1 each, rounded to 256 B) | choice, keys_out,
// choice_out i32 (m each, each rounded to 256 B) | CUB's radix-sort scratch.
namespace {
size_t round256(size_t b) {
  return (b + 255) / 256 * 256;
}
}  // namespace

size_t permutation_workspace(int64_t m, int e) {
  size_t sort_bytes = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, static_cast<int32_t*>(nullptr),
                                  static_cast<int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
                                  static_cast<int32_t*>(nullptr), static_cast<int>(m));
  // The offsets' scan runs before the sort and shares its scratch.
  size_t scan_bytes = 0;
  cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, static_cast<int64_t*>(nullptr),
                                static_cast<int64_t*>(nullptr), e + 1);
  return 2 * round256(sizeof(int64_t) * (e + 1)) + 3 * round256(sizeof(int32_t) * m) +
         std::max(sort_bytes, scan_bytes);
}

cudaError_t expert_permutation(const int32_t* expert_index, int64_t m, int k, int e, int64_t align,
                               bool skips, void* workspace, size_t workspace_bytes, int64_t rows,
                               int32_t* source_token, int32_t* row_of_choice, int64_t* offsets,
                               int64_t* segments, cudaStream_t stream) {
  char* p = static_cast<char*>(workspace);
  auto* counts = reinterpret_cast<int64_t*>(p);  // e + 1: the last stays 0 for the total
  p += round256(sizeof(int64_t) * (e + 1));
  auto* aligned = reinterpret_cast<int64_t*>(p);
  p += round256(sizeof(int64_t) * (e + 1));
  auto* choice = reinterpret_cast<int32_t*>(p);
  auto* keys_out = reinterpret_cast<int32_t*>(p + round256(sizeof(int32_t) * m));
  auto* choice_out = reinterpret_cast<int32_t*>(p + 2 * round256(sizeof(int32_t) * m));
  void* sort_ws = p + 3 * round256(sizeof(int32_t) * m);
  size_t sort_bytes =
      workspace_bytes - (static_cast<char*>(sort_ws) - static_cast<char*>(workspace));
  if (cudaError_t err = cudaMemsetAsync(counts, 0, sizeof(int64_t) * (e + 1), stream);
      err != cudaSuccess)
    return err;
  if (m > 0 && e <= kernels::kMaxRoutedExperts)
    histogram_shared_kernel<<<static_cast<int>(std::min<int64_t>((m + 255) / 256, 2 * sm_count())),
                              256, sizeof(int) * e, stream>>>(expert_index, m, e, counts);
  else if (m > 0)
    histogram_kernel<<<(m + 255) / 256, 256, 0, stream>>>(expert_index, m, counts);
  // Parallel scan: the embedding backward sorts by token id, so e is the vocabulary (~150k).
  if (cudaError_t err =
          cub::DeviceScan::ExclusiveSum(sort_ws, sort_bytes, counts, offsets, e + 1, stream);
      err != cudaSuccess)
    return err;
  const bool padded = align > 1;
  if (padded) {
    align_counts_kernel<<<(e + 256) / 256, 256, 0, stream>>>(counts, e, align, aligned);
    if (cudaError_t err =
            cub::DeviceScan::ExclusiveSum(sort_ws, sort_bytes, aligned, segments, e + 1, stream);
        err != cudaSuccess)
      return err;
  }
  if (padded || skips) {  // padding rows (and rows past the routed ones) name no token
    if (cudaError_t err = cudaMemsetAsync(source_token, 0xFF, sizeof(int32_t) * rows, stream);
        err != cudaSuccess)
      return err;
  }
  if (m == 0) return cudaGetLastError();
  iota_kernel<<<(m + 255) / 256, 256, 0, stream>>>(choice, m);
  // Negative indices (not routed here) sort after every expert: their low bits are all ones,
  // above e - 1 once the key has a bit to spare.
  int bits = 1;
  while ((1 << bits) < e || (skips && (1 << bits) <= e)) ++bits;
  // LSD radix sort is stable: within an expert, choices stay in token order.
  if (cudaError_t err =
          cub::DeviceRadixSort::SortPairs(sort_ws, sort_bytes, expert_index, keys_out, choice,
                                          choice_out, static_cast<int>(m), 0, bits, stream);
      err != cudaSuccess)
    return err;
  permutation_kernel<<<(m + 255) / 256, 256, 0, stream>>>(choice_out, keys_out, offsets,
                                                          padded ? segments : nullptr, m, k,
                                                          source_token, row_of_choice);
  return cudaGetLastError();
}

cudaError_t gather_rows(DType s, const void* src, const int32_t* index, void* dst, int64_t rows,
                        int64_t width, cudaStream_t stream) {
  if (rows == 0 || width == 0) return cudaSuccess;
  dispatch_storage(s, [&](auto tag) {
    using T = decltype(tag);
    if (width < kNarrowRow)
      gather_narrow_rows_kernel<T><<<grid_for(rows * width), kBlock, 0, stream>>>(
          static_cast<const T*>(src), index, static_cast<T*>(dst), rows, width);
    else if (packable<T>(width, {src, dst}))  // rows as 16-byte units
      gather_rows_kernel<uint4><<<rows, kBlock, 0, stream>>>(static_cast<const uint4*>(src), index,
                                                             static_cast<uint4*>(dst), rows,
                                                             width / Pack<T>::kSize);
    else
      gather_rows_kernel<T><<<rows, kBlock, 0, stream>>>(static_cast<const T*>(src), index,
                                                         static_cast<T*>(dst), rows, width);
  });
  return cudaGetLastError();
}

cudaError_t scatter_token_rows(DType s, const void* src, const int32_t* row_of_choice,
                               int64_t tokens, int k, void* dst, int64_t width, MxValuesOut mx,
                               Fp8RowsOut fp8, cudaStream_t stream) {
  if (fp8.data &&
      (mx.values || width % kFp8Block != 0 || reinterpret_cast<uintptr_t>(fp8.data) % 8 != 0))
    return cudaErrorNotSupported;
  if (tokens == 0 || width == 0) return cudaSuccess;
  cudaError_t err = cudaSuccess;
  dispatch_storage(s, [&](auto tag) {
    using T = decltype(tag);
    if (fp8.data) {
      if (packable<T>(width, {src, dst}))
        scatter_token_rows_quantized_kernel<T, true><<<tokens, kBlock, 0, stream>>>(
            static_cast<const T*>(src), row_of_choice, k, static_cast<T*>(dst), width, mx, fp8);
      else
        err = cudaErrorNotSupported;
    } else if (mx.values) {
      if (width % kMxBlock == 0 && packable<T>(width, {src, dst, mx.values}))
        scatter_token_rows_quantized_kernel<T, false><<<tokens, kBlock, 0, stream>>>(
            static_cast<const T*>(src), row_of_choice, k, static_cast<T*>(dst), width, mx, fp8);
      else
        err = cudaErrorNotSupported;
    } else if (width < kNarrowRow) {
      scatter_narrow_rows_kernel<T><<<grid_for(tokens * width), kBlock, 0, stream>>>(
          static_cast<const T*>(src), row_of_choice, k, static_cast<T*>(dst), tokens, width);
    } else if (packable<T>(width, {src, dst})) {  // rows as 16-byte units
      scatter_token_rows_kernel<uint4>
          <<<tokens, kBlock, 0, stream>>>(static_cast<const uint4*>(src), row_of_choice, k,
                                          static_cast<uint4*>(dst), width / Pack<T>::kSize);
    } else {
      scatter_token_rows_kernel<T><<<tokens, kBlock, 0, stream>>>(
          static_cast<const T*>(src), row_of_choice, k, static_cast<T*>(dst), width);
    }
  });
  return err != cudaSuccess ? err : cudaGetLastError();
}

cudaError_t sum_token_rows(DType s, const void* rows, const int32_t* row_of_choice,
                           const void* residual, int64_t tokens, int k, void* out, int64_t width,
                           cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  dispatch_storage(s, [&](auto tag) {
    using T = decltype(tag);
    const T* r = static_cast<const T*>(rows);
    const T* res = static_cast<const T*>(residual);
    T* o = static_cast<T*>(out);
    if (packable<T>(width, {rows, out, residual ? residual : out}))
      token_sum_kernel<T, Pack<T>::kSize>
          <<<tokens, kBlock, 0, stream>>>(r, row_of_choice, res, k, o, width);
    else
      token_sum_kernel<T, 1><<<tokens, kBlock, 0, stream>>>(r, row_of_choice, res, k, o, width);
  });
  return cudaGetLastError();
}

cudaError_t segment_sum_rows(DType s, const void* rows, const int32_t* order,
                             const int64_t* offsets, int64_t segments, int64_t width, void* out,
                             bool out_f32, cudaStream_t stream) {
  if (segments == 0) return cudaSuccess;
  dispatch_storage(s, [&](auto tag) {
    using T = decltype(tag);
    if (out_f32)
      segment_sum_kernel<T, float><<<segments, 128, 0, stream>>>(
          static_cast<const T*>(rows), order, offsets, static_cast<float*>(out), width);
    else
      segment_sum_kernel<T, T><<<segments, 128, 0, stream>>>(static_cast<const T*>(rows), order,
                                                             offsets, static_cast<T*>(out), width);
  });
  return cudaGetLastError();
}

}  // namespace kernels
}  // namespace mt::cuda
