// Training FLOPs per token, the convention of torchtitan/Megatron for MFU:
//   6 * active parameters + per layer 6 * heads * (qk_head_dim + v_head_dim) * seq_len.
// Active parameters weight each routed expert by top_k / n_experts; the embedding table counts
// only when tied (then it is also the LM head); router, norms and LM head count.
#pragma once
#include <cstdint>

#include "model/config.h"

namespace mt {

struct ParamCounts {
  int64_t total = 0;  // every trainable parameter
  double active = 0;  // per token, as defined above
};
ParamCounts count_params(const ModelConfig& c);
double train_flops_per_token(const ModelConfig& c, int64_t seq_len);

}  // namespace mt
