#include "model/qwen3_moe.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <map>
#include <optional>
#include <string_view>

#include "core/log.h"
#include "core/profile.h"
#include "fsdp/fsdp.h"
#include "ops/attention.h"
#include "ops/elementwise.h"
#include "ops/embedding.h"
#include "ops/fp8.h"
#include "ops/fp8_gemm.h"
#include "ops/gemm.h"
#include "ops/loss.h"
#include "ops/norm.h"
#include "ops/route.h"
#if MOETRAIN_HAS_CUDA
#include "core/cuda/device.h"
#include "core/cuda/graph.h"
#endif

namespace mt {

namespace {
// The loss is normalised by the global count of counted tokens (the trainer all-reduces it), so
// summing the ranks' gradients gives the gradient of the global batch: no further division.
constexpr double kGradDivideFactor = 1.0;

#if MOETRAIN_HAS_CUDA
// The batch as a captured pass replays it: padded to the document shape the attention plans for
// (ops::planned_documents; the extra documents empty: cu_seqlens repeats N), so the results do
// not change and batches of any document count share a few graphs. On the host.
Batch padded_documents(const Batch& b) {
  const Tensor cu = b.cu_seqlens.to(Device::kCPU);
  const int64_t docs = cu.numel() - 1;
  // The documents span the whole rows (a context-parallel rank holds a cp-th of their tokens).
  const ops::PlannedDocuments planned =
      ops::planned_documents(docs, b.max_seqlen, b.size() * b.context.cp());
  Batch out = b;
  out.cu_seqlens = Tensor::empty({planned.count + 1}, DType::kI32);
  for (int64_t i = 0; i <= planned.count; ++i)
    out.cu_seqlens.data<int32_t>()[i] = cu.data<int32_t>()[std::min(i, docs)];
  out.max_seqlen = planned.longest;  // the same long-document threshold: a power of two already
  return out;
}
#endif

}  // namespace

#if MOETRAIN_HAS_CUDA
// Captured training passes (CUDA graphs). A named namespace: Qwen3Moe::GraphCache holds them.
namespace captured {

// What a captured pass depends on besides the values in its buffers.
struct PassKey {
  int64_t tokens = 0, docs = 0, longest = 0;
  int64_t long_docs = -1;     // the attention backward's long documents, planned (a power of two)
  bool padding_mask = false;  // whether the pass reads Batch::padding
  std::vector<bool> expert_grads_unwritten;  // per layer: overwrite or accumulate
  std::vector<bool> grad_shards_stale;       // per group: zeroed by the pass or added to
  auto operator<=>(const PassKey&) const = default;
};

// One shape's captured pass: the inputs it reads (ordinary device memory, rewritten before each
// replay) and the graph.
struct Pass {
  Batch inputs;
  cuda::CapturedWork work;
  bool interrupted = false;  // a run of the body threw before its end (a failed capture)
};

// The batch copied into the pass's own input buffers (allocated on first use).
void stage_inputs(const Batch& padded, Batch& inputs) {
  if (!inputs.tokens.defined()) {
    inputs = padded.to(Device::kCUDA);  // always a copy: the graph owns these buffers
    return;
  }
  inputs.tokens.copy_from(padded.tokens);
  inputs.targets.copy_from(padded.targets);
  inputs.loss_mask.copy_from(padded.loss_mask);
  inputs.positions.copy_from(padded.positions);
  inputs.cu_seqlens.copy_from(padded.cu_seqlens);
  if (padded.padding.defined()) inputs.padding.copy_from(padded.padding);
}

}  // namespace captured
#endif

struct Qwen3Moe::GraphCache {
#if MOETRAIN_HAS_CUDA
  std::map<captured::PassKey, captured::Pass> passes;
  std::vector<const void*> buffers;  // what the captures read and write (pass_buffers())
#endif
  int64_t replays = 0;
};

Qwen3Moe::Qwen3Moe(const ModelConfig& c, uint64_t seed, dist::DeviceMesh* mesh,
                   const ParallelConfig& parallel)
    : cfg_(c), parallel_(parallel), precision_(plan_precision(c, parallel)), mesh_(mesh) {
  cfg_.validate();
  cfg_.expert_precision = precision_.experts;
  int64_t first_expert = 0, local_experts = c.n_experts;
  if (mesh) {
    first_expert = mesh->first_local_expert();
    local_experts = mesh->experts_per_rank();
    if (mesh->ep_size() > 1) comms_.ep = &mesh->ep();
    comms_.exchange = parallel.ep_exchange;
    comms_.chunks = parallel.ep_chunks;
    if (mesh->ep_size() > 1 && parallel.ep_overlap) {
      lane_ = std::make_unique<Lane>(moe::kExchangeExposedSpan);
      comms_.lane = lane_.get();
    }
    if (mesh->world().size() > 1) comms_.batch = &mesh->world();
    cp_ = mesh->cp();
  }
  const DType dt = cfg_.master_dtype();
  ParamUnit embed{"embed", {}, {}};
  embed.groups.push_back(
      make_param_group(ParamKind::kDense, {{"embed.table", {c.vocab_size, c.dim}}}, dt));
  units_.push_back(std::move(embed));
  for (int64_t l = 0; l < c.n_layers; ++l)
    units_.push_back(ParamUnit{fmt::format("layers.{}", l),
                               make_block_groups(cfg_, precision_, l, first_expert, local_experts),
                               {}});
  std::vector<ParamSpec> head_specs = {{"head.norm", {c.dim}, true}};
  if (!c.tie_word_embeddings) head_specs.push_back({"head.out", {c.dim, c.vocab_size}});
  units_.push_back(
      ParamUnit{"head", {make_param_group(ParamKind::kDense, std::move(head_specs), dt)}, {}});
  for (auto& u : units_)
    for (auto& g : u.groups) {
      allocate_group(g);
      init_params(g, seed, c.init_std);  // on the host, then moved: same values on any device
      place_group(g, cfg_.device, cfg_.activation_dtype());
      if (!mesh) continue;
      dist::Communicator& group =
          g.kind == ParamKind::kExpert ? mesh->dp_shard_mod_ep() : mesh->world();
      if (group.size() > 1) fsdp::shard_group(g, group);
    }
  // One GPU holding FP8 tiles: each block's forward layout is transposed on a lane while the
  // block before it runs (fsdp::prefetch_forward_tiles).
  if (cfg_.device == Device::kCUDA &&
      std::any_of(units_.begin(), units_.end(), [](const ParamUnit& u) {
        return std::any_of(u.groups.begin(), u.groups.end(),
                           [](const ParamGroup& g) { return g.holds_fp8_tiles(); });
      }))
    tiles_lane_ = std::make_unique<Lane>("exposed.fp8_tiles");
  for (int64_t l = 0; l < c.n_layers; ++l) {
    router_bias_.push_back(Tensor::zeros({c.n_experts}, cfg_.stat_dtype(), cfg_.device));
    expert_load_.push_back(Tensor::zeros({c.n_experts}, DType::kI64));
  }
  losses_ = Tensor::zeros({1 + c.n_layers}, DType::kF64, cfg_.device);
  routed_ = Tensor::zeros({c.n_layers, c.n_experts}, DType::kI64, cfg_.device);
  ce_scale_ = Tensor::zeros({1}, DType::kF64, cfg_.device);
  graphs_ = std::make_unique<GraphCache>();
}

Qwen3Moe::~Qwen3Moe() = default;

void Qwen3Moe::zero_grad() {
  for (auto& u : units_)
    for (auto& g : u.groups) {
      if (g.kind == ParamKind::kExpert && !g.sharded())
        g.grads_unwritten = true;  // the backward overwrites them: no fill
      else
        g.grad_shard_stale = true;  // zeroed by the step's first backward of the group
    }
  for (auto& l : expert_load_) l.zero_();
}

Tensor Qwen3Moe::head_weight() const {
  const ParamGroup& g = units_.back().groups[0];
  return cfg_.tie_word_embeddings ? units_[0].groups[0].weight(0) : g.weight(1);
}

MicroBatchLosses Qwen3Moe::forward(const Batch& b, Tensor* token_losses) {
  if (token_losses) {
    const Shape want{b.size()};
    MT_CHECK(token_losses->shape() == want && token_losses->dtype() == cfg_.stat_dtype() &&
                 token_losses->device() == cfg_.device,
             "per-token losses: {} {}, the model needs {} {} on its device",
             dtype_name(token_losses->dtype()), shape_str(token_losses->shape()),
             dtype_name(cfg_.stat_dtype()), shape_str(want));
  }
  pass(b, nullptr, token_losses);  // forward passes are never graphed
  return collect();
}
MicroBatchLosses Qwen3Moe::forward_backward(const Batch& b, const LossScale& s) {
  ce_scale_.set_item(0, s.ce_scale);
  if (use_graphs())
    run_graphed(b, s);
  else
    pass(b, &s);
  return collect();
}

int64_t Qwen3Moe::graph_replays() const {
  return graphs_->replays;
}

bool Qwen3Moe::use_graphs() const {
#if MOETRAIN_HAS_CUDA
  // Training passes with no host round trip: one GPU, or several over NCCL (FSDP's collectives
  // are captured with the pass), with ep > 1 when the expert exchange keeps its counts on the
  // device (the host-count reference reads them every layer). Never under the profiler (its
  // phases wait for the device).
  const bool exchange_on_device = !comms_.ep || comms_.exchange == moe::ExchangeMode::kDeviceCounts;
  return cfg_.on_gpu() && cfg_.cuda_graphs && exchange_on_device && !profile::enabled();
#else
  return false;
#endif
}

#if MOETRAIN_HAS_CUDA
std::vector<const void*> Qwen3Moe::pass_buffers() const {
  std::vector<const void*> out = {losses_.raw(), routed_.raw(), ce_scale_.raw()};
  for (const auto& u : units_)
    for (const auto& g : u.groups) {
      for (const Tensor* t : {&g.shard, &g.grad_shard, &g.params, &g.compute, &g.grads})
        out.push_back(t->defined() ? t->raw() : nullptr);
      const std::vector<const void*> tiles = g.held_tile_buffers();
      out.insert(out.end(), tiles.begin(), tiles.end());
    }
  for (const Tensor& bias : router_bias_) out.push_back(bias.raw());
  return out;
}

std::vector<dist::Communicator*> Qwen3Moe::pass_communicators() const {
  std::vector<dist::Communicator*> out;
  auto add = [&](dist::Communicator* c) {
    if (c && std::find(out.begin(), out.end(), c) == out.end()) out.push_back(c);
  };
  add(comms_.batch);
  add(cp_);
  for (const auto& u : units_)
    for (const auto& g : u.groups) add(g.comm);
  return out;
}
#endif

void Qwen3Moe::run_graphed(const Batch& b, const LossScale& scale) {
#if MOETRAIN_HAS_CUDA
  // Persistent state the pass would otherwise create lazily (an unsharded group's bf16 compute
  // copy, its held FP8 tiles) must not come from the graph pool: make it now. (A sharded group's
  // gathered copies live only inside the pass.) A graph holds the addresses of everything it reads
  // and writes: when one of those buffers was replaced (a checkpoint load drops the compute
  // copies), every capture is stale.
  for (auto& u : units_)
    for (auto& g : u.groups) fsdp::make_persistent_copies(g);
  if (std::vector<const void*> now = pass_buffers(); now != graphs_->buffers) {
    graphs_->passes.clear();
    graphs_->buffers = std::move(now);
  }
  const Batch padded = padded_documents(b);
  captured::PassKey key{padded.size(),
                        padded.cu_seqlens.numel() - 1,
                        padded.max_seqlen,
                        ops::planned_long_documents(padded.long_documents),
                        padded.padding.defined(),
                        {},
                        {}};
  std::vector<ParamGroup*> experts;
  for (size_t u = 1; u + 1 < units_.size(); ++u) experts.push_back(&units_[u].groups[1]);
  for (ParamGroup* g : experts) key.expert_grads_unwritten.push_back(g->grads_unwritten);
  std::vector<ParamGroup*> groups;
  for (auto& u : units_)
    for (auto& g : u.groups) groups.push_back(&g);
  for (ParamGroup* g : groups) key.grad_shards_stale.push_back(g->grad_shard_stale);
  captured::Pass& cp = graphs_->passes[key];
  captured::stage_inputs(padded, cp.inputs);
  auto body = [&] {
    // A failed capture ran the pass's host code, not its work: the eager run after it starts
    // from the flags the key was made of, and with no collective of the capture in flight.
    for (size_t l = 0; l < experts.size(); ++l)
      experts[l]->grads_unwritten = key.expert_grads_unwritten[l];
    for (size_t i = 0; i < groups.size(); ++i)
      groups[i]->grad_shard_stale = key.grad_shards_stale[i];
    if (cp.interrupted) {
      for (auto& u : units_)
        for (auto& g : u.groups) fsdp::abandon_in_flight(g);
      cuda::clear_last_error();  // what dropping the failed capture's events left behind
    }
    cp.interrupted = true;
    pass(cp.inputs, &scale);
    cp.interrupted = false;
  };
  const std::string what =
      fmt::format("the training pass of {} tokens ({} documents, longest {}, {} long; padded)",
                  padded.size(), key.docs, key.longest, key.long_docs);
  if (cp.work.run(body, what)) {
    ++graphs_->replays;
    for (ParamGroup* g : experts) g->grads_unwritten = false;  // what pass() would have set
    for (ParamGroup* g : groups) g->grad_shard_stale = false;
    // The replay's collectives were captured, not issued: their communicators' watchdogs watch
    // the whole replay instead (a dead peer stops this rank with its name, not a hang).
    for (dist::Communicator* comm : pass_communicators())
      comm->watch_queued("a collective of a replayed training pass (CUDA graph)");
  }
  MT_CHECK(graph_pool_live_bytes() == 0,
           "{} bytes allocated inside a captured pass outlive it (a replay would overwrite them)",
           graph_pool_live_bytes());
#else
  (void)b;
  (void)scale;
#endif
}

namespace {
// Test hook for a host sync inside a captured pass: MOETRAIN_FAULT_HOST_WAIT=1 makes each pass
// read a device value on the host after queuing the first layer's gather and the next one's
// prefetch, a wait a capture cannot record (eagerly it only costs the wait; captured, it is a
// HostSyncInCapture naming the phase "test.injected_host_wait").
bool host_wait_injected() {
  static const bool on = [] {
    const char* v = std::getenv("MOETRAIN_FAULT_HOST_WAIT");
    return v && std::string_view(v) == "1";
  }();
  return on;
}
}  // namespace

void Qwen3Moe::pass(const Batch& b, const LossScale* scale, Tensor* token_losses) {
  const ModelConfig& c = cfg_;
  const int64_t n = b.size(), L = c.n_layers;
  const DType dt = c.activation_dtype(), st = c.stat_dtype();
  const Device dev = c.device;
  const bool tied = c.tie_word_embeddings;
  const int64_t cp = mesh_ ? mesh_->cp_size() : 1;
  MT_CHECK(b.context.cp() == cp,
           "a batch dealt to {} context-parallel ranks for a model on a mesh with cp = {}",
           b.context.cp(), cp);
  ParamUnit& embed = units_.front();
  ParamUnit& head = units_.back();
  losses_.zero_();
  Tensor loss_sum = losses_.view(0, {1});

  // Units: the embedding (0), the blocks (1..L), the head (L + 1); the embedding's backward
  // reads no parameters (a scatter-add of the gradient).
  std::vector<bool> reads(units_.size(), true);
  reads[0] = false;
  // A full checkpointing policy reruns the forward's expert products in the backward; a pass
  // without a backward holds nothing for one.
  fsdp::UnitSchedule schedule(
      units_, kGradDivideFactor, std::move(reads), precision_.backward_copies,
      scale ? parallel_.reshard : fsdp::Reshard::kAfterForward, tiles_lane_.get());
  const size_t head_unit = units_.size() - 1;

  schedule.forward_begin(0);
  Tensor x = Tensor::empty({n, c.dim}, dt, dev);
  ops::embedding_forward(b.tokens, embed.groups[0].weight(0), x);
  if (!tied) schedule.forward_end(0);  // tied: the head reads the table too
  std::vector<BlockActivations> acts(L);
  std::vector<BlockInputs> inputs(L);
  for (int64_t l = 0; l < L; ++l) {
    ParamUnit& unit = units_[l + 1];
    inputs[l].batch = &b;
    inputs[l].comms = comms_;
    inputs[l].cp = cp_;
    if (c.bias_update_rate > 0) inputs[l].router_bias = router_bias_[l];
    {
      const profile::Phase phase("fsdp.gather");
      schedule.forward_begin(l + 1);
    }
    if (l == 0 && host_wait_injected()) {
      const profile::Phase phase("test.injected_host_wait");
      (void)losses_.to(Device::kCPU);
    }
    x = block_forward(bind_block_params(unit.groups), c, inputs[l], x, acts[l]);
    schedule.forward_end(l + 1);
    losses_.view(1 + l, {1}).copy_from(acts[l].aux_loss);
    // The routing statistics' counts: the whole batch's (every rank), padding left out.
    routed_.view(l * c.n_experts, {c.n_experts}).copy_from(acts[l].aux_stats.tokens_per_expert);
  }
  if (c.aux_loss_form == AuxLossForm::kTransformers) {
    // transformers' load_balancing_loss_func: one loss over all layers' routing as one batch,
    // E * sum_e (C_e / LN) (sum_l P_le / LN), written as a sum over layers of the per-layer
    // formula with the pooled counts C and token count LN and the layer's own score sums; the
    // backward then gives each layer's scores the gradient E C_e / (LN)^2.
    ops::AuxStats pooled = ops::zero_aux_stats(acts[0].aux_stats);
    for (int64_t l = 0; l < L; ++l) ops::add_aux_stats(acts[l].aux_stats, pooled);
    for (int64_t l = 0; l < L; ++l) {
      acts[l].aux_stats = {pooled.tokens_per_expert, acts[l].aux_stats.score_sum, pooled.top_k};
      acts[l].aux_loss = ops::router_aux_loss(acts[l].aux_stats);
      losses_.view(1 + l, {1}).copy_from(acts[l].aux_loss);
    }
  }
  std::optional<profile::Phase> head_phase(std::in_place, "head");
  schedule.forward_begin(head_unit);
  const Tensor norm_w = head.groups[0].weight(0);
  Tensor xf = Tensor::empty({n, c.dim}, dt, dev), rstd = Tensor::empty({n}, st, dev);
  ops::rmsnorm_forward(x, norm_w, c.rms_norm_eps, xf, rstd);
  if (!scale) {
    head_and_loss(b, xf, nullptr, loss_sum, token_losses);
    schedule.forward_end(head_unit);
    schedule.forward_end(0);
    return;
  }

  // Backward: the head's (inside head_and_loss, chunk by chunk), blocks in reverse, embedding.
  schedule.backward_begin(head_unit);
  schedule.begin_gradients(0);  // tied: the head's backward writes the table's gradient
  Tensor dxf = Tensor::empty({n, c.dim}, dt, dev);
  HeadGradients hg{&ce_scale_, &dxf, tied ? embed.groups[0].grad(0) : head.groups[0].grad(1)};
  head_and_loss(b, xf, &hg, loss_sum);
  Tensor dx = Tensor::empty({n, c.dim}, dt, dev);
  Tensor dnorm = head.groups[0].grad(0);
  ops::rmsnorm_backward(x, norm_w, rstd, dxf, dx, dnorm);
  schedule.backward_end(head_unit);
  schedule.forward_end(0);  // tied: held for the head until now
  head_phase.reset();
  for (int64_t l = L - 1; l >= 0; --l) {
    ParamUnit& unit = units_[l + 1];
    {
      const profile::Phase phase("fsdp.gather");
      schedule.backward_begin(l + 1);
    }
    BlockParams g = bind_block_grads(unit.groups);
    ParamGroup& experts = unit.groups[1];
    dx = block_backward(bind_block_params(unit.groups), g, c, inputs[l], acts[l], dx,
                        scale->aux_scale,
                        experts.grads_unwritten ? ops::Accumulate::kNo : ops::Accumulate::kYes);
    experts.grads_unwritten = false;
    const profile::Phase phase("fsdp.reduce");
    schedule.backward_end(l + 1);
  }
  const profile::Phase phase("embedding.backward");
  schedule.backward_begin(0);
  Tensor dtable = embed.groups[0].grad(0);
  ops::embedding_backward(b.tokens, dx, dtable);
  schedule.backward_end(0);
  schedule.backward_done();
}

MicroBatchLosses Qwen3Moe::collect() {
  const Tensor losses = losses_.to(Device::kCPU);
  MicroBatchLosses out;
  out.ce_sum = losses.data<double>()[0];
  for (int64_t l = 0; l < cfg_.n_layers; ++l) out.aux_sum += losses.data<double>()[1 + l];
  const Tensor routed = routed_.to(Device::kCPU);
  for (int64_t l = 0; l < cfg_.n_layers; ++l)
    for (int64_t e = 0; e < cfg_.n_experts; ++e)
      expert_load_[l].data<int64_t>()[e] += routed.data<int64_t>()[l * cfg_.n_experts + e];
  return out;
}

void fp8_head_backward_input(Tensor& logits, const Tensor& targets, const Tensor& mask,
                             const Tensor& lse, const Tensor& ce_scale, const QuantTensor& w_tiles,
                             Fp8ScaleRule rule, QuantTensor& slice, Tensor& dx) {
  const int64_t rows = logits.dim(0);
  for (int64_t s0 = 0; s0 < rows; s0 += kHeadFp8GradientRows) {
    const int64_t s1 = std::min(rows, s0 + kHeadFp8GradientRows), k = s1 - s0;
    Tensor dlogits = logits.slice_rows(s0, s1), dx_rows = dx.slice_rows(s0, s1);
    QuantTensor q = slice.rows(0, k);
    const ops::Fp8RowsOut fp8{&q, rule};
    ops::cross_entropy_backward(dlogits, targets.view(s0, {k}), mask.view(s0, {k}),
                                lse.view(s0, {k}), ce_scale, dlogits, &fp8);
    ops::fp8_gemm(q, w_tiles, dx_rows);
  }
}

void Qwen3Moe::head_and_loss(const Batch& b, const Tensor& xf, HeadGradients* grads,
                             Tensor& loss_sum, Tensor* token_losses) {
  const ModelConfig& c = cfg_;
  const int64_t n = xf.dim(0), v = c.vocab_size;
  const int64_t chunk = c.loss_chunk_tokens > 0 ? std::min(c.loss_chunk_tokens, n) : n;
  const DType dt = xf.dtype(), st = c.stat_dtype();
  const Device dev = xf.device();
  const Tensor w_out = head_weight();
  const ops::Transpose w_op = c.tie_word_embeddings ? ops::Transpose::kYes : ops::Transpose::kNo;
  // One (chunk, V) buffer: the backward writes dlogits over the logits.
  Tensor logits_buffer = Tensor::empty({chunk, v}, dt, dev),
         lse_buffer = Tensor::empty({chunk}, st, dev);
  // FP8 dense recipe: the head's weight tiles for both products, from one read, once for all
  // chunks (the forward's dropped after the last chunk's forward); dlogits' FP8 rows a slice at a
  // time (kHeadFp8GradientRows).
  const Fp8ScaleRule rule = c.expert_precision.fp8_scale;
  ops::Fp8LinearWeight w_fp8;
  QuantTensor dlogits_fp8;
  if (c.dense_fp8())
    w_fp8 = ops::fp8_linear_weight(w_out, w_op, rule,
                                   grads ? ops::Fp8LinearUse::kBoth : ops::Fp8LinearUse::kForward);
  for (int64_t r0 = 0; r0 < n; r0 += chunk) {
    const int64_t rows = std::min(chunk, n - r0);
    const Tensor x = xf.slice_rows(r0, r0 + rows);
    const Tensor targets = b.targets.view(r0, {rows}), mask = b.loss_mask.view(r0, {rows});
    Tensor logits = logits_buffer.view(0, {rows, v}), lse = lse_buffer.view(0, {rows});
    if (c.dense_fp8()) {
      ops::fp8_gemm(ops::fp8_rows(x, rule), w_fp8.forward, logits);
      if (r0 + rows == n) w_fp8.forward = QuantTensor();
      if (grads && !dlogits_fp8.defined())
        dlogits_fp8 = QuantTensor::empty({std::min(chunk, kHeadFp8GradientRows), v},
                                         QuantBlock::kRow128, QuantAxis::kDim0, dev);
    } else {
      ops::gemm(x, ops::Transpose::kNo, w_out, w_op, logits, ops::Accumulate::kNo);
    }
    Tensor token_loss = token_losses ? token_losses->view(r0, {rows}) : Tensor();
    ops::cross_entropy_forward(logits, targets, mask, lse, loss_sum,
                               token_losses ? &token_loss : nullptr);
    if (!grads) continue;
    Tensor& dlogits = logits;  // written over the logits
    Tensor dx = grads->dxf->slice_rows(r0, r0 + rows);
    if (c.dense_fp8()) {
      fp8_head_backward_input(dlogits, targets, mask, lse, *grads->ce_scale, w_fp8.input_gradient,
                              rule, dlogits_fp8, dx);
      ops::linear_backward_weight(x, dlogits, grads->dw, w_op);
    } else {
      ops::cross_entropy_backward(logits, targets, mask, lse, *grads->ce_scale, dlogits);
      ops::linear_backward(x, w_out, dlogits, dx, grads->dw, ops::Accumulate::kNo, w_op);
    }
  }
}

void Qwen3Moe::update_router_biases() {
  if (cfg_.bias_update_rate <= 0) return;
  for (int64_t l = 0; l < cfg_.n_layers; ++l) {
    const int64_t* load = expert_load_[l].data<int64_t>();  // the whole batch's already
    double mean = 0;
    for (int64_t e = 0; e < cfg_.n_experts; ++e) mean += static_cast<double>(load[e]);
    mean /= static_cast<double>(cfg_.n_experts);
    for (int64_t e = 0; e < cfg_.n_experts; ++e) {
      const double sign = mean > load[e] ? 1.0 : (mean < load[e] ? -1.0 : 0.0);
      router_bias_[l].set_item(e, router_bias_[l].item(e) + cfg_.bias_update_rate * sign);
    }
  }
}

}  // namespace mt
