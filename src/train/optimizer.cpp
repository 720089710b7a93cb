#include "train/optimizer.h"

#include <cmath>
#include <numbers>

#include "ops/elementwise.h"
#include "ops/optim.h"

namespace mt {

double learning_rate(const TrainConfig& t, int64_t step) {
  if (step <= t.warmup_steps) return t.lr * static_cast<double>(step) / t.warmup_steps;
  const double decay_steps = std::max<int64_t>(t.steps - t.warmup_steps, 1);
  const double progress = std::min(1.0, (step - t.warmup_steps) / decay_steps);
  const double cosine = 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
  return t.lr * (t.min_lr_ratio + (1.0 - t.min_lr_ratio) * cosine);
}

AdamW::AdamW(std::vector<ParamUnit>& units, const TrainConfig& t, dist::Communicator* norm_group)
    : cfg_(t), norm_group_(norm_group) {
  for (auto& u : units)
    for (auto& g : u.groups) {
      groups_.push_back(&g);
      state_.push_back(Tensor::zeros(g.shard.shape(), g.shard.dtype(), g.shard.device()));
      state_.push_back(Tensor::zeros(g.shard.shape(), g.shard.dtype(), g.shard.device()));
    }
}

double AdamW::grad_norm() const {
  // Shards partition every group (padding is zero) and EP ranks hold disjoint experts, so the
  // world sum counts each element once.
  Tensor sq = Tensor::zeros({1}, DType::kF64);
  for (const ParamGroup* g : groups_) sq.data<double>()[0] += ops::sum_of_squares(g->grad_shard);
  if (norm_group_) norm_group_->all_reduce(sq);
  return std::sqrt(sq.data<double>()[0]);
}

double AdamW::clip_grad_norm(double max_norm) {
  const double norm = grad_norm();
  clip_coef_ = max_norm > 0 && norm > max_norm ? max_norm / (norm + 1e-6) : 1.0;
  return norm;
}

void AdamW::step(double lr, int64_t step) {
  const ops::AdamWHyper h{lr,   cfg_.beta1, cfg_.beta2, cfg_.eps, cfg_.weight_decay,
                          step, clip_coef_};
  for (size_t i = 0; i < groups_.size(); ++i) {
    ParamGroup& g = *groups_[i];
    // An unsharded group's persistent cast copy is rewritten in the same pass.
    Tensor* compute = !g.sharded() && g.compute.defined() ? &g.compute : nullptr;
    ops::adamw_step(g.shard, g.grad_shard, state_[2 * i], state_[2 * i + 1], h, compute);
  }
  clip_coef_ = 1.0;
}

}  // namespace mt
