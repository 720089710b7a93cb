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

AdamW::AdamW(std::vector<ParamUnit>& units, const TrainConfig& t) : cfg_(t) {
  for (auto& u : units)
    for (auto& g : u.groups) {
      groups_.push_back(&g);
      state_.push_back(Tensor::zeros(g.params.shape(), g.params.dtype()));
      state_.push_back(Tensor::zeros(g.params.shape(), g.params.dtype()));
    }
}

double AdamW::grad_norm() const {
  double sq = 0;
  for (const ParamGroup* g : groups_) sq += ops::sum_of_squares(g->grads);
  return std::sqrt(sq);
}

double AdamW::clip_grad_norm(double max_norm) {
  const double norm = grad_norm();
  if (max_norm > 0 && norm > max_norm) {
    const double coef = max_norm / (norm + 1e-6);
    for (ParamGroup* g : groups_) ops::scale_(g->grads, coef);
  }
  return norm;
}

void AdamW::step(double lr, int64_t step) {
  const ops::AdamWHyper h{lr, cfg_.beta1, cfg_.beta2, cfg_.eps, cfg_.weight_decay, step};
  for (size_t i = 0; i < groups_.size(); ++i)
    ops::adamw_step(groups_[i]->params, groups_[i]->grads, state_[2 * i], state_[2 * i + 1], h);
}

}  // namespace mt
