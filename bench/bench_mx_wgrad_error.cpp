// The numerics question of MXFP8 dispatch (issue 15, docs/numerics.md): rows that arrive quantized
// along the hidden dimension (dim0) cannot be quantized along the tokens (dim1) as the original
// bf16 would be; requant_dim1 dequantizes them and quantizes again along dim1. How much worse is
// that weight gradient?
//
// Trains CONFIG (bf16 experts) to its last step, then runs one more step eagerly with
// moe::set_weight_gradient_tap capturing each expert weight gradient's operands as the run has
// them, and computes per layer, in fp64 on the host from those operands:
//   exact       dW = x^T dy (each expert's rows)
//   original    x and dy quantized along the tokens (mx_round_trip_expert_rows, as mxfp8 does)
//   requantized the operand MXFP8 dispatch delivers (gate_up: x, the dispatched rows; down: dy,
//               the output gradient the combine's backward sends) first quantized along dim0 and
//               dequantized (the wire), then as `original`
// and prints one JSON line per (layer, product) with each variant's relative error (Frobenius) to
// the exact gradient, the two variants' difference, and the wire's own error on the operand.
// Usage: bench_mx_wgrad_error CONFIG [section.key=value ...]   (CHECKPOINT_DIR: where the run's
// final checkpoint goes, default /tmp/moetrain-mx-wgrad-error)
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/quant.h"
#include "moe/moe_layer.h"
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
  mt::Tensor x, dy;  // f64 on the host
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

mt::Tensor wire(const mt::Tensor& t) {  // quantized along dim0 and dequantized
  mt::Tensor out = t.clone();
  mt::ops::mx_round_trip(t, mt::QuantAxis::kDim0, mt::MxScaleRule::kRceil, out);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s CONFIG [section.key=value ...]\n", argv[0]);
    return 2;
  }
  const char* dir_env = std::getenv("CHECKPOINT_DIR");
  const std::string dir = dir_env ? dir_env : "/tmp/moetrain-mx-wgrad-error";
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
  mt::moe::set_weight_gradient_tap([&](std::string_view product, const mt::Tensor& x,
                                       const mt::Tensor& dy, const mt::ops::ExpertRows& rows) {
    tapped.push_back({std::string(product), host_f64(x), host_f64(dy),
                      rows.offsets.to(mt::Device::kCPU), rows.segments.to(mt::Device::kCPU),
                      rows.align});
  });
  {
    mt::Trainer t(tapped_config);
    mt::RunOptions run;
    run.resume = dir;
    t.run(run);
  }
  mt::moe::set_weight_gradient_tap(nullptr);
  const int64_t layers = trained.model.n_layers;
  for (size_t i = 0; i < tapped.size(); ++i) {
    const Tapped& t = tapped[i];
    const int64_t layer = layers - 1 - static_cast<int64_t>(i / 2);  // backward order
    const bool gate_up = t.product == "gate_up";
    const mt::Tensor exact = weight_gradient(t.x, t.dy, t);
    const mt::Tensor original = weight_gradient(along_tokens(t.x, t), along_tokens(t.dy, t), t);
    const mt::Tensor requantized =
        gate_up ? weight_gradient(along_tokens(wire(t.x), t), along_tokens(t.dy, t), t)
                : weight_gradient(along_tokens(t.x, t), along_tokens(wire(t.dy), t), t);
    const double e_original = mt::relative_error(original, exact);
    const double e_requantized = mt::relative_error(requantized, exact);
    std::printf(
        "{\"bench\": \"mx_wgrad_error\", \"step\": %lld, \"layer\": %lld, \"product\": \"%s\", "
        "\"requantized_operand\": \"%s\", \"rows\": %lld, \"dim1_of_original\": %.4e, "
        "\"dim1_of_requantized_dim0\": %.4e, \"ratio\": %.6f, \"between_the_two\": %.3e, "
        "\"wire_error_of_operand\": %.3e}\n",
        static_cast<long long>(trained.train.steps + 1), static_cast<long long>(layer),
        t.product.c_str(), gate_up ? "x" : "dy", static_cast<long long>(t.x.dim(0)), e_original,
        e_requantized, e_requantized / e_original, mt::relative_error(requantized, original),
        mt::relative_error(gate_up ? wire(t.x) : wire(t.dy), gate_up ? t.x : t.dy));
    std::fflush(stdout);
  }
  return tapped.empty() ? 1 : 0;
}
