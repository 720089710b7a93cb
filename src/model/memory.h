// The memory a run needs at the least on each rank, before anything is allocated: the start-up
// check (cli) refuses a size that cannot fit with this estimate instead of failing minutes later.
// It counts what the model allocates from the same sources the model and trainer use: the
// parameter counts (model/flops.h), the precision plan (model/precision.h) and the expert
// exchange's window (moe::ExpertExchange::window_bytes). Activations and workspaces beyond the
// large tensors come on top, so fitting is necessary, not sufficient.
#pragma once
#include <cstdint>

#include "model/config.h"
#include "model/parallel.h"

namespace mt {

struct MemoryEstimate {
  double states = 0;       // weights, gradients and AdamW moments (this rank's shard on the GPU)
  double activations = 0;  // one micro-batch's, under the checkpoint policy
  double workspaces = 0;   // GPU: compute and quantized copies, held blocks, the exchange's window
  double total() const { return states + activations + workspaces; }
};

// m.device says where the model runs; `tokens` is one micro-batch's rows (batch_rows x seq_len),
// of which a rank holds tokens / p.cp. On the CPU every rank is a thread or process of one host,
// so the estimate is the host's for all `p.world` ranks.
MemoryEstimate estimate_memory(const ModelConfig& m, const ParallelConfig& p, int64_t tokens);

}  // namespace mt
