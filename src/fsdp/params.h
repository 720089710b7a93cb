// Parameters live in flat buffers, one per (unit, group): a unit is what FSDP gathers and
// reshards as one (the embedding, each block, the head); inside a block the dense parameters and
// the expert parameters are separate groups because they shard over different process groups.
// Named tensors are views into the flat buffers, so the optimizer and the communication work on
// one contiguous range per group.
//
// Unsharded (one rank): `shard` and `params` are the same storage, as are `grad_shard` and
// `grads`. Sharded (FSDP): this rank owns one 1/n slice of the zero-padded flat buffer (the fp32
// master copy, what the optimizer updates); `params` and `grads` exist only while the unit is in
// use (fsdp/fsdp.h gathers and releases them).
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "core/lane.h"
#include "core/tensor.h"
#include "dist/communicator.h"
#include "ops/expert_gemm.h"

namespace mt {

enum class ParamKind { kDense, kExpert };

struct ParamSpec {
  std::string name;  // full name, e.g. "layers.0.attn.wq"
  Shape shape;
  bool is_norm_weight = false;  // initialised to 1
  int64_t offset = 0;           // in elements, inside the group's flat buffer
  // Element index of this tensor's first element within the full (unsplit) parameter: non-zero
  // for the expert slice of an EP rank, so that every rank draws the same initial values.
  int64_t init_offset = 0;
  // Read by the ops in the master dtype (fp32), not from the compute copy: the router, whose
  // logits decide the routing. A sharded group holding one gathers its fp32 masters and casts
  // the compute copy locally.
  bool master_weight = false;
  // An expert matrix under an MX or FP8 recipe: the ops read only its quantized copies
  // (ops::WeightCopies), made from the weights at each gather for the pass that gathers
  // (fsdp::gather) and dropped at release, or on one rank under an FP8 recipe held across steps
  // and rewritten by AdamW's pass (ParamGroup::holds_fp8_tiles); no compute copy is kept for it.
  bool quant_copies = false;
};

struct ParamGroup {
  ParamKind kind = ParamKind::kDense;
  DType master_dtype = DType::kF32;  // params, shard, grads
  std::vector<ParamSpec> specs;
  int64_t numel = 0;                   // sum of the specs, unpadded
  dist::Communicator* comm = nullptr;  // the FSDP group; null: not sharded
  Tensor shard;                        // (padded / n) owned master parameters
  Tensor grad_shard;                   // (padded / n)
  Tensor params;                       // (padded) full parameters while gathered
  Tensor grads;                        // (padded) full gradients during backward
  // Mixed precision: the dtype the ops read the weights in, and the gathered params cast to it
  // (undefined when it is the params' own dtype, or when every spec is read otherwise:
  // reads_compute()). Sharded, the copy lives while the unit is gathered. Unsharded, it persists
  // across steps: AdamW rewrites it in its own pass, so one GPU never re-casts its weights;
  // anything else that writes params (a checkpoint load) drops the copy, and the next gather
  // casts again.
  DType compute_dtype = DType::kF32;
  Tensor compute;
  // True when `grads` holds nothing of this step yet, so its first writer overwrites instead of
  // adding: the expert gradients (96% of a Qwen3-MoE's parameters) are then never zero-filled,
  // and their GEMMs never read them back.
  bool grads_unwritten = false;
  // True when grad_shard still holds the last step's gradients, which that step's optimizer
  // update may still be reading (on the GPU it runs beside the next passes): the group's first
  // backward of the step zeroes them (fsdp::begin_backward), once the pass has waited for the
  // update (ParamUnit::await_update). Qwen3Moe::zero_grad sets it.
  bool grad_shard_stale = false;
  // A gather started by fsdp::prefetch and not yet waited for (gather waits).
  std::shared_ptr<dist::PendingCollective> gathering;
  // A gradient reduce-scatter started by fsdp::reduce_gradients, and the chunk it writes, not
  // yet added to grad_shard (fsdp::finish_reduction adds it).
  std::shared_ptr<dist::PendingCollective> reducing;
  Tensor reduced;
  double reduced_divide_factor = 1.0;

  // The quantized copies of the specs with quant_copies (indexed like specs; empty while not
  // made): made by fsdp::gather for the pass it gathers for, as `precision` asks (MX values or
  // FP8 tiles), dropped by fsdp::release; except FP8 tiles on one rank (holds_fp8_tiles): the
  // input gradient's layout (fp8_input) made at the first gather, rewritten by AdamW's pass from
  // the updated masters, dropped only with the compute copies (fsdp::drop_compute_copies: a
  // checkpoint load); the forward's (fp8_forward) its transpose, made by each gather for a forward
  // (or ahead of it on a lane: fsdp::prefetch_forward_tiles) and dropped at release.
  std::vector<ops::WeightCopies> copies;
  // The lane making fp8_forward ahead of the gather, and the run's end (null: none under way):
  // the gather joins it before the pass reads the tiles; release joins it before dropping them.
  Lane* tiles_lane = nullptr;
  Lane::Point tiles_made = -1;
  ops::ExpertPrecision precision;

  bool sharded() const { return comm != nullptr; }
  bool wants_quant_copies() const {
    for (const ParamSpec& s : specs)
      if (s.quant_copies) return true;
    return false;
  }
  // One rank under an FP8 recipe: the quantized specs' input-gradient tiles persist across passes
  // and steps (1 byte a weight, in place of the 2 of a bf16 compute copy), each step's written by
  // the optimizer in its pass over the masters (ops::AdamWCopies); the forward's layout lives only
  // while a forward's gather holds it.
  bool holds_fp8_tiles() const {
    return !sharded() && precision.fp8_forward_and_input() && wants_quant_copies();
  }
  bool copies_made() const { return !copies.empty(); }
  // The held tiles' data and scales (none when not held or not yet made): what a captured pass
  // reads and a captured update writes beside the flat buffers.
  std::vector<const void*> held_tile_buffers() const;
  const ops::WeightCopies* quant_copies(size_t i) const {
    return i < copies.size() && specs[i].quant_copies ? &copies[i] : nullptr;
  }
  // Some spec is read from the compute copy: neither an fp32 master weight nor quantized copies
  // only. A sharded group's FP8 tiles are made from the gathered compute copy (the bf16 values the
  // products would quantize themselves, in one read of 2 bytes a weight); MX values straight from
  // the masters, and one rank's held FP8 tiles by AdamW.
  bool reads_compute() const {
    for (const ParamSpec& s : specs)
      if (!s.master_weight && (!s.quant_copies || (precision.fp8_forward_and_input() && sharded())))
        return true;
    return false;
  }
  bool reads_master() const {
    for (const ParamSpec& s : specs)
      if (s.master_weight) return true;
    return false;
  }
  int64_t shard_begin() const { return sharded() ? comm->rank() * shard.numel() : 0; }
  Tensor param(size_t i) const { return params.view(specs[i].offset, specs[i].shape); }
  // The weight as the ops read it: the compute copy when there is one. Undefined for an MX spec
  // of a gathered sharded group (its compute copy is dropped once the quantized copies are made).
  Tensor weight(size_t i) const {
    const bool cast = compute.defined() && !specs[i].master_weight;
    const Tensor& from = cast ? compute : params;
    return from.defined() ? from.view(specs[i].offset, specs[i].shape) : Tensor();
  }
  Tensor grad(size_t i) const { return grads.view(specs[i].offset, specs[i].shape); }
};

struct ParamUnit {
  std::string name;
  std::vector<ParamGroup> groups;
  // Set by an optimizer whose update of this unit runs beside the passes (train/optimizer.h:
  // AdamW on a GPU side stream): a pass calls it before it reads the unit's parameters or
  // writes its gradients, and it orders what the pass queues after the update (it does not
  // wait on the host). Unset: the update is already ordered before the pass.
  std::function<void()> await_update;
};

// Lays a group out from specs (offsets, numel, the master dtype) without storage: a model builds
// its groups' storage one group at a time (allocate, initialise, place, shard), so a rank never
// holds more than one unsharded group on the host.
ParamGroup make_param_group(ParamKind kind, std::vector<ParamSpec> specs, DType dtype);
// Zeroed host params and grads for a laid-out group.
void allocate_group(ParamGroup& g);
// Moves an initialised, unsharded group's params and grads to `device`; the ops will read the
// weights in `compute_dtype` (a copy made when the unit is gathered, when it differs).
void place_group(ParamGroup& g, Device device, DType compute_dtype);
// Initialises every parameter from (seed, name): N(0, std) for matrices, 1 for norm weights.
// The values depend on nothing but the seed, the name and the element's index in the full
// parameter (not on order, sharding or expert parallelism).
void init_params(ParamGroup& g, uint64_t seed, double std);
// Writes `value` (spec s's whole tensor as this rank holds it, any dtype) into the part of `flat`
// this rank has: flat holds elements [flat_begin, flat_begin + flat.numel()) of the group's
// buffer (its shard and shard_begin(), or all of it unsharded), in flat's dtype.
void write_spec_slice(Tensor& flat, int64_t flat_begin, const ParamSpec& s, const Tensor& value);

}  // namespace mt
