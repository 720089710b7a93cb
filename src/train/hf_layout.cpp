#include "train/hf_layout.h"

#include <cstdio>

#include "core/error.h"
#include "model/qwen3_moe.h"

namespace mt {

HfLayout::HfLayout(const ParamSpec& s, const ModelConfig& c, HfExperts experts) {
  const int64_t d = c.dim, f = c.moe_dim, e = c.n_experts;
  auto one = [&](Map m, std::string name, Shape hf_shape) {
    map_ = m;
    if (m == Map::kTransposed) {
      rows_ = hf_shape[1];
      cols_ = hf_shape[0];
    }
    tensors_.push_back({std::move(name), std::move(hf_shape)});
  };
  if (s.name == "embed.table") {
    one(Map::kSame, "model.embed_tokens.weight", {c.vocab_size, d});
    return;
  }
  if (s.name == "head.norm") {
    one(Map::kSame, "model.norm.weight", {d});
    return;
  }
  if (s.name == "head.out") {
    one(Map::kTransposed, "lm_head.weight", {c.vocab_size, d});
    return;
  }
  int64_t layer = -1;
  char rest[64] = {};
  MT_CHECK(std::sscanf(s.name.c_str(), "layers.%ld.%63s", &layer, rest) == 2,
           "parameter {} has no HF name", s.name);
  const std::string p = fmt::format("model.layers.{}.", layer), what = rest;
  if (what == "attn_norm") {
    one(Map::kSame, p + "input_layernorm.weight", {d});
    return;
  }
  if (what == "mlp_norm") {
    one(Map::kSame, p + "post_attention_layernorm.weight", {d});
    return;
  }
  if (what == "attn.q_norm") {
    one(Map::kSame, p + "self_attn.q_norm.weight", {c.head_dim});
    return;
  }
  if (what == "attn.k_norm") {
    one(Map::kSame, p + "self_attn.k_norm.weight", {c.head_dim});
    return;
  }
  if (what == "attn.wq") {
    one(Map::kTransposed, p + "self_attn.q_proj.weight", {c.q_dim(), d});
    return;
  }
  if (what == "attn.wk") {
    one(Map::kTransposed, p + "self_attn.k_proj.weight", {c.kv_dim(), d});
    return;
  }
  if (what == "attn.wv") {
    one(Map::kTransposed, p + "self_attn.v_proj.weight", {c.kv_dim(), d});
    return;
  }
  if (what == "attn.wo") {
    one(Map::kTransposed, p + "self_attn.o_proj.weight", {d, c.q_dim()});
    return;
  }
  if (what == "moe.router") {
    one(Map::kTransposed, p + "mlp.gate.weight", {e, d});
    return;
  }
  MT_CHECK(what == "moe.w_gate_up" || what == "moe.w_down", "parameter {} has no HF name", s.name);
  const bool gate_up = what == "moe.w_gate_up";
  map_ = gate_up ? Map::kGateUp : Map::kDown;
  merged_ = experts == HfExperts::kMerged;
  rows_ = gate_up ? d : f;
  cols_ = gate_up ? 2 * f : d;
  const int64_t local = s.shape[0];
  first_expert_ = s.init_offset / (rows_ * cols_);
  if (merged_) {
    tensors_.push_back(gate_up ? HfTensor{p + "mlp.experts.gate_up_proj", {e, 2 * f, d}}
                               : HfTensor{p + "mlp.experts.down_proj", {e, d, f}});
    return;
  }
  for (int64_t x = first_expert_; x < first_expert_ + local; ++x) {
    const std::string q = fmt::format("{}mlp.experts.{}.", p, x);
    if (gate_up) {
      tensors_.push_back({q + "gate_proj.weight", {f, d}});
      tensors_.push_back({q + "up_proj.weight", {f, d}});
    } else {
      tensors_.push_back({q + "down_proj.weight", {d, f}});
    }
  }
}

HfLayout::Element HfLayout::source(int64_t j) const {
  switch (map_) {
    case Map::kSame:
      return {0, j};
    case Map::kTransposed:  // moetrain (rows, cols)[r][c] = HF (cols, rows)[c][r]
      return {0, (j % cols_) * rows_ + j / cols_};
    case Map::kGateUp:
    case Map::kDown: {
      const int64_t per = rows_ * cols_, x = j / per, k = j % per;
      const int64_t r = k / cols_, col = k % cols_;
      if (merged_)  // HF (E, cols, rows): each expert's matrix is HF's (out, in)
        return {0, ((first_expert_ + x) * cols_ + col) * rows_ + r};
      if (map_ == Map::kDown) return {static_cast<int32_t>(x), col * rows_ + r};
      const int64_t f = cols_ / 2;  // gate columns [0, F), up columns [F, 2F)
      return {static_cast<int32_t>(2 * x + (col >= f)), (col % f) * rows_ + r};
    }
  }
  return {0, 0};
}

ParamSpec whole_parameter(const ParamSpec& spec, const ModelConfig& c) {
  ParamSpec s = spec;
  if (s.name.ends_with("moe.w_gate_up") || s.name.ends_with("moe.w_down")) {
    s.shape[0] = c.n_experts;
    s.init_offset = 0;
  }
  return s;
}

std::vector<HfTensor> hf_tensors(const Qwen3Moe& model, HfExperts experts) {
  std::vector<HfTensor> out;
  for (const ParamUnit& u : model.units())
    for (const ParamGroup& g : u.groups)
      for (const ParamSpec& s : g.specs) {
        const HfLayout layout(whole_parameter(s, model.config()), model.config(), experts);
        out.insert(out.end(), layout.tensors().begin(), layout.tensors().end());
      }
  return out;
}

}  // namespace mt
