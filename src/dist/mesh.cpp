#include "dist/mesh.h"

#include "core/error.h"

namespace mt::dist {

void MeshShape::validate(int64_t n_experts) const {
  if (world < 1) throw ConfigError(fmt::format("config: parallel.world = {} must be >= 1", world));
  if (ep < 1 || world % ep != 0)
    throw ConfigError(fmt::format(
        "config: parallel.ep = {} must divide parallel.world = {} (valid: divisors of {})", ep,
        world, world));
  if (cp < 1 || world % cp != 0)
    throw ConfigError(fmt::format(
        "config: parallel.cp = {} must divide parallel.world = {} (valid: divisors of {})", cp,
        world, world));
  if (n_experts % ep != 0)
    throw ConfigError(
        fmt::format("config: parallel.ep = {} must divide model.n_experts = {}", ep, n_experts));
}

DeviceMesh::DeviceMesh(Communicator& world, const MeshShape& shape, int64_t n_experts)
    : world_(world), shape_(shape), n_experts_(n_experts) {
  MT_CHECK(shape.world == world.size(), "mesh world {} vs communicator size {}", shape.world,
           world.size());
  shape.validate(n_experts);
  const int r = world.rank();
  ep_ = world.split(/*color=*/r / shape.ep, /*key=*/r);
  dp_mod_ep_ = world.split(/*color=*/r % shape.ep, /*key=*/r);
  if (shape.cp > 1) cp_ = world.split(/*color=*/r / shape.cp, /*key=*/r);
}

}  // namespace mt::dist
