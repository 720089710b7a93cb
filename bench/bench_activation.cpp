// SwiGLU (ops/activation.h) at the MoE layer's expert rows: 131072 rows (16384 tokens, top-8) of
// gate|up 2 x 768 in bf16, with the routing weights and padding marks the layer gives it. Both
// passes are memory-bound: the floor is their bytes (forward: h read, a written, 6 bytes an output
// element with the row's weight; backward: h and da read, dh written, 10 bytes) at the copy rate
// of the same run (a device-to-device copy of h). One JSON line per case: shape, ms, GB/s and the
// ratio to that copy; with the fused MX values (the MX recipes' forward) beside the plain pass.
#include <cstdio>

#include "bench/bench_util.h"
#include "core/cuda/check.h"
#include "core/cuda/stream.h"
#include "ops/activation.h"
#include "ops/mx.h"

namespace {

using mt::Device;
using mt::DType;
using mt::Tensor;

void report(const char* name, int64_t m, int64_t f, double bytes, double ms, double copy_gbps) {
  const double gbps = bytes / (ms * 1e-3) / 1e9;
  std::printf(
      "{\"bench\": \"swiglu\", \"pass\": \"%s\", \"rows\": %lld, \"f\": %lld, \"ms\": %.4f, "
      "\"gb_s\": %.0f, \"ratio_to_copy\": %.3f}\n",
      name, static_cast<long long>(m), static_cast<long long>(f), ms, gbps,
      copy_gbps > 0 ? gbps / copy_gbps : 1.0);
}

}  // namespace

int main() {
  constexpr int64_t m = 16384 * 8, f = 768;
  const Tensor h = mt::bench::random_bf16({m, 2 * f}, 1, 1.0);
  const Tensor da = mt::bench::random_bf16({m, f}, 2, 1.0);
  Tensor a = Tensor::empty({m, f}, DType::kBF16, Device::kCUDA);
  Tensor dh = Tensor::empty({m, 2 * f}, DType::kBF16, Device::kCUDA);
  Tensor copy = Tensor::empty({m, 2 * f}, DType::kBF16, Device::kCUDA);
  // Every row real (token >= 0), weights from the routing (f32 on the GPU).
  Tensor token = Tensor::zeros({m}, DType::kI32).to(Device::kCUDA);
  Tensor weight = Tensor::empty({m}, DType::kF32);
  for (int64_t r = 0; r < m; ++r) weight.data<float>()[r] = 0.125f;
  weight = weight.to(Device::kCUDA);
  Tensor dweight = Tensor::empty({m}, DType::kF32, Device::kCUDA);
  const mt::ops::SwigluRows rows{&token, &weight};

  const double copy_ms = mt::bench::median_ms([&] {
    MT_CUDA_CHECK(cudaMemcpyAsync(copy.raw(), h.raw(), h.nbytes(), cudaMemcpyDeviceToDevice,
                                  mt::cuda::stream()));
  });
  const double copy_gbps = 2.0 * static_cast<double>(h.nbytes()) / (copy_ms * 1e-3) / 1e9;
  report("copy_h", m, f, 2.0 * static_cast<double>(h.nbytes()), copy_ms, 0);

  const double elems = static_cast<double>(m * f);
  report("forward", m, f, elems * 6,
         mt::bench::median_ms([&] { mt::ops::swiglu_forward(h, a, rows); }), copy_gbps);
  const mt::ops::MxValuesOut mx{&a, mt::MxScaleRule::kRceil};  // the MX values in place of a
  report("forward_mx_values", m, f, elems * 6,
         mt::bench::median_ms([&] { mt::ops::swiglu_forward(h, a, rows, &mx); }), copy_gbps);
  report("backward", m, f, elems * 10,
         mt::bench::median_ms([&] { mt::ops::swiglu_backward(h, da, dh, rows, &dweight); }),
         copy_gbps);
  std::fflush(stdout);
  return 0;
}
