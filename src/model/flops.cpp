#include "model/flops.h"

namespace mt {

ParamCounts count_params(const ModelConfig& c) {
  const int64_t attn = c.dim * c.q_dim() + 2 * c.dim * c.kv_dim() + c.q_dim() * c.dim +
                       2 * c.head_dim /* q_norm, k_norm */ + c.dim /* attn norm */;
  const int64_t expert = 3 * c.dim * c.moe_dim;
  const int64_t moe_dense = c.dim * c.n_experts /* router */ + c.dim /* mlp norm */;
  const int64_t embed = c.vocab_size * c.dim;
  const int64_t head = c.tie_word_embeddings ? 0 : c.vocab_size * c.dim;
  ParamCounts p;
  p.total = embed + head + c.dim /* final norm */ +
            c.n_layers * (attn + moe_dense + c.n_experts * expert);
  const double active_expert = static_cast<double>(c.top_k) * expert;
  p.active = static_cast<double>(c.n_layers) * (attn + moe_dense + active_expert) +
             static_cast<double>(c.dim) + static_cast<double>(c.vocab_size) * c.dim;
  return p;
}

double train_flops_per_token(const ModelConfig& c, int64_t seq_len) {
  const double attention = 6.0 * c.n_layers * c.n_heads * (2.0 * c.head_dim) * seq_len;
  return 6.0 * count_params(c).active + attention;
}

}  // namespace mt
