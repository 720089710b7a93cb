// Token-choice top-k routing, as Qwen3-MoE: scores = softmax(logits) in the compute dtype
// (fp32 at least), the k largest of (scores + bias) are chosen, and their routing weights are
// the chosen scores, renormalised to sum 1 when norm_topk_prob. The bias (aux-loss-free
// balancing, DeepSeek-V3) only steers the choice, never the weights. Forced-balanced routing
// (benchmarks) sends token t's choice j to expert (t*k + j) mod E with the scores gathered there.
#pragma once
#include <string_view>

#include "core/tensor.h"
#include "ops/routing_mode.h"

namespace mt::ops {

std::string_view routing_mode_name(RoutingMode m);  // "learned", "balanced", "skewed"
bool parse_routing_mode(std::string_view name, RoutingMode* out);

struct RouterOptions {
  int top_k = 1;
  bool norm_topk_prob = true;
  RoutingMode mode = RoutingMode::kLearned;
};

// N tokens, E experts, k choices.
struct Routing {
  Tensor scores;             // (N, E) softmax of the router logits
  Tensor expert_index;       // i32 (N, k), choice order: descending biased score
  Tensor expert_weight;      // (N, k) routing weights (they scale the experts' outputs)
  Tensor tokens_per_expert;  // i64 (E)
};

// logits (N, E); bias (E) or an undefined tensor.
void router_forward(const Tensor& logits, const Tensor& bias, const RouterOptions& opt,
                    Routing& out);

// What the load-balancing loss needs from a batch: its real tokens only (padding, Batch::padding,
// is outside it, as transformers' load_balancing_loss_func leaves out what its attention mask
// does). When the batch is split over ranks these are summed over ranks (all-reduce) so that
// every rank sees the loss of the whole batch. The token count is not kept: every token makes
// top_k choices, so it is sum(tokens_per_expert) / top_k, which the device reads where it is
// (a captured pass cannot take a host count that changes from batch to batch).
struct AuxStats {
  Tensor tokens_per_expert;  // i64 (E) choices of real tokens per expert (routing's device)
  Tensor score_sum;          // (E) sum over real tokens of the scores (routing's device)
  int64_t top_k = 1;
};
// padding: u8 (N), 1 where a token is left out; undefined: none is.
AuxStats router_aux_stats(const Routing& r, const Tensor& padding);

// pooled += layer, field by field (the counts, the score sums): the statistics of several layers
// taken as one batch, as transformers' load_balancing_loss_func takes every layer's router logits
// at once. `pooled` starts as zeros on the layer's device (zero_aux_stats).
AuxStats zero_aux_stats(const AuxStats& like);
void add_aux_stats(const AuxStats& layer, AuxStats& pooled);

// Switch-Transformer load-balancing loss as in HF Qwen3-MoE, per layer:
//   aux = E * sum_e (tokens_per_expert[e] / N) * (score_sum[e] / N),  N = sum(counts) / top_k,
// as one f64 element on the statistics' device (on the GPU it never visits the host); 0 when N
// is 0.
Tensor router_aux_loss(const AuxStats& s);

// dweight (N, k): gradient of the routing weights. aux_grad: d(total loss) / d(aux), with the
// statistics the forward used; padding tokens (as router_aux_stats) get no aux gradient.
// dlogits (N, E) overwritten. The counts are a step function: no gradient flows through them.
void router_backward(const Routing& r, const RouterOptions& opt, const AuxStats& stats,
                     const Tensor& padding, const Tensor& dweight, double aux_grad,
                     Tensor& dlogits);

}  // namespace mt::ops
