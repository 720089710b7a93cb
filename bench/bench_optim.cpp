// AdamW (ops/optim.h) over one MoE layer's expert weights (Qwen3-30B-A3B's shapes: 128 experts of
// gate|up 2048 x 1536 and down 768 x 2048, 604M weights), one rank's optimizer step as training
// runs it: the update alone (28 bytes a weight: weight, gradient and both moments read, all but
// the gradient written back), writing the bf16 compute copy in its pass (30: bf16 experts), and
// writing FP8 128 x 128 tiles instead (the FP8 recipes on one GPU, where no gather makes them):
// both layouts (30), or the input gradient's alone (29: what one GPU holds; bench_fp8_gemm's
// fp8_transpose_tiles times the forward's layout made from them). Memory-bound: the floor is those
// bytes at the copy rate of the same run (a device-to-device copy of one f32 matrix). One JSON line
// per case: ms, GB/s, ratio to the copy.
#include <cstdio>
#include <utility>
#include <vector>

#include "bench/bench_util.h"
#include "core/quant.h"
#include "ops/elementwise.h"
#include "ops/optim.h"

namespace {

using mt::Device;
using mt::DType;
using mt::Tensor;

void report(const char* writes, int64_t weights, double bytes_per_weight, double ms,
            double copy_gbps) {
  const double gbps = bytes_per_weight * static_cast<double>(weights) / (ms * 1e-3) / 1e9;
  std::printf(
      "{\"bench\": \"adamw\", \"shape\": \"128 x (2048 x 1536 + 768 x 2048) f32\", \"writes\": "
      "\"%s\", \"weights\": %lld, \"bytes_per_weight\": %.0f, \"ms\": %.3f, \"gb_s\": %.0f, "
      "\"ratio_to_copy\": %.3f}\n",
      writes, static_cast<long long>(weights), bytes_per_weight, ms, gbps, gbps / copy_gbps);
  std::fflush(stdout);
}

}  // namespace

int main() {
  constexpr int64_t kExperts = 128, kDim = 2048, kFfn = 768;
  const mt::ops::AdamWHyper h{1e-4, 0.9, 0.95, 1e-8, 0.1, 3};
  const Tensor scalars = mt::ops::adamw_device_scalars(h);
  struct Matrix {
    Tensor p, g, m, v, compute;
    mt::QuantTensor dim0, dim1;
  };
  std::vector<Matrix> matrices;
  int64_t weights = 0;
  for (const mt::Shape& shape :
       {mt::Shape{kExperts, kDim, 2 * kFfn}, mt::Shape{kExperts, kFfn, kDim}}) {
    Matrix x;
    x.p = Tensor::empty(shape, DType::kF32, Device::kCUDA);
    x.g = Tensor::empty(shape, DType::kF32, Device::kCUDA);
    mt::ops::convert(mt::bench::random_bf16(shape, 1 + matrices.size(), 0.02), x.p);
    mt::ops::convert(mt::bench::random_bf16(shape, 11 + matrices.size(), 1e-3), x.g);
    x.m = Tensor::zeros(shape, DType::kF32, Device::kCUDA);
    x.v = Tensor::zeros(shape, DType::kF32, Device::kCUDA);
    x.compute = Tensor::empty(shape, DType::kBF16, Device::kCUDA);
    x.dim0 = mt::QuantTensor::empty(shape, mt::QuantBlock::kTile128, mt::QuantAxis::kDim0,
                                    Device::kCUDA);
    x.dim1 = mt::QuantTensor::empty(shape, mt::QuantBlock::kTile128, mt::QuantAxis::kDim1,
                                    Device::kCUDA);
    weights += x.p.numel();
    matrices.push_back(std::move(x));
  }
  Tensor copy = Tensor::empty(matrices[0].p.shape(), DType::kF32, Device::kCUDA);
  const double copy_ms = mt::bench::median_ms([&] { copy.copy_from(matrices[0].p); });
  const double copy_gbps = 2.0 * static_cast<double>(copy.nbytes()) / (copy_ms * 1e-3) / 1e9;
  const auto step_ms = [&](auto copies_of) {
    return mt::bench::median_ms([&] {
      for (Matrix& x : matrices) mt::ops::adamw_step(x.p, x.g, x.m, x.v, scalars, copies_of(x));
    });
  };
  report("none", weights, 28, step_ms([](Matrix&) { return mt::ops::AdamWCopies{}; }), copy_gbps);
  report("bf16_compute_copy", weights, 30,
         step_ms([](Matrix& x) { return mt::ops::AdamWCopies{.compute = &x.compute}; }), copy_gbps);
  report("fp8_tiles_both_layouts", weights, 30, step_ms([](Matrix& x) {
           return mt::ops::AdamWCopies{.tiles_dim0 = &x.dim0, .tiles_dim1 = &x.dim1};
         }),
         copy_gbps);
  report("fp8_tiles_input_gradient_layout", weights, 29,
         step_ms([](Matrix& x) { return mt::ops::AdamWCopies{.tiles_dim0 = &x.dim0}; }), copy_gbps);
  return 0;
}
