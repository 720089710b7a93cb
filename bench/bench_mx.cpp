// MX quantization on one GPU, JSON lines: dim0 and dim1 of a 16384 x 2048 bf16 tensor (and the
// experts' weights, 128 x 2048 x 768, along dim1) with the bytes moved (2 read + 1 + 1/32 written
// per element) over the time, beside a device-to-device copy of the same input measured in the
// same run (ratio_to_copy) and beside the copy ceiling, a 1 GiB copy (ratio_to_ceiling). Inputs
// rotate over four buffers so that no run reads from L2 what the last one left there; each
// sample times kLaunches back-to-back launches (a single 25 us kernel would time its launch).
// Last, a weight's two MX copies from its fp32 master: in two passes and from one read.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "core/cuda/check.h"
#include "core/quant.h"
#include "ops/elementwise.h"
#include "ops/mx.h"

namespace {

constexpr int kRotate = 4;
constexpr int kLaunches = 5 * kRotate;

// Median over samples of kLaunches calls of fn(i), i cycling through the rotated buffers, per call.
template <class F>
double per_launch_ms(F&& fn) {
  return mt::bench::median_ms([&] {
           for (int l = 0; l < kLaunches; ++l) fn(l % kRotate);
         }) /
         kLaunches;
}

double ceiling_gbps = 0;

void report(const std::string& name, const mt::Shape& shape, double bytes, double ms,
            double copy_gbps) {
  const double gbps = bytes / (ms * 1e-3) / 1e9;
  std::printf(
      "{\"bench\": \"%s\", \"shape\": \"%s bf16\", \"ms\": %.4f, \"gb_per_s\": %.0f, "
      "\"ratio_to_copy\": %.3f, \"ratio_to_ceiling\": %.3f}\n",
      name.c_str(), mt::shape_str(shape).c_str(), ms, gbps, copy_gbps > 0 ? gbps / copy_gbps : 1.0,
      ceiling_gbps > 0 ? gbps / ceiling_gbps : 1.0);
  std::fflush(stdout);
}

}  // namespace

int main() {
  using mt::Device;
  using mt::DType;
  using mt::MxScaleRule;
  using mt::QuantAxis;
  using mt::Tensor;
  {
    const Tensor a = Tensor::empty({int64_t{1} << 29}, DType::kBF16, Device::kCUDA);
    Tensor b = Tensor::empty({int64_t{1} << 29}, DType::kBF16, Device::kCUDA);
    const double ms = mt::bench::median_ms([&] {
      MT_CUDA_CHECK(cudaMemcpyAsync(b.raw(), a.raw(), a.nbytes(), cudaMemcpyDeviceToDevice,
                                    mt::cuda::stream()));
    });
    report("copy_d2d_ceiling", {1 << 29}, 2.0 * a.nbytes(), ms, 0);
    ceiling_gbps = 2.0 * a.nbytes() / (ms * 1e-3) / 1e9;
  }
  for (const mt::Shape& shape : {mt::Shape{16384, 2048}, mt::Shape{128, 2048, 768}}) {
    std::vector<Tensor> x, copy;
    for (int i = 0; i < kRotate; ++i) {
      x.push_back(mt::bench::random_bf16(shape, 10 + i, 1.0));
      copy.push_back(Tensor::empty(shape, DType::kBF16, Device::kCUDA));
    }
    const double in_bytes = static_cast<double>(x[0].nbytes());
    const double copy_ms = per_launch_ms([&](int i) {
      MT_CUDA_CHECK(cudaMemcpyAsync(copy[i].raw(), x[i].raw(), x[i].nbytes(),
                                    cudaMemcpyDeviceToDevice, mt::cuda::stream()));
    });
    const double copy_gbps = 2 * in_bytes / (copy_ms * 1e-3) / 1e9;
    report("copy_d2d", shape, 2 * in_bytes, copy_ms, 0);
    const double n = static_cast<double>(x[0].numel());
    const double quant_bytes = in_bytes + n + n / mt::kMxBlock;
    for (QuantAxis axis : {QuantAxis::kDim0, QuantAxis::kDim1}) {
      if (shape.size() == 3 && axis == QuantAxis::kDim0) continue;  // weights: K runs down (dim1)
      for (MxScaleRule rule : {MxScaleRule::kFloor, MxScaleRule::kRceil}) {
        std::vector<mt::QuantTensor> q;
        for (int i = 0; i < kRotate; ++i)
          q.push_back(mt::QuantTensor::empty(shape, mt::QuantBlock::kMx32, axis, Device::kCUDA));
        const double ms = per_launch_ms([&](int i) { mt::ops::mx_quantize(x[i], rule, q[i]); });
        report(std::string("mx_quantize_") + std::string(mt::quant_axis_name(axis)) + "_" +
                   std::string(mt::mx_scale_rule_name(rule)),
               shape, quant_bytes, ms, copy_gbps);
      }
      std::vector<mt::QuantTensor> q;
      for (int i = 0; i < kRotate; ++i) {
        q.push_back(mt::QuantTensor::empty(shape, mt::QuantBlock::kMx32, axis, Device::kCUDA));
        mt::ops::mx_quantize(x[i], MxScaleRule::kRceil, q[i]);
      }
      report(std::string("mx_dequantize_") + std::string(mt::quant_axis_name(axis)), shape,
             quant_bytes, per_launch_ms([&](int i) { mt::ops::mx_dequantize(q[i], copy[i]); }),
             copy_gbps);
    }
    // The one-pass round trip along dim0 (the MX values the expert products read): a copy's bytes.
    report("mx_round_trip_dim0_rceil", shape, 2 * in_bytes, per_launch_ms([&](int i) {
             mt::ops::mx_round_trip(x[i], QuantAxis::kDim0, MxScaleRule::kRceil, copy[i]);
           }),
           copy_gbps);
  }
  // A weight's two MX copies in bf16 (the forward's along K, stored transposed; the input
  // gradient's along N) from its fp32 master, as a gather on one rank makes them: in two passes
  // (4 + 2 bytes per element each) and both from one read (4 + 2 + 2).
  {
    const mt::Shape shape{128, 2048, 768}, transposed{128, 768, 2048};
    std::vector<Tensor> w, along_n, along_k;
    for (int i = 0; i < kRotate; ++i) {
      w.push_back(Tensor::empty(shape, DType::kF32, Device::kCUDA));
      mt::ops::convert(mt::bench::random_bf16(shape, 20 + i, 1.0), w.back());
      along_n.push_back(Tensor::empty(shape, DType::kBF16, Device::kCUDA));
      along_k.push_back(Tensor::empty(transposed, DType::kBF16, Device::kCUDA));
    }
    const double n = static_cast<double>(w[0].numel());
    const double two_ms = per_launch_ms([&](int i) {
      mt::ops::mx_round_trip(w[i], QuantAxis::kDim0, MxScaleRule::kRceil, along_n[i]);
      mt::ops::mx_round_trip_transposed(w[i], MxScaleRule::kRceil, along_k[i]);
    });
    const double one_ms = per_launch_ms([&](int i) {
      mt::ops::mx_round_trip_both_axes(w[i], MxScaleRule::kRceil, along_n[i], along_k[i]);
    });
    const double one_gbps = 8 * n / (one_ms * 1e-3) / 1e9;
    std::printf(
        "{\"bench\": \"mx_weight_copies\", \"shape\": \"%s f32 -> 2 x bf16\", \"two_passes_ms\": "
        "%.4f, \"one_read_ms\": %.4f, \"speedup\": %.2f, \"one_read_gb_per_s\": %.0f, "
        "\"ratio_to_ceiling\": %.3f, \"floor_ms\": %.4f}\n",
        mt::shape_str(shape).c_str(), two_ms, one_ms, two_ms / one_ms, one_gbps,
        ceiling_gbps > 0 ? one_gbps / ceiling_gbps : 1.0,
        ceiling_gbps > 0 ? 8 * n / (ceiling_gbps * 1e9) * 1e3 : 0.0);
    std::fflush(stdout);
  }
  return 0;
}
