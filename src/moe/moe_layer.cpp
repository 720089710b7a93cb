#include "moe/moe_layer.h"

#include <optional>

#include "core/profile.h"
#include "ops/activation.h"
#include "ops/elementwise.h"
#include "ops/expert_gemm.h"
#include "ops/fp8.h"
#include "ops/gemm.h"

namespace mt::moe {

ops::RouterOptions router_options(const MoeConfig& c) {
  return {static_cast<int>(c.top_k), c.norm_topk_prob, c.routing};
}

namespace {
ExpertOperandsTap& expert_operands_tap() {
  static ExpertOperandsTap tap;
  return tap;
}

void tap_expert_operands(std::string_view product, const Tensor& x, const Tensor& dy,
                         const Tensor& w, const ops::ExpertRows& rows) {
  if (const ExpertOperandsTap& tap = expert_operands_tap()) tap(product, x, dy, w, rows);
}

// Routing math (logits, softmax, weights) runs in f32 at least: on the GPU the router GEMM reads
// the fp32 master weights (ParamSpec::master_weight) and the up-cast input and writes f32
// logits; the CPU reference keeps its compute dtype (f32 or f64).
DType router_dtype(const Tensor& hn) {
  return hn.device() == Device::kCUDA ? DType::kF32 : hn.dtype();
}

// The padding marks of the expert rows (ops::swiglu_forward): the permutation's, when its layout
// is padded.
const Tensor* padding_marks(const MoeChunk& ch) {
  return ch.perm.align > 1 ? &ch.perm.source_token : nullptr;
}

// What SwiGLU needs of the expert rows: their padding marks and routing weights.
ops::SwigluRows swiglu_rows(const MoeChunk& ch) {
  return {padding_marks(ch), &ch.row_weight};
}

// Whether the rows reach the experts as MX values along the hidden dimension (an MXFP8 dispatch:
// with EP the wire made them, with ep 1 the permutation does, once): the forward product then
// takes them as they are.
bool rows_arrive_mx(const MoeConfig& c) {
  return c.expert_precision.dispatch == RowWire::kMxfp8;
}

// Whether the rows reach the experts as FP8 rows (an FP8 dispatch: with EP the wire made them,
// with ep 1 the layer quantizes its tokens as a sender would, so every EP size computes the
// same): the products take them as they arrived, the weight gradient their values.
bool rows_arrive_fp8(const MoeConfig& c) {
  return c.expert_precision.dispatch == RowWire::kFp8;
}

// Token rows as the experts here take them: the rows (as they are, or their MX or FP8 values on
// those wires) and, on the FP8 wire, the FP8 rows themselves.
struct TokensHere {
  Tensor rows;
  QuantTensor fp8;
};

// FP8 rows' values in the compute dtype dt (what the weight gradient reads).
Tensor fp8_values(const QuantTensor& q, DType dt) {
  Tensor values = Tensor::empty(q.shape(), dt, q.device());
  ops::fp8_dequantize(q, values);
  return values;
}

// This rank's own token rows as they would leave on the wire: on the FP8 wire quantized once
// (what a sender does), else as they are.
TokensHere own_tokens(const MoeConfig& c, const Tensor& own) {
  if (!rows_arrive_fp8(c)) return {own, {}};
  QuantTensor q =
      QuantTensor::empty(own.shape(), QuantBlock::kRow128, QuantAxis::kDim0, own.device());
  ops::fp8_quantize(own, c.expert_precision.fp8_scale, q);
  return {fp8_values(q, own.dtype()), q};
}

// The tokens the experts here take their rows from, and their routing weights: this rank's own
// (the chunk's rows of hn and of the routing), or with EP the ones received.
TokensHere tokens_here(const MoeConfig& c, const MoeChunk& ch, const Tensor& hn) {
  return ch.exchange ? TokensHere{ch.xr, ch.xr_fp8} : own_tokens(c, ch.rows_of(hn));
}
int64_t count_tokens_here(const MoeChunk& ch) {
  return ch.exchange ? ch.xr.dim(0) : ch.end - ch.begin;
}
Tensor weights_here(const MoeActivations& a, const MoeChunk& ch) {
  return ch.exchange ? ch.wr : ch.rows_of(a.routing.expert_weight);
}

// The exchange's FP8 rows, once they have arrived: their values beside them (the chunk's xr).
void fp8_rows_arrived(MoeChunk& ch, DType dt) {
  if (ch.xr_fp8.defined() && !ch.xr.defined()) ch.xr = fp8_values(ch.xr_fp8, dt);
}

// What reads a permutation's expert rows: the weight gradient (the rows themselves), the MX
// product (their MX values), or both.
enum class RowReaders : uint8_t { kWeightGradient, kProduct, kBoth };

// What a product reading a permutation's expert rows multiplies, made by the permutation: under
// an MX recipe their MX values along the hidden dimension, under an FP8 one their FP8 rows (1 x
// 128 blocks); each undefined when no such product reads them.
struct PermutedOperands {
  Tensor mx;
  QuantTensor fp8;
};

// Permutes `here` into the expert rows `rows` (allocated here) with what a product reading them
// multiplies: MX values in place when the rows arrive as MX values (with ep 1 the permutation
// rounds them, once; with EP the wire did) or when only the product reads them, else beside them;
// FP8 rows beside them (the weight gradient reads the rows): the ones that arrived, moved, on the
// FP8 wire, else made by the permutation.
PermutedOperands permute_expert_rows(const MoeConfig& c, const MoeChunk& ch, const TokensHere& here,
                                     Tensor& rows, RowReaders readers) {
  const ops::ExpertPrecision& p = c.expert_precision;
  const bool product = readers != RowReaders::kWeightGradient;
  const Tensor& tokens = here.rows;
  rows = Tensor::empty({ch.perm.rows(), c.dim}, tokens.dtype(), tokens.device());
  PermutedOperands made;
  if (here.fp8.defined()) {
    ops::permute_rows(tokens, ch.perm, rows);
    if (product) {
      made.fp8 =
          QuantTensor::empty(rows.shape(), QuantBlock::kRow128, QuantAxis::kDim0, rows.device());
      ops::permute_rows(here.fp8, ch.perm, made.fp8);
    }
    return made;
  }
  if (product && p.fp8_forward_and_input()) {
    made.fp8 =
        QuantTensor::empty(rows.shape(), QuantBlock::kRow128, QuantAxis::kDim0, rows.device());
    const ops::Fp8RowsOut fp8{&made.fp8, p.fp8_scale};
    ops::permute_rows(tokens, ch.perm, rows, nullptr, &fp8);
    return made;
  }
  const bool mx_product = product && p.mx_forward_and_input();
  Tensor values;
  if (rows_arrive_mx(c) || (mx_product && readers == RowReaders::kProduct))
    values = rows;
  else if (mx_product)
    values = Tensor::empty(rows.shape(), rows.dtype(), rows.device());
  const bool make = values.defined() && !(rows_arrive_mx(c) && ch.exchange);
  const ops::MxValuesOut mx{&values, p.rule};
  ops::permute_rows(tokens, ch.perm, rows, make ? &mx : nullptr);
  if (mx_product) made.mx = values;
  return made;
}

// The layer's exchanges: on the comms' lane when there is one, else in the caller's order. Keeps
// what the thread's stream made for a run until the run is joined (core/lane.h).
class Exchanges {
 public:
  Exchanges(const MoeComms& comms, Device device) : lane_(comms.lane), device_(device) {}
  ~Exchanges() { join_all(); }
  Exchanges(const Exchanges&) = delete;
  Exchanges& operator=(const Exchanges&) = delete;

  Lane::Point run(const std::function<void()>& work, std::vector<Tensor> keep = {}) {
    if (!lane_) {
      work();
      return 0;
    }
    for (Tensor& t : keep) kept_.push_back(std::move(t));
    return last_ = lane_->run(device_, work);
  }
  void join(Lane::Point p) {
    if (lane_) lane_->join(p);
  }
  void join_all() {
    if (lane_ && last_ >= 0) lane_->join(last_);
    last_ = -1;
    kept_.clear();
  }

 private:
  Lane* lane_;
  Device device_;
  Lane::Point last_ = -1;
  std::vector<Tensor> kept_;
};

// On the GPU every expert's rows start on a 128-row boundary: the forward and input-gradient
// GEMMs then run whole row tiles per expert with one TMA descriptor per operand
// (ops/grouped_gemm.h), at the price of up to 127 rows of padding per expert.
int64_t segment_align(const MoeConfig& c, const Tensor& hn) {
  return c.pad_expert_rows && hn.device() == Device::kCUDA ? 128 : 1;
}
}  // namespace

void set_expert_operands_tap(ExpertOperandsTap tap) {
  expert_operands_tap() = std::move(tap);
}

void MoeActivations::drop_expert_rows() {
  for (MoeChunk& ch : chunks) ch.xe = ch.row_weight = ch.act = Tensor();
}

namespace {

// The chunks of a routed layer: consecutive tokens, sizes within one of each other (every EP rank
// has the same N, so the same chunks), each with its exchange (planned on the lane, the layer's
// activations and routing weights sent with it) and its permutation. Fields already present stay.
void make_chunks(const MoeConfig& c, const MoeComms& comms, const Tensor& hn, MoeActivations& a,
                 Exchanges& ex) {
  const int64_t n = hn.dim(0);
  const int64_t count =
      comms.ep ? std::clamp<int64_t>(comms.chunks, 1, std::max<int64_t>(n, 1)) : 1;
  a.chunks.resize(count);
  for (int64_t i = 0; i < count; ++i) {
    a.chunks[i].begin = n * i / count;
    a.chunks[i].end = n * (i + 1) / count;
  }
  if (!comms.ep) {
    ops::make_expert_permutation(a.routing.expert_index, c.n_experts, a.chunks[0].perm,
                                 segment_align(c, hn));
    return;
  }
  std::vector<Lane::Point> planned(count);
  for (int64_t i = 0; i < count; ++i) {
    MoeChunk& ch = a.chunks[i];
    planned[i] = ex.run([&] {
      const Tensor rows = ch.rows_of(hn);
      const Tensor choices = ch.rows_of(a.routing.expert_index);
      const Tensor weights = ch.rows_of(a.routing.expert_weight);
      // The plan dispatches the tokens and their routing weights with their choices.
      std::vector<DispatchRows> with;
      if (!ch.xr.defined()) with.push_back({&rows, &ch.xr, c.expert_precision, &ch.xr_fp8});
      if (!ch.wr.defined()) with.push_back({&weights, &ch.wr});
      ch.exchange =
          std::make_shared<ExpertExchange>(*comms.ep, choices, c.n_experts, comms.exchange, with);
    });
  }
  for (int64_t i = 0; i < count; ++i) {
    MoeChunk& ch = a.chunks[i];
    ex.join(planned[i]);
    fp8_rows_arrived(ch, hn.dtype());
    ops::make_expert_permutation(ch.exchange->local_index(), c.n_experts / comms.ep->size(),
                                 ch.perm, segment_align(c, hn), ch.exchange->local_rows());
  }
}

// Everything of one chunk a fill computes: its undefined fields after the routing.
void fill_chunk(const MoeWeights& w, const MoeConfig& c, const MoeActivations& a, const Tensor& hn,
                MoeChunk& ch, FillFor fill) {
  const DType dt = hn.dtype();
  const Device dev = hn.device();
  const ops::ExpertPrecision& prec = c.expert_precision;
  // Whether anything past the forward's products reads the rows and SwiGLU output made here: a
  // backward fill's are its own; a forward's are read by the backward unless it makes them again.
  const bool rows_read = fill == FillFor::kBackward || c.forward_rows == ForwardRows::kKept;
  // The forward product's rows: their MX values or FP8 rows under those recipes, when it runs in
  // this fill.
  PermutedOperands xe_made;
  if (!ch.xe.defined())
    xe_made = permute_expert_rows(c, ch, tokens_here(c, ch, hn), ch.xe,
                                  ch.gate_up.defined() ? RowReaders::kWeightGradient
                                  : rows_read          ? RowReaders::kBoth
                                                       : RowReaders::kProduct);
  if (!ch.row_weight.defined()) {
    // Each choice's routing weight moved to its expert row: the scatter (Rt, k, 1) -> (R, 1) that
    // is unpermute_rows' backward.
    const Tensor weight = weights_here(a, ch);
    Tensor rows = Tensor::empty({ch.perm.rows(), 1}, weight.dtype(), dev);
    ops::unpermute_rows_backward(weight.reshape({weight.dim(0), weight.dim(1), 1}), ch.perm, rows);
    ch.row_weight = rows.reshape({ch.perm.rows()});
  }
  const int64_t r = ch.xe.dim(0);
  if (!ch.gate_up.defined()) {
    ch.gate_up = Tensor::empty({r, 2 * c.moe_dim}, dt, dev);
    const ops::QuantOperands made{w.gate_up_copies,
                                  rows_arrive_mx(c)      ? &ch.xe
                                  : xe_made.mx.defined() ? &xe_made.mx
                                                         : nullptr,
                                  xe_made.fp8.defined() ? &xe_made.fp8 : nullptr};
    ops::expert_gemm_forward(ch.xe, w.w_gate_up, ch.perm.expert_rows(), prec, ch.gate_up, made);
  }
  if (!ch.act.defined()) {
    ch.act = Tensor::empty({r, c.moe_dim}, dt, dev);
    std::optional<ops::MxValuesOut> mx;
    std::optional<ops::Fp8RowsOut> fp8;
    if (prec.mx_forward_and_input() && fill == FillFor::kForward) {
      ch.act_mx = rows_read ? Tensor::empty(ch.act.shape(), dt, dev) : ch.act;
      mx = ops::MxValuesOut{&ch.act_mx, prec.rule};
    }
    if (prec.fp8_forward_and_input() && fill == FillFor::kForward) {
      ch.act_fp8 = QuantTensor::empty(ch.act.shape(), QuantBlock::kRow128, QuantAxis::kDim0, dev);
      fp8 = ops::Fp8RowsOut{&ch.act_fp8, prec.fp8_scale};
    }
    ops::swiglu_forward(ch.gate_up, ch.act, swiglu_rows(ch), mx ? &*mx : nullptr,
                        fp8 ? &*fp8 : nullptr);
  }
}

}  // namespace

void moe_fill(const MoeWeights& w, const MoeConfig& c, const MoeComms& comms, const Tensor& bias,
              const Tensor& hn, MoeActivations& a, FillFor fill) {
  const Device dev = hn.device();
  Exchanges ex(comms, dev);
  if (!a.routing.expert_index.defined()) {
    if (!a.logits.defined()) {
      a.logits = Tensor::empty({hn.dim(0), c.n_experts}, router_dtype(hn), dev);
      const profile::Phase phase("moe.router_logits");
      if (w.router.dtype() != hn.dtype()) {  // fp32 master weights: the input up-cast
        Tensor hn_up = Tensor::empty(hn.shape(), w.router.dtype(), dev);
        ops::convert(hn, hn_up);
        ops::linear_forward(hn_up, w.router, a.logits);
      } else {
        ops::linear_forward(hn, w.router, a.logits);
      }
    }
    ops::router_forward(a.logits, bias, router_options(c), a.routing);
    a.aux_stats = ops::router_aux_stats(a.routing, a.padding);
    if (comms.batch) {
      comms.batch->all_reduce(a.aux_stats.tokens_per_expert);
      comms.batch->all_reduce(a.aux_stats.score_sum);
    }
    a.aux_loss = ops::router_aux_loss(a.aux_stats);
    make_chunks(c, comms, hn, a, ex);
  }
  for (MoeChunk& ch : a.chunks) {
    // Outputs the exchange's plan made and a checkpointing policy dropped are sent again.
    if (ch.exchange && (!ch.xr.defined() || !ch.wr.defined())) {
      const Tensor rows = ch.rows_of(hn);
      const Tensor weights = ch.rows_of(a.routing.expert_weight);
      ex.join(ex.run([&] {
        if (!ch.xr.defined())
          ch.exchange->dispatch({&rows, &ch.xr, c.expert_precision, &ch.xr_fp8});
        if (!ch.wr.defined()) ch.wr = ch.exchange->dispatch(weights);
      }));
      fp8_rows_arrived(ch, hn.dtype());
    }
    fill_chunk(w, c, a, hn, ch, fill);
  }
}

void moe_combine(const MoeWeights& w, const MoeConfig& c, const MoeComms& comms, MoeActivations& a,
                 Tensor& out, const Tensor* residual) {
  Exchanges ex(comms, out.device());
  for (MoeChunk& ch : a.chunks) {
    Tensor ye = Tensor::empty({ch.act.dim(0), c.dim}, ch.act.dtype(), ch.act.device());
    ops::expert_gemm_forward(ch.act, w.w_down, ch.perm.expert_rows(), c.expert_precision, ye,
                             {w.down_copies, ch.act_mx.defined() ? &ch.act_mx : nullptr,
                              ch.act_fp8.defined() ? &ch.act_fp8 : nullptr});
    ch.act_mx = Tensor();
    ch.act_fp8 = QuantTensor();
    Tensor out_rows = ch.rows_of(out);
    Tensor res_rows = residual ? ch.rows_of(*residual) : Tensor();
    const Tensor* res = residual ? &res_rows : nullptr;
    if (!ch.exchange) {
      ops::combine_forward(ye, ch.perm, out_rows, res);
      continue;
    }
    // Each received token's expert outputs summed here, then one row back per (token, rank).
    Tensor partial = Tensor::empty({ch.xr.dim(0), c.dim}, ye.dtype(), ye.device());
    ops::combine_forward(ye, ch.perm, partial);
    ex.run([&] { ch.exchange->combine(partial, out_rows, res); }, {partial});
  }
}

Tensor moe_backward(const MoeWeights& w, MoeWeights& g, const MoeConfig& c, const MoeComms& comms,
                    const Tensor& hn, const MoeActivations& a, const Tensor& dout, double aux_grad,
                    ops::Accumulate expert_grads) {
  const int64_t n = hn.dim(0);
  const DType dt = hn.dtype();
  const Device dev = hn.device();
  const ops::ExpertPrecision& prec = c.expert_precision;
  const DType wt = a.routing.expert_weight.dtype();
  Tensor dhn = Tensor::empty({n, c.dim}, dt, dev);
  Tensor dweight = Tensor::empty({n, c.top_k}, wt, dev);
  Exchanges ex(comms, dev);
  // The combine's backward: every expert row receives its token's gradient (the routing weights
  // are in the rows' activations). dY travels as the dispatch sends the rows (MX values along the
  // hidden dimension with an MXFP8 dispatch, FP8 rows with an FP8 one): each chunk's on the lane
  // before any expert work, so that the next chunk's crosses while the experts take this one.
  std::vector<TokensHere> dy_here(a.chunks.size());
  std::vector<Lane::Point> dispatched(a.chunks.size());
  for (size_t i = 0; i < a.chunks.size(); ++i) {
    const MoeChunk& ch = a.chunks[i];
    const Tensor rows = ch.rows_of(dout);
    if (!ch.exchange) {
      dy_here[i] = own_tokens(c, rows);
      continue;
    }
    dispatched[i] = ex.run([&] {
      ch.exchange->dispatch({&rows, &dy_here[i].rows, prec, &dy_here[i].fp8});
    });
  }
  for (size_t i = 0; i < a.chunks.size(); ++i) {
    const MoeChunk& ch = a.chunks[i];
    const ops::Accumulate grads = i == 0 ? expert_grads : ops::Accumulate::kYes;
    const int64_t r = ch.xe.dim(0), here = count_tokens_here(ch);
    const ops::ExpertRows rows = ch.perm.expert_rows();
    if (ch.exchange) ex.join(dispatched[i]);
    if (dy_here[i].fp8.defined() && !dy_here[i].rows.defined())
      dy_here[i].rows = fp8_values(dy_here[i].fp8, dt);
    // The input-gradient product takes dY's MX values or FP8 rows, made by the permutation as
    // the forward's rows' are.
    Tensor dye;
    PermutedOperands dye_made = permute_expert_rows(c, ch, dy_here[i], dye, RowReaders::kBoth);
    dy_here[i] = {};
    Tensor dact = Tensor::empty({r, c.moe_dim}, dt, dev);
    ops::expert_gemm_backward_input(dye, w.w_down, rows, prec, dact,
                                    {w.down_copies, dye_made.mx.defined() ? &dye_made.mx : nullptr,
                                     dye_made.fp8.defined() ? &dye_made.fp8 : nullptr});
    dye_made = {};

    Tensor dgate_up = Tensor::empty({r, 2 * c.moe_dim}, dt, dev);
    Tensor drow_weight = Tensor::empty({r, 1}, ch.row_weight.dtype(), dev);
    Tensor drow_weight_flat = drow_weight.reshape({r});
    Tensor dgate_up_mx;
    QuantTensor dgate_up_fp8;  // the gate|up input gradient's operand, written by SwiGLU
    std::optional<ops::MxValuesOut> dgate_up_values;
    std::optional<ops::Fp8RowsOut> dgate_up_rows;
    if (prec.mx_forward_and_input()) {
      dgate_up_mx = Tensor::empty(dgate_up.shape(), dt, dev);
      dgate_up_values = ops::MxValuesOut{&dgate_up_mx, prec.rule};
    }
    if (prec.fp8_forward_and_input()) {
      dgate_up_fp8 =
          QuantTensor::empty(dgate_up.shape(), QuantBlock::kRow128, QuantAxis::kDim0, dev);
      dgate_up_rows = ops::Fp8RowsOut{&dgate_up_fp8, prec.fp8_scale};
    }
    ops::swiglu_backward(ch.gate_up, dact, dgate_up, swiglu_rows(ch), &drow_weight_flat,
                         dgate_up_values ? &*dgate_up_values : nullptr,
                         dgate_up_rows ? &*dgate_up_rows : nullptr);
    // The routing weights' gradient, back from the expert rows to the choices; with EP a
    // choice's gradient comes from its expert's rank, zeros from the others.
    Tensor dweight_rows = ch.rows_of(dweight);
    Tensor dweight_here = ch.exchange ? Tensor::empty({here, c.top_k}, wt, dev) : dweight_rows;
    Tensor dweight_3d = dweight_here.reshape({here, c.top_k, 1});
    ops::unpermute_rows(drow_weight, ch.perm, dweight_3d);
    Tensor dxe = Tensor::empty({r, c.dim}, dt, dev);
    ops::expert_gemm_backward_input(
        dgate_up, w.w_gate_up, rows, prec, dxe,
        {w.gate_up_copies, dgate_up_mx.defined() ? &dgate_up_mx : nullptr,
         dgate_up_fp8.defined() ? &dgate_up_fp8 : nullptr});
    dgate_up_mx = Tensor();
    dgate_up_fp8 = QuantTensor();

    // The dispatch's backward: each token's rows summed where they are, then across the ranks,
    // with the routing weights' gradient in the same exchange, which crosses (on the lane) while
    // the experts' weight gradients, which nothing waits for here, are computed.
    Tensor dhn_rows = ch.rows_of(dhn);
    Tensor dx_here = ch.exchange ? Tensor::empty({here, c.dim}, dt, dev) : dhn_rows;
    ops::permute_rows_backward(dxe, ch.perm, dx_here);
    dxe = Tensor();
    if (ch.exchange)
      ex.run(
          [&] {
            ch.exchange->combine({{&dweight_here, &dweight_rows}, {&dx_here, &dhn_rows}});
          },
          {dweight_here, dx_here});
    tap_expert_operands("down", ch.act, dye, w.w_down, rows);
    ops::expert_gemm_backward_weight(ch.act, dye, rows, prec, g.w_down, grads);
    tap_expert_operands("gate_up", ch.xe, dgate_up, w.w_gate_up, rows);
    ops::expert_gemm_backward_weight(ch.xe, dgate_up, rows, prec, g.w_gate_up, grads);
  }
  ex.join_all();

  Tensor dlogits = Tensor::empty({n, c.n_experts}, a.routing.scores.dtype(), dev);
  ops::router_backward(a.routing, router_options(c), a.aux_stats, a.padding, dweight, aux_grad,
                       dlogits);
  if (w.router.dtype() != hn.dtype()) {
    // fp32 master weights (mixed precision): the router's GEMMs in fp32 on the up-cast input,
    // its input gradient added to the experts' in fp32 and rounded once.
    MT_CHECK(dlogits.dtype() == w.router.dtype(), "router logits gradient {} for {} weights",
             dtype_name(dlogits.dtype()), dtype_name(w.router.dtype()));
    Tensor hn_up = Tensor::empty(hn.shape(), w.router.dtype(), dev);
    Tensor dhn_up = Tensor::empty(hn.shape(), w.router.dtype(), dev);
    ops::convert(hn, hn_up);
    ops::convert(dhn, dhn_up);
    ops::linear_backward(hn_up, w.router, dlogits, dhn_up, g.router, ops::Accumulate::kYes);
    ops::convert(dhn_up, dhn);
    return dhn;
  }
  if (dlogits.dtype() != w.router.dtype()) {  // f32 routing math, GEMM operands in the weights'
    Tensor cast = Tensor::empty(dlogits.shape(), w.router.dtype(), dev);
    ops::convert(dlogits, cast);
    dlogits = cast;
  }
  ops::linear_backward(hn, w.router, dlogits, dhn, g.router, ops::Accumulate::kYes);
  return dhn;
}

}  // namespace mt::moe
