// Parameters live in flat buffers, one per (unit, group): a unit is what FSDP shards and
// gathers as one (the embedding, each block, the head); inside a block the dense parameters and
// the expert parameters are separate groups because they shard over different process groups.
// Named tensors are views into the flat buffers, so the optimizer and the communication work on
// one contiguous range per group.
#pragma once
#include <string>
#include <vector>

#include "core/tensor.h"

namespace mt {

enum class ParamKind { kDense, kExpert };

struct ParamSpec {
  std::string name;  // full name, e.g. "layers.0.attn.wq"
  Shape shape;
  bool is_norm_weight = false;  // initialised to 1
  int64_t offset = 0;           // in elements, inside the group's flat buffer
};

struct ParamGroup {
  ParamKind kind = ParamKind::kDense;
  std::vector<ParamSpec> specs;
  Tensor params;  // (numel) compute dtype
  Tensor grads;   // (numel)
  Tensor param(size_t i) const { return params.view(specs[i].offset, specs[i].shape); }
  Tensor grad(size_t i) const { return grads.view(specs[i].offset, specs[i].shape); }
};

struct ParamUnit {
  std::string name;
  std::vector<ParamGroup> groups;
};

// Builds a group from specs: assigns offsets, allocates zeroed params and grads.
ParamGroup make_param_group(ParamKind kind, std::vector<ParamSpec> specs, DType dtype);
// Initialises every parameter from (seed, name): N(0, std) for matrices, 1 for norm weights.
// The values depend on nothing but the seed and the name (not on order or sharding).
void init_params(ParamGroup& g, uint64_t seed, double std);

}  // namespace mt
