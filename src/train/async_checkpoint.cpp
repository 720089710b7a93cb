#include "train/async_checkpoint.h"

#include <chrono>
#include <filesystem>
#include <utility>
#include <vector>

#include "core/atomic_file.h"
#include "core/log.h"
#include "train/safetensors.h"
#if MOETRAIN_HAS_CUDA
#include "core/cuda/device.h"
#endif

namespace mt {

namespace {
using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}
// How long rank 0's writer waits for the other ranks' files of a save before it gives up
// publishing it (a rank that died leaves the job anyway).
constexpr double kRankFilesTimeoutS = 1800;
// A rank whose state is not finite writes this beside where its file would go, so that rank 0
// stops waiting and publishes nothing.
std::string refusal_path(const std::string& file) {
  return file + ".not_finite";
}
#if MOETRAIN_HAS_CUDA
// Faults a new buffer's pages in on every core (writing a byte of each): page-locking faults them
// one thread at a time, at the kernel's page-clearing rate.
void fault_in(void* data, size_t bytes) {
  constexpr size_t kPage = 4096;
  auto* p = static_cast<volatile char*>(data);
  const auto pages = static_cast<int64_t>((bytes + kPage - 1) / kPage);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < pages; ++i) p[static_cast<size_t>(i) * kPage] = 0;
}
#endif
}  // namespace

AsyncCheckpointWriter::AsyncCheckpointWriter(dist::Communicator* world, int64_t keep,
                                             int64_t attempt)
    : world_(world), keep_(keep), attempt_(attempt), thread_([this] { run(); }) {}

AsyncCheckpointWriter::~AsyncCheckpointWriter() {
  {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return !job_ && !busy_; });
    quit_ = true;
  }
  cv_.notify_all();
  thread_.join();
#if MOETRAIN_HAS_CUDA
  for (auto& [name, t] : staging_)
    if (t.nbytes() > 0) cuda::unpin_host_memory(t.raw());
#endif
}

bool AsyncCheckpointWriter::failed() const {
  std::lock_guard lock(mu_);
  return !error_.empty();
}

AsyncSaveTimes AsyncCheckpointWriter::last_times() const {
  std::lock_guard lock(mu_);
  return times_;
}

void AsyncCheckpointWriter::wait() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return !job_ && !busy_; });
  if (error_.empty()) return;
  const std::string message = std::exchange(error_, "");
  if (error_code_ == ExitCode::kNumerical) throw NumericalError(message);
  throw IoError(message);
}

std::string AsyncCheckpointWriter::save(const std::string& dir, Qwen3Moe& model, AdamW& opt,
                                        const TrainState& st) {
  wait();  // the staging buffers are the previous save's until it is written
  const auto start = Clock::now();
  const CheckpointTarget target = checkpoint_target(dir, st.step, world_);
  double prepare_s = 0;
  for_each_checkpoint_tensor(model, opt, [&](const std::string& name, const Tensor& t) {
    auto it = staging_.find(name);
    if (it == staging_.end() || it->second.shape() != t.shape() ||
        it->second.dtype() != t.dtype()) {
      const auto prepare = Clock::now();
#if MOETRAIN_HAS_CUDA
      if (it != staging_.end() && it->second.nbytes() > 0)
        cuda::unpin_host_memory(it->second.raw());  // before its memory is freed
#endif
      Tensor host = Tensor::empty(t.shape(), t.dtype());
#if MOETRAIN_HAS_CUDA
      if (t.device() != Device::kCPU && host.nbytes() > 0) {
        fault_in(host.raw(), host.nbytes());
        (void)cuda::pin_host_memory(host.raw(), host.nbytes());  // else pageable: slower, same
      }
#endif
      it = staging_.insert_or_assign(name, std::move(host)).first;
      prepare_s += seconds_since(prepare);
    }
    it->second.copy_from(t);
  });
  {
    std::lock_guard lock(mu_);
    times_ = {};
    times_.copy_s = seconds_since(start);
    times_.prepare_s = prepare_s;
    job_ = Job{target, st, model.mesh() ? model.mesh()->ep_size() : 1};
  }
  cv_.notify_all();
  return target.published;
}

void AsyncCheckpointWriter::run() {
  while (true) {
    Job job;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return job_.has_value() || quit_; });
      if (quit_ && !job_) return;
      job = std::move(*job_);
      job_.reset();
      busy_ = true;
    }
    std::string error;
    ExitCode code = ExitCode::kIo;
    const auto start = Clock::now();
    try {
      write(job.target, job.state, job.ep);
    } catch (const NumericalError& e) {
      error = e.what();
      code = ExitCode::kNumerical;
    } catch (const std::exception& e) {
      error = fmt::format(
          "step {}: the asynchronous checkpoint into '{}' failed: {}; the last "
          "complete checkpoint stays `latest`",
          job.state.step, job.target.dir, e.what());
    }
    const double took = seconds_since(start);
    if (error.empty() && job.target.rank == 0) {
      const double gib = static_cast<double>(last_times().bytes) / (1 << 30);
      log::info(
          "checkpoint {} written in the background: {:.2f} GiB (rank 0's) in {:.2f} s, "
          "{:.2f} GiB/s",
          job.target.published, gib, took, took > 0 ? gib / took : 0.0);
    }
    {
      std::lock_guard lock(mu_);
      times_.write_s = took;
      error_ = std::move(error);
      error_code_ = code;
      busy_ = false;
    }
    cv_.notify_all();
  }
}

void AsyncCheckpointWriter::write(const CheckpointTarget& target, const TrainState& st,
                                  int64_t ep) {
  namespace fs = std::filesystem;
  const std::string save_id = fmt::format("{}.{}", attempt_, st.step);
  fs::remove(refusal_path(target.file));
  if (const std::string bad = first_non_finite(staging_); !bad.empty()) {
    write_file_atomically(refusal_path(target.file), save_id + "\n");
    throw non_finite_state(target, bad);
  }
  write_checkpoint_file(target, staging_, st, ep, {{"save_id", save_id}});
  {
    std::lock_guard lock(mu_);
    times_.bytes = static_cast<int64_t>(fs::file_size(target.file));
  }
  if (target.rank != 0) return;
  // Rank 0 publishes once every rank's file of this save is complete (written atomically, so
  // there means whole; this save's, by its id).
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(kRankFilesTimeoutS));
  for (int r = 1; r < target.ranks; ++r) {
    const std::string file = target.rank_path(r);
    while (true) {
      std::error_code ec;
      if (fs::exists(refusal_path(file), ec))
        throw NumericalError(fmt::format(
            "step {}: rank {}'s state is not finite; no checkpoint is written for this step",
            st.step, r));
      if (fs::exists(file, ec)) {
        const auto meta = read_safetensors_metadata(file);
        const auto id = meta.find("save_id");
        if (id != meta.end() && id->second == save_id) break;
      }
      if (Clock::now() > deadline)
        throw IoError(fmt::format("rank {}'s file '{}' did not appear in {:.0f} s", r, file,
                                  kRankFilesTimeoutS));
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  publish_checkpoint(target, keep_);
}

}  // namespace mt
