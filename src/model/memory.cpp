#include "model/memory.h"

#include <algorithm>

#include "model/flops.h"
#include "model/precision.h"
#include "moe/exchange/expert_exchange.h"

namespace mt {

MemoryEstimate estimate_memory(const ModelConfig& m, const ParallelConfig& p, int64_t tokens) {
  MemoryEstimate e;
  const double params = static_cast<double>(count_params(m).total);
  const double world = static_cast<double>(p.world);
  // The device exchange's expert rows are sized for ep times a balanced share.
  const double rows_factor = p.device_exchange() ? static_cast<double>(p.ep) : 1.0;
  // Context parallelism: a rank holds tokens / cp of the rows; its attention holds the rows' keys
  // and values (gathered) and, in the backward, their gradients and the reduce-scatter's staging.
  const int64_t local = tokens / p.cp;
  e.activations = activation_bytes(m, local, rows_factor);
  if (p.cp > 1)
    e.activations += 5.0 * static_cast<double>(tokens * m.kv_dim()) *
                     static_cast<double>(dtype_size(m.activation_dtype()));
  if (!m.on_gpu()) {
    // Weights, gradients and two AdamW moments in the compute dtype; CPU ranks share one host.
    e.states = params * 4 * static_cast<double>(dtype_size(m.compute_dtype));
    e.activations *= world;
    return e;
  }
  // fp32 master weights, gradients and two AdamW moments sharded over the ranks (16 bytes).
  e.states = params * 16 / world;
  // Workspaces: the bf16 compute copies (every unit's on one rank, where they persist; a unit and
  // the prefetched next one when sharded); under an MX or FP8 recipe the expert matrices keep
  // none, and a unit in use holds each one's quantized copies for its pass (MX values in the
  // compute dtype, FP8 tiles at a byte a weight) beside the gathered or rounded weights they are
  // made from, except on one rank under an FP8 recipe, where every expert matrix holds its input
  // gradient's tiles across steps (AdamW rewrites them) and the unit in use its forward's, their
  // transpose (on the GPU the next unit's too, made beside it); the expert exchange's receive
  // buffer, and 1 GiB for the libraries (cuBLASLt, cuDNN, NCCL).
  const PrecisionPlan plan = plan_precision(m, p);
  const BlockParamCounts block = count_block_params(m);
  const double experts =
      static_cast<double>(m.n_experts * block.per_expert) / static_cast<double>(p.ep);
  const bool mx = plan.expert_weight_copies;
  const double compute_bytes = static_cast<double>(dtype_size(m.activation_dtype()));
  const double copy_size = plan.experts.fp8_forward_and_input() ? 1.0 / compute_bytes : 1.0;
  const double expert_in_use = 1.0 + static_cast<double>(plan.copies_in_use()) * copy_size;
  const double layer = static_cast<double>(block.dense) + experts * expert_in_use;
  const double table = static_cast<double>(m.vocab_size * m.dim);
  // One rank: every compute copy persists except the expert matrices' under an MX or FP8 recipe;
  // MX: the quantized copies of the unit in use and the next; FP8: every layer's input-gradient
  // tiles and the forward's of the unit in use (and of the next, on the GPU).
  const double expert_all = experts * static_cast<double>(m.n_layers);
  const double forward_tiles = m.device == Device::kCUDA ? 2.0 : 1.0;
  const double all = !mx ? params
                     : plan.experts.fp8_forward_and_input()
                         ? params - expert_all + (expert_all + forward_tiles * experts) * copy_size
                         : params - expert_all + 2 * experts * expert_in_use;
  e.workspaces = (world > 1 ? 2 * std::max(layer, table) : all) * compute_bytes + double{1 << 30};
  // model.dense_recipe in FP8: beside the logits, the LM head's weight tiles for its forward and
  // input gradient (a byte a weight each) and a slice of dlogits' FP8 rows (a byte an element and
  // an f32 scale per 128). With one chunk the forward's tiles are dropped before the slice is
  // made; with several, all three live through the chunks.
  if (m.dense_fp8()) {
    const int64_t chunk = m.loss_chunk_tokens > 0 ? std::min(local, m.loss_chunk_tokens) : local;
    const double slice = static_cast<double>(std::min(chunk, kHeadFp8GradientRows)) *
                         static_cast<double>(m.vocab_size) * (1.0 + 4.0 / 128);
    e.workspaces += chunk >= local ? table + std::max(table, slice) : 2 * table + slice;
  }
  // Held from forward to backward (parallel.reshard_after_forward = false): the other blocks'
  // gathered weights at the end of the forward (a sharded MX expert group: both passes' copies).
  if (world > 1 && p.reshard == fsdp::Reshard::kAfterBackward && m.n_layers > 2) {
    const bool experts_sharded = p.world > p.ep;
    const double held = static_cast<double>(block.dense) +
                        (experts_sharded ? experts * (mx ? 2.0 * copy_size : 1.0) : 0.0);
    e.workspaces += static_cast<double>(m.n_layers - 2) * held * compute_bytes;
  }
  if (p.device_exchange())
    e.workspaces += static_cast<double>(
        moe::ExpertExchange::window_bytes(static_cast<int>(p.ep), local, m.top_k, m.n_experts,
                                          m.dim, m.activation_dtype(), plan.experts));
  return e;
}

}  // namespace mt
