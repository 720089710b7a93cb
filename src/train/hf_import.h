// Hugging Face Qwen3-MoE weights into moetrain's parameters (transformers' Qwen3MoeForCausalLM
// names). A directory holds model.safetensors, or model.safetensors.index.json and its shards.
// Experts in either layout: per expert (mlp.experts.N.{gate,up,down}_proj.weight, as the
// published checkpoints and transformers' save_pretrained hold them) or merged
// (mlp.experts.gate_up_proj [E, 2F, D], mlp.experts.down_proj [E, D, F], transformers 5's
// in-memory layout). HF linear weights are (out, in); moetrain's are (in, out), and an expert's
// gate and up projections are one (D, 2F) matrix, gate columns first: the import transposes and
// concatenates (train/hf_layout.h). bf16, fp16 and fp32 on disk.
#pragma once
#include <map>
#include <string>

#include "model/qwen3_moe.h"

namespace mt {

// The model section for an HF directory: its config.json's architecture over `given`'s routing
// and numerics fields. An architecture field that `given` sets (to other than its default) must
// agree with config.json, else a ConfigError (exit 2) names model.<field> and both values.
ModelConfig hf_architecture(const std::string& dir, const ModelConfig& given);

// Writes every parameter this rank holds (its FSDP shard, its EP experts) from the HF directory;
// the optimizer's moments and the router biases are left as they are (a fresh run: zero). The
// files are memory-mapped and each rank reads only the elements its shards hold, so no rank
// holds a whole checkpoint. A missing or extra tensor, a wrong shape or an unsupported dtype is a
// CheckpointError (exit 4) naming the tensor, raised before any parameter is written.
void load_hf_weights(const std::string& dir, Qwen3Moe& model);

// The same mapping for any set of tensors in HF names and layouts (weights, or their gradients):
// each parameter of the model by its moetrain name, as f64 host tensors in moetrain's layout
// (an expert parameter holds this rank's experts). `where` names the source in errors.
std::map<std::string, Tensor> hf_to_moetrain(std::map<std::string, Tensor> tensors,
                                             const Qwen3Moe& model, const std::string& where);

}  // namespace mt
