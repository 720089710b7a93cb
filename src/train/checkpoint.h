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
#include <map>
#include <optional>
#include <string>

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

// Writes <dir>/step_<step>.safetensors and <dir>/latest; returns the checkpoint's path.
std::string save_checkpoint(const std::string& dir, Qwen3Moe& model, AdamW& opt,
                            const TrainState& st, dist::Communicator* world = nullptr);
// `path` is a checkpoint file or a directory (then its `latest`). Every tensor must be present
// with the model's shape and dtype; errors are CheckpointErrors naming the tensor.
TrainState load_checkpoint(const std::string& path, Qwen3Moe& model, AdamW& opt,
                           dist::Communicator* world = nullptr);

// The checkpoint <dir>/latest names (a file or a step folder in dir): nullopt when there is no
// `latest`, empty when it names nothing.
std::optional<std::string> latest_checkpoint(const std::string& dir);

}  // namespace mt
