// The expert products' numerics against fp64 (docs/numerics.md). Trains CONFIG (bf16 experts) to
// its last step, then runs one more step eagerly with moe::set_expert_operands_tap capturing each
// expert matrix's operands as the run has them (x, dy, w), and computes per layer and matrix, in
// fp64 on the host:
//
// 1. Each recipe's three products against the exact ones (JSON "expert_product_error"): forward
//    out = x w, input gradient dx = dy w^T, weight gradient dw = x^T dy, each from its operands
//    quantized as the recipe quantizes them and dequantized exactly, multiplied in fp64 (the
//    recipes' definitions; the GPU kernels are tested against them): fp8_blockwise (1 x 128 along
//    the contraction, the weight in 128 x 128 tiles, the weight gradient's operands along the
//    tokens per expert; fp32 scales) and mxfp8 (1 x 32 along the contraction, RCEIL). The
//    relative error is the Frobenius norm's over the experts' rows.
// 2. The numerics question of MXFP8 dispatch (issue 15, JSON "mx_wgrad_error"): rows that arrive
//    quantized along the hidden dimension (dim0) cannot be quantized along the tokens (dim1) as
//    the original bf16 would be; requant_dim1 dequantizes them and quantizes again along dim1:
//      exact       dW = x^T dy (each expert's rows)
//      original    x and dy quantized along the tokens (mx_round_trip_expert_rows, as mxfp8 does)
//      requantized the operand MXFP8 dispatch delivers (gate_up: x, the dispatched rows; down: dy,
//                  the output gradient the combine's backward sends) first quantized along dim0
//                  and dequantized (the wire), then as `original`
//    with each variant's relative error (Frobenius) to the exact gradient, the two variants'
//    difference, and the wire's own error on the operand.
// Usage: bench_expert_gemm_error CONFIG [section.key=value ...]   (CHECKPOINT_DIR: where the run's
// final checkpoint goes, default /tmp/moetrain-expert-gemm-error)
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/quant.h"
#include "moe/moe_layer.h"
#include "ops/fp8.h"
#include "ops/grouped_gemm.h"
#include "ops/mx.h"
#include "train/config.h"
#include "train/trainer.h"
#if MOETRAIN_HAS_CUDA
#include "core/cuda/device.h"
#endif

namespace {

struct Tapped {
  std::string product;
  mt::Tensor x, dy, w;  // f64 on the host
  mt::Tensor offsets, segments;
  int64_t align;
};

mt::Tensor host_f64(const mt::Tensor& t) {
  const mt::Tensor h = t.to(mt::Device::kCPU);
  return h.dtype() == mt::DType::kF64 ? h : h.to(mt::DType::kF64);
}

// dW (E, K, N) from x (M, K) and dy (M, N) over the experts' rows, in fp64.
mt::Tensor weight_gradient(const mt::Tensor& x, const mt::Tensor& dy, const Tapped& t) {
  const mt::ops::ExpertRows rows(t.offsets, t.segments, t.align);
  mt::Tensor dw = mt::Tensor::zeros({t.offsets.numel() - 1, x.dim(1), dy.dim(1)}, mt::DType::kF64);
  mt::ops::grouped_gemm_backward_weight(x, dy, rows, dw, mt::ops::Accumulate::kNo);
  return dw;
}

mt::Tensor along_tokens(const mt::Tensor& t, const Tapped& tap) {
  mt::Tensor out = t.clone();
  mt::ops::mx_round_trip_expert_rows(t, mt::ops::ExpertRows(tap.offsets, tap.segments, tap.align),
                                     mt::MxScaleRule::kRceil, out);
  return out;
}

// t quantized in MX blocks along `axis` and dequantized.
mt::Tensor mx_along(const mt::Tensor& t, mt::QuantAxis axis) {
  mt::Tensor out = t.clone();
  mt::ops::mx_round_trip(t, axis, mt::MxScaleRule::kRceil, out);
  return out;
}

mt::Tensor wire(const mt::Tensor& t) {  // quantized along dim0 and dequantized
  return mx_along(t, mt::QuantAxis::kDim0);
}

// out (M, N) = x w and dx (M, K) = dy w^T over the experts' rows, in fp64.
mt::Tensor forward(const mt::Tensor& x, const mt::Tensor& w, const Tapped& t) {
  mt::Tensor out = mt::Tensor::zeros({x.dim(0), w.dim(2)}, mt::DType::kF64);
  mt::ops::grouped_gemm(x, w, mt::ops::Transpose::kNo,
                        mt::ops::ExpertRows(t.offsets, t.segments, t.align), out);
  return out;
}
mt::Tensor input_gradient(const mt::Tensor& dy, const mt::Tensor& w, const Tapped& t) {
  mt::Tensor dx = mt::Tensor::zeros({dy.dim(0), w.dim(1)}, mt::DType::kF64);
  mt::ops::grouped_gemm(dy, w, mt::ops::Transpose::kYes,
                        mt::ops::ExpertRows(t.offsets, t.segments, t.align), dx);
  return dx;
}

// The three products of a recipe: out = x w, dx = dy w^T, dw = x^T dy, each from its operands as
// the recipe quantizes them.
struct Products {
  mt::Tensor out, dx, dw;
};

Products exact_products(const Tapped& t) {
  return {forward(t.x, t.w, t), input_gradient(t.dy, t.w, t), weight_gradient(t.x, t.dy, t)};
}

// x and dy along their last dimension (the forward's and the input gradient's contractions), the
// weight in 128 x 128 tiles, x and dy along the tokens (the weight gradient).
Products fp8_products(const Tapped& t) {
  const auto rule = mt::Fp8ScaleRule::kFp32;
  mt::Tensor x = t.x.clone(), dy = t.dy.clone(), w = t.w.clone();
  mt::ops::fp8_round_trip(t.x, mt::QuantBlock::kRow128, mt::QuantAxis::kDim0, rule, x);
  mt::ops::fp8_round_trip(t.dy, mt::QuantBlock::kRow128, mt::QuantAxis::kDim0, rule, dy);
  mt::ops::fp8_round_trip(t.w, mt::QuantBlock::kTile128, mt::QuantAxis::kDim0, rule, w);
  const mt::ops::ExpertRows rows(t.offsets, t.segments, t.align);
  mt::Tensor xt = t.x.clone(), dyt = t.dy.clone();
  mt::ops::fp8_round_trip_expert_rows(t.x, rows, rule, xt);
  mt::ops::fp8_round_trip_expert_rows(t.dy, rows, rule, dyt);
  return {forward(x, w, t), input_gradient(dy, w, t), weight_gradient(xt, dyt, t)};
}

// As fp8_products in 1 x 32 blocks, x_tokens and dy_tokens given (along_tokens of x and dy); the
// forward and the input gradient read different copies of the weight (along K, along N).
Products mx_products(const Tapped& t, const mt::Tensor& x_tokens, const mt::Tensor& dy_tokens) {
  return {
      forward(mx_along(t.x, mt::QuantAxis::kDim0), mx_along(t.w, mt::QuantAxis::kDim1), t),
      input_gradient(mx_along(t.dy, mt::QuantAxis::kDim0), mx_along(t.w, mt::QuantAxis::kDim0), t),
      weight_gradient(x_tokens, dy_tokens, t)};
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s CONFIG [section.key=value ...]\n", argv[0]);
    return 2;
  }
  const char* dir_env = std::getenv("CHECKPOINT_DIR");
  const std::string dir = dir_env ? dir_env : "/tmp/moetrain-expert-gemm-error";
  std::vector<std::string> sets(argv + 2, argv + argc);
  // hardware.device = "auto" is resolved by the CLI, not the trainer: the GPU when one is seen.
  bool gpu = false;
#if MOETRAIN_HAS_CUDA
  gpu = mt::cuda::device_count() > 0;
#endif
  sets.insert(sets.begin(), std::string("hardware.device=") + (gpu ? "cuda" : "cpu"));
  sets.push_back("model.expert_recipe=bf16");
  sets.push_back("checkpoint.dir=" + dir);
  const mt::Config trained = mt::load_config(argv[1], sets);
  {
    mt::Trainer t(trained);
    mt::RunOptions run;
    run.existing = mt::ExistingCheckpoints::kOverwrite;
    t.run(run);
  }
  // One more step, eager (the tap is host code), from the last checkpoint. (The operands of a
  // step come from the weights before it: the schedule one step longer changes nothing of them.)
  sets.push_back("hardware.cuda_graphs=false");
  sets.push_back("train.steps=" + std::to_string(trained.train.steps + 1));
  const mt::Config tapped_config = mt::load_config(argv[1], sets);
  std::vector<Tapped> tapped;
  mt::moe::set_expert_operands_tap([&](std::string_view product, const mt::Tensor& x,
                                       const mt::Tensor& dy, const mt::Tensor& w,
                                       const mt::ops::ExpertRows& rows) {
    tapped.push_back({std::string(product), host_f64(x), host_f64(dy), host_f64(w),
                      rows.offsets.to(mt::Device::kCPU), rows.segments.to(mt::Device::kCPU),
                      rows.align});
  });
  {
    mt::Trainer t(tapped_config);
    mt::RunOptions run;
    run.resume = dir;
    t.run(run);
  }
  mt::moe::set_expert_operands_tap(nullptr);
  const int64_t layers = trained.model.n_layers;
  for (size_t i = 0; i < tapped.size(); ++i) {
    const Tapped& t = tapped[i];
    const int64_t layer = layers - 1 - static_cast<int64_t>(i / 2);  // backward order
    const bool gate_up = t.product == "gate_up";
    const Products exact = exact_products(t);
    const mt::Tensor x_tokens = along_tokens(t.x, t), dy_tokens = along_tokens(t.dy, t);
    const Products mx = mx_products(t, x_tokens, dy_tokens);
    // The FP8 blocks need K and N multiples of 128 (the tiny preset's 64 are not).
    std::vector<std::pair<const char*, Products>> recipes;
    if (t.x.dim(1) % mt::kFp8Block == 0 && t.dy.dim(1) % mt::kFp8Block == 0)
      recipes.emplace_back("fp8_blockwise", fp8_products(t));
    recipes.emplace_back("mxfp8", mx);
    for (const auto& [recipe, p] : recipes) {
      std::printf(
          "{\"bench\": \"expert_product_error\", \"step\": %lld, \"layer\": %lld, "
          "\"matrix\": \"%s\", \"recipe\": \"%s\", \"rows\": %lld, \"forward\": %.4e, "
          "\"input_gradient\": %.4e, \"weight_gradient\": %.4e}\n",
          static_cast<long long>(trained.train.steps + 1), static_cast<long long>(layer),
          t.product.c_str(), recipe, static_cast<long long>(t.x.dim(0)),
          mt::relative_error(p.out, exact.out), mt::relative_error(p.dx, exact.dx),
          mt::relative_error(p.dw, exact.dw));
    }
    // MXFP8 dispatch: the operand the wire delivers (gate|up: x; down: dy), quantized along dim0
    // and dequantized, then along the tokens as mxfp8 does.
    const mt::Tensor& original = mx.dw;
    const mt::Tensor wired = wire(gate_up ? t.x : t.dy);
    const mt::Tensor requantized = gate_up ? weight_gradient(along_tokens(wired, t), dy_tokens, t)
                                           : weight_gradient(x_tokens, along_tokens(wired, t), t);
    const double e_original = mt::relative_error(original, exact.dw);
    const double e_requantized = mt::relative_error(requantized, exact.dw);
    std::printf(
        "{\"bench\": \"mx_wgrad_error\", \"step\": %lld, \"layer\": %lld, \"product\": \"%s\", "
        "\"requantized_operand\": \"%s\", \"rows\": %lld, \"dim1_of_original\": %.4e, "
        "\"dim1_of_requantized_dim0\": %.4e, \"ratio\": %.6f, \"between_the_two\": %.3e, "
        "\"wire_error_of_operand\": %.3e}\n",
        static_cast<long long>(trained.train.steps + 1), static_cast<long long>(layer),
        t.product.c_str(), gate_up ? "x" : "dy", static_cast<long long>(t.x.dim(0)), e_original,
        e_requantized, e_requantized / e_original, mt::relative_error(requantized, original),
        mt::relative_error(wired, gate_up ? t.x : t.dy));
    std::fflush(stdout);
  }
  return tapped.empty() ? 1 : 0;
}
