#include "train/trainer.h"

#include <omp.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string_view>

#include "core/atomic_file.h"
#include "core/log.h"
#include "core/profile.h"
#include "model/context_parallel.h"
#include "model/flops.h"
#include "model/precision.h"
#include "train/checkpoint.h"
#include "train/evaluate.h"
#include "train/hf_export.h"
#include "train/hf_import.h"
#include "train/stop_request.h"
#if MOETRAIN_HAS_CUDA
#include "core/cuda/device.h"
#endif

namespace mt {

namespace {

double cpu_ghz() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("cpu MHz", 0) == 0) return std::stod(line.substr(line.find(':') + 1)) / 1000.0;
  return 2.5;
}

nlohmann::json finite_or_null(double v) {
  return std::isfinite(v) ? nlohmann::json(v) : nullptr;
}

void write_progress(int64_t step, int64_t total, const StepMetrics& m) {
  constexpr int kWidth = 30;
  const int filled = static_cast<int>(kWidth * step / std::max<int64_t>(total, 1));
  std::string bar(filled, '#');
  bar.append(kWidth - filled, '.');
  std::fprintf(stderr, "\r[%s] %lld/%lld loss %.4f", bar.c_str(), static_cast<long long>(step),
               static_cast<long long>(total), m.loss);
  if (step == total) std::fprintf(stderr, "\n");
  std::fflush(stderr);
}

// The phases that left the step's high-water mark, innermost first ("gpu.x < moe.backward < ..."):
// where the step's memory peaked.
std::string peak_phases(const std::vector<std::pair<std::string, int64_t>>& peaks, int64_t peak) {
  std::string chain;
  for (const auto& [name, bytes] : peaks)
    if (bytes == peak) chain += (chain.empty() ? "" : " < ") + name;
  return chain.empty() ? "no phase" : chain;
}
int64_t cuda_peak_bytes() {
  return memory_stats(Device::kCUDA).peak_bytes;
}
int64_t cpu_peak_bytes() {
  return memory_stats(Device::kCPU).peak_bytes;
}

}  // namespace

RoutingBalance routing_balance(const Tensor& load) {
  const int64_t e = load.numel();
  int64_t total = 0, most = 0, idle = 0;
  for (int64_t i = 0; i < e; ++i) {
    const int64_t n = load.data<int64_t>()[i];
    total += n;
    most = std::max(most, n);
    idle += n == 0;
  }
  const double mean = static_cast<double>(total) / static_cast<double>(e);
  return {mean > 0 ? static_cast<double>(most) / mean : 0.0,
          static_cast<double>(idle) / static_cast<double>(e)};
}

double peak_flops(const HardwareConfig& h) {
  if (h.peak_tflops > 0) return h.peak_tflops * 1e12;
  const int threads = h.threads > 0 ? static_cast<int>(h.threads) : omp_get_max_threads();
  return threads * 32.0 * cpu_ghz() * 1e9;
}

Trainer::Trainer(const Config& c, dist::Communicator* world) : cfg_(c), world_(world) {
  if (c.hardware.threads > 0) omp_set_num_threads(static_cast<int>(c.hardware.threads));
  cfg_.model.device = c.hardware.device == "cuda" ? Device::kCUDA : Device::kCPU;
  cfg_.model.cuda_graphs = c.hardware.cuda_graphs;
  profile::set_peak_probe(cfg_.model.on_gpu() ? &cuda_peak_bytes : &cpu_peak_bytes);
#if MOETRAIN_HAS_CUDA
  if (cfg_.model.on_gpu()) {
    profile::set_device_sync(&cuda::synchronize);
    cuda::use_device_clock();
  }
#endif
  MT_CHECK(world_size() == c.parallel.world, "communicator of {} ranks for parallel.world = {}",
           world_size(), c.parallel.world);
  if (world_) {
    mesh_ = std::make_unique<dist::DeviceMesh>(*world_, c.parallel.mesh(), c.model.n_experts);
  }
  draw_run_id();
  if (mesh_ && c.parallel.device_exchange()) reserve_exchange(c);
  model_ = std::make_unique<Qwen3Moe>(cfg_.model, c.train.seed, mesh_.get(), c.parallel);
  opt_ = std::make_unique<AdamW>(model_->units(), c.train, world_);
  opt_->use_cuda_graphs(cfg_.model.on_gpu() && c.hardware.cuda_graphs);
  opt_->update_beside_passes(cfg_.model.on_gpu() && c.hardware.overlap_optimizer);
  if (cfg_.model.on_gpu() && c.hardware.cuda_graphs && c.parallel.ep > 1 &&
      c.parallel.ep_exchange == moe::ExchangeMode::kHostCounts && is_rank0())
    log::info(
        "CUDA graphs: the optimizer step only; the training passes run eagerly with "
        "parallel.ep_exchange = \"host\" (the expert exchange reads its row counts on the host)");
  data_ = make_data_loader(c);
  if (c.checkpoint.async && !c.checkpoint.dir.empty())
    writer_ = std::make_unique<AsyncCheckpointWriter>(world_, c.checkpoint.keep, attempt_id_);
  if (c.eval.every > 0)
    eval_docs_ = std::make_unique<MappedTokenFile>(c.eval.data, c.model.vocab_size);
  stats_ = data_->stats(c.train.seq_len);
  packing_report_ = data_->packing_report(c.train.seq_len);
  flops_per_token_ = train_flops_per_token(c.model, c.train.seq_len);
  // In-process CPU ranks share one host: each rank's share of the host's peak. A GPU without
  // hardware.peak_tflops is measured against the H200's dense bf16 rate (989 TFLOP/s).
  peak_flops_ = cfg_.model.on_gpu() && c.hardware.peak_tflops <= 0
                    ? 989e12
                    : peak_flops(c.hardware) / world_size();
}

void Trainer::resume(const std::string& path) {
  opt_->wait_for_update();
  const TrainState st = load_checkpoint(path, *model_, *opt_, world_);
  step_ = st.step;
  if (st.run_id != 0) run_id_ = st.run_id;
  data_->set_state(st.data_position);
  if (is_rank0()) log::info("resumed from '{}' at step {}", path, step_);
}

std::string Trainer::save(const std::string& dir) {
  opt_->wait_for_update();
  if (writer_ && dir == cfg_.checkpoint.dir)
    return writer_->save(dir, *model_, *opt_, {step_, data_->state(), run_id_});
  return save_checkpoint(dir, *model_, *opt_, {step_, data_->state(), run_id_}, world_,
                         cfg_.checkpoint.keep);
}

bool Trainer::any_rank(bool mine) const {
  Tensor flag = Tensor::zeros({1}, DType::kI64);
  flag.data<int64_t>()[0] = mine;
  if (world_) world_->all_reduce(flag);
  return flag.data<int64_t>()[0] != 0;
}

void Trainer::finish_saves() {
  if (!writer_) return;
  std::string problem;
  ExitCode code = ExitCode::kIo;
  try {
    writer_->wait();
  } catch (const Error& e) {
    problem = e.what();
    code = e.code();
  }
  if (!any_rank(!problem.empty())) return;
  if (problem.empty())
    throw IoError("a checkpoint write failed on another rank (its message names it)");
  if (code == ExitCode::kNumerical) throw NumericalError(problem);
  throw IoError(problem);
}

// A run's id: rank 0 draws 63 random bits (never 0), every rank gets them (a resume takes the
// checkpoint's instead).
void Trainer::draw_run_id() {
  Tensor id = Tensor::zeros({2}, DType::kI64);  // the run, and this start of it
  if (!world_ || world_->rank() == 0) {
    std::random_device rd;
    for (int i = 0; i < 2; ++i) {
      const uint64_t bits = (uint64_t{rd()} << 32 | rd()) >> 1;
      id.data<int64_t>()[i] = static_cast<int64_t>(bits == 0 ? 1 : bits);
    }
  }
  if (world_ && world_->size() > 1) world_->all_reduce(id);
  run_id_ = id.data<int64_t>()[0];
  attempt_id_ = id.data<int64_t>()[1];
}

// The device exchange's receive buffer, for its largest exchange (a micro-batch's tokens from
// every EP rank with their choices, counts and routing weights), registered now, before any pass
// is captured.
void Trainer::reserve_exchange(const Config& c) {
  const int64_t tokens = c.train.batch_rows * c.train.seq_len / c.parallel.cp;  // this rank's
  const size_t bytes = moe::ExpertExchange::window_bytes(
      static_cast<int>(c.parallel.ep), tokens, c.model.top_k, c.model.n_experts, c.model.dim,
      cfg_.model.activation_dtype(), plan_precision(c.model, c.parallel).experts);
  std::string why;
  const size_t got =
      mesh_->ep().reserve_peer_window(bytes, static_cast<int>(c.parallel.ep_exchange_ctas), &why);
  if (!is_rank0()) return;
  if (got > 0)
    log::info(
        "expert exchange: device-initiated, {:.1f} MiB receive buffer per rank ({} ranks x "
        "{} tokens x dim {}), {} thread blocks",
        static_cast<double>(got) / (1 << 20), c.parallel.ep, tokens, c.model.dim,
        c.parallel.ep_exchange_ctas);
  else
    log::info("expert exchange: counts on the device, rows through all-to-all ({})", why);
}

// Data-parallel rank d (world rank / cp) takes rows [d * rows, (d + 1) * rows) of each global
// micro-batch of dp * rows rows, so any mesh sees the same global batches as one rank with
// dp * rows rows; under context parallelism the cp ranks of a group share those rows, each
// holding its chunks of every row (context_shard).
Batch Trainer::next_local_batch() {
  const TrainConfig& t = cfg_.train;
  const int d = mesh_ ? mesh_->dp_rank() : 0;
  data_->skip(d * t.batch_rows, t.seq_len);
  Batch b = data_->next(t.batch_rows, t.seq_len);
  data_->skip((dp_size() - 1 - d) * t.batch_rows, t.seq_len);
  if (mesh_ && mesh_->cp_size() > 1)
    b = context_shard(b, t.seq_len, mesh_->cp_size(), mesh_->cp_rank());
  return cfg_.model.on_gpu() ? b.to(Device::kCUDA) : b;
}

namespace {
// Test hook for failure handling: MOETRAIN_FAULT_EXIT="<rank>:<step>" makes that rank's process
// exit with code 17 right after that step, as a crashed rank would (no cleanup, no goodbye);
// "<rank>:<step>:pass" makes it exit within that step instead, after the step's first collective
// (the token count) and before its training pass, so that its peers are left in the pass.
enum class FaultPoint { kAfterStep, kBeforePass };
struct Fault {
  int rank = -1;
  long long step = -1;
  FaultPoint point = FaultPoint::kAfterStep;
};
void maybe_inject_fault(int rank, int64_t step, FaultPoint at) {
  static const Fault fault = [] {  // read once: the environment does not change mid-run
    Fault f;
    const char* spec = std::getenv("MOETRAIN_FAULT_EXIT");
    char where[8] = {};
    const int fields = spec ? std::sscanf(spec, "%d:%lld:%7s", &f.rank, &f.step, where) : 0;
    if (fields < 2) f.rank = -1;
    if (fields == 3 && std::string_view(where) == "pass") f.point = FaultPoint::kBeforePass;
    return f;
  }();
  if (fault.rank == rank && fault.step == step && fault.point == at) std::_Exit(17);
}
}  // namespace

std::optional<StepMetrics> Trainer::train_step() {
  const TrainConfig& t = cfg_.train;
  const DataState data_before = data_->state();
  const auto start = std::chrono::steady_clock::now();
  reset_peak_memory(cfg_.model.device);
  const MemoryStats memory_before = memory_stats(cfg_.model.device);
  StepMetrics m;
  m.step = step_ + 1;
  m.lr = learning_rate(t, m.step);
  model_->zero_grad();

  // Every micro-batch's loss is normalised by the step's total count of counted tokens, so
  // accumulation gives the gradient of one big batch.
  std::vector<Batch> micro;
  // Counted targets, padding tokens, the ranks asked to stop, and those whose asynchronous
  // checkpoint failed: the step's first collective is where they agree (stop_request.h).
  Tensor counted_all = Tensor::zeros({4}, DType::kI64);
  counted_all.data<int64_t>()[2] = stop_requested() != 0;
  counted_all.data<int64_t>()[3] = writer_ && writer_->failed();
  {
    const profile::Phase phase("data");
    for (int64_t i = 0; i < t.grad_accum; ++i) {
      micro.push_back(next_local_batch());
      counted_all.data<int64_t>()[0] += micro.back().masked_tokens();
      counted_all.data<int64_t>()[1] += micro.back().padding_tokens;
    }
  }
  if (world_) world_->all_reduce(counted_all);
  if (counted_all.data<int64_t>()[3] > 0) {
    writer_->wait();  // throws this rank's error
    throw IoError(
        fmt::format("step {}: a checkpoint write failed on another rank (its message "
                    "names it)",
                    m.step));
  }
  if (counted_all.data<int64_t>()[2] > 0) {
    data_->set_state(data_before);
    return std::nullopt;
  }
  maybe_inject_fault(world_ ? world_->rank() : 0, m.step, FaultPoint::kBeforePass);
  const int64_t counted = counted_all.data<int64_t>()[0];
  m.pad_fraction = static_cast<double>(counted_all.data<int64_t>()[1]) /
                   static_cast<double>(t.tokens_per_step() * dp_size());
  const LossScale scale{1.0 / std::max<int64_t>(counted, 1),
                        cfg_.model.aux_loss_coef / static_cast<double>(t.grad_accum)};
  Tensor ce = Tensor::zeros({1}, DType::kF64);
  double aux = 0;  // the aux statistics are global already: the same on every rank
  for (const Batch& b : micro) {
    const MicroBatchLosses l = model_->forward_backward(b, scale);
    ce.data<double>()[0] += l.ce_sum;
    aux += l.aux_sum;
  }
  if (world_) world_->all_reduce(ce);
  m.loss = ce.data<double>()[0] / std::max<int64_t>(counted, 1);
  m.aux_loss = aux / static_cast<double>(t.grad_accum);
  if (!std::isfinite(m.loss))
    throw NumericalError(fmt::format(
        "step {}: loss is {}; stopping before the optimizer step (checkpoints on disk are "
        "untouched; {})",
        m.step, m.loss,
        m.step == 1 ? fmt::format("no update has run yet, so the learning rate is not the cause: "
                                  "the initial weights (model.init_std = {}, or those loaded) or "
                                  "the data make it so",
                                  cfg_.model.init_std)
                    : std::string("lower train.lr or resume from the last checkpoint")));
  {
    const profile::Phase phase("grad_norm");
    m.grad_norm = opt_->clip_grad_norm(t.grad_clip);
  }
  if (!std::isfinite(m.grad_norm))
    throw NumericalError(fmt::format(
        "step {}: gradient norm is {}; stopping before the optimizer step (checkpoints on disk "
        "are untouched)",
        m.step, m.grad_norm));
  {
    const profile::Phase phase("optimizer");
    opt_->step(m.lr, m.step);
    model_->update_router_biases();
  }
  for (const Tensor& load : model_->step_expert_load()) {
    const RoutingBalance b = routing_balance(load);
    m.expert_load_max_over_mean.push_back(b.max_over_mean);
    m.idle_expert_fraction.push_back(b.idle_fraction);
  }
  ++step_;

  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  m.tokens_per_s = static_cast<double>(t.tokens_per_step() * dp_size()) / seconds;
  m.mfu = flops_per_token_ * m.tokens_per_s / (peak_flops_ * world_size());
  const MemoryStats memory_after = memory_stats(cfg_.model.device);
  m.peak_bytes = memory_after.peak_bytes;
  m.device_mallocs = memory_after.device_mallocs - memory_before.device_mallocs;
  m.cache_flushes = memory_after.cache_flushes - memory_before.cache_flushes;
  // The loss and gradient norm have been read: the device has passed every span of the passes.
  // With the exchanges beside the experts on the GPU the compute stream's waits for them are
  // timed; otherwise it waits for every exchange, all of which is exposed.
  const bool waits_timed = cfg_.model.device == Device::kCUDA && cfg_.parallel.ep_overlap;
  for (const auto& [name, ms] : profile::take_spans()) {
    if (name.starts_with("ep.")) m.exchange_ms += ms;
    if (name == moe::kExchangeExposedSpan) m.exchange_exposed_ms += ms;
  }
  if (!waits_timed) m.exchange_exposed_ms = m.exchange_ms;
  if (profile::enabled() && is_rank0()) {
    // Longest first; phases nest (gpu.* are the single ops inside the model's phases).
    auto phases = profile::take();
    std::sort(phases.begin(), phases.end(),
              [](const auto& a, const auto& b) { return a.second > b.second; });
    std::string line;
    for (const auto& [name, ms] : phases) line += fmt::format(" | {} {:.1f}", name, ms);
    log::info("profile step {} ({:.1f} ms){}", m.step, seconds * 1e3, line);
    log::info("profile step {}: peak memory {:.2f} GiB reached in {}", m.step,
              m.peak_bytes / double(1ull << 30), peak_phases(profile::take_peaks(), m.peak_bytes));
  }
  return m;
}

// The export, collective; when it fails anyway (the disk filled since the start), the weights
// are not lost: they are in checkpoint.dir's checkpoint of this step, or one is written to a
// rescue directory, and the IoError says where.
void Trainer::export_or_rescue(const std::string& out) {
  std::string problem;
  try {
    if (std::getenv("MOETRAIN_FAULT_EXPORT"))  // test hook: an export that fails at the end
      throw IoError(fmt::format("hf export: cannot write '{}': injected failure", out));
    export_hf(*model_, out, DType::kBF16, world_);
  } catch (const std::exception& e) {  // ours, and std::filesystem's (a rename that failed)
    problem = e.what();
  }
  if (!any_rank(!problem.empty())) return;
  std::string where;
  if (!cfg_.checkpoint.dir.empty() && saved_step_ == step_) {
    where = saved_path_;
  } else {
    const std::string dir =
        (std::filesystem::temp_directory_path() / fmt::format("moetrain-rescue-{:016x}", run_id_))
            .string();
    where = save(dir);
  }
  throw IoError(
      fmt::format("{}; the trained weights (step {}) are in the checkpoint '{}' "
                  "(export-hf --resume it once the disk has room)",
                  problem.empty() ? "--export-hf failed on another rank" : problem, step_, where));
}

void Trainer::stop_for_signal() {
  const int sig = stop_requested();
  const std::string by = sig != 0 ? fmt::format("{} ({})", strsignal(sig), sig)
                                  : std::string("a signal to another rank");
  std::string state = "no checkpoint written (checkpoint.dir is not set)";
  if (!cfg_.checkpoint.dir.empty()) {
    if (saved_step_ != step_) {
      saved_path_ = save(cfg_.checkpoint.dir);
      saved_step_ = step_;
    }
    finish_saves();
    state = fmt::format("checkpoint at step {}: {} (continue with --resume {})", step_, saved_path_,
                        cfg_.checkpoint.dir);
  }
  throw StoppedBySignal(fmt::format("stopped by {} after step {}; {}", by, step_, state));
}

namespace {
// The metrics lines of steps up to `step` (a resumed run writes the later ones again),
// rewritten atomically; lines that are not a step's JSON are kept.
void keep_metrics_until(const std::string& path, int64_t step) {
  std::ifstream in(path);
  if (!in) return;
  std::string kept, line;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.is_object() && j.contains("step") && j["step"].is_number_integer() &&
        j["step"].get<int64_t>() > step)
      continue;
    kept += line + "\n";
  }
  in.close();
  try {
    write_file_atomically(path, kept);
  } catch (const std::exception& e) {
    throw IoError(fmt::format("cannot rewrite --metrics '{}': {}", path, e.what()));
  }
}

// --overwrite: the old run's checkpoints and `latest` go before the new run writes any.
void remove_checkpoints(const std::string& dir) {
  std::error_code ec;
  for (const auto& [step, path] : checkpoints_in(dir)) {
    std::filesystem::remove_all(path, ec);
    if (ec) throw IoError(fmt::format("--overwrite: cannot remove '{}': {}", path, ec.message()));
  }
  std::filesystem::remove(std::filesystem::path(dir) / "latest", ec);
}

// Output paths are checked before the first step, so that an unusable one (a regular file where
// a directory goes, /proc, a full or read-only filesystem) stops the run at once rather than after
// its last step: ConfigError naming the path and the system's reason.
//
// checkpoint.dir is created and a file written and removed in it. Each rank tries its own file:
// ranks share the directory.
void check_checkpoint_dir(const std::string& dir, int rank) {
  namespace fs = std::filesystem;
  std::error_code ec, status;
  fs::create_directories(dir, ec);
  if (!fs::is_directory(dir, status))
    throw ConfigError(fmt::format("config: checkpoint.dir = '{}' is not a directory{}", dir,
                                  ec       ? ": " + ec.message()
                                  : status ? ": " + status.message()
                                           : ""));
  if (const auto why = cannot_write_in(dir, fmt::format(".moetrain_write_test_{}", rank)))
    throw ConfigError(fmt::format("config: checkpoint.dir = '{}' is not writable: {}", dir, *why));
}

// A file the run appends to (--metrics): it is opened (and so created) for appending.
void check_output_file(const char* role, const std::string& path) {
  if (std::filesystem::is_directory(path))
    throw ConfigError(fmt::format("{} '{}' is a directory; it names a file", role, path));
  std::FILE* f = std::fopen(path.c_str(), "a");
  if (!f)
    throw ConfigError(fmt::format("cannot write {} '{}': {}", role, path, std::strerror(errno)));
  std::fclose(f);
}

// --export-hf: a directory (replaced whole at the end: the export goes to a sibling first), so not
// an existing file, in a parent where a file can be written.
void check_export_dir(const std::string& out) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists(out, ec) && !fs::is_directory(out, ec))
    throw ConfigError(
        fmt::format("--export-hf '{}' is a file; it names a directory to write", out));
  const fs::path parent = fs::absolute(out, ec).parent_path();
  fs::create_directories(parent, ec);
  if (ec || !fs::is_directory(parent))
    throw ConfigError(fmt::format("--export-hf '{}': cannot create '{}': {}", out, parent.string(),
                                  ec ? ec.message() : "not a directory"));
  if (const auto why =
          cannot_write_in(parent.string(), fmt::format(".moetrain_write_test_{}", ::getpid())))
    throw ConfigError(
        fmt::format("--export-hf '{}': cannot write in '{}': {}", out, parent.string(), *why));
}
}  // namespace

std::vector<StepMetrics> Trainer::run(const RunOptions& opt) {
  const TrainConfig& t = cfg_.train;
  // The output paths, and one run per checkpoint directory (rank 0 locks it for the run); every
  // rank learns whether any could not, so all stop alike.
  std::unique_ptr<DirectoryLock> dir_lock;
  {
    std::string problem;
    try {
      if (!cfg_.checkpoint.dir.empty())
        check_checkpoint_dir(cfg_.checkpoint.dir, world_ ? world_->rank() : 0);
      if (is_rank0()) {
        if (!opt.metrics_path.empty()) check_output_file("--metrics", opt.metrics_path);
        if (!opt.export_hf.empty()) check_export_dir(opt.export_hf);
        std::string holder;
        if (!cfg_.checkpoint.dir.empty() &&
            !(dir_lock = DirectoryLock::try_acquire(cfg_.checkpoint.dir, &holder)))
          problem = fmt::format(
              "config: checkpoint.dir = '{}' is in use by another run ({}); stop it, or give "
              "this run another checkpoint.dir",
              cfg_.checkpoint.dir, holder);
      }
    } catch (const Error& e) {
      problem = e.what();
    } catch (const std::filesystem::filesystem_error& e) {
      problem = fmt::format("config: cannot use '{}': {}", e.path1().string(), e.code().message());
    }
    if (any_rank(!problem.empty()))
      throw ConfigError(problem.empty() ? std::string("config: another rank cannot use an output "
                                                      "path (its message names it)")
                                        : problem);
  }
  if (!cfg_.checkpoint.dir.empty()) {
    if (step_ == 0 && opt.resume.empty() && opt.existing == ExistingCheckpoints::kRefuse)
      if (const std::optional<std::string> latest = latest_checkpoint(cfg_.checkpoint.dir))
        throw ConfigError(fmt::format(
            "config: checkpoint.dir = '{}' already holds checkpoints (latest: {}); continue them "
            "with --resume {}, or pass --overwrite to start a new run there",
            cfg_.checkpoint.dir, *latest, cfg_.checkpoint.dir));
  }
  if (!opt.init_from.empty() && opt.resume.empty()) {
    load_hf_weights(opt.init_from, *model_);
    if (is_rank0()) log::info("initialised from the Hugging Face weights in '{}'", opt.init_from);
  }
  if (!opt.resume.empty()) resume(opt.resume);
  const int64_t last = opt.steps ? std::min(*opt.steps, t.steps) : t.steps;
  if (opt.steps && *opt.steps <= step_)
    throw ConfigError(fmt::format(
        "--steps {} is at or below the checkpoint's step {}: nothing to train (valid: above {})",
        *opt.steps, step_, step_));
  if (step_ == 0 && opt.resume.empty() && opt.existing == ExistingCheckpoints::kOverwrite &&
      !cfg_.checkpoint.dir.empty() && is_rank0())
    remove_checkpoints(cfg_.checkpoint.dir);
  std::ofstream metrics;
  if (!opt.metrics_path.empty() && is_rank0()) {
    // A resumed run's file holds the lines of the steps it runs again: cut back to its step, so
    // that every step appears once.
    if (step_ > 0) keep_metrics_until(opt.metrics_path, step_);
    metrics.open(opt.metrics_path, std::ios::app);
    if (!metrics)
      throw ConfigError(
          fmt::format("cannot open --metrics '{}': {}", opt.metrics_path, std::strerror(errno)));
  }
  const ParamCounts pc = count_params(cfg_.model);
  if (is_rank0()) {
    log::info(
        "model: {} layers, dim {}, {} experts top-{}; {:.2f}M params ({:.2f}M active); "
        "{} tokens/step; data{} unigram entropy {:.4f} nats",
        cfg_.model.n_layers, cfg_.model.dim, cfg_.model.n_experts, cfg_.model.top_k, pc.total / 1e6,
        pc.active / 1e6, t.tokens_per_step() * dp_size(),
        std::isfinite(stats_.loss_floor) ? fmt::format(" floor {:.4f} nats,", stats_.loss_floor)
                                         : std::string(":"),
        stats_.unigram_entropy);
    if (!packing_report_.empty()) log::info("data: {}", packing_report_);
  }
  std::vector<StepMetrics> all;
  bool first_line = true;
  while (step_ < last) {
    std::optional<StepMetrics> stepped = train_step();
    if (!stepped) stop_for_signal();
    StepMetrics& m = *stepped;
    if (eval_docs_ && (m.step % cfg_.eval.every == 0 || m.step == last)) {
      opt_->wait_for_update();
      const EvalResult e = evaluate_tokens(*model_, eval_docs_->view(), t.batch_rows, t.seq_len,
                                           world_, nullptr, cfg_.eval.data);
      m.eval_loss = e.mean();
      if (is_rank0())
        log::info("eval at step {}: loss {:.4f} over {} tokens of '{}'", m.step, m.eval_loss,
                  e.tokens, cfg_.eval.data);
    }
    all.push_back(m);
    maybe_inject_fault(world_ ? world_->rank() : 0, m.step, FaultPoint::kAfterStep);
    const bool at_interval = cfg_.checkpoint.every > 0 && m.step % cfg_.checkpoint.every == 0;
    if (!cfg_.checkpoint.dir.empty() && (at_interval || m.step == last)) {
      const auto start = std::chrono::steady_clock::now();
      saved_path_ = save(cfg_.checkpoint.dir);
      saved_step_ = step_;
      all.back().checkpoint_stall_s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (is_rank0())
        log::info("checkpoint: {} ({:.2f} s{})", saved_path_, all.back().checkpoint_stall_s,
                  writer_ ? fmt::format(", the copy to host memory, {:.2f} s of it preparing "
                                        "staging; written in the background",
                                        writer_->last_times().prepare_s)
                          : std::string());
    }
    if (metrics.is_open()) {
      nlohmann::ordered_json j{{"step", m.step},
                               {"loss", m.loss},
                               {"aux_loss", m.aux_loss},
                               {"grad_norm", m.grad_norm},
                               {"lr", m.lr},
                               {"tokens_per_s", m.tokens_per_s},
                               {"mfu", m.mfu},
                               {"peak_bytes", m.peak_bytes}};
      if (cfg_.model.on_gpu()) {
        j["device_mallocs"] = m.device_mallocs;
        j["cache_flushes"] = m.cache_flushes;
      }
      j["pad_fraction"] = m.pad_fraction;
      j["expert_load_max_over_mean"] = m.expert_load_max_over_mean;
      j["idle_expert_fraction"] = m.idle_expert_fraction;
      if (cfg_.parallel.ep > 1) {
        j["exchange_ms"] = m.exchange_ms;
        j["exchange_exposed_ms"] = m.exchange_exposed_ms;
      }
      if (!std::isnan(m.eval_loss)) j["eval_loss"] = m.eval_loss;
      if (all.back().checkpoint_stall_s > 0)
        j["checkpoint_stall_s"] = all.back().checkpoint_stall_s;
      if (first_line) {
        j["loss_floor"] = finite_or_null(stats_.loss_floor);
        j["unigram_entropy"] = finite_or_null(stats_.unigram_entropy);
        first_line = false;
      }
      metrics << j.dump() << "\n" << std::flush;
      if (!metrics)
        throw IoError(fmt::format(
            "step {}: cannot write --metrics '{}': {}; stopping{}", m.step, opt.metrics_path,
            std::strerror(errno),
            cfg_.checkpoint.dir.empty()
                ? std::string()
                : fmt::format(" (the last checkpoint in '{}' stays)", cfg_.checkpoint.dir)));
    }
    if (opt.progress_bar && is_rank0()) write_progress(m.step, last, m);
    if (is_rank0() && (m.step % t.log_every == 0 || m.step == last)) {
      // Clear the bar's line first so that the log line does not land after it.
      if (opt.progress_bar && m.step != last) std::fprintf(stderr, "\r\033[2K");
      // The worst layer's routing.
      const auto worst =
          std::max_element(m.expert_load_max_over_mean.begin(), m.expert_load_max_over_mean.end()) -
          m.expert_load_max_over_mean.begin();
      log::info(
          "step {:>5} | loss {:.4f} | aux {:.4f} | grad_norm {:.4f} | lr {:.3e} | "
          "{:.0f} tok/s | mfu {:.2f}% | peak mem {:.1f} MiB | load max/mean {:.2f} idle {:.0f}% "
          "(layer {}){}{}",
          m.step, m.loss, m.aux_loss, m.grad_norm, m.lr, m.tokens_per_s, 100 * m.mfu,
          m.peak_bytes / 1048576.0, m.expert_load_max_over_mean[worst],
          100 * m.idle_expert_fraction[worst], worst,
          m.pad_fraction > 0 ? fmt::format(" | pad {:.1f}%", 100 * m.pad_fraction) : "",
          cfg_.parallel.ep > 1 ? fmt::format(" | ep exchange {:.1f} ms ({:.1f} exposed)",
                                             m.exchange_ms, m.exchange_exposed_ms)
                               : "");
    }
    // A steady step allocates nothing from the driver; one that flushes the allocator's cache
    // (cudaFree synchronises) runs at the memory limit, slower than it need be.
    if (is_rank0() && m.cache_flushes > 0 && m.step > 2)
      log::warn(
          "step {}: GPU memory at its limit: the allocator returned its cache to the driver {} "
          "time(s) and called cudaMalloc {} time(s) this step (each flush synchronises the GPU); "
          "model.checkpoint = \"selective\" or a smaller train.batch_rows leaves room",
          m.step, m.cache_flushes, m.device_mallocs);
  }
  // Whoever reads the model next (an export, a caller) sees the last update, and the last
  // checkpoint is on disk.
  opt_->wait_for_update();
  finish_saves();
  if (!opt.export_hf.empty()) export_or_rescue(opt.export_hf);
  return all;
}

}  // namespace mt
