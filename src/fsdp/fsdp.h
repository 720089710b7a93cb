// Fully sharded data parallelism over parameter groups: shard after initialisation, gather
// before a unit is used, release after, reduce-scatter its gradients after its backward.
// Every function is a no-op on an unsharded group, so the model calls them unconditionally.
#pragma once
#include <vector>

#include "dist/communicator.h"
#include "fsdp/params.h"

namespace mt::fsdp {

// Makes an initialised, unsharded group sharded over `comm`: pads the flat buffer to a multiple
// of comm.size() with zeros and keeps this rank's slice.
void shard_group(ParamGroup& g, dist::Communicator& comm);

// params (padded) = all-gather of the shards (collective over the group's comm); then, in mixed
// precision, the compute copy, and the quantized copies `use` needs (ParamSpec::quant_copies; the
// copies of a unit gathered again for its backward are made again, as its gathered weights are;
// one rank's held FP8 tiles give the forward's layout by a transpose). Call before the unit runs,
// sharded or not.
void gather(ParamGroup& g, ops::CopyUse use = ops::CopyUse::kBoth);
// Starts gather(g)'s all-gather in the background (NCCL: on the communicator's stream, so it
// overlaps the compute queued until gather(g), which then waits for it instead of gathering).
// Sharded groups only; a no-op otherwise or when one is already under way.
void prefetch(ParamGroup& g);
// Drops the quantized copies, and on a sharded group the gathered params and the compute copy
// (reshard after forward, and after backward). An unsharded group's compute copy and held FP8
// tiles stay: AdamW keeps them (the forward's transposed tiles go).
void release(ParamGroup& g);
// An unsharded group's persistent compute copy and held FP8 tiles (ParamGroup::holds_fp8_tiles),
// made now when missing (gather makes them too): what must exist before a CUDA graph is captured,
// outside its memory pool.
void make_persistent_copies(ParamGroup& g);
// Drops the compute copy and the quantized copies: after something else wrote the parameters (a
// checkpoint load); the next gather makes them again.
void drop_compute_copies(ParamGroup& g);
// Allocates zeroed full gradients for the unit's backward.
void begin_backward(ParamGroup& g);
// Starts grad_shard += reduce-scatter(grads) / divide_factor in the background (NCCL: on the
// communicator's stream, overlapping the backward queued after it) and hands the full gradients
// to the collective. finish_reduction completes it; grad_shard must not be read before.
void reduce_gradients(ParamGroup& g, double divide_factor);
// Orders the reduction's end before what is queued next and adds its chunk to grad_shard;
// a no-op when none is under way.
void finish_reduction(ParamGroup& g);

// Forgets the group's gathered buffers and the collectives started for it without waiting for
// them: after a CUDA graph capture failed mid-pass, whose collectives were recorded, never run.
void abandon_in_flight(ParamGroup& g);

// When a sharded group's gathered weights (its compute copy, or its quantized copies) are dropped
// within a pass: after its unit's forward, so that its backward gathers them again (FSDP's
// default: at most two units gathered at once), or after its backward, held in between (PyTorch
// FSDP2's reshard_after_forward=False): one all-gather per unit and pass instead of two, and the
// quantized copies of both passes made from one read of the gathered weights, for the memory of
// every unit's gathered weights at the end of the forward. Unsharded groups have nothing to gather
// and keep the default; a pass without a backward reshards after the forward either way.
enum class Reshard : uint8_t { kAfterForward, kAfterBackward };

// The order a model runs its units in, with FSDP's communication around each: units 0..n-1
// forward, then n-1..0 backward; made for one pass (every unit released at its start).
// Forward: a unit is gathered just before it runs, the next unit's gather started behind it
// (NCCL: overlapping this unit's compute), and released after (Reshard::kAfterForward) or held
// for its backward (kAfterBackward: its sharded groups, with the quantized copies of both passes).
// Backward: a unit is gathered (unless still held from its forward), its gradients allocated and
// the gather of the unit below started (when that unit's backward reads its parameters and it
// is not held); once its backward is queued, its reduce-scatter starts in the background, the
// reduction of the unit above is finished and the unit released, so (NCCL) each reduction
// overlaps the next unit's backward and at most two units' full gradients live. Unsharded units
// only get their compute and quantized copies, as with the functions above; with a tiles lane,
// a one-rank unit's forward FP8 tiles are made on it while the unit before (forward) or after
// (a backward that reruns the forward) runs, and joined at the unit's gather.
class UnitSchedule {
 public:
  // backward_reads_params[i]: unit i's backward needs its parameters (an embedding's does not).
  // backward_copies: the quantized copies a backward needs (kBoth when it reruns the forward's
  // products: a full activation-checkpointing policy). reshard: see Reshard; a unit whose backward
  // reads no parameters is released after its forward either way. tiles_lane: where held FP8
  // tiles are transposed ahead (null: at each gather, in the pass's order).
  UnitSchedule(std::vector<ParamUnit>& units, double grad_divide_factor,
               std::vector<bool> backward_reads_params,
               ops::CopyUse backward_copies = ops::CopyUse::kBackward,
               Reshard reshard = Reshard::kAfterForward, Lane* tiles_lane = nullptr);
  void forward_begin(size_t i);
  void forward_end(size_t i);
  // Allocates unit i's full gradients (once per pass): before its backward_begin when another
  // unit's backward writes them first (tied embeddings).
  void begin_gradients(size_t i);
  void backward_begin(size_t i);
  void backward_end(size_t i);
  void backward_done();  // every reduction finished: the optimizer may read the gradients

 private:
  // What a unit holds gathered: nothing, what its forward reads, or what its backward reads.
  enum class Held : uint8_t { kNothing, kForForward, kForBackward };
  bool holds_for_backward(size_t i) const;
  void release_unit(size_t i);

  std::vector<ParamUnit>* units_;
  Lane* tiles_lane_;
  double divide_;
  ops::CopyUse backward_copies_;
  Reshard reshard_;
  std::vector<bool> reads_, gradients_;
  std::vector<Held> held_;
};

// Orders what the thread queues next after the optimizer's last update of u, when that update
// runs beside the passes (ParamUnit::await_update); gather, begin_backward and a prefetch that
// starts a gather call it.
void await_update(ParamUnit& u);
void gather(ParamUnit& u, ops::CopyUse use);
void prefetch(ParamUnit& u);
// Starts the forward FP8 tiles of u's one-rank groups (holding their tiles, made before) on lane:
// allocated on the thread's stream after u's update, transposed on the lane; the group's gather
// joins the run (and its release, if no gather came).
void prefetch_forward_tiles(ParamUnit& u, Lane& lane);
void release(ParamUnit& u);
void begin_backward(ParamUnit& u);
void reduce_gradients(ParamUnit& u, double divide_factor);
void finish_reduction(ParamUnit& u);

}  // namespace mt::fsdp
