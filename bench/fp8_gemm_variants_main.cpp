// Set-up and report of the FP8 GEMM workbench (bench/fp8_gemm_variants.cu): the four row
// products of the Qwen3-30B-A3B expert layer, 128 experts x 1024 rows, JSON lines.
#include <cstdio>

#include "bench/bench_util.h"
#include "bench/fp8_gemm_variants.h"
#include "core/cuda/device.h"
#include "core/quant.h"
#include "ops/fp8.h"

namespace {

using mt::Device;
using mt::DType;
using mt::QuantAxis;
using mt::QuantBlock;
using mt::QuantTensor;
using mt::Tensor;

void product(const char* name, int64_t q, int64_t p, bool forward) {
  constexpr int kExperts = 128;
  constexpr int64_t kRows = 1024, kM = kExperts * kRows;
  const int64_t k = forward ? q : p, n = forward ? p : q;
  const Tensor a = mt::bench::random_bf16({kM, q}, 3, 1.0);
  const Tensor w = mt::bench::random_bf16({kExperts, k, n}, 4, 0.05);
  QuantTensor aq =
      QuantTensor::empty(a.shape(), QuantBlock::kRow128, QuantAxis::kDim0, Device::kCUDA);
  mt::ops::fp8_quantize(a, mt::Fp8ScaleRule::kFp32, aq);
  QuantTensor b = QuantTensor::empty(w.shape(), QuantBlock::kTile128,
                                     forward ? QuantAxis::kDim1 : QuantAxis::kDim0, Device::kCUDA);
  mt::ops::fp8_quantize(w, mt::Fp8ScaleRule::kFp32, b);
  Tensor out = Tensor::empty({kM, p}, DType::kBF16, Device::kCUDA);
  Tensor off_host = Tensor::empty({kExperts + 1}, DType::kI64);
  for (int e = 0; e <= kExperts; ++e) off_host.data<int64_t>()[e] = e * kRows;
  const Tensor off = off_host.to(Device::kCUDA);
  mt::cuda::synchronize();
  const Fp8RowsProblem pr{off.data<int64_t>(),
                          kExperts,
                          kM,
                          q,
                          p,
                          aq.data().raw(),
                          aq.scales().data<float>(),
                          b.data().raw(),
                          b.scales().data<float>(),
                          out.raw(),
                          forward};
  const double flops = 2.0 * kM * q * p;
  for (int v = 0; v < kFp8VariantCount; ++v) {
    const double ms = time_fp8_rows_variant(v, pr);
    std::printf(
        "{\"bench\": \"fp8_variant\", \"product\": \"%s\", \"variant\": \"%s\", "
        "\"ms\": %.4f, \"tflops\": %.1f}\n",
        name, kFp8Variants[v], ms, flops / (ms * 1e-3) / 1e12);
    std::fflush(stdout);
  }
}

}  // namespace

int main() {
  product("gate_up_forward", 2048, 1536, true);
  product("down_forward", 768, 2048, true);
  product("down_input_gradient", 2048, 768, false);
  product("gate_up_input_gradient", 1536, 2048, false);
  return 0;
}
