// Shared pieces of the GPU benchmarks: random device data (never time on zeros) and a CUDA-event
// median.
#pragma once
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "core/cuda/check.h"
#include "core/rng.h"
#include "core/tensor.h"

namespace mt::bench {

// bf16 values scale * N(0, 1) from a 4 Mi-element host block copied over the tensor; the
// repetition does not matter for timing.
inline Tensor random_bf16(const Shape& s, uint64_t seed, double scale) {
  constexpr int64_t kBlock = 1 << 22;
  Tensor block = Tensor::empty({kBlock}, DType::kBF16);
  const CounterRng rng{seed, 1};
  for (int64_t i = 0; i < kBlock; ++i)
    block.data<bf16>()[i] = to_bf16(static_cast<float>(scale * rng.normal(i)));
  Tensor t = Tensor::empty(s, DType::kBF16, Device::kCUDA);
  for (int64_t at = 0; at < t.numel(); at += kBlock) {
    const int64_t len = std::min(kBlock, t.numel() - at);
    Tensor dst = t.view(at, {len});
    dst.copy_from(block.view(0, {len}));
  }
  return t;
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// "a, b, c" with three decimals: the samples behind a median, for the JSON line.
inline std::string join(const std::vector<double>& v) {
  std::string out;
  for (double x : v) out += (out.empty() ? "" : ", ") + fmt::format("{:.3f}", x);
  return out;
}

// Median of `reps` runs after `warmup` untimed ones, in milliseconds, timed with CUDA events.
inline double median_ms(const std::function<void()>& fn, int warmup = 3, int reps = 10) {
  for (int i = 0; i < warmup; ++i) fn();
  cudaEvent_t start, stop;
  MT_CUDA_CHECK(cudaEventCreate(&start));
  MT_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<float> ms(reps);
  for (float& t : ms) {
    MT_CUDA_CHECK(cudaEventRecord(start));
    fn();
    MT_CUDA_CHECK(cudaEventRecord(stop));
    MT_CUDA_CHECK(cudaEventSynchronize(stop));
    MT_CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return ms[reps / 2];
}

}  // namespace mt::bench
