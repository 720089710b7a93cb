// The model and trainer on the GPU (ctest label `gpu`): one mixed-precision step against the
// CPU engine in f32 (bf16, the MX and FP8 recipes, FP8 dense layers), the tiny preset reaching its
// entropy floor, bit-identical resume, and CUDA graph replay bit-identical to eager passes.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "core/cuda/device.h"
#include "hf_fixture.h"
#include "mx_cases.h"
#include "ops/fp8.h"
#include "processes.h"
#include "train/hf_import.h"
#include "train/safetensors.h"
#include "train/trainer.h"
#include "training.h"

namespace mt {
namespace {

const std::string kTiny = testing::source_dir() + "/configs/tiny.toml";

void require_gpu() {
  if (cuda::device_count() == 0) GTEST_FAIL() << "no GPU: run this test on the GPU machine";
}

// One step of the tiny preset with `sets` on the CPU (f32) or the GPU (bf16 compute): its
// metrics and every parameter group's gradient, on the host.
struct OneStep {
  StepMetrics metrics;
  std::vector<Tensor> grads;
  std::vector<ParamKind> kinds;
  std::vector<bool> attention;  // the group holds a block's attention projections
};
OneStep one_step(std::vector<std::string> sets, Device device) {
  // Forced-balanced routing: bf16 and f32 logits must not pick different experts.
  sets.insert(sets.end(), {"model.routing=balanced", "train.steps=4"});
  if (device == Device::kCUDA) sets.push_back("hardware.device=cuda");
  Trainer t(load_config(kTiny, sets));
  RunOptions one;
  one.steps = 1;
  OneStep out{t.run(one).front(), {}, {}, {}};
  for (auto& u : t.model().units())
    for (auto& g : u.groups) {
      out.grads.push_back(g.grad_shard.to(Device::kCPU));
      out.kinds.push_back(g.kind);
      out.attention.push_back(std::any_of(g.specs.begin(), g.specs.end(), [](const ParamSpec& s) {
        return s.name.ends_with(".attn.wq");
      }));
    }
  return out;
}

// One step on the GPU (bf16 compute) against the CPU engine (f32) with the same overrides: loss,
// aux loss and grad norm, and every parameter group's gradient, within bf16 accuracy.
TEST(GpuTrain, OneStepMatchesTheCpuEngine) {
  require_gpu();
  const OneStep c = one_step({}, Device::kCPU), g = one_step({}, Device::kCUDA);
  EXPECT_NEAR(g.metrics.loss, c.metrics.loss, 1e-2 * c.metrics.loss);
  EXPECT_NEAR(g.metrics.aux_loss, c.metrics.aux_loss, 1e-2 * c.metrics.aux_loss);
  EXPECT_NEAR(g.metrics.grad_norm, c.metrics.grad_norm, 3e-2 * c.metrics.grad_norm);
  ASSERT_EQ(c.grads.size(), g.grads.size());
  for (size_t i = 0; i < c.grads.size(); ++i)
    EXPECT_LT(relative_error(g.grads[i], c.grads[i]), 3e-2) << "gradient group " << i;
}

// One GPU step of a quantized expert recipe (`sets`) against the CPU engine's step of the same
// recipe: loss, aux loss and gradient norm, the dense gradient groups within bf16's 3e-2, the
// expert groups within 6e-2 and nearer the recipe's CPU gradients than the CPU's bf16 ones (what
// proves the GPU ran the recipe).
// Which groups' products a recipe quantizes: the experts', or the attention projections' too
// (model.dense_recipe; those groups are then held to the experts' bounds).
enum class Quantized { kExperts, kExpertsAndAttention };
void expect_recipe_step_matches_cpu(const std::vector<std::string>& sets, const OneStep& cpu_bf16,
                                    Quantized quantized = Quantized::kExperts) {
  const std::string label = sets.back();
  SCOPED_TRACE(label);
  const OneStep c = one_step(sets, Device::kCPU), g = one_step(sets, Device::kCUDA);
  EXPECT_NEAR(g.metrics.loss, c.metrics.loss, 1e-2 * c.metrics.loss);
  EXPECT_NEAR(g.metrics.aux_loss, c.metrics.aux_loss, 1e-2 * c.metrics.aux_loss);
  EXPECT_NEAR(g.metrics.grad_norm, c.metrics.grad_norm, 3e-2 * c.metrics.grad_norm);
  ASSERT_EQ(c.grads.size(), g.grads.size());
  int experts = 0;
  for (size_t i = 0; i < c.grads.size(); ++i) {
    const double err = relative_error(g.grads[i], c.grads[i]);
    const double to_bf16 = relative_error(g.grads[i], cpu_bf16.grads[i]);
    const double recipe = relative_error(c.grads[i], cpu_bf16.grads[i]);
    std::printf("%s group %zu (%s): GPU to CPU %.2e, GPU to CPU bf16 %.2e, CPU to CPU bf16 %.2e\n",
                label.c_str(), i, g.kinds[i] == ParamKind::kExpert ? "experts" : "dense", err,
                to_bf16, recipe);
    const bool attention = quantized == Quantized::kExpertsAndAttention && g.attention[i];
    // With the dense layers in FP8 every gradient passes through the head's and the attention's
    // quantized products too, each adding the bf16-versus-f32 flips of E4M3 steps: 1e-1.
    const double bound = quantized == Quantized::kExperts ? 6e-2 : 1e-1;
    if (g.kinds[i] != ParamKind::kExpert && !attention) {
      EXPECT_LT(err, quantized == Quantized::kExperts ? 3e-2 : bound) << "gradient group " << i;
      continue;
    }
    experts += g.kinds[i] == ParamKind::kExpert;
    EXPECT_LT(err, bound) << "gradient group " << i;
    EXPECT_LT(err, to_bf16) << "gradient group " << i << " is nearer bf16's than its recipe's";
  }
  EXPECT_GT(experts, 0);
}

// The MX recipes through the whole model: the GPU's fused MX values (the permutation, SwiGLU),
// the copies made at each gather from the fp32 masters, against the CPU's f32 reference of the
// same recipe. The GPU quantizes bf16-rounded operands and the CPU f32 ones: where the two
// straddle an E4M3 rounding midpoint (about 2^-9 / 2^-3, 1.6% of the elements) the quantized
// values differ by a whole E4M3 step (6-12%), and each of the recipe's up to six quantized
// operands adds that to bf16's own error, so the expert groups are held to 6e-2 (the dense ones
// to bf16's 3e-2). What proves the GPU runs the recipe rather than bf16: its expert gradients
// are nearer the CPU's of the same recipe than the CPU's bf16 ones.
TEST(GpuTrain, MxRecipesOneStepMatchTheCpuEngine) {
  require_gpu();
  const OneStep cpu_bf16 = one_step({}, Device::kCPU);
  for (const std::vector<std::string>& sets : std::vector<std::vector<std::string>>{
           {"model.expert_recipe=mxfp8_wgrad_with_hp"},
           {"model.expert_recipe=mxfp8_wgrad_with_hp", "parallel.ep_dispatch_dtype=mxfp8"},
           {"model.expert_recipe=mxfp8"}})
    expect_recipe_step_matches_cpu(sets, cpu_bf16);
}

// The FP8 blockwise recipes through the whole model (dims of 128: the blocks' size), on the FP8
// tensor cores, under the MX recipes' bounds and for the same reason: the GPU quantizes
// bf16-rounded operands, and a bf16 rounding that moves a block's amax moves its scale, so a few
// percent of its elements land one E4M3 step away.
TEST(GpuTrain, Fp8RecipesOneStepMatchTheCpuEngine) {
  require_gpu();
  const std::vector<std::string> dims = {"model.dim=128", "model.moe_dim=128"};
  const OneStep cpu_bf16 = one_step(dims, Device::kCPU);
  for (const char* recipe : {"fp8_blockwise", "fp8_wgrad_with_hp"}) {
    std::vector<std::string> sets = dims;
    sets.push_back(std::string("model.expert_recipe=") + recipe);
    expect_recipe_step_matches_cpu(sets, cpu_bf16);
  }
  // The FP8 wire (with ep 1 the tokens quantized as a sender would, the products taking those
  // rows as they are, the weight gradient their values).
  std::vector<std::string> wire = dims;
  wire.push_back("model.expert_recipe=fp8_wgrad_with_hp");
  wire.push_back("parallel.ep_dispatch_dtype=fp8_blockwise");
  expect_recipe_step_matches_cpu(wire, cpu_bf16);
}

// model.dense_recipe in FP8 (the attention projections' forward and input-gradient products and
// the LM head's forward, dims of 128) beside the experts' FP8 recipe: every group within the
// recipes' 6e-2, the blocks' attention groups and the experts' nearer the recipe's CPU gradients
// than the CPU's bf16 ones.
TEST(GpuTrain, DenseFp8RecipeOneStepMatchesTheCpuEngine) {
  require_gpu();
  const std::vector<std::string> dims = {"model.dim=128", "model.moe_dim=128",
                                         "model.head_dim=128"};
  const OneStep cpu_bf16 = one_step(dims, Device::kCPU);
  std::vector<std::string> sets = dims;
  sets.insert(sets.end(),
              {"model.expert_recipe=fp8_wgrad_with_hp", "model.dense_recipe=fp8_wgrad_with_hp"});
  expect_recipe_step_matches_cpu(sets, cpu_bf16, Quantized::kExpertsAndAttention);
}

// transformers' tiny Qwen3-MoE (tests/fixtures/hf_qwen3moe/base) imported onto the GPU: the
// mixed-precision engine (bf16 weights and activations, f32 statistics and gradients) gives
// transformers' fp32 loss and every parameter's gradient within bf16 accuracy.
TEST(GpuHf, TinyFixtureInBf16MatchesTransformersFp32) {
  require_gpu();
  const std::string dir = testing::hf_fixture("base");
  Config cfg = load_config(kTiny, {"hardware.device=cuda", "hardware.cuda_graphs=false"});
  cfg.model = model_config_from_hf_json(dir + "/config.json", cfg.model);
  cfg.model.aux_loss_coef = 0;
  Trainer t(cfg);
  load_hf_weights(dir, t.model());
  const SafetensorsFile ref = read_safetensors(dir + "/reference.safetensors");
  const Tensor& tokens = ref.tensors.at("tokens");
  const int64_t n = tokens.numel() - 1;
  const Batch b = testing::reference_batch(tokens);
  Qwen3Moe& model = t.model();
  model.zero_grad();
  const MicroBatchLosses l =
      model.forward_backward(b.to(Device::kCUDA), {1.0 / static_cast<double>(n), 0.0});
  const double loss = l.ce_sum / static_cast<double>(n), want = ref.tensors.at("loss").item(0);
  EXPECT_NEAR(loss, want, 1e-2 * want);
  std::map<std::string, Tensor> grads;
  for (const auto& [name, g] : ref.tensors)
    if (name.rfind("grad.", 0) == 0) grads.emplace(name.substr(5), g);
  const std::map<std::string, Tensor> want_grads = hf_to_moetrain(grads, model, "reference");
  double worst = 0, num = 0, den = 0;
  int compared = 0;
  for (const ParamUnit& u : model.units())
    for (const ParamGroup& g : u.groups)
      for (size_t i = 0; i < g.specs.size(); ++i) {
        const Tensor got = g.grad(i).to(Device::kCPU).to(DType::kF64);
        const Tensor w = want_grads.at(g.specs[i].name).reshape(got.shape());
        ASSERT_TRUE(all_finite(got)) << g.specs[i].name;
        const double err = relative_error(got, w);
        EXPECT_LT(err, 5e-2) << g.specs[i].name;
        worst = std::max(worst, err);
        for (int64_t k = 0; k < got.numel(); ++k) {
          num += std::pow(got.data<double>()[k] - w.data<double>()[k], 2);
          den += std::pow(w.data<double>()[k], 2);
        }
        ++compared;
      }
  const double overall = std::sqrt(num / den);
  std::printf(
      "bf16 on the GPU: loss %.6f (transformers fp32 %.6f), gradients: overall relative "
      "error %.2e, worst tensor %.2e over %d tensors\n",
      loss, want, overall, worst, compared);
  EXPECT_LT(overall, 3e-2);  // the bf16 step's bound against the f32 engine (GpuTrain above)
  EXPECT_GT(overall, 0.0) << "bf16 cannot be exact";
  EXPECT_EQ(compared, static_cast<int>(want_grads.size()));
}

// A host sync inside a captured pass is an error naming the copy and the phase (exit 1), never a
// silent eager fallback; the same run eagerly is fine.
TEST(GpuTrain, AHostSyncInACapturedPassIsANamedError) {
  require_gpu();
  const std::string run = testing::moetrain_binary() + " train --config " + kTiny +
                          " --set hardware.device=cuda --steps 3";
  const testing::Proc graphed =
      testing::run_cmd("MOETRAIN_FAULT_HOST_WAIT=1 " + run + " --set hardware.cuda_graphs=true");
  EXPECT_EQ(graphed.code, 1) << graphed.output;
  for (const char* words : {"capturing the training pass", "host sync inside a CUDA graph capture",
                            "from the GPU to the host", "in phase 'test.injected_host_wait'"})
    EXPECT_NE(graphed.output.find(words), std::string::npos) << words << "\n" << graphed.output;
  const testing::Proc eager =
      testing::run_cmd("MOETRAIN_FAULT_HOST_WAIT=1 " + run + " --set hardware.cuda_graphs=false");
  EXPECT_EQ(eager.code, 0) << eager.output;
}

TEST(GpuTrain, TinyPresetReachesTheEntropyFloor) {
  require_gpu();
  Trainer t(load_config(kTiny, {"hardware.device=cuda"}));
  const auto m = t.run({});
  const double floor = t.data_stats().loss_floor, unigram = t.data_stats().unigram_entropy;
  EXPECT_LE(m.back().loss - floor, 0.2 * (unigram - floor))
      << "final " << m.back().loss << " floor " << floor << " unigram " << unigram;
}

TEST(GpuTrain, ResumeIsBitIdentical) {
  require_gpu();
  const std::string dir = (std::filesystem::temp_directory_path() / "mt_gpu_resume").string();
  std::filesystem::remove_all(dir);
  const Config c = load_config(kTiny, {"hardware.device=cuda", "train.steps=8",
                                       "checkpoint.every=4", "checkpoint.dir=\"" + dir + "\""});
  const testing::ResumeRuns runs = testing::straight_and_resumed(c, dir, 4);
  const auto &a = runs.straight_steps, &b = runs.resumed_steps;
  ASSERT_EQ(b.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(b[i].loss, a[4 + i].loss) << "step " << b[i].step;
  auto& ua = runs.straight->model().units();
  auto& ub = runs.resumed->model().units();
  for (size_t u = 0; u < ua.size(); ++u)
    for (size_t g = 0; g < ua[u].groups.size(); ++g) {
      const Tensor x = ua[u].groups[g].params.to(Device::kCPU);
      const Tensor y = ub[u].groups[g].params.to(Device::kCPU);
      EXPECT_EQ(std::memcmp(x.raw(), y.raw(), x.nbytes()), 0) << ua[u].name << " group " << g;
    }
}

// Trains the tiny preset with `sets` twice, with CUDA graphs and without, and expects the same
// losses, aux losses, gradient norms and parameters to the bit (every kernel of the step is
// deterministic), and that passes were replayed. With recast, the weights' compute copies are
// dropped halfway (what a checkpoint load does: the next pass casts them again at new
// addresses, so the captured graphs must be captured again).
void expect_graphs_match_eager(std::vector<std::string> sets, int64_t steps, bool recast) {
  sets.push_back("hardware.device=cuda");
  sets.push_back(fmt::format("train.steps={}", steps));
  std::vector<std::string> eager_sets = sets;
  eager_sets.push_back("hardware.cuda_graphs=false");
  Trainer graphed(load_config(kTiny, sets)), eager(load_config(kTiny, eager_sets));
  RunOptions half;
  half.steps = steps / 2;
  auto a = graphed.run(half), b = eager.run(half);
  const int64_t replays_before = graphed.model().graph_replays();
  if (recast)
    for (Trainer* t : {&graphed, &eager})
      for (auto& u : t->model().units())
        for (auto& g : u.groups) g.compute = Tensor();
  for (const auto& m : graphed.run({})) a.push_back(m);
  for (const auto& m : eager.run({})) b.push_back(m);
  ASSERT_EQ(a.size(), static_cast<size_t>(steps));
  ASSERT_EQ(a.size(), b.size());
  EXPECT_GT(replays_before, 0) << "no pass was replayed from a graph";
  EXPECT_GT(graphed.model().graph_replays(), replays_before) << "no replay in the second half";
  EXPECT_EQ(eager.model().graph_replays(), 0);
  std::printf("graph replays: %lld\n", static_cast<long long>(graphed.model().graph_replays()));
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].loss, b[i].loss) << "step " << a[i].step;
    EXPECT_EQ(a[i].aux_loss, b[i].aux_loss) << "step " << a[i].step;
    EXPECT_EQ(a[i].grad_norm, b[i].grad_norm) << "step " << a[i].step;
    // A replay allocates nothing, yet its memory counts: each step reports the eager run's high-
    // water mark within a few percent (the passes of the two modes allocate in another order;
    // a replay that counted nothing would report a quarter of it).
    const auto peak = [](const StepMetrics& m) { return static_cast<double>(m.peak_bytes); };
    EXPECT_NEAR(peak(a[i]), peak(b[i]), 0.05 * peak(b[i])) << "step " << a[i].step;
  }
  auto& ua = graphed.model().units();
  auto& ub = eager.model().units();
  for (size_t u = 0; u < ua.size(); ++u)
    for (size_t g = 0; g < ua[u].groups.size(); ++g) {
      const Tensor x = ua[u].groups[g].params.to(Device::kCPU);
      const Tensor y = ub[u].groups[g].params.to(Device::kCPU);
      EXPECT_EQ(std::memcmp(x.raw(), y.raw(), x.nbytes()), 0) << ua[u].name << " group " << g;
    }
}

TEST(GpuTrain, CudaGraphReplayIsBitIdentical) {
  require_gpu();
  expect_graphs_match_eager({}, 12, /*recast=*/true);
}

// Two micro-batches per step (the first overwrites the expert gradients, the second adds: two
// graphs), selective recompute inside the captured pass, and aux-loss-free balancing (router
// biases rewritten between steps in place).
// MX recipes: the weights' copies and the operands' MX values are made inside the captured pass
// (graph memory, none left after it); with a full recompute the backward's gather makes the
// forward's copies too.
TEST(GpuTrain, CudaGraphReplayIsBitIdenticalWithMxRecipes) {
  require_gpu();
  expect_graphs_match_eager({"model.expert_recipe=mxfp8_wgrad_with_hp"}, 8, /*recast=*/false);
  expect_graphs_match_eager({"model.expert_recipe=mxfp8", "model.checkpoint=\"full\""}, 8,
                            /*recast=*/false);
}

// FP8 recipes: the operands' FP8 copies are made inside the captured pass too.
TEST(GpuTrain, CudaGraphReplayIsBitIdenticalWithFp8Recipes) {
  require_gpu();
  expect_graphs_match_eager(
      {"model.dim=128", "model.moe_dim=128", "model.expert_recipe=fp8_blockwise"}, 8,
      /*recast=*/false);
  expect_graphs_match_eager(
      {"model.dim=128", "model.moe_dim=128", "model.expert_recipe=fp8_wgrad_with_hp",
       "model.fp8_scale=pow2", "model.checkpoint=\"full\""},
      8, /*recast=*/false);
  expect_graphs_match_eager(
      {"model.dim=128", "model.moe_dim=128", "model.expert_recipe=fp8_blockwise",
       "model.requant_dim1=true", "parallel.ep_dispatch_dtype=fp8_blockwise"},
      8, /*recast=*/false);
  expect_graphs_match_eager(
      {"model.dim=128", "model.moe_dim=128", "model.head_dim=128",
       "model.expert_recipe=fp8_wgrad_with_hp", "model.dense_recipe=fp8_wgrad_with_hp"},
      8, /*recast=*/false);
}

// On one GPU the expert weights' input-gradient FP8 tiles are written by AdamW in its pass
// (ParamGroup::holds_fp8_tiles): after captured steps they are, byte for byte, the tiles the
// quantization kernel makes from the updated masters rounded to bf16, and the CPU's quantization
// of them; their transpose (what a forward's gather makes) is the forward's; none outlives its
// pass.
TEST(GpuTrain, HeldFp8TilesAreTheUpdatedWeights) {
  require_gpu();
  for (const char* rule : {"fp32", "pow2"}) {
    SCOPED_TRACE(rule);
    Trainer t(load_config(
        kTiny, {"model.dim=128", "model.moe_dim=128", "model.expert_recipe=fp8_wgrad_with_hp",
                fmt::format("model.fp8_scale={}", rule), "train.steps=3", "hardware.device=cuda"}));
    ASSERT_EQ(t.run({}).size(), 3u);
    cuda::synchronize();
    int held = 0;
    for (auto& u : t.model().units())
      for (auto& g : u.groups)
        for (size_t i = 0; g.holds_fp8_tiles() && i < g.specs.size(); ++i) {
          if (!g.specs[i].quant_copies) continue;
          ++held;
          EXPECT_FALSE(g.compute.defined()) << g.specs[i].name << ": a compute copy beside them";
          EXPECT_FALSE(g.copies[i].fp8_forward.defined()) << g.specs[i].name;
          ops::WeightCopies gpu, cpu;
          ops::make_weight_copies(g.param(i), g.precision, g.compute_dtype, ops::CopyUse::kBoth,
                                  gpu);
          ops::make_weight_copies(g.param(i).to(Device::kCPU), g.precision, g.compute_dtype,
                                  ops::CopyUse::kBoth, cpu);
          const QuantTensor& held_q = g.copies[i].fp8_input;
          QuantTensor forward = QuantTensor::poisoned(held_q.shape(), QuantBlock::kTile128,
                                                      QuantAxis::kDim1, Device::kCUDA);
          ops::fp8_transpose_tiles(held_q, forward);
          for (const QuantTensor* want : {&gpu.fp8_forward, &cpu.fp8_forward})
            EXPECT_TRUE(testing::same_quant(forward, *want)) << g.specs[i].name << " forward";
          for (const QuantTensor* want : {&gpu.fp8_input, &cpu.fp8_input})
            EXPECT_TRUE(testing::same_quant(held_q, *want)) << g.specs[i].name << " held";
        }
    EXPECT_EQ(held, 2 * 2);  // the tiny preset's two layers, gate|up and down each
  }
}

TEST(GpuTrain, CudaGraphReplayWithAccumulationRecomputeAndBiases) {
  require_gpu();
  expect_graphs_match_eager(
      {"train.grad_accum=2", "model.checkpoint=\"selective\"", "model.bias_update_rate=0.001"}, 12,
      /*recast=*/false);
}

// Trains with the optimizer step beside the next passes (hardware.overlap_optimizer, a side
// stream) and in line, and expects every step's losses and gradient norm and the final
// parameters and moments to the bit: the same kernels read the same values, only their streams
// differ, so a pass that read a unit's weights (or wrote its gradients) before its update ended
// would show. "wide" makes the update long enough to overlap the forward (64 experts of 256,
// dim 512, 50k vocabulary: each layer's update several times a small layer's forward).
void expect_overlap_matches_in_line(std::vector<std::string> sets, int64_t steps) {
  sets.push_back("hardware.device=cuda");
  sets.push_back(fmt::format("train.steps={}", steps));
  std::vector<std::string> in_line = sets;
  in_line.push_back("hardware.overlap_optimizer=false");
  sets.push_back("hardware.overlap_optimizer=true");
  Trainer beside(load_config(kTiny, sets)), line(load_config(kTiny, in_line));
  const auto a = beside.run({}), b = line.run({});
  ASSERT_EQ(a.size(), static_cast<size_t>(steps));
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].loss, b[i].loss) << "step " << a[i].step;
    EXPECT_EQ(a[i].aux_loss, b[i].aux_loss) << "step " << a[i].step;
    EXPECT_EQ(a[i].grad_norm, b[i].grad_norm) << "step " << a[i].step;
  }
  EXPECT_NE(a.front().loss, a.back().loss) << "the run did not train";
  auto& ua = beside.model().units();
  auto& ub = line.model().units();
  for (size_t u = 0; u < ua.size(); ++u)
    for (size_t g = 0; g < ua[u].groups.size(); ++g) {
      for (const auto& [x_dev, y_dev] :
           {std::pair{&ua[u].groups[g].shard, &ub[u].groups[g].shard},
            std::pair{&ua[u].groups[g].grad_shard, &ub[u].groups[g].grad_shard}}) {
        const Tensor x = x_dev->to(Device::kCPU), y = y_dev->to(Device::kCPU);
        EXPECT_EQ(std::memcmp(x.raw(), y.raw(), x.nbytes()), 0) << ua[u].name << " group " << g;
      }
    }
  const auto& sa = beside.optimizer().state();
  const auto& sb = line.optimizer().state();
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t i = 0; i < sa.size(); ++i) {
    const Tensor x = sa[i].to(Device::kCPU), y = sb[i].to(Device::kCPU);
    EXPECT_EQ(std::memcmp(x.raw(), y.raw(), x.nbytes()), 0) << "moment " << i;
  }
}

const std::vector<std::string> kWide = {
    "model.dim=512", "model.n_heads=8",   "model.head_dim=64",     "model.n_experts=64",
    "model.top_k=4", "model.moe_dim=256", "model.vocab_size=50000"};

TEST(GpuTrain, OptimizerBesideThePassesIsBitIdenticalToInLine) {
  require_gpu();
  expect_overlap_matches_in_line({}, 6);
  expect_overlap_matches_in_line(kWide, 6);
  // Eager passes; two micro-batches (the gradients zeroed by the first pass of a step only) and
  // a recompute policy, graphed; an MX recipe (copies made at each gather, after the update);
  // an FP8 recipe (the input gradient's tiles written by the update beside the passes, the
  // forward's transposed from them at each gather, which must wait for it).
  std::vector<std::string> eager = kWide;
  eager.push_back("hardware.cuda_graphs=false");
  expect_overlap_matches_in_line(eager, 4);
  std::vector<std::string> accum = kWide;
  accum.insert(accum.end(), {"train.grad_accum=2", "model.checkpoint=\"selective\""});
  expect_overlap_matches_in_line(accum, 4);
  std::vector<std::string> mx = kWide;
  mx.push_back("model.expert_recipe=mxfp8_wgrad_with_hp");
  expect_overlap_matches_in_line(mx, 4);
  std::vector<std::string> fp8 = kWide;
  fp8.insert(fp8.end(), {"model.expert_recipe=fp8_wgrad_with_hp", "model.checkpoint=\"full\""});
  expect_overlap_matches_in_line(fp8, 4);
}

}  // namespace
}  // namespace mt
