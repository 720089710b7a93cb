// The whole job's configuration: TOML sections [model], [train], [data], [parallel],
// [checkpoint], [eval], [hardware], each key with one type. Unknown keys, wrong types and impossible combinations are
// ConfigErrors naming the key (exit code 2).
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/parallel.h"
#include "train/packing.h"

namespace mt {

struct TrainConfig {
  int64_t steps = 300;
  int64_t seq_len = 128;      // tokens per packed row
  int64_t batch_rows = 8;     // rows per micro-batch
  int64_t grad_accum = 1;     // micro-batches per optimizer step
  double lr = 3e-3;           // peak learning rate
  double min_lr_ratio = 0.1;  // cosine floor as a fraction of lr
  int64_t warmup_steps = 20;
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double grad_clip = 1.0;  // global L2 norm; 0 disables
  uint64_t seed = 1234;    // parameter initialisation
  int64_t log_every = 10;
  int64_t tokens_per_step() const { return seq_len * batch_rows * grad_accum; }
};

enum class DataSourceKind { kSynthetic, kTokens, kSft };

// One token file of a blend (data.mix): documents are drawn in proportion to `weight`.
struct DataFile {
  std::string path;
  double weight = 1;
};

struct DataConfig {
  DataSourceKind source = DataSourceKind::kSynthetic;
  std::string path;           // token file for "tokens" and "sft"
  std::vector<DataFile> mix;  // instead of path: several files with weights
  // Token files: each epoch visits the documents in an order drawn from `seed` and the epoch
  // (false: the file's order).
  bool shuffle = true;
  // Unset: whole for "sft", stream otherwise (train/packing.h).
  std::optional<Packing> packing;
  int64_t pack_window = 1000;  // whole packing: documents packed together
  Overlong overlong = Overlong::kTruncate;
  // Synthetic mixture of stochastic languages (see train/synthetic_data.h).
  int64_t languages = 4;
  int64_t branching = 4;
  int64_t min_doc_len = 16;
  int64_t max_doc_len = 96;
  uint64_t seed = 7;

  Packing resolved_packing() const {
    return packing.value_or(source == DataSourceKind::kSft ? Packing::kWhole : Packing::kStream);
  }
  // data.path as a one-file mix, or data.mix.
  std::vector<DataFile> files() const {
    return mix.empty() ? std::vector<DataFile>{{path, 1.0}} : mix;
  }
};

struct CheckpointConfig {
  std::string dir;    // empty: no checkpoints
  int64_t every = 0;  // steps between checkpoints; 0: only at the end
  int64_t keep = 0;   // the newest checkpoints kept; 0: all
  // Write checkpoints from a thread while training goes on (train/async_checkpoint.h).
  bool async = false;
  // After a stop signal (train/stop_request.h), the seconds the run may take to reach a step
  // boundary and write its checkpoint before it ends at once; 0: no limit of its own.
  double signal_deadline_s = 0;
};

// Validation during training: every `every` steps (0: never), the loss over every token of the
// token file `data` (train/evaluate.h).
struct EvalConfig {
  std::string data;
  int64_t every = 0;
};

struct HardwareConfig {
  std::string device = "auto";     // auto (the CLI picks the GPU when it can) | cpu | cuda
  double peak_tflops = 0;          // for MFU; 0: estimate for the device
  int64_t threads = 0;             // CPU threads; 0: all cores
  bool cuda_graphs = true;         // replay each training pass as a CUDA graph (not with ep > 1)
  bool overlap_optimizer = false;  // the GPU's AdamW step beside the next forward (side stream)
};

// The most CPU threads per rank: a bound that catches typos before they allocate.
inline constexpr int64_t kMaxThreads = 4096;

// Ranks and expert parallelism (DESIGN.md §4). world > 1 on the CPU runs the ranks as threads of
// one process (the in-process backend); ep must divide world and model.n_experts; world is at
// most dist::kMaxWorld.

struct Config {
  ModelConfig model;
  ParallelConfig parallel;
  TrainConfig train;
  DataConfig data;
  CheckpointConfig checkpoint;
  EvalConfig eval;
  HardwareConfig hardware;
  std::string source;  // where it came from, for logs
};

// Parses a TOML file (path may be empty: defaults) and applies "section.key=value" overrides,
// where value is TOML (strings may go unquoted). Validates the result.
Config load_config(const std::string& path, const std::vector<std::string>& overrides);
Config parse_config_string(const std::string& toml_text, const std::vector<std::string>& overrides,
                           const std::string& name = "config");
void validate_config(const Config& c);

}  // namespace mt
