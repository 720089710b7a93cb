// Qwen3-MoE architecture: every field of the HF config.json that changes the math, plus the
// MoE routing options, numerics and memory policy of the trainer (how the ranks divide the work is
// model/parallel.h). Sizes are validated in one place (validate) with messages
// that name the key.
#pragma once
#include <array>
#include <cstdint>
#include <string>

#include "core/dtype.h"
#include "core/enum_names.h"
#include "core/tensor.h"
#include "moe/moe_layer.h"
#include "ops/expert_gemm.h"
#include "ops/routing_mode.h"

namespace mt {

enum class CheckpointPolicy { kNone, kSelective, kFull };
const char* policy_name(CheckpointPolicy p);
bool parse_policy(const std::string& s, CheckpointPolicy* out);

// The load-balancing loss over the layers (docs/config.md): kPerLayer, each layer's own
// Switch-Transformer loss, summed (moetrain's default, as Megatron-Core and torchtitan); or
// kTransformers, transformers' load_balancing_loss_func: one loss over every layer's routing
// taken as one batch (counts and mean scores pooled over the layers).
enum class AuxLossForm { kPerLayer, kTransformers };
inline constexpr std::array<EnumName<AuxLossForm>, 2> kAuxLossForms{
    {{AuxLossForm::kPerLayer, "per_layer"}, {AuxLossForm::kTransformers, "transformers"}}};

// The dense layers' products (docs/numerics.md): kBf16, or kFp8WgradWithHp, DeepSeek-V3's
// blockwise FP8 for the forward and input-gradient products of the attention projections and the
// LM head (activations and gradients in 1 x 128 blocks, weights in 128 x 128 tiles,
// model.fp8_scale), the weight gradients in bf16. The two 512-wide input gradients (k, v) stay
// bf16: they sum into their output inside cuBLAS's epilogue, which an FP8 product and an add
// would cost more than FP8 saves there (docs/benchmarks.md).
enum class DenseRecipe { kBf16, kFp8WgradWithHp };
inline constexpr std::array<EnumName<DenseRecipe>, 2> kDenseRecipes{
    {{DenseRecipe::kBf16, "bf16"}, {DenseRecipe::kFp8WgradWithHp, "fp8_wgrad_with_hp"}}};
// Under an FP8 dense recipe the LM head's backward quantizes its output gradient (dlogits) this
// many rows at a time, each slice's FP8 rows written by the cross-entropy backward and consumed
// by the input-gradient product before the next (a band of the FP8 kernel's walk, so the head's
// weight is read once a slice): the FP8 copy costs this many rows of the vocabulary, not a chunk.
inline constexpr int64_t kHeadFp8GradientRows = 4096;

struct ModelConfig {
  // --- architecture (HF Qwen3MoeConfig names in comments) ---
  int64_t vocab_size = 256;          // vocab_size
  int64_t dim = 64;                  // hidden_size
  int64_t n_layers = 2;              // num_hidden_layers
  int64_t n_heads = 4;               // num_attention_heads
  int64_t n_kv_heads = 2;            // num_key_value_heads
  int64_t head_dim = 16;             // head_dim (independent of dim / n_heads)
  int64_t n_experts = 8;             // num_experts
  int64_t top_k = 2;                 // num_experts_per_tok
  int64_t moe_dim = 64;              // moe_intermediate_size
  double rope_theta = 10000.0;       // rope_theta
  double rms_norm_eps = 1e-6;        // rms_norm_eps
  bool norm_topk_prob = true;        // norm_topk_prob
  bool tie_word_embeddings = false;  // tie_word_embeddings
  // --- routing and balancing ---
  double aux_loss_coef = 0.001;  // router_aux_loss_coef; 0 disables
  AuxLossForm aux_loss_form = AuxLossForm::kPerLayer;
  double bias_update_rate = 0.0;  // aux-loss-free balancing (0 = off)
  // learned, or a fixed pattern for benchmarks (balanced, skewed: ops/routing_mode.h).
  ops::RoutingMode routing = ops::RoutingMode::kLearned;
  // On the GPU: each expert's rows start on a 128-row boundary, so the forward and
  // input-gradient expert GEMMs run on fixed TMA descriptors; false: dense rows (up to E x 127
  // fewer rows in each of the layer's row buffers).
  bool pad_expert_rows = true;
  // --- numerics and memory ---
  // The experts' GEMMs (ops/expert_gemm.h): bf16, mxfp8 or mxfp8_wgrad_with_hp, with the MX
  // scale rule; MX recipes need dim and moe_dim to be multiples of 32. A run's comes from its
  // precision plan (model/precision.h), which takes the dispatch dtype from
  // parallel.ep_dispatch_dtype; here it stays bf16 unless a caller of the MoE layer sets it.
  ops::ExpertPrecision expert_precision;
  // The attention projections' and the LM head's products; FP8 takes expert_precision.fp8_scale
  // and needs dim, the heads' widths and vocab_size to be multiples of 128.
  DenseRecipe dense_recipe = DenseRecipe::kBf16;
  double init_std = 0.02;
  DType compute_dtype = DType::kF32;  // CPU: f32 to train, f64 for gradient checks
  // Mixed precision (GPU): the router's weights and GEMMs in f32 (its fp32 master weights and the
  // up-cast input; logits are f32 either way) or bf16 (the compute copy, as every other weight).
  DType router_dtype = DType::kF32;
  CheckpointPolicy checkpoint = CheckpointPolicy::kNone;
  // The LM head and loss run over this many tokens at a time (forward and backward together),
  // so at most chunk x vocab logits exist at once (the backward writes dlogits over them); 0 = all
  // tokens at once.
  int64_t loss_chunk_tokens = 8192;
  // Where the model runs (set by the trainer from hardware.device). On the GPU: fp32 master
  // weights and gradients, bf16 compute copies and activations, f32 statistics (RMSNorm rstd,
  // attention and loss LSE, routing). On the CPU everything is compute_dtype.
  Device device = Device::kCPU;
  // Replay each training pass as a CUDA graph where it can be captured (hardware.cuda_graphs;
  // Qwen3Moe::use_graphs says where).
  bool cuda_graphs = false;

  bool on_gpu() const { return device == Device::kCUDA; }
  DType master_dtype() const { return on_gpu() ? DType::kF32 : compute_dtype; }
  DType activation_dtype() const { return on_gpu() ? DType::kBF16 : compute_dtype; }
  DType stat_dtype() const { return on_gpu() ? DType::kF32 : compute_dtype; }

  moe::MoeConfig moe() const {
    return {dim,
            moe_dim,
            n_experts,
            top_k,
            norm_topk_prob,
            routing,
            expert_precision,
            pad_expert_rows,
            checkpoint == CheckpointPolicy::kNone ? moe::ForwardRows::kKept
                                                  : moe::ForwardRows::kRecomputed};
  }
  int64_t q_dim() const { return n_heads * head_dim; }
  int64_t kv_dim() const { return n_kv_heads * head_dim; }
  bool dense_fp8() const { return dense_recipe != DenseRecipe::kBf16; }
  // Throws ConfigError naming the first impossible field ("model.<key>").
  void validate() const;
};

// Reads a Hugging Face config.json (Qwen3MoeForCausalLM) into the architecture fields; the
// routing/numerics fields keep their values. Unsupported variants (dense layers via
// mlp_only_layers, decoder_sparse_step != 1, sliding window) are rejected by name.
ModelConfig model_config_from_hf_json(const std::string& path, ModelConfig base);

}  // namespace mt
