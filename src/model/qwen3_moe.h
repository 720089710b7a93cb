// The Qwen3-MoE causal LM: embedding -> blocks -> final RMSNorm -> LM head -> cross-entropy.
// Parameter units: "embed" (table), "layers.i" (dense + expert groups), "head" (final norm and,
// unless tied, the LM head).
//
// On a device mesh every rank holds its part of the batch (under context parallelism its chunks
// of its group's rows: model/context_parallel.h); dense groups are sharded over the
// world, expert groups hold this EP rank's experts sharded over dp_shard_mod_ep, and a unit is
// gathered just before it runs and released right after (forward and backward alike).
#pragma once
#include <memory>
#include <utility>
#include <vector>

#include "core/quant.h"
#include "dist/mesh.h"
#include "fsdp/params.h"
#include "model/batch.h"
#include "model/block.h"
#include "model/config.h"
#include "model/parallel.h"
#include "model/precision.h"

namespace mt {

// The LM head's input gradient under the FP8 dense recipe (Qwen3Moe::head_and_loss; also what
// bench_fp8_gemm times): the cross-entropy backward writes dlogits over `logits` (rows, V) and,
// kHeadFp8GradientRows rows at a time, their FP8 rows into `slice` (kRow128 along dim0, at least
// min(rows, kHeadFp8GradientRows) rows of V), each slice's dx (rows, D) = dlogits w^T taken on
// ops::fp8_gemm from w's input-gradient tiles before the next slice is written.
void fp8_head_backward_input(Tensor& logits, const Tensor& targets, const Tensor& mask,
                             const Tensor& lse, const Tensor& ce_scale, const QuantTensor& w_tiles,
                             Fp8ScaleRule rule, QuantTensor& slice, Tensor& dx);

// How one micro-batch's losses enter the step's objective:
//   total = sum_micro (ce_sum * ce_scale + aux_scale * sum_layers aux).
struct LossScale {
  double ce_scale = 1.0;   // 1 / (masked tokens of the whole step)
  double aux_scale = 0.0;  // aux_loss_coef / micro-batches per step
};

struct MicroBatchLosses {
  double ce_sum = 0;   // sum of the token losses over masked tokens
  double aux_sum = 0;  // sum over layers of the per-layer aux loss (no coefficient)
};

class Qwen3Moe {
 public:
  // mesh: null for one rank; otherwise it must outlive the model. parallel: how the layers use
  // the mesh (the exchange's mode, chunks and lane, FSDP's resharding, the dispatch dtype, which
  // the precision plan takes; its world and ep are the mesh's).
  Qwen3Moe(const ModelConfig& c, uint64_t seed, dist::DeviceMesh* mesh = nullptr,
           const ParallelConfig& parallel = {});
  ~Qwen3Moe();
  // Captured CUDA graphs hold this model's addresses: it is never copied.
  Qwen3Moe(const Qwen3Moe&) = delete;
  Qwen3Moe& operator=(const Qwen3Moe&) = delete;

  const ModelConfig& config() const { return cfg_; }
  std::vector<ParamUnit>& units() { return units_; }
  const std::vector<ParamUnit>& units() const { return units_; }
  // Aux-loss-free balancing state: one (E) bias per layer (zero when the option is off).
  std::vector<Tensor>& router_biases() { return router_bias_; }
  // Tokens of the whole batch (every rank's part; padding left out) routed to each expert in this
  // step, per layer (i64 (E), on the host, the same on every rank); reset by zero_grad.
  const std::vector<Tensor>& step_expert_load() const { return expert_load_; }
  // Micro-batches run as replays of captured CUDA graphs so far (hardware.cuda_graphs; where
  // use_graphs() allows: on the GPU, with the device exchange when ep > 1, not profiling).
  int64_t graph_replays() const;

  void zero_grad();
  // Forward and backward of one micro-batch; gradients accumulate.
  MicroBatchLosses forward_backward(const Batch& b, const LossScale& s);
  // Forward only (evaluation and finite differences). token_losses (b.size(), the loss
  // statistics' dtype, on the model's device), where given, receives each token's loss (0 where
  // the loss mask is 0).
  MicroBatchLosses forward(const Batch& b, Tensor* token_losses = nullptr);
  // bias_e += rate * sign(mean load - load_e) from this step's loads over all ranks
  // (DeepSeek-V3 style); the loads are global already (step_expert_load), so no collective.
  void update_router_biases();
  dist::DeviceMesh* mesh() const { return mesh_; }

 private:
  // The device work of one micro-batch: forward (and backward when s), losses into losses_,
  // routed counts into routed_. On the GPU it never waits for the host, so it can be captured.
  // token_losses: forward()'s (forward passes only).
  void pass(const Batch& b, const LossScale* s, Tensor* token_losses = nullptr);
  // pass() as a CUDA graph: the first batch of a shape runs eagerly (warming cuDNN, cuBLASLt
  // and the graph pool), the second is captured, later ones replay it (see the .cpp).
  void run_graphed(const Batch& b, const LossScale& s);
  // Whether training passes run as CUDA graphs (forward passes never do).
  bool use_graphs() const;
  struct GraphCache;  // captured passes by shape (qwen3_moe.cpp)
  // The device buffers a captured pass reads and writes by address, besides its inputs.
  std::vector<const void*> pass_buffers() const;
  // The communicators a pass's collectives use (the batch group's and the FSDP groups').
  std::vector<dist::Communicator*> pass_communicators() const;
  // Reads losses_ and routed_ back (the pass's one wait for the device) and folds the counts
  // into expert_load_.
  MicroBatchLosses collect();
  Tensor head_weight() const;  // (D, V) view, or the embedding table when tied (V, D)
  // What the head's backward writes: dxf overwritten, dw (the head's or, tied, the table's
  // gradient) accumulated; ce_scale is the one-f64 device scale of the loss gradient.
  struct HeadGradients {
    const Tensor* ce_scale;
    Tensor* dxf;
    Tensor dw;
  };
  // The LM head and cross-entropy over cfg_.loss_chunk_tokens tokens at a time: each chunk's
  // logits, loss and (when grads) gradients, so at most chunk x vocab logits exist at once.
  // Adds the summed loss of the counted tokens to loss_sum (one f64 on the device).
  void head_and_loss(const Batch& b, const Tensor& xf, HeadGradients* grads, Tensor& loss_sum,
                     Tensor* token_losses = nullptr);

  ModelConfig cfg_;  // its expert_precision is the precision plan's
  ParallelConfig parallel_;
  PrecisionPlan precision_;
  dist::DeviceMesh* mesh_ = nullptr;
  moe::MoeComms comms_;
  dist::Communicator* cp_ = nullptr;  // the CP group (parallel.cp > 1)
  std::unique_ptr<Lane> lane_;        // with ep > 1: where the exchanges run
  std::unique_ptr<Lane> tiles_lane_;  // one GPU holding FP8 tiles: where they are transposed
  std::vector<ParamUnit> units_;      // [0] embed, [1..L] layers, [L+1] head
  std::vector<Tensor> router_bias_;
  std::vector<Tensor> expert_load_;
  // On the model's device, written by pass(): [0] the loss sum, [1 + l] layer l's aux loss (f64);
  // routed_ (L, E) i64 the pass's counts; ce_scale_ the loss-gradient scale (one f64).
  Tensor losses_, routed_, ce_scale_;
  std::unique_ptr<GraphCache> graphs_;
};

}  // namespace mt
