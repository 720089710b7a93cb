// The training loop: micro-batches -> forward/backward -> clip -> AdamW -> router bias update ->
// metrics -> checkpoints.
#pragma once
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "model/qwen3_moe.h"
#include "train/async_checkpoint.h"
#include "train/config.h"
#include "train/data_loader.h"
#include "train/optimizer.h"
#include "train/token_file.h"

namespace mt {

struct StepMetrics {
  int64_t step = 0;
  double loss = 0;       // mean cross-entropy over the step's counted tokens
  double aux_loss = 0;   // mean over micro-batches of the summed per-layer aux losses
  double grad_norm = 0;  // before clipping
  double lr = 0;
  double tokens_per_s = 0;
  double mfu = 0;  // model FLOPs / (time * peak)
  int64_t peak_bytes = 0;
  // The GPU caching allocator's cudaMalloc calls and cache flushes during this step (core/tensor.h
  // MemoryStats): zero in a steady step; flushes mean the step runs near the memory limit and
  // stalls on the driver.
  int64_t device_mallocs = 0;
  int64_t cache_flushes = 0;
  // Device time in expert-parallel dispatch and combine (count exchange, row all-to-alls,
  // regrouping), forward and backward; 0 without expert parallelism.
  double exchange_ms = 0;
  // Of it, the time the pass's stream stood waiting for the exchange: with the exchanges beside
  // the experts (parallel.ep_overlap on the GPU) measured at each wait, else all of it.
  double exchange_exposed_ms = 0;
  // Validation loss over eval.data after this step (eval.every); NaN when not evaluated.
  double eval_loss = std::numeric_limits<double>::quiet_NaN();
  // Of the step's input tokens (every rank), the fraction that is row padding (whole packing).
  double pad_fraction = 0;
  // The time training stood still for this step's checkpoint (0 without one): the whole save, or
  // with checkpoint.async the copy into host memory.
  double checkpoint_stall_s = 0;
  // Routing over the step's whole batch (every rank, padding left out), per layer: the busiest
  // expert's load over the mean load (1 = perfectly balanced; the "max violation" of aux-loss-free
  // balancing), and the fraction of experts that received no token.
  std::vector<double> expert_load_max_over_mean;
  std::vector<double> idle_expert_fraction;
};

// What a new run does with a checkpoint.dir that already holds checkpoints (a `latest`):
// refuse (the default: its `latest` and step files would be overwritten), or start over there.
enum class ExistingCheckpoints { kRefuse, kOverwrite };

struct RunOptions {
  std::optional<int64_t> steps;  // overrides train.steps (the schedule keeps train.steps)
  std::string metrics_path;      // JSON lines
  std::string resume;            // checkpoint file or directory
  std::string init_from;         // a Hugging Face Qwen3-MoE directory's weights (fresh run)
  std::string export_hf;         // after the last step, the weights as an HF directory (bf16)
  ExistingCheckpoints existing = ExistingCheckpoints::kRefuse;
  bool progress_bar = false;
};

class Trainer {
 public:
  // world: this rank's communicator when parallel.world > 1 (its size must match); null on one
  // rank. Every data-parallel rank holds batch_rows rows of each micro-batch (the cp ranks of a
  // context-parallel group each their chunks of them).
  explicit Trainer(const Config& c, dist::Communicator* world = nullptr);
  // Runs until the configured (or overridden) step; returns the metrics of every step run.
  std::vector<StepMetrics> run(const RunOptions& opt);

  // Loads a checkpoint (file or directory): parameters, AdamW moments, step, data position.
  void resume(const std::string& path);
  // Writes a checkpoint of the current state into `dir` (collective); returns its path.
  std::string save(const std::string& dir);
  Qwen3Moe& model() { return *model_; }
  AdamW& optimizer() { return *opt_; }
  const DataStats& data_stats() const { return stats_; }
  int64_t step() const { return step_; }
  dist::DeviceMesh* mesh() { return mesh_.get(); }

 private:
  // One optimizer step; nullopt when a rank was asked to stop (stop_request.h): then every rank
  // agreed, before the step's passes, and the data position is the step's start again.
  std::optional<StepMetrics> train_step();
  // Writes the stop's checkpoint (unless this step's is written) and throws StoppedBySignal.
  [[noreturn]] void stop_for_signal();
  void export_or_rescue(const std::string& out);
  bool is_rank0() const { return !world_ || world_->rank() == 0; }
  int world_size() const { return world_ ? world_->size() : 1; }
  // Ranks reading different rows (world / parallel.cp).
  int dp_size() const { return mesh_ ? mesh_->dp_size() : 1; }
  Batch next_local_batch();
  void reserve_exchange(const Config& c);
  void draw_run_id();
  std::unique_ptr<MappedTokenFile> eval_docs_;  // eval.data, when eval.every > 0

  Config cfg_;
  dist::Communicator* world_ = nullptr;
  std::unique_ptr<dist::DeviceMesh> mesh_;
  std::unique_ptr<Qwen3Moe> model_;
  std::unique_ptr<AdamW> opt_;
  std::unique_ptr<DataLoader> data_;
  DataStats stats_;
  std::string packing_report_;  // the loader's, for the log at start
  double flops_per_token_ = 0;
  double peak_flops_ = 0;
  int64_t step_ = 0;
  int64_t run_id_ = 0;       // rank 0's draw, the same on every rank (TrainState::run_id)
  int64_t saved_step_ = -1;  // the step of the last checkpoint this run wrote, and its path
  std::string saved_path_;
  int64_t attempt_id_ = 0;  // like run_id_, but new at every start (resumes included)
  std::unique_ptr<AsyncCheckpointWriter> writer_;  // checkpoint.async
  // Waits for the asynchronous save in flight; every rank learns whether any failed, and all
  // stop with its error if one did (collective).
  void finish_saves();
  // Whether any rank's `mine` is true (collective: one all-reduce), so that all ranks stop alike
  // on a problem only one of them met.
  bool any_rank(bool mine) const;
};

// A layer's routing over a batch from its per-expert loads (i64 (E), on the host): the busiest
// expert's load over the mean, and the fraction of experts with no token (0 and 1 for no load).
struct RoutingBalance {
  double max_over_mean = 0;
  double idle_fraction = 0;
};
RoutingBalance routing_balance(const Tensor& load);

// FLOP/s the MFU is measured against: hardware.peak_tflops when set, else an estimate for the
// host CPU (cores x 32 fp32 FLOP/cycle, AVX2 FMA, at the reported clock).
double peak_flops(const HardwareConfig& h);

}  // namespace mt
