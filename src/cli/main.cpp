// The moetrain binary. Subcommands:
//   train  --config F [--set section.key=value ...] [--steps N] [--metrics P] [--resume C]
//          [--overwrite] [--init-from HF_DIR] [--export-hf OUT_DIR]
//   eval --config F (--resume C | --init-from HF_DIR) --data TOKENS [--per-token OUT.jsonl] :
//        forward-only mean loss (and each token's)
//   export-hf --config F --resume C --out DIR [--dtype bf16|f32] : a Hugging Face directory
//   launch -n N -- train ...     : N processes on this host, one rank each (torchrun's env)
//   flops  --config F [--set ...] : parameter counts and training FLOPs per token
// Exit codes: 0 ok, 1 internal error, 2 config/usage, 3 data, 4 checkpoint, 5 NaN/Inf, 6 out of
// GPU memory, 7 stopped by a signal (SIGTERM, SIGINT, SIGUSR1) with its checkpoint written.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>

#include "core/atomic_file.h"
#include "core/log.h"
#include "core/mapped_file.h"
#include "core/parse.h"
#include "dist/communicator.h"
#include "dist/launcher.h"
#include "dist/socket_backend.h"
#include "model/flops.h"
#include "model/memory.h"
#include "train/config.h"
#include "train/evaluate.h"
#include "train/hf_export.h"
#include "train/hf_import.h"
#include "train/stop_request.h"
#include "train/token_file.h"
#include "train/trainer.h"
#if MOETRAIN_HAS_CUDA
#include "core/cuda/device.h"
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
  [[maybe_unused]] const bool launched = rdv.has_value();  // read where NCCL and CUDA are
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
  mt::ModelConfig m = c.model;
  double have = 0;
  const char* where = "host";
  if (c.hardware.device == "cuda") {
#if MOETRAIN_HAS_CUDA
    have = static_cast<double>(mt::cuda::device_memory_bytes());
    where = "GPU";
    m.device = mt::Device::kCUDA;
#endif
  } else {
    have =
        static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
  }
  const mt::MemoryEstimate e =
      mt::estimate_memory(m, c.parallel, c.train.batch_rows * c.train.seq_len);
  const double params = static_cast<double>(mt::count_params(c.model).total);
  const double states = e.states, activations = e.activations, workspaces = e.workspaces;
  const double need = states + activations + workspaces;
  if (have > 0 && need > have)
    throw mt::ConfigError(fmt::format(
        "config: this run needs at least {:.1f} GiB on the {} ({:.3g} parameters' weights, "
        "gradients and AdamW moments {:.1f} GiB; activations of {} tokens per micro-batch with "
        "model.checkpoint = \"{}\" {:.1f} GiB; workspaces {:.1f} GiB), more than its {:.1f} "
        "GiB. Less: "
        "model.checkpoint = \"selective\" or \"full\", fewer tokens per micro-batch "
        "(train.batch_rows, train.seq_len), model.loss_chunk_tokens, fewer layers "
        "(model.n_layers) or experts (model.n_experts), a smaller model.dim, model.moe_dim or "
        "model.vocab_size, or more ranks (parallel.world)",
        need / (1 << 30), where, params, states / (1 << 30), c.train.batch_rows * c.train.seq_len,
        mt::policy_name(c.model.checkpoint), activations / (1 << 30), workspaces / (1 << 30),
        have / (1 << 30)));
}

// The config with the launch's world and the device chosen, and the ranks to run `fn` on: one
// (null), the launched processes (TCP, then NCCL on the GPUs), or threads of this process.
struct Ranks {
  mt::Config config;
  std::optional<mt::dist::Rendezvous> rdv;
};

Ranks prepare_ranks(const ConfigArgs& a, const std::string& init_from) {
  // Started by `moetrain launch` or torchrun: one process per rank, the world from the env.
  Ranks r;
  std::vector<std::string> overrides = a.overrides;
  if (mt::dist::launched_by_env()) {
    r.rdv = mt::dist::rendezvous_from_env();
    mt::log::set_rank(r.rdv->rank);
    overrides.insert(overrides.begin(), fmt::format("parallel.world={}", r.rdv->world));
  }
  r.config = mt::load_config(a.path, overrides);
  mt::Config& c = r.config;
  if (!init_from.empty()) c.model = mt::hf_architecture(init_from, c.model);
  if (r.rdv && c.parallel.world != r.rdv->world)
    throw mt::ConfigError(fmt::format("config: parallel.world = {} but WORLD_SIZE = {}",
                                      c.parallel.world, r.rdv->world));
  choose_device(c, r.rdv);
  return r;
}

void on_ranks(const Ranks& r, const std::function<void(mt::dist::Communicator*)>& fn) {
  const mt::Config& c = r.config;
  if (c.parallel.world == 1) {
    fn(nullptr);
  } else if (r.rdv) {
    const auto world = mt::dist::connect_socket_world(*r.rdv);
#if MOETRAIN_HAS_NCCL
    if (c.hardware.device == "cuda") {  // NCCL on the GPUs; TCP carried its id
      const auto gpus = mt::dist::connect_nccl_world(*r.rdv, *world);
      fn(gpus.get());
      return;
    }
#endif
    fn(world.get());
  } else {
    // CPU ranks as threads of this process (the in-process backend).
    mt::dist::run_in_process(static_cast<int>(c.parallel.world),
                             [&](mt::dist::Communicator& world) { fn(&world); });
  }
}

int run_train(const ConfigArgs& a, mt::RunOptions opt) {
  const Ranks r = prepare_ranks(a, opt.init_from);
  check_memory(r.config);
  mt::install_stop_handlers(r.config.checkpoint.signal_deadline_s);
  mt::install_mapped_file_fault_handler();
  opt.progress_bar = isatty(fileno(stderr));
  on_ranks(r, [&](mt::dist::Communicator* world) {
    mt::Trainer trainer(r.config, world);
    const auto m = trainer.run(opt);
    if (!m.empty() && (!world || world->rank() == 0)) {
      const mt::DataStats& s = trainer.data_stats();
      // A known floor is the synthetic languages'; real data has none to print.
      mt::log::info("done: {} steps, final loss {:.4f} ({}unigram entropy {:.4f})", m.back().step,
                    m.back().loss,
                    std::isfinite(s.loss_floor) ? fmt::format("data floor {:.4f}, ", s.loss_floor)
                                                : std::string(),
                    s.unigram_entropy);
    }
  });
  return 0;
}

// eval: the mean loss over every counted target of a token file, from a checkpoint or an HF
// directory; one JSON line last. --per-token: each counted target's loss as a JSON line
// {"doc", "pos", "token", "loss"} (document, index in it, token id), in file order, written to
// OUT.tmp and renamed to OUT when complete.
int run_eval(const ConfigArgs& a, const std::string& resume, const std::string& init_from,
             const std::string& data, const std::string& per_token) {
  if (resume.empty() == init_from.empty())
    throw mt::ConfigError("eval: give one of --resume CKPT or --init-from HF_DIR");
  const Ranks r = prepare_ranks(a, init_from);
  check_memory(r.config);
  mt::install_mapped_file_fault_handler();
  if (!per_token.empty()) {  // checked before the model loads: exit 2 with the system's reason
    const std::filesystem::path parent = std::filesystem::path(per_token).parent_path();
    if (const auto why = mt::cannot_write_in(parent.empty() ? "." : parent.string(),
                                             fmt::format(".moetrain_write_test_{}", ::getpid())))
      throw mt::ConfigError(
          fmt::format("eval: cannot write --per-token '{}': {}", per_token, *why));
  }
  const mt::MappedTokenFile file(data, r.config.model.vocab_size);
  const mt::TokenView& docs = file.view();
  on_ranks(r, [&](mt::dist::Communicator* world) {
    mt::Trainer trainer(r.config, world);
    if (!resume.empty()) trainer.resume(resume);
    if (!init_from.empty()) mt::load_hf_weights(init_from, trainer.model());
    const bool writes = !world || world->rank() == 0;
    std::ofstream out;
    const std::string tmp = per_token + ".tmp";
    if (!per_token.empty() && writes) {
      out.open(tmp);
      if (!out) throw mt::DataError(fmt::format("eval: cannot write '{}'", tmp));
    }
    const mt::TokenLossSink sink = [&](int64_t target, double loss) {
      const int64_t doc = std::upper_bound(docs.doc_offsets, docs.doc_offsets + docs.num_docs + 1,
                                           static_cast<uint64_t>(target)) -
                          docs.doc_offsets - 1;
      out << fmt::format("{{\"doc\": {}, \"pos\": {}, \"token\": {}, \"loss\": {}}}\n", doc,
                         target - static_cast<int64_t>(docs.doc_offsets[doc]), docs.tokens[target],
                         loss);
    };
    const mt::EvalResult e = mt::evaluate_tokens(trainer.model(), docs, r.config.train.batch_rows,
                                                 r.config.train.seq_len, world,
                                                 per_token.empty() ? nullptr : &sink, data);
    if (!per_token.empty() && writes) {
      out.close();
      if (!out || std::rename(tmp.c_str(), per_token.c_str()) != 0)
        throw mt::DataError(fmt::format("eval: cannot write '{}'", per_token));
    }
    if (writes) {
      nlohmann::ordered_json j{{"eval", data},
                               {"from", resume.empty() ? init_from : resume},
                               {"loss", e.mean()},
                               {"tokens", e.tokens}};
      std::printf("%s\n", j.dump().c_str());
      std::fflush(stdout);
    }
  });
  return 0;
}

// export-hf: the checkpoint's parameters as a Hugging Face directory (train/hf_export.h), from
// as many ranks as wrote it.
int run_export_hf(const ConfigArgs& a, const std::string& resume, const std::string& out,
                  const std::string& dtype_name) {
  mt::DType dtype;
  if (!mt::parse_dtype(dtype_name, &dtype) ||
      (dtype != mt::DType::kBF16 && dtype != mt::DType::kF32))
    throw mt::ConfigError(fmt::format("export-hf: --dtype {} (valid: bf16, f32)", dtype_name));
  if (std::error_code ec; std::filesystem::exists(out, ec) && !std::filesystem::is_directory(out))
    throw mt::ConfigError(
        fmt::format("export-hf: --out '{}' is a file; it names a directory to write", out));
  const Ranks r = prepare_ranks(a, "");
  check_memory(r.config);
  on_ranks(r, [&](mt::dist::Communicator* world) {
    mt::Trainer trainer(r.config, world);
    trainer.resume(resume);
    mt::export_hf(trainer.model(), out, dtype, world);
    if (!world || world->rank() == 0)
      mt::log::info("exported '{}' (step {}) to '{}' as {}", resume, trainer.step(), out,
                    dtype_name);
  });
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
      ->check(CLI::Validator(
          [](const std::string& v) -> std::string {
            const std::optional<int64_t> n = mt::parse_int64(v);
            return n && *n > 0 ? std::string() : "--steps must be a positive integer";
          },
          "POSITIVE"));
  train->add_option("--metrics", run_opt.metrics_path,
                    "append one JSON object per step to this file");
  train->add_option("--resume", run_opt.resume,
                    "checkpoint file, or a checkpoint directory's latest");
  train->add_flag("--overwrite", overwrite,
                  "start a new run in a checkpoint.dir that already holds checkpoints");
  train->add_option("--init-from", run_opt.init_from,
                    "start from a Hugging Face Qwen3-MoE directory (config.json + safetensors)");
  train->add_option("--export-hf", run_opt.export_hf,
                    "after the last step, write the weights as a Hugging Face directory (bf16)");
  mt::dist::LaunchOptions launch_opt;
  CLI::App* launch =
      app.add_subcommand("launch", "start N ranks on this host: launch -n N -- train ...");
  launch->add_option("-n,--nproc", launch_opt.nproc, "processes (ranks)")->required();
  launch->add_option("--master-port", launch_opt.master_port,
                     "rendezvous port (default: a free one)");
  launch->add_option("args", launch_opt.args, "the moetrain command of every rank")->required();
  ConfigArgs export_cfg;
  std::string export_resume, export_out, export_dtype = "bf16";
  CLI::App* export_hf =
      app.add_subcommand("export-hf", "write a checkpoint as a Hugging Face Qwen3-MoE directory");
  add_config_options(export_hf, export_cfg);
  export_hf->add_option("--resume", export_resume, "checkpoint file or directory")->required();
  export_hf->add_option("--out", export_out, "the directory to write")->required();
  export_hf->add_option("--dtype", export_dtype, "bf16 (default) or f32");
  ConfigArgs eval_cfg;
  std::string eval_resume, eval_init, eval_data, eval_per_token;
  CLI::App* eval = app.add_subcommand("eval", "the mean loss over a token file (forward only)");
  add_config_options(eval, eval_cfg);
  eval->add_option("--resume", eval_resume, "checkpoint file or directory");
  eval->add_option("--init-from", eval_init, "a Hugging Face Qwen3-MoE directory");
  eval->add_option("--data", eval_data, "token file (docs/data_format.md)")->required();
  eval->add_option("--per-token", eval_per_token,
                   "write each counted token's loss here, as JSON lines {doc, pos, token, loss}");
  CLI::App* flops = app.add_subcommand("flops", "parameter counts and FLOPs per token");
  add_config_options(flops, flops_cfg);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::string commands;
    bool known = false;
    const std::string first = argc > 1 ? argv[1] : "";
    for (const CLI::App* sub : app.get_subcommands({})) {
      commands += (commands.empty() ? "" : ", ") + sub->get_name();
      known |= sub->get_name() == first;
    }
    if (argc > 1 && !first.starts_with("-") && !known)
      std::fprintf(stderr, "moetrain: unknown command '%s' (valid: %s)\n",
                   first.substr(0, 80).c_str(), commands.c_str());
    else
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
    if (*eval) return run_eval(eval_cfg, eval_resume, eval_init, eval_data, eval_per_token);
    if (*export_hf) return run_export_hf(export_cfg, export_resume, export_out, export_dtype);
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
