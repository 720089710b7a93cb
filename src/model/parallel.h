// The [parallel] section: how the ranks divide the work (the device mesh) and how the model's
// layers use it (the expert exchange, FSDP's schedule, what the dispatch sends). Parsed by
// train/config.cpp, validated once here with the mesh, and read by the model, the trainer and
// the memory estimate (docs/config.md lists the keys).
#pragma once
#include <cstdint>

#include "dist/mesh.h"
#include "fsdp/fsdp.h"
#include "moe/exchange/expert_exchange.h"
#include "ops/expert_gemm.h"

namespace mt {

struct ParallelConfig {
  int64_t world = 1;  // ranks; dense parameters shard over all of them
  int64_t ep = 1;     // ranks the experts are split over (dist/mesh.h)
  // Context parallelism: ranks each packed row is split over along its tokens (dist/mesh.h; the
  // chunks: ops::context_parallel_rows). train.seq_len must be a multiple of 2 cp.
  int64_t cp = 1;
  // How the expert exchange sizes its rows (moe/exchange/expert_exchange.h): "device" (fixed
  // capacity, counts on the device, graph-capturable) or "host" (counts read on the host).
  moe::ExchangeMode ep_exchange = moe::ExchangeMode::kDeviceCounts;
  // Thread blocks of the exchange's device kernels (each one an SM while it runs).
  int64_t ep_exchange_ctas = 132;
  // With ep > 1: the MoE layer's tokens in this many chunks, each chunk's exchange beside the
  // experts' work on another (moe::MoeComms::chunks), 1 to moe::kMaxExchangeChunks.
  int64_t ep_chunks = 1;
  // With ep > 1 on the GPU: the exchanges on a stream beside the experts' (core/lane.h);
  // false runs them in turn on the pass's stream.
  bool ep_overlap = true;
  // With world > 1: when a block's gathered weights are dropped within a training pass, after
  // its forward (gathered again for its backward) or after its backward (fsdp::Reshard;
  // the key is reshard_after_forward).
  fsdp::Reshard reshard = fsdp::Reshard::kAfterForward;
  // What the dispatch sends the experts (and the combine's backward its gradient): the rows as
  // they are, or MXFP8 (RowWire); part of the experts' precision (ops::ExpertPrecision).
  RowWire ep_dispatch_dtype = RowWire::kAsIs;

  dist::MeshShape mesh() const {
    return {static_cast<int>(world), static_cast<int>(ep), static_cast<int>(cp)};
  }
  // Ranks that read different rows (world / cp).
  int64_t dp() const { return world / cp; }
  // The exchange through a device path with fixed capacity: its window is reserved up front.
  bool device_exchange() const { return ep > 1 && ep_exchange == moe::ExchangeMode::kDeviceCounts; }
  // Throws ConfigError naming the first impossible key ("parallel.<key>"), the mesh against the
  // model's experts included (dist::MeshShape::validate).
  void validate(int64_t n_experts) const;
};

}  // namespace mt
