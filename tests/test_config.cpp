// Config parsing: every kind of bad input gives one ConfigError naming the key; presets load;
// the HF config.json reader agrees with the presets; the CLI exits with code 2.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "model/flops.h"
#include "model/memory.h"
#include "model/precision.h"
#include "moe/exchange/expert_exchange.h"
#include "testing.h"
#include "train/config.h"

namespace mt {
namespace {

std::string config_error(const std::string& toml, const std::vector<std::string>& sets = {}) {
  try {
    parse_config_string(toml, sets);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "no error";
}

TEST(Config, UnknownKeyNamesKeyAndValidKeys) {
  const std::string e = config_error("[model]\ndimm = 3\n");
  EXPECT_NE(e.find("unknown key model.dimm"), std::string::npos) << e;
  EXPECT_NE(e.find("n_heads"), std::string::npos) << e;
  EXPECT_NE(config_error("[modle]\ndim = 3\n").find("unknown section [modle]"), std::string::npos);
  EXPECT_NE(config_error("", {"train.stepz=3"}).find("train.stepz"), std::string::npos);
}

TEST(Config, WrongTypeNamesKey) {
  EXPECT_NE(config_error("[model]\ndim = \"wide\"\n").find("model.dim must be an integer"),
            std::string::npos);
  EXPECT_NE(config_error("[train]\nlr = true\n").find("train.lr must be a number"),
            std::string::npos);
  EXPECT_NE(config_error("[model]\ncheckpoint = \"some\"\n").find("valid: none, selective, full"),
            std::string::npos);
  EXPECT_NE(config_error("", {"hardware.overlap_optimizer=\"yes\""})
                .find("hardware.overlap_optimizer must be true or false"),
            std::string::npos);
}

TEST(Config, ImpossibleShapesNameTheSizes) {
  const std::string heads = config_error("[model]\nn_heads = 6\nn_kv_heads = 4\n");
  EXPECT_NE(heads.find("model.n_heads = 6"), std::string::npos) << heads;
  EXPECT_NE(heads.find("model.n_kv_heads = 4"), std::string::npos) << heads;
  EXPECT_NE(config_error("[model]\ntop_k = 9\nn_experts = 8\n").find("model.top_k = 9"),
            std::string::npos);
  EXPECT_NE(config_error("[model]\nhead_dim = 7\n").find("model.head_dim = 7"), std::string::npos);
  EXPECT_NE(config_error("[model]\nloss_chunk_tokens = -1\n").find("model.loss_chunk_tokens = -1"),
            std::string::npos);
  EXPECT_NE(config_error("[train]\nseq_len = 0\n").find("train.seq_len = 0"), std::string::npos);
  EXPECT_NE(config_error("[model]\nvocab_size = 8\n").find("model.vocab_size = 8"),
            std::string::npos);
  EXPECT_NE(config_error("[data]\nsource = \"tokens\"\n").find("data.path"), std::string::npos);
}

TEST(Config, OverridesApplyAndAcceptBareStrings) {
  const Config c = parse_config_string("[model]\ndim = 32\n",
                                       {"model.dim=48", "model.checkpoint=full", "train.lr=1e-3"});
  EXPECT_EQ(c.model.dim, 48);
  EXPECT_EQ(c.model.checkpoint, CheckpointPolicy::kFull);
  EXPECT_EQ(c.train.lr, 1e-3);
  EXPECT_NE(config_error("", {"dim=3"}).find("section.key=value"), std::string::npos);
}

TEST(Config, PresetsLoad) {
  for (const char* name : {"tiny", "qwen3-30b-a3b", "qwen3-235b-a22b"}) {
    const std::string path = std::string(MOETRAIN_SOURCE_DIR) + "/configs/" + name + ".toml";
    EXPECT_NO_THROW(load_config(path, {})) << path;
  }
  const Config c =
      load_config(std::string(MOETRAIN_SOURCE_DIR) + "/configs/qwen3-30b-a3b.toml", {});
  EXPECT_NEAR(train_flops_per_token(c.model, 16384) / 1e9, 56.9, 0.05);
}

TEST(Config, HfConfigJsonMatchesPreset) {
  const std::string json = R"({
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": false, "decoder_sparse_step": 1,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "mlp_only_layers": [],
    "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": true,
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
    "rope_scaling": null, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": null, "tie_word_embeddings": false, "use_sliding_window": false,
    "vocab_size": 151936})";
  const std::string path = (std::filesystem::temp_directory_path() / "mt_hf_config.json").string();
  std::ofstream(path) << json;
  const Config hf = parse_config_string("[model]\nhf_config = \"" + path + "\"\n", {});
  const Config preset =
      load_config(std::string(MOETRAIN_SOURCE_DIR) + "/configs/qwen3-30b-a3b.toml", {});
  const ModelConfig &a = hf.model, &b = preset.model;
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.dim, b.dim);
  EXPECT_EQ(a.n_layers, b.n_layers);
  EXPECT_EQ(a.n_heads, b.n_heads);
  EXPECT_EQ(a.n_kv_heads, b.n_kv_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.n_experts, b.n_experts);
  EXPECT_EQ(a.top_k, b.top_k);
  EXPECT_EQ(a.moe_dim, b.moe_dim);
  EXPECT_EQ(a.rope_theta, b.rope_theta);
  EXPECT_EQ(a.rms_norm_eps, b.rms_norm_eps);
  EXPECT_EQ(a.norm_topk_prob, b.norm_topk_prob);
  EXPECT_EQ(a.tie_word_embeddings, b.tie_word_embeddings);
  // Dense layers are refused by name.
  std::ofstream(path) << R"({"vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "num_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 8, "mlp_only_layers": [1]})";
  EXPECT_NE(config_error("[model]\nhf_config = \"" + path + "\"\n").find("mlp_only_layers"),
            std::string::npos);
}

struct CliRun {
  int code;
  std::string err;
};
// env: "NAME=value ..." set for the command alone.
CliRun run_cli(const std::string& args, const std::string& env = "") {
  // One file per process: ctest runs the Cli tests in parallel processes.
  const std::string err_path =
      (std::filesystem::temp_directory_path() / ("mt_cli_err_" + std::to_string(getpid()) + ".txt"))
          .string();
  const std::string cmd =
      env + " " + std::string(MOETRAIN_BINARY) + " " + args + " >/dev/null 2>" + err_path;
  const int status = std::system(cmd.c_str());
  std::ifstream in(err_path);
  std::string err((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, err};
}

TEST(Cli, ConfigErrorsExitWithCode2AndOneLine) {
  const std::string tiny = std::string(MOETRAIN_SOURCE_DIR) + "/configs/tiny.toml";
  for (const std::string& args : {"train --config " + tiny + " --set model.colour=3",
                                  "train --config " + tiny + " --set model.n_kv_heads=3",
                                  "train --config " + tiny + " --set model.top_k=100",
                                  std::string("train --config /nonexistent.toml"),
                                  "train --config " + tiny + " --bogus-flag"}) {
    const CliRun r = run_cli(args);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << args << "\n" << r.err;
  }
  EXPECT_NE(run_cli("train --config " + tiny + " --set model.colour=3").err.find("model.colour"),
            std::string::npos);
}

// Issue 17's findings, each of which main accepted silently, crashed on or reported late: one
// line naming the value and exit code 2, before anything is allocated or trained.
TEST(Cli, HostileConfigsExitWithCode2NamingTheValue) {
  const std::string tiny = std::string(MOETRAIN_SOURCE_DIR) + "/configs/tiny.toml";
  const std::string t = "train --config " + tiny + " --set ";
  const std::pair<std::string, std::string> cases[] = {
      {t + "model.n_experts=4611686018427387904", "model.n_experts x model.dim"},  // segfaulted
      {t + "model.n_heads=4611686018427387904", "model.n_heads x model.head_dim"},
      {t + "model.vocab_size=2147483647", "weights, gradients and AdamW moments"},  // bad_alloc
      {t + "model.n_layers=1000000000", "model.n_layers x (experts"},
      {t + "train.seq_len=4611686018427387904", "tokens per micro-batch exceeds 2147483647"},
      {t + "train.batch_rows=4611686018427387904", "tokens per micro-batch exceeds 2147483647"},
      {t + "train.grad_accum=1099511627776", "exceeds 1048576 micro-batches per step"},
      {t + "model.routing=random", "model.routing = \"random\" (valid: learned, balanced, skewed)"},
      {t + "model.routing=skewed --set model.n_experts=4 --set model.top_k=4",
       "needs model.n_experts >= 8"},
      {t + "model.dense_recipe=fp8",
       "model.dense_recipe = \"fp8\" (valid: bf16, fp8_wgrad_with_hp)"},
      {t + "model.dense_recipe=fp8_wgrad_with_hp",  // tiny's dim 64
       "model.dim = 64 must be a multiple of 128 with model.dense_recipe = \"fp8_wgrad_with_hp\""},
      {t + "model.dense_recipe=fp8_wgrad_with_hp --set model.dim=128",  // heads 4 x 16
       "model.n_heads x model.head_dim = 64 must be a multiple of 128"},
      {t + "parallel.ep_exchange=nvshmem",
       "parallel.ep_exchange = \"nvshmem\" (valid: device, host)"},
      {t + "parallel.ep_exchange_ctas=0", "parallel.ep_exchange_ctas = 0 must be in [1, 1024]"},
      {t + "parallel.ep_chunks=0", "parallel.ep_chunks = 0 must be in [1, 16]"},
      {t + "parallel.ep_chunks=17", "parallel.ep_chunks = 17 must be in [1, 16]"},
      {t + "parallel.ep_overlap=2", "parallel.ep_overlap"},
      {t + "parallel.reshard_after_forward=never", "parallel.reshard_after_forward"},
      {t + "eval.every=-1", "eval.every = -1 must be >= 0"},
      {t + "model.router_dtype=f64", "model.router_dtype = \"f64\" (valid: f32, bf16)"},
      {t + "model.aux_loss_form=global",
       "model.aux_loss_form = \"global\" (valid: per_layer, transformers)"},
      {t + "data.shuffle=maybe", "data.shuffle"},
      // Issues 31 and 32's keys.
      {t + "data.packing=greedy", "data.packing = \"greedy\" (valid: whole, stream)"},
      {t + "data.packing=whole", "data.packing = \"whole\" needs token files"},
      {t + "data.pack_window=0", "data.pack_window = 0 must be >= 1"},
      {t + "data.overlong=split", "data.overlong = \"split\" (valid: truncate, drop, error)"},
      {t + "data.source=tokens --set 'data.mix=[{path=\"a.tok\", weight=0}]'",
       "data.mix[0].weight = 0 (the file 'a.tok') must be > 0"},
      {t + "data.source=tokens --set 'data.mix=[{path=\"a.tok\", share=1}]'",
       "unknown key data.mix[0].share (valid: path, weight)"},
      {t + "data.source=tokens --set data.mix=3", "data.mix must be a list"},
      {t + "data.source=tokens --set data.path=a.tok --set 'data.mix=[{path=\"b.tok\"}]'",
       "data.path = 'a.tok' and data.mix (1 files) both name the data"},
      {t + "'data.mix=[{path=\"a.tok\"}]'", "data.mix needs data.source"},
      {t + "checkpoint.keep=-1", "checkpoint.keep = -1 must be >= 0"},
      {t + "checkpoint.signal_deadline_s=-2", "checkpoint.signal_deadline_s = -2 must be >= 0"},
      {t + "checkpoint.async=sometimes", "checkpoint.async"},
      {t + "hardware.threads=100000", "hardware.threads = 100000"},          // aborted
      {t + "hardware.threads=4294967297", "hardware.threads = 4294967297"},  // became 1
      {t + "parallel.world=100000", "parallel.world = 100000"},              // aborted
      {t + "train.eps=nan", "train.eps = nan"},                              // trained on
      {t + "train.grad_clip=inf", "train.grad_clip = inf"},
      {t + "model.rms_norm_eps=nan", "model.rms_norm_eps = nan"},
      {t + "model.rope_theta=-inf", "model.rope_theta = -inf"},
      {t + "train.beta1=nan", "train.beta1 = nan"},
      {t + "train.weight_decay=-0.1", "train.weight_decay = -0.1"},
      {t + "train.seed=-1", "train.seed = -1"},
      {"train --config " + std::string(MOETRAIN_SOURCE_DIR) + "/configs", "is a directory"},
      {"train --config " + tiny + " --steps 0", "--steps"},  // ignored before
      {"train --config " + tiny + " --steps -5", "--steps"},
      // Issue 32: messages that name what is wrong, briefly.
      {"train --config " + tiny + " --steps abc", "--steps must be a positive integer"},
      {"trian --config " + tiny, "unknown command 'trian' (valid: train, launch, export-hf"},
      {"train --config " + tiny + " --set 'data.path=a\nb'", "--set data.path holds a control"},
      {"train --config " + tiny + " --set data.source=" + std::string(5000, 'x'),
       "... (5000 bytes)\" (valid: synthetic, tokens, sft)"},
  };
  for (const auto& [args, names] : cases) {
    const CliRun r = run_cli(args);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.err;
    EXPECT_NE(r.err.find(names), std::string::npos) << args << "\n" << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << args << "\n" << r.err;
  }
}

// The launch environment's numbers are checked: a port above 65535 became another port and a
// timeout of 1e10 s overflowed the deadline (issue 17).
TEST(Cli, LaunchEnvironmentOutOfRangeExitsWithCode2) {
  const std::string tiny = std::string(MOETRAIN_SOURCE_DIR) + "/configs/tiny.toml";
  const std::pair<std::string, std::string> cases[] = {
      {"WORLD_SIZE=2 RANK=0 MASTER_PORT=70000",
       "MASTER_PORT='70000' is not an integer in [0, 65535]"},
      {"WORLD_SIZE=1 RANK=0 MOETRAIN_TIMEOUT_S=1e10", "MOETRAIN_TIMEOUT_S='1e10'"},
      {"WORLD_SIZE=1 RANK=0 MOETRAIN_TIMEOUT_S=ten", "MOETRAIN_TIMEOUT_S='ten'"},
      {"WORLD_SIZE=99999999999 RANK=0", "WORLD_SIZE='99999999999'"},
  };
  for (const auto& [env, names] : cases) {
    const CliRun r = run_cli("train --config " + tiny + " --steps 1", env);
    EXPECT_EQ(r.code, 2) << env << "\n" << r.err;
    EXPECT_NE(r.err.find(names), std::string::npos) << env << "\n" << r.err;
  }
}

// An unusable checkpoint.dir stops the run before its first step (issue 17: it failed after the
// last one, losing the run).
TEST(Cli, UnwritableCheckpointDirStopsBeforeTraining) {
  const std::string tiny = std::string(MOETRAIN_SOURCE_DIR) + "/configs/tiny.toml";
  const std::string file = (std::filesystem::temp_directory_path() / "mt_ckpt_is_a_file").string();
  std::ofstream(file) << "x";
  for (const std::string& dir : {file, std::string("/proc/moetrain_ckpt")}) {
    const auto start = std::chrono::steady_clock::now();
    const CliRun r = run_cli("train --config " + tiny + " --set checkpoint.dir=" + dir);
    EXPECT_EQ(r.code, 2) << dir << "\n" << r.err;
    EXPECT_NE(r.err.find("checkpoint.dir = '" + dir + "'"), std::string::npos) << r.err;
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));  // not trained
  }
}

// A new run into a directory that holds checkpoints is refused without --resume or --overwrite
// (issue 17: it silently moved `latest` back and overwrote step files).
TEST(Cli, ANewRunDoesNotOverwriteCheckpointsUnlessAsked) {
  const std::string tiny = std::string(MOETRAIN_SOURCE_DIR) + "/configs/tiny.toml";
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("mt_existing_" + std::to_string(getpid())))
          .string();
  std::filesystem::remove_all(dir);
  const std::string run = "train --config " + tiny +
                          " --set train.seq_len=32 --set train.batch_rows=2"
                          " --set checkpoint.every=2 --set checkpoint.dir=" +
                          dir + " --steps 2";
  ASSERT_EQ(run_cli(run).code, 0);
  const CliRun again = run_cli(run);
  EXPECT_EQ(again.code, 2) << again.err;
  EXPECT_NE(again.err.find("already holds checkpoints (latest: step_00000002.safetensors)"),
            std::string::npos)
      << again.err;
  EXPECT_NE(again.err.find("--resume " + dir), std::string::npos) << again.err;
  EXPECT_EQ(run_cli(run + " --overwrite").code, 0);
  EXPECT_EQ(run_cli("train --config " + tiny +
                    " --set train.seq_len=32 --set train.batch_rows=2 --set checkpoint.every=2"
                    " --set checkpoint.dir=" +
                    dir + " --steps 4 --resume " + dir)
                .code,
            0);
  std::filesystem::remove_all(dir);
}

// A model whose parameters and AdamW state alone exceed the host stops before allocating, with
// the estimate and the settings that need less.
TEST(Cli, AModelLargerThanTheHostIsRefusedWithTheEstimate) {
  const std::string tiny = std::string(MOETRAIN_SOURCE_DIR) + "/configs/tiny.toml";
  const CliRun r =
      run_cli("train --config " + tiny +
              " --set hardware.device=cpu --set model.dim=4096 --set model.moe_dim=4096 "
              "--set model.n_experts=256 --set model.n_layers=8");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("weights, gradients and AdamW moments"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("model.n_layers"), std::string::npos) << r.err;
}

// A model that fits but whose activations do not (a long micro-batch with every activation
// kept) is refused the same way, naming the activations and the policy that keeps less.
TEST(Cli, ActivationsLargerThanTheHostAreRefusedWithTheEstimate) {
  const std::string tiny = std::string(MOETRAIN_SOURCE_DIR) + "/configs/tiny.toml";
  const CliRun r = run_cli("train --config " + tiny +
                           " --set hardware.device=cpu --set model.checkpoint=none"
                           " --set train.seq_len=1048576 --set train.batch_rows=64");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("activations of 67108864 tokens per micro-batch with model.checkpoint = "
                       "\"none\""),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("train.batch_rows"), std::string::npos) << r.err;
}

// Every [parallel] key lands in ParallelConfig (the model's config keeps none), and the mesh is
// checked once, by ParallelConfig::validate through dist::MeshShape, with messages naming the keys.
TEST(ParallelConfig, EveryParallelKeyIsItsAndTheMeshIsValidatedOnce) {
  const std::string tiny = std::string(MOETRAIN_SOURCE_DIR) + "/configs/tiny.toml";
  const Config c = load_config(
      tiny, {"parallel.ep_exchange=host", "parallel.ep_chunks=3", "parallel.ep_overlap=false",
             "parallel.reshard_after_forward=false", "parallel.ep_exchange_ctas=64",
             "parallel.ep_dispatch_dtype=mxfp8", "model.expert_recipe=mxfp8_wgrad_with_hp"});
  EXPECT_EQ(c.parallel.ep_exchange, moe::ExchangeMode::kHostCounts);
  EXPECT_EQ(c.parallel.ep_chunks, 3);
  EXPECT_FALSE(c.parallel.ep_overlap);
  EXPECT_EQ(c.parallel.reshard, fsdp::Reshard::kAfterBackward);
  EXPECT_EQ(c.parallel.ep_exchange_ctas, 64);
  EXPECT_EQ(c.parallel.ep_dispatch_dtype, RowWire::kMxfp8);
  // The model's own precision keeps bf16 dispatch; the run's plan takes the parallel key.
  EXPECT_EQ(c.model.expert_precision.dispatch, RowWire::kAsIs);
  EXPECT_EQ(plan_precision(c.model, c.parallel).experts.dispatch, RowWire::kMxfp8);

  const std::string world = testing::error_of([&] { load_config(tiny, {"parallel.ep=3"}); });
  EXPECT_NE(world.find("parallel.ep = 3 must divide parallel.world = 1"), std::string::npos)
      << world;
  const std::string experts = testing::error_of([&] {
    load_config(tiny, {"parallel.world=3", "parallel.ep=3"});
  });
  EXPECT_NE(experts.find("parallel.ep = 3 must divide model.n_experts = 8"), std::string::npos)
      << experts;
  // Context parallelism: cp divides the world, and the rows split into 2 cp equal chunks.
  EXPECT_EQ(load_config(tiny, {"parallel.world=4", "parallel.cp=2"}).parallel.dp(), 2);
  const std::string cp = testing::error_of([&] {
    load_config(tiny, {"parallel.world=4", "parallel.cp=3"});
  });
  EXPECT_NE(cp.find("parallel.cp = 3 must divide parallel.world = 4"), std::string::npos) << cp;
  const std::string big = testing::error_of([&] {
    load_config(tiny, {"parallel.world=2", "parallel.cp=4"});
  });
  EXPECT_NE(big.find("parallel.cp = 4 must be in [1, parallel.world = 2]"), std::string::npos)
      << big;
  const std::string row = testing::error_of([&] {
    load_config(tiny, {"parallel.world=4", "parallel.cp=4", "train.seq_len=20"});
  });
  EXPECT_NE(row.find("train.seq_len = 20 must be a multiple of 2 x parallel.cp = 8"),
            std::string::npos)
      << row;
  EXPECT_NE(row.find("nearest valid: 16 or 24"), std::string::npos) << row;
}

// The precision plan: MX copies of the expert weights under an MX recipe only, both passes' in
// the backward's gather with full checkpointing (its forward products rerun), else the input
// gradient's.
TEST(PrecisionPlan, CopiesFollowTheRecipeAndTheCheckpointPolicy) {
  ModelConfig m;
  ParallelConfig p;
  PrecisionPlan plan = plan_precision(m, p);
  EXPECT_FALSE(plan.expert_weight_copies);
  EXPECT_EQ(plan.copies_in_use(), 0);
  m.expert_precision.recipe = ops::ExpertRecipe::kMxfp8;
  plan = plan_precision(m, p);
  EXPECT_TRUE(plan.expert_weight_copies);
  EXPECT_EQ(plan.backward_copies, ops::CopyUse::kBackward);
  EXPECT_EQ(plan.copies_in_use(), 1);
  m.checkpoint = CheckpointPolicy::kFull;
  plan = plan_precision(m, p);
  EXPECT_EQ(plan.backward_copies, ops::CopyUse::kBoth);
  EXPECT_EQ(plan.copies_in_use(), 2);
  p.ep_dispatch_dtype = RowWire::kMxfp8;  // with mxfp8 it needs requant_dim1
  EXPECT_NE(testing::error_of([&] { plan_precision(m, p); }).find("model.requant_dim1"),
            std::string::npos);
  // The FP8 recipes keep their weights' FP8 tiles as the MX recipes keep their MX values.
  p.ep_dispatch_dtype = RowWire::kAsIs;
  m.checkpoint = CheckpointPolicy::kNone;
  for (const auto recipe : {ops::ExpertRecipe::kFp8Blockwise, ops::ExpertRecipe::kFp8WgradWithHp}) {
    m.expert_precision.recipe = recipe;
    plan = plan_precision(m, p);
    EXPECT_TRUE(plan.expert_weight_copies);
    EXPECT_EQ(plan.copies_in_use(), 1);
  }
}

// The memory estimate counts the expert exchange's window as the exchange sizes it
// (moe::ExpertExchange::window_bytes over the precision plan's wire), not by a formula of its own.
TEST(MemoryEstimate, TheDeviceExchangeCostsItsOwnWindow) {
  ModelConfig m;
  m.device = Device::kCUDA;  // the estimate is arithmetic: no GPU needed
  m.expert_precision.recipe = ops::ExpertRecipe::kMxfp8WgradWithHp;
  ParallelConfig p;
  p.world = 2;
  p.ep = 2;
  p.ep_dispatch_dtype = RowWire::kMxfp8;
  const int64_t tokens = 256;
  const MemoryEstimate device = estimate_memory(m, p, tokens);
  p.ep_exchange = moe::ExchangeMode::kHostCounts;
  const MemoryEstimate host = estimate_memory(m, p, tokens);
  const double window = static_cast<double>(moe::ExpertExchange::window_bytes(
      2, tokens, m.top_k, m.n_experts, m.dim, DType::kBF16, plan_precision(m, p).experts));
  EXPECT_GT(window, 0);
  EXPECT_DOUBLE_EQ(device.workspaces - host.workspaces, window);
  EXPECT_EQ(device.states, host.states);
  EXPECT_GT(device.activations, host.activations);  // ep times a balanced share of expert rows
}

// One GPU: an FP8 recipe's expert matrices hold their input gradient's 128 x 128 tiles (a byte a
// weight) in place of the bf16 compute copy (two), and the unit in use and the next their
// forward's; an MX recipe keeps only the copies of the unit in use and the next.
TEST(MemoryEstimate, OneGpuHoldsOneFp8TileLayoutInPlaceOfTheComputeCopy) {
  ModelConfig m;
  m.device = Device::kCUDA;
  m.dim = 1024;
  m.moe_dim = 512;
  m.n_layers = 8;
  const ParallelConfig p;
  const int64_t tokens = 2048;
  const MemoryEstimate bf16 = estimate_memory(m, p, tokens);
  m.expert_precision.recipe = ops::ExpertRecipe::kFp8WgradWithHp;
  const MemoryEstimate fp8 = estimate_memory(m, p, tokens);
  m.expert_precision.recipe = ops::ExpertRecipe::kMxfp8WgradWithHp;
  const MemoryEstimate mx = estimate_memory(m, p, tokens);
  // bf16: a compute copy of every expert matrix (2 bytes a weight); FP8: a byte a weight of every
  // layer's input-gradient tiles, and of two layers' forward tiles.
  const BlockParamCounts block = count_block_params(m);
  const double experts = static_cast<double>(m.n_experts * block.per_expert);
  EXPECT_DOUBLE_EQ(
      bf16.workspaces - fp8.workspaces,
      experts * (2.0 * static_cast<double>(m.n_layers) - static_cast<double>(m.n_layers + 2)));
  EXPECT_LT(mx.workspaces, bf16.workspaces);
  EXPECT_EQ(fp8.states, bf16.states);
}

// The LM head's buffers: one (chunk, vocab) buffer in the activation dtype (dlogits written over
// the logits); the FP8 dense recipe adds the head weight's two tile layouts (a byte a weight each)
// and one slice of dlogits' FP8 rows (kHeadFp8GradientRows rows, or the chunk where shorter), of
// which one chunk (its forward's tiles dropped before the slice is made) holds the larger two.
TEST(MemoryEstimate, TheHeadHoldsOneLogitsBufferAndTheFp8RecipeASliceOfItsRows) {
  ModelConfig m;
  m.device = Device::kCUDA;
  const ParallelConfig p;
  const int64_t tokens = 16384;
  const double v = static_cast<double>(m.vocab_size), table = v * static_cast<double>(m.dim);
  for (const int64_t chunk : {int64_t{0}, int64_t{8192}, int64_t{1024}}) {
    SCOPED_TRACE(::testing::Message() << "loss_chunk_tokens " << chunk);
    m.loss_chunk_tokens = chunk;
    m.dense_recipe = DenseRecipe::kBf16;
    const MemoryEstimate bf16 = estimate_memory(m, p, tokens);
    m.loss_chunk_tokens = 1;
    const MemoryEstimate one_row = estimate_memory(m, p, tokens);
    const double rows = chunk > 0 ? static_cast<double>(chunk) : static_cast<double>(tokens);
    EXPECT_DOUBLE_EQ(bf16.activations - one_row.activations, (rows - 1) * v * 2);
    m.loss_chunk_tokens = chunk;
    m.dense_recipe = DenseRecipe::kFp8WgradWithHp;
    const MemoryEstimate fp8 = estimate_memory(m, p, tokens);
    const double slice = std::min(rows, static_cast<double>(kHeadFp8GradientRows)) * v * 1.03125;
    EXPECT_DOUBLE_EQ(fp8.workspaces - bf16.workspaces,
                     chunk == 0 ? table + std::max(table, slice) : 2 * table + slice);
    EXPECT_EQ(fp8.activations, bf16.activations);
  }
}

// Context parallelism: a rank's activations are its tokens' (a cp-th of the rows'), plus the
// rows' gathered keys and values and their gradients; its exchange window is its tokens'.
TEST(MemoryEstimate, ContextParallelRanksHoldTheirShareOfTheRows) {
  ModelConfig m;
  m.device = Device::kCUDA;
  ParallelConfig p;
  p.world = 4;
  p.ep = 2;
  const int64_t tokens = 4096;
  const MemoryEstimate whole = estimate_memory(m, p, tokens);
  p.cp = 2;
  const MemoryEstimate half = estimate_memory(m, p, tokens);
  const double kv = 5.0 * static_cast<double>(tokens * m.kv_dim() * 2);  // bf16
  EXPECT_DOUBLE_EQ(half.activations, activation_bytes(m, tokens / 2, 2.0) + kv);
  EXPECT_LT(half.activations, whole.activations);
  EXPECT_EQ(half.states, whole.states);
  EXPECT_DOUBLE_EQ(
      whole.workspaces - half.workspaces,
      static_cast<double>(
          moe::ExpertExchange::window_bytes(2, tokens, m.top_k, m.n_experts, m.dim, DType::kBF16,
                                            plan_precision(m, p).experts) -
          moe::ExpertExchange::window_bytes(2, tokens / 2, m.top_k, m.n_experts, m.dim,
                                            DType::kBF16, plan_precision(m, p).experts)));
}

}  // namespace
}  // namespace mt
