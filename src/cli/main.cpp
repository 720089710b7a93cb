// The moetrain binary. Subcommands:
//   train  --config F [--set section.key=value ...] [--steps N] [--metrics P] [--resume C]
//          [--overwrite]
//   launch -n N -- train ...     : N processes on this host, one rank each (torchrun's env)
//   flops  --config F [--set ...] : parameter counts and training FLOPs per token
// Exit codes: 0 ok, 1 internal error, 2 config/usage, 3 data, 4 checkpoint, 5 NaN/Inf.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <optional>

#include "core/log.h"
#include "dist/communicator.h"
#include "dist/launcher.h"
#include "dist/socket_backend.h"
#include "model/flops.h"
#include "train/config.h"
#include "train/trainer.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/device.h"
#endif
#if MOETRAIN_HAS_NCCL
#include "dist/nccl_backend.h"
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

// Resolves hardware.device: "auto" takes the GPU when one is visible and the run is one rank
// in f32 (f64 is a CPU-only check mode), and NCCL with one GPU per process when launched
// (`moetrain launch` or torchrun) with at least as many visible GPUs as ranks: every rank of a
// one-host job sees the same counts, so all decide alike. Several hosts: say "cuda" explicitly.
void choose_device(mt::Config& c, const std::optional<mt::dist::Rendezvous>& rdv) {
  const bool launched = rdv.has_value();
  int gpus = 0;
#if MOETRAIN_HAS_CUDA
  gpus = mt::cuda::device_count();
#endif
  if (c.hardware.device == "cuda" && gpus == 0)
    throw mt::ConfigError(
        "config: hardware.device = \"cuda\" but no GPU is visible (valid here: auto, cpu)");
  if (c.hardware.device == "cuda" && c.parallel.world > 1) {
#if MOETRAIN_HAS_NCCL
    if (!launched)
      throw mt::ConfigError(fmt::format(
          "config: hardware.device = \"cuda\" with parallel.world = {} needs one process per "
          "GPU: moetrain launch -n {} -- train ... (or torchrun)",
          c.parallel.world, c.parallel.world));
#else
    throw mt::ConfigError(fmt::format(
        "config: hardware.device = \"cuda\" with parallel.world = {} needs NCCL, which this "
        "build lacks (valid: parallel.world = 1, or hardware.device = \"cpu\")",
        c.parallel.world));
#endif
  }
  if (c.hardware.device != "auto") return;
  const bool f32 = c.model.compute_dtype == mt::DType::kF32;
  bool gpu_ok = gpus > 0 && c.parallel.world == 1 && f32;
#if MOETRAIN_HAS_NCCL
  if (launched && f32 && rdv->world <= gpus) gpu_ok = true;  // one GPU per rank, over NCCL
#endif
  c.hardware.device = gpu_ok ? "cuda" : "cpu";
#if MOETRAIN_HAS_CUDA
  if (gpu_ok && (!launched || rdv->rank == 0))
    mt::log::info("running on {} (bf16 compute, fp32 master weights){}", mt::cuda::device_name(0),
                  c.parallel.world > 1 ? fmt::format(", {} ranks over NCCL", c.parallel.world)
                                       : std::string());
  else if (gpus > 0 && !gpu_ok)
    mt::log::info(
        "GPU present; running on the CPU (in-process ranks, more ranks than GPUs, or f64)");
#endif
}

// The memory the parameters and their training state need at the least, against what this
// machine has, before anything is allocated: a size that cannot fit stops here with the estimate
// instead of minutes later with bad_alloc. Activations and workspaces come on top, so passing
// this check is necessary, not sufficient (out of GPU memory later exits 6 with the details).
void check_memory(const mt::Config& c) {
  const double params = static_cast<double>(mt::count_params(c.model).total);
  const double world = static_cast<double>(c.parallel.world);
  double need = 0, have = 0;
  const char* where = "";
  if (c.hardware.device == "cuda") {
#if MOETRAIN_HAS_CUDA
    // fp32 master weights, gradients and two AdamW moments sharded over the ranks (16 bytes),
    // and a bf16 compute copy of at least one unit's worth (counted as nothing here).
    need = params * 16 / world;
    have = static_cast<double>(mt::cuda::device_memory_bytes());
    where = "GPU";
#endif
  } else {
    // Weights, gradients and two AdamW moments in the compute dtype; CPU ranks share one host.
    need = params * 4 * static_cast<double>(mt::dtype_size(c.model.compute_dtype));
    have =
        static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
    where = "host";
  }
  if (have > 0 && need > have)
    throw mt::ConfigError(fmt::format(
        "config: {:.3g} parameters need at least {:.1f} GiB for weights, gradients and AdamW "
        "moments, more than this {}'s {:.1f} GiB; fewer layers (model.n_layers), experts "
        "(model.n_experts), a smaller model.dim, model.moe_dim or model.vocab_size, or more ranks "
        "(parallel.world) need less",
        params, need / (1 << 30), where, have / (1 << 30)));
}

int run_train(const ConfigArgs& a, mt::RunOptions opt) {
  // Started by `moetrain launch` or torchrun: one process per rank, the world from the env.
  std::optional<mt::dist::Rendezvous> rdv;
  std::vector<std::string> overrides = a.overrides;
  if (mt::dist::launched_by_env()) {
    rdv = mt::dist::rendezvous_from_env();
    mt::log::set_rank(rdv->rank);
    overrides.insert(overrides.begin(), fmt::format("parallel.world={}", rdv->world));
  }
  mt::Config c = mt::load_config(a.path, overrides);
  if (rdv && c.parallel.world != rdv->world)
    throw mt::ConfigError(fmt::format("config: parallel.world = {} but WORLD_SIZE = {}",
                                      c.parallel.world, rdv->world));
  choose_device(c, rdv);
  check_memory(c);
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
  } else if (rdv) {
    const auto world = mt::dist::connect_socket_world(*rdv);
#if MOETRAIN_HAS_NCCL
    if (c.hardware.device == "cuda") {  // NCCL on the GPUs; TCP carried its id
      const auto gpus = mt::dist::connect_nccl_world(*rdv, *world);
      train(gpus.get());
      return 0;
    }
#endif
    train(world.get());
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
  std::printf(
      "{\"params\": %lld, \"active_params\": %.0f, \"seq_len\": %lld, "
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
  bool overwrite = false;
  mt::RunOptions run_opt;
  CLI::App* train = app.add_subcommand("train", "train a model");
  add_config_options(train, train_cfg);
  train->add_option("--steps", steps, "stop after this step (the LR schedule keeps train.steps)")
      ->check(CLI::PositiveNumber);
  train->add_option("--metrics", run_opt.metrics_path,
                    "append one JSON object per step to this file");
  train->add_option("--resume", run_opt.resume,
                    "checkpoint file, or a checkpoint directory's latest");
  train->add_flag("--overwrite", overwrite,
                  "start a new run in a checkpoint.dir that already holds checkpoints");
  mt::dist::LaunchOptions launch_opt;
  CLI::App* launch =
      app.add_subcommand("launch", "start N ranks on this host: launch -n N -- train ...");
  launch->add_option("-n,--nproc", launch_opt.nproc, "processes (ranks)")->required();
  launch->add_option("--master-port", launch_opt.master_port,
                     "rendezvous port (default: a free one)");
  launch->add_option("args", launch_opt.args, "the moetrain command of every rank")->required();
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
    if (*train) {
      if (steps > 0) run_opt.steps = steps;
      if (overwrite) run_opt.existing = mt::ExistingCheckpoints::kOverwrite;
      return run_train(train_cfg, run_opt);
    }
    if (*launch) return mt::dist::launch_local(launch_opt);
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
