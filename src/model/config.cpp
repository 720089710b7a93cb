#include "model/config.h"

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <utility>

#include "core/error.h"

namespace mt {

const char* policy_name(CheckpointPolicy p) {
  switch (p) {
    case CheckpointPolicy::kNone:
      return "none";
    case CheckpointPolicy::kSelective:
      return "selective";
    case CheckpointPolicy::kFull:
      return "full";
  }
  return "?";
}

bool parse_policy(const std::string& s, CheckpointPolicy* out) {
  for (auto p : {CheckpointPolicy::kNone, CheckpointPolicy::kSelective, CheckpointPolicy::kFull}) {
    if (s == policy_name(p)) {
      *out = p;
      return true;
    }
  }
  return false;
}

void ModelConfig::validate() const {
  auto positive = [](const char* key, int64_t v) {
    if (v <= 0) throw ConfigError(fmt::format("config: model.{} = {} must be > 0", key, v));
  };
  positive("vocab_size", vocab_size);
  positive("dim", dim);
  positive("n_layers", n_layers);
  positive("n_heads", n_heads);
  positive("n_kv_heads", n_kv_heads);
  positive("head_dim", head_dim);
  positive("n_experts", n_experts);
  positive("top_k", top_k);
  positive("moe_dim", moe_dim);
  if (const int64_t block = expert_precision.dim_multiple(); block > 1)
    for (const auto& [key, v] : {std::pair{"dim", dim}, std::pair{"moe_dim", moe_dim}})
      if (v % block != 0)
        throw ConfigError(fmt::format(
            "config: model.{} = {} must be a multiple of {} with model.expert_recipe = \"{}\" (the "
            "recipe's quantization blocks run along it)",
            key, v, block, ops::expert_recipe_name(expert_precision.recipe)));
  if (dense_recipe != DenseRecipe::kBf16)
    for (const auto& [key, v] :
         {std::pair{"dim", dim}, std::pair{"n_heads x model.head_dim", q_dim()},
          std::pair{"n_kv_heads x model.head_dim", kv_dim()}, std::pair{"vocab_size", vocab_size}})
      if (v % kFp8Block != 0)
        throw ConfigError(fmt::format(
            "config: model.{} = {} must be a multiple of {} with model.dense_recipe = \"{}\" (the "
            "recipe's 128 x 128 weight tiles run along it)",
            key, v, kFp8Block, enum_name(kDenseRecipes, dense_recipe)));
  for (const auto& [key, v] :
       {std::pair{"rms_norm_eps", rms_norm_eps}, std::pair{"rope_theta", rope_theta}})
    if (!(v > 0)) throw ConfigError(fmt::format("config: model.{} = {} must be > 0", key, v));
  if (init_std < 0 || aux_loss_coef < 0 || bias_update_rate < 0)
    throw ConfigError(
        "config: model.init_std, model.aux_loss_coef and model.bias_update_rate must be >= 0");
  // Sizes whose products the engine forms: none may overflow, and none may ask for more than a
  // machine could hold (2^40 elements in one parameter tensor is 4 TiB in f32).
  constexpr long double kMaxElements = 1099511627776.0L;  // 2^40
  const long double experts = static_cast<long double>(n_experts) * dim * moe_dim * 3;
  const long double attention = static_cast<long double>(n_heads) * head_dim * dim;
  for (const auto& [what, elems] :
       {std::pair{"model.vocab_size x model.dim (embedding)",
                  static_cast<long double>(vocab_size) * dim},
        std::pair{"model.n_experts x model.dim x model.moe_dim (experts of one layer)", experts},
        std::pair{"model.n_heads x model.head_dim x model.dim (attention of one layer)", attention},
        std::pair{"model.n_layers x (experts + attention of one layer)",
                  n_layers * (experts + attention)}})
    if (elems > kMaxElements)
      throw ConfigError(fmt::format(
          "config: {} = {:.3g} elements, more than any machine holds (at most 2^40 per tensor)",
          what, static_cast<double>(elems)));
  if (n_heads % n_kv_heads != 0)
    throw ConfigError(
        fmt::format("config: model.n_heads = {} is not a multiple of model.n_kv_heads = {}",
                    n_heads, n_kv_heads));
  if (head_dim % 2 != 0)
    throw ConfigError(
        fmt::format("config: model.head_dim = {} must be even (RoPE rotates pairs)", head_dim));
  if (loss_chunk_tokens < 0)
    throw ConfigError(
        fmt::format("config: model.loss_chunk_tokens = {} must be >= 0 (0 = all tokens at once)",
                    loss_chunk_tokens));
  if (routing == ops::RoutingMode::kSkewed &&
      std::min(ops::skewed_hot_experts(n_experts), n_experts - ops::skewed_hot_experts(n_experts)) <
          (top_k + 1) / 2)
    throw ConfigError(fmt::format(
        "config: model.routing = \"skewed\" puts ceil(top_k / 2) = {} choices of a token on the "
        "{} hot experts (model.n_experts / 4) and the rest on the {} cold ones: needs "
        "model.n_experts >= {}",
        (top_k + 1) / 2, ops::skewed_hot_experts(n_experts),
        n_experts - ops::skewed_hot_experts(n_experts), 4 * ((top_k + 1) / 2)));
  if (top_k > n_experts)
    throw ConfigError(
        fmt::format("config: model.top_k = {} exceeds model.n_experts = {}", top_k, n_experts));
  if (vocab_size > (int64_t{1} << 31) - 1)
    throw ConfigError(
        fmt::format("config: model.vocab_size = {} does not fit i32 token ids", vocab_size));
  if (!(rope_theta > 0)) throw ConfigError("config: model.rope_theta must be > 0");
  if (!(rms_norm_eps > 0)) throw ConfigError("config: model.rms_norm_eps must be > 0");
  if (!(init_std > 0)) throw ConfigError("config: model.init_std must be > 0");
  if (aux_loss_coef < 0) throw ConfigError("config: model.aux_loss_coef must be >= 0");
  if (bias_update_rate < 0) throw ConfigError("config: model.bias_update_rate must be >= 0");
  if (!on_gpu() && compute_dtype != DType::kF32 && compute_dtype != DType::kF64)
    throw ConfigError(fmt::format(
        "config: model.compute_dtype = \"{}\" is not available on the CPU (valid: f32, f64)",
        dtype_name(compute_dtype)));
}

ModelConfig model_config_from_hf_json(const std::string& path, ModelConfig base) {
  std::ifstream in(path);
  if (!in) throw ConfigError(fmt::format("config: cannot open HF config '{}'", path));
  nlohmann::json j;
  try {
    in >> j;
  } catch (const std::exception& e) {
    throw ConfigError(fmt::format("config: '{}' is not valid JSON: {}", path, e.what()));
  }
  auto get_int = [&](const char* key, int64_t* out) {
    if (!j.contains(key)) throw ConfigError(fmt::format("config: '{}' lacks \"{}\"", path, key));
    if (!j[key].is_number_integer())
      throw ConfigError(fmt::format("config: '{}': \"{}\" must be an integer", path, key));
    *out = j[key].get<int64_t>();
  };
  auto get_num = [&](const char* key, double* out) {
    if (!j.contains(key)) return;
    if (!j[key].is_number())
      throw ConfigError(fmt::format("config: '{}': \"{}\" must be a number", path, key));
    *out = j[key].get<double>();
  };
  auto get_bool = [&](const char* key, bool* out) {
    if (!j.contains(key)) return;
    if (!j[key].is_boolean())
      throw ConfigError(fmt::format("config: '{}': \"{}\" must be true or false", path, key));
    *out = j[key].get<bool>();
  };
  // Only Qwen3-MoE: another architecture's config.json would map onto the wrong fields.
  if (j.contains("model_type") && j["model_type"] != "qwen3_moe")
    throw ConfigError(
        fmt::format("config: '{}' is model_type {}, not a Qwen3-MoE (model_type \"qwen3_moe\")",
                    path, j["model_type"].dump()));
  ModelConfig c = base;
  get_int("vocab_size", &c.vocab_size);
  get_int("hidden_size", &c.dim);
  get_int("num_hidden_layers", &c.n_layers);
  get_int("num_attention_heads", &c.n_heads);
  get_int("num_key_value_heads", &c.n_kv_heads);
  // transformers 4 and the published checkpoints: num_experts; transformers 5: num_local_experts.
  get_int(j.contains("num_experts") ? "num_experts" : "num_local_experts", &c.n_experts);
  get_int("num_experts_per_tok", &c.top_k);
  get_int("moe_intermediate_size", &c.moe_dim);
  if (j.contains("head_dim"))
    get_int("head_dim", &c.head_dim);
  else
    c.head_dim = c.dim / c.n_heads;
  get_num("rope_theta", &c.rope_theta);
  if (j.contains("rope_parameters") && j["rope_parameters"].is_object()) {  // transformers 5
    const nlohmann::json& rp = j["rope_parameters"];
    if (rp.contains("rope_type") && rp["rope_type"] != "default")
      throw ConfigError(fmt::format("config: '{}': rope_parameters.rope_type {} is not supported",
                                    path, rp["rope_type"].dump()));
    if (rp.contains("rope_theta")) {
      if (!rp["rope_theta"].is_number())
        throw ConfigError(
            fmt::format("config: '{}': rope_parameters.rope_theta must be a number", path));
      c.rope_theta = rp["rope_theta"].get<double>();
    }
  }
  get_num("rms_norm_eps", &c.rms_norm_eps);
  get_num("router_aux_loss_coef", &c.aux_loss_coef);
  get_num("initializer_range", &c.init_std);
  get_bool("norm_topk_prob", &c.norm_topk_prob);
  get_bool("tie_word_embeddings", &c.tie_word_embeddings);
  if (j.contains("mlp_only_layers") && j["mlp_only_layers"].is_array() &&
      !j["mlp_only_layers"].empty())
    throw ConfigError(fmt::format(
        "config: '{}': mlp_only_layers (dense layers) is not supported; every layer must be MoE",
        path));
  if (j.contains("decoder_sparse_step") && j["decoder_sparse_step"] != 1)
    throw ConfigError(fmt::format("config: '{}': decoder_sparse_step must be 1", path));
  if (j.value("use_sliding_window", false))
    throw ConfigError(fmt::format("config: '{}': use_sliding_window is not supported", path));
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null())
    throw ConfigError(fmt::format("config: '{}': rope_scaling is not supported", path));
  c.validate();
  return c;
}

}  // namespace mt
