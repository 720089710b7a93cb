#include "train/hf_export.h"

#include <chrono>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "core/atomic_file.h"
#include "core/error.h"
#include "core/log.h"
#include "core/profile.h"
#include "dist/mesh.h"
#include "ops/dispatch.h"
#include "train/hf_layout.h"
#include "train/safetensors.h"

namespace mt {

namespace {

namespace fs = std::filesystem;

// Every HF tensor in unit order, cut into shards of at most `max_bytes` (a larger tensor alone).
struct ShardPlan {
  std::vector<std::vector<SafetensorsWriter::Planned>> shards{1};
  std::map<std::string, size_t> shard_of;
  size_t total_bytes = 0;
  std::string file(size_t i) const {
    return shards.size() == 1
               ? "model.safetensors"
               : fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, shards.size());
  }
};

ShardPlan plan_shards(const Qwen3Moe& model, DType dtype, size_t max_bytes) {
  ShardPlan p;
  size_t bytes = 0;
  for (const HfTensor& t : hf_tensors(model, HfExperts::kPerExpert)) {
    const size_t n = static_cast<size_t>(shape_numel(t.shape)) * dtype_size(dtype);
    if (bytes > 0 && bytes + n > max_bytes) {
      p.shards.emplace_back();
      bytes = 0;
    }
    p.shards.back().push_back({t.name, dtype, t.shape});
    p.shard_of[t.name] = p.shards.size() - 1;
    bytes += n;
    p.total_bytes += n;
  }
  return p;
}

// The whole value of each of the group's parameters (every expert) in the shard's dtype on its
// device, by spec: the group's shards are gathered over FSDP, an expert parameter then over EP
// (EP rank p holds experts [p*L, (p+1)*L), so the ranks' blocks end to end are every expert).
// Collective; fn(spec, value) runs on every rank.
template <class F>
void for_each_whole_parameter(Qwen3Moe& model, ParamGroup& g, F&& fn) {
  dist::DeviceMesh* mesh = model.mesh();
  Tensor flat = g.shard;
  if (g.sharded()) {
    flat = Tensor::empty({g.shard.numel() * g.comm->size()}, g.shard.dtype(), g.shard.device());
    g.comm->all_gather(g.shard, flat);
  }
  const bool split = g.kind == ParamKind::kExpert && mesh && mesh->ep_size() > 1;
  for (const ParamSpec& s : g.specs) {
    Tensor value = flat.view(s.offset, s.shape);
    if (split) {
      Shape whole = s.shape;
      whole[0] *= mesh->ep_size();
      Tensor all = Tensor::empty(whole, value.dtype(), value.device());
      mesh->ep().all_gather(value, all);
      value = all;
    }
    fn(s, value);
  }
}

void store(void* base, DType t, int64_t i, double v) {
  if (t == DType::kBF16)
    static_cast<bf16*>(base)[i] = to_bf16(v);
  else
    static_cast<float*>(base)[i] = static_cast<float>(v);
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

void export_hf(Qwen3Moe& model, const std::string& out_dir, DType dtype, dist::Communicator* world,
               size_t max_shard_bytes) {
  MT_CHECK(dtype == DType::kBF16 || dtype == DType::kF32, "export in {}: bf16 or f32",
           dtype_name(dtype));
  const ModelConfig& c = model.config();
  const auto start = std::chrono::steady_clock::now();
  const bool writes = !world || world->rank() == 0;
  const ShardPlan plan = plan_shards(model, dtype, max_shard_bytes);
  std::vector<std::unique_ptr<SafetensorsWriter>> files;
  // Written into a sibling folder and renamed into place when complete: a failed export leaves
  // out_dir as it was.
  const std::string partial = out_dir + ".partial";
  if (writes) {
    fs::remove_all(partial);
    fs::create_directories(partial);
    for (size_t i = 0; i < plan.shards.size(); ++i)
      files.push_back(std::make_unique<SafetensorsWriter>(
          (fs::path(partial) / plan.file(i)).string(), plan.shards[i],
          std::map<std::string, std::string>{{"format", "pt"}}));
  }
  // One parameter at a time: rank 0 holds one whole parameter and its HF tensors, never the model.
  for (ParamUnit& u : model.units())
    for (ParamGroup& g : u.groups)
      for_each_whole_parameter(model, g, [&](const ParamSpec& s, const Tensor& value) {
        if (!writes) return;
        const Tensor host = value.to(Device::kCPU);
        const HfLayout layout(whole_parameter(s, c), c, HfExperts::kPerExpert);
        std::vector<Tensor> out;
        for (const HfTensor& t : layout.tensors()) out.push_back(Tensor::empty(t.shape, dtype));
        std::vector<void*> bases;
        for (Tensor& t : out) bases.push_back(t.raw());
        ops::dispatch_float(host.dtype(), [&](auto tag) {
          using T = decltype(tag);
          const T* v = host.data<T>();
          layout.for_each_element(0, host.numel(), [&](int64_t j, HfLayout::Element e) {
            store(bases[e.tensor], dtype, e.index, static_cast<double>(v[j]));
          });
        });
        for (size_t i = 0; i < out.size(); ++i) {
          const std::string& name = layout.tensors()[i].name;
          files[plan.shard_of.at(name)]->write(name, out[i].raw(), out[i].nbytes());
        }
      });
  if (!writes) return;
  for (auto& f : files) f->commit();
  log::info(
      "hf export: {} tensors ({:.2f} GiB, {} file{}) in '{}' in {:.1f} s; peak host memory "
      "{:.2f} GiB",
      plan.shard_of.size(), static_cast<double>(plan.total_bytes) / (1 << 30), plan.shards.size(),
      plan.shards.size() == 1 ? "" : "s", out_dir,
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
      static_cast<double>(profile::peak_host_bytes()) / (1 << 30));
  if (plan.shards.size() > 1) {
    nlohmann::json index;
    index["metadata"] = {{"total_size", plan.total_bytes}};
    for (const auto& [name, shard] : plan.shard_of) index["weight_map"][name] = plan.file(shard);
    write_file_atomically((fs::path(partial) / "model.safetensors.index.json").string(),
                          index.dump(2) + "\n");
  }
  write_file_atomically((fs::path(partial) / "config.json").string(),
                        hf_config(c, dtype).dump(2) + "\n");
  // An earlier export in out_dir steps aside first (a folder cannot be renamed onto a full one).
  const std::string old = out_dir + ".old";
  std::error_code ec;
  fs::remove_all(old, ec);
  if (fs::exists(out_dir)) fs::rename(out_dir, old);
  fs::rename(partial, out_dir);
  fs::remove_all(old, ec);
}

}  // namespace mt
