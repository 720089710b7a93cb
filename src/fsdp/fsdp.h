// Fully sharded data parallelism over parameter groups: shard after initialisation, gather
// before a unit is used, release after, reduce-scatter its gradients after its backward.
// Every function is a no-op on an unsharded group, so the model calls them unconditionally.
#pragma once
#include "dist/communicator.h"
#include "model/params.h"

namespace mt::fsdp {

// Makes an initialised, unsharded group sharded over `comm`: pads the flat buffer to a multiple
// of comm.size() with zeros and keeps this rank's slice.
void shard_group(ParamGroup& g, dist::Communicator& comm);

// params (padded) = all-gather of the shards (collective over the group's comm); then, in mixed
// precision, the compute copy. Call before the unit runs, sharded or not.
void gather(ParamGroup& g);
// Starts gather(g)'s all-gather in the background (NCCL: on the communicator's stream, so it
// overlaps the compute queued until gather(g), which then waits for it instead of gathering).
// Sharded groups only; a no-op otherwise or when one is already under way.
void prefetch(ParamGroup& g);
// Drops the gathered params and the compute copy (reshard after forward, and after backward).
void release(ParamGroup& g);
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

void gather(ParamUnit& u);
void prefetch(ParamUnit& u);
void release(ParamUnit& u);
void begin_backward(ParamUnit& u);
void reduce_gradients(ParamUnit& u, double divide_factor);
void finish_reduction(ParamUnit& u);

}  // namespace mt::fsdp
