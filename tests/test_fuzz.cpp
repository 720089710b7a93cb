// Seeded mutations of a valid checkpoint, token file and config, each run by the moetrain binary
// in a subprocess with a timeout: no signal, no hang, and only the documented exit codes of the
// input's kind (issue 17). MOETRAIN_FUZZ_CASES (per kind, default 80) and MOETRAIN_FUZZ_SEED run
// it longer or elsewhere on demand.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "processes.h"
#include "train/token_file.h"

namespace mt {
namespace {

int env_or(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : fallback;
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// One of: flip bits, overwrite a span with random bytes, truncate, insert, duplicate a span.
std::string mutate(std::string s, std::mt19937_64& rng) {
  if (s.empty()) return s;
  auto pick = [&](size_t n) { return static_cast<size_t>(rng() % std::max<size_t>(n, 1)); };
  const int edits = 1 + static_cast<int>(rng() % 4);
  for (int e = 0; e < edits && !s.empty(); ++e) {
    switch (rng() % 5) {
      case 0:
        s[pick(s.size())] ^= static_cast<char>(1u << (rng() % 8));
        break;
      case 1: {
        const size_t at = pick(s.size()), n = 1 + pick(16);
        for (size_t i = at; i < std::min(s.size(), at + n); ++i) s[i] = static_cast<char>(rng());
        break;
      }
      case 2:
        s.resize(pick(s.size()));
        break;
      case 3:
        s.insert(pick(s.size()), std::string(1 + pick(8), static_cast<char>(rng())));
        break;
      default: {
        const size_t at = pick(s.size()), n = 1 + pick(32);
        s.insert(pick(s.size()), s.substr(at, n));
      }
    }
  }
  return s;
}

struct Outcome {
  int code;  // exit code; 128 + signal when killed; 124 when the timeout fired
};

Outcome run(const std::string& args) {
  const std::string cmd =
      "timeout -s KILL 60 " + testing::moetrain_binary() + " " + args + " >/dev/null 2>&1";
  const int status = std::system(cmd.c_str());
  if (WIFSIGNALED(status)) return {128 + WTERMSIG(status)};
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1};
}

class Fuzz : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::unique_temp_path("fuzz");
    std::filesystem::create_directories(dir_);
    seed_ = static_cast<uint64_t>(env_or("MOETRAIN_FUZZ_SEED", 20261130));
    cases_ = env_or("MOETRAIN_FUZZ_CASES", 80);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // Runs `cases_` mutations of `original`, written to `path` before each `args`; every exit
  // code must be in `allowed`.
  void check(const char* kind, const std::string& original, const std::string& path,
             const std::string& args, const std::set<int>& allowed) {
    std::mt19937_64 rng(seed_ + std::hash<std::string>{}(kind));
    std::map<int, int> seen;
    for (int i = 0; i < cases_; ++i) {
      const std::string bytes = mutate(original, rng);
      write_bytes(path, bytes);
      const Outcome o = run(args);
      ++seen[o.code];
      if (!allowed.count(o.code)) {
        // Outside the test's folder, which TearDown removes.
        const std::string keep = testing::unique_temp_path(std::string("fuzz_failing_") + kind +
                                                           "_" + std::to_string(i));
        write_bytes(keep, bytes);
        ADD_FAILURE() << kind << " case " << i << " (seed " << seed_ << "): exit " << o.code
                      << (o.code == 124 || o.code == 137 ? " (hang)" : "") << "; input kept as "
                      << keep << "; command: moetrain " << args;
      }
    }
    std::string summary;
    for (const auto& [code, n] : seen)
      summary += " exit " + std::to_string(code) + ": " + std::to_string(n);
    std::printf("fuzz %s: %d cases,%s\n", kind, cases_, summary.c_str());
  }

  std::string dir_;
  uint64_t seed_ = 0;
  int cases_ = 0;
};

const std::string kShort =
    " --set train.seq_len=32 --set train.batch_rows=2 --set train.warmup_steps=1";

TEST_F(Fuzz, ConfigsExitWith0Or2) {
  const std::string original = read_bytes(testing::source_dir() + "/configs/tiny.toml");
  const std::string path = dir_ + "/config.toml";
  check("config", original, path, "flops --config " + path, {0, 2});
}

TEST_F(Fuzz, TokenFilesExitWith0Or3) {
  TokenDocuments d;
  std::mt19937_64 rng(seed_);
  d.doc_offsets = {0};
  for (int doc = 0; doc < 12; ++doc) {
    const int n = 8 + static_cast<int>(rng() % 40);
    for (int i = 0; i < n; ++i) {
      d.tokens.push_back(static_cast<uint32_t>(rng() % 256));
      d.loss_mask.push_back(i > 2 ? 1 : 0);
    }
    d.doc_offsets.push_back(d.tokens.size());
  }
  const std::string good = dir_ + "/good.tok", path = dir_ + "/data.tok";
  write_token_file(good, d);
  check("tokens", read_bytes(good), path,
        "train --config " + testing::source_dir() + "/configs/tiny.toml" + kShort +
            " --set data.source=sft --set data.path=" + path + " --steps 1",
        {0, 3});
}

TEST_F(Fuzz, CheckpointsExitWith0Or4) {
  const std::string tiny = testing::source_dir() + "/configs/tiny.toml";
  const std::string ckpt = dir_ + "/ckpt";
  ASSERT_EQ(run("train --config " + tiny + kShort + " --set checkpoint.every=1 --set " +
                "checkpoint.dir=" + ckpt + " --steps 1")
                .code,
            0);
  const std::string original = read_bytes(ckpt + "/step_00000001.safetensors");
  ASSERT_FALSE(original.empty());
  const std::string path = dir_ + "/resume.safetensors";
  // Resuming a corrupt file is exit 4; one that still loads (a mutation of unused header
  // bytes, say) trains its next step: 0; one whose step metadata became another integer of 2 or
  // more is past --steps 2: exit 2 saying so.
  check("checkpoint", original, path,
        "train --config " + tiny + kShort + " --resume " + path + " --steps 2", {0, 2, 4});
}

}  // namespace
}  // namespace mt
