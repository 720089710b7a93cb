// One Qwen3-MoE decoder block: x -> x + Attn(RMSNorm(x)) = h -> h + MoE(RMSNorm(h)).
// Attention: q, k, v projections, per-head RMSNorm on q and k (before RoPE, as HF), RoPE,
// causal packed-document GQA attention, output projection.
#pragma once
#include "fsdp/params.h"
#include "model/batch.h"
#include "model/config.h"
#include "model/precision.h"
#include "moe/moe_layer.h"

namespace mt {

// Views into a block unit's two flat buffers (or its gradients). Shapes: D = dim, H = heads,
// KV = kv heads, hd = head_dim, E = experts, F = moe_dim.
struct BlockParams {
  Tensor attn_norm;     // (D)
  Tensor wq;            // (D, H*hd)
  Tensor wk;            // (D, KV*hd)
  Tensor wv;            // (D, KV*hd)
  Tensor wo;            // (H*hd, D)
  Tensor q_norm;        // (hd)
  Tensor k_norm;        // (hd)
  Tensor mlp_norm;      // (D)
  moe::MoeWeights moe;  // router (D, E) dense; w_gate_up (E, D, 2F), w_down (E, F, D) expert
};

// The block unit's parameter groups: [0] dense, [1] expert, the latter holding experts
// [first_expert, first_expert + local_experts) (all of them without expert parallelism).
// Under an MX or FP8 recipe (the precision plan) the expert group keeps its matrices' quantized
// copies.
std::vector<ParamGroup> make_block_groups(const ModelConfig& c, const PrecisionPlan& precision,
                                          int64_t layer, int64_t first_expert,
                                          int64_t local_experts);
BlockParams bind_block_params(const std::vector<ParamGroup>& groups);
BlockParams bind_block_grads(const std::vector<ParamGroup>& groups);

// Saved activations. The checkpoint policy decides which survive the forward; block_fill
// recomputes the rest in backward (attention output and LSE always survive: attention never
// runs twice).
struct BlockActivations {
  Tensor x;              // (N, D)      block input             [all policies]
  Tensor attn, lse;      // (N, H, hd), (N, H)                  [all policies]
  Tensor q, k, v;        // GEMM outputs (N, H*hd), (N, KV*hd) x2          [none, selective]
  Tensor xn, attn_rstd;  // (N, D), (N)                         [none]
  Tensor qn, q_rstd, kn, k_rstd;  // (N*H, hd), (N*H), (N*KV, hd), (N*KV)  [none]
  Tensor qr, kr;                  // after RoPE (N, H, hd), (N, KV, hd)  [none]
  Tensor h, hn, mlp_rstd;         // (N, D), (N, D), (N)                 [none]
  moe::MoeActivations moe;  // routing, logits, gate_up (+ EP: xr, wr) [selective]; rest [none]
  // Step statistics, always kept, on the activations' device: i64 (E) rows routed to each
  // expert, and the aux loss (one f64) with the statistics it was computed from (the backward
  // uses these, also when the routing is recomputed; model.aux_loss_form = "transformers"
  // replaces them with the pooled ones after the forward).
  Tensor tokens_per_expert;
  Tensor aux_loss;
  ops::AuxStats aux_stats;
};

struct BlockInputs {
  const Batch* batch = nullptr;  // positions and cu_seqlens
  Tensor router_bias;            // (E) or undefined
  moe::MoeComms comms;           // EP and batch groups (null on one rank)
  // Context parallelism: the CP group (batch->context names this rank's tokens), else null.
  dist::Communicator* cp = nullptr;
};

// out (N, D). Keeps in `a` what the policy saves.
Tensor block_forward(const BlockParams& p, const ModelConfig& c, const BlockInputs& in,
                     const Tensor& x, BlockActivations& a);
// Returns dx (N, D); weight gradients accumulate into g (the expert ones are overwritten when
// expert_grads is kNo); releases `a`.
Tensor block_backward(const BlockParams& p, BlockParams& g, const ModelConfig& c,
                      const BlockInputs& in, BlockActivations& a, const Tensor& dout,
                      double aux_grad, ops::Accumulate expert_grads = ops::Accumulate::kYes);

}  // namespace mt
