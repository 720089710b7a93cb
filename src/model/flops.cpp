#include "model/flops.h"

#include <algorithm>

namespace mt {

BlockParamCounts count_block_params(const ModelConfig& c) {
  const int64_t attn = c.dim * c.q_dim() + 2 * c.dim * c.kv_dim() + c.q_dim() * c.dim +
                       2 * c.head_dim /* q_norm, k_norm */ + c.dim /* attn norm */;
  const int64_t moe_dense = c.dim * c.n_experts /* router */ + c.dim /* mlp norm */;
  return {attn + moe_dense, 3 * c.dim * c.moe_dim};
}

ParamCounts count_params(const ModelConfig& c) {
  const BlockParamCounts b = count_block_params(c);
  const int64_t embed = c.vocab_size * c.dim;
  const int64_t head = c.tie_word_embeddings ? 0 : c.vocab_size * c.dim;
  ParamCounts p;
  p.total =
      embed + head + c.dim /* final norm */ + c.n_layers * (b.dense + c.n_experts * b.per_expert);
  const double active_expert = static_cast<double>(c.top_k) * b.per_expert;
  p.active = static_cast<double>(c.n_layers) * (b.dense + active_expert) +
             static_cast<double>(c.dim) + static_cast<double>(c.vocab_size) * c.dim;
  return p;
}

double train_flops_per_token(const ModelConfig& c, int64_t seq_len) {
  const double attention = 6.0 * c.n_layers * c.n_heads * (2.0 * c.head_dim) * seq_len;
  return 6.0 * count_params(c).active + attention;
}

double activation_bytes(const ModelConfig& c, int64_t tokens, double expert_rows_factor) {
  const double act = static_cast<double>(dtype_size(c.activation_dtype()));
  const double stat = static_cast<double>(dtype_size(c.stat_dtype()));
  const double d = static_cast<double>(c.dim), q = static_cast<double>(c.q_dim()),
               kv = static_cast<double>(c.kv_dim()), k = static_cast<double>(c.top_k),
               f = static_cast<double>(c.moe_dim), e = static_cast<double>(c.n_experts);
  // Per token and layer.
  const double inputs = d * act;                            // the block's input
  const double attention = (d + 3 * q + 4 * kv + d) * act;  // xn, q/qn/qr/out, k/v/kn/kr, h
  const double router = 2 * e * stat;                       // logits, scores
  const double experts = expert_rows_factor * k * (d + 3 * f) * act;  // rows, gate/up, SwiGLU
  double per_layer = 0;
  switch (c.checkpoint) {
    case CheckpointPolicy::kNone:
      per_layer = inputs + attention + router + experts;
      break;
    case CheckpointPolicy::kSelective:  // q, k, v, attention, routing, gate/up products
      per_layer = inputs + (2 * q + 2 * kv) * act + router + expert_rows_factor * k * 2 * f * act;
      break;
    case CheckpointPolicy::kFull:  // inputs and attention; one block's worth while it reruns
      per_layer = inputs + q * act;
      break;
  }
  const double n = static_cast<double>(tokens);
  double total = n * per_layer * static_cast<double>(c.n_layers);
  if (c.checkpoint == CheckpointPolicy::kFull)
    total += n * (attention + router + experts);  // the block being recomputed
  const double chunk =
      c.loss_chunk_tokens > 0 ? std::min(n, static_cast<double>(c.loss_chunk_tokens)) : n;
  // The head's (chunk, vocab) logits; the backward writes dlogits over them.
  total += chunk * static_cast<double>(c.vocab_size) * act;
  return total;
}

}  // namespace mt
