// moetrain's parameters as a Hugging Face Qwen3-MoE directory that transformers'
// AutoModelForCausalLM.from_pretrained, vLLM and SGLang load: config.json (transformers 5's keys,
// with the published checkpoints' num_experts and rope_theta beside them), the weights in
// safetensors shards of at most 5 GB with model.safetensors.index.json, experts per expert
// (mlp.experts.N.{gate,up,down}_proj.weight), HF's (out, in) layout. The inverse of
// train/hf_import.h: import -> export -> import gives the same parameters (f32 export).
#pragma once
#include <string>

#include "dist/communicator.h"
#include "model/qwen3_moe.h"

namespace mt {

// Collective over the model's ranks (world: null on one rank): every group's shards are
// gathered, the experts from every EP rank, and rank 0 writes `out_dir` (created; files written
// atomically, each shard when all its tensors are in it; the index and config.json last). dtype:
// bf16 or f32. Rank 0 holds one whole parameter at a time, never the model.
inline constexpr size_t kHfShardBytes = size_t{5} << 30;  // what the published checkpoints use
void export_hf(Qwen3Moe& model, const std::string& out_dir, DType dtype, dist::Communicator* world,
               size_t max_shard_bytes = kHfShardBytes);

}  // namespace mt
