// Checkpoints in safetensors: every parameter by name, the AdamW moments
// ("optim.exp_avg.<name>", "optim.exp_avg_sq.<name>"), the router biases
// ("buffers.layers.<i>.router_bias"), and in the metadata the step and the data position (the
// loader's state, integers >= 0 separated by commas).
// Written atomically (temporary file, fsync, rename), then `latest` is pointed at it.
//
// On several ranks each rank writes what it owns to <dir>/step_<step>/rank_<r>.safetensors: the
// flat shard of a sharded group as "<unit>.<dense|experts>.shard" (and its moments), unsharded
// groups by name. Resume needs the same world size and ep (checked, named in the error).
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "model/qwen3_moe.h"
#include "train/data_loader.h"
#include "train/optimizer.h"
#include "train/safetensors.h"

namespace mt {

struct TrainState {
  int64_t step = 0;               // optimizer steps completed
  DataState data_position = {0};  // the loader's state after that step
  // The run the state belongs to (drawn by rank 0 when a run starts, kept across resumes; 0 in
  // files from before it was recorded): every rank's file must carry the same.
  int64_t run_id = 0;
};

// Writes <dir>/step_<step>.safetensors and <dir>/latest; returns the checkpoint's path. keep > 0:
// then only the newest `keep` checkpoints up to this one stay (checkpoint.keep; older ones are
// removed after `latest` names the new one).
std::string save_checkpoint(const std::string& dir, Qwen3Moe& model, AdamW& opt,
                            const TrainState& st, dist::Communicator* world = nullptr,
                            int64_t keep = 0);
// The pieces of a save, for the synchronous save above and the asynchronous writer
// (train/async_checkpoint.h).
// Where a step's checkpoint goes (the directories created): this rank's file, what `latest` will
// name, and the path a save returns.
struct CheckpointTarget {
  std::string dir, file, latest, published;
  int64_t step = 0;
  int rank = 0, ranks = 1;
  std::string rank_path(int r) const;  // rank r's file
};
CheckpointTarget checkpoint_target(const std::string& dir, int64_t step,
                                   const dist::Communicator* world);
// Every tensor a checkpoint holds, by name (the device's tensors: copy before the next update).
void for_each_checkpoint_tensor(Qwen3Moe& model, AdamW& opt,
                                const std::function<void(const std::string&, const Tensor&)>& f);
// The first tensor holding a NaN or infinity ("" when none does), and the error that says so.
std::string first_non_finite(const std::map<std::string, Tensor>& host);
NumericalError non_finite_state(const CheckpointTarget& t, const std::string& tensor);
// This rank's file: the host tensors with their checksums and the metadata (plus `extra`).
void write_checkpoint_file(const CheckpointTarget& t, const std::map<std::string, Tensor>& host,
                           const TrainState& st, int64_t ep,
                           const std::map<std::string, std::string>& extra = {});
// `latest` names it (every rank's file complete), then checkpoint.keep's pruning.
void publish_checkpoint(const CheckpointTarget& t, int64_t keep);

// The checkpoints in a directory (step_NNNNNNNN.safetensors files and step_NNNNNNNN folders), by
// step, with their paths.
std::vector<std::pair<int64_t, std::string>> checkpoints_in(const std::string& dir);
// Removes all but the newest `keep` checkpoints at or below step `published` (IoError naming
// what could not be removed).
void prune_checkpoints(const std::string& dir, int64_t keep, int64_t published);
// `path` is a checkpoint file or a directory (then its `latest`). Every tensor must be present
// with the model's shape and dtype; errors are CheckpointErrors naming the tensor.
TrainState load_checkpoint(const std::string& path, Qwen3Moe& model, AdamW& opt,
                           dist::Communicator* world = nullptr);

// One writer per checkpoint directory: an exclusive flock on <dir>/.moetrain.lock, which holds the
// pid and host of its holder. The kernel drops it when the holder exits however it exits (even
// SIGKILL), so a dead run's lock is taken over by the next without a word.
class DirectoryLock {
 public:
  // The lock, or (someone holds it) nullptr with `holder` set to what its file says.
  static std::unique_ptr<DirectoryLock> try_acquire(const std::string& dir, std::string* holder);
  ~DirectoryLock();
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;

 private:
  explicit DirectoryLock(int fd) : fd_(fd) {}
  int fd_;
};

// The checkpoint <dir>/latest names (a file or a step folder in dir): nullopt when there is no
// `latest`, empty when it names nothing.
std::optional<std::string> latest_checkpoint(const std::string& dir);

}  // namespace mt
