#include "train/hf_import.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <vector>

#include "core/error.h"
#include "core/log.h"
#include "core/profile.h"
#include "dist/mesh.h"
#include "fsdp/fsdp.h"
#include "train/hf_layout.h"
#include "train/safetensors.h"

namespace mt {

namespace {

namespace fs = std::filesystem;

// Every tensor of an HF directory (model.safetensors, or the index and its shards), mapped.
class HfDirectory {
 public:
  explicit HfDirectory(const std::string& dir) {
    const fs::path index = fs::path(dir) / "model.safetensors.index.json";
    std::map<std::string, std::string> weight_map;  // tensor -> file, from the index
    std::set<std::string> files;
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
      for (const auto& [tensor, file] : j["weight_map"].items()) {
        if (!file.is_string())
          throw CheckpointError(
              fmt::format("hf: '{}': weight_map[{}] is not a file name", index.string(), tensor));
        weight_map[tensor] = file.get<std::string>();
        files.insert(file.get<std::string>());
      }
    } else {
      files.insert("model.safetensors");
    }
    for (const std::string& f : files) {
      const fs::path path = fs::path(dir) / f;
      if (!fs::exists(path))
        throw CheckpointError(fmt::format("hf: '{}' is missing ({})", path.string(),
                                          fs::exists(index) ? "named by the index" : "no index"));
      files_.push_back(std::make_unique<MappedSafetensors>(path.string()));
      for (const auto& [name, e] : files_.back()->tensors()) {
        if (e.dtype != DType::kBF16 && e.dtype != DType::kF16 && e.dtype != DType::kF32)
          throw CheckpointError(
              fmt::format("hf: '{}': tensor {} is {}; bf16, f16 and f32 are supported",
                          path.string(), name, dtype_name(e.dtype)));
        if (!tensors_.emplace(name, e).second)
          throw CheckpointError(fmt::format("hf: tensor {} is in two files of '{}'", name, dir));
        const auto w = weight_map.find(name);
        if (w != weight_map.end() && w->second != f)
          throw CheckpointError(fmt::format("hf: '{}' says tensor {} is in {}, it is in {}",
                                            index.string(), name, w->second, f));
      }
    }
    for (const auto& [name, file] : weight_map)
      if (!tensors_.count(name))
        throw CheckpointError(fmt::format("hf: '{}' names tensor {} in {}, which lacks it",
                                          index.string(), name, file));
  }
  const std::map<std::string, SafetensorsEntry>& tensors() const { return tensors_; }
  void release_pages() const {
    for (const auto& f : files_) f->release_pages();
  }

 private:
  std::vector<std::unique_ptr<MappedSafetensors>> files_;
  std::map<std::string, SafetensorsEntry> tensors_;
};

double load(const SafetensorsEntry& e, int64_t i) {
  switch (e.dtype) {
    case DType::kBF16:
      return from_bf16(reinterpret_cast<const bf16*>(e.data)[i]);
    case DType::kF16:
      return from_f16(reinterpret_cast<const f16*>(e.data)[i]);
    case DType::kF32:
      return reinterpret_cast<const float*>(e.data)[i];
    case DType::kF64:
      return reinterpret_cast<const double*>(e.data)[i];
    default:
      MT_CHECK(false, "hf: read of a {} tensor", dtype_name(e.dtype));
  }
  return 0;
}

// The expert layout of `t`, after checking it against the model: every tensor the model needs
// present with its shape, nothing left over (a tied checkpoint may keep a copy of lm_head).
HfExperts check_tensors(const std::map<std::string, SafetensorsEntry>& t, const Qwen3Moe& model,
                        const std::string& where) {
  const HfExperts experts = t.count("model.layers.0.mlp.experts.gate_up_proj")
                                ? HfExperts::kMerged
                                : HfExperts::kPerExpert;
  std::set<std::string> expected;
  for (const HfTensor& h : hf_tensors(model, experts)) {
    const auto it = t.find(h.name);
    if (it == t.end())
      throw CheckpointError(fmt::format("hf: '{}' lacks tensor {}", where, h.name));
    if (it->second.shape != h.shape)
      throw CheckpointError(fmt::format("hf: '{}': tensor {} is {}, the model needs {}", where,
                                        h.name, shape_str(it->second.shape), shape_str(h.shape)));
    expected.insert(h.name);
  }
  const ModelConfig& c = model.config();
  if (c.tie_word_embeddings) {
    const auto head = t.find("lm_head.weight");
    if (head != t.end() && head->second.shape == Shape{c.vocab_size, c.dim})
      expected.insert("lm_head.weight");
  }
  for (const auto& [name, _] : t)
    if (!expected.count(name))
      throw CheckpointError(
          fmt::format("hf: '{}' holds tensor {}, which no parameter of this model takes (another "
                      "architecture, or a config.json that does not match the weights)",
                      where, name));
  return experts;
}

// Elements [lo, hi) of the moetrain value of `layout`'s parameter into `dst` (host, hi - lo
// elements, f32 or f64).
void read_elements(const HfLayout& layout, const std::map<std::string, SafetensorsEntry>& t,
                   int64_t lo, int64_t hi, Tensor dst) {
  MT_CHECK(dst.dtype() == DType::kF64 || dst.dtype() == DType::kF32, "hf: read into {}",
           dtype_name(dst.dtype()));
  std::vector<const SafetensorsEntry*> src;
  for (const HfTensor& h : layout.tensors()) src.push_back(&t.at(h.name));
  if (dst.dtype() == DType::kF64) {
    double* d = dst.data<double>();
    layout.for_each_element(
        lo, hi, [&](int64_t j, HfLayout::Element e) { d[j - lo] = load(*src[e.tensor], e.index); });
  } else {
    float* d = dst.data<float>();
    layout.for_each_element(lo, hi, [&](int64_t j, HfLayout::Element e) {
      d[j - lo] = static_cast<float>(load(*src[e.tensor], e.index));
    });
  }
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
  std::map<std::string, SafetensorsEntry> entries;
  for (auto& [name, t] : tensors) {
    if (t.device() != Device::kCPU) t = t.to(Device::kCPU);
    entries.emplace(name,
                    SafetensorsEntry{t.dtype(), t.shape(), static_cast<const uint8_t*>(t.raw())});
  }
  const HfExperts experts = check_tensors(entries, model, where);
  std::map<std::string, Tensor> out;
  for (const ParamUnit& u : model.units())
    for (const ParamGroup& g : u.groups)
      for (const ParamSpec& s : g.specs) {
        Tensor v = Tensor::empty(s.shape, DType::kF64);
        read_elements(HfLayout(s, model.config(), experts), entries, 0, v.numel(),
                      v.reshape({v.numel()}));
        out.emplace(s.name, std::move(v));
      }
  return out;
}

void load_hf_weights(const std::string& dir, Qwen3Moe& model) {
  const auto start = std::chrono::steady_clock::now();
  const int64_t peak_before = profile::peak_host_bytes();
  const HfDirectory hf(dir);
  const HfExperts experts = check_tensors(hf.tensors(), model, dir);  // before any write
  for (ParamUnit& u : model.units())
    for (ParamGroup& g : u.groups) {
      Tensor host = g.shard.to(Device::kCPU);
      const int64_t begin = g.shard_begin(), end = begin + host.numel();
      for (const ParamSpec& s : g.specs) {
        const int64_t lo = std::max(begin, s.offset),
                      hi = std::min(end, s.offset + shape_numel(s.shape));
        if (lo < hi)
          read_elements(HfLayout(s, model.config(), experts), hf.tensors(), lo - s.offset,
                        hi - s.offset, host.view(lo - begin, {hi - lo}));
      }
      g.shard.copy_from(host);
      fsdp::drop_compute_copies(g);  // cast (and MX-copied) again at the next gather
      hf.release_pages();            // a rank holds one group's source pages at a time
    }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  log::info(
      "hf import: rank {} read its slices of {} tensors from '{}' in {:.1f} s; peak host "
      "memory {:.2f} GiB ({:.2f} GiB before the import)",
      model.mesh() ? model.mesh()->world().rank() : 0, hf.tensors().size(), dir, seconds,
      static_cast<double>(profile::peak_host_bytes()) / (1 << 30),
      static_cast<double>(peak_before) / (1 << 30));
}

}  // namespace mt
