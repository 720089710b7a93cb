#include "train/hf_export.h"

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "core/atomic_file.h"
#include "core/error.h"
#include "dist/mesh.h"
#include "train/checkpoint.h"
#include "train/hf_import.h"

namespace mt {

namespace {

namespace fs = std::filesystem;

constexpr size_t kShardBytes = size_t{5} << 30;  // the most one safetensors shard holds

// The whole parameter (every expert) of each spec, f64 on the host, by moetrain name. Sharded
// groups are all-gathered over their FSDP group; expert groups then over the EP group (EP rank p
// holds experts [p*L, (p+1)*L), so the ranks' blocks laid end to end are every expert).
std::map<std::string, Tensor> full_parameters(Qwen3Moe& model) {
  std::map<std::string, Tensor> out;
  dist::DeviceMesh* mesh = model.mesh();
  for (ParamUnit& u : model.units())
    for (ParamGroup& g : u.groups) {
      Tensor flat = g.shard.to(Device::kCPU).to(DType::kF64);
      if (g.sharded()) {
        Tensor all = Tensor::empty({flat.numel() * g.comm->size()}, DType::kF64);
        g.comm->all_gather(flat, all);
        flat = all;
      }
      const bool split = g.kind == ParamKind::kExpert && mesh && mesh->ep_size() > 1;
      for (const ParamSpec& s : g.specs) {
        Tensor mine = flat.view(s.offset, s.shape).clone();
        if (split) {
          Shape whole = s.shape;
          whole[0] *= mesh->ep_size();
          Tensor all = Tensor::empty(whole, DType::kF64);
          mesh->ep().all_gather(mine, all);
          mine = all;
        }
        out.emplace(s.name, mine);
      }
    }
  return out;
}

nlohmann::json hf_config(const ModelConfig& c, DType dtype) {
  nlohmann::json j;
  j["architectures"] = {"Qwen3MoeForCausalLM"};
  j["model_type"] = "qwen3_moe";
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.dim;
  j["num_hidden_layers"] = c.n_layers;
  j["num_attention_heads"] = c.n_heads;
  j["num_key_value_heads"] = c.n_kv_heads;
  j["head_dim"] = c.head_dim;
  j["num_local_experts"] = c.n_experts;  // transformers 5
  j["num_experts"] = c.n_experts;        // transformers 4, vLLM, SGLang
  j["num_experts_per_tok"] = c.top_k;
  j["moe_intermediate_size"] = c.moe_dim;
  j["intermediate_size"] = c.moe_dim;  // unused: every layer is MoE
  j["decoder_sparse_step"] = 1;
  j["mlp_only_layers"] = nlohmann::json::array();
  j["norm_topk_prob"] = c.norm_topk_prob;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["rope_theta"] = c.rope_theta;
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", c.rope_theta}};
  j["router_aux_loss_coef"] = c.aux_loss_coef;
  j["hidden_act"] = "silu";
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["use_sliding_window"] = false;
  j["initializer_range"] = c.init_std;
  j["max_position_embeddings"] = 40960;
  j["dtype"] = dtype == DType::kBF16 ? "bfloat16" : "float32";
  return j;
}

}  // namespace

void export_hf(Qwen3Moe& model, const std::string& out_dir, DType dtype,
               dist::Communicator* world) {
  MT_CHECK(dtype == DType::kBF16 || dtype == DType::kF32, "export in {}: bf16 or f32",
           dtype_name(dtype));
  const ModelConfig& c = model.config();
  std::map<std::string, Tensor> p = full_parameters(model);  // collective: every rank
  if (world && world->rank() != 0) return;
  const int64_t d = c.dim, f = c.moe_dim;
  // HF name -> tensor in `dtype`, in HF's layout.
  std::map<std::string, Tensor> hf;
  auto put = [&](const std::string& name, const Tensor& t) { hf.emplace(name, t.to(dtype)); };
  put("model.embed_tokens.weight", p.at("embed.table"));
  put("model.norm.weight", p.at("head.norm"));
  if (!c.tie_word_embeddings) put("lm_head.weight", transposed_f64(p.at("head.out")));
  for (int64_t l = 0; l < c.n_layers; ++l) {
    const std::string m = fmt::format("layers.{}.", l), h = fmt::format("model.layers.{}.", l);
    put(h + "input_layernorm.weight", p.at(m + "attn_norm"));
    put(h + "post_attention_layernorm.weight", p.at(m + "mlp_norm"));
    put(h + "self_attn.q_norm.weight", p.at(m + "attn.q_norm"));
    put(h + "self_attn.k_norm.weight", p.at(m + "attn.k_norm"));
    put(h + "self_attn.q_proj.weight", transposed_f64(p.at(m + "attn.wq")));
    put(h + "self_attn.k_proj.weight", transposed_f64(p.at(m + "attn.wk")));
    put(h + "self_attn.v_proj.weight", transposed_f64(p.at(m + "attn.wv")));
    put(h + "self_attn.o_proj.weight", transposed_f64(p.at(m + "attn.wo")));
    put(h + "mlp.gate.weight", transposed_f64(p.at(m + "moe.router")));
    const Tensor& gu = p.at(m + "moe.w_gate_up");  // (E, D, 2F)
    const Tensor& dn = p.at(m + "moe.w_down");     // (E, F, D)
    for (int64_t x = 0; x < c.n_experts; ++x) {
      const std::string e = fmt::format("{}mlp.experts.{}.", h, x);
      const Tensor both = gu.view(x * d * 2 * f, {d, 2 * f}).clone();
      Tensor gate = Tensor::empty({d, f}, DType::kF64), up = Tensor::empty({d, f}, DType::kF64);
      for (int64_t r = 0; r < d; ++r)
        for (int64_t j = 0; j < f; ++j) {
          gate.data<double>()[r * f + j] = both.data<double>()[r * 2 * f + j];
          up.data<double>()[r * f + j] = both.data<double>()[r * 2 * f + f + j];
        }
      put(e + "gate_proj.weight", transposed_f64(gate));
      put(e + "up_proj.weight", transposed_f64(up));
      put(e + "down_proj.weight", transposed_f64(dn.view(x * f * d, {f, d}).clone()));
    }
  }
  // Shards of at most kShardBytes, in name order; the index names each tensor's file.
  std::vector<std::vector<std::string>> shards(1);
  size_t bytes = 0, total = 0;
  for (const auto& [name, t] : hf) {
    if (bytes > 0 && bytes + t.nbytes() > kShardBytes) {
      shards.emplace_back();
      bytes = 0;
    }
    shards.back().push_back(name);
    bytes += t.nbytes();
    total += t.nbytes();
  }
  fs::create_directories(out_dir);
  nlohmann::json index;
  index["metadata"] = {{"total_size", total}};
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string file = shards.size() == 1 ? "model.safetensors"
                                                : fmt::format("model-{:05d}-of-{:05d}.safetensors",
                                                              i + 1, shards.size());
    SafetensorsFile sf;
    sf.metadata["format"] = "pt";
    for (const std::string& name : shards[i]) {
      sf.tensors.emplace(name, hf.at(name));
      index["weight_map"][name] = file;
    }
    write_safetensors((fs::path(out_dir) / file).string(), sf);
  }
  if (shards.size() > 1)
    write_file_atomically((fs::path(out_dir) / "model.safetensors.index.json").string(),
                          index.dump(2) + "\n");
  write_file_atomically((fs::path(out_dir) / "config.json").string(),
                        hf_config(c, dtype).dump(2) + "\n");
}

}  // namespace mt
