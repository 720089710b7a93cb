// The precision plan of a run, computed once (plan_precision) from the experts' recipe and MX
// scale rule (model.expert_recipe, model.mx_scale_rule, model.requant_dim1), the dispatch dtype
// (parallel.ep_dispatch_dtype) and the checkpoint policy (model.checkpoint). What depends on it
// reads it here: the MoE layer's products and wire (experts), FSDP's expert groups (which
// quantized copies a gather makes: block.cpp, Qwen3Moe's unit schedule), the expert exchange's
// window (trainer) and the memory estimate (model/memory.h).
#pragma once
#include "model/config.h"
#include "model/parallel.h"
#include "ops/expert_gemm.h"

namespace mt {

struct PrecisionPlan {
  ops::ExpertPrecision experts;
  // The experts' weights keep quantized copies (made by FSDP's gather for each pass, or once a
  // step on one rank): MX values in the compute dtype under an MX recipe, FP8 tiles under an FP8
  // one (ops::WeightCopies).
  bool expert_weight_copies = false;
  // The copies a training pass's backward gather makes: the input gradient's, and the forward's
  // too where the backward reruns the forward's products (a full checkpointing policy).
  ops::CopyUse backward_copies = ops::CopyUse::kBackward;
  // Quantized copies of each expert matrix alive at once for the unit in use (0 under bf16).
  int64_t copies_in_use() const {
    return expert_weight_copies ? (backward_copies == ops::CopyUse::kBoth ? 2 : 1) : 0;
  }
};

// Throws ConfigError naming the keys of an impossible combination (model.expert_recipe with
// parallel.ep_dispatch_dtype, ops::ExpertPrecision::invalid_combination).
PrecisionPlan plan_precision(const ModelConfig& m, const ParallelConfig& p);

}  // namespace mt
