// Training end to end: the tiny preset converges near the data's entropy floor; resume from a
// checkpoint is bit-identical; gradient accumulation equals one big batch; bad checkpoints and
// NaN losses fail with clear errors and the right exit codes.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "processes.h"
#include "train/checkpoint.h"
#include "train/token_file.h"
#include "train/trainer.h"
#include "training.h"

namespace mt {
namespace {

const std::string kTiny = std::string(MOETRAIN_SOURCE_DIR) + "/configs/tiny.toml";

// A path of this process's own (two test runs at once must not share files), emptied.
std::string fresh_dir(const std::string& name) {
  const auto p = std::filesystem::temp_directory_path() / (std::to_string(getpid()) + "_" + name);
  std::filesystem::remove_all(p);
  return p.string();
}

TEST(Train, TinyPresetReachesTheEntropyFloor) {
  const Config c = load_config(kTiny, {});
  Trainer t(c);
  const std::string metrics = fresh_dir("mt_tiny_metrics.jsonl");
  RunOptions opt;
  opt.metrics_path = metrics;
  const auto m = t.run(opt);
  ASSERT_EQ(static_cast<int64_t>(m.size()), c.train.steps);
  const double floor = t.data_stats().loss_floor, unigram = t.data_stats().unigram_entropy;
  const double final_loss = m.back().loss;
  EXPECT_LE(final_loss - floor, 0.2 * (unigram - floor))
      << "final " << final_loss << " floor " << floor << " unigram " << unigram;
  EXPECT_GT(final_loss, floor - 0.1);  // below the floor would mean a leak of the targets

  // The metrics file: one JSON object per step, the floor on the first line.
  std::ifstream in(metrics);
  std::string line;
  int64_t lines = 0;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    for (const char* key : {"step", "loss", "grad_norm", "lr", "tokens_per_s", "mfu"})
      EXPECT_TRUE(j.contains(key)) << key;
    if (lines == 0) {
      EXPECT_NEAR(j.at("loss_floor").get<double>(), floor, 1e-12);
      EXPECT_NEAR(j.at("unigram_entropy").get<double>(), unigram, 1e-12);
    }
    ++lines;
  }
  EXPECT_EQ(lines, c.train.steps);
}

std::vector<std::string> short_run() {
  return {"train.steps=8", "train.warmup_steps=2", "train.batch_rows=2", "train.seq_len=64",
          "model.bias_update_rate=0.001"};
}

// The short run, checkpointing into `dir` every `every` steps.
Config checkpointing_run(const std::string& dir, int every) {
  std::vector<std::string> sets = short_run();
  sets.push_back("checkpoint.dir=\"" + dir + "\"");
  sets.push_back("checkpoint.every=" + std::to_string(every));
  return load_config(kTiny, sets);
}

// The message of the CheckpointError that resuming `t` from `file` throws, or "no error".
std::string resume_error(Trainer& t, const std::string& file) {
  RunOptions o;
  o.resume = file;
  try {
    t.run(o);
  } catch (const CheckpointError& e) {
    return e.what();
  }
  return "no error";
}

std::vector<Tensor> all_state(Trainer& t) {
  std::vector<Tensor> s;
  for (auto& u : t.model().units())
    for (auto& g : u.groups) s.push_back(g.params.clone());
  for (auto& m : t.optimizer().state()) s.push_back(m.clone());
  for (auto& b : t.model().router_biases()) s.push_back(b.clone());
  return s;
}

// A safetensors header of the wrong structure, offsets that wrap or run past the data, and
// negative shapes are exit 4 naming the tensor, checked before anything is allocated (issue
// 17: they exited 1 with a raw JSON exception, loaded silently, or allocated first).
TEST(Checkpoint, MalformedSafetensorsHeadersAreNamedWithExitCode4) {
  const std::string path = fresh_dir("mt_bad_header.safetensors");
  auto write = [&](const std::string& header, size_t data_bytes) {
    std::ofstream out(path, std::ios::binary);
    const uint64_t n = header.size();
    out.write(reinterpret_cast<const char*>(&n), 8);
    out << header << std::string(data_bytes, '\0');
  };
  const std::pair<std::string, std::string> cases[] = {
      {"42", "not a JSON object"},
      {R"({"w": {"shape": [2], "data_offsets": [0, 8]}})", "tensor w needs an object"},
      {R"({"w": {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}})", "tensor w has shape 2"},
      {R"({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})",
       "tensor w has shape [-2]"},
      {R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [18446744073709551608, 0]}})",
       "tensor w needs 8 bytes at [18446744073709551608, 0)"},
      {R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})",
       "tensor w needs 8 bytes at [8, 16) of 8"},
      {R"({"w": {"dtype": "F32", "shape": [4611686018427387904, 4], "data_offsets": [0, 8]}})",
       "larger than the file"},
      {R"({"w": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}})", "unsupported dtype"},
      {R"({"__metadata__": {"step": 3}})", "metadata step is not a string"},
  };
  for (const auto& [header, names] : cases) {
    write(header, 8);
    try {
      read_safetensors(path);
      ADD_FAILURE() << header << " was accepted";
    } catch (const CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find(names), std::string::npos) << header << ": " << e.what();
      EXPECT_EQ(e.code(), ExitCode::kCheckpoint);
    }
  }
  write(R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", 8);
  EXPECT_EQ(read_safetensors(path).tensors.at("w").numel(), 2);  // and a good one loads
}

// A flipped byte inside a tensor is named by its checksum (issue 17: it loaded silently).
TEST(Checkpoint, ACorruptTensorFailsItsChecksum) {
  const std::string dir = fresh_dir("mt_checksum");
  const Config c = checkpointing_run(dir, 4);
  Trainer(c).run({});
  const std::string file = dir + "/step_00000004.safetensors";
  // The first tensor of more than 64 bytes, from the header's offsets.
  std::ifstream in(file, std::ios::binary);
  uint64_t hlen = 0;
  in.read(reinterpret_cast<char*>(&hlen), 8);
  std::string header(hlen, '\0');
  in.read(header.data(), static_cast<std::streamsize>(hlen));
  in.close();
  const auto j = nlohmann::json::parse(header);
  std::string victim;
  for (const auto& [name, info] : j.items())
    if (name != "__metadata__" && info.at("data_offsets")[1].get<uint64_t>() >
                                      info.at("data_offsets")[0].get<uint64_t>() + 64) {
      victim = name;
      break;
    }
  ASSERT_FALSE(victim.empty());
  const uint64_t at = 8 + hlen + j.at(victim).at("data_offsets")[0].get<uint64_t>() + 17;
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(at));
    char byte = 0;
    f.read(&byte, 1);
    byte ^= 0x10;
    f.seekp(static_cast<std::streamoff>(at));
    f.write(&byte, 1);
  }
  Trainer t(c);
  const std::string e = resume_error(t, file);
  EXPECT_NE(e.find("tensor " + victim + " fails its checksum"), std::string::npos) << e;
}

// A negative data position (or step) in a checkpoint is refused before the model is touched.
TEST(Checkpoint, NegativePositionIsRefused) {
  const std::string dir = fresh_dir("mt_negative_position");
  const Config c = checkpointing_run(dir, 4);
  Trainer(c).run({});
  const std::string file = dir + "/step_00000004.safetensors";
  SafetensorsFile f = read_safetensors(file);
  f.metadata["data_position"] = "-5";
  write_safetensors(file, f);
  Trainer t(c);
  const Tensor before = t.model().units()[0].groups[0].params.clone();
  const std::string e = resume_error(t, file);
  EXPECT_NE(e.find("data_position -5"), std::string::npos) << e;
  EXPECT_EQ(relative_error(t.model().units()[0].groups[0].params, before), 0.0);
}

// A state that turned non-finite in the update (the step's loss and gradients still finite) is
// never written as a checkpoint: exit 5 naming the tensor and the last good checkpoint, which
// stays `latest` (issue 17: it was written, and the NaN exit's advice then pointed at it).
void non_finite_state_is_never_written(const Config& c, const std::string& dir);

// Also when written by the asynchronous writer: the writer refuses it and the run stops with the
// same error (at the next step's agreement, or at the end).
TEST(Checkpoint, NonFiniteStateIsNeverWritten) {
  for (const bool async : {false, true}) {
    SCOPED_TRACE(async ? "async" : "blocking");
    const std::string dir = fresh_dir(async ? "mt_nonfinite_async" : "mt_nonfinite_ckpt");
    Config c = checkpointing_run(dir, 1);
    c.checkpoint.async = async;
    non_finite_state_is_never_written(c, dir);
  }
}

void non_finite_state_is_never_written(const Config& c, const std::string& dir) {
  Trainer t(c);
  RunOptions two;
  two.steps = 2;
  t.run(two);
  // A NaN first moment: step 3's loss and gradients are finite, its update is not.
  t.optimizer().state()[0].set_item(0, std::nan(""));
  RunOptions three;
  three.steps = 3;
  try {
    t.run(three);
    ADD_FAILURE() << "a non-finite state was checkpointed";
  } catch (const NumericalError& e) {
    EXPECT_EQ(e.code(), ExitCode::kNumerical);
    EXPECT_NE(std::string(e.what()).find("step 3: the model's state is not finite"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("step_00000002.safetensors"), std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(std::filesystem::exists(dir + "/step_00000003.safetensors"));
  EXPECT_EQ(latest_checkpoint(dir), "step_00000002.safetensors");
}

TEST(Train, ResumeIsBitIdentical) {
  const std::string dir = fresh_dir("mt_resume_ckpt");
  std::vector<std::string> sets = short_run();
  sets.push_back("checkpoint.dir=\"" + dir + "\"");
  sets.push_back("checkpoint.every=4");
  for (const char* policy : {"none", "full"}) {
    sets.push_back(std::string("model.checkpoint=") + policy);
    const Config c = parse_config_string(std::string(), sets);
    const testing::ResumeRuns runs = testing::straight_and_resumed(c, dir, 4);
    const auto &m_straight = runs.straight_steps, &m_resumed = runs.resumed_steps;

    ASSERT_EQ(m_resumed.size(), 4u);
    for (size_t i = 0; i < 4; ++i) {
      EXPECT_EQ(m_resumed[i].step, m_straight[4 + i].step);
      EXPECT_EQ(m_resumed[i].loss, m_straight[4 + i].loss) << "step " << m_resumed[i].step;
      EXPECT_EQ(m_resumed[i].grad_norm, m_straight[4 + i].grad_norm);
    }
    const auto a = all_state(*runs.straight), b = all_state(*runs.resumed);
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_EQ(std::memcmp(a[i].raw(), b[i].raw(), a[i].nbytes()), 0) << "state tensor " << i;
    sets.pop_back();
  }
}

// Whole packing of an SFT file: resume continues bit for bit (the packer's window and row are in
// the checkpoint), and the metrics carry the padding and the routing statistics per layer.
TEST(Train, WholePackingResumeIsBitIdentical) {
  const std::string dir = fresh_dir("mt_resume_whole");
  std::filesystem::create_directories(dir);
  TokenDocuments docs;
  docs.doc_offsets = {0};
  for (int d = 0; d < 60; ++d) {
    const int len = 3 + (d * 29) % 70;  // 3 .. 72 tokens: some longer than a row of 65
    for (int i = 0; i < len; ++i) {
      docs.tokens.push_back(static_cast<uint32_t>((d * 7 + i * 3) % 256));
      docs.loss_mask.push_back(i >= len / 3);
    }
    docs.doc_offsets.push_back(docs.tokens.size());
  }
  write_token_file(dir + "/sft.tok", docs);
  std::vector<std::string> sets = short_run();
  sets.push_back("checkpoint.dir=\"" + dir + "/ckpt\"");
  sets.push_back("checkpoint.every=4");
  sets.push_back("data.source=sft");
  sets.push_back("data.path=\"" + dir + "/sft.tok\"");
  sets.push_back("data.pack_window=9");
  const Config c = load_config(kTiny, sets);
  ASSERT_EQ(c.data.resolved_packing(), Packing::kWhole);
  const testing::ResumeRuns runs = testing::straight_and_resumed(c, dir + "/ckpt", 4);
  ASSERT_EQ(runs.resumed_steps.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    const StepMetrics &a = runs.straight_steps[4 + i], &b = runs.resumed_steps[i];
    EXPECT_EQ(b.loss, a.loss) << "step " << b.step;
    EXPECT_EQ(b.grad_norm, a.grad_norm);
    EXPECT_EQ(b.pad_fraction, a.pad_fraction);
    EXPECT_LT(a.pad_fraction, 0.5);
    ASSERT_EQ(a.expert_load_max_over_mean.size(), static_cast<size_t>(c.model.n_layers));
    EXPECT_EQ(b.expert_load_max_over_mean, a.expert_load_max_over_mean);
  }
  double padding = 0;  // the windows' last rows are the least full
  for (const StepMetrics& m : runs.straight_steps) padding += m.pad_fraction;
  EXPECT_GT(padding, 0.0);
  const auto a = all_state(*runs.straight), b = all_state(*runs.resumed);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_EQ(std::memcmp(a[i].raw(), b[i].raw(), a[i].nbytes()), 0) << "state tensor " << i;
}

// The routing statistics of a layer's loads, by hand.
TEST(Train, RoutingBalanceByHand) {
  Tensor load = Tensor::zeros({4}, DType::kI64);
  load.data<int64_t>()[0] = 6;
  load.data<int64_t>()[1] = 2;
  const RoutingBalance b = routing_balance(load);  // mean 2: max 6 -> 3, two of four idle
  EXPECT_DOUBLE_EQ(b.max_over_mean, 3.0);
  EXPECT_DOUBLE_EQ(b.idle_fraction, 0.5);
  const RoutingBalance none = routing_balance(Tensor::zeros({4}, DType::kI64));
  EXPECT_EQ(none.max_over_mean, 0.0);
  EXPECT_EQ(none.idle_fraction, 1.0);
}

TEST(Train, GradientAccumulationEqualsOneBigBatch) {
  auto first_step = [](const std::vector<std::string>& extra) {
    std::vector<std::string> sets = short_run();
    sets.insert(sets.end(), extra.begin(), extra.end());
    Trainer t(parse_config_string("", sets));
    RunOptions one;
    one.steps = 1;
    return t.run(one).front();
  };
  const StepMetrics big = first_step({"train.batch_rows=4", "train.grad_accum=1"});
  const StepMetrics acc = first_step({"train.batch_rows=2", "train.grad_accum=2"});
  EXPECT_NEAR(acc.loss, big.loss, 1e-5 * big.loss);
  EXPECT_NEAR(acc.grad_norm, big.grad_norm, 1e-4 * big.grad_norm);
  EXPECT_NEAR(acc.aux_loss, big.aux_loss, 0.05 * big.aux_loss);  // per-micro-batch statistic
}

TEST(Train, CheckpointOfAnotherShapeIsRefusedAndLeavesTheModel) {
  const std::string dir = fresh_dir("mt_shape_ckpt");
  std::vector<std::string> sets = short_run();
  sets.push_back("checkpoint.dir=\"" + dir + "\"");
  Trainer small(parse_config_string("", sets));
  RunOptions two;
  two.steps = 2;
  small.run(two);

  sets.push_back("model.moe_dim=32");
  Trainer other(parse_config_string("", sets));
  const Tensor before = other.model().units()[1].groups[1].params.clone();
  RunOptions resume;
  resume.resume = dir;
  try {
    other.run(resume);
    FAIL() << "loading a checkpoint of another shape must fail";
  } catch (const CheckpointError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("layers.0.moe.w_gate_up"), std::string::npos) << msg;
    EXPECT_NE(msg.find("(8, 64, 128)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("(8, 64, 64)"), std::string::npos) << msg;
  }
  const Tensor after = other.model().units()[1].groups[1].params;
  EXPECT_EQ(std::memcmp(before.raw(), after.raw(), before.nbytes()), 0);

  // A truncated checkpoint file.
  const std::string file = dir + "/step_00000002.safetensors";
  std::filesystem::resize_file(file, std::filesystem::file_size(file) / 2);
  Trainer again(parse_config_string("", short_run()));
  resume.resume = file;
  EXPECT_THROW(again.run(resume), CheckpointError);
}

TEST(Train, SftTokenFileTrainsThroughTheCli) {
  const std::string dir = fresh_dir("mt_sft");
  std::filesystem::create_directories(dir);
  TokenDocuments docs;
  docs.doc_offsets = {0};
  for (int d = 0; d < 40; ++d) {
    for (int i = 0; i < 30; ++i) {
      docs.tokens.push_back(static_cast<uint32_t>((d * 7 + i * 3) % 256));
      docs.loss_mask.push_back(i >= 10);  // the "prompt" does not count
    }
    docs.doc_offsets.push_back(docs.tokens.size());
  }
  write_token_file(dir + "/sft.tok", docs);
  const std::string cmd = std::string(MOETRAIN_BINARY) + " train --config " + kTiny +
                          " --set data.source=sft --set data.path=" + dir +
                          "/sft.tok --set train.seq_len=64 --set train.batch_rows=2 --steps 3"
                          " --metrics " +
                          dir + "/m.jsonl";
  const testing::Proc p = testing::run_cmd(cmd);
  ASSERT_EQ(p.code, 0) << p.output;
  // sft packs whole documents and says how full its rows are; real data has no known floor,
  // and the log says nothing of one (it printed "data floor nan").
  EXPECT_NE(p.output.find("whole packing fills"), std::string::npos) << p.output;
  EXPECT_EQ(p.output.find("nan"), std::string::npos) << p.output;
  std::ifstream in(dir + "/m.jsonl");
  std::string line;
  int lines = 0;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    EXPECT_TRUE(std::isfinite(j.at("loss").get<double>()));
    if (lines++ == 0) {
      EXPECT_TRUE(j.at("loss_floor").is_null());  // unknown for real data
    }
  }
  EXPECT_EQ(lines, 3);
}

TEST(Train, NanLossStopsWithExitCode5AndKeepsCheckpoints) {
  Trainer t(parse_config_string("", short_run()));
  t.model().units()[0].groups[0].params.set_item(0, std::numeric_limits<double>::quiet_NaN());
  // Token 0 is a language marker, so its embedding row feeds the loss of every document.
  try {
    t.run({});
    FAIL() << "a NaN loss must stop training";
  } catch (const NumericalError& e) {
    EXPECT_NE(std::string(e.what()).find("step 1"), std::string::npos) << e.what();
    EXPECT_EQ(e.code(), ExitCode::kNumerical);
  }
  // Through the CLI: an lr that blows up the model ends with exit code 5, and the checkpoints
  // written before the blow-up stay complete and loadable.
  const std::string dir = fresh_dir("mt_nan_ckpt");
  const std::string cmd = std::string(MOETRAIN_BINARY) + " train --config " + kTiny +
                          " --set train.lr=1e30 --set train.grad_clip=0 --set train.warmup_steps=0"
                          " --set checkpoint.every=1 --set checkpoint.dir=" +
                          dir + " --steps 20 >/dev/null 2>&1";
  const int status = std::system(cmd.c_str());
  EXPECT_EQ(WIFEXITED(status) ? WEXITSTATUS(status) : -1, 5);
  std::ifstream latest(dir + "/latest");
  std::string name;
  ASSERT_TRUE(latest >> name) << "no checkpoint was written before the NaN";
  const SafetensorsFile f = read_safetensors(dir + "/" + name);
  EXPECT_TRUE(f.tensors.count("layers.0.attn.wq"));
  for (const auto& e : std::filesystem::directory_iterator(dir))
    EXPECT_NE(e.path().extension(), ".tmp") << e.path();
}

}  // namespace
}  // namespace mt
