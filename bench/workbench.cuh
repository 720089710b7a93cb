// Shared by the GEMM workbenches (bench/*.cu built on request): error checks that print a JSON
// line, deterministic random fill that never repeats, event timing (median of 20 calls after 5
// warm-up calls, the host waiting for each), the experts' row counts and an output comparison.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define WORKBENCH_CHECK(x)                                                              \
  do {                                                                                  \
    cudaError_t e = (x);                                                                \
    if (e != cudaSuccess) {                                                             \
      std::printf("{\"error\": \"%s at line %d\"}\n", cudaGetErrorString(e), __LINE__); \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

namespace workbench {

// A hash of (i, seed): the fills' source of bits.
__device__ __forceinline__ uint32_t hash(int64_t i, uint32_t seed) {
  uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
  h ^= h >> 16;
  h *= 0x7feb352du;
  h ^= h >> 15;
  return h;
}

// p[i] = scale * (a hash of (i, seed) in [-1, 1)): never zeros, never periodic.
template <class T>
__global__ void fill_random(T* p, int64_t n, uint32_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    p[i] = T(scale * ((hash(i, seed) & 0xFFFF) / 32768.0f - 1.0f));
}

// Median milliseconds of `call` on the default stream.
template <class F>
float median_ms(F&& call) {
  for (int i = 0; i < 5; ++i) call();
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> ms(20);
  for (float& t : ms) {
    cudaEventRecord(a);
    call();
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    cudaEventElapsedTime(&t, a, b);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Rows per expert: `mean` each, or (ragged) a deterministic spread in [0.5, 1.5) x mean with the
// last expert taking what makes the total experts x mean.
inline std::vector<int64_t> expert_rows(int experts, int64_t mean, bool ragged) {
  std::vector<int64_t> rows(experts, mean);
  if (!ragged) return rows;
  int64_t sum = 0;
  for (int e = 0; e + 1 < experts; ++e) {
    uint32_t h = static_cast<uint32_t>(e + 1) * 2654435761u;
    h ^= h >> 15;
    rows[e] = mean / 2 + static_cast<int64_t>((h % 1000) * mean / 1000);
    sum += rows[e];
  }
  rows[experts - 1] = experts * mean - sum;
  return rows;
}

// Row offsets (experts + 1) of consecutive segments of `rows`.
inline std::vector<int64_t> offsets_of(const std::vector<int64_t>& rows) {
  std::vector<int64_t> off(rows.size() + 1, 0);
  for (size_t e = 0; e < rows.size(); ++e) off[e + 1] = off[e] + rows[e];
  return off;
}

// a and b compared element by element: how many differ in their bits, and the largest absolute
// difference of their values (1e30 where it is not finite).
struct Differences {
  unsigned long long differing = 0;
  float max_abs = 0;
};

template <class T>
__device__ bool same_bits(const T& a, const T& b) {
  static_assert(sizeof(T) == 2 || sizeof(T) == 4);
  if constexpr (sizeof(T) == 2)
    return *reinterpret_cast<const uint16_t*>(&a) == *reinterpret_cast<const uint16_t*>(&b);
  else
    return *reinterpret_cast<const uint32_t*>(&a) == *reinterpret_cast<const uint32_t*>(&b);
}

template <class T>
__global__ void count_differences(const T* a, const T* b, int64_t n, Differences* out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    if (same_bits(a[i], b[i])) continue;
    atomicAdd(&out->differing, 1ull);
    const float d = float(a[i]) - float(b[i]);
    atomicMax(reinterpret_cast<int*>(&out->max_abs),
              __float_as_int(isfinite(d) ? fabsf(d) : 1e30f));
  }
}

template <class T>
Differences differences(const T* a, const T* b, int64_t n) {
  Differences* d = nullptr;
  WORKBENCH_CHECK(cudaMalloc(&d, sizeof(Differences)));
  WORKBENCH_CHECK(cudaMemset(d, 0, sizeof(Differences)));
  count_differences<<<1024, 256>>>(a, b, n, d);
  Differences h;
  WORKBENCH_CHECK(cudaMemcpy(&h, d, sizeof(h), cudaMemcpyDeviceToHost));
  cudaFree(d);
  return h;
}

}  // namespace workbench
