// Shared by the GEMM workbenches (bench/*.cu built on request): error checks that print a JSON
// line, deterministic random fill that never repeats, and event timing (median of 20 calls
// after 5 warm-up calls, the host waiting for each).
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

// p[i] = scale * (a hash of (i, seed) in [-1, 1)): never zeros, never periodic.
template <class T>
__global__ void fill_random(T* p, int64_t n, uint32_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    p[i] = T(scale * ((h & 0xFFFF) / 32768.0f - 1.0f));
  }
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

}  // namespace workbench
