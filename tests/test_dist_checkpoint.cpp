// Checkpoints of sharded runs: a resume repeats the run bit for bit, another (world, ep)
// reshards every tensor, and rank files that disagree stop every rank.
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

TEST(DistCheckpoint, ShardedResumeIsBitIdenticalAndAnotherEpIsResharded) {
  const std::string dir = (std::filesystem::temp_directory_path() / "mt_dist_ckpt").string();
  std::filesystem::remove_all(dir);
  std::vector<std::string> sets = small_model(2);
  sets.push_back("parallel.world=4");
  sets.push_back("parallel.ep=2");
  sets.push_back("train.steps=4");
  sets.push_back("checkpoint.dir=\"" + dir + "\"");
  sets.push_back("checkpoint.every=2");
  const Config c = parse_config_string("", sets);
  Snapshot straight, resumed;
  std::mutex mu;
  run_in_process(4, [&](Communicator& comm) {
    Trainer t(c, &comm);
    t.run({});
    collect(t.model(), 8, straight, mu);
  });
  run_in_process(4, [&](Communicator& comm) {
    Trainer t(c, &comm);
    RunOptions o;
    o.resume = dir + "/step_00000002";
    t.run(o);
    collect(t.model(), 8, resumed, mu);
  });
  expect_same(resumed.params, straight.params, 0.0, "parameter");  // bit-identical

  // Another ep: the checkpoint is resharded, and the run goes on to the same parameters (to the
  // rounding of the other summation order, as the equivalence suite).
  sets.push_back("parallel.ep=4");
  const Config other = parse_config_string("", sets);
  Snapshot resharded;
  run_in_process(4, [&](Communicator& comm) {
    Trainer t(other, &comm);
    RunOptions o;
    o.resume = dir + "/step_00000002";
    o.existing = ExistingCheckpoints::kOverwrite;
    t.run(o);
    collect(t.model(), 8, resharded, mu);
  });
  expect_same(resharded.params, straight.params, 1e-10, "parameter after resharding");
}

// Context parallelism: a run at (W 4, cp 2, ep 2) resumed from its step-2 checkpoint at the same
// mesh repeats itself bit for bit; resumed at (W 2, cp 1) and (W 4, cp 4, ep 4), the same global
// batches (dp x rows), it reaches the same parameters to the rounding of another summation order.
TEST(DistCheckpoint, ContextParallelRunsResumeAtAnyCp) {
  const std::string dir = testing::unique_temp_path("cp_ckpt");
  auto config = [&](int world, int cp, int ep) {
    const int dp = world / cp;
    std::vector<std::string> sets = small_model(4 / dp);  // 4 rows per micro-batch in all
    sets.push_back("parallel.world=" + std::to_string(world));
    sets.push_back("parallel.cp=" + std::to_string(cp));
    sets.push_back("parallel.ep=" + std::to_string(ep));
    sets.push_back("train.steps=4");
    sets.push_back("checkpoint.dir=\"" + dir + "\"");
    sets.push_back("checkpoint.every=2");
    return parse_config_string("", sets);
  };
  std::mutex mu;
  auto run = [&](int world, int cp, int ep, bool resume) {
    Snapshot snap;
    const Config c = config(world, cp, ep);
    run_in_process(world, [&](Communicator& comm) {
      Trainer t(c, &comm);
      RunOptions o;
      if (resume) {
        o.resume = dir + "/step_00000002";
        o.existing = ExistingCheckpoints::kOverwrite;
      }
      const auto m = t.run(o);
      collect(t.model(), 8, snap, mu);
      if (comm.rank() == 0) snap.metrics = m;
    });
    return snap;
  };
  const Snapshot straight = run(4, 2, 2, false);
  ASSERT_EQ(straight.metrics.size(), 4u);
  const Snapshot same = run(4, 2, 2, true);
  ASSERT_EQ(same.metrics.size(), 2u);
  EXPECT_EQ(same.metrics.back().loss, straight.metrics.back().loss);
  expect_same(same.params, straight.params, 0.0, "parameter");  // bit-identical
  for (const auto& [world, cp, ep] : {std::tuple{2, 1, 2}, std::tuple{4, 4, 4}}) {
    SCOPED_TRACE(fmt::format("resumed at world {} cp {} ep {}", world, cp, ep));
    const Snapshot other = run(world, cp, ep, true);
    EXPECT_NEAR(other.metrics.back().loss, straight.metrics.back().loss,
                1e-10 * straight.metrics.back().loss);
    expect_same(other.params, straight.params, 1e-10, "parameter");
  }
  std::filesystem::remove_all(dir);
}

// Rank files that disagree (two steps in one directory, or rank 0's file copied as rank 1's)
// stop every rank at load with the same error, before any collective of training (issue 17:
// rank 0 finished and rank 1 waited 300 s).
// Resharding: a checkpoint written at (1, 1) resumes at (4, 2), whose checkpoint resumes at
// (2, 2), whose checkpoint resumes at (1, 1): the last file holds every parameter, moment and
// router bias of the first bit for bit, with its step, data position and run.
TEST(DistCheckpoint, ReshardingOverWorldsAndEpKeepsEveryTensor) {
  namespace fs = std::filesystem;
  const std::string root = testing::unique_temp_path("reshard");
  auto config = [&](int world, int ep, const std::string& dir) {
    std::vector<std::string> sets = small_model(8 / world);
    sets.push_back("train.steps=2");
    sets.push_back("checkpoint.every=2");
    sets.push_back("checkpoint.dir=\"" + dir + "\"");
    sets.push_back("parallel.world=" + std::to_string(world));
    sets.push_back("parallel.ep=" + std::to_string(ep));
    return parse_config_string("", sets);
  };
  const std::string first = root + "/w1";
  Trainer(config(1, 1, first)).run({});
  std::string from = first;
  for (const auto& [world, ep] : {std::pair{4, 2}, std::pair{2, 2}}) {
    const std::string to = root + "/w" + std::to_string(world) + "ep" + std::to_string(ep);
    run_in_process(world, [&](Communicator& comm) {
      Trainer t(config(world, ep, to), &comm);
      t.resume(from);
      EXPECT_EQ(t.step(), 2);
      t.save(to);
    });
    from = to;
  }
  const std::string last = root + "/back";
  Trainer t(config(1, 1, last));
  t.resume(from);
  const std::string written = t.save(last);
  const SafetensorsFile a = read_safetensors(first + "/step_00000002.safetensors");
  const SafetensorsFile b = read_safetensors(written);
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (const auto& [name, ta] : a.tensors) {
    ASSERT_TRUE(b.tensors.count(name)) << name;
    const Tensor& tb = b.tensors.at(name);
    ASSERT_EQ(ta.nbytes(), tb.nbytes()) << name;
    EXPECT_EQ(std::memcmp(ta.raw(), tb.raw(), ta.nbytes()), 0) << name;
  }
  for (const char* key : {"step", "data_position", "run_id"})
    EXPECT_EQ(a.metadata.at(key), b.metadata.at(key)) << key;
  fs::remove_all(root);
}

TEST(DistCheckpoint, RankFilesThatDisagreeStopEveryRank) {
  namespace fs = std::filesystem;
  const std::string dir = (fs::temp_directory_path() / "mt_dist_mixed").string();
  fs::remove_all(dir);
  std::vector<std::string> sets = small_model(2);
  sets.push_back("parallel.world=2");
  sets.push_back("train.steps=4");
  sets.push_back("checkpoint.dir=\"" + dir + "\"");
  sets.push_back("checkpoint.every=2");
  const Config c = parse_config_string("", sets);
  run_in_process(2, [&](Communicator& comm) { Trainer(c, &comm).run({}); });
  const fs::path two = fs::path(dir) / "step_00000002", four = fs::path(dir) / "step_00000004";
  auto resume_fails_on_every_rank = [&](const std::string& names) {
    std::atomic<int> refused{0};
    try {
      run_in_process(2, [&](Communicator& comm) {
        Trainer t(c, &comm);
        RunOptions o;
        o.resume = two.string();
        try {
          t.run(o);
        } catch (const CheckpointError& e) {
          EXPECT_NE(std::string(e.what()).find(names), std::string::npos) << e.what();
          ++refused;
          throw;
        }
      });
    } catch (const CheckpointError&) {
    }
    EXPECT_EQ(refused.load(), 2) << names;
  };
  fs::copy_file(four / "rank_1.safetensors", two / "rank_1.safetensors",
                fs::copy_options::overwrite_existing);
  resume_fails_on_every_rank("different steps: rank 0's is step 2, rank 1's step 4");
  fs::copy_file(two / "rank_0.safetensors", two / "rank_1.safetensors",
                fs::copy_options::overwrite_existing);
  resume_fails_on_every_rank("rank 1 read a file written by rank 0");
  // The same step and rank from another run (same config, its own run id).
  const std::string other_dir = dir + "_other";
  fs::remove_all(other_dir);
  std::vector<std::string> other_sets = sets;
  other_sets.push_back("checkpoint.dir=\"" + other_dir + "\"");
  const Config other = parse_config_string("", other_sets);
  run_in_process(2, [&](Communicator& comm) { Trainer(other, &comm).run({}); });
  fs::copy_file(fs::path(other_dir) / "step_00000002" / "rank_1.safetensors",
                two / "rank_1.safetensors", fs::copy_options::overwrite_existing);
  resume_fails_on_every_rank("the ranks' files are from different runs");
  fs::remove_all(other_dir);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace mt
