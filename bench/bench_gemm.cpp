// GEMM benchmarks on one GPU, JSON lines: the dense cuBLASLt bf16 ceiling (8192^3), and the
// grouped expert GEMMs (forward, dx, dw) at the balanced shape of ../shared/GPU.md
// (131072 x 2048 rows by 128 experts of 2048 x 1536), each with its ratio to the dense ceiling
// measured in the same run. The PyTorch comparator (torch._grouped_mm) is
// bench/grouped_mm_torch.py. Then mx_gemm: the four MX products of the Qwen3-30B-A3B expert
// layer (ops/mx_gemm.h) over the same balanced rows, each beside the bf16 product the ops run for
// the same shape (bf16 operands: the emulated path's GEMM), and the quantization of its rows.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "core/cuda/check.h"
#include "ops/cuda/grouped_gemm.h"
#include "ops/gemm.h"
#include "ops/grouped_gemm.h"
#include "ops/mx.h"
#include "ops/mx_gemm.h"

namespace {

void report(const char* name, const char* shape, double flops, double ms, double ceiling_tflops) {
  const double tflops = flops / (ms * 1e-3) / 1e12;
  std::printf(
      "{\"bench\": \"%s\", \"shape\": \"%s\", \"ms\": %.4f, \"tflops\": %.1f, "
      "\"ratio_to_dense_ceiling\": %.3f}\n",
      name, shape, ms, tflops, ceiling_tflops > 0 ? tflops / ceiling_tflops : 1.0);
  std::fflush(stdout);
}

}  // namespace

int main() {
  using mt::Device;
  using mt::DType;
  using mt::Tensor;
  // Dense ceiling: cuBLASLt bf16, 8192^3.
  const int64_t d = 8192;
  const Tensor a = mt::bench::random_bf16({d, d}, 1, 1.0),
               b = mt::bench::random_bf16({d, d}, 2, 1.0);
  Tensor c = Tensor::empty({d, d}, DType::kBF16, Device::kCUDA);
  const double dense_ms = mt::bench::median_ms([&] {
    mt::ops::gemm(a, mt::ops::Transpose::kNo, b, mt::ops::Transpose::kNo, c,
                  mt::ops::Accumulate::kNo);
  });
  const double dense_flops = 2.0 * d * d * d;
  const double ceiling = dense_flops / (dense_ms * 1e-3) / 1e12;
  report("dense_gemm_cublaslt", "8192x8192x8192 bf16", dense_flops, dense_ms, 0);

  // Grouped, balanced: 128 experts x 1024 rows, K 2048, N 1536 (Qwen3-30B-A3B gate|up).
  const int64_t experts = 128, rows_per_expert = 1024, m = experts * rows_per_expert;
  const int64_t k = 2048, n = 1536;
  Tensor off_host = Tensor::empty({experts + 1}, DType::kI64);
  for (int64_t e = 0; e <= experts; ++e) off_host.data<int64_t>()[e] = e * rows_per_expert;
  const Tensor off = off_host.to(Device::kCUDA);
  const Tensor x = mt::bench::random_bf16({m, k}, 3, 1.0),
               w = mt::bench::random_bf16({experts, k, n}, 4, 0.05);
  const Tensor dy = mt::bench::random_bf16({m, n}, 5, 1.0);
  Tensor out = Tensor::empty({m, n}, DType::kBF16, Device::kCUDA);
  Tensor dx = Tensor::empty({m, k}, DType::kBF16, Device::kCUDA);
  Tensor dw = Tensor::zeros({experts, k, n}, DType::kF32, Device::kCUDA);
  const double flops = 2.0 * m * k * n;
  const char* shape = "131072x2048 @ 128x2048x1536 bf16 balanced";
  // What the ops use (CUTLASS's Hopper kernels where built), then version 1 directly.
  report("grouped_gemm_forward", shape, flops,
         mt::bench::median_ms([&] { mt::ops::grouped_gemm_forward(x, w, off, out); }), ceiling);
  report("grouped_gemm_dx", shape, flops,
         mt::bench::median_ms([&] { mt::ops::grouped_gemm_backward_input(dy, w, off, dx); }),
         ceiling);
  report("grouped_gemm_dw", shape, flops,
         mt::bench::median_ms([&] { mt::ops::grouped_gemm_backward_weight(x, dy, off, dw); }),
         ceiling);
  // The trainer's first write of a step: beta 0, no read of the f32 gradient.
  report("grouped_gemm_dw_overwrite", shape, flops, mt::bench::median_ms([&] {
           mt::ops::grouped_gemm_backward_weight(x, dy, off, dw, mt::ops::Accumulate::kNo);
         }),
         ceiling);
  const mt::cuda::kernels::ExpertSegments o{off.data<int64_t>(), off.data<int64_t>()};  // dense
  const int ne = static_cast<int>(experts);
  report("grouped_gemm_forward_v1", shape, flops, mt::bench::median_ms([&] {
           MT_CUDA_CHECK(mt::cuda::kernels::grouped_gemm_rows(x.raw(), w.raw(), o, ne, m, k, n,
                                                              false, out.raw(), false, nullptr));
         }),
         ceiling);

  // MX: rows in 128-row segments (1024 per expert: already aligned), the layer's four products.
  const mt::ops::ExpertRows padded(off, off, 128);
  struct Product {
    const char* name;
    int64_t p, q;       // out (m, p) = a (m, q) b[e]^T
    bool transposed_w;  // bf16 comparator: forward x w (w (E, q, p)), else input grad dy w^T
  };
  for (const Product& pr :
       {Product{"gate_up_forward", 1536, 2048, true}, Product{"down_forward", 2048, 768, true},
        Product{"down_input_gradient", 768, 2048, false},
        Product{"gate_up_input_gradient", 2048, 1536, false}}) {
    const Tensor rows_bf16 = mt::bench::random_bf16({m, pr.q}, 6, 1.0);
    const Tensor b = mt::bench::random_bf16({experts, pr.p, pr.q}, 7, 0.05);
    const Tensor w_kn = mt::bench::random_bf16({experts, pr.q, pr.p}, 8, 0.05);
    mt::QuantTensor a = mt::QuantTensor::empty({m, pr.q}, mt::QuantBlock::kMx32,
                                               mt::QuantAxis::kDim0, Device::kCUDA);
    Tensor o = Tensor::empty({m, pr.p}, DType::kBF16, Device::kCUDA);
    const double f = 2.0 * m * pr.p * pr.q;
    const std::string s = std::to_string(m) + "x" + std::to_string(pr.q) + " @ 128x" +
                          std::to_string(pr.q) + "x" + std::to_string(pr.p) + " balanced";
    const std::string mx_name = std::string("mx_gemm_") + pr.name;
    const std::string bf16_name = std::string("bf16_gemm_") + pr.name;
    const double quantize_ms =
        mt::bench::median_ms([&] { mt::ops::mx_quantize(rows_bf16, mt::MxScaleRule::kRceil, a); });
    std::printf("{\"bench\": \"mx_quantize_rows_%s\", \"shape\": \"%s\", \"ms\": %.4f}\n", pr.name,
                s.c_str(), quantize_ms);
    report(mx_name.c_str(), s.c_str(), f,
           mt::bench::median_ms([&] { mt::ops::mx_grouped_gemm(a, b, padded, o); }), ceiling);
    report(bf16_name.c_str(), s.c_str(), f, mt::bench::median_ms([&] {
             if (pr.transposed_w)
               mt::ops::grouped_gemm_forward(rows_bf16, w_kn, padded, o);
             else
               mt::ops::grouped_gemm_backward_input(rows_bf16, b, padded, o);
           }),
           ceiling);
  }
  return 0;
}
