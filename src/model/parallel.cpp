#include "model/parallel.h"

#include "core/error.h"
#include "moe/moe_layer.h"

namespace mt {

void ParallelConfig::validate(int64_t n_experts) const {
  if (world < 1 || world > dist::kMaxWorld)
    throw ConfigError(
        fmt::format("config: parallel.world = {} must be in [1, {}]", world, dist::kMaxWorld));
  if (cp < 1 || cp > world)
    throw ConfigError(fmt::format(
        "config: parallel.cp = {} must be in [1, parallel.world = {}] and divide it", cp, world));
  mesh().validate(n_experts);
  if (ep_chunks < 1 || ep_chunks > moe::kMaxExchangeChunks)
    throw ConfigError(fmt::format("config: parallel.ep_chunks = {} must be in [1, {}]", ep_chunks,
                                  moe::kMaxExchangeChunks));
  if (ep_exchange_ctas < 1 || ep_exchange_ctas > 1024)
    throw ConfigError(fmt::format("config: parallel.ep_exchange_ctas = {} must be in [1, 1024]",
                                  ep_exchange_ctas));
}

}  // namespace mt
