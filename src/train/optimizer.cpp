#include "train/optimizer.h"

#include <cmath>
#include <initializer_list>
#include <numbers>
#include <optional>

#include "core/log.h"
#include "core/profile.h"
#include "fsdp/fsdp.h"
#include "ops/elementwise.h"
#include "ops/optim.h"
#if MOETRAIN_HAS_CUDA
#include "core/cuda/graph.h"
#include "core/cuda/stream.h"
#endif

namespace mt {

double learning_rate(const TrainConfig& t, int64_t step) {
  if (step <= t.warmup_steps) return t.lr * static_cast<double>(step) / t.warmup_steps;
  const double decay_steps = std::max<int64_t>(t.steps - t.warmup_steps, 1);
  const double progress = std::min(1.0, (step - t.warmup_steps) / decay_steps);
  const double cosine = 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
  return t.lr * (t.min_lr_ratio + (1.0 - t.min_lr_ratio) * cosine);
}

// The GPU step: its scalars' device buffer, and when captured the graph and the buffers it
// addresses.
struct AdamW::Captured {
#if MOETRAIN_HAS_CUDA
  Tensor scalars;
  cuda::CapturedWork work;
  std::vector<const void*> buffers;
  // The update beside the passes: its stream, the point of the passes' stream it starts from,
  // and the end of each unit's update.
  std::unique_ptr<cuda::SideStream> side;
  std::vector<std::shared_ptr<cuda::Fence>> updated;
  std::unique_ptr<cuda::Fence> ready_fence;
#endif
};

AdamW::~AdamW() {
  update_beside_passes(false);  // the units outlive the optimizer: no hook may point at it
}

namespace {
// An unsharded group's persistent cast copy, rewritten by the update in the same pass.
Tensor* persistent_compute(ParamGroup& g) {
  return !g.sharded() && g.compute.defined() ? &g.compute : nullptr;
}

// One group's update (h: the hyper-parameters, or their device bytes), writing its persistent
// copies in the same pass: one launch over the flat buffer, or where the group holds FP8 tiles
// (one rank, an FP8 recipe) one per quantized weight, which writes its tiles, and one per run of
// other specs between them.
template <class Hyper>
void update_group(ParamGroup& g, Tensor& m, Tensor& v, const Hyper& h) {
  Tensor* compute = persistent_compute(g);
  if (!g.holds_fp8_tiles() || !g.copies_made())
    return ops::adamw_step(g.shard, g.grad_shard, m, v, h, {.compute = compute});
  const auto plain = [&](int64_t begin, int64_t end) {
    if (end <= begin) return;
    const Shape s{end - begin};
    Tensor p = g.shard.view(begin, s), mv = m.view(begin, s), vv = v.view(begin, s);
    Tensor c = compute ? compute->view(begin, s) : Tensor();
    ops::adamw_step(p, g.grad_shard.view(begin, s), mv, vv, h, {.compute = compute ? &c : nullptr});
  };
  int64_t done = 0;
  for (size_t i = 0; i < g.specs.size(); ++i) {
    const ParamSpec& s = g.specs[i];
    if (!s.quant_copies) continue;
    MT_CHECK(s.offset >= done, "group of {}: specs out of offset order", s.name);
    plain(done, s.offset);
    Tensor p = g.shard.view(s.offset, s.shape), mv = m.view(s.offset, s.shape),
           vv = v.view(s.offset, s.shape);
    ops::WeightCopies& q = g.copies[i];
    ops::adamw_step(
        p, g.grad_shard.view(s.offset, s.shape), mv, vv, h,
        {.tiles_dim0 = &q.fp8_input, .tiles_from = g.compute_dtype, .rule = g.precision.fp8_scale});
    done = s.offset + shape_numel(s.shape);
  }
  plain(done, g.shard.numel());
}
}  // namespace

AdamW::AdamW(std::vector<ParamUnit>& units, const TrainConfig& t, dist::Communicator* norm_group)
    : units_(&units), cfg_(t), norm_group_(norm_group), captured_(std::make_unique<Captured>()) {
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
  clip_coef_ = 1.0;
  if (!groups_.empty() && groups_.front()->shard.device() == Device::kCUDA) return step_gpu(h);
  for (size_t i = 0; i < groups_.size(); ++i) {
    ParamGroup& g = *groups_[i];
    update_group(g, state_[2 * i], state_[2 * i + 1], h);
  }
}

void AdamW::step_gpu(const ops::AdamWHyper& h) {
#if MOETRAIN_HAS_CUDA
  // The step's scalars go to the device once, for every group's launch (and where a captured
  // step reads them).
  Captured& c = *captured_;
  if (c.scalars.defined())
    c.scalars.copy_from(ops::adamw_device_scalars(h));
  else
    c.scalars = ops::adamw_device_scalars(h);
  auto body = [&] {
    size_t i = 0;
    for (size_t u = 0; u < units_->size(); ++u) {
      for (size_t k = 0; k < (*units_)[u].groups.size(); ++k, ++i) {
        ParamGroup& g = *groups_[i];
        update_group(g, state_[2 * i], state_[2 * i + 1], c.scalars);
      }
      if (c.side) c.updated[u]->record();
    }
  };
  // Beside the passes: the side stream starts after everything queued so far (the gradients'
  // reductions and norm, the scalars), and the step runs there, captured or not.
  std::optional<cuda::StreamScope> beside;
  if (c.side) {
    c.ready_fence->record();
    beside.emplace(c.side->get());
    c.ready_fence->wait();
  }
  if (!graphs_on_ || profile::enabled()) return body();
  std::vector<const void*> buffers = {c.scalars.raw()};
  for (size_t i = 0; i < groups_.size(); ++i) {
    ParamGroup& g = *groups_[i];
    const Tensor* compute = persistent_compute(g);
    for (const Tensor* t : std::initializer_list<const Tensor*>{
             &g.shard, &g.grad_shard, &state_[2 * i], &state_[2 * i + 1], compute})
      buffers.push_back(t ? t->raw() : nullptr);
    const std::vector<const void*> tiles = g.held_tile_buffers();  // the update writes them
    buffers.insert(buffers.end(), tiles.begin(), tiles.end());
  }
  if (buffers != c.buffers) {  // a buffer moved (a checkpoint load drops the compute copies)
    c.work.drop();
    c.buffers = std::move(buffers);
  }
  c.work.run(body, "the optimizer step");
#else
  (void)h;
#endif
}

void AdamW::update_beside_passes(bool on) {
#if MOETRAIN_HAS_CUDA
  Captured& c = *captured_;
  if (on == (c.side != nullptr)) return;
  if (groups_.empty() || groups_.front()->shard.device() != Device::kCUDA) return;
  c.work.drop();  // the captured step records the units' fences, or does not
  if (!on) {
    wait_for_update();
    for (ParamUnit& u : *units_) u.await_update = nullptr;
    c.side.reset();
    c.updated.clear();
    c.ready_fence.reset();
    return;
  }
  c.side = std::make_unique<cuda::SideStream>();
  c.ready_fence = std::make_unique<cuda::Fence>();
  for (ParamUnit& u : *units_) {
    auto updated = std::make_shared<cuda::Fence>();
    c.updated.push_back(updated);
    u.await_update = [updated] { updated->wait(); };
  }
#else
  (void)on;
#endif
}

void AdamW::wait_for_update() {
#if MOETRAIN_HAS_CUDA
  for (const auto& f : captured_->updated) f->wait();
#endif
}

}  // namespace mt
