#include "fsdp/fsdp.h"

#include <algorithm>

#include "ops/elementwise.h"
#include "ops/fp8.h"

namespace mt::fsdp {

void shard_group(ParamGroup& g, dist::Communicator& comm) {
  MT_CHECK(!g.sharded(), "group of {} is already sharded", g.specs.front().name);
  const int64_t n = comm.size();
  const int64_t chunk = (g.numel + n - 1) / n;
  g.comm = &comm;
  const Device device = g.params.device();
  g.shard = Tensor::zeros({chunk}, g.params.dtype(), device);
  const int64_t begin = comm.rank() * chunk;
  const int64_t end = std::min(begin + chunk, g.numel);
  if (end > begin) g.shard.view(0, {end - begin}).copy_from(g.params.view(begin, {end - begin}));
  g.grad_shard = Tensor::zeros({chunk}, g.params.dtype(), device);
  g.params = Tensor();
  g.grads = Tensor();
}

namespace {
// The sharded gather, started: mixed precision gathers only the compute copy, in its own dtype
// (bf16: half the bytes of the fp32 master); the ops read nothing else.
std::shared_ptr<dist::PendingCollective> start_gather(ParamGroup& g) {
  const Shape full{g.shard.numel() * g.comm->size()};
  const Device device = g.shard.device();
  if (g.compute_dtype != g.shard.dtype() && !g.reads_master()) {
    Tensor mine = Tensor::empty(g.shard.shape(), g.compute_dtype, device);
    ops::convert(g.shard, mine);
    g.compute = Tensor::empty(full, g.compute_dtype, device);
    return g.comm->all_gather_async(mine, g.compute);
  }
  g.params = Tensor::empty(full, g.shard.dtype(), device);
  return g.comm->all_gather_async(g.shard, g.params);
}
}  // namespace

void prefetch(ParamGroup& g) {
  if (!g.sharded() || g.gathering) return;
  g.gathering = start_gather(g);
}

namespace {
// The quantized copies `use` needs, from the weights the ops would read (the gathered compute copy,
// or the params rounded to the compute dtype); each copy tensor kept from an earlier gather of this
// pass is rewritten in place.
void make_quant_copies(ParamGroup& g, ops::CopyUse use) {
  if (!g.wants_quant_copies()) return;
  g.copies.resize(g.specs.size());
  for (size_t i = 0; i < g.specs.size(); ++i)
    if (g.specs[i].quant_copies)
      ops::make_weight_copies(g.weight(i), g.precision, g.compute_dtype, use, g.copies[i]);
}

// One rank's held FP8 tiles are the input gradient's layout (dim0); the forward's (dim1) is
// their transpose, made for each pass that runs the forward's products and dropped at release:
// a byte a weight held in place of two.
// Each forward tile tensor allocated on the thread's stream (a lane's run writes them beside it).
void allocate_forward_tiles(ParamGroup& g) {
  for (size_t i = 0; i < g.specs.size(); ++i) {
    ops::WeightCopies& q = g.copies[i];
    if (g.specs[i].quant_copies && !q.fp8_forward.defined())
      q.fp8_forward = QuantTensor::empty(q.fp8_input.shape(), QuantBlock::kTile128,
                                         QuantAxis::kDim1, q.fp8_input.device());
  }
}

void transpose_forward_tiles(ParamGroup& g) {
  for (size_t i = 0; i < g.specs.size(); ++i)
    if (g.specs[i].quant_copies)
      ops::fp8_transpose_tiles(g.copies[i].fp8_input, g.copies[i].fp8_forward);
}

// The thread's stream waits for forward tiles made ahead on a lane, if any.
void join_forward_tiles(ParamGroup& g) {
  if (!g.tiles_lane) return;
  g.tiles_lane->join(g.tiles_made);
  g.tiles_lane = nullptr;
  g.tiles_made = -1;
}

void make_forward_tiles(ParamGroup& g, ops::CopyUse use) {
  if (g.tiles_lane) return join_forward_tiles(g);
  if (use == ops::CopyUse::kBackward) return;
  allocate_forward_tiles(g);
  transpose_forward_tiles(g);
}

void drop_forward_tiles(ParamGroup& g) {
  join_forward_tiles(g);  // never free what the lane may still write
  for (ops::WeightCopies& q : g.copies) q.fp8_forward = QuantTensor();
}
}  // namespace

void make_persistent_copies(ParamGroup& g) {
  if (g.sharded()) return;
  // Held FP8 tiles: the input gradient's layout, from the masters rounded as the products read
  // them (once; AdamW rewrites them each step).
  if (g.holds_fp8_tiles() && !g.copies_made()) make_quant_copies(g, ops::CopyUse::kBackward);
  if (g.compute_dtype == g.params.dtype() || g.compute.defined() || !g.reads_compute()) return;
  g.compute = Tensor::empty(g.params.shape(), g.compute_dtype, g.params.device());
  ops::convert(g.params, g.compute);  // the ops read a cast copy
}

void gather(ParamGroup& g, ops::CopyUse use) {
  if (!g.sharded()) {
    make_persistent_copies(g);
    if (g.holds_fp8_tiles()) return make_forward_tiles(g, use);
    return make_quant_copies(g, use);
  }
  if (!g.gathering) g.gathering = start_gather(g);
  g.gathering->wait();
  g.gathering.reset();
  const bool gathered_compute = g.compute_dtype != g.shard.dtype() && !g.reads_master();
  if (!gathered_compute && g.compute_dtype != g.params.dtype() && !g.compute.defined()) {
    g.compute = Tensor::empty(g.params.shape(), g.compute_dtype, g.params.device());
    ops::convert(g.params, g.compute);
  }
  make_quant_copies(g, use);
  // Nothing else reads the gathered weights of a group of quantized copies only (MX): free them
  // now.
  if (g.wants_quant_copies() && !g.reads_compute() && !g.reads_master()) {
    g.compute = Tensor();
    g.params = Tensor();
  }
}

void drop_compute_copies(ParamGroup& g) {
  g.compute = Tensor();
  g.copies.clear();
}

void release(ParamGroup& g) {
  if (g.holds_fp8_tiles())
    drop_forward_tiles(g);
  else
    g.copies.clear();
  if (!g.sharded()) return;              // the unsharded cast copy stays: AdamW keeps it current
  if (g.gathering) g.gathering->wait();  // never free what a collective may still write
  g.gathering.reset();
  drop_compute_copies(g);
  g.params = Tensor();
}

void begin_backward(ParamGroup& g) {
  if (g.grad_shard_stale) {
    g.grad_shard.zero_();
    g.grad_shard_stale = false;
  }
  if (!g.sharded()) return;
  const Shape full{g.shard.numel() * g.comm->size()};
  // Expert gradients are written whole by their first writer (see ParamGroup::grads_unwritten).
  g.grads_unwritten = g.kind == ParamKind::kExpert;
  g.grads = g.grads_unwritten ? Tensor::empty(full, g.shard.dtype(), g.shard.device())
                              : Tensor::zeros(full, g.shard.dtype(), g.shard.device());
}

void reduce_gradients(ParamGroup& g, double divide_factor) {
  if (!g.sharded()) return;
  finish_reduction(g);  // the previous micro-batch's, if still under way
  g.reduced = Tensor::empty(g.grad_shard.shape(), g.grad_shard.dtype(), g.grad_shard.device());
  g.reducing = g.comm->reduce_scatter_async(g.grads, g.reduced);  // keeps g.grads alive
  g.reduced_divide_factor = divide_factor;
  g.grads = Tensor();
}

void finish_reduction(ParamGroup& g) {
  if (!g.reducing) return;
  g.reducing->wait();
  g.reducing.reset();  // the full gradients go back to the allocator, after the collective
  if (g.reduced_divide_factor != 1.0) ops::scale_(g.reduced, 1.0 / g.reduced_divide_factor);
  ops::add_(g.grad_shard, g.reduced);
  g.reduced = Tensor();
}

void abandon_in_flight(ParamGroup& g) {
  join_forward_tiles(g);
  g.gathering.reset();
  g.reducing.reset();
  g.reduced = Tensor();
  if (!g.sharded()) return;
  g.params = Tensor();
  drop_compute_copies(g);
  g.grads = Tensor();
}

void await_update(ParamUnit& u) {
  if (u.await_update) u.await_update();
}
void gather(ParamUnit& u, ops::CopyUse use) {
  await_update(u);
  for (auto& g : u.groups) gather(g, use);
}
void prefetch(ParamUnit& u) {
  // A gather it starts reads the unit's shards: after their update. One that starts none (an
  // unsharded unit) leaves the wait to the unit's gather, so the work queued meanwhile runs
  // beside the update.
  if (std::any_of(u.groups.begin(), u.groups.end(),
                  [](const ParamGroup& g) { return g.sharded() && !g.gathering; }))
    await_update(u);
  for (auto& g : u.groups) prefetch(g);
}
void prefetch_forward_tiles(ParamUnit& u, Lane& lane) {
  std::vector<ParamGroup*> ahead;
  for (ParamGroup& g : u.groups)
    if (g.holds_fp8_tiles() && g.copies_made() && !g.tiles_lane) ahead.push_back(&g);
  if (ahead.empty()) return;
  await_update(u);  // the held tiles are the update's
  for (ParamGroup* g : ahead) allocate_forward_tiles(*g);
  const Lane::Point end = lane.run(ahead.front()->params.device(), [&] {
    for (ParamGroup* g : ahead) transpose_forward_tiles(*g);
  });
  for (ParamGroup* g : ahead) {
    g->tiles_lane = &lane;
    g->tiles_made = end;
  }
}
void release(ParamUnit& u) {
  for (auto& g : u.groups) release(g);
}
void begin_backward(ParamUnit& u) {
  await_update(u);
  for (auto& g : u.groups) begin_backward(g);
}
void reduce_gradients(ParamUnit& u, double divide_factor) {
  for (auto& g : u.groups) reduce_gradients(g, divide_factor);
}
void finish_reduction(ParamUnit& u) {
  for (auto& g : u.groups) finish_reduction(g);
}

UnitSchedule::UnitSchedule(std::vector<ParamUnit>& units, double grad_divide_factor,
                           std::vector<bool> backward_reads_params, ops::CopyUse backward_copies,
                           Reshard reshard, Lane* tiles_lane)
    : units_(&units),
      tiles_lane_(tiles_lane),
      divide_(grad_divide_factor),
      backward_copies_(backward_copies),
      reshard_(reshard),
      reads_(std::move(backward_reads_params)),
      gradients_(units.size(), false),
      held_(units.size(), Held::kNothing) {
  MT_CHECK(reads_.size() == units.size(), "{} backward flags for {} units", reads_.size(),
           units.size());
}

bool UnitSchedule::holds_for_backward(size_t i) const {
  return reshard_ == Reshard::kAfterBackward && reads_[i];
}

void UnitSchedule::release_unit(size_t i) {
  release((*units_)[i]);
  held_[i] = Held::kNothing;
}

void UnitSchedule::forward_begin(size_t i) {
  ParamUnit& u = (*units_)[i];
  // Held for the backward, a sharded group makes the backward's quantized copies now, from the same
  // gather; an unsharded one has nothing to gather again and makes them at its backward.
  const bool hold = holds_for_backward(i);
  await_update(u);
  for (ParamGroup& g : u.groups)
    gather(g, hold && g.sharded() ? ops::CopyUse::kBoth : ops::CopyUse::kForward);
  held_[i] = hold ? Held::kForBackward : Held::kForForward;
  if (i + 1 < units_->size()) {
    prefetch((*units_)[i + 1]);
    if (tiles_lane_) prefetch_forward_tiles((*units_)[i + 1], *tiles_lane_);
  }
}

void UnitSchedule::forward_end(size_t i) {
  if (!holds_for_backward(i)) return release_unit(i);
  for (ParamGroup& g : (*units_)[i].groups)
    if (!g.sharded()) release(g);  // its forward's quantized copies
}

void UnitSchedule::begin_gradients(size_t i) {
  if (gradients_[i]) return;
  begin_backward((*units_)[i]);
  gradients_[i] = true;
}

void UnitSchedule::backward_begin(size_t i) {
  ParamUnit& u = (*units_)[i];
  if (reads_[i] && held_[i] == Held::kNothing) {
    gather(u, backward_copies_);
    held_[i] = Held::kForBackward;
  } else if (reads_[i] && held_[i] == Held::kForBackward) {
    for (ParamGroup& g : u.groups)
      if (!g.sharded()) gather(g, backward_copies_);  // the sharded ones are held
  } else if (reads_[i]) {
    // Held from its forward by the model (the head, the tied embedding): its forward's gather
    // serves, which made no backward quantized copies.
    for (const ParamGroup& g : u.groups)
      MT_CHECK(!g.wants_quant_copies(),
               "unit {} holds quantized copies from its forward into its backward", u.name);
  }
  begin_gradients(i);
  if (i > 0 && reads_[i - 1] && held_[i - 1] == Held::kNothing) prefetch((*units_)[i - 1]);
  // A backward that reruns the forward's products reads the forward's tiles.
  if (tiles_lane_ && i > 0 && reads_[i - 1] && backward_copies_ != ops::CopyUse::kBackward)
    prefetch_forward_tiles((*units_)[i - 1], *tiles_lane_);
}

void UnitSchedule::backward_end(size_t i) {
  reduce_gradients((*units_)[i], divide_);
  if (i + 1 < units_->size()) finish_reduction((*units_)[i + 1]);
  release_unit(i);
}

void UnitSchedule::backward_done() {
  for (ParamUnit& u : *units_) finish_reduction(u);
}

}  // namespace mt::fsdp
