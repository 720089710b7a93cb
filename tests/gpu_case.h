// The GPU side of the op families' tests (tests/test_<family>.cpp, cases named Gpu*, ctest label
// `gpu`): each CUDA op against the CPU reference on fresh random inputs (the seed is printed),
// outputs poisoned with NaN first, ||gpu - cpu|| / ||cpu|| under 1e-5 for f32 storage and 1e-2
// for bf16 (inputs rounded to bf16 for both sides).
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>

#include "core/cuda/device.h"
#include "core/tensor.h"
#include "ops/fp8.h"
#include "ops/permute.h"
#include "testing.h"

namespace mt {
namespace {

// A fresh seed per case, or with MOETRAIN_TEST_SEED set that seed for every case (to replay a
// printed one: MOETRAIN_TEST_SEED=S test_<family> --gtest_filter=THE_CASE).
inline uint64_t fresh_seed() {
  if (const char* fixed = std::getenv("MOETRAIN_TEST_SEED")) return std::stoull(fixed);
  static const uint64_t base = std::random_device{}();
  static uint64_t n = 0;
  return base + 1000 * n++;
}

// A case over a storage dtype (f32 or bf16: the parameter): inputs representable in it, outputs
// poisoned on the GPU, and the tolerance its precision sets.
struct GpuCase : ::testing::TestWithParam<DType> {
  void SetUp() override {
    if (cuda::device_count() == 0) GTEST_FAIL() << "no GPU: run this test on the GPU machine";
    seed = fresh_seed();
    RecordProperty("seed", std::to_string(seed));
    std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  }
  // A random f32 tensor whose values are representable in the storage dtype under test.
  Tensor input(const Shape& s, double scale = 1.0) {
    return testing::randn(s, seed + counter++, scale, DType::kF32).to(GetParam()).to(DType::kF32);
  }
  Tensor gpu(const Tensor& cpu_f32) const { return cpu_f32.to(GetParam()).to(Device::kCUDA); }
  Tensor gpu_out(const Shape& s, DType d) const { return Tensor::poisoned(s, d, Device::kCUDA); }
  Tensor gpu_out(const Shape& s) const { return gpu_out(s, GetParam()); }
  double tol() const { return GetParam() == DType::kF32 ? 1e-5 : 1e-2; }
  void expect_close(const Tensor& got, const Tensor& ref, const char* what) const {
    const Tensor host = got.to(Device::kCPU).to(DType::kF32);
    ASSERT_TRUE(all_finite(host)) << what << ": unwritten (NaN) or non-finite output";
    const double err = relative_error(host, ref);
    EXPECT_LT(err, tol()) << what << " (" << dtype_name(GetParam()) << ", seed " << seed << ")";
  }
  uint64_t seed = 0;
  uint64_t counter = 0;
};

// The expert rows of a skewed routing of `tokens` tokens, top-2 over `experts` (expert 0 takes a
// third of the first choices, the last expert none), permuted on the GPU with segments aligned to
// `align` rows (128: as the MoE layer lays them out on one GPU; 1: dense).
inline ops::ExpertPermutation random_expert_rows(int64_t tokens, int64_t experts, int64_t align,
                                                 uint64_t seed) {
  Tensor index = Tensor::empty({tokens, 2}, DType::kI32);
  std::mt19937_64 rng(seed);
  for (int64_t t = 0; t < tokens; ++t) {
    const int32_t a = static_cast<int32_t>(rng() % 3 == 0 ? 0 : rng() % (experts - 1));
    int32_t b = static_cast<int32_t>(rng() % (experts - 1));
    if (b == a) b = (a + 1) % static_cast<int32_t>(experts - 1);
    index.data<int32_t>()[2 * t] = a;
    index.data<int32_t>()[2 * t + 1] = b;
  }
  ops::ExpertPermutation p;
  ops::make_expert_permutation(index.to(Device::kCUDA), experts, p, align);
  return p;
}
inline ops::ExpertRows on_cpu(const ops::ExpertRows& r) {
  return {r.offsets.to(Device::kCPU), r.segments.to(Device::kCPU), r.align};
}

// The FP8 rows (1 x 128) got from a kernel for the rows of out: equal to out quantized by the CPU
// reference, byte for byte and scale for scale, except padding rows, which keep the poison.
inline int64_t fp8_rows_differing(const QuantTensor& got_gpu, const Tensor& out_gpu,
                                  Fp8ScaleRule rule, const std::function<bool(int64_t)>& padding) {
  const int64_t m = out_gpu.dim(0), width = out_gpu.dim(1);
  QuantTensor want = QuantTensor::empty({m, width}, QuantBlock::kRow128, QuantAxis::kDim0);
  ops::fp8_quantize(out_gpu.to(Device::kCPU).to(DType::kF32), rule, want);
  const QuantTensor got = got_gpu.to(Device::kCPU);
  const auto* gd = static_cast<const uint8_t*>(got.data().raw());
  const auto* wd = static_cast<const uint8_t*>(want.data().raw());
  constexpr uint8_t kPoison = 0xFF;  // Tensor::poisoned's byte
  int64_t wrong = 0;
  for (int64_t r = 0; r < m; ++r) {
    const bool pad = padding(r);
    for (int64_t c = 0; c < width; ++c)
      wrong += gd[r * width + c] != (pad ? kPoison : wd[r * width + c]);
    for (int64_t b = 0; b < width / 128; ++b) {
      const float gs = got.scales().data<float>()[r * (width / 128) + b];
      const float ws = want.scales().data<float>()[r * (width / 128) + b];
      wrong += pad ? !std::isnan(gs) : std::memcmp(&gs, &ws, 4) != 0;
    }
  }
  return wrong;
}

}  // namespace
}  // namespace mt

// Each family's fixture is a GpuCase over both storage dtypes.
#define MOETRAIN_GPU_CASES(Fixture)                                                        \
  INSTANTIATE_TEST_SUITE_P(Storage, Fixture, ::testing::Values(DType::kF32, DType::kBF16), \
                           [](const auto& info) { return std::string(dtype_name(info.param)); })
