// Hugging Face Qwen3-MoE import against transformers itself: tests/fixtures/hf_qwen3moe holds
// small random models saved by transformers 5.17 (scripts/make_hf_fixture.py: head_dim unlike
// hidden / heads, norm_topk_prob both ways, tied embeddings, experts per expert and merged) with
// transformers' fp32 loss and every parameter's gradient for one token batch. moetrain's fp64
// engine, loaded from the directory, gives the same loss and gradients to 1e-5 (fp32
// reference). Bad directories are exit-4 errors naming the tensor or file.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "dist/communicator.h"
#include "dist/mesh.h"
#include "model/qwen3_moe.h"
#include "processes.h"
#include "testing.h"
#include "train/checkpoint.h"
#include "train/evaluate.h"
#include "train/hf_export.h"
#include "train/hf_import.h"

namespace mt {
namespace {

namespace fs = std::filesystem;
using dist::run_in_process;

std::string fixture(const std::string& name) {
  return std::string(MOETRAIN_SOURCE_DIR) + "/tests/fixtures/hf_qwen3moe/" + name;
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

// One document: inputs are the reference tokens but the last, targets the tokens after them.
Batch reference_batch(const Tensor& tokens) {
  const int64_t n = tokens.numel() - 1;
  Batch b;
  b.tokens = Tensor::empty({n}, DType::kI32);
  b.targets = Tensor::empty({n}, DType::kI32);
  b.loss_mask = Tensor::empty({n}, DType::kU8);
  b.positions = Tensor::empty({n}, DType::kI32);
  for (int64_t i = 0; i < n; ++i) {
    b.tokens.data<int32_t>()[i] = static_cast<int32_t>(tokens.data<int64_t>()[i]);
    b.targets.data<int32_t>()[i] = static_cast<int32_t>(tokens.data<int64_t>()[i + 1]);
    b.loss_mask.data<uint8_t>()[i] = 1;
    b.positions.data<int32_t>()[i] = static_cast<int32_t>(i);
  }
  b.cu_seqlens = Tensor::empty({2}, DType::kI32);
  b.cu_seqlens.data<int32_t>()[0] = 0;
  b.cu_seqlens.data<int32_t>()[1] = static_cast<int32_t>(n);
  b.max_seqlen = n;
  return b;
}

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
      EXPECT_EQ(relative_error(a.units()[u].groups[g].params, b.units()[u].groups[g].params), 0.0)
          << a.units()[u].name;
  fs::remove_all(dir);
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
        EXPECT_EQ(relative_error(a.units()[u].groups[g].params, b.units()[u].groups[g].params), 0.0)
            << name << " " << a.units()[u].name;
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
    const EvalResult e = evaluate_tokens(model, docs, 1, seq_len, nullptr);
    EXPECT_EQ(e.tokens, 19) << seq_len;
    EXPECT_NEAR(e.mean(), want, 1e-5 * want) << seq_len;
  }
  const EvalResult one = evaluate_tokens(model, docs, 1, 8, nullptr);
  EXPECT_EQ(one.tokens, 19);
  EXPECT_GT(std::abs(one.mean() - want), 1e-3);  // rows of 8 cut the context
  run_in_process(2, [&](dist::Communicator& comm) {
    ModelConfig c2 = c;
    dist::DeviceMesh mesh(comm, {2, 2}, c2.n_experts);
    Qwen3Moe m2(c2, 1, &mesh);
    load_hf_weights(dir, m2);
    const EvalResult two = evaluate_tokens(m2, docs, 1, 8, &comm);
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
  const testing::Proc both =
      testing::run_cmd(std::string(MOETRAIN_BINARY) + " eval --config " + cfg + " --data " + data);
  EXPECT_EQ(both.code, 2) << both.output;
  std::filesystem::remove(data);
  std::filesystem::remove(cfg);
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
