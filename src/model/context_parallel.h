// Context parallelism (CP): each packed row is split over the cp ranks of a CP group along its
// tokens, in 2 cp equal chunks, rank r holding chunks r and 2 cp - 1 - r of every row
// (ops::context_parallel_rows: equal causal work per rank). Everything but attention is
// token-local and runs on a rank's own tokens; attention gathers the rows' keys and values from
// the group (Llama 3's all-gather pattern, as torchtitan and prime-rl do by default), computes its
// own queries against them (ops::attention_forward_rows) and returns each rank's share of the key
// and value gradients through a reduce-scatter. docs/distributed.md draws the layout.
#pragma once
#include <cstdint>
#include <memory>

#include "dist/communicator.h"
#include "model/batch.h"

namespace mt {

// Rank `rank`'s share of `whole` (cp = 1, rows of row_tokens tokens laid end to end, as
// pack_rows makes them): its tokens, targets, mask, positions (each token's true position within
// its document) and padding in chunk order, the whole rows' documents, and the ContextShard. An
// mt::Error names the sizes when row_tokens is not a multiple of 2 cp.
Batch context_shard(const Batch& whole, int64_t row_tokens, int64_t cp, int64_t rank);

// The rows' tokens gathered from the CP group in the background (NCCL: on the communicator's
// stream), so that the gather crosses while the caller queues other work: local (n, ...) is this
// rank's tokens (shard.rows); rows() waits for the gather and returns the whole rows' (cp n, ...)
// in row order (chunk copies). local must not be written before rows().
class ContextRowsGather {
 public:
  ContextRowsGather(dist::Communicator& cp, const ContextShard& shard, const Tensor& local);
  Tensor rows();

 private:
  const ContextShard* shard_;
  int64_t n_ = 0;
  Tensor gathered_;
  std::unique_ptr<dist::PendingCollective> pending_;
};
// The same at once.
Tensor gather_context_rows(dist::Communicator& cp, const ContextShard& shard, const Tensor& local);
// The transpose in the background: whole (cp n, ...) per-rank partial gradients in row order;
// local (n, ...) is overwritten with the group's sum at this rank's tokens (chunk copies, then a
// reduce-scatter that crosses while the caller queues other work). local must not be read, nor
// written, before wait().
class ContextRowsReduce {
 public:
  ContextRowsReduce(dist::Communicator& cp, const ContextShard& shard, const Tensor& whole,
                    Tensor& local);
  void wait();

 private:
  Tensor staged_;
  std::unique_ptr<dist::PendingCollective> pending_;
};
// The same at once.
void reduce_scatter_context_rows(dist::Communicator& cp, const ContextShard& shard,
                                 const Tensor& whole, Tensor& local);

}  // namespace mt
