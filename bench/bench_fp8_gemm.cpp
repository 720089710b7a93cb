// FP8 blockwise expert products on one GPU (ops/fp8_gemm.h), JSON lines: the six products of the
// Qwen3-30B-A3B expert layer (128 experts, 131,072 expert rows: dim 2048, expert dim 768,
// gate|up 1536) on the FP8 tensor cores, each beside our bf16 product over the same rows in the
// same run (the bar: >= 1.6x): the forward and input gradients by our kernel over the
// padded layout (`_fixed`, what the MoE layer runs) and by CUTLASS's grouped kernels in both
// schedules; TFLOP/s over the real rows.
// Rows: balanced (1024 per expert) and ragged (counts 512..1536, segments on 128-row boundaries,
// as the MoE layer lays them out). Then the quantizations the recipe adds, against a copy's
// rate. torch._scaled_grouped_mm (row-wise FP8, torchao's Hopper MoE path) is
// bench/fp8_grouped_mm_torch.py. Last, the dense layers' products in FP8 (model.dense_recipe)
// against bf16.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "bench/bench_util.h"
#include "core/cuda/check.h"
#include "core/quant.h"
#include "model/config.h"
#include "model/qwen3_moe.h"
#include "ops/cuda/fp8_gemm.h"
#include "ops/fp8.h"
#include "ops/fp8_gemm.h"
#include "ops/grouped_gemm.h"
#include "ops/loss.h"

namespace {

using mt::Device;
using mt::DType;
using mt::QuantAxis;
using mt::QuantBlock;
using mt::QuantTensor;
using mt::Tensor;
namespace kernels = mt::cuda::kernels;

constexpr int64_t kExperts = 128;

struct Layout {
  const char* name;
  Tensor offsets, segments;  // on the GPU
  int64_t rows = 0;          // real rows
  int64_t capacity = 0;      // rows with padding
  mt::ops::ExpertRows expert_rows() const { return {offsets, segments, 128}; }
};

Layout make_layout(const char* name, bool ragged) {
  std::mt19937_64 rng(7);
  Tensor off = Tensor::empty({kExperts + 1}, DType::kI64),
         seg = Tensor::empty({kExperts + 1}, DType::kI64);
  int64_t o = 0, s = 0;
  for (int64_t e = 0; e < kExperts; ++e) {
    off.data<int64_t>()[e] = o;
    seg.data<int64_t>()[e] = s;
    // Ragged: pairs of experts take 1024 +- d rows (the total stays 131,072).
    const int64_t d = ragged ? static_cast<int64_t>(rng() % 513) : 0;
    const int64_t count =
        e % 2 == 0 ? 1024 + d : 2048 - (off.data<int64_t>()[e] - off.data<int64_t>()[e - 1]);
    o += count;
    s += (count + 127) / 128 * 128;
  }
  off.data<int64_t>()[kExperts] = o;
  seg.data<int64_t>()[kExperts] = s;
  return {name, off.to(Device::kCUDA), seg.to(Device::kCUDA), o, s};
}

void report(const std::string& bench, const std::string& shape, double flops, double ms,
            const char* comparator, double comparator_ms) {
  const double tflops = flops / (ms * 1e-3) / 1e12;
  std::printf(
      "{\"bench\": \"%s\", \"shape\": \"%s\", \"ms\": %.4f, \"tflops\": %.1f, "
      "\"comparator\": \"%s\", \"comparator_ms\": %.4f, \"speedup\": %.3f}\n",
      bench.c_str(), shape.c_str(), ms, tflops, comparator, comparator_ms,
      comparator_ms > 0 ? comparator_ms / ms : 0.0);
  std::fflush(stdout);
}

QuantTensor rows_fp8(const Tensor& x) {
  QuantTensor q =
      QuantTensor::empty(x.shape(), QuantBlock::kRow128, QuantAxis::kDim0, Device::kCUDA);
  mt::ops::fp8_quantize(x, mt::Fp8ScaleRule::kFp32, q);
  return q;
}

// One product out (M, P) = a (M, Q) op(w) of the rows, FP8 against bf16.
struct RowsProduct {
  const char* name;
  int64_t q, p;            // contraction and output width
  bool weight_transposed;  // b = w^T (the forward) or b = w (the input gradient)
};

void bench_rows(const Layout& l, const RowsProduct& pr) {
  const int64_t m = l.capacity, k = pr.weight_transposed ? pr.q : pr.p,
                n = pr.weight_transposed ? pr.p : pr.q;
  const Tensor a = mt::bench::random_bf16({m, pr.q}, 3, 1.0);
  const Tensor w = mt::bench::random_bf16({kExperts, k, n}, 4, 0.05);  // (E, K, N)
  Tensor out = Tensor::empty({m, pr.p}, DType::kBF16, Device::kCUDA);
  const double flops = 2.0 * l.rows * pr.q * pr.p;
  const std::string shape = std::string(l.name) + " " + std::to_string(l.rows) + " rows, Q " +
                            std::to_string(pr.q) + ", P " + std::to_string(pr.p);
  const mt::ops::ExpertRows rows = l.expert_rows();
  const double bf16_ms = mt::bench::median_ms([&] {
    mt::ops::grouped_gemm(
        a, w, pr.weight_transposed ? mt::ops::Transpose::kNo : mt::ops::Transpose::kYes, rows, out);
  });
  report(std::string("bf16_") + pr.name, shape, flops, bf16_ms, "none", 0);
  const QuantTensor aq = rows_fp8(a);
  QuantTensor w0 =
      QuantTensor::empty(w.shape(), QuantBlock::kTile128, QuantAxis::kDim0, Device::kCUDA);
  QuantTensor w1 =
      QuantTensor::empty(w.shape(), QuantBlock::kTile128, QuantAxis::kDim1, Device::kCUDA);
  mt::ops::fp8_quantize_both_axes(w, mt::Fp8ScaleRule::kFp32, w0, w1);
  const QuantTensor& b = pr.weight_transposed ? w1 : w0;
  const kernels::Fp8Operands ops{aq.data().raw(), aq.scales().data<float>(), b.data().raw(),
                                 b.scales().data<float>(), out.raw()};
  Tensor ws = Tensor::empty({static_cast<int64_t>(kernels::fp8_gemm_rows_workspace(kExperts))},
                            DType::kU8, Device::kCUDA);
  const kernels::ExpertSegments seg{l.offsets.data<int64_t>(), l.segments.data<int64_t>()};
  for (auto [schedule, sname] : {std::pair{kernels::Fp8Schedule::kCooperative, "cooperative"},
                                 std::pair{kernels::Fp8Schedule::kPingpong, "pingpong"}}) {
    const double ms = mt::bench::median_ms([&] {
      MT_CUDA_CHECK(kernels::fp8_gemm_rows(seg, static_cast<int>(kExperts), ops,
                                           pr.weight_transposed ? kernels::Fp8WeightScales::kMnMajor
                                                                : kernels::Fp8WeightScales::kKMajor,
                                           m, pr.p, pr.q, schedule, ws.raw(), ws.nbytes(),
                                           mt::cuda::stream()));
    });
    report(std::string("fp8_") + pr.name + "_" + sname, shape, flops, ms, "bf16", bf16_ms);
  }
  Tensor fixed_ws =
      Tensor::empty({static_cast<int64_t>(kernels::fp8_gemm_rows_fixed_workspace(m, pr.p, pr.q))},
                    DType::kU8, Device::kCUDA);
  const double fixed_ms = mt::bench::median_ms([&] {
    MT_CUDA_CHECK(kernels::fp8_gemm_rows_fixed(
        l.segments.data<int64_t>(), static_cast<int>(kExperts), ops,
        pr.weight_transposed ? kernels::Fp8WeightScales::kMnMajor
                             : kernels::Fp8WeightScales::kKMajor,
        m, pr.p, pr.q, fixed_ws.raw(), fixed_ws.nbytes(), mt::cuda::stream()));
  });
  report(std::string("fp8_") + pr.name + "_fixed", shape, flops, fixed_ms, "bf16", bf16_ms);
}

void bench_weight(const Layout& l, const char* name, int64_t k, int64_t n) {
  const int64_t m = l.capacity;
  const Tensor x = mt::bench::random_bf16({m, k}, 5, 1.0),
               dy = mt::bench::random_bf16({m, n}, 6, 1.0);
  Tensor dw = Tensor::zeros({kExperts, k, n}, DType::kF32, Device::kCUDA);
  const double flops = 2.0 * l.rows * k * n;
  const std::string shape = std::string(l.name) + " " + std::to_string(l.rows) + " rows, K " +
                            std::to_string(k) + ", N " + std::to_string(n) + ", f32 out";
  const mt::ops::ExpertRows rows = l.expert_rows();
  const double bf16_ms = mt::bench::median_ms(
      [&] { mt::ops::grouped_gemm_backward_weight(x, dy, rows, dw, mt::ops::Accumulate::kNo); });
  report(std::string("bf16_") + name, shape, flops, bf16_ms, "none", 0);
  QuantTensor xt = QuantTensor::empty(mt::ops::fp8_expert_rows_shape(x), QuantBlock::kRow128,
                                      QuantAxis::kDim1, Device::kCUDA);
  QuantTensor dyt = QuantTensor::empty(mt::ops::fp8_expert_rows_shape(dy), QuantBlock::kRow128,
                                       QuantAxis::kDim1, Device::kCUDA);
  const double quant_ms = mt::bench::median_ms([&] {
    mt::ops::fp8_quantize_expert_rows(x, rows, mt::Fp8ScaleRule::kFp32, xt);
    mt::ops::fp8_quantize_expert_rows(dy, rows, mt::Fp8ScaleRule::kFp32, dyt);
  });
  const double bytes = static_cast<double>(m) * (k + n) * 3;  // bf16 in, e4m3 out
  std::printf(
      "{\"bench\": \"fp8_quantize_expert_rows_%s\", \"shape\": \"%s\", \"ms\": %.4f, "
      "\"gbps\": %.0f}\n",
      name, shape.c_str(), quant_ms, bytes / (quant_ms * 1e-3) / 1e9);
  const kernels::Fp8Operands ops{xt.data().raw(), xt.scales().data<float>(), dyt.data().raw(),
                                 dyt.scales().data<float>(), dw.raw()};
  Tensor ws = Tensor::empty({static_cast<int64_t>(kernels::fp8_gemm_weight_workspace(kExperts))},
                            DType::kU8, Device::kCUDA);
  const kernels::ExpertSegments seg{l.offsets.data<int64_t>(), l.segments.data<int64_t>()};
  for (auto [schedule, sname] : {std::pair{kernels::Fp8Schedule::kCooperative, "cooperative"},
                                 std::pair{kernels::Fp8Schedule::kPingpong, "pingpong"}}) {
    const double ms = mt::bench::median_ms([&] {
      MT_CUDA_CHECK(kernels::fp8_gemm_weight(seg, static_cast<int>(kExperts), ops, xt.shape()[0], k,
                                             n, false, schedule, ws.raw(), ws.nbytes(),
                                             mt::cuda::stream()));
    });
    report(std::string("fp8_") + name + "_" + sname, shape, flops, ms, "bf16", bf16_ms);
  }
}

void bench_quantize(const Layout& l) {
  const int64_t m = l.capacity;
  const Tensor x = mt::bench::random_bf16({m, 2048}, 8, 1.0);
  Tensor copy = Tensor::empty(x.shape(), DType::kBF16, Device::kCUDA);
  const double copy_ms = mt::bench::median_ms([&] { copy.copy_from(x); });
  const double copy_gbps = 2.0 * x.nbytes() / (copy_ms * 1e-3) / 1e9;
  QuantTensor q =
      QuantTensor::empty(x.shape(), QuantBlock::kRow128, QuantAxis::kDim0, Device::kCUDA);
  const double ms =
      mt::bench::median_ms([&] { mt::ops::fp8_quantize(x, mt::Fp8ScaleRule::kFp32, q); });
  const double gbps = 1.5 * x.nbytes() / (ms * 1e-3) / 1e9;
  std::printf(
      "{\"bench\": \"fp8_quantize_rows\", \"shape\": \"%lld x 2048 bf16\", \"ms\": %.4f, "
      "\"gbps\": %.0f, \"copy_gbps\": %.0f, \"ratio_to_copy\": %.3f}\n",
      static_cast<long long>(m), ms, gbps, copy_gbps, gbps / copy_gbps);
  const Tensor w = mt::bench::random_bf16({kExperts, 2048, 1536}, 9, 0.05);
  QuantTensor w0 =
      QuantTensor::empty(w.shape(), QuantBlock::kTile128, QuantAxis::kDim0, Device::kCUDA);
  QuantTensor w1 =
      QuantTensor::empty(w.shape(), QuantBlock::kTile128, QuantAxis::kDim1, Device::kCUDA);
  const double wms = mt::bench::median_ms(
      [&] { mt::ops::fp8_quantize_both_axes(w, mt::Fp8ScaleRule::kFp32, w0, w1); });
  const double wgbps = 2.0 * w.nbytes() / (wms * 1e-3) / 1e9;  // bf16 in, two e4m3 copies out
  std::printf(
      "{\"bench\": \"fp8_quantize_weight_both_axes\", \"shape\": \"128 x 2048 x 1536 bf16\", "
      "\"ms\": %.4f, \"gbps\": %.0f, \"ratio_to_copy\": %.3f}\n",
      wms, wgbps, wgbps / copy_gbps);
  // The forward's layout from the input gradient's (one GPU holds only that one): a byte a weight
  // read and written.
  const double tms = mt::bench::median_ms([&] { mt::ops::fp8_transpose_tiles(w0, w1); });
  const double tgbps = 2.0 * static_cast<double>(w0.data().nbytes()) / (tms * 1e-3) / 1e9;
  std::printf(
      "{\"bench\": \"fp8_transpose_tiles\", \"shape\": \"128 x 2048 x 1536 e4m3\", \"ms\": %.4f, "
      "\"gbps\": %.0f, \"ratio_to_copy\": %.3f}\n",
      tms, tgbps, tgbps / copy_gbps);
}

// The dense layers' products (model.dense_recipe) at the 8-layer preset's step, 16,384 tokens:
// the attention projections' forward and input gradient and the LM head's, each beside the bf16
// GEMM the model runs otherwise (ops::gemm, cuBLAS): the FP8 product alone (ops::fp8_gemm, both
// operands quantized before), then the whole call the model makes (ops::fp8_linear_forward or
// _backward_input: the row operand's 1 x 128 quantization and the weight's tiles included).
enum class Product { kForward, kInputGradient };
void bench_dense(const char* name, int64_t m, int64_t in, int64_t out, Product product) {
  const bool forward = product == Product::kForward;
  const int64_t q = forward ? in : out, p = forward ? out : in;  // contraction, output width
  const Tensor a = mt::bench::random_bf16({m, q}, 12, 1.0);
  const Tensor w = mt::bench::random_bf16({in, out}, 13, 0.05);
  Tensor y = Tensor::empty({m, p}, DType::kBF16, Device::kCUDA);
  const double flops = 2.0 * m * q * p;
  const std::string shape =
      std::to_string(m) + " rows, in " + std::to_string(in) + ", out " + std::to_string(out);
  const auto no = mt::ops::Transpose::kNo;
  const double bf16_ms = mt::bench::median_ms([&] {
    mt::ops::gemm(a, no, w, forward ? no : mt::ops::Transpose::kYes, y, mt::ops::Accumulate::kNo);
  });
  report(std::string("bf16_") + name, shape, flops, bf16_ms, "none", 0);
  const QuantTensor aq = rows_fp8(a);
  QuantTensor b = QuantTensor::empty(w.shape(), QuantBlock::kTile128,
                                     forward ? QuantAxis::kDim1 : QuantAxis::kDim0, Device::kCUDA);
  mt::ops::fp8_quantize(w, mt::Fp8ScaleRule::kFp32, b);
  const double ms = mt::bench::median_ms([&] { mt::ops::fp8_gemm(aq, b, y); });
  report(std::string("fp8_") + name, shape, flops, ms, "bf16", bf16_ms);
  const double whole_ms = mt::bench::median_ms([&] {
    if (forward)
      mt::ops::fp8_linear_forward(mt::ops::fp8_rows(a, mt::Fp8ScaleRule::kFp32), w, no,
                                  mt::Fp8ScaleRule::kFp32, y);
    else
      mt::ops::fp8_linear_backward_input(a, w, no, mt::Fp8ScaleRule::kFp32, y);
  });
  report(std::string("fp8_") + name + "_with_quantization", shape, flops, whole_ms, "bf16",
         bf16_ms);
}

// The LM head's input gradient as the model runs it from the logits (Qwen3Moe::head_and_loss),
// 16,384 tokens: bf16, the cross-entropy backward writing dlogits over the logits and cuBLAS's
// dx = dlogits w^T; FP8, the model's own mt::fp8_head_backward_input (the same backward writing
// each slice of kHeadFp8GradientRows rows' FP8 rows in its kernel, each slice's dx on
// ops::fp8_gemm; the weight's tiles made before, once a step). The rate is the product's FLOPs over
// the whole time, the backward's included.
void bench_head_input_gradient(int64_t m, int64_t dim, int64_t vocab) {
  Tensor logits = mt::bench::random_bf16({m, vocab}, 14, 2.0);
  const Tensor w = mt::bench::random_bf16({dim, vocab}, 15, 0.05);
  Tensor targets = Tensor::empty({m}, DType::kI32), mask = Tensor::empty({m}, DType::kU8);
  for (int64_t i = 0; i < m; ++i) {
    targets.set_item(i, static_cast<double>((i * 7919) % vocab));
    mask.set_item(i, 1);
  }
  targets = targets.to(Device::kCUDA);
  mask = mask.to(Device::kCUDA);
  Tensor lse = Tensor::empty({m}, DType::kF32, Device::kCUDA);
  Tensor scale = Tensor::empty({1}, DType::kF64);
  scale.set_item(0, 1.0 / static_cast<double>(m));
  scale = scale.to(Device::kCUDA);
  mt::ops::cross_entropy_forward(logits, targets, mask, lse);
  Tensor dx = Tensor::empty({m, dim}, DType::kBF16, Device::kCUDA);
  const double flops = 2.0 * m * dim * vocab;
  const std::string shape = std::to_string(m) + " rows, dim " + std::to_string(dim) +
                            ", vocabulary " + std::to_string(vocab);
  const auto no = mt::ops::Transpose::kNo;
  // In place, as the model runs it: each repetition reads the last one's dlogits as its logits
  // (finite; the kernels' work does not depend on the values).
  const double bf16_ms = mt::bench::median_ms([&] {
    mt::ops::cross_entropy_backward(logits, targets, mask, lse, scale, logits);
    mt::ops::gemm(logits, no, w, mt::ops::Transpose::kYes, dx, mt::ops::Accumulate::kNo);
  });
  report("bf16_lm_head_backward_input_from_logits", shape, flops, bf16_ms, "none", 0);
  const mt::ops::Fp8LinearWeight tiles = mt::ops::fp8_linear_weight(
      w, no, mt::Fp8ScaleRule::kFp32, mt::ops::Fp8LinearUse::kInputGradient);
  const int64_t slice = std::min(m, mt::kHeadFp8GradientRows);
  QuantTensor q =
      QuantTensor::empty({slice, vocab}, QuantBlock::kRow128, QuantAxis::kDim0, Device::kCUDA);
  const double ms = mt::bench::median_ms([&] {
    mt::fp8_head_backward_input(logits, targets, mask, lse, scale, tiles.input_gradient,
                                mt::Fp8ScaleRule::kFp32, q, dx);
  });
  report("fp8_lm_head_backward_input_from_logits", shape, flops, ms, "bf16", bf16_ms);
}

}  // namespace

// Usage: bench_fp8_gemm [products] [quantize] [dense]: the sections named, or all of them.
int main(int argc, char** argv) {
  const auto wanted = [&](std::string_view section) {
    if (argc < 2) return true;
    for (int i = 1; i < argc; ++i)
      if (section == argv[i]) return true;
    return false;
  };
  for (const Layout& l : {make_layout("balanced", false), make_layout("ragged", true)}) {
    if (wanted("products")) {
      bench_rows(l, {"gate_up_forward", 2048, 1536, true});
      bench_rows(l, {"down_forward", 768, 2048, true});
      bench_rows(l, {"down_input_gradient", 2048, 768, false});
      bench_rows(l, {"gate_up_input_gradient", 1536, 2048, false});
      bench_weight(l, "gate_up_weight_gradient", 2048, 1536);
      bench_weight(l, "down_weight_gradient", 768, 2048);
    }
    if (wanted("quantize") && std::string(l.name) == "balanced") bench_quantize(l);
  }
  if (wanted("dense")) {
    constexpr int64_t kTokens = 16384;
    for (const Product product : {Product::kForward, Product::kInputGradient}) {
      const bool fwd = product == Product::kForward;
      bench_dense(fwd ? "attn_q_forward" : "attn_q_input_gradient", kTokens, 2048, 4096, product);
      bench_dense(fwd ? "attn_kv_forward" : "attn_kv_input_gradient", kTokens, 2048, 512, product);
      bench_dense(fwd ? "attn_o_forward" : "attn_o_input_gradient", kTokens, 4096, 2048, product);
      bench_dense(fwd ? "lm_head_forward" : "lm_head_input_gradient", kTokens, 2048, 151936,
                  product);
    }
    bench_head_input_gradient(kTokens, 2048, 151936);
  }
  return 0;
}
