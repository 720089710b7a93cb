// The MoE layer forward + backward at the Qwen3-30B-A3B shape (16384 tokens, dim 2048, expert
// dim 768, 128 experts, top-8, bf16), real and forced-balanced routing: JSON lines with the time
// and the ratio to the expert-GEMM floor (6 GEMMs at the dense ceiling measured in the run), for
// padded expert rows (the default) and dense ones, alternated in one process. `ms` is the layer
// as the trainer runs it on one GPU (a replayed CUDA graph); `eager_launch_ms` launches each op
// from the host. Last, the layer under each expert precision recipe (MXFP8: the forward and
// input-gradient products on ops::mx_grouped_gemm, the mxfp8 weight gradient emulated).
// The PyTorch comparator (eager, torch.compile, and torch.compile with CUDA graphs) is
// bench/moe_layer_torch.py.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "core/cuda/check.h"
#include "core/cuda/device.h"
#include "core/cuda/graph.h"
#include "core/log.h"
#include "core/profile.h"
#include "model/config.h"
#include "moe/moe_layer.h"
#include "ops/elementwise.h"
#include "ops/gemm.h"

int main() {
  using mt::Device;
  using mt::DType;
  using mt::Tensor;
  mt::ModelConfig c;
  c.dim = 2048;
  c.moe_dim = 768;
  c.n_experts = 128;
  c.top_k = 8;
  const int64_t n = 16384, d = c.dim, f = c.moe_dim, e = c.n_experts;
  mt::log::set_level(mt::log::Level::kWarn);  // stdout is JSON lines: no capture notices
  mt::moe::MoeWeights w{mt::bench::random_bf16({d, e}, 1, 0.02),
                        mt::bench::random_bf16({e, d, 2 * f}, 2, 0.02),
                        mt::bench::random_bf16({e, f, d}, 3, 0.02)};
  mt::moe::MoeWeights g{Tensor::zeros({d, e}, DType::kF32, Device::kCUDA),
                        Tensor::zeros({e, d, 2 * f}, DType::kF32, Device::kCUDA),
                        Tensor::zeros({e, f, d}, DType::kF32, Device::kCUDA)};
  const Tensor hn = mt::bench::random_bf16({n, d}, 4, 1.0),
               dout = mt::bench::random_bf16({n, d}, 5, 1.0);

  // Ceiling for the floor: cuBLASLt bf16 at 8192^3 in this run.
  const Tensor a = mt::bench::random_bf16({8192, 8192}, 6, 1.0),
               b = mt::bench::random_bf16({8192, 8192}, 7, 1.0);
  Tensor cc = Tensor::empty({8192, 8192}, DType::kBF16, Device::kCUDA);
  const double dense_ms = mt::bench::median_ms([&] {
    mt::ops::gemm(a, mt::ops::Transpose::kNo, b, mt::ops::Transpose::kNo, cc,
                  mt::ops::Accumulate::kNo);
  });
  const double ceiling = 2.0 * 8192 * 8192 * 8192 / (dense_ms * 1e-3);
  // Expert GEMM FLOPs: forward 2 GEMMs (gate|up 2F wide, down), backward 4 (dx and dw of each).
  const double expert_flops = 3.0 * 2.0 * n * c.top_k * (d * 2 * f + f * d);
  const double floor_ms = expert_flops / ceiling * 1e3;

  // Expert weight gradients as the trainer writes them: overwritten by the step's first backward
  // (beta 0, no read of the f32 gradient), see moe_backward.
  const auto first_write = mt::ops::Accumulate::kNo;
  // One layer; given four events, one is recorded before each stage (fill, down projection with
  // the combine, backward) and one after the last.
  const auto marked_layer = [&](cudaEvent_t* marks) {
    const auto mark = [&](int i) {
      if (marks) MT_CUDA_CHECK(cudaEventRecord(marks[i], mt::cuda::stream()));
    };
    mt::moe::MoeActivations act;
    mark(0);
    mt::moe::moe_fill(w, c.moe(), {}, Tensor(), hn, act);
    mark(1);
    Tensor layer_out = Tensor::empty({n, d}, DType::kBF16, Device::kCUDA);
    mt::moe::moe_combine(w, c.moe(), {}, act, layer_out);
    mark(2);
    (void)mt::moe::moe_backward(w, g, c.moe(), {}, hn, act, dout, 0.001, first_write);
    mark(3);
  };
  const auto layer = [&] { marked_layer(nullptr); };
  // Two ways to run it: launched op by op from the host (each run's first small kernels wait for
  // their launches), and as the trainer runs it on one GPU, a CUDA graph replayed with one launch
  // (captured afresh for each routing and row layout, the config being part of what it records).
  const auto layer_ms = [&](bool graphed) {
    // Profiling times ops between device waits, which a capture cannot hold (as in the trainer).
    if (!graphed || mt::profile::enabled()) return mt::bench::median_ms(layer);
    mt::cuda::CapturedWork captured;  // the warm-up runs it eagerly, then captures it
    return mt::bench::median_ms([&] { captured.run(layer, "the MoE layer"); });
  };
  // The fill, the down projection with the combine, and the backward inside whole layers (events
  // between them, no waits; medians of 10 after 3 warm-ups): whether a stage runs slower in the
  // layer than on its own.
  const auto stages_in_layer_ms = [&] {
    cudaEvent_t ev[4];
    for (auto& event : ev) MT_CUDA_CHECK(cudaEventCreate(&event));
    std::vector<double> ms[3];
    for (int rep = 0; rep < 13; ++rep) {
      marked_layer(ev);
      MT_CUDA_CHECK(cudaEventSynchronize(ev[3]));
      for (int i = 0; i < 3 && rep >= 3; ++i) {
        float t = 0;
        MT_CUDA_CHECK(cudaEventElapsedTime(&t, ev[i], ev[i + 1]));
        ms[i].push_back(t);
      }
    }
    for (auto& event : ev) cudaEventDestroy(event);
    return std::array<double, 3>{mt::bench::median(ms[0]), mt::bench::median(ms[1]),
                                 mt::bench::median(ms[2])};
  };
  for (bool balanced : {false, true}) {
    c.routing = balanced ? mt::ops::RoutingMode::kBalanced : mt::ops::RoutingMode::kLearned;
    c.pad_expert_rows = true;
    // Stages, each timed on its own with the earlier stages' outputs ready (where the time goes).
    const double router_ms = mt::bench::median_ms([&] {
      mt::moe::MoeActivations act;
      act.chunks.resize(1);
      mt::moe::MoeChunk& ch = act.chunks[0];
      ch.xe = ch.row_weight = ch.gate_up = ch.act = hn;  // present: moe_fill stops after routing
      mt::moe::moe_fill(w, c.moe(), {}, Tensor(), hn,
                        act);  // router GEMM, top-k, stats, permutation
    });
    mt::moe::MoeActivations full;
    const double fill_ms = mt::bench::median_ms([&] {
      full = mt::moe::MoeActivations();
      mt::moe::moe_fill(w, c.moe(), {}, Tensor(), hn, full);
    });
    Tensor out = Tensor::empty({n, d}, DType::kBF16, Device::kCUDA);
    const double combine_ms =
        mt::bench::median_ms([&] { mt::moe::moe_combine(w, c.moe(), {}, full, out); });
    const double backward_ms = mt::bench::median_ms([&] {
      (void)mt::moe::moe_backward(w, g, c.moe(), {}, hn, full, dout, 0.001, first_write);
    });
    const std::array<double, 3> in_layer = stages_in_layer_ms();
    std::printf(
        "{\"bench\": \"moe_layer_stages\", \"routing\": \"%s\", \"router_topk_permutation_ms\": "
        "%.3f, \"forward_fill_ms\": %.3f, \"down_and_combine_ms\": %.3f, \"backward_ms\": %.3f, "
        "\"in_layer_ms\": \"%.3f, %.3f, %.3f\"}\n",
        balanced ? "balanced" : "real", router_ms, fill_ms, combine_ms, backward_ms, in_layer[0],
        in_layer[1], in_layer[2]);
    // The whole layer, with padded expert rows (the default) and dense ones alternating four
    // times: a power-capped GPU's clock drifts by more than the difference between the two.
    std::vector<double> padded_ms, dense_ms, eager_ms;
    for (int round = 0; round < 4; ++round)
      for (bool padded : {true, false}) {
        c.pad_expert_rows = padded;
        (padded ? padded_ms : dense_ms).push_back(layer_ms(true));
        if (padded) eager_ms.push_back(layer_ms(false));
      }
    c.pad_expert_rows = true;
    const double ms = mt::bench::median(padded_ms), dense = mt::bench::median(dense_ms);
    std::printf(
        "{\"bench\": \"moe_layer_fwd_bwd\", \"shape\": \"16384 tok, dim 2048, F 768, 128 "
        "experts, top-8, bf16\", \"routing\": \"%s\", \"ms\": %.3f, \"expert_gemm_floor_ms\": "
        "%.3f, \"ratio_to_floor\": %.2f, \"dense_expert_rows_ms\": %.3f, \"eager_launch_ms\": "
        "%.3f, \"rounds_ms\": \"%s / %s / %s\"}\n",
        balanced ? "balanced" : "real", ms, floor_ms, ms / floor_ms, dense,
        mt::bench::median(eager_ms), mt::bench::join(padded_ms).c_str(),
        mt::bench::join(dense_ms).c_str(), mt::bench::join(eager_ms).c_str());
    std::fflush(stdout);
  }
  // The experts' precision recipes (ops/expert_gemm.h), balanced routing, alternating over
  // kRounds rounds: ms is each recipe's median, paired_ratio the median over the rounds of its
  // time over bf16's in the same round (the GPU's clock drifts between rounds by more than the
  // recipes differ); peak: the layer's device memory high-water mark, one eager run.
  {
    c.routing = mt::ops::RoutingMode::kBalanced;
    c.pad_expert_rows = true;
    struct Recipe {
      mt::ops::ExpertRecipe recipe;
      mt::RowWire dispatch;
    };
    using mt::RowWire, mt::ops::ExpertRecipe;
    const Recipe recipes[] = {{ExpertRecipe::kBf16, RowWire::kAsIs},
                              {ExpertRecipe::kMxfp8WgradWithHp, RowWire::kAsIs},
                              {ExpertRecipe::kMxfp8WgradWithHp, RowWire::kMxfp8},
                              {ExpertRecipe::kMxfp8, RowWire::kAsIs},
                              {ExpertRecipe::kFp8WgradWithHp, RowWire::kAsIs},
                              {ExpertRecipe::kFp8Blockwise, RowWire::kAsIs}};
    constexpr int kRecipes = 6;
    // The weights' quantized copies (MX values, FP8 tiles), made in training by each gather for
    // its pass (fsdp::gather: the forward's and the input gradient's once per step each): made
    // here once per family, outside the layer, and timed on their own. As a gather makes them: MX
    // values from the fp32 masters (each value rounded to bf16 first), FP8 tiles from the bf16
    // compute copy.
    struct Copies {
      mt::ops::WeightCopies gate_up, down;
      double ms = 0, held_ms = 0;  // per step: at each pass's gather / both at the forward's
    };
    Copies mx_copies, fp8_copies;
    Tensor gate_up32 = Tensor::empty(w.w_gate_up.shape(), DType::kF32, Device::kCUDA);
    Tensor down32 = Tensor::empty(w.w_down.shape(), DType::kF32, Device::kCUDA);
    mt::ops::convert(w.w_gate_up, gate_up32);
    mt::ops::convert(w.w_down, down32);
    // Per step, the default makes each pass's copies at its gather (two reads of the masters);
    // parallel.reshard_after_forward = false makes both at the forward's (one read).
    for (const ExpertRecipe family :
         {ExpertRecipe::kMxfp8WgradWithHp, ExpertRecipe::kFp8WgradWithHp}) {
      mt::ops::ExpertPrecision p = c.expert_precision;
      p.recipe = family;
      Copies& made = family == ExpertRecipe::kMxfp8WgradWithHp ? mx_copies : fp8_copies;
      const auto make_copies = [&](std::initializer_list<mt::ops::CopyUse> uses) {
        for (const mt::ops::CopyUse use : uses) {
          const bool fp8 = p.fp8_forward_and_input();
          mt::ops::make_weight_copies(fp8 ? w.w_gate_up : gate_up32, p, DType::kBF16, use,
                                      made.gate_up);
          mt::ops::make_weight_copies(fp8 ? w.w_down : down32, p, DType::kBF16, use, made.down);
        }
      };
      made.ms = mt::bench::median_ms([&] {
        make_copies({mt::ops::CopyUse::kForward, mt::ops::CopyUse::kBackward});
      });
      made.held_ms = mt::bench::median_ms([&] { make_copies({mt::ops::CopyUse::kBoth}); });
    }
    const auto copies_of = [&](const Recipe& r) -> const Copies* {
      mt::ops::ExpertPrecision p = c.expert_precision;
      p.recipe = r.recipe;
      return p.mx_forward_and_input()    ? &mx_copies
             : p.fp8_forward_and_input() ? &fp8_copies
                                         : nullptr;
    };
    const auto use_recipe = [&](const Recipe& r) {
      c.expert_precision.recipe = r.recipe;
      c.expert_precision.dispatch = r.dispatch;
      const Copies* made = copies_of(r);
      w.gate_up_copies = made ? &made->gate_up : nullptr;
      w.down_copies = made ? &made->down : nullptr;
    };
    constexpr int kRounds = 7;
    std::vector<double> recipe_ms[kRecipes];
    for (int round = 0; round < kRounds; ++round)
      for (int r = 0; r < kRecipes; ++r) {
        use_recipe(recipes[r]);
        recipe_ms[r].push_back(layer_ms(true));
      }
    for (int r = 0; r < kRecipes; ++r) {
      use_recipe(recipes[r]);
      mt::cuda::synchronize();
      const int64_t before = mt::memory_stats(Device::kCUDA).current_bytes;
      mt::reset_peak_memory(Device::kCUDA);
      layer();
      mt::cuda::synchronize();
      const double peak_gib =
          static_cast<double>(mt::memory_stats(Device::kCUDA).peak_bytes - before) / (1 << 30);
      std::vector<double> paired(kRounds);
      for (int round = 0; round < kRounds; ++round)
        paired[round] = recipe_ms[r][round] / recipe_ms[0][round];
      std::printf(
          "{\"bench\": \"moe_layer_recipe\", \"recipe\": \"%s\", \"dispatch\": \"%s\", "
          "\"routing\": \"balanced\", \"ms\": %.3f, \"ratio_to_bf16\": %.2f, "
          "\"paired_ratio\": %.3f, \"paired_ratios\": \"%s\", "
          "\"layer_peak_gib\": %.2f, \"rounds_ms\": \"%s\", "
          "\"weight_copies_ms_per_step\": %.3f, \"held_copies_ms_per_step\": %.3f}\n",
          std::string(mt::ops::expert_recipe_name(recipes[r].recipe)).c_str(),
          std::string(mt::ops::dispatch_dtype_name(recipes[r].dispatch)).c_str(),
          mt::bench::median(recipe_ms[r]),
          mt::bench::median(recipe_ms[r]) / mt::bench::median(recipe_ms[0]),
          mt::bench::median(paired), mt::bench::join(paired).c_str(), peak_gib,
          mt::bench::join(recipe_ms[r]).c_str(),
          copies_of(recipes[r]) ? copies_of(recipes[r])->ms : 0.0,
          copies_of(recipes[r]) ? copies_of(recipes[r])->held_ms : 0.0);
    }
    // MOETRAIN_PROFILE=1: one more real-routing layer under bf16 and each FP8 recipe, every op
    // timed on its own (device waits at both ends of each), as one JSON line of milliseconds per
    // op and recipe.
    if (mt::profile::enabled()) {
      mt::profile::set_device_sync(&mt::cuda::synchronize);
      c.routing = mt::ops::RoutingMode::kLearned;
      for (const int r : {0, 4, 5}) {
        use_recipe(recipes[r]);
        for (int pass = 0; pass < 2; ++pass) {  // the first pass warms the caches
          (void)mt::profile::take();
          layer();
        }
        std::printf("{\"bench\": \"moe_layer_ops\", \"routing\": \"real\", \"recipe\": \"%s\"",
                    std::string(mt::ops::expert_recipe_name(recipes[r].recipe)).c_str());
        for (const auto& [name, op_ms] : mt::profile::take())
          std::printf(", \"%s\": %.3f", name.c_str(), op_ms);
        std::printf("}\n");
      }
    }
    use_recipe(recipes[0]);
    std::fflush(stdout);
  }
  return 0;
}
