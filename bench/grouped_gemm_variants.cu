// Workbench for the CUTLASS grouped GEMM configuration: times tile shapes, clusters and
// schedules of the forward product at the balanced Qwen3-30B-A3B shape (JSON lines). The
// winner goes into src/ops/cuda/cutlass/grouped_gemm_sm90.cuh through the GPU tests.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "ops/cuda/cutlass/grouped_gemm_sm90.cuh"

namespace variants {

using cute::_1;
using cute::_128;
using cute::_2;
using cute::_256;
using cute::_64;
using cute::Shape;
using cutlass::layout::RowMajor;
using mt::cuda::grouped_sm90::Config;
using mt::cuda::grouped_sm90::Pingpong;

__global__ void fill_random(cutlass::bfloat16_t* p, int64_t n, uint32_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    p[i] = cutlass::bfloat16_t(scale * ((h & 0xFFFF) / 32768.0f - 1.0f));
  }
}

#define CHECK(x)                                                                        \
  do {                                                                                  \
    cudaError_t e = (x);                                                                \
    if (e != cudaSuccess) {                                                             \
      std::printf("{\"error\": \"%s at line %d\"}\n", cudaGetErrorString(e), __LINE__); \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

template <class C>
void time_variant(const char* name, const int64_t* offsets, int experts, const void* x,
                  const void* w, void* out, int64_t m, int64_t k, int64_t n) {
  const size_t bytes =
      mt::cuda::grouped_sm90::workspace_bytes<mt::cuda::grouped_sm90::Product::kForward, C>(
          experts);
  void* ws = nullptr;
  CHECK(cudaMalloc(&ws, bytes));
  auto call = [&] {
    CHECK((mt::cuda::grouped_sm90::run<mt::cuda::grouped_sm90::Product::kForward, C>(
        offsets, experts, x, w, out, m, k, n, ws, bytes, nullptr)));
  };
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
  std::sort(ms.begin(), ms.end());
  const double med = ms[ms.size() / 2];
  std::printf(
      "{\"bench\": \"grouped_forward_variant\", \"variant\": \"%s\", \"ms\": %.4f, "
      "\"tflops\": %.1f}\n",
      name, med, 2.0 * m * k * n / (med * 1e-3) / 1e12);
  std::fflush(stdout);
  cudaFree(ws);
}

}  // namespace variants

int main() {
  using namespace variants;
  const int experts = 128;
  const int64_t rows = 1024, m = experts * rows, k = 2048, n = 1536;
  std::vector<int64_t> off(experts + 1);
  for (int e = 0; e <= experts; ++e) off[e] = e * rows;
  int64_t* d_off;
  cutlass::bfloat16_t *x, *w, *out;
  CHECK(cudaMalloc(&d_off, sizeof(int64_t) * off.size()));
  CHECK(cudaMemcpy(d_off, off.data(), sizeof(int64_t) * off.size(), cudaMemcpyHostToDevice));
  CHECK(cudaMalloc(&x, sizeof(cutlass::bfloat16_t) * m * k));
  CHECK(cudaMalloc(&w, sizeof(cutlass::bfloat16_t) * experts * k * n));
  CHECK(cudaMalloc(&out, sizeof(cutlass::bfloat16_t) * m * n));
  fill_random<<<1024, 256>>>(x, m * k, 1, 1.0f);
  fill_random<<<1024, 256>>>(w, experts * k * n, 2, 0.05f);
  CHECK(cudaDeviceSynchronize());
  using bf = cutlass::bfloat16_t;
  time_variant<Config<RowMajor, RowMajor, bf, Shape<_128, _128, _64>, Shape<_1, _1, _1>>>(
      "coop 128x128x64 1x1", d_off, experts, x, w, out, m, k, n);
  time_variant<Config<RowMajor, RowMajor, bf, Shape<_256, _128, _64>, Shape<_2, _1, _1>>>(
      "coop 256x128x64 2x1", d_off, experts, x, w, out, m, k, n);
  time_variant<Config<RowMajor, RowMajor, bf, Shape<_128, _256, _64>, Shape<_1, _2, _1>>>(
      "coop 128x256x64 1x2", d_off, experts, x, w, out, m, k, n);
  time_variant<Config<RowMajor, RowMajor, bf, Shape<_128, _128, _64>, Shape<_2, _1, _1>, Pingpong>>(
      "pingpong 128x128x64 2x1", d_off, experts, x, w, out, m, k, n);
  time_variant<Config<RowMajor, RowMajor, bf, Shape<_64, _128, _64>, Shape<_1, _1, _1>, Pingpong>>(
      "pingpong 64x128x64 1x1", d_off, experts, x, w, out, m, k, n);
  return 0;
}
