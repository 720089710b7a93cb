#include "model/qwen3_moe.h"

#include <cmath>

#include "ops/elementwise.h"
#include "ops/embedding.h"
#include "ops/gemm.h"
#include "ops/loss.h"
#include "ops/norm.h"

namespace mt {

int64_t Batch::masked_tokens() const {
  int64_t n = 0;
  for (int64_t i = 0; i < loss_mask.numel(); ++i) n += loss_mask.data<uint8_t>()[i] != 0;
  return n;
}

Qwen3Moe::Qwen3Moe(const ModelConfig& c, uint64_t seed) : cfg_(c) {
  cfg_.validate();
  const DType dt = cfg_.compute_dtype;
  ParamUnit embed{"embed", {}};
  embed.groups.push_back(
      make_param_group(ParamKind::kDense, {{"embed.table", {c.vocab_size, c.dim}}}, dt));
  units_.push_back(std::move(embed));
  for (int64_t l = 0; l < c.n_layers; ++l)
    units_.push_back(ParamUnit{fmt::format("layers.{}", l), make_block_groups(c, l)});
  std::vector<ParamSpec> head_specs = {{"head.norm", {c.dim}, true}};
  if (!c.tie_word_embeddings) head_specs.push_back({"head.out", {c.dim, c.vocab_size}});
  units_.push_back(
      ParamUnit{"head", {make_param_group(ParamKind::kDense, std::move(head_specs), dt)}});
  for (auto& u : units_)
    for (auto& g : u.groups) init_params(g, seed, c.init_std);
  for (int64_t l = 0; l < c.n_layers; ++l) {
    router_bias_.push_back(Tensor::zeros({c.n_experts}, dt));
    expert_load_.push_back(Tensor::zeros({c.n_experts}, DType::kI64));
  }
}

void Qwen3Moe::zero_grad() {
  for (auto& u : units_)
    for (auto& g : u.groups) g.grads.zero_();
  for (auto& l : expert_load_) l.zero_();
}

Tensor Qwen3Moe::head_weight() const {
  const ParamGroup& g = units_.back().groups[0];
  return cfg_.tie_word_embeddings ? units_[0].groups[0].param(0) : g.param(1);
}

MicroBatchLosses Qwen3Moe::forward(const Batch& b) { return run(b, nullptr); }
MicroBatchLosses Qwen3Moe::forward_backward(const Batch& b, const LossScale& s) {
  return run(b, &s);
}

MicroBatchLosses Qwen3Moe::run(const Batch& b, const LossScale* scale) {
  const ModelConfig& c = cfg_;
  const int64_t n = b.size(), L = c.n_layers;
  const DType dt = c.compute_dtype;
  const Tensor table = units_[0].groups[0].param(0);
  const ParamGroup& head = units_.back().groups[0];

  // Forward.
  Tensor x = Tensor::empty({n, c.dim}, dt);
  ops::embedding_forward(b.tokens, table, x);
  std::vector<BlockActivations> acts(L);
  std::vector<BlockInputs> inputs(L);
  MicroBatchLosses out;
  for (int64_t l = 0; l < L; ++l) {
    inputs[l].batch = &b;
    if (c.bias_update_rate > 0) inputs[l].router_bias = router_bias_[l];
    x = block_forward(bind_block_params(units_[l + 1].groups), c, inputs[l], x, acts[l]);
    out.aux_sum += acts[l].aux_loss;
    const int64_t* routed = acts[l].tokens_per_expert.data<int64_t>();
    for (int64_t e = 0; e < c.n_experts; ++e) expert_load_[l].data<int64_t>()[e] += routed[e];
  }
  Tensor xf = Tensor::empty({n, c.dim}, dt), rstd = Tensor::empty({n}, dt);
  ops::rmsnorm_forward(x, head.param(0), c.rms_norm_eps, xf, rstd);
  Tensor logits = Tensor::empty({n, c.vocab_size}, dt);
  const Tensor w_out = head_weight();
  ops::gemm(xf, ops::Transpose::kNo, w_out,
            c.tie_word_embeddings ? ops::Transpose::kYes : ops::Transpose::kNo, logits,
            ops::Accumulate::kNo);
  Tensor lse = Tensor::empty({n}, dt);
  out.ce_sum = ops::cross_entropy_forward(logits, b.targets, b.loss_mask, lse);
  out.masked = b.masked_tokens();
  if (!scale) return out;

  // Backward.
  Tensor dlogits = Tensor::empty(logits.shape(), dt);
  ops::cross_entropy_backward(logits, b.targets, b.loss_mask, lse, scale->ce_scale, dlogits);
  logits = Tensor();
  Tensor dxf = Tensor::empty({n, c.dim}, dt);
  ParamGroup& head_grads = units_.back().groups[0];
  if (c.tie_word_embeddings) {
    ops::gemm(dlogits, ops::Transpose::kNo, w_out, ops::Transpose::kNo, dxf, ops::Accumulate::kNo);
    Tensor dtable = units_[0].groups[0].grad(0);
    ops::gemm(dlogits, ops::Transpose::kYes, xf, ops::Transpose::kNo, dtable,
              ops::Accumulate::kYes);
  } else {
    Tensor dw_out = head_grads.grad(1);
    ops::linear_backward(xf, w_out, dlogits, dxf, dw_out);
  }
  Tensor dx = Tensor::empty({n, c.dim}, dt);
  Tensor dnorm = head_grads.grad(0);
  ops::rmsnorm_backward(x, head.param(0), rstd, dxf, dx, dnorm);
  for (int64_t l = L - 1; l >= 0; --l) {
    BlockParams g = bind_block_grads(units_[l + 1].groups);
    dx = block_backward(bind_block_params(units_[l + 1].groups), g, c, inputs[l], acts[l], dx,
                        scale->aux_scale);
  }
  Tensor dtable = units_[0].groups[0].grad(0);
  ops::embedding_backward(b.tokens, dx, dtable);
  return out;
}

void Qwen3Moe::update_router_biases() {
  if (cfg_.bias_update_rate <= 0) return;
  for (int64_t l = 0; l < cfg_.n_layers; ++l) {
    const int64_t* load = expert_load_[l].data<int64_t>();
    double mean = 0;
    for (int64_t e = 0; e < cfg_.n_experts; ++e) mean += static_cast<double>(load[e]);
    mean /= static_cast<double>(cfg_.n_experts);
    for (int64_t e = 0; e < cfg_.n_experts; ++e) {
      const double sign = mean > load[e] ? 1.0 : (mean < load[e] ? -1.0 : 0.0);
      router_bias_[l].set_item(e, router_bias_[l].item(e) + cfg_.bias_update_rate * sign);
    }
  }
}

}  // namespace mt
