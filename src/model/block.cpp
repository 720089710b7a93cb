#include "model/block.h"

#include <cmath>
#include <optional>

#include "core/profile.h"
#include "model/context_parallel.h"
#include "ops/attention.h"
#include "ops/elementwise.h"
#include "ops/fp8.h"
#include "ops/fp8_gemm.h"
#include "ops/gemm.h"
#include "ops/norm.h"
#include "ops/rope.h"

namespace mt {

namespace {

// The one table of a block's parameters; bind_* read the groups in this order.
enum DenseIndex { kAttnNorm, kWq, kWk, kWv, kWo, kQNorm, kKNorm, kMlpNorm, kRouter };
enum ExpertIndex { kGateUp, kDown };

BlockParams bind(const std::vector<ParamGroup>& groups, bool grads) {
  MT_CHECK(groups.size() == 2, "a block unit has 2 parameter groups, got {}", groups.size());
  auto get = [&](int group, int i) {
    return grads ? groups[group].grad(i) : groups[group].weight(i);
  };
  BlockParams p;
  p.attn_norm = get(0, kAttnNorm);
  p.wq = get(0, kWq);
  p.wk = get(0, kWk);
  p.wv = get(0, kWv);
  p.wo = get(0, kWo);
  p.q_norm = get(0, kQNorm);
  p.k_norm = get(0, kKNorm);
  p.mlp_norm = get(0, kMlpNorm);
  p.moe.router = get(0, kRouter);
  p.moe.w_gate_up = get(1, kGateUp);
  p.moe.w_down = get(1, kDown);
  if (!grads) {
    p.moe.gate_up_copies = groups[1].quant_copies(kGateUp);
    p.moe.down_copies = groups[1].quant_copies(kDown);
  }
  return p;
}

void drop_for_policy(BlockActivations& a, CheckpointPolicy policy) {
  if (policy == CheckpointPolicy::kNone) return;
  a.xn = a.attn_rstd = a.qn = a.q_rstd = a.kn = a.k_rstd = a.qr = a.kr = Tensor();
  a.h = a.hn = a.mlp_rstd = Tensor();
  // The gathers are rebuilt; the exchange's outputs (xr, wr) stay: no re-sending.
  a.moe.drop_expert_rows();
  if (policy == CheckpointPolicy::kSelective) return;
  a.q = a.k = a.v = Tensor();
  a.moe = moe::MoeActivations();
}

double attention_scale(const ModelConfig& c) {
  return 1.0 / std::sqrt(static_cast<double>(c.head_dim));
}

Tensor new_like(const Tensor& t) {
  return Tensor::empty(t.shape(), t.dtype(), t.device());
}

// Computes every activation that is not saved, in forward order; attention is never rerun.
void block_fill(const BlockParams& p, const ModelConfig& c, const BlockInputs& in,
                BlockActivations& a, moe::FillFor fill) {
  const int64_t n = a.x.dim(0);
  const DType dt = a.x.dtype(), st = c.stat_dtype();
  const Device dev = a.x.device();
  std::optional<profile::Phase> phase(std::in_place, "attention_half.fill");
  if (!a.xn.defined()) {
    a.xn = new_like(a.x);
    a.attn_rstd = Tensor::empty({n}, st, dev);
    ops::rmsnorm_forward(a.x, p.attn_norm, c.rms_norm_eps, a.xn, a.attn_rstd);
  }
  if (!a.q.defined()) {
    a.q = Tensor::empty({n, c.q_dim()}, dt, dev);
    a.k = Tensor::empty({n, c.kv_dim()}, dt, dev);
    a.v = Tensor::empty({n, c.kv_dim()}, dt, dev);
    if (c.dense_fp8()) {  // xn quantized once for the three products
      const Fp8ScaleRule rule = c.expert_precision.fp8_scale;
      const QuantTensor xq = ops::fp8_rows(a.xn, rule);
      ops::fp8_linear_forward(xq, p.wq, ops::Transpose::kNo, rule, a.q);
      ops::fp8_linear_forward(xq, p.wk, ops::Transpose::kNo, rule, a.k);
      ops::fp8_linear_forward(xq, p.wv, ops::Transpose::kNo, rule, a.v);
    } else {
      ops::linear_forward(a.xn, p.wq, a.q);
      ops::linear_forward(a.xn, p.wk, a.k);
      ops::linear_forward(a.xn, p.wv, a.v);
    }
  }
  // Context parallelism: the rows' V gathered while this rank's norms and RoPE run, then K.
  const bool attend = !a.attn.defined();
  std::optional<ContextRowsGather> v_rows, k_rows;
  if (in.cp && attend)
    v_rows.emplace(*in.cp, in.batch->context, a.v.reshape({n, c.n_kv_heads, c.head_dim}));
  if (!a.qn.defined()) {
    a.qn = Tensor::empty({n * c.n_heads, c.head_dim}, dt, dev);
    a.kn = Tensor::empty({n * c.n_kv_heads, c.head_dim}, dt, dev);
    a.q_rstd = Tensor::empty({n * c.n_heads}, st, dev);
    a.k_rstd = Tensor::empty({n * c.n_kv_heads}, st, dev);
    ops::rmsnorm_forward(a.q.reshape(a.qn.shape()), p.q_norm, c.rms_norm_eps, a.qn, a.q_rstd);
    ops::rmsnorm_forward(a.k.reshape(a.kn.shape()), p.k_norm, c.rms_norm_eps, a.kn, a.k_rstd);
  }
  if (!a.qr.defined()) {
    a.qr = Tensor::empty({n, c.n_heads, c.head_dim}, dt, dev);
    a.kr = Tensor::empty({n, c.n_kv_heads, c.head_dim}, dt, dev);
    ops::rope_forward(a.kn.reshape(a.kr.shape()), in.batch->positions, c.rope_theta, a.kr);
    if (in.cp && attend) k_rows.emplace(*in.cp, in.batch->context, a.kr);
    ops::rope_forward(a.qn.reshape(a.qr.shape()), in.batch->positions, c.rope_theta, a.qr);
  }
  if (in.cp && attend && !k_rows) k_rows.emplace(*in.cp, in.batch->context, a.kr);
  if (attend) {
    a.attn = Tensor::empty({n, c.n_heads, c.head_dim}, dt, dev);
    a.lse = Tensor::empty({n, c.n_heads}, st, dev);
    const Tensor v = a.v.reshape({n, c.n_kv_heads, c.head_dim});
    if (in.cp) {  // this rank's queries against the rows' keys and values
      Tensor keys, values;
      {
        const profile::Phase gather("cp.gather_kv");
        keys = k_rows->rows();
        values = v_rows->rows();
      }
      const profile::Phase sdpa("sdpa.forward");
      ops::attention_forward_rows(a.qr, in.batch->context.chunks, keys, values,
                                  in.batch->documents(), attention_scale(c), a.attn, a.lse);
    } else {
      const profile::Phase sdpa("sdpa.forward");
      ops::attention_forward(a.qr, a.kr, v, in.batch->documents(), attention_scale(c), a.attn,
                             a.lse);
    }
  }
  if (!a.h.defined()) {  // h = x + attn wo: the residual added in the GEMM's epilogue
    a.h = new_like(a.x);
    const Tensor attn = a.attn.reshape({n, c.q_dim()});
    if (c.dense_fp8()) {  // the FP8 kernel writes the product; the residual added after
      const Fp8ScaleRule rule = c.expert_precision.fp8_scale;
      ops::fp8_linear_forward(ops::fp8_rows(attn, rule), p.wo, ops::Transpose::kNo, rule, a.h);
      ops::add_(a.h, a.x);
    } else {
      ops::linear_forward_residual(attn, p.wo, a.x, a.h);
    }
  }
  if (!a.hn.defined()) {
    a.hn = new_like(a.x);
    a.mlp_rstd = Tensor::empty({n}, st, dev);
    ops::rmsnorm_forward(a.h, p.mlp_norm, c.rms_norm_eps, a.hn, a.mlp_rstd);
  }
  phase.emplace("moe.fill");
  a.moe.padding = in.batch->padding;
  moe::moe_fill(p.moe, c.moe(), in.comms, in.router_bias, a.hn, a.moe, fill);
}

}  // namespace

std::vector<ParamGroup> make_block_groups(const ModelConfig& c, const PrecisionPlan& precision,
                                          int64_t layer, int64_t first_expert,
                                          int64_t local_experts) {
  const std::string pre = fmt::format("layers.{}.", layer);
  std::vector<ParamSpec> dense = {
      {pre + "attn_norm", {c.dim}, true},         {pre + "attn.wq", {c.dim, c.q_dim()}},
      {pre + "attn.wk", {c.dim, c.kv_dim()}},     {pre + "attn.wv", {c.dim, c.kv_dim()}},
      {pre + "attn.wo", {c.q_dim(), c.dim}},      {pre + "attn.q_norm", {c.head_dim}, true},
      {pre + "attn.k_norm", {c.head_dim}, true},  {pre + "mlp_norm", {c.dim}, true},
      {pre + "moe.router", {c.dim, c.n_experts}},
  };
  dense.back().master_weight = c.router_dtype == DType::kF32;               // read the fp32 masters
  const int64_t gate_up = c.dim * 2 * c.moe_dim, down = c.moe_dim * c.dim;  // per expert
  std::vector<ParamSpec> experts = {
      {pre + "moe.w_gate_up",
       {local_experts, c.dim, 2 * c.moe_dim},
       false,
       0,
       first_expert * gate_up},
      {pre + "moe.w_down", {local_experts, c.moe_dim, c.dim}, false, 0, first_expert * down},
  };
  // Under an MX or FP8 recipe the group keeps each matrix's quantized copies (made at each gather).
  for (ParamSpec& s : experts) s.quant_copies = precision.expert_weight_copies;
  std::vector<ParamGroup> groups;
  groups.push_back(make_param_group(ParamKind::kDense, std::move(dense), c.master_dtype()));
  groups.push_back(make_param_group(ParamKind::kExpert, std::move(experts), c.master_dtype()));
  groups.back().precision = precision.experts;
  return groups;
}

BlockParams bind_block_params(const std::vector<ParamGroup>& groups) {
  return bind(groups, false);
}
BlockParams bind_block_grads(const std::vector<ParamGroup>& groups) {
  return bind(groups, true);
}

Tensor block_forward(const BlockParams& p, const ModelConfig& c, const BlockInputs& in,
                     const Tensor& x, BlockActivations& a) {
  a = BlockActivations();
  a.x = x;
  block_fill(p, c, in, a, moe::FillFor::kForward);
  Tensor out = new_like(x);
  const profile::Phase phase("moe.combine");
  moe::moe_combine(p.moe, c.moe(), in.comms, a.moe, out,
                   &a.h);  // the residual add in the combine's pass
  a.tokens_per_expert = a.moe.routing.tokens_per_expert;
  a.aux_loss = a.moe.aux_loss;
  a.aux_stats = a.moe.aux_stats;
  drop_for_policy(a, c.checkpoint);
  return out;
}

Tensor block_backward(const BlockParams& p, BlockParams& g, const ModelConfig& c,
                      const BlockInputs& in, BlockActivations& a, const Tensor& dout,
                      double aux_grad, ops::Accumulate expert_grads) {
  block_fill(p, c, in, a, moe::FillFor::kBackward);
  a.moe.aux_stats = a.aux_stats;  // the forward's (a recomputed routing has per-layer ones)
  const int64_t n = a.x.dim(0);
  const DType dt = a.x.dtype();
  const Device dev = a.x.device();

  // Context parallelism: the rows' keys and values gathered again, crossing while the MoE half's
  // backward runs.
  std::optional<ContextRowsGather> k_rows, v_rows;
  if (in.cp) {
    k_rows.emplace(*in.cp, in.batch->context, a.kr);
    v_rows.emplace(*in.cp, in.batch->context, a.v.reshape({n, c.n_kv_heads, c.head_dim}));
  }

  // MoE half: out = h + moe(rmsnorm(h)).
  std::optional<profile::Phase> phase(std::in_place, "moe.backward");
  Tensor dh = dout.clone();
  Tensor dhn =
      moe::moe_backward(p.moe, g.moe, c.moe(), in.comms, a.hn, a.moe, dout, aux_grad, expert_grads);
  Tensor tmp = new_like(a.x);
  ops::rmsnorm_backward(a.h, p.mlp_norm, a.mlp_rstd, dhn, tmp, g.mlp_norm);
  ops::add_(dh, tmp);

  // Attention half: h = x + attn(rmsnorm(x)) @ wo.
  phase.emplace("attention_half.backward");
  Tensor dx = dh.clone();
  Tensor dattn = Tensor::empty({n, c.q_dim()}, dt, dev);
  if (c.dense_fp8()) {
    ops::fp8_linear_backward(a.attn.reshape({n, c.q_dim()}), p.wo, dh, c.expert_precision.fp8_scale,
                             dattn, g.wo);
  } else {
    ops::linear_backward(a.attn.reshape({n, c.q_dim()}), p.wo, dh, dattn, g.wo);
  }
  Tensor dqr = new_like(a.qr), dkr = new_like(a.kr);
  Tensor dv = Tensor::empty({n, c.n_kv_heads, c.head_dim}, dt, dev);
  std::optional<ContextRowsReduce> dk_sum, dv_sum;  // context parallelism: in flight below
  if (in.cp) {  // the rows' keys and values again; this rank's share of their gradients
    const ContextShard& shard = in.batch->context;
    Tensor keys, values;
    {
      const profile::Phase gather("cp.gather_kv");
      keys = k_rows->rows();
      values = v_rows->rows();
    }
    Tensor dk_rows = new_like(keys), dv_rows = new_like(values);
    {
      const profile::Phase sdpa("sdpa.backward");
      ops::attention_backward_rows(a.qr, shard.chunks, keys, values, a.attn, a.lse,
                                   dattn.reshape(a.attn.shape()), in.batch->documents(),
                                   attention_scale(c), dqr, dk_rows, dv_rows);
    }
    dk_sum.emplace(*in.cp, shard, dk_rows, dkr);
    dv_sum.emplace(*in.cp, shard, dv_rows, dv);
  } else {
    const profile::Phase sdpa("sdpa.backward");
    ops::attention_backward(a.qr, a.kr, a.v.reshape(dv.shape()), a.attn, a.lse,
                            dattn.reshape(a.attn.shape()), in.batch->documents(),
                            attention_scale(c), dqr, dkr, dv);
  }
  // The queries' chain first: under context parallelism the keys' and values' gradient sums cross
  // meanwhile (the same ops and accumulation order either way).
  Tensor dqn = new_like(a.qn), dkn = new_like(a.kn);
  Tensor dqn_heads = dqn.reshape(dqr.shape()), dkn_heads = dkn.reshape(dkr.shape());
  ops::rope_backward(dqr, in.batch->positions, c.rope_theta, dqn_heads);
  Tensor dq = new_like(a.qn), dk = new_like(a.kn);
  ops::rmsnorm_backward(a.q.reshape(a.qn.shape()), p.q_norm, a.q_rstd, dqn, dq, g.q_norm);
  Tensor dxn = new_like(a.x);
  if (c.dense_fp8()) {  // k's and v's input gradients below sum into this one in bf16
    ops::fp8_linear_backward(a.xn, p.wq, dq.reshape({n, c.q_dim()}), c.expert_precision.fp8_scale,
                             dxn, g.wq);
  } else {
    ops::linear_backward(a.xn, p.wq, dq.reshape({n, c.q_dim()}), dxn, g.wq);
  }
  if (dk_sum) {
    const profile::Phase reduce("cp.reduce_scatter_dk");
    dk_sum->wait();
  }
  ops::rope_backward(dkr, in.batch->positions, c.rope_theta, dkn_heads);
  ops::rmsnorm_backward(a.k.reshape(a.kn.shape()), p.k_norm, a.k_rstd, dkn, dk, g.k_norm);
  ops::linear_backward(a.xn, p.wk, dk.reshape({n, c.kv_dim()}), dxn, g.wk, ops::Accumulate::kYes);
  if (dv_sum) {
    const profile::Phase reduce("cp.reduce_scatter_dv");
    dv_sum->wait();
  }
  ops::linear_backward(a.xn, p.wv, dv.reshape({n, c.kv_dim()}), dxn, g.wv, ops::Accumulate::kYes);
  ops::rmsnorm_backward(a.x, p.attn_norm, a.attn_rstd, dxn, tmp, g.attn_norm);
  ops::add_(dx, tmp);
  a = BlockActivations();
  return dx;
}

}  // namespace mt
