// Nothing lost: a signal stops a run at a step boundary with a checkpoint (exit 7) from which it
// resumes bit for bit, on one process and on launched ranks; a second signal stops it at once;
// and a chaos run, killed again and again (SIGKILL or SIGTERM, a rank or the launcher, at seeded
// random moments) and resumed each time, ends with the uninterrupted run's weights.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <thread>

#include "core/rng.h"
#include "processes.h"
#include "train/checkpoint.h"
#include "train/safetensors.h"
#include "train/token_file.h"

namespace mt {
namespace {

namespace fs = std::filesystem;

// The tiny preset at 256 tokens a step (about 25 ms on two cores), checkpointing every 4 steps;
// launched ranks take one thread each.
std::string small_run(const std::string& dir, int steps, int ranks) {
  std::string cmd = testing::moetrain_binary();
  if (ranks > 1) cmd += fmt::format(" launch -n {} --", ranks);
  return cmd + fmt::format(
                   " train --config {}/configs/tiny.toml --set train.seq_len=64"
                   " --set train.batch_rows={} --set train.steps={} --set train.log_every=1"
                   " --set hardware.device=cpu --set hardware.threads={} --set checkpoint.every=4"
                   " --set checkpoint.dir={}/ckpt --metrics {}/m.jsonl",
                   testing::source_dir(), 4 / ranks, steps, ranks > 1 ? 1 : 0, dir, dir);
}

int lines_of(const std::string& path) {
  std::ifstream in(path);
  int n = 0;
  for (std::string line; std::getline(in, line);) n += !line.empty();
  return n;
}

// The step `latest` names in a checkpoint directory (-1: none).
int64_t latest_step(const std::string& dir) {
  const std::optional<std::string> latest = latest_checkpoint(dir);
  if (!latest || latest->empty()) return -1;
  return std::stoll(latest->substr(5, 8));  // step_NNNNNNNN[.safetensors]
}

// Every tensor of the checkpoint at `step` (one file, or one per rank), bit for bit.
void expect_same_checkpoint(const std::string& a, const std::string& b, int64_t step, int ranks) {
  for (int r = 0; r < ranks; ++r) {
    const std::string name = ranks == 1 ? fmt::format("step_{:08d}.safetensors", step)
                                        : fmt::format("step_{:08d}/rank_{}.safetensors", step, r);
    const SafetensorsFile x = read_safetensors(a + "/" + name),
                          y = read_safetensors(b + "/" + name);
    ASSERT_EQ(x.tensors.size(), y.tensors.size()) << name;
    for (const auto& [tensor, t] : x.tensors) {
      ASSERT_TRUE(y.tensors.count(tensor)) << tensor;
      const Tensor& u = y.tensors.at(tensor);
      ASSERT_EQ(t.nbytes(), u.nbytes()) << tensor;
      EXPECT_EQ(std::memcmp(t.raw(), u.raw(), t.nbytes()), 0) << name << " " << tensor;
    }
  }
}

std::string fresh(const std::string& stem) {
  const std::string dir = testing::unique_temp_path(stem);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// Waits (up to 60 s) until the metrics file holds `n` lines.
bool wait_for_lines(const std::string& path, int n) {
  for (int i = 0; i < 600; ++i) {
    if (lines_of(path) >= n) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return false;
}

// SIGTERM to a training process: it finishes the step in flight, writes a checkpoint of it and
// exits 7 saying where; resumed from there it ends with the weights of the run never stopped, on
// one process and on two launched ranks (the signal to the launcher, and to one rank alone).
TEST(Preemption, SigtermSavesTheStepAndResumesBitForBit) {
  constexpr int kSteps = 40;
  for (const auto& [ranks, target] :
       {std::pair{1, "process"}, std::pair{2, "launcher"}, std::pair{2, "rank 1"}}) {
    SCOPED_TRACE(fmt::format("{} rank(s), signal to the {}", ranks, target));
    const std::string straight = fresh("straight"), stopped = fresh("stopped");
    ASSERT_EQ(testing::run_cmd(small_run(straight, kSteps, ranks)).code, 0);
    const pid_t pid = testing::spawn(small_run(stopped, kSteps, ranks), stopped + "/log");
    ASSERT_TRUE(wait_for_lines(stopped + "/m.jsonl", 5));
    pid_t victim = pid;
    if (std::string(target) == "rank 1") {
      const std::vector<pid_t> children = testing::children_of(pid);
      ASSERT_EQ(children.size(), 2u);
      victim = children[1];
    }
    ::kill(victim, SIGTERM);
    const int code = testing::wait_code(pid);
    const std::string log = testing::read_file(stopped + "/log");
    ASSERT_EQ(code, 7) << log;
    const int done = lines_of(stopped + "/m.jsonl");
    ASSERT_LT(done, kSteps) << "stopped too late to test anything";
    EXPECT_EQ(latest_step(stopped + "/ckpt"), done) << "the step in flight is saved, none lost";
    EXPECT_NE(log.find(fmt::format("after step {}; checkpoint at step {}", done, done)),
              std::string::npos)
        << log;
    const testing::Proc resumed =
        testing::run_cmd(small_run(stopped, kSteps, ranks) + " --resume " + stopped + "/ckpt");
    ASSERT_EQ(resumed.code, 0) << resumed.output;
    expect_same_checkpoint(straight + "/ckpt", stopped + "/ckpt", kSteps, ranks);
    fs::remove_all(straight);
    fs::remove_all(stopped);
  }
}

// A second signal stops the run at once; the last complete checkpoint stays `latest`, and it
// resumes.
TEST(Preemption, ASecondSignalStopsAtOnce) {
  const std::string dir = fresh("twice");
  const pid_t pid =
      testing::spawn(small_run(dir, 100000, 1) + " --set checkpoint.every=1", dir + "/log");
  ASSERT_TRUE(wait_for_lines(dir + "/m.jsonl", 3));
  ::kill(pid, SIGTERM);
  ::kill(pid, SIGTERM);
  const int code = testing::wait_code(pid);
  EXPECT_TRUE(code == 128 + SIGTERM || code == 7) << code;  // 7: it was saving when the second came
  const int64_t step = latest_step(dir + "/ckpt");
  ASSERT_GE(step, 1);
  const testing::Proc resumed = testing::run_cmd(small_run(dir, static_cast<int>(step) + 1, 1) +
                                                 " --resume " + dir + "/ckpt");
  EXPECT_EQ(resumed.code, 0) << resumed.output;
  fs::remove_all(dir);
}

// checkpoint.signal_deadline_s: a run that cannot reach its step boundary in time (here a step
// slowed by an injected wait) ends when the deadline passes.
TEST(Preemption, TheDeadlineEndsARunThatCannotStop) {
  const std::string dir = fresh("deadline");
  // One enormous step: the signal arrives in it and the boundary is far.
  const std::string cmd = testing::moetrain_binary() +
                          fmt::format(
                              " train --config {}/configs/tiny.toml --set train.seq_len=4096"
                              " --set train.batch_rows=64 --set hardware.device=cpu"
                              " --set checkpoint.signal_deadline_s=0.5",
                              testing::source_dir());
  const pid_t pid = testing::spawn(cmd, dir + "/log");
  std::this_thread::sleep_for(std::chrono::seconds(2));
  const auto start = std::chrono::steady_clock::now();
  ::kill(pid, SIGTERM);
  const int code = testing::wait_code(pid);
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(code, 128 + SIGALRM) << testing::read_file(dir + "/log");
  EXPECT_LT(took, 5.0);
  fs::remove_all(dir);
}

// checkpoint.keep: only the newest k stay, older ones removed once the new one is `latest`; a
// resume from what stays works. --overwrite removes the old run's checkpoints before the new
// run writes its own.
TEST(Checkpoints, KeepTheNewestAndOverwriteRemovesTheOldRun) {
  const std::string dir = fresh("keep");
  const testing::Proc p =
      testing::run_cmd(small_run(dir, 12, 1) + " --set checkpoint.every=2 --set checkpoint.keep=2");
  ASSERT_EQ(p.code, 0) << p.output;
  std::vector<int64_t> steps;
  for (const auto& [step, path] : checkpoints_in(dir + "/ckpt")) steps.push_back(step);
  EXPECT_EQ(steps, (std::vector<int64_t>{10, 12}));
  const testing::Proc again = testing::run_cmd(small_run(dir, 14, 1) + " --resume " + dir +
                                               "/ckpt/step_00000010.safetensors");
  EXPECT_EQ(again.code, 0) << again.output;
  // A new run over it with --overwrite: only its own checkpoints remain.
  const testing::Proc over =
      testing::run_cmd(small_run(dir, 4, 1) + " --set checkpoint.every=2 --overwrite");
  ASSERT_EQ(over.code, 0) << over.output;
  steps.clear();
  for (const auto& [step, path] : checkpoints_in(dir + "/ckpt")) steps.push_back(step);
  EXPECT_EQ(steps, (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(latest_step(dir + "/ckpt"), 4);
  fs::remove_all(dir);
}

// After a resume the metrics file holds each step once (the lines a crash left past the
// checkpoint are cut back); --steps at or below the checkpoint's step is exit 2 saying so.
TEST(Checkpoints, ResumedMetricsHoldEachStepOnce) {
  const std::string dir = fresh("metrics_once");
  ASSERT_EQ(testing::run_cmd(small_run(dir, 10, 1)).code, 0);  // checkpoints at 4 and 8, 10
  // As after a crash at step 10 with the last checkpoint at 8: resume from 8.
  const testing::Proc p = testing::run_cmd(small_run(dir, 12, 1) + " --resume " + dir +
                                           "/ckpt/step_00000008.safetensors");
  ASSERT_EQ(p.code, 0) << p.output;
  std::ifstream in(dir + "/m.jsonl");
  std::vector<int64_t> steps;
  for (std::string line; std::getline(in, line);)
    steps.push_back(nlohmann::json::parse(line).at("step").get<int64_t>());
  std::vector<int64_t> want(12);
  std::iota(want.begin(), want.end(), 1);
  EXPECT_EQ(steps, want);
  const testing::Proc low =
      testing::run_cmd(small_run(dir, 12, 1) + " --resume " + dir + "/ckpt --steps 12");
  EXPECT_EQ(low.code, 2) << low.output;
  EXPECT_NE(low.output.find("--steps 12 is at or below the checkpoint's step 12"),
            std::string::npos)
      << low.output;
  fs::remove_all(dir);
}

// A metrics write that fails (a full device) stops the run with exit 8 naming the file and the
// system's reason, keeping the last checkpoint.
TEST(Checkpoints, AFailedMetricsWriteStopsTheRun) {
  const std::string dir = fresh("dev_full");
  std::string cmd = small_run(dir, 6, 1);
  cmd.replace(cmd.find(dir + "/m.jsonl"), dir.size() + 8, "/dev/full");
  const testing::Proc p = testing::run_cmd(cmd);
  EXPECT_EQ(p.code, 8) << p.output;
  EXPECT_NE(p.output.find("cannot write --metrics '/dev/full': No space left on device"),
            std::string::npos)
      << p.output;
  fs::remove_all(dir);
}

// Checkpoint metadata integers are read strictly: "1e3" and "20abc" are refused, naming the key.
TEST(Checkpoints, MetadataIntegersAreStrict) {
  const std::string dir = fresh("strict_meta");
  ASSERT_EQ(testing::run_cmd(small_run(dir, 4, 1)).code, 0);
  const std::string file = dir + "/ckpt/step_00000004.safetensors";
  for (const char* bad : {"1e3", "20abc", ""}) {
    SafetensorsFile f = read_safetensors(file);
    f.metadata["step"] = bad;
    write_safetensors(dir + "/bad.safetensors", f);
    const testing::Proc p =
        testing::run_cmd(small_run(dir, 8, 1) + " --resume " + dir + "/bad.safetensors");
    EXPECT_EQ(p.code, 4) << bad << ": " << p.output;
    EXPECT_NE(p.output.find("step metadata '" + std::string(bad) + "'; it must be an integer"),
              std::string::npos)
        << p.output;
  }
  fs::remove_all(dir);
}

// One run per checkpoint directory: a second run into it is exit 2 naming the holder (pid and
// host); once the holder is dead (SIGKILL leaves its lock file behind) the next run takes it.
TEST(Checkpoints, OneRunPerDirectory) {
  const std::string dir = fresh("lock");
  const pid_t first = testing::spawn(small_run(dir, 100000, 1), dir + "/log");
  ASSERT_TRUE(wait_for_lines(dir + "/m.jsonl", 2));
  std::string second = small_run(dir, 4, 1) + " --overwrite";
  second.replace(second.find(dir + "/m.jsonl"), dir.size() + 8, dir + "/m2.jsonl");
  const testing::Proc refused = testing::run_cmd(second);
  EXPECT_EQ(refused.code, 2) << refused.output;
  EXPECT_NE(refused.output.find(fmt::format("is in use by another run (pid {} on host", first)),
            std::string::npos)
      << refused.output;
  ::kill(first, SIGKILL);
  testing::wait_code(first);
  EXPECT_TRUE(fs::exists(dir + "/ckpt/.moetrain.lock"));
  const testing::Proc taken = testing::run_cmd(second);
  EXPECT_EQ(taken.code, 0) << taken.output;
  fs::remove_all(dir);
}

// Output paths are checked before the first step (exit 2 naming the path and the reason): an
// export directory that is a file, an unwritable metrics path, a checkpoint.dir that cannot be a
// directory. An export that fails anyway at the end leaves the weights in a checkpoint it names
// (exit 8); one that succeeds replaces the folder whole.
TEST(Outputs, CheckedBeforeTheFirstStepAndExportsNeverLost) {
  const std::string dir = fresh("outputs");
  std::ofstream(dir + "/a_file") << "x";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {" --export-hf " + dir + "/a_file", "--export-hf '" + dir + "/a_file' is a file"},
      {" --export-hf /proc/nope/hf", "--export-hf '/proc/nope/hf'"},
      {" --set checkpoint.dir=" + dir + "/a_file/ckpt", "is not a directory"},
  };
  for (const auto& [extra, words] : cases) {
    std::string cmd =
        testing::moetrain_binary() +
        fmt::format(" train --config {}/configs/tiny.toml --steps 2", testing::source_dir()) +
        extra;
    const testing::Proc p = testing::run_cmd(cmd);
    EXPECT_EQ(p.code, 2) << extra << ": " << p.output;
    EXPECT_NE(p.output.find(words), std::string::npos) << p.output;
    EXPECT_EQ(p.output.find("step     1"), std::string::npos) << "trained before refusing";
  }
  // export-hf --out naming a file, eval --per-token where nothing can be written, and a
  // checkpoint.dir longer than the system allows: exit 2 naming them (they were exit 1).
  const std::string tiny = fmt::format(" --config {}/configs/tiny.toml", testing::source_dir());
  const std::string hf = testing::source_dir() + "/tests/fixtures/hf_qwen3moe/base";
  const std::vector<std::pair<std::string, std::string>> commands = {
      {"export-hf" + tiny + " --resume x --out " + dir + "/a_file",
       "--out '" + dir + "/a_file' is a file"},
      {"eval" + tiny + " --init-from " + hf + " --data x --per-token /proc/nope.jsonl",
       "cannot write --per-token '/proc/nope.jsonl'"},
      {"train" + tiny + " --steps 1 --set checkpoint.dir=" + dir + "/" + std::string(300, 'd'),
       "File name too long"},
  };
  for (const auto& [args, words] : commands) {
    const testing::Proc p = testing::run_cmd(testing::moetrain_binary() + " " + args);
    EXPECT_EQ(p.code, 2) << args << ": " << p.output;
    EXPECT_NE(p.output.find(words), std::string::npos) << p.output;
  }
  const testing::Proc bad_metrics = testing::run_cmd(
      testing::moetrain_binary() +
      fmt::format(" train --config {}/configs/tiny.toml --steps 2 --metrics /proc/nope.jsonl",
                  testing::source_dir()));
  EXPECT_EQ(bad_metrics.code, 2) << bad_metrics.output;
  EXPECT_NE(bad_metrics.output.find("cannot write --metrics '/proc/nope.jsonl'"), std::string::npos)
      << bad_metrics.output;
  // An export that fails at the end: the checkpoint of the last step holds the weights.
  const testing::Proc lost = testing::run_cmd("MOETRAIN_FAULT_EXPORT=1 " + small_run(dir, 4, 1) +
                                              " --export-hf " + dir + "/hf");
  EXPECT_EQ(lost.code, 8) << lost.output;
  EXPECT_NE(lost.output.find("the trained weights (step 4) are in the checkpoint '" + dir +
                             "/ckpt/step_00000004.safetensors'"),
            std::string::npos)
      << lost.output;
  // Twice into one folder: the second replaces the first whole, no partial folder left.
  for (int i = 0; i < 2; ++i) {
    const testing::Proc ok =
        testing::run_cmd(small_run(dir, 4, 1) + " --overwrite --export-hf " + dir + "/hf");
    ASSERT_EQ(ok.code, 0) << ok.output;
  }
  EXPECT_TRUE(fs::exists(dir + "/hf/config.json"));
  EXPECT_FALSE(fs::exists(dir + "/hf.partial"));
  EXPECT_FALSE(fs::exists(dir + "/hf.old"));
  fs::remove_all(dir);
}

// A token file truncated while a run reads it is exit 3 naming it (it was SIGBUS, exit 135).
TEST(Outputs, ADataFileTruncatedWhileReadIsExit3) {
  const std::string dir = fresh("shrink");
  TokenDocuments docs;
  docs.doc_offsets = {0};
  for (int d = 0; d < 4000; ++d) {
    for (int i = 0; i < 100; ++i) docs.tokens.push_back(static_cast<uint32_t>((d * 7 + i) % 256));
    docs.doc_offsets.push_back(docs.tokens.size());
  }
  const std::string data = dir + "/big.tok";
  write_token_file(data, docs);
  const pid_t pid = testing::spawn(
      testing::moetrain_binary() +
          fmt::format(" train --config {}/configs/tiny.toml --set data.source=tokens --set "
                      "data.path={} --set data.shuffle=false --set train.steps=100000 --set "
                      "hardware.device=cpu --metrics {}/m.jsonl",
                      testing::source_dir(), data, dir),
      dir + "/log");
  ASSERT_TRUE(wait_for_lines(dir + "/m.jsonl", 2));
  fs::resize_file(data, 64);
  const int code = testing::wait_code(pid);
  const std::string log = testing::read_file(dir + "/log");
  EXPECT_EQ(code, 3) << log;
  EXPECT_NE(log.find("data: '" + data + "' shrank or changed while it was read"), std::string::npos)
      << log;
  fs::remove_all(dir);
}

// checkpoint.async: the checkpoints written by the thread are those of the blocking save, bit
// for bit (one process and two launched ranks, with keep), the stall is reported per step, and a
// SIGTERM's checkpoint is complete on disk before the exit.
TEST(AsyncCheckpoints, WriteWhatTheBlockingSaveWritesAndStopCleanly) {
  for (const int ranks : {1, 2}) {
    SCOPED_TRACE(fmt::format("{} rank(s)", ranks));
    const std::string sync = fresh("sync"), async = fresh("async");
    ASSERT_EQ(testing::run_cmd(small_run(sync, 12, ranks)).code, 0);
    const testing::Proc a = testing::run_cmd(
        small_run(async, 12, ranks) + " --set checkpoint.async=true --set checkpoint.keep=2");
    ASSERT_EQ(a.code, 0) << a.output;
    for (const int64_t step : {8, 12})
      expect_same_checkpoint(sync + "/ckpt", async + "/ckpt", step, ranks);
    std::vector<int64_t> steps;
    for (const auto& [step, path] : checkpoints_in(async + "/ckpt")) steps.push_back(step);
    EXPECT_EQ(steps, (std::vector<int64_t>{8, 12}));
    std::ifstream in(async + "/m.jsonl");
    int stalls = 0;
    for (std::string line; std::getline(in, line);)
      stalls += nlohmann::json::parse(line).contains("checkpoint_stall_s");
    EXPECT_EQ(stalls, 3);  // steps 4, 8, 12
    // Stopped by SIGTERM: the step's checkpoint is whole on disk, and it resumes bit for bit.
    fs::remove_all(async);
    fs::create_directories(async);
    const pid_t pid = testing::spawn(small_run(async, 40, ranks) + " --set checkpoint.async=true",
                                     async + "/log");
    ASSERT_TRUE(wait_for_lines(async + "/m.jsonl", 6));
    ::kill(pid, SIGTERM);
    ASSERT_EQ(testing::wait_code(pid), 7) << testing::read_file(async + "/log");
    const int64_t stopped = latest_step(async + "/ckpt");
    EXPECT_EQ(stopped, lines_of(async + "/m.jsonl"));
    const testing::Proc resumed = testing::run_cmd(
        small_run(async, 40, ranks) + " --set checkpoint.async=true --resume " + async + "/ckpt");
    ASSERT_EQ(resumed.code, 0) << resumed.output;
    const std::string straight = fresh("async_straight");
    ASSERT_EQ(testing::run_cmd(small_run(straight, 40, ranks)).code, 0);
    expect_same_checkpoint(straight + "/ckpt", async + "/ckpt", 40, ranks);
    for (const std::string& d : {sync, async, straight}) fs::remove_all(d);
  }
}

// Strict loading: resuming into a model of fewer layers, or a tied model from an untied run, is
// exit 4 naming the tensors the model lacks and the config fields that differ (it trained on).
TEST(Checkpoints, ATensorTheModelLacksIsRefused) {
  const std::string dir = fresh("strict_set");
  ASSERT_EQ(testing::run_cmd(small_run(dir, 4, 1)).code, 0);
  const std::string file = dir + "/ckpt/step_00000004.safetensors";
  const std::pair<std::string, std::string> cases[] = {
      {" --set model.n_layers=1", "it holds 2 layers, model.n_layers = 1"},
      {" --set model.tie_word_embeddings=true",
       "it has an LM head of its own, and model.tie_word_embeddings = true"},
  };
  for (const auto& [extra, words] : cases) {
    const std::string other = fresh("strict_other");
    const testing::Proc p = testing::run_cmd(small_run(other, 8, 1) + extra + " --resume " + file);
    EXPECT_EQ(p.code, 4) << extra << ": " << p.output;
    EXPECT_NE(p.output.find("tensor(s) this model lacks"), std::string::npos) << p.output;
    EXPECT_NE(p.output.find(words), std::string::npos) << p.output;
    fs::remove_all(other);
  }
  fs::remove_all(dir);
}

// Two rank-0 processes on one port: the second is exit 2 naming the port and the reason.
TEST(Messages, ASecondRankZeroOnOnePortIsExit2) {
  const std::string dir = fresh("two_masters");
  const int port = testing::free_port();
  const std::string env = fmt::format(
      "env WORLD_SIZE=2 RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT={} MOETRAIN_TIMEOUT_S=5 ", port);
  const pid_t first = testing::spawn(
      env + testing::moetrain_binary() +
          fmt::format(" train --config {}/configs/tiny.toml --steps 1", testing::source_dir()),
      dir + "/first.log");
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const testing::Proc second = testing::run_cmd(
      env + testing::moetrain_binary() +
      fmt::format(" train --config {}/configs/tiny.toml --steps 1", testing::source_dir()));
  EXPECT_EQ(second.code, 2) << second.output;
  EXPECT_NE(second.output.find(
                fmt::format("cannot listen on MASTER_PORT={}: Address already in use", port)),
            std::string::npos)
      << second.output;
  ::kill(first, SIGKILL);
  testing::wait_code(first);
  fs::remove_all(dir);
}

// The chaos run: two launched ranks checkpointing every 4 steps, hit again and again at seeded
// random moments by SIGKILL or SIGTERM on a random rank or the launcher, then resumed, until it
// reaches its last step. Its final weights equal the uninterrupted run's bit for bit; a SIGTERM
// loses no step, a SIGKILL at most the steps since the last checkpoint. MOETRAIN_CHAOS_ROUNDS
// (default 20) and MOETRAIN_CHAOS_SEED set the rounds and the draws; the figures go to stdout.
TEST(Chaos, KilledAndResumedRunEndsBitIdentical) {
  const char* rounds_env = std::getenv("MOETRAIN_CHAOS_ROUNDS");
  const char* seed_env = std::getenv("MOETRAIN_CHAOS_SEED");
  const int max_rounds = rounds_env ? std::atoi(rounds_env) : 20;
  const uint64_t seed = seed_env ? std::strtoull(seed_env, nullptr, 10) : 20261203;
  const int steps = 8 + 12 * max_rounds;  // a round runs a few steps before its hit
  const std::string straight = fresh("chaos_straight"), dir = fresh("chaos");
  ASSERT_EQ(testing::run_cmd(small_run(straight, steps, 2)).code, 0);
  std::mt19937_64 rng(seed);
  int rounds = 0, kills = 0, terms = 0;
  int64_t lost = 0;
  bool finished = false;
  while (!finished && rounds < 4 * max_rounds) {
    ++rounds;
    const int64_t before = latest_step(dir + "/ckpt");
    std::string cmd = small_run(dir, steps, 2);
    const bool async = rounds % 2 == 0;  // both ways of saving
    if (async) cmd += " --set checkpoint.async=true";
    if (before >= 0) cmd += " --resume " + dir + "/ckpt";
    const int lines_before = lines_of(dir + "/m.jsonl");
    const pid_t launcher = testing::spawn(cmd, dir + "/log");
    std::vector<pid_t> ranks;
    for (int i = 0; i < 100 && ranks.size() < 2; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      ranks = testing::children_of(launcher);
    }
    // Hit after a seeded delay, once the ranks train (the last rounds run to the end).
    const bool hit = rounds <= max_rounds;
    const bool kill9 = rng() % 2 == 0;
    const int who = static_cast<int>(rng() % 3);  // 0: the launcher, 1-2: a rank
    const auto delay = std::chrono::milliseconds(rng() % 400);
    if (hit) {
      wait_for_lines(dir + "/m.jsonl", lines_before + 1);
      std::this_thread::sleep_for(delay);
      const pid_t victim = who == 0 || ranks.size() < 2 ? launcher : ranks[who - 1];
      ::kill(victim, kill9 ? SIGKILL : SIGTERM);
      (kill9 ? kills : terms) += 1;
    }
    const int code = testing::wait_code(launcher);
    for (int i = 0; i < 200; ++i) {  // orphaned ranks (their launcher killed) finish their stop
      if (std::all_of(ranks.begin(), ranks.end(), testing::gone)) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ASSERT_TRUE(std::all_of(ranks.begin(), ranks.end(), testing::gone)) << "round " << rounds;
    // The steps this round ran, from its metrics lines, against what its checkpoint kept.
    int64_t reached = before < 0 ? 0 : before;
    {
      std::ifstream in(dir + "/m.jsonl");
      int n = 0;
      for (std::string line; std::getline(in, line);)
        if (++n > lines_before && !line.empty())
          reached =
              std::max<int64_t>(reached, nlohmann::json::parse(line).at("step").get<int64_t>());
    }
    const int64_t kept = std::max<int64_t>(latest_step(dir + "/ckpt"), 0);
    if (code == 0) {
      finished = kept == steps;
      continue;
    }
    if (hit && !kill9) {
      EXPECT_EQ(code, 7) << "round " << rounds << ": " << testing::read_file(dir + "/log");
      EXPECT_EQ(kept, reached) << "round " << rounds << ": a SIGTERM lost steps";
    } else {
      // At most the steps since the last complete checkpoint: a blocking save's interval, or
      // with an asynchronous save in flight when the kill came, two of them.
      EXPECT_LE(reached - kept, async ? 8 : 4) << "round " << rounds;
    }
    lost += reached - kept;
  }
  ASSERT_TRUE(finished) << rounds << " rounds";
  expect_same_checkpoint(straight + "/ckpt", dir + "/ckpt", steps, 2);
  std::printf(
      "{\"chaos\": {\"rounds\": %d, \"sigkill\": %d, \"sigterm\": %d, \"steps_lost\": %lld, "
      "\"steps\": %d, \"identical\": %s, \"seed\": %llu}}\n",
      rounds, kills, terms, static_cast<long long>(lost), steps,
      ::testing::Test::HasFailure() ? "false" : "true", static_cast<unsigned long long>(seed));
  fs::remove_all(straight);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace mt
