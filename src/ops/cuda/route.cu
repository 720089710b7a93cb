// The router's kernels: softmax, top-k and renormalisation a warp per token, the expert counts,
// the load-balancing statistics and the router backward. Deterministic: sums run in a fixed
// order, counts are integer atomics.
#include "ops/cuda/route.h"

#include "ops/cuda/common.cuh"

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

__global__ void column_sum_partial_kernel(const float* scores, const uint8_t* padding, int64_t n,
                                          int e, float* partial) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= e) return;
  const int64_t rows = (n + gridDim.y - 1) / gridDim.y;
  const int64_t begin = blockIdx.y * rows, end = min(n, begin + rows);
  float s = 0.f;
  for (int64_t t = begin; t < end; ++t)
    if (!padding || !padding[t]) s += scores[t * e + c];
  partial[blockIdx.y * e + c] = s;
}

// The choices of the tokens that are not padding, per expert: a block histogram, then one atomic
// per bin.
__global__ void expert_counts_kernel(const int32_t* index, const uint8_t* padding, int64_t n, int e,
                                     int k, int64_t* counts) {
  extern __shared__ int hist[];
  zero_block_histogram(hist, e);
  const int64_t m = n * k;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < m;
       i += int64_t{gridDim.x} * blockDim.x)
    if (!padding[i / k]) atomicAdd(&hist[index[i]], 1);
  flush_block_histogram(hist, e, counts);
}

// The aux term's scale, aux_grad * E / N^2 with N = sum(counts) / k the batch's real tokens
// (0 when N is 0), for the backward to read: one block, a fixed-order sum (double: exact for
// any count a batch has).
__global__ void aux_scale_kernel(const int64_t* counts, int e, int k, double aux_grad,
                                 double* scale) {
  double choices = 0;
  for (int c = threadIdx.x; c < e; c += kBlock) choices += static_cast<double>(counts[c]);
  const double n = block_sum_fixed_order(choices) / k;
  if (threadIdx.x == 0) *scale = n > 0 ? aux_grad * e / (n * n) : 0.0;
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
// Launch bounds: 128 registers a thread at the most, so that a block of kRouterWarps warps always
// launches (the 1000-expert instantiation otherwise asks for more than an SM holds).
template <int kPerLane>
__global__ void __launch_bounds__(32 * kRouterWarps)
    router_backward_kernel(const float* scores, const int32_t* index, const float* dweight,
                           const int64_t* counts, const uint8_t* padding, const double* aux_scale,
                           int64_t n, int e, int k, bool norm_topk, float* dlogits) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t{gridDim.x} * (blockDim.x / 32);
  for (int64_t t = blockIdx.x * int64_t{blockDim.x / 32} + threadIdx.x / 32; t < n; t += warps) {
    const float* s_row = scores + t * e;
    const double scale = padding && padding[t] ? 0.0 : *aux_scale;
    float s[kPerLane], ds[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int c = lane + 32 * i;
      s[i] = c < e ? s_row[c] : 0.f;
      ds[i] = c < e ? static_cast<float>(scale * counts[c]) : 0.f;
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

__global__ void aux_loss_kernel(const int64_t* counts, const float* score_sum, int e, int k,
                                double* out) {
  double s = 0, choices = 0;
  for (int c = threadIdx.x; c < e; c += kBlock) {
    s += static_cast<double>(counts[c]) * static_cast<double>(score_sum[c]);
    choices += static_cast<double>(counts[c]);
  }
  s = block_sum_fixed_order(s);
  __syncthreads();  // the tree's shared memory is used again
  const double n = block_sum_fixed_order(choices) / k;
  if (threadIdx.x == 0) *out = n > 0 ? static_cast<double>(e) / (n * n) * s : 0.0;
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

cudaError_t router_aux_loss(const int64_t* counts, const float* score_sum, int e, int top_k,
                            double* out, cudaStream_t stream) {
  aux_loss_kernel<<<1, kBlock, 0, stream>>>(counts, score_sum, e, top_k, out);
  return cudaGetLastError();
}

cudaError_t expert_counts(const int32_t* index, const uint8_t* padding, int64_t n, int e, int k,
                          int64_t* counts, cudaStream_t stream) {
  if (cudaError_t err = cudaMemsetAsync(counts, 0, sizeof(int64_t) * e, stream); err != cudaSuccess)
    return err;
  if (n == 0) return cudaSuccess;
  const int grid = static_cast<int>(std::min<int64_t>((n * k + 255) / 256, 2 * sm_count()));
  expert_counts_kernel<<<grid, 256, sizeof(int) * e, stream>>>(index, padding, n, e, k, counts);
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

cudaError_t column_sum(const float* scores, const uint8_t* padding, int64_t n, int e,
                       float* partial, float* out, cudaStream_t stream) {
  const dim3 grid((e + 127) / 128, kSumChunks);
  column_sum_partial_kernel<<<grid, 128, 0, stream>>>(scores, padding, n, e, partial);
  column_sum_final_kernel<<<(e + 127) / 128, 128, 0, stream>>>(partial, kSumChunks, e, out);
  return cudaGetLastError();
}

size_t router_backward_workspace() {
  return sizeof(double);
}

cudaError_t router_backward(const float* scores, const int32_t* index, const float* dweight,
                            const int64_t* counts, const uint8_t* padding, double aux_grad,
                            int64_t n, int e, int k, bool norm_topk, double* workspace,
                            float* dlogits, cudaStream_t stream) {
  if (k > kMaxTopK || e > kMaxExperts) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  aux_scale_kernel<<<1, kBlock, 0, stream>>>(counts, e, k, aux_grad, workspace);
  const int grid = grid_for(n, kRouterWarps);  // one warp per token
  if (per_lane_for(e) == 4)
    router_backward_kernel<4><<<grid, 32 * kRouterWarps, 0, stream>>>(
        scores, index, dweight, counts, padding, workspace, n, e, k, norm_topk, dlogits);
  else
    router_backward_kernel<kMaxExperts / 32><<<grid, 32 * kRouterWarps, 0, stream>>>(
        scores, index, dweight, counts, padding, workspace, n, e, k, norm_topk, dlogits);
  return cudaGetLastError();
}

}  // namespace kernels
}  // namespace mt::cuda
