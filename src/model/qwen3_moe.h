// The Qwen3-MoE causal LM: embedding -> blocks -> final RMSNorm -> LM head -> cross-entropy.
// Parameter units: "embed" (table), "layers.i" (dense + expert groups), "head" (final norm and,
// unless tied, the LM head).
#pragma once
#include <vector>

#include "model/batch.h"
#include "model/block.h"
#include "model/config.h"
#include "model/params.h"

namespace mt {

// How one micro-batch's losses enter the step's objective:
//   total = sum_micro (ce_sum * ce_scale + aux_scale * sum_layers aux).
struct LossScale {
  double ce_scale = 1.0;   // 1 / (masked tokens of the whole step)
  double aux_scale = 0.0;  // aux_loss_coef / micro-batches per step
};

struct MicroBatchLosses {
  double ce_sum = 0;      // sum of the token losses over masked tokens
  double aux_sum = 0;     // sum over layers of the per-layer aux loss (no coefficient)
  int64_t masked = 0;
};

class Qwen3Moe {
 public:
  Qwen3Moe(const ModelConfig& c, uint64_t seed);

  const ModelConfig& config() const { return cfg_; }
  std::vector<ParamUnit>& units() { return units_; }
  const std::vector<ParamUnit>& units() const { return units_; }
  // Aux-loss-free balancing state: one (E) bias per layer (zero when the option is off).
  std::vector<Tensor>& router_biases() { return router_bias_; }
  // Tokens each expert received in this step, per layer (i64 (E)), reset by zero_grad.
  const std::vector<Tensor>& step_expert_load() const { return expert_load_; }

  void zero_grad();
  // Forward and backward of one micro-batch; gradients accumulate.
  MicroBatchLosses forward_backward(const Batch& b, const LossScale& s);
  // Forward only (evaluation and finite differences).
  MicroBatchLosses forward(const Batch& b);
  // bias_e += rate * sign(mean load - load_e) from this step's loads (DeepSeek-V3 style).
  void update_router_biases();

 private:
  MicroBatchLosses run(const Batch& b, const LossScale* s);
  Tensor head_weight() const;  // (D, V) view, or the embedding table when tied (V, D)

  ModelConfig cfg_;
  std::vector<ParamUnit> units_;  // [0] embed, [1..L] layers, [L+1] head
  std::vector<Tensor> router_bias_;
  std::vector<Tensor> expert_load_;
};

}  // namespace mt
