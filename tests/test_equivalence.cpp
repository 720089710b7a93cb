// Any (world, ep, cp) on in-process ranks reproduces one rank holding the global batch: the loss,
// every gradient and, after three steps, every parameter (bf16 and MX recipes, whole packing,
// context parallelism).
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "core/rng.h"
#include "dist/communicator.h"
#include "dist/mesh.h"
#include "dist_training.h"
#include "fsdp/fsdp.h"
#include "moe/exchange/expert_exchange.h"
#include "moe/moe_layer.h"
#include "ops/elementwise.h"
#include "ops/mx.h"
#include "processes.h"
#include "testing.h"
#include "train/checkpoint.h"
#include "train/data_loader.h"
#include "train/token_file.h"
#include "train/trainer.h"

namespace mt {
namespace {

using dist::Communicator;
using dist::run_in_process;

// (W, ep) against one rank holding the whole batch, with each routing: the router's (learned),
// the benchmarks' fixed patterns, and every token on experts 0 and 1 (concentrate_routing); with
// ep > 1 also with the layer's tokens in chunks, each with its own exchange.
struct EquivalenceCase {
  int world, ep;
  const char* routing = "learned";  // model.routing, or "concentrated"
  const char* exchange = "device";  // parallel.ep_exchange
  int chunks = 1;                   // parallel.ep_chunks
};
class Equivalence : public ::testing::TestWithParam<EquivalenceCase> {};

TEST_P(Equivalence, OneStepLossAndGradientsThenThreeStepsParameters) {
  const auto [world, ep, routing, exchange, chunks] = GetParam();
  const bool concentrated = std::string(routing) == "concentrated";
  std::vector<std::string> sets = {
      std::string("model.routing=") + (concentrated ? "learned" : routing),
      std::string("parallel.ep_exchange=") + exchange,
      "parallel.ep_chunks=" + std::to_string(chunks)};
  // The fixed patterns run over each rank's token positions: skewed's cold round-robin has period
  // 6 (E = 8: 6 cold experts), so micro-batches of a multiple of 6 tokens route as the whole
  // batch does.
  if (std::string(routing) == "skewed") sets.push_back("train.seq_len=24");
  const std::function<void(Trainer&)> prepare =
      concentrated ? std::function<void(Trainer&)>(concentrate_routing) : nullptr;
  const Snapshot ref1 = train(0, 1, 1, sets, prepare), got1 = train(world, ep, 1, sets, prepare);
  EXPECT_NEAR(got1.metrics[0].loss, ref1.metrics[0].loss, 1e-10 * ref1.metrics[0].loss);
  EXPECT_NEAR(got1.metrics[0].aux_loss, ref1.metrics[0].aux_loss, 1e-10 * ref1.metrics[0].aux_loss);
  EXPECT_NEAR(got1.metrics[0].grad_norm, ref1.metrics[0].grad_norm,
              1e-10 * ref1.metrics[0].grad_norm);
  expect_same(got1.grads, ref1.grads, 1e-10, "gradient");
  // Time in dispatch/combine is reported exactly when experts are split over ranks.
  if (ep > 1)
    EXPECT_GT(got1.metrics[0].exchange_ms, 0.0);
  else
    EXPECT_EQ(got1.metrics[0].exchange_ms, 0.0);
  // On CPU ranks every exchange is waited for: all of it is exposed.
  EXPECT_EQ(got1.metrics[0].exchange_exposed_ms, got1.metrics[0].exchange_ms);
  EXPECT_EQ(ref1.metrics[0].exchange_ms, 0.0);
  if (concentrated)  // experts 2..7 had no rows: their gradients are zero, the others' not
    for (int64_t e = 0; e < 8; ++e) {
      const Tensor& g = ref1.grads.at("layers.0.moe.w_down");
      const int64_t per = g.numel() / 8;
      double sum = 0;
      for (int64_t i = e * per; i < (e + 1) * per; ++i) sum += std::abs(g.item(i));
      EXPECT_EQ(sum == 0.0, e >= 2) << "expert " << e;
    }
  const Snapshot ref3 = train(0, 1, 3, sets, prepare), got3 = train(world, ep, 3, sets, prepare);
  for (int s = 0; s < 3; ++s)
    EXPECT_NEAR(got3.metrics[s].loss, ref3.metrics[s].loss, 1e-10 * ref3.metrics[s].loss);
  expect_same(got3.params, ref3.params, 1e-10, "parameter");
}

// Context parallelism: (W, cp, ep) against one rank holding the global batch. Rows of 16 tokens
// in 2 cp chunks (cp = 4: chunks of 2) under documents of 4 to 12 tokens, so documents cross
// chunk and rank boundaries; the experts borrowed from the whole mesh (ep across CP ranks too).
struct CpCase {
  int world, cp, ep;
  const char* checkpoint = "none";  // model.checkpoint: the attention's K/V gathered again
};
class EquivalenceCp : public ::testing::TestWithParam<CpCase> {};

TEST_P(EquivalenceCp, OneStepLossAndGradientsThenThreeStepsParameters) {
  const CpCase k = GetParam();
  const std::vector<std::string> sets = {std::string("model.checkpoint=") + k.checkpoint};
  std::vector<std::string> mesh_sets = sets;
  mesh_sets.push_back("parallel.cp=" + std::to_string(k.cp));
  const Snapshot ref1 = train(0, 1, 1, sets), got1 = train(k.world, k.ep, 1, mesh_sets);
  EXPECT_NEAR(got1.metrics[0].loss, ref1.metrics[0].loss, 1e-10 * ref1.metrics[0].loss);
  EXPECT_NEAR(got1.metrics[0].aux_loss, ref1.metrics[0].aux_loss, 1e-10 * ref1.metrics[0].aux_loss);
  EXPECT_NEAR(got1.metrics[0].grad_norm, ref1.metrics[0].grad_norm,
              1e-10 * ref1.metrics[0].grad_norm);
  EXPECT_EQ(got1.metrics[0].expert_load_max_over_mean, ref1.metrics[0].expert_load_max_over_mean);
  expect_same(got1.grads, ref1.grads, 1e-10, "gradient");
  const Snapshot ref3 = train(0, 1, 3, sets), got3 = train(k.world, k.ep, 3, mesh_sets);
  for (int s = 0; s < 3; ++s)
    EXPECT_NEAR(got3.metrics[s].loss, ref3.metrics[s].loss, 1e-10 * ref3.metrics[s].loss);
  expect_same(got3.params, ref3.params, 1e-10, "parameter");
}

INSTANTIATE_TEST_SUITE_P(WorldCpEp, EquivalenceCp,
                         ::testing::Values(CpCase{2, 2, 1}, CpCase{4, 2, 1}, CpCase{4, 2, 2},
                                           CpCase{4, 4, 1}, CpCase{4, 4, 4},
                                           CpCase{4, 2, 4, "selective"}, CpCase{2, 2, 2, "full"}),
                         [](const auto& info) {
                           return "W" + std::to_string(info.param.world) + "_cp" +
                                  std::to_string(info.param.cp) + "_ep" +
                                  std::to_string(info.param.ep) + "_" + info.param.checkpoint;
                         });

// Whole packing of an SFT file (documents of 2 to 20 tokens in rows of 17: some fill a row, some
// are truncated, the rest padded) with a blend of two files: any (W, ep) gives the single rank's
// loss, gradients, routing statistics and, after three steps, parameters; the padding is reported.
TEST(EquivalenceWhole, SftBlendMatchesOneRank) {
  std::vector<std::string> paths;
  for (int f = 0; f < 2; ++f) {
    TokenDocuments docs;
    docs.doc_offsets = {0};
    const CounterRng rng{static_cast<uint64_t>(f), 12};
    for (int d = 0; d < 30; ++d) {
      const int64_t len = 2 + rng.below(d, 19);
      for (int64_t i = 0; i < len; ++i) {
        docs.tokens.push_back(rng.below(100 * d + i + 50, 32));
        docs.loss_mask.push_back(i % 3 != 0);
      }
      docs.doc_offsets.push_back(docs.tokens.size());
    }
    paths.push_back(testing::unique_temp_path("whole_equiv_" + std::to_string(f) + ".tok"));
    write_token_file(paths.back(), docs);
  }
  const std::vector<std::string> sets = {
      "data.source=sft",
      "data.mix=[{path=\"" + paths[0] + "\", weight=2}, {path=\"" + paths[1] + "\", weight=1}]",
      "data.pack_window=6"};
  // (W, ep, cp): the context-parallel ones with padding and SFT masks in the chunks.
  for (const auto& [world, ep, cp] :
       {std::tuple{2, 1, 1}, std::tuple{2, 2, 1}, std::tuple{4, 2, 1}, std::tuple{2, 1, 2},
        std::tuple{4, 2, 2}, std::tuple{4, 4, 4}}) {
    SCOPED_TRACE(fmt::format("world {} ep {} cp {}", world, ep, cp));
    std::vector<std::string> mesh_sets = sets;
    mesh_sets.push_back("parallel.cp=" + std::to_string(cp));
    const Snapshot ref1 = train(0, 1, 1, sets), got1 = train(world, ep, 1, mesh_sets);
    const StepMetrics &r = ref1.metrics[0], &g = got1.metrics[0];
    EXPECT_NEAR(g.loss, r.loss, 1e-10 * r.loss);
    EXPECT_NEAR(g.aux_loss, r.aux_loss, 1e-10 * r.aux_loss);
    EXPECT_GT(r.pad_fraction, 0.0);
    EXPECT_EQ(g.pad_fraction, r.pad_fraction);
    EXPECT_EQ(g.expert_load_max_over_mean, r.expert_load_max_over_mean);
    EXPECT_EQ(g.idle_expert_fraction, r.idle_expert_fraction);
    ASSERT_EQ(r.expert_load_max_over_mean.size(), 2u);
    EXPECT_GE(r.expert_load_max_over_mean[0], 1.0);
    expect_same(got1.grads, ref1.grads, 1e-10, "gradient");
    const Snapshot ref3 = train(0, 1, 3, sets), got3 = train(world, ep, 3, mesh_sets);
    expect_same(got3.params, ref3.params, 1e-10, "parameter");
  }
  for (const std::string& p : paths) std::filesystem::remove(p);
}

// MX and FP8 blockwise expert recipes: every quantization that runs along a row (the forward's
// and input gradient's operands) sees the same rows however the batch is split, and a weight's
// tiles are the same on every rank, so mxfp8_wgrad_with_hp and fp8_wgrad_with_hp are equivalent
// at every (W, ep). mxfp8 and fp8_blockwise also block each expert's rows along the tokens for
// the weight gradient: with W = ep an expert receives the batch's rows for it in the single
// rank's order, so the blocks are the same; with W > ep each rank of an EP group blocks its own
// rows (as torchao's per-rank grouped GEMM does) and the single-rank run is not the reference.
struct MxCase {
  int world, ep;
  const char* recipe;
  // parallel.ep_dispatch_dtype (mxfp8 with mxfp8, fp8_blockwise with fp8_blockwise: requant_dim1)
  const char* dispatch = "bf16";
  int chunks = 1;  // parallel.ep_chunks (not with mxfp8: each chunk blocks its own rows)
  // model.checkpoint: a recomputing fill permutes the exchange's rows (or FP8 rows) again
  const char* checkpoint = "none";
};
class EquivalenceMx : public ::testing::TestWithParam<MxCase> {};

TEST_P(EquivalenceMx, OneStepGradientsThenThreeStepsParameters) {
  const MxCase m = GetParam();
  // The recipe's blocks run along both expert dims: 32 for MX, 128 for FP8 blockwise.
  const bool fp8 = std::string(m.recipe).rfind("fp8", 0) == 0;
  const std::vector<std::string> dims =
      fp8 ? std::vector<std::string>{"model.dim=128", "model.moe_dim=128"}
          : std::vector<std::string>{"model.dim=32", "model.moe_dim=32"};
  std::vector<std::string> mx = {dims[0],
                                 dims[1],
                                 std::string("model.expert_recipe=") + m.recipe,
                                 std::string("parallel.ep_dispatch_dtype=") + m.dispatch,
                                 "parallel.ep_chunks=" + std::to_string(m.chunks),
                                 std::string("model.checkpoint=") + m.checkpoint};
  if (std::string(m.dispatch) == m.recipe) mx.push_back("model.requant_dim1=true");
  const Snapshot ref1 = train(0, 1, 1, mx), got1 = train(m.world, m.ep, 1, mx);
  EXPECT_NEAR(got1.metrics[0].loss, ref1.metrics[0].loss, 1e-10 * ref1.metrics[0].loss);
  expect_same(got1.grads, ref1.grads, 1e-10, "gradient");
  const Snapshot ref3 = train(0, 1, 3, mx), got3 = train(m.world, m.ep, 3, mx);
  expect_same(got3.params, ref3.params, 1e-10, "parameter");
  // Not the bf16 run: the recipe changed the gradients.
  const Snapshot plain = train(0, 1, 1, dims);
  EXPECT_GT(
      relative_error(ref1.grads.at("layers.0.moe.w_down"), plain.grads.at("layers.0.moe.w_down")),
      1e-4);
  // A quantized wire is in use: the experts' weight gradients read what it delivered (mxfp8's
  // re-quantization along the tokens gives back its original blocks here, so not with mxfp8).
  if (std::string(m.dispatch) != "bf16" && std::string(m.recipe) != "mxfp8") {
    std::vector<std::string> bf16_wire = mx;
    bf16_wire[3] = "parallel.ep_dispatch_dtype=bf16";
    if (bf16_wire.back() == "model.requant_dim1=true") bf16_wire.pop_back();
    const Snapshot wire = train(0, 1, 1, bf16_wire);
    EXPECT_GT(relative_error(ref1.grads.at("layers.0.moe.w_gate_up"),
                             wire.grads.at("layers.0.moe.w_gate_up")),
              1e-4);
  }
}

// model.dense_recipe in FP8: the attention projections' operands are quantized along each
// token's row and each weight in whole tiles, so every (W, ep) gives the single rank's gradients.
TEST(EquivalenceDenseFp8, OneStepGradientsMatchOneRank) {
  const std::vector<std::string> dims = {"model.dim=128", "model.moe_dim=128",
                                         "model.head_dim=128", "model.vocab_size=128"};
  std::vector<std::string> fp8 = dims;
  fp8.push_back("model.dense_recipe=fp8_wgrad_with_hp");
  const Snapshot ref = train(0, 1, 1, fp8);
  for (const auto& [world, ep] : {std::pair{2, 1}, std::pair{4, 2}}) {
    SCOPED_TRACE("W " + std::to_string(world) + ", ep " + std::to_string(ep));
    const Snapshot got = train(world, ep, 1, fp8);
    EXPECT_NEAR(got.metrics[0].loss, ref.metrics[0].loss, 1e-10 * ref.metrics[0].loss);
    expect_same(got.grads, ref.grads, 1e-10, "gradient");
  }
  // Not the bf16 run: the recipe changed the attention's and the head's gradients.
  const Snapshot plain = train(0, 1, 1, dims);
  for (const char* name : {"layers.0.attn.wq", "layers.1.attn.wo", "head.out"})
    EXPECT_GT(relative_error(ref.grads.at(name), plain.grads.at(name)), 1e-4) << name;
}

INSTANTIATE_TEST_SUITE_P(
    WorldEpRecipe, EquivalenceMx,
    ::testing::Values(
        MxCase{2, 1, "mxfp8_wgrad_with_hp"}, MxCase{4, 2, "mxfp8_wgrad_with_hp"},
        MxCase{4, 4, "mxfp8_wgrad_with_hp"}, MxCase{2, 2, "mxfp8"}, MxCase{4, 4, "mxfp8"},
        MxCase{4, 2, "mxfp8_wgrad_with_hp", "mxfp8"}, MxCase{2, 2, "mxfp8", "mxfp8"},
        MxCase{4, 2, "mxfp8_wgrad_with_hp", "mxfp8", 3}, MxCase{2, 1, "fp8_wgrad_with_hp"},
        MxCase{4, 2, "fp8_wgrad_with_hp", "bf16", 3}, MxCase{2, 2, "fp8_blockwise"},
        MxCase{4, 4, "fp8_blockwise"}, MxCase{4, 2, "fp8_wgrad_with_hp", "fp8_blockwise"},
        MxCase{2, 2, "fp8_blockwise", "fp8_blockwise"},
        MxCase{4, 2, "fp8_wgrad_with_hp", "fp8_blockwise", 3},
        MxCase{2, 2, "fp8_blockwise", "fp8_blockwise", 1, "full"},
        MxCase{4, 2, "fp8_wgrad_with_hp", "fp8_blockwise", 1, "selective"}),
    [](const auto& info) {
      return "W" + std::to_string(info.param.world) + "_ep" + std::to_string(info.param.ep) + "_" +
             info.param.recipe + "_dispatch_" + info.param.dispatch +
             (info.param.chunks > 1 ? "_chunks" + std::to_string(info.param.chunks) : "") +
             (std::string(info.param.checkpoint) != "none"
                  ? std::string("_") + info.param.checkpoint
                  : std::string());
    });

INSTANTIATE_TEST_SUITE_P(
    WorldEpRouting, Equivalence,
    ::testing::Values(
        EquivalenceCase{1, 1}, EquivalenceCase{2, 1}, EquivalenceCase{2, 2}, EquivalenceCase{4, 2},
        EquivalenceCase{4, 4}, EquivalenceCase{2, 2, "skewed"}, EquivalenceCase{4, 4, "skewed"},
        EquivalenceCase{4, 2, "balanced"}, EquivalenceCase{2, 2, "concentrated"},
        EquivalenceCase{4, 4, "concentrated"}, EquivalenceCase{2, 2, "learned", "host"},
        EquivalenceCase{4, 2, "skewed", "host"}, EquivalenceCase{4, 4, "concentrated", "host"},
        EquivalenceCase{2, 2, "learned", "device", 2}, EquivalenceCase{4, 2, "skewed", "device", 3},
        EquivalenceCase{4, 4, "concentrated", "device", 3},
        EquivalenceCase{2, 2, "balanced", "host", 2}),
    [](const auto& info) {
      return "W" + std::to_string(info.param.world) + "_ep" + std::to_string(info.param.ep) + "_" +
             info.param.routing + "_" + info.param.exchange +
             (info.param.chunks > 1 ? "_chunks" + std::to_string(info.param.chunks) : "");
    });

}  // namespace
}  // namespace mt
