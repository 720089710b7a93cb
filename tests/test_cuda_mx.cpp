// The MX kernels against the CPU reference, bit for bit (ctest label `gpu`): fresh seeds each run
// (printed on failure), every edge case of tests/mx_cases.h, outputs poisoned twice (0xFF, then
// zeros, so that no byte passes by already holding its value).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <tuple>

#include "core/mx.h"
#include "mx_cases.h"
#include "ops/mx.h"
#include "testing.h"

namespace mt {
namespace {

using testing::same_bytes;
using testing::same_values;

uint64_t fresh_seed() {
  static const uint64_t base = std::random_device{}();
  static uint64_t n = 0;
  return base + 1000 * n++;
}

class GpuMx : public ::testing::TestWithParam<testing::MxCase> {};

TEST_P(GpuMx, QuantizeAndDequantizeMatchTheCpuBitForBit) {
  const auto [dtype, rule, axis] = GetParam();
  for (const Shape& shape :
       {Shape{32, 32}, Shape{96, 64}, Shape{3, 64, 160}, Shape{256, 2048}, Shape{2, 1024, 768}}) {
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE("shape " + shape_str(shape) + " seed " + std::to_string(seed));
    const Tensor x = testing::mx_input(shape, seed, dtype);
    MxTensor want = MxTensor::poisoned(shape, axis);
    ops::mx_quantize(x, rule, want);
    const Tensor xg = x.to(Device::kCUDA);
    for (int poison : {0xFF, 0x00}) {
      MxTensor got = MxTensor::poisoned(shape, axis, Device::kCUDA);
      if (poison == 0x00) {
        cudaMemset(got.data().raw(), 0, got.data().nbytes());
        cudaMemset(got.scales().raw(), 0, got.scales().nbytes());
      }
      ops::mx_quantize(xg, rule, got);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_TRUE(same_bytes(got.scales(), want.scales()));
      EXPECT_TRUE(same_bytes(got.data(), want.data()));
    }
    for (DType out : {DType::kF32, DType::kBF16}) {
      Tensor back_cpu = Tensor::poisoned(shape, out);
      ops::mx_dequantize(want, back_cpu);
      Tensor back_gpu = Tensor::poisoned(shape, out, Device::kCUDA);
      ops::mx_dequantize(want.to(Device::kCUDA), back_gpu);
      EXPECT_TRUE(same_values(back_gpu, back_cpu));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, GpuMx, testing::mx_case_values(), testing::mx_case_name);

TEST(GpuMx, RefusesWhatTheKernelsCannotRead) {
  MxTensor q = MxTensor::empty({64, 36}, MxAxis::kDim1, Device::kCUDA);
  const Tensor x = Tensor::zeros({64, 36}, DType::kBF16, Device::kCUDA);  // 72-byte rows
  EXPECT_NE(testing::error_of([&] {
              ops::mx_quantize(x, MxScaleRule::kRceil, q);
            }).find("multiple of 16 bytes"),
            std::string::npos);
  Tensor out = Tensor::zeros({64, 36}, DType::kBF16, Device::kCUDA);
  EXPECT_NE(testing::error_of([&] { ops::mx_dequantize(q, out); }).find("multiple of 16 bytes"),
            std::string::npos);
}

}  // namespace
}  // namespace mt
