// Hugging Face Qwen3-MoE import against transformers itself: tests/fixtures/hf_qwen3moe holds
// small random models saved by transformers 5.17 (scripts/make_hf_fixture.py: head_dim unlike
// hidden / heads, norm_topk_prob both ways, tied embeddings, experts per expert and merged) with
// transformers' fp32 loss and every parameter's gradient for one token batch. moetrain's fp64
// engine, loaded from the directory, gives the same loss and gradients to 1e-5 (fp32
// reference). Bad directories are exit-4 errors naming the tensor or file.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "core/rng.h"
#include "dist/communicator.h"
#include "dist/mesh.h"
#include "hf_fixture.h"
#include "model/qwen3_moe.h"
#include "processes.h"
#include "testing.h"
#include "train/checkpoint.h"
#include "train/evaluate.h"
#include "train/hf_export.h"
#include "train/hf_import.h"
#include "train/hf_layout.h"

namespace mt {
namespace {

namespace fs = std::filesystem;
using dist::run_in_process;

std::string fixture(const std::string& name) {
  return testing::hf_fixture(name);
}

// The architecture from config.json; the engine in fp64 with transformers' loss (no
// load-balancing term: the fixture left it out).
ModelConfig hf_model(const std::string& dir) {
  ModelConfig base;
  base.compute_dtype = DType::kF64;
  ModelConfig c = model_config_from_hf_json(dir + "/config.json", base);
  c.aux_loss_coef = 0;
  c.loss_chunk_tokens = 0;
  return c;
}

using testing::reference_batch;

// Group g of unit u holds the same parameters, bit for bit, in models a and b.
#define EXPECT_SAME_PARAMS(a, b, u, g) \
  EXPECT_EQ(relative_error((a).units()[u].groups[g].params, (b).units()[u].groups[g].params), 0.0)

class HfParity : public ::testing::TestWithParam<const char*> {};

TEST_P(HfParity, LossAndEveryGradientMatchTransformers) {
  const std::string dir = fixture(GetParam());
  const ModelConfig c = hf_model(dir);
  Qwen3Moe model(c, 7);
  load_hf_weights(dir, model);
  SafetensorsFile ref = read_safetensors(dir + "/reference.safetensors");
  const Batch b = reference_batch(ref.tensors.at("tokens"));
  const int64_t n = b.size();
  model.zero_grad();
  const MicroBatchLosses l = model.forward_backward(b, {1.0 / static_cast<double>(n), 0.0});
  const double loss = l.ce_sum / static_cast<double>(n), want = ref.tensors.at("loss").item(0);
  EXPECT_NEAR(loss, want, 1e-5 * want) << GetParam();
  // transformers' gradients, mapped into moetrain's names and layouts like the weights.
  std::map<std::string, Tensor> grads;
  for (auto& [name, t] : ref.tensors)
    if (name.rfind("grad.", 0) == 0) grads.emplace(name.substr(5), t);
  const std::map<std::string, Tensor> want_grads = hf_to_moetrain(grads, model, "reference");
  int compared = 0;
  double worst = 0;
  for (const ParamUnit& u : model.units())
    for (const ParamGroup& g : u.groups)
      for (size_t i = 0; i < g.specs.size(); ++i) {
        const Tensor got = g.grad(i);
        const Tensor& w = want_grads.at(g.specs[i].name);
        const double err = relative_error(got, w.reshape(got.shape()));
        EXPECT_LT(err, 1e-5) << GetParam() << " " << g.specs[i].name;
        worst = std::max(worst, err);
        ++compared;
      }
  std::printf("%s: loss %.9f (transformers %.9f), worst gradient relative error %.2e\n", GetParam(),
              loss, want, worst);
  EXPECT_EQ(compared, static_cast<int>(want_grads.size()));
  EXPECT_GE(compared, 20);
}

// With transformers' load-balancing loss on (output_router_logits, reference_aux.safetensors):
// model.aux_loss_form = "transformers" gives its aux loss, total loss and every gradient; the
// per-layer form gives another aux loss (the choice is real).
TEST_P(HfParity, TransformersLoadBalancingLossAndGradients) {
  const std::string dir = fixture(GetParam());
  ModelConfig c = hf_model(dir);
  const SafetensorsFile ref = read_safetensors(dir + "/reference.safetensors");
  const SafetensorsFile aux = read_safetensors(dir + "/reference_aux.safetensors");
  const double coef = aux.tensors.at("aux_coef").item(0);
  // transformers routes every input token, the last one too (it has no label): the batch holds
  // all 20, the last one's target uncounted.
  const Tensor& tokens = ref.tensors.at("tokens");
  Batch b = reference_batch(tokens);
  const int64_t all = tokens.numel();
  const double n = static_cast<double>(all - 1);  // counted targets
  b.tokens = Tensor::empty({all}, DType::kI32);
  for (int64_t i = 0; i < all; ++i)
    b.tokens.data<int32_t>()[i] = static_cast<int32_t>(tokens.data<int64_t>()[i]);
  for (Tensor* t : {&b.targets, &b.loss_mask, &b.positions}) {
    Tensor longer = Tensor::zeros({all}, t->dtype());
    std::memcpy(longer.raw(), t->raw(), t->nbytes());
    *t = longer;
  }
  b.positions.data<int32_t>()[all - 1] = static_cast<int32_t>(all - 1);
  b.cu_seqlens.data<int32_t>()[1] = static_cast<int32_t>(all);
  b.max_seqlen = all;
  c.aux_loss_coef = coef;
  c.aux_loss_form = AuxLossForm::kPerLayer;
  Qwen3Moe per_layer(c, 7);
  load_hf_weights(dir, per_layer);
  const double per_layer_aux = per_layer.forward(b).aux_sum;
  c.aux_loss_form = AuxLossForm::kTransformers;
  Qwen3Moe model(c, 7);
  load_hf_weights(dir, model);
  model.zero_grad();
  const MicroBatchLosses l = model.forward_backward(b, {1.0 / n, coef});
  const double want_aux = aux.tensors.at("aux_loss").item(0), want = aux.tensors.at("loss").item(0);
  EXPECT_NEAR(l.aux_sum, want_aux, 1e-5 * want_aux) << GetParam();
  EXPECT_GT(std::abs(per_layer_aux - want_aux), 1e-3 * want_aux) << GetParam();
  EXPECT_NEAR(l.ce_sum / n + coef * l.aux_sum, want, 1e-5 * want) << GetParam();
  std::map<std::string, Tensor> grads;
  for (const auto& [name, t] : aux.tensors)
    if (name.rfind("grad.", 0) == 0) grads.emplace(name.substr(5), t);
  const std::map<std::string, Tensor> want_grads = hf_to_moetrain(grads, model, "reference_aux");
  double worst = 0;
  for (const ParamUnit& u : model.units())
    for (const ParamGroup& g : u.groups)
      for (size_t i = 0; i < g.specs.size(); ++i) {
        const Tensor got = g.grad(i);
        const double err = relative_error(got, want_grads.at(g.specs[i].name).reshape(got.shape()));
        EXPECT_LT(err, 1e-5) << GetParam() << " " << g.specs[i].name;
        worst = std::max(worst, err);
      }
  std::printf("%s: aux %.9f (transformers %.9f; per layer %.9f), worst gradient error %.2e\n",
              GetParam(), l.aux_sum, want_aux, per_layer_aux, worst);
}

INSTANTIATE_TEST_SUITE_P(Transformers, HfParity,
                         ::testing::Values("base", "no_norm_topk", "tied", "merged"));

// The per-expert and the merged layouts of the same weights load to the same parameters
// (the merged fixture is another random model: its per-expert twin is made here by hand).
TEST(HfImport, PerExpertAndMergedLayoutsAgree) {
  const std::string merged = fixture("merged");
  SafetensorsFile f = read_safetensors(merged + "/model.safetensors");
  const ModelConfig c = hf_model(merged);
  const int64_t e = c.n_experts, d = c.dim, ff = c.moe_dim;
  SafetensorsFile split;
  for (auto& [name, t] : f.tensors) {
    const auto at = name.find("mlp.experts.");
    if (at == std::string::npos) {
      split.tensors.emplace(name, t);
      continue;
    }
    const std::string pre = name.substr(0, at) + "mlp.experts.";
    const bool gate_up = name.find("gate_up_proj") != std::string::npos;
    for (int64_t x = 0; x < e; ++x) {
      if (gate_up) {
        split.tensors.emplace(fmt::format("{}{}.gate_proj.weight", pre, x),
                              t.view(x * 2 * ff * d, {ff, d}).clone());
        split.tensors.emplace(fmt::format("{}{}.up_proj.weight", pre, x),
                              t.view(x * 2 * ff * d + ff * d, {ff, d}).clone());
      } else {
        split.tensors.emplace(fmt::format("{}{}.down_proj.weight", pre, x),
                              t.view(x * d * ff, {d, ff}).clone());
      }
    }
  }
  const std::string dir = testing::unique_temp_path("hf_split");
  fs::create_directories(dir);
  fs::copy_file(merged + "/config.json", dir + "/config.json");
  write_safetensors(dir + "/model.safetensors", split);
  Qwen3Moe a(c, 1), b(c, 2);
  load_hf_weights(merged, a);
  load_hf_weights(dir, b);
  for (size_t u = 0; u < a.units().size(); ++u)
    for (size_t g = 0; g < a.units()[u].groups.size(); ++g)
      EXPECT_SAME_PARAMS(a, b, u, g) << a.units()[u].name;
  fs::remove_all(dir);
}

// The tiled, threaded walk visits every element of any range once, with source()'s answer:
// each map (same, transposed, gate/up and down per expert and merged, an EP slice of experts),
// ranges that start and end inside rows, and ranges long enough for several threads.
TEST(HfLayout, TiledWalkVisitsEveryElementOnceWithItsSource) {
  ModelConfig c;
  c.dim = 96;
  c.moe_dim = 40;
  c.n_experts = 6;
  c.vocab_size = 50;
  const int64_t per_gate_up = c.dim * 2 * c.moe_dim;
  const std::vector<ParamSpec> specs = {
      {"head.norm", {c.dim}},
      {"layers.0.attn.wq", {c.dim, c.q_dim()}},
      {"layers.1.moe.w_gate_up", {3, c.dim, 2 * c.moe_dim}, false, 0, 3 * per_gate_up},
      {"layers.1.moe.w_down", {6, c.moe_dim, c.dim}},
      {"embed.table", {1 << 13, c.dim}},  // > 2^20 elements: several threads
  };
  for (const HfExperts experts : {HfExperts::kPerExpert, HfExperts::kMerged})
    for (const ParamSpec& s : specs) {
      const HfLayout layout(s, c, experts);
      const int64_t n = shape_numel(s.shape);
      for (const auto& [lo, hi] : {std::pair<int64_t, int64_t>{0, n}, {7, n - 5}, {n / 3, n / 2}}) {
        std::vector<std::atomic<int>> seen(n);
        std::atomic<int64_t> wrong{0};
        layout.for_each_element(lo, hi, [&](int64_t j, HfLayout::Element e) {
          seen[j]++;
          const HfLayout::Element want = layout.source(j);
          if (e.tensor != want.tensor || e.index != want.index) ++wrong;
        });
        EXPECT_EQ(wrong.load(), 0) << s.name;
        for (int64_t j = 0; j < n; ++j)
          ASSERT_EQ(seen[j].load(), j >= lo && j < hi ? 1 : 0) << s.name << " element " << j;
      }
    }
}

// Sharded over (W, ep) = (4, 2), each rank reads only its slice of the mapped files: every
// element a rank holds equals the same element of one rank's import (an expert slice's element j
// is element init_offset + j of the whole parameter).
TEST(HfImport, EveryRankReadsItsSliceOfTheSameWeights) {
  const std::string dir = fixture("base");
  const ModelConfig c = hf_model(dir);
  Qwen3Moe one(c, 1);
  load_hf_weights(dir, one);
  std::map<std::string, Tensor> whole;
  for (const ParamUnit& u : one.units())
    for (const ParamGroup& g : u.groups)
      for (size_t i = 0; i < g.specs.size(); ++i) whole.emplace(g.specs[i].name, g.param(i));
  std::atomic<int64_t> checked{0};
  run_in_process(4, [&](dist::Communicator& comm) {
    ModelConfig c4 = c;
    dist::DeviceMesh mesh(comm, {4, 2}, c4.n_experts);
    Qwen3Moe m(c4, 2, &mesh);  // another seed: nothing equal by chance
    load_hf_weights(dir, m);
    for (const ParamUnit& u : m.units())
      for (const ParamGroup& g : u.groups) {
        const int64_t begin = g.shard_begin(), end = begin + g.shard.numel();
        for (const ParamSpec& s : g.specs) {
          const int64_t lo = std::max(begin, s.offset),
                        hi = std::min(end, s.offset + shape_numel(s.shape));
          for (int64_t k = lo; k < hi; ++k) {
            const double got = g.shard.item(k - begin);
            const double want = whole.at(s.name).item(s.init_offset + k - s.offset);
            ASSERT_EQ(got, want) << s.name << " element " << k - s.offset;
            ++checked;
          }
        }
      }
  });
  int64_t params = 0;
  for (const auto& [_, t] : whole) params += t.numel();
  // Every element is held by exactly one rank (dense groups sharded over all 4, each EP rank's
  // experts over its 2 FSDP peers), so the ranks together checked each element once.
  EXPECT_EQ(checked.load(), params);
}

// fp16 on disk loads as the fp16 values, exactly (a file of the same values in f32 loads to the
// same parameters).
TEST(HfImport, Fp16CheckpointsLoadTheirValues) {
  const std::string base = fixture("base");
  const ModelConfig c = hf_model(base);
  const SafetensorsFile f = read_safetensors(base + "/model.safetensors");
  SafetensorsFile half, rounded;
  for (const auto& [name, t] : f.tensors) {
    half.tensors.emplace(name, t.to(DType::kF16));
    rounded.tensors.emplace(name, t.to(DType::kF16).to(DType::kF32));
  }
  std::map<std::string, std::string> dirs;
  for (const auto& [key, file] : {std::pair{"half", &half}, std::pair{"rounded", &rounded}}) {
    dirs[key] = testing::unique_temp_path(std::string("hf_") + key);
    fs::create_directories(dirs[key]);
    fs::copy_file(base + "/config.json", dirs[key] + "/config.json");
    write_safetensors(dirs[key] + "/model.safetensors", *file);
  }
  Qwen3Moe a(c, 1), b(c, 2), orig(c, 3);
  load_hf_weights(dirs["half"], a);
  load_hf_weights(dirs["rounded"], b);
  load_hf_weights(base, orig);
  for (size_t u = 0; u < a.units().size(); ++u)
    for (size_t g = 0; g < a.units()[u].groups.size(); ++g) {
      const Tensor& pa = a.units()[u].groups[g].params;
      EXPECT_EQ(relative_error(pa, b.units()[u].groups[g].params), 0.0) << a.units()[u].name;
      // fp16 rounding happened: the values differ from the f32 originals, but by < 2^-11.
      const double err = relative_error(pa, orig.units()[u].groups[g].params);
      EXPECT_GT(err, 0.0) << a.units()[u].name;
      EXPECT_LT(err, 1e-3) << a.units()[u].name;
    }
  for (const auto& [_, d] : dirs) fs::remove_all(d);
}

// Bad directories: each a CheckpointError (exit 4) naming what is wrong, and the model's
// parameters untouched.
TEST(HfImport, BadDirectoriesNameTheTensorAndWriteNothing) {
  const std::string base = fixture("base");
  const ModelConfig c = hf_model(base);
  SafetensorsFile f = read_safetensors(base + "/model.safetensors");
  auto expect_refused = [&](const SafetensorsFile& file, const std::string& words,
                            const std::string& index = "") {
    const std::string dir = testing::unique_temp_path("hf_bad");
    fs::create_directories(dir);
    fs::copy_file(base + "/config.json", dir + "/config.json");
    if (index.empty()) {
      write_safetensors(dir + "/model.safetensors", file);
    } else {
      std::ofstream(dir + "/model.safetensors.index.json") << index;
    }
    Qwen3Moe model(c, 1);
    const Tensor before = model.units()[1].groups[0].params.clone();
    try {
      load_hf_weights(dir, model);
      ADD_FAILURE() << "accepted: " << words;
    } catch (const CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
      EXPECT_EQ(e.code(), ExitCode::kCheckpoint);
    }
    EXPECT_EQ(relative_error(model.units()[1].groups[0].params, before), 0.0) << words;
    fs::remove_all(dir);
  };
  SafetensorsFile missing = f;
  missing.tensors.erase("model.layers.1.self_attn.q_norm.weight");
  expect_refused(missing, "lacks tensor model.layers.1.self_attn.q_norm.weight");
  SafetensorsFile extra = f;
  extra.tensors.emplace("model.layers.0.mlp.shared_expert.weight", Tensor::zeros({4}, DType::kF32));
  expect_refused(extra, "holds tensor model.layers.0.mlp.shared_expert.weight");
  SafetensorsFile wrong = f;
  wrong.tensors["model.layers.0.mlp.gate.weight"] = Tensor::zeros({8, 31}, DType::kF32);
  expect_refused(wrong, "tensor model.layers.0.mlp.gate.weight is (8, 31)");
  SafetensorsFile ints = f;
  ints.tensors["model.norm.weight"] = Tensor::zeros({32}, DType::kI32);
  expect_refused(ints, "tensor model.norm.weight is i32");
  expect_refused(f, "model-00002-of-00002.safetensors' is missing",
                 R"({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}})");
  // The index names a tensor that its file lacks.
  {
    const std::string dir = testing::unique_temp_path("hf_bad_index");
    fs::create_directories(dir);
    fs::copy_file(base + "/config.json", dir + "/config.json");
    write_safetensors(dir + "/model-00001-of-00001.safetensors", f);
    std::ofstream(dir + "/model.safetensors.index.json")
        << R"({"weight_map": {"model.norm.weight": "model-00001-of-00001.safetensors",
               "model.layers.9.mlp.gate.weight": "model-00001-of-00001.safetensors"}})";
    Qwen3Moe model(c, 1);
    const std::string e = testing::error_of([&] { load_hf_weights(dir, model); });
    EXPECT_NE(e.find("names tensor model.layers.9.mlp.gate.weight"), std::string::npos) << e;
    fs::remove_all(dir);
  }
  // A shard cut short: the tensor whose bytes are missing is named.
  {
    const std::string dir = testing::unique_temp_path("hf_bad_cut");
    fs::create_directories(dir);
    fs::copy_file(base + "/config.json", dir + "/config.json");
    write_safetensors(dir + "/model.safetensors", f);
    fs::resize_file(dir + "/model.safetensors", fs::file_size(dir + "/model.safetensors") - 100);
    Qwen3Moe model(c, 1);
    const std::string e = testing::error_of([&] { load_hf_weights(dir, model); });
    EXPECT_NE(e.find("is truncated or corrupt: tensor"), std::string::npos) << e;
    fs::remove_all(dir);
  }
}

// config.json of both transformers generations, and another architecture refused by name.
TEST(HfImport, ConfigJsonOfBothGenerationsAndOtherArchitectures) {
  const ModelConfig v5 = hf_model(fixture("base"));  // num_local_experts, rope_parameters
  EXPECT_EQ(v5.n_experts, 8);
  EXPECT_EQ(v5.head_dim, 12);
  EXPECT_EQ(v5.rope_theta, 10000.0);
  const std::string dir = testing::unique_temp_path("hf_v4");
  fs::create_directories(dir);
  std::ifstream in(fixture("base") + "/config.json");
  nlohmann::json j;
  in >> j;
  j.erase("num_local_experts");
  j.erase("rope_parameters");
  j["num_experts"] = 16;
  j["rope_theta"] = 1e6;
  std::ofstream(dir + "/config.json") << j.dump();
  const ModelConfig v4 = hf_model(dir);
  EXPECT_EQ(v4.n_experts, 16);
  EXPECT_EQ(v4.rope_theta, 1e6);
  j["model_type"] = "llama";
  std::ofstream(dir + "/config.json") << j.dump();
  const std::string e = testing::error_of([&] { (void)hf_model(dir); });
  EXPECT_NE(e.find("model_type \"llama\", not a Qwen3-MoE"), std::string::npos) << e;
  fs::remove_all(dir);
}

// `moetrain train --init-from HF_DIR`: the architecture comes from config.json (a config without
// a model section), the weights from the safetensors; a model field that disagrees is exit 2.
TEST(HfImport, TrainStartsFromAnHfDirectoryThroughTheCli) {
  const std::string cfg = testing::unique_temp_path("hf_train.toml");
  std::ofstream(cfg) << "[train]\nsteps = 2\nseq_len = 16\nbatch_rows = 2\nlog_every = 1\n"
                        "warmup_steps = 1\n[data]\nsource = \"synthetic\"\nlanguages = 2\n"
                        "branching = 2\nmin_doc_len = 4\nmax_doc_len = 12\n"
                        "[hardware]\ndevice = \"cpu\"\n";
  const std::string metrics = testing::unique_temp_path("hf_metrics.jsonl");
  const std::string bin = MOETRAIN_BINARY;
  const testing::Proc ok = testing::run_cmd(bin + " train --config " + cfg + " --init-from " +
                                            fixture("base") + " --metrics " + metrics);
  ASSERT_EQ(ok.code, 0) << ok.output;
  EXPECT_NE(ok.output.find("initialised from the Hugging Face weights"), std::string::npos)
      << ok.output;
  EXPECT_NE(ok.output.find("2 layers, dim 32, 8 experts top-3"), std::string::npos) << ok.output;
  EXPECT_EQ(testing::read_file(metrics).empty(), false);
  const testing::Proc bad = testing::run_cmd(bin + " train --config " + cfg + " --init-from " +
                                             fixture("base") + " --set model.dim=48");
  EXPECT_EQ(bad.code, 2) << bad.output;
  EXPECT_NE(bad.output.find("model.dim = 48 disagrees"), std::string::npos) << bad.output;
  std::filesystem::remove(cfg);
  std::filesystem::remove(metrics);
}

// import -> export (f32) -> import gives the same parameters bit for bit; the export holds
// experts per expert (whatever the import's layout) and config.json with both generations' keys.
TEST(HfExport, RoundTripIsBitIdenticalAndPerExpert) {
  for (const char* name : {"base", "merged", "tied"}) {
    const ModelConfig c = hf_model(fixture(name));
    Qwen3Moe a(c, 1), b(c, 2);
    load_hf_weights(fixture(name), a);
    const std::string dir = testing::unique_temp_path("hf_export");
    export_hf(a, dir, DType::kF32, nullptr);
    load_hf_weights(dir, b);
    for (size_t u = 0; u < a.units().size(); ++u)
      for (size_t g = 0; g < a.units()[u].groups.size(); ++g)
        EXPECT_SAME_PARAMS(a, b, u, g) << name << " " << a.units()[u].name;
    const SafetensorsFile f = read_safetensors(dir + "/model.safetensors");
    EXPECT_TRUE(f.tensors.count("model.layers.1.mlp.experts.7.up_proj.weight")) << name;
    EXPECT_FALSE(f.tensors.count("model.layers.1.mlp.experts.gate_up_proj")) << name;
    EXPECT_EQ(f.tensors.count("lm_head.weight"), std::string(name) == "tied" ? 0u : 1u) << name;
    std::ifstream in(dir + "/config.json");
    nlohmann::json j;
    in >> j;
    EXPECT_EQ(j.at("num_experts"), 8);
    EXPECT_EQ(j.at("num_local_experts"), 8);
    EXPECT_EQ(j.at("rope_parameters").at("rope_theta"), 10000.0);
    EXPECT_EQ(j.at("head_dim"), 12);
    std::filesystem::remove_all(dir);
  }
}

// Shards of at most 16 KiB: several files and the index, which the import follows to the same
// parameters; no shard over the limit unless it holds one tensor larger than it.
// Export from (W, ep) = (4, 2) ranks (dense groups sharded over 4, each EP rank's experts over its
// 2 FSDP peers): the import's values come back exactly, every expert from its EP rank.
TEST(HfExport, FromFourRanksWithExpertParallelismGivesTheImportedWeights) {
  const std::string src = fixture("base");
  const ModelConfig c = hf_model(src);
  const std::string dir = testing::unique_temp_path("hf_export_w4");
  run_in_process(4, [&](dist::Communicator& comm) {
    ModelConfig c4 = c;
    dist::DeviceMesh mesh(comm, {4, 2}, c4.n_experts);
    Qwen3Moe m(c4, 5, &mesh);
    load_hf_weights(src, m);
    export_hf(m, dir, DType::kF32, &comm);
  });
  Qwen3Moe a(c, 1), b(c, 2);
  load_hf_weights(src, a);
  load_hf_weights(dir, b);
  for (size_t u = 0; u < a.units().size(); ++u)
    for (size_t g = 0; g < a.units()[u].groups.size(); ++g)
      EXPECT_SAME_PARAMS(a, b, u, g) << a.units()[u].name;
  fs::remove_all(dir);
}

TEST(HfExport, ShardedExportHasAnIndexAndLoadsTheSame) {
  const ModelConfig c = hf_model(fixture("base"));
  Qwen3Moe a(c, 1), b(c, 2);
  load_hf_weights(fixture("base"), a);
  const std::string dir = testing::unique_temp_path("hf_sharded");
  constexpr size_t kLimit = 16 << 10;
  export_hf(a, dir, DType::kBF16, nullptr, kLimit);
  std::ifstream in(dir + "/model.safetensors.index.json");
  nlohmann::json index;
  in >> index;
  std::set<std::string> files;
  for (const auto& [_, file] : index.at("weight_map").items())
    files.insert(file.get<std::string>());
  EXPECT_GE(files.size(), 3u);
  EXPECT_FALSE(fs::exists(dir + "/model.safetensors"));
  size_t data_bytes = 0;
  for (const std::string& f : files) {
    const SafetensorsFile sf = read_safetensors(dir + "/" + f);
    size_t bytes = 0;
    for (const auto& [name, t] : sf.tensors) {
      EXPECT_EQ(index["weight_map"][name], f);
      EXPECT_EQ(t.dtype(), DType::kBF16);
      bytes += t.nbytes();
    }
    if (sf.tensors.size() > 1) {
      EXPECT_LE(bytes, kLimit) << f;
    }
    data_bytes += bytes;
  }
  EXPECT_EQ(index.at("metadata").at("total_size").get<size_t>(), data_bytes);
  load_hf_weights(dir, b);
  for (size_t u = 0; u < a.units().size(); ++u)
    for (size_t g = 0; g < a.units()[u].groups.size(); ++g) {
      // bf16 on disk: the parameters are a's rounded to bf16.
      const Tensor want = a.units()[u].groups[g].params.to(DType::kBF16).to(DType::kF64);
      EXPECT_EQ(relative_error(b.units()[u].groups[g].params.to(DType::kF64), want), 0.0)
          << a.units()[u].name;
    }
  fs::remove_all(dir);
}

// `moetrain export-hf` from a checkpoint written by two ranks with ep 2 (in-process CPU ranks)
// gives the export of the same run on one rank (the runs agree to fp64 rounding; the export is
// f32), and a bad --dtype is exit 2.
TEST(HfExport, TwoRankCheckpointExportsLikeOneRank) {
  const std::string bin = MOETRAIN_BINARY;
  const std::string cfg = std::string(MOETRAIN_SOURCE_DIR) + "/configs/tiny.toml";
  std::map<int, std::string> exported;
  for (const int world : {1, 2}) {
    const std::string ckpt = testing::unique_temp_path("hf_ckpt");
    const std::string sets =
        " --set hardware.device=cpu --set model.compute_dtype=f64 --set train.steps=2"
        " --set checkpoint.every=2 --set checkpoint.dir=\"" +
        ckpt + "\"" + " --set parallel.world=" + std::to_string(world) +
        " --set parallel.ep=" + std::to_string(world) +
        " --set train.batch_rows=" + std::to_string(8 / world);
    const testing::Proc t = testing::run_cmd(bin + " train --config " + cfg + sets);
    ASSERT_EQ(t.code, 0) << t.output;
    exported[world] = testing::unique_temp_path("hf_out");
    const testing::Proc e =
        testing::run_cmd(bin + " export-hf --config " + cfg + sets + " --resume " + ckpt +
                         " --out " + exported[world] + " --dtype f32");
    ASSERT_EQ(e.code, 0) << e.output;
    std::filesystem::remove_all(ckpt);
  }
  const SafetensorsFile one = read_safetensors(exported[1] + "/model.safetensors");
  const SafetensorsFile two = read_safetensors(exported[2] + "/model.safetensors");
  ASSERT_EQ(one.tensors.size(), two.tensors.size());
  for (const auto& [name, t] : one.tensors) {
    ASSERT_TRUE(two.tensors.count(name)) << name;
    EXPECT_LT(relative_error(two.tensors.at(name), t), 1e-6) << name;
  }
  const testing::Proc bad =
      testing::run_cmd(bin + " export-hf --config " + cfg + " --resume x --out y --dtype e4m3");
  EXPECT_EQ(bad.code, 2) << bad.output;
  EXPECT_NE(bad.output.find("--dtype e4m3 (valid: bf16, f32)"), std::string::npos) << bad.output;
  for (const auto& [_, dir] : exported) std::filesystem::remove_all(dir);
}

// Evaluation over a token file holding the fixture's batch as one document: with rows long enough
// for the whole document (and padded past it) the loss is transformers'; over two in-process
// ranks with shorter rows it is one rank's with the same rows. Through the CLI: one JSON line.
TEST(Eval, TokenFileLossIsTransformersAndRankIndependent) {
  const std::string dir = fixture("base");
  const ModelConfig c = hf_model(dir);
  const SafetensorsFile ref = read_safetensors(dir + "/reference.safetensors");
  const Tensor& tokens = ref.tensors.at("tokens");
  TokenDocuments docs;
  docs.doc_offsets = {0, static_cast<uint64_t>(tokens.numel())};
  for (int64_t i = 0; i < tokens.numel(); ++i)
    docs.tokens.push_back(static_cast<uint32_t>(tokens.data<int64_t>()[i]));
  Qwen3Moe model(c, 1);
  load_hf_weights(dir, model);
  const double want = ref.tensors.at("loss").item(0);
  for (const int64_t seq_len : {19, 32}) {
    const EvalResult e = evaluate_tokens(model, docs.view(), 1, seq_len, nullptr);
    EXPECT_EQ(e.tokens, 19) << seq_len;
    EXPECT_NEAR(e.mean(), want, 1e-5 * want) << seq_len;
  }
  // Rows of 8 never cut the document: a micro-batch of 3 x 8 inputs is one packed sequence.
  const EvalResult one = evaluate_tokens(model, docs.view(), 3, 8, nullptr);
  EXPECT_EQ(one.tokens, 19);
  EXPECT_NEAR(one.mean(), want, 1e-5 * want);
  // One row of 8 cannot hold its 20 tokens: refused, naming it.
  const std::string too_long =
      testing::error_of([&] { evaluate_tokens(model, docs.view(), 1, 8, nullptr); });
  EXPECT_NE(too_long.find("document 0 of 'the evaluation data' has 20 tokens"), std::string::npos)
      << too_long;
  run_in_process(2, [&](dist::Communicator& comm) {
    ModelConfig c2 = c;
    dist::DeviceMesh mesh(comm, {2, 2}, c2.n_experts);
    Qwen3Moe m2(c2, 1, &mesh);
    load_hf_weights(dir, m2);
    const EvalResult two = evaluate_tokens(m2, docs.view(), 3, 8, &comm);
    EXPECT_EQ(two.tokens, 19);
    EXPECT_NEAR(two.mean(), one.mean(), 1e-12 * one.mean());
  });
  // The CLI.
  const std::string data = testing::unique_temp_path("eval.tokens");
  write_token_file(data, docs);
  const std::string cfg = testing::unique_temp_path("eval.toml");
  std::ofstream(cfg) << "[train]\nseq_len = 32\nbatch_rows = 1\n[hardware]\ndevice = \"cpu\"\n"
                        "[model]\ncompute_dtype = \"f64\"\n";
  const testing::Proc p = testing::run_cmd(std::string(MOETRAIN_BINARY) + " eval --config " + cfg +
                                           " --init-from " + dir + " --data " + data);
  ASSERT_EQ(p.code, 0) << p.output;
  const auto at = p.output.rfind("{\"eval\"");
  ASSERT_NE(at, std::string::npos) << p.output;
  const nlohmann::json j = nlohmann::json::parse(p.output.substr(at));
  EXPECT_EQ(j.at("tokens"), 19);
  EXPECT_NEAR(j.at("loss").get<double>(), want, 1e-5 * want);
  // --per-token: every counted target's loss, which is transformers' (log-softmax of its fp32
  // logits at the next token), with the document, position and token of each.
  const std::string per_token = testing::unique_temp_path("per_token.jsonl");
  const testing::Proc pt =
      testing::run_cmd(std::string(MOETRAIN_BINARY) + " eval --config " + cfg + " --init-from " +
                       dir + " --data " + data + " --per-token " + per_token);
  ASSERT_EQ(pt.code, 0) << pt.output;
  const Tensor& ref_logits = ref.tensors.at("logits");  // (T, V), the prediction of token t + 1
  const int64_t v = ref_logits.dim(1);
  std::ifstream lines(per_token);
  std::string line;
  int64_t count = 0;
  double sum = 0;
  while (std::getline(lines, line)) {
    const nlohmann::json t = nlohmann::json::parse(line);
    const int64_t pos = t.at("pos");
    ASSERT_EQ(t.at("doc"), 0);
    ASSERT_EQ(pos, count + 1) << "in file order, from the document's second token";
    ASSERT_EQ(t.at("token"), tokens.data<int64_t>()[pos]);
    double m = -1e300, z = 0;
    for (int64_t k = 0; k < v; ++k) m = std::max<double>(m, ref_logits.item((pos - 1) * v + k));
    for (int64_t k = 0; k < v; ++k) z += std::exp(ref_logits.item((pos - 1) * v + k) - m);
    const double want =
        m + std::log(z) - ref_logits.item((pos - 1) * v + tokens.data<int64_t>()[pos]);
    EXPECT_NEAR(t.at("loss").get<double>(), want, 1e-5 * std::max(1.0, want)) << line;
    sum += t.at("loss").get<double>();
    ++count;
  }
  EXPECT_EQ(count, 19);
  EXPECT_NEAR(sum / 19, j.at("loss").get<double>(), 1e-12 * sum);
  std::filesystem::remove(per_token);
  // Over two in-process ranks, the per-token losses arrive on rank 0 in the same order.
  std::vector<std::pair<int64_t, double>> one_rank, two_ranks;
  const TokenLossSink into_one = [&](int64_t t, double l) { one_rank.push_back({t, l}); };
  (void)evaluate_tokens(model, docs.view(), 3, 8, nullptr, &into_one);
  run_in_process(2, [&](dist::Communicator& comm) {
    ModelConfig c2 = c;
    dist::DeviceMesh mesh(comm, {2, 2}, c2.n_experts);
    Qwen3Moe m2(c2, 1, &mesh);
    load_hf_weights(dir, m2);
    const TokenLossSink into_two = [&](int64_t t, double l) { two_ranks.push_back({t, l}); };
    (void)evaluate_tokens(m2, docs.view(), 3, 8, &comm, &into_two);
  });
  ASSERT_EQ(one_rank.size(), 19u);
  ASSERT_EQ(two_ranks.size(), 19u);
  for (size_t k = 0; k < 19; ++k) {
    EXPECT_EQ(two_ranks[k].first, one_rank[k].first);
    EXPECT_NEAR(two_ranks[k].second, one_rank[k].second, 1e-12 * one_rank[k].second);
  }
  const testing::Proc both =
      testing::run_cmd(std::string(MOETRAIN_BINARY) + " eval --config " + cfg + " --data " + data);
  EXPECT_EQ(both.code, 2) << both.output;
  std::filesystem::remove(data);
  std::filesystem::remove(cfg);
}

// Evaluation never cuts a document: each document's per-token losses inside a file of others
// (packed with them, over one rank or two) equal its losses in a file by itself (CPU, fp32, 1e-6),
// documents as long as the micro-batch included.
TEST(Eval, EachDocumentsLossesAreItsOwnAlone) {
  const std::string dir = fixture("base");
  ModelConfig c = hf_model(dir);
  c.compute_dtype = DType::kF32;
  Qwen3Moe model(c, 1);
  load_hf_weights(dir, model);
  const CounterRng rng{3, 31};
  TokenDocuments docs;
  docs.doc_offsets = {0};
  const int64_t rows = 2, seq_len = 16, capacity = rows * seq_len + 1;
  for (int d = 0; d < 14; ++d) {
    const int64_t len = d == 5 ? capacity : 2 + rng.below(d, 30);
    for (int64_t i = 0; i < len; ++i) {
      docs.tokens.push_back(rng.below(1000 * d + i + 1, static_cast<uint32_t>(c.vocab_size)));
      docs.loss_mask.push_back(i % 4 != 1);
    }
    docs.doc_offsets.push_back(docs.tokens.size());
  }
  std::map<int64_t, double> together;
  const TokenLossSink into = [&](int64_t t, double l) { together[t] = l; };
  const EvalResult all = evaluate_tokens(model, docs.view(), rows, seq_len, nullptr, &into);
  EXPECT_EQ(all.tokens, static_cast<int64_t>(together.size()));
  int64_t checked = 0;
  for (int64_t d = 0; d < docs.num_docs(); ++d) {
    TokenDocuments one;
    const uint64_t first = docs.doc_offsets[d], last = docs.doc_offsets[d + 1];
    one.doc_offsets = {0, last - first};
    one.tokens.assign(docs.tokens.begin() + first, docs.tokens.begin() + last);
    one.loss_mask.assign(docs.loss_mask.begin() + first, docs.loss_mask.begin() + last);
    std::vector<std::pair<int64_t, double>> alone;
    const TokenLossSink sink = [&](int64_t t, double l) { alone.push_back({t, l}); };
    (void)evaluate_tokens(model, one.view(), rows, seq_len, nullptr, &sink);
    ASSERT_FALSE(alone.empty()) << d;
    for (const auto& [t, l] : alone) {
      ASSERT_TRUE(together.count(first + t)) << "document " << d << " target " << t;
      EXPECT_NEAR(together.at(first + t), l, 1e-6 * std::max(1.0, std::abs(l)))
          << "document " << d << " target " << t;
      ++checked;
    }
  }
  EXPECT_EQ(checked, all.tokens);
  // Two ranks (ep 2), and context parallelism (each micro-batch over a CP group, each rank its
  // chunks of it: world 2 with cp 2, world 4 with cp 2 and ep 2): the same values.
  for (const dist::MeshShape shape :
       {dist::MeshShape{2, 2, 1}, dist::MeshShape{2, 1, 2}, dist::MeshShape{4, 2, 2}}) {
    SCOPED_TRACE(fmt::format("world {} ep {} cp {}", shape.world, shape.ep, shape.cp));
    run_in_process(shape.world, [&](dist::Communicator& comm) {
      dist::DeviceMesh mesh(comm, shape, c.n_experts);
      Qwen3Moe m2(c, 1, &mesh);
      load_hf_weights(dir, m2);
      std::vector<std::pair<int64_t, double>> two;
      const TokenLossSink sink = [&](int64_t t, double l) { two.push_back({t, l}); };
      const EvalResult e = evaluate_tokens(m2, docs.view(), rows, seq_len, &comm, &sink);
      EXPECT_EQ(e.tokens, all.tokens);
      EXPECT_NEAR(e.loss_sum, all.loss_sum, 1e-6 * all.loss_sum);
      if (comm.rank() != 0) return;
      ASSERT_EQ(two.size(), together.size());
      for (const auto& [t, l] : two)
        EXPECT_NEAR(together.at(t), l, 1e-6 * std::max(1.0, std::abs(l))) << "target " << t;
    });
  }
}

// Validation during training: eval.every steps (and the last) the metrics carry eval_loss, a
// finite loss below the uniform distribution's; eval.every without eval.data is exit 2.
TEST(Eval, TrainingReportsTheValidationLoss) {
  TokenDocuments docs;
  docs.doc_offsets = {0, 40, 100};
  for (int i = 0; i < 100; ++i) docs.tokens.push_back(static_cast<uint32_t>((i * 37) % 200));
  const std::string data = testing::unique_temp_path("val.tokens");
  write_token_file(data, docs);
  const std::string metrics = testing::unique_temp_path("val.jsonl");
  const std::string tiny = std::string(MOETRAIN_SOURCE_DIR) + "/configs/tiny.toml";
  const std::string bin = MOETRAIN_BINARY;
  const testing::Proc p = testing::run_cmd(
      bin + " train --config " + tiny + " --set hardware.device=cpu --set train.steps=3" +
      " --set eval.every=2 --set eval.data=\"" + data + "\" --metrics " + metrics);
  ASSERT_EQ(p.code, 0) << p.output;
  std::ifstream in(metrics);
  std::string line;
  std::vector<int64_t> evaluated;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (!j.contains("eval_loss")) continue;
    evaluated.push_back(j.at("step").get<int64_t>());
    EXPECT_GT(j.at("eval_loss").get<double>(), 0.0);
    EXPECT_LT(j.at("eval_loss").get<double>(), std::log(256.0) + 1.0);
  }
  EXPECT_EQ(evaluated, (std::vector<int64_t>{2, 3}));
  const testing::Proc bad =
      testing::run_cmd(bin + " train --config " + tiny + " --set eval.every=2");
  EXPECT_EQ(bad.code, 2) << bad.output;
  EXPECT_NE(bad.output.find("eval.every > 0 needs eval.data"), std::string::npos) << bad.output;
  std::filesystem::remove(data);
  std::filesystem::remove(metrics);
}

}  // namespace
}  // namespace mt
