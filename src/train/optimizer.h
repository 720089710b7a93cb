// AdamW over a model's parameter groups (fp32 master weights and moments, one flat buffer per
// group), the warmup + cosine learning-rate schedule, and global gradient-norm clipping.
#pragma once
#include <memory>
#include <vector>

#include "fsdp/params.h"
#include "ops/optim.h"
#include "train/config.h"

namespace mt {

// Linear warmup from lr/warmup to lr over warmup_steps, then cosine down to lr * min_lr_ratio
// at `steps`. step is 1-based.
double learning_rate(const TrainConfig& t, int64_t step);

// Works on what each rank owns: the shards of sharded groups (whole groups otherwise).
class AdamW {
 public:
  // norm_group: the ranks whose shards together hold every parameter exactly once (the world);
  // null on one rank.
  AdamW(std::vector<ParamUnit>& units, const TrainConfig& t,
        dist::Communicator* norm_group = nullptr);
  ~AdamW();
  AdamW(const AdamW&) = delete;
  AdamW& operator=(const AdamW&) = delete;
  // On the GPU, step() replays its launches as a CUDA graph, the learning rate and clipping
  // factor read from device memory (captured at the second step, again when a buffer moved).
  void use_cuda_graphs(bool on) { graphs_on_ = on; }
  // On the GPU, step() queues its update on a side stream, unit by unit in the units' order, and
  // returns: the next passes wait for each unit's update only where they first read its
  // parameters or write its gradients (ParamUnit::await_update), so the update of the later
  // units runs while the first ones compute the next forward. The same kernels on the same
  // values: bit-identical to the update in line. Anything else that reads the parameters or
  // moments (a checkpoint, an export) calls wait_for_update() first. No effect on the CPU.
  void update_beside_passes(bool on);
  // The thread's stream waits for the last step's update (on the host: nothing to wait for).
  void wait_for_update();
  // sqrt of the sum of squares of every gradient element of the model, each counted once.
  double grad_norm() const;
  // Returns the norm; when it exceeds max_norm, the next step() scales the gradients so that the
  // global norm is max_norm (inside the AdamW pass: no separate pass over the gradients).
  double clip_grad_norm(double max_norm);
  void step(double lr, int64_t step);

  // Moments, in the order of the units' groups: [2i] exp_avg, [2i+1] exp_avg_sq.
  std::vector<Tensor>& state() { return state_; }

 private:
  std::vector<ParamUnit>* units_;
  std::vector<ParamGroup*> groups_;  // the units' groups, in order
  std::vector<Tensor> state_;
  TrainConfig cfg_;
  dist::Communicator* norm_group_;
  double clip_coef_ = 1.0;  // set by clip_grad_norm, used once by step
  bool graphs_on_ = false;
  struct Captured;  // optimizer.cpp
  std::unique_ptr<Captured> captured_;
  void step_gpu(const ops::AdamWHyper& h);
};

}  // namespace mt
