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
// One block's parameters: its dense group (attention, norms, router) and one expert's.
struct BlockParamCounts {
  int64_t dense = 0;
  int64_t per_expert = 0;
};
BlockParamCounts count_block_params(const ModelConfig& c);
double train_flops_per_token(const ModelConfig& c, int64_t seq_len);

// A lower bound of the activations one training pass of `tokens` tokens keeps on one rank, in
// bytes, under the model's checkpoint policy (block.h says what each policy keeps): the large
// tensors only (per layer, the attention projections and the expert rows, gate/up products and
// SwiGLU outputs, the router's f32 logits and scores), plus the LM head's logits for one chunk of
// model.loss_chunk_tokens. `expert_rows_factor` scales the expert
// rows a rank holds (1 without expert parallelism; the device exchange's buffers hold ep times
// the balanced share).
double activation_bytes(const ModelConfig& c, int64_t tokens, double expert_rows_factor = 1.0);

}  // namespace mt
