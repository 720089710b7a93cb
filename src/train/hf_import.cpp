#include "train/hf_import.h"

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <vector>

#include "core/error.h"
#include "train/checkpoint.h"

namespace mt {

namespace {

namespace fs = std::filesystem;

// name -> tensor (host) of every file of the directory.
std::map<std::string, Tensor> read_hf_tensors(const std::string& dir) {
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  std::vector<std::string> files;
  if (fs::exists(index)) {
    std::ifstream in(index);
    nlohmann::json j;
    try {
      in >> j;
    } catch (const std::exception& e) {
      throw CheckpointError(
          fmt::format("hf: '{}' is not valid JSON: {}", index.string(), e.what()));
    }
    if (!j.contains("weight_map") || !j["weight_map"].is_object())
      throw CheckpointError(fmt::format("hf: '{}' has no weight_map object", index.string()));
    std::set<std::string> names;
    for (const auto& [tensor, file] : j["weight_map"].items()) {
      if (!file.is_string())
        throw CheckpointError(
            fmt::format("hf: '{}': weight_map[{}] is not a file name", index.string(), tensor));
      names.insert(file.get<std::string>());
    }
    files.assign(names.begin(), names.end());
  } else {
    files.push_back("model.safetensors");
  }
  std::map<std::string, Tensor> out;
  for (const std::string& f : files) {
    const fs::path path = fs::path(dir) / f;
    if (!fs::exists(path))
      throw CheckpointError(fmt::format("hf: '{}' is missing ({})", path.string(),
                                        fs::exists(index) ? "named by the index" : "no index"));
    SafetensorsFile file = read_safetensors(path.string());
    for (auto& [name, t] : file.tensors) {
      if (t.dtype() != DType::kBF16 && t.dtype() != DType::kF32)
        throw CheckpointError(fmt::format("hf: '{}': tensor {} is {}; bf16 and f32 are supported",
                                          path.string(), name, dtype_name(t.dtype())));
      if (!out.emplace(name, std::move(t)).second)
        throw CheckpointError(fmt::format("hf: tensor {} is in two files of '{}'", name, dir));
    }
  }
  return out;
}

// The HF tensors, taken by name: each is used once, and what is left over is an error.
class Source {
 public:
  Source(std::map<std::string, Tensor> t, std::string dir)
      : t_(std::move(t)), dir_(std::move(dir)) {}
  bool has(const std::string& name) const { return t_.count(name) > 0; }
  // The tensor as f64 on the host, checked against its expected shape.
  Tensor take(const std::string& name, const Shape& shape) {
    const auto it = t_.find(name);
    if (it == t_.end()) throw CheckpointError(fmt::format("hf: '{}' lacks tensor {}", dir_, name));
    if (it->second.shape() != shape)
      throw CheckpointError(fmt::format("hf: '{}': tensor {} is {}, the model needs {}", dir_, name,
                                        shape_str(it->second.shape()), shape_str(shape)));
    used_.insert(name);
    return it->second.to(DType::kF64);
  }
  void expect_all_used() const {
    for (const auto& [name, _] : t_)
      if (!used_.count(name))
        throw CheckpointError(
            fmt::format("hf: '{}' holds tensor {}, which no parameter of this model takes (another "
                        "architecture, or a config.json that does not match the weights)",
                        dir_, name));
  }

 private:
  std::map<std::string, Tensor> t_;
  std::set<std::string> used_;
  std::string dir_;
};

}  // namespace

Tensor transposed_f64(const Tensor& in) {
  const int64_t r = in.dim(0), c = in.dim(1);
  Tensor out = Tensor::empty({c, r}, DType::kF64);
  const double* s = in.data<double>();
  double* d = out.data<double>();
  for (int64_t i = 0; i < r; ++i)
    for (int64_t j = 0; j < c; ++j) d[j * r + i] = s[i * c + j];
  return out;
}

namespace {

// moetrain's full value (f64, moetrain's layout) of a spec, from the HF tensors. Experts: the
// spec's local ones, from its init_offset.
Tensor hf_value(const ParamSpec& s, const ModelConfig& c, Source& src) {
  const int64_t d = c.dim, f = c.moe_dim, e = c.n_experts;
  if (s.name == "embed.table") return src.take("model.embed_tokens.weight", {c.vocab_size, d});
  if (s.name == "head.norm") return src.take("model.norm.weight", {d});
  if (s.name == "head.out") return transposed_f64(src.take("lm_head.weight", {c.vocab_size, d}));
  int64_t layer = -1;
  char rest[64] = {};
  MT_CHECK(std::sscanf(s.name.c_str(), "layers.%ld.%63s", &layer, rest) == 2,
           "parameter {} has no HF name", s.name);
  const std::string p = fmt::format("model.layers.{}.", layer), what = rest;
  if (what == "attn_norm") return src.take(p + "input_layernorm.weight", {d});
  if (what == "mlp_norm") return src.take(p + "post_attention_layernorm.weight", {d});
  if (what == "attn.q_norm") return src.take(p + "self_attn.q_norm.weight", {c.head_dim});
  if (what == "attn.k_norm") return src.take(p + "self_attn.k_norm.weight", {c.head_dim});
  if (what == "attn.wq")
    return transposed_f64(src.take(p + "self_attn.q_proj.weight", {c.q_dim(), d}));
  if (what == "attn.wk")
    return transposed_f64(src.take(p + "self_attn.k_proj.weight", {c.kv_dim(), d}));
  if (what == "attn.wv")
    return transposed_f64(src.take(p + "self_attn.v_proj.weight", {c.kv_dim(), d}));
  if (what == "attn.wo")
    return transposed_f64(src.take(p + "self_attn.o_proj.weight", {d, c.q_dim()}));
  if (what == "moe.router") return transposed_f64(src.take(p + "mlp.gate.weight", {e, d}));
  const bool gate_up = what == "moe.w_gate_up";
  MT_CHECK(gate_up || what == "moe.w_down", "parameter {} has no HF name", s.name);
  const int64_t local = s.shape[0], per = shape_numel(s.shape) / local;
  const int64_t first = s.init_offset / per;
  Tensor out = Tensor::empty(s.shape, DType::kF64);
  double* o = out.data<double>();
  const std::string merged = p + (gate_up ? "mlp.experts.gate_up_proj" : "mlp.experts.down_proj");
  if (src.has(merged)) {  // transformers 5: [E, 2F, D] and [E, D, F], each expert (out, in)
    const Tensor all = src.take(merged, gate_up ? Shape{e, 2 * f, d} : Shape{e, d, f});
    for (int64_t x = 0; x < local; ++x) {
      const Tensor one = transposed_f64(
          all.view((first + x) * per, gate_up ? Shape{2 * f, d} : Shape{d, f}).clone());
      std::copy(one.data<double>(), one.data<double>() + per, o + x * per);
    }
    return out;
  }
  for (int64_t x = 0; x < local; ++x) {
    const std::string q = fmt::format("{}mlp.experts.{}.", p, first + x);
    if (gate_up) {  // (D, 2F): gate columns, then up
      const Tensor g = transposed_f64(src.take(q + "gate_proj.weight", {f, d}));
      const Tensor u = transposed_f64(src.take(q + "up_proj.weight", {f, d}));
      for (int64_t r = 0; r < d; ++r)
        for (int64_t j = 0; j < f; ++j) {
          o[x * per + r * 2 * f + j] = g.data<double>()[r * f + j];
          o[x * per + r * 2 * f + f + j] = u.data<double>()[r * f + j];
        }
    } else {
      const Tensor w = transposed_f64(src.take(q + "down_proj.weight", {d, f}));
      std::copy(w.data<double>(), w.data<double>() + per, o + x * per);
    }
  }
  return out;
}

}  // namespace

ModelConfig hf_architecture(const std::string& dir, const ModelConfig& given) {
  const std::string path = (fs::path(dir) / "config.json").string();
  if (!fs::exists(path))
    throw ConfigError(
        fmt::format("--init-from '{}' has no config.json (a Hugging Face model "
                    "directory holds config.json and model.safetensors)",
                    dir));
  const ModelConfig hf = model_config_from_hf_json(path, given);
  const ModelConfig defaults;
  auto agree = [&](const char* key, auto ModelConfig::*field) {
    if (given.*field != defaults.*field && given.*field != hf.*field)
      throw ConfigError(fmt::format(
          "config: model.{} = {} disagrees with {}'s {} (leave it out, or give the checkpoint's)",
          key, given.*field, path, hf.*field));
  };
  agree("vocab_size", &ModelConfig::vocab_size);
  agree("dim", &ModelConfig::dim);
  agree("n_layers", &ModelConfig::n_layers);
  agree("n_heads", &ModelConfig::n_heads);
  agree("n_kv_heads", &ModelConfig::n_kv_heads);
  agree("head_dim", &ModelConfig::head_dim);
  agree("n_experts", &ModelConfig::n_experts);
  agree("top_k", &ModelConfig::top_k);
  agree("moe_dim", &ModelConfig::moe_dim);
  agree("rope_theta", &ModelConfig::rope_theta);
  agree("rms_norm_eps", &ModelConfig::rms_norm_eps);
  agree("norm_topk_prob", &ModelConfig::norm_topk_prob);
  agree("tie_word_embeddings", &ModelConfig::tie_word_embeddings);
  ModelConfig out = hf;
  // The trainer's own choices stay the given config's (config.json's initializer_range and
  // router_aux_loss_coef are transformers' defaults, not the run's).
  out.aux_loss_coef = given.aux_loss_coef;
  out.init_std = given.init_std;
  return out;
}

std::map<std::string, Tensor> hf_to_moetrain(std::map<std::string, Tensor> tensors,
                                             const Qwen3Moe& model, const std::string& where) {
  Source src(std::move(tensors), where);
  const ModelConfig& c = model.config();
  std::map<std::string, Tensor> out;
  for (const ParamUnit& u : model.units())
    for (const ParamGroup& g : u.groups)
      for (const ParamSpec& s : g.specs) out.emplace(s.name, hf_value(s, c, src));
  // Other ranks' experts are in the files too: mark them used. (Each rank reads whole files.)
  if (model.mesh() && model.mesh()->ep_size() > 1)
    for (int64_t l = 0; l < c.n_layers; ++l)
      for (int64_t x = 0; x < c.n_experts; ++x)
        for (const char* w : {"gate_proj", "up_proj", "down_proj"}) {
          const std::string name = fmt::format("model.layers.{}.mlp.experts.{}.{}.weight", l, x, w);
          const bool down = w[0] == 'd';
          if (src.has(name))
            (void)src.take(name, {down ? c.dim : c.moe_dim, down ? c.moe_dim : c.dim});
        }
  if (c.tie_word_embeddings && src.has("lm_head.weight"))  // a tied copy some exports keep
    (void)src.take("lm_head.weight", {c.vocab_size, c.dim});
  src.expect_all_used();
  return out;
}

void load_hf_weights(const std::string& dir, Qwen3Moe& model) {
  // Every value first (all errors before any parameter is written), then the writes.
  const std::map<std::string, Tensor> values = hf_to_moetrain(read_hf_tensors(dir), model, dir);
  for (ParamUnit& u : model.units())
    for (ParamGroup& g : u.groups) {
      for (const ParamSpec& s : g.specs)
        write_spec_slice(g.shard, g.shard_begin(), s, values.at(s.name));
      g.compute = Tensor();  // the compute copy is cast again at the next gather
    }
}

}  // namespace mt
