// The device mesh: W ranks = dp x cp. Context parallelism splits each packed row over `cp`
// ranks (the CP group: cp consecutive ranks, rank r is CP rank r % cp of data-parallel rank
// r / cp; the ranks of a CP group read the same rows). Dense parameters shard over all W ranks
// (FSDP over dp x cp); experts are split over `ep` ranks, borrowed from the whole mesh as
// torchtitan does (ep divides W), and the experts of one EP rank shard again over the W / ep
// ranks that hold the same experts (dp_shard_mod_ep). Rank r is EP rank r % ep of EP group
// r / ep, so an EP group is `ep` consecutive ranks (one NVLink domain when ep <= GPUs per node).
#pragma once
#include <memory>

#include "dist/communicator.h"

namespace mt::dist {

struct MeshShape {
  int world = 1;
  int ep = 1;
  int cp = 1;
  // Throws ConfigError naming the sizes when ep does not divide the world or the experts, or cp
  // the world.
  void validate(int64_t n_experts) const;
};

class DeviceMesh {
 public:
  // Collective over `world`: creates the EP and dp_shard_mod_ep groups.
  DeviceMesh(Communicator& world, const MeshShape& shape, int64_t n_experts);

  Communicator& world() { return world_; }
  Communicator& ep() { return *ep_; }
  Communicator& dp_shard_mod_ep() { return *dp_mod_ep_; }
  // The ranks sharing this rank's rows (size cp); null when cp = 1.
  Communicator* cp() { return cp_.get(); }
  int cp_size() const { return shape_.cp; }
  int cp_rank() const { return world_.rank() % shape_.cp; }
  // Data-parallel ranks: groups of different rows.
  int dp_size() const { return shape_.world / shape_.cp; }
  int dp_rank() const { return world_.rank() / shape_.cp; }
  int ep_size() const { return shape_.ep; }
  int ep_rank() const { return world_.rank() % shape_.ep; }
  int64_t experts_per_rank() const { return n_experts_ / shape_.ep; }
  int64_t first_local_expert() const { return ep_rank() * experts_per_rank(); }

 private:
  Communicator& world_;
  MeshShape shape_;
  int64_t n_experts_;
  std::unique_ptr<Communicator> ep_;
  std::unique_ptr<Communicator> dp_mod_ep_;
  std::unique_ptr<Communicator> cp_;
};

}  // namespace mt::dist
