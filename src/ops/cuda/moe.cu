// The MoE layer's own kernels: routing (softmax, top-k, renormalisation, counts), the stable
// expert-major permutation (CUB radix sort by expert), row gathers in both directions, the
// weighted combine and its backward, and the router backward. Every result is deterministic:
// sums run in a fixed order, counts are integer atomics.
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include "ops/cuda/common.cuh"
#include "ops/cuda/mx.cuh"

namespace mt::cuda {

namespace {

constexpr int kMaxTopK = kernels::kMaxRoutedTopK;
constexpr int kRouterWarps = 16;  // warps per block of the routing kernels

// Experts per lane of a warp-per-token routing kernel: lane L holds experts L, L + 32, ...
// (coalesced loads); two instantiations, up to 128 and up to 1024 experts.
constexpr int kMaxExperts = kernels::kMaxRoutedExperts;
constexpr int per_lane_for(int e) {
  return e <= 128 ? 4 : kMaxExperts / 32;
}

// Element i of a register array with a runtime index, without spilling it to local memory.
template <int N>
__device__ __forceinline__ float select(const float (&v)[N], int i) {
  float out = 0.f;
#pragma unroll
  for (int j = 0; j < N; ++j)
    if (j == i) out = v[j];
  return out;
}

// A block's shared histogram of e bins (dynamic shared memory): zeroed at the start, then added
// to the global counts with one atomic per non-empty bin (many choices on few addresses would
// serialise on global atomics).
__device__ __forceinline__ void zero_block_histogram(int* hist, int e) {
  for (int c = threadIdx.x; c < e; c += blockDim.x) hist[c] = 0;
  __syncthreads();
}

__device__ __forceinline__ void flush_block_histogram(const int* hist, int e, int64_t* counts) {
  __syncthreads();
  for (int c = threadIdx.x; c < e; c += blockDim.x)
    if (hist[c] != 0)
      atomicAdd(reinterpret_cast<unsigned long long*>(counts + c),
                static_cast<unsigned long long>(hist[c]));
}

// One warp per token: softmax over the lanes' experts, then k rounds of a warp arg-max over the
// biased scores not yet taken (ties: the lower expert, as the CPU's stable order), lane j keeping
// choice j. Counts go to a per-block shared histogram first: one global atomic per expert and
// block instead of one per choice (128k choices on 128 addresses serialise).
template <int kPerLane>
__global__ void router_kernel(const float* logits, const float* bias, int64_t n, int e, int k,
                              bool norm_topk, ops::RoutingMode mode, float* scores, int32_t* index,
                              float* weight, int64_t* counts) {
  extern __shared__ int hist[];
  zero_block_histogram(hist, e);
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t{gridDim.x} * (blockDim.x / 32);
  for (int64_t t = blockIdx.x * int64_t{blockDim.x / 32} + threadIdx.x / 32; t < n; t += warps) {
    const float* l = logits + t * e;
    float s[kPerLane];
    float m = -INFINITY;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int c = lane + 32 * i;
      s[i] = c < e ? l[c] : -INFINITY;
      m = fmaxf(m, s[i]);
    }
    m = warp_max(m);
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      s[i] = lane + 32 * i < e ? expf(s[i] - m) : 0.f;
      sum += s[i];
    }
    sum = warp_sum(sum);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int c = lane + 32 * i;
      s[i] /= sum;
      if (c < e) scores[t * e + c] = s[i];
    }
    uint32_t taken = 0;  // bit i: expert lane + 32 i already chosen
    float wsum = 0.f, my_score = 0.f;
    int my_expert = 0;
    for (int j = 0; j < k; ++j) {
      int best = -1;
      float best_key = 0.f, best_score = 0.f;
      if (mode != ops::RoutingMode::kLearned) {
        best = ops::fixed_choice(mode, t, j, k, e);
        best_score = __shfl_sync(0xffffffffu, select(s, best / 32), best % 32);
      } else {
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
          const int c = lane + 32 * i;
          if (c >= e || (taken >> i & 1u)) continue;
          const float key = s[i] + (bias ? bias[c] : 0.f);
          if (best < 0 || key > best_key) best = c, best_key = key, best_score = s[i];
        }
        for (int o = 16; o > 0; o >>= 1) {
          const int oc = __shfl_xor_sync(0xffffffffu, best, o);
          const float ok = __shfl_xor_sync(0xffffffffu, best_key, o);
          const float os = __shfl_xor_sync(0xffffffffu, best_score, o);
          if (oc >= 0 && (best < 0 || ok > best_key || (ok == best_key && oc < best)))
            best = oc, best_key = ok, best_score = os;
        }
        // NaN keys break the order's symmetry: lane 0's answer is everyone's.
        best = __shfl_sync(0xffffffffu, best, 0);
        best_score = __shfl_sync(0xffffffffu, best_score, 0);
        if (best % 32 == lane) taken |= 1u << (best / 32);
      }
      if (lane == j) my_expert = best, my_score = best_score;
      wsum += best_score;
    }
    if (lane < k) {
      index[t * k + lane] = my_expert;
      weight[t * k + lane] = norm_topk ? my_score / wsum : my_score;
      atomicAdd(&hist[my_expert], 1);
    }
  }
  flush_block_histogram(hist, e, counts);
}

// score_sum[c] = sum over tokens of scores[t, c]: partial sums over kSumChunks row chunks
// (enough blocks to fill the GPU), then the chunks in order. Deterministic.
constexpr int kSumChunks = 128;

__global__ void column_sum_partial_kernel(const float* scores, int64_t n, int e, float* partial) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= e) return;
  const int64_t rows = (n + gridDim.y - 1) / gridDim.y;
  const int64_t begin = blockIdx.y * rows, end = min(n, begin + rows);
  float s = 0.f;
  for (int64_t t = begin; t < end; ++t) s += scores[t * e + c];
  partial[blockIdx.y * e + c] = s;
}

__global__ void column_sum_final_kernel(const float* partial, int chunks, int e, float* out) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= e) return;
  float s = 0.f;
  for (int k = 0; k < chunks; ++k) s += partial[k * e + c];
  out[c] = s;
}

// One warp per token, lanes over experts as the forward: d(score) = the aux term plus the
// combine weights' gradient through the renormalisation, then the softmax backward.
template <int kPerLane>
__global__ void router_backward_kernel(const float* scores, const int32_t* index,
                                       const float* dweight, const int64_t* counts,
                                       double aux_scale, int64_t n, int e, int k, bool norm_topk,
                                       float* dlogits) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t{gridDim.x} * (blockDim.x / 32);
  for (int64_t t = blockIdx.x * int64_t{blockDim.x / 32} + threadIdx.x / 32; t < n; t += warps) {
    const float* s_row = scores + t * e;
    float s[kPerLane], ds[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int c = lane + 32 * i;
      s[i] = c < e ? s_row[c] : 0.f;
      ds[i] = c < e ? static_cast<float>(aux_scale * counts[c]) : 0.f;
    }
    // Lane j < k holds choice j.
    int chosen = 0;
    float dw = 0.f, sc = 0.f;
    if (lane < k) {
      chosen = index[t * k + lane];
      dw = dweight[t * k + lane];
      sc = s_row[chosen];
    }
    float add = dw;
    if (norm_topk) {
      const float sum = warp_sum(sc);
      const float dot = warp_sum(dw * sc / sum);
      add = (dw - dot) / sum;
    }
    for (int j = 0; j < k; ++j) {
      const int c = __shfl_sync(0xffffffffu, chosen, j);
      const float a = __shfl_sync(0xffffffffu, add, j);
      if (c % 32 == lane) {
#pragma unroll
        for (int i = 0; i < kPerLane; ++i)
          if (i == c / 32) ds[i] += a;
      }
    }
    float inner = 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) inner += ds[i] * s[i];
    inner = warp_sum(inner);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int c = lane + 32 * i;
      if (c < e) dlogits[t * e + c] = s[i] * (ds[i] - inner);
    }
  }
}

// One block: per-thread partial sums in double, then a fixed tree (deterministic).
__global__ void add_aux_stats_kernel(const int64_t* counts, const float* score_sum, int e,
                                     int64_t* pooled_counts, float* pooled_sum) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= e) return;
  pooled_counts[c] += counts[c];
  pooled_sum[c] += score_sum[c];
}

__global__ void aux_loss_kernel(const int64_t* counts, const float* score_sum, int e, double scale,
                                double* out) {
  double s = 0;
  for (int c = threadIdx.x; c < e; c += kBlock)
    s += static_cast<double>(counts[c]) * static_cast<double>(score_sum[c]);
  s = block_sum_fixed_order(s);
  if (threadIdx.x == 0) *out = scale * s;
}

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

__global__ void convert_kernel_f32_bf16(const float* src, __nv_bfloat16* dst, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    dst[i] = __float2bfloat16_rn(src[i]);
}

__global__ void convert_kernel_bf16_f32(const __nv_bfloat16* src, float* dst, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    dst[i] = __bfloat162float(src[i]);
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

// The scatter that also writes the rows' MX values along dim0 (kernels::MxValuesOut): a token's
// row is rounded once for its k copies. A thread moves 16 bytes of the row per step; every lane
// runs every step (a block's four or eight lanes shuffle its amax).
template <class T>
__global__ void scatter_token_rows_mx_kernel(const T* src, const int32_t* row_of_choice, int k,
                                             T* dst, int64_t width, kernels::MxValuesOut mx) {
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
      if (values != dst)
        for (int j = 0; j < k; ++j)
          if (rows[j] >= 0) *reinterpret_cast<uint4*>(dst + rows[j] * width + c) = raw;
      const T* packed = reinterpret_cast<const T*>(&raw);  // the row's pack, read once
#pragma unroll
      for (int i = 0; i < P; ++i) v[i] = to_float(packed[i]);
    }
    mx_round_trip_lanes<P>(v, mx.rule, active);
    if (!active) continue;
    for (int j = 0; j < k; ++j)
      if (rows[j] >= 0) store_n<T, P>(values + static_cast<int64_t>(rows[j]) * width + c, v);
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

// Deterministic sum of squares: per-block partials over fixed ranges, then one block adds them
// in order (in double).
constexpr int kSquareBlocks = 1024;

template <class T>
__global__ void sum_squares_partial_kernel(const T* x, int64_t n, float* partial) {
  const int64_t per_block = (n + gridDim.x - 1) / gridDim.x;
  const int64_t begin = blockIdx.x * per_block, end = min(n, begin + per_block);
  float s = 0.f;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const float v = to_float(x[i]);
    s += v * v;
  }
  s = block_sum(s);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

__global__ void sum_partials_kernel(const float* partial, int count, double* out) {
  if (threadIdx.x != 0) return;
  double s = 0;
  for (int i = 0; i < count; ++i) s += partial[i];
  *out = s;
}

template <class T>
__global__ void scale_kernel(T* x, float s, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    x[i] = from_float<T>(to_float(x[i]) * s);
}

// Packs over the first `packs` x P elements, then single elements.
template <class T>
__global__ void add_kernel(const T* a, const T* b, T* out, int64_t n, int64_t packs) {
  constexpr int P = Pack<T>::kSize;
  const int64_t first = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = first; i < packs; i += stride) {
    float x[P], y[P];
    load_n<T, P>(a + i * P, x);
    load_n<T, P>(b + i * P, y);
#pragma unroll
    for (int k = 0; k < P; ++k) x[k] += y[k];
    store_n<T, P>(out + i * P, x);
  }
  for (int64_t i = packs * P + first; i < n; i += stride)
    out[i] = from_float<T>(to_float(a[i]) + to_float(b[i]));
}

// One thread per token: entry p of its row is p when a choice lies in [p*L, (p+1)*L), else -1.
__global__ void peer_choices_kernel(const int32_t* index, int64_t n, int k, int peers, int per_peer,
                                    int32_t* out) {
  const int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (t >= n) return;
  for (int p = 0; p < peers; ++p) out[t * peers + p] = -1;
  for (int j = 0; j < k; ++j) {
    const int p = index[t * k + j] / per_peer;
    out[t * peers + p] = p;
  }
}

// counts (peers, L + 1): per peer, its experts' choices, then the tokens with a choice there.
// A shared histogram per block, flushed with one atomic per bin.
__global__ void peer_counts_kernel(const int32_t* index, int64_t n, int k, int peers, int per_peer,
                                   int64_t* counts) {
  extern __shared__ int hist[];
  const int bins = peers * (per_peer + 1);
  zero_block_histogram(hist, bins);
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < n;
       t += int64_t{gridDim.x} * blockDim.x) {
    const int32_t* row = index + t * k;
    for (int j = 0; j < k; ++j) {
      const int p = row[j] / per_peer;
      atomicAdd(&hist[p * (per_peer + 1) + row[j] - p * per_peer], 1);
      bool first = true;  // the token's first choice on rank p counts the token
      for (int i = 0; i < j; ++i) first &= row[i] / per_peer != p;
      if (first) atomicAdd(&hist[p * (per_peer + 1) + per_peer], 1);
    }
  }
  flush_block_histogram(hist, bins, counts);
}

__global__ void local_choices_kernel(const int32_t* index, int64_t n, int k, int first,
                                     int per_peer, const int64_t* received, int64_t region,
                                     int32_t* out) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i >= n) return;
  const int64_t r = i / k;
  const bool written = !received || r % region < received[(r / region) * (per_peer + 1) + per_peer];
  const int local = index[i] - first;
  out[i] = written && local >= 0 && local < per_peer ? local : -1;
}

__global__ void slots_kernel(const int32_t* index, const int32_t* row, const int64_t* offsets,
                             int64_t n, int64_t region_rows, int32_t* out) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i >= n) return;
  const int32_t e = index[i];
  out[i] = e < 0 ? -1 : static_cast<int32_t>(row[i] - offsets[e] + e * region_rows);
}

// A warp per row of x: each of its places, the row's units striding over the lanes.
template <class U>
__global__ void place_rows_kernel(const U* x, int64_t n, int64_t units, const int32_t* slot,
                                  int peers, int64_t capacity, U* out) {
  const int64_t warps = int64_t{gridDim.x} * (blockDim.x / 32);
  const int lane = threadIdx.x % 32;
  for (int64_t t = blockIdx.x * int64_t{blockDim.x / 32} + threadIdx.x / 32; t < n; t += warps)
    for (int p = 0; p < peers; ++p) {
      const int32_t s = slot[t * peers + p];
      if (s < 0 || s >= capacity) continue;
      U* dst = out + (p * capacity + s) * units;
      for (int64_t c = lane; c < units; c += 32) dst[c] = x[t * units + c];
    }
}

__global__ void region_slots_kernel(const int64_t* received, int peers, int width, int64_t capacity,
                                    int32_t* out) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i >= peers * capacity * peers) return;
  const int64_t j = i / peers;
  const int q = static_cast<int>(i % peers), p = static_cast<int>(j / capacity);
  const int64_t s = j % capacity;
  out[i] = q == p && s < received[p * width + width - 1] ? static_cast<int32_t>(s) : -1;
}

}  // namespace

namespace kernels {

cudaError_t router_forward(const float* logits, const float* bias, int64_t n, int e, int k,
                           bool norm_topk, ops::RoutingMode mode, float* scores, int32_t* index,
                           float* weight, int64_t* counts, cudaStream_t stream) {
  if (k > kMaxTopK || e > kMaxExperts) return cudaErrorInvalidValue;
  if (cudaError_t err = cudaMemsetAsync(counts, 0, sizeof(int64_t) * e, stream); err != cudaSuccess)
    return err;
  if (n == 0) return cudaSuccess;
  // Few blocks, many tokens each: every block flushes its histogram once.
  const int grid =
      static_cast<int>(std::min<int64_t>((n + kRouterWarps - 1) / kRouterWarps, 2 * sm_count()));
  const size_t smem = sizeof(int) * e;
  if (per_lane_for(e) == 4)
    router_kernel<4><<<grid, 32 * kRouterWarps, smem, stream>>>(
        logits, bias, n, e, k, norm_topk, mode, scores, index, weight, counts);
  else
    router_kernel<kMaxExperts / 32><<<grid, 32 * kRouterWarps, smem, stream>>>(
        logits, bias, n, e, k, norm_topk, mode, scores, index, weight, counts);
  return cudaGetLastError();
}

cudaError_t router_aux_loss(const int64_t* counts, const float* score_sum, int e, double scale,
                            double* out, cudaStream_t stream) {
  aux_loss_kernel<<<1, kBlock, 0, stream>>>(counts, score_sum, e, scale, out);
  return cudaGetLastError();
}

cudaError_t add_aux_stats(const int64_t* counts, const float* score_sum, int e,
                          int64_t* pooled_counts, float* pooled_sum, cudaStream_t stream) {
  add_aux_stats_kernel<<<(e + 127) / 128, 128, 0, stream>>>(counts, score_sum, e, pooled_counts,
                                                            pooled_sum);
  return cudaGetLastError();
}

size_t column_sum_workspace(int e) {
  return sizeof(float) * kSumChunks * e;
}

cudaError_t column_sum(const float* scores, int64_t n, int e, float* partial, float* out,
                       cudaStream_t stream) {
  const dim3 grid((e + 127) / 128, kSumChunks);
  column_sum_partial_kernel<<<grid, 128, 0, stream>>>(scores, n, e, partial);
  column_sum_final_kernel<<<(e + 127) / 128, 128, 0, stream>>>(partial, kSumChunks, e, out);
  return cudaGetLastError();
}

cudaError_t router_backward(const float* scores, const int32_t* index, const float* dweight,
                            const int64_t* counts, double aux_scale, int64_t n, int e, int k,
                            bool norm_topk, float* dlogits, cudaStream_t stream) {
  if (k > kMaxTopK || e > kMaxExperts) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  const int grid = grid_for(n, kRouterWarps);  // one warp per token
  if (per_lane_for(e) == 4)
    router_backward_kernel<4><<<grid, 32 * kRouterWarps, 0, stream>>>(
        scores, index, dweight, counts, aux_scale, n, e, k, norm_topk, dlogits);
  else
    router_backward_kernel<kMaxExperts / 32><<<grid, 32 * kRouterWarps, 0, stream>>>(
        scores, index, dweight, counts, aux_scale, n, e, k, norm_topk, dlogits);
  return cudaGetLastError();
}

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
  if (m > 0 && e <= kMaxExperts)
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
                               cudaStream_t stream) {
  if (tokens == 0 || width == 0) return cudaSuccess;
  cudaError_t err = cudaSuccess;
  dispatch_storage(s, [&](auto tag) {
    using T = decltype(tag);
    if (mx.values) {
      if (width % kMxBlock == 0 && packable<T>(width, {src, dst, mx.values}))
        scatter_token_rows_mx_kernel<T><<<tokens, kBlock, 0, stream>>>(
            static_cast<const T*>(src), row_of_choice, k, static_cast<T*>(dst), width, mx);
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

cudaError_t peer_choices(const int32_t* index, int64_t n, int k, int peers, int per_peer,
                         int32_t* out, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  peer_choices_kernel<<<grid_for(n), kBlock, 0, stream>>>(index, n, k, peers, per_peer, out);
  return cudaGetLastError();
}

cudaError_t peer_counts(const int32_t* index, int64_t n, int k, int peers, int per_peer,
                        int64_t* counts, cudaStream_t stream) {
  const int bins = peers * (per_peer + 1);
  if (cudaError_t err = cudaMemsetAsync(counts, 0, sizeof(int64_t) * bins, stream);
      err != cudaSuccess)
    return err;
  if (n == 0) return cudaSuccess;
  const int grid = static_cast<int>(std::min<int64_t>((n + 255) / 256, 2 * sm_count()));
  peer_counts_kernel<<<grid, 256, sizeof(int) * bins, stream>>>(index, n, k, peers, per_peer,
                                                                counts);
  return cudaGetLastError();
}

cudaError_t local_choices(const int32_t* index, int64_t n, int k, int first, int per_peer,
                          const int64_t* received, int64_t region, int32_t* out,
                          cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  local_choices_kernel<<<(n + kBlock - 1) / kBlock, kBlock, 0, stream>>>(
      index, n, k, first, per_peer, received, region, out);
  return cudaGetLastError();
}

cudaError_t slots_within_experts(const int32_t* index, const int32_t* row, const int64_t* offsets,
                                 int64_t n, int64_t region_rows, int32_t* out,
                                 cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  slots_kernel<<<(n + kBlock - 1) / kBlock, kBlock, 0, stream>>>(index, row, offsets, n,
                                                                 region_rows, out);
  return cudaGetLastError();
}

cudaError_t region_slots(const int64_t* received, int peers, int width, int64_t capacity,
                         int32_t* out, cudaStream_t stream) {
  const int64_t n = peers * capacity * peers;
  if (n == 0) return cudaSuccess;
  region_slots_kernel<<<(n + kBlock - 1) / kBlock, kBlock, 0, stream>>>(received, peers, width,
                                                                        capacity, out);
  return cudaGetLastError();
}

cudaError_t place_rows(const void* x, int64_t n, int64_t row_bytes, const int32_t* slot, int peers,
                       int64_t capacity, void* out, cudaStream_t stream) {
  if (n == 0 || row_bytes == 0 || peers == 0) return cudaSuccess;
  const auto aligned = [&](size_t a) {
    return row_bytes % static_cast<int64_t>(a) == 0 && reinterpret_cast<uintptr_t>(x) % a == 0 &&
           reinterpret_cast<uintptr_t>(out) % a == 0;
  };
  const auto blocks = static_cast<unsigned>(std::min<int64_t>((n + 7) / 8, 132 * 16));
  if (aligned(16))
    place_rows_kernel<uint4><<<blocks, kBlock, 0, stream>>>(static_cast<const uint4*>(x), n,
                                                            row_bytes / 16, slot, peers, capacity,
                                                            static_cast<uint4*>(out));
  else if (aligned(4))
    place_rows_kernel<uint32_t><<<blocks, kBlock, 0, stream>>>(static_cast<const uint32_t*>(x), n,
                                                               row_bytes / 4, slot, peers, capacity,
                                                               static_cast<uint32_t*>(out));
  else
    place_rows_kernel<uint8_t><<<blocks, kBlock, 0, stream>>>(static_cast<const uint8_t*>(x), n,
                                                              row_bytes, slot, peers, capacity,
                                                              static_cast<uint8_t*>(out));
  return cudaGetLastError();
}

cudaError_t convert(DType from, const void* src, void* dst, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (from == DType::kF32)
    convert_kernel_f32_bf16<<<grid_for(n), kBlock, 0, stream>>>(
        static_cast<const float*>(src), static_cast<__nv_bfloat16*>(dst), n);
  else
    convert_kernel_bf16_f32<<<grid_for(n), kBlock, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(src), static_cast<float*>(dst), n);
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

size_t sum_of_squares_workspace() {
  return sizeof(float) * kSquareBlocks + sizeof(double);
}

cudaError_t sum_of_squares(DType s, const void* x, int64_t n, void* workspace, double* result,
                           cudaStream_t stream) {
  auto* partial = static_cast<float*>(workspace);
  auto* out = reinterpret_cast<double*>(partial + kSquareBlocks);
  dispatch_storage(s, [&](auto tag) {
    using T = decltype(tag);
    sum_squares_partial_kernel<T>
        <<<kSquareBlocks, kBlock, 0, stream>>>(static_cast<const T*>(x), n, partial);
  });
  sum_partials_kernel<<<1, 32, 0, stream>>>(partial, kSquareBlocks, out);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  return cudaMemcpyAsync(result, out, sizeof(double), cudaMemcpyDeviceToHost, stream) == cudaSuccess
             ? cudaStreamSynchronize(stream)
             : cudaGetLastError();
}

cudaError_t scale(DType s, void* x, float factor, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  dispatch_storage(s, [&](auto tag) {
    using T = decltype(tag);
    scale_kernel<T><<<grid_for(n), kBlock, 0, stream>>>(static_cast<T*>(x), factor, n);
  });
  return cudaGetLastError();
}

cudaError_t add(DType s, const void* a, const void* b, void* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  dispatch_storage(s, [&](auto tag) {
    using T = decltype(tag);
    const int64_t packs = packable<T>(Pack<T>::kSize, {a, b, out}) ? n / Pack<T>::kSize : 0;
    add_kernel<T><<<grid_for(std::max<int64_t>(packs, 1)), kBlock, 0, stream>>>(
        static_cast<const T*>(a), static_cast<const T*>(b), static_cast<T*>(out), n, packs);
  });
  return cudaGetLastError();
}

}  // namespace kernels
}  // namespace mt::cuda
