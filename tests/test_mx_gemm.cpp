// The MX expert product (ops/mx_gemm.h): its checks on the CPU and, in the Gpu* cases (ctest label
// `gpu`), the fused Hopper kernel against the definition (dequantize, then the bf16 grouped GEMM),
// bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>

#include "core/quant.h"
#include "core/rng.h"
#include "ops/grouped_gemm.h"
#include "ops/mx.h"
#include "ops/mx_gemm.h"
#include "testing.h"
#if MOETRAIN_HAS_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda/check.h"
#include "gpu_case.h"
#endif

namespace mt {
namespace {

TEST(MxGroupedGemm, RefusesOperandsItCannotMultiply) {
  // Three experts: 45 rows, none, 70 rows from row 64 of 160 (the rest padding).
  Tensor offsets = Tensor::empty({4}, DType::kI64), segments = Tensor::empty({4}, DType::kI64);
  const int64_t off[] = {0, 45, 45, 115}, seg[] = {0, 64, 64, 160};
  for (int i = 0; i < 4; ++i) {
    offsets.data<int64_t>()[i] = off[i];
    segments.data<int64_t>()[i] = seg[i];
  }
  const ops::ExpertRows rows{offsets, segments, 32};
  const int64_t m = 160;
  Tensor out = Tensor::zeros({m, 8}, DType::kF64);
  QuantTensor along_tokens = QuantTensor::empty({m, 64}, QuantBlock::kMx32, QuantAxis::kDim1);
  const Tensor b = Tensor::zeros({3, 8, 64}, DType::kF64);
  const std::string axis =
      testing::error_of([&] { ops::mx_grouped_gemm(along_tokens, b, rows, out); });
  EXPECT_NE(axis.find("quantized along dim0"), std::string::npos) << axis;
  EXPECT_NE(axis.find("dim1"), std::string::npos) << axis;
  QuantTensor a = QuantTensor::empty({m, 64}, QuantBlock::kMx32, QuantAxis::kDim0);
  const Tensor wrong_inner = Tensor::zeros({3, 8, 96}, DType::kF64);
  const std::string inner =
      testing::error_of([&] { ops::mx_grouped_gemm(a, wrong_inner, rows, out); });
  EXPECT_NE(inner.find("(experts, P, 64)"), std::string::npos) << inner;
}

#if MOETRAIN_HAS_CUDA
// Rows whose 32-blocks span 2^-20 .. 2^20, with zero blocks and blocks whose values fall over
// 16 binades (E4M3 subnormals and zeros among their elements), bf16 on the GPU.
Tensor block_scaled_rows(int64_t m, int64_t q, uint64_t seed) {
  Tensor t = Tensor::empty({m, q}, DType::kF32);
  const CounterRng rng{seed, 11};
  for (int64_t i = 0; i < t.numel(); ++i) {
    const int64_t block = i / kMxBlock;
    const uint32_t pick = rng.u32(2 * block) % 16;
    const int exponent = static_cast<int>(rng.u32(2 * block + 1) % 41) - 20;
    const int spread = pick == 1 ? -static_cast<int>(i % kMxBlock) / 2 : 0;
    t.data<float>()[i] =
        pick == 0 ? 0.0f : static_cast<float>(std::ldexp(rng.normal(i), exponent + spread));
  }
  return t.to(DType::kBF16).to(Device::kCUDA);
}
// The MX product's kernel against its definition run on the GPU (dequantize, then the bf16
// grouped GEMM): the same bf16 operand values multiplied in the same order (k16 steps up K), so
// every expert row bit for bit; and against the CPU's f64 product to bf16 accuracy. Routing
// skewed (one expert a third of the rows, one empty), 128-row segments; shapes with a partial
// column tile, a partial K tile and a partial last row tile; outputs poisoned.
TEST(GpuMxGemm, KernelEqualsTheDefinitionBitForBit) {
  struct Case {
    int64_t p, q;
    const char* what;
  };
  for (const Case c : {Case{512, 256, "whole column tiles"}, Case{392, 96, "partial tiles"},
                       Case{256, 2048, "long K"}}) {
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE(std::string(c.what) + " seed " + std::to_string(seed));
    const int64_t experts = 8;
    const ops::ExpertPermutation perm = random_expert_rows(700, experts, 128, seed);
    const ops::ExpertRows rows = perm.expert_rows(), rows_cpu = on_cpu(rows);
    const int64_t m = perm.rows();
    QuantTensor a =
        QuantTensor::poisoned({m, c.q}, QuantBlock::kMx32, QuantAxis::kDim0, Device::kCUDA);
    ops::mx_quantize(block_scaled_rows(m, c.q, seed), MxScaleRule::kRceil, a);
    const Tensor b =
        testing::randn({experts, c.p, c.q}, seed + 1, 0.05, DType::kF32).to(DType::kBF16);
    const Tensor b_gpu = b.to(Device::kCUDA);
    Tensor got = Tensor::poisoned({m, c.p}, DType::kBF16, Device::kCUDA);
    ops::mx_grouped_gemm(a, b_gpu, rows, got);
    Tensor values = Tensor::poisoned({m, c.q}, DType::kBF16, Device::kCUDA);
    ops::mx_dequantize(a, values);
    Tensor want = Tensor::poisoned({m, c.p}, DType::kBF16, Device::kCUDA);
    ops::grouped_gemm_backward_input(values, b_gpu, rows, want);
    Tensor exact = Tensor::zeros({m, c.p}, DType::kF64);
    ops::mx_grouped_gemm(a.to(Device::kCPU), b.to(DType::kF64), rows_cpu, exact);

    const Tensor g = got.to(Device::kCPU), w = want.to(Device::kCPU);
    int64_t differing = 0, compared = 0;
    double num = 0, den = 0;
    for (int64_t e = 0; e < experts; ++e) {
      const int64_t first = rows_cpu.segments.data<int64_t>()[e];
      const int64_t count =
          rows_cpu.offsets.data<int64_t>()[e + 1] - rows_cpu.offsets.data<int64_t>()[e];
      for (int64_t i = first * c.p; i < (first + count) * c.p; ++i) {
        differing += g.data<bf16>()[i].bits != w.data<bf16>()[i].bits;
        ++compared;
        const double d = static_cast<double>(g.item(i)) - exact.item(i);
        num += d * d;
        den += exact.item(i) * exact.item(i);
      }
    }
    ASSERT_GT(compared, 0);
    EXPECT_EQ(differing, 0) << "of " << compared << " expert-row outputs";
    EXPECT_GT(den, 0.0);
    EXPECT_LT(std::sqrt(num / den), 4e-3);  // bf16 rounding of each output
  }
}
// A block whose scale is NaN (0xFF) makes its row's outputs NaN, as its dequantized values would.
TEST(GpuMxGemm, ANanScalePoisonsItsRow) {
  const int64_t experts = 2, m = 256, q = 64, p = 256;
  Tensor offsets = Tensor::empty({experts + 1}, DType::kI64);
  for (int64_t e = 0; e <= experts; ++e) offsets.data<int64_t>()[e] = e * 128;
  const Tensor off = offsets.to(Device::kCUDA);
  const ops::ExpertRows rows(off, off, 128);
  QuantTensor a = QuantTensor::empty({m, q}, QuantBlock::kMx32, QuantAxis::kDim0, Device::kCUDA);
  ops::mx_quantize(block_scaled_rows(m, q, fresh_seed()), MxScaleRule::kRceil, a);
  const uint8_t nan_scale = 0xFF;
  MT_CUDA_CHECK(cudaMemcpy(static_cast<uint8_t*>(a.scales().raw()) + 130 * (q / kMxBlock) + 1,
                           &nan_scale, 1, cudaMemcpyHostToDevice));
  const Tensor b =
      testing::randn({experts, p, q}, 5, 0.05, DType::kF32).to(DType::kBF16).to(Device::kCUDA);
  Tensor out = Tensor::poisoned({m, p}, DType::kBF16, Device::kCUDA);
  ops::mx_grouped_gemm(a, b, rows, out);
  const Tensor o = out.to(Device::kCPU);
  for (int64_t row : {int64_t{129}, int64_t{130}, int64_t{131}})
    for (int64_t j = 0; j < p; ++j)
      ASSERT_EQ(std::isnan(o.item(row * p + j)), row == 130) << "row " << row << " col " << j;
}
#endif  // MOETRAIN_HAS_CUDA

}  // namespace
}  // namespace mt
