// The moetrain binary. Subcommands:
//   train  --config F [--set section.key=value ...] [--steps N] [--metrics P] [--resume C]
//   flops  --config F [--set ...] : parameter counts and training FLOPs per token
// Exit codes: 0 ok, 1 internal error, 2 config/usage, 3 data, 4 checkpoint, 5 NaN/Inf.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>

#include "core/log.h"
#include "dist/communicator.h"
#include "model/flops.h"
#include "train/config.h"
#include "train/trainer.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/device.h"
#endif

namespace {

struct ConfigArgs {
  std::string path;
  std::vector<std::string> overrides;
};

void add_config_options(CLI::App* cmd, ConfigArgs& a) {
  cmd->add_option("--config", a.path, "TOML config (configs/*.toml)");
  cmd->add_option("--set", a.overrides, "override: section.key=value (repeatable)");
}

// The GPU backend is issue 4; until it lands, a GPU is reported and the CPU engine runs.
void choose_device(const mt::Config& c) {
  int gpus = 0;
#if MOETRAIN_HAS_CUDA
  gpus = mt::cuda::device_count();
#endif
  if (c.hardware.device == "cuda")
    throw mt::ConfigError(
        "config: hardware.device = \"cuda\": the CUDA backend is not built yet (valid now: auto, "
        "cpu)");
  if (gpus > 0 && c.hardware.device == "auto") {
#if MOETRAIN_HAS_CUDA
    mt::log::warn("found {} GPU(s) ({}), but the CUDA backend is not built yet: running on the CPU",
                  gpus, mt::cuda::device_name(0));
#endif
  }
}

int run_train(const ConfigArgs& a, int64_t steps, const std::string& metrics,
              const std::string& resume) {
  const mt::Config c = mt::load_config(a.path, a.overrides);
  choose_device(c);
  mt::RunOptions opt;
  if (steps > 0) opt.steps = steps;
  opt.metrics_path = metrics;
  opt.resume = resume;
  opt.progress_bar = isatty(fileno(stderr));
  auto train = [&](mt::dist::Communicator* world) {
    mt::Trainer trainer(c, world);
    const auto m = trainer.run(opt);
    if (!m.empty() && (!world || world->rank() == 0))
      mt::log::info("done: {} steps, final loss {:.4f} (data floor {:.4f}, unigram {:.4f})",
                    m.back().step, m.back().loss, trainer.data_stats().loss_floor,
                    trainer.data_stats().unigram_entropy);
  };
  if (c.parallel.world == 1) {
    train(nullptr);
  } else {
    // CPU ranks as threads of this process (the in-process backend).
    mt::dist::run_in_process(static_cast<int>(c.parallel.world),
                             [&](mt::dist::Communicator& world) { train(&world); });
  }
  return 0;
}

int run_flops(const ConfigArgs& a) {
  const mt::Config c = mt::load_config(a.path, a.overrides);
  const mt::ParamCounts p = mt::count_params(c.model);
  std::printf("{\"params\": %lld, \"active_params\": %.0f, \"seq_len\": %lld, "
              "\"train_flops_per_token\": %.6e}\n",
              static_cast<long long>(p.total), p.active, static_cast<long long>(c.train.seq_len),
              mt::train_flops_per_token(c.model, c.train.seq_len));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"moetrain: Mixture-of-Experts training engine"};
  app.require_subcommand(1);
  ConfigArgs train_cfg, flops_cfg;
  int64_t steps = 0;
  std::string metrics, resume;
  CLI::App* train = app.add_subcommand("train", "train a model");
  add_config_options(train, train_cfg);
  train->add_option("--steps", steps, "stop after this step (the LR schedule keeps train.steps)");
  train->add_option("--metrics", metrics, "append one JSON object per step to this file");
  train->add_option("--resume", resume, "checkpoint file, or a checkpoint directory's latest");
  CLI::App* flops = app.add_subcommand("flops", "parameter counts and FLOPs per token");
  add_config_options(flops, flops_cfg);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::fprintf(stderr, "moetrain: %s (see --help)\n", e.what());
    return static_cast<int>(mt::ExitCode::kConfig);
  }
  try {
    if (*train) return run_train(train_cfg, steps, metrics, resume);
    if (*flops) return run_flops(flops_cfg);
  } catch (const mt::Error& e) {
    std::fprintf(stderr, "moetrain: %s\n", e.what());
    return static_cast<int>(e.code());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moetrain: internal error: %s\n", e.what());
    return static_cast<int>(mt::ExitCode::kInternal);
  }
  return 0;
}
