#include "moe/moe_layer.h"

#include <optional>

#include "core/profile.h"
#include "ops/activation.h"
#include "ops/elementwise.h"
#include "ops/expert_gemm.h"
#include "ops/gemm.h"

namespace mt::moe {

ops::RouterOptions router_options(const MoeConfig& c) {
  return {static_cast<int>(c.top_k), c.norm_topk_prob, c.routing};
}

namespace {
WeightGradientTap& weight_gradient_tap() {
  static WeightGradientTap tap;
  return tap;
}

void tap_weight_gradient(std::string_view product, const Tensor& x, const Tensor& dy,
                         const ops::ExpertRows& rows) {
  if (const WeightGradientTap& tap = weight_gradient_tap()) tap(product, x, dy, rows);
}

// Routing math (logits, softmax, weights) runs in f32 at least: on the GPU the router GEMM reads
// the fp32 master weights (ParamSpec::master_weight) and the up-cast input and writes f32
// logits; the CPU reference keeps its compute dtype (f32 or f64).
DType router_dtype(const Tensor& hn) {
  return hn.device() == Device::kCUDA ? DType::kF32 : hn.dtype();
}

// The padding marks of the expert rows (ops::swiglu_forward): the permutation's, when its layout
// is padded.
const Tensor* padding_marks(const MoeActivations& a) {
  return a.perm.align > 1 ? &a.perm.source_token : nullptr;
}

// What SwiGLU needs of the expert rows: their padding marks and routing weights.
ops::SwigluRows swiglu_rows(const MoeActivations& a) {
  return {padding_marks(a), &a.row_weight};
}

// The tokens the experts here take their rows from, and their routing weights (N, k): this
// rank's own, or with EP the ones received.
const Tensor& tokens_here(const MoeActivations& a, const Tensor& hn) {
  return a.exchange ? a.xr : hn;
}
const Tensor& weights_here(const MoeActivations& a) {
  return a.exchange ? a.wr : a.routing.expert_weight;
}

// Whether the rows reach the experts as MX values along the hidden dimension (an MXFP8 dispatch:
// with EP the wire made them, with ep 1 the permutation does, once): the forward product then
// takes them as they are.
bool rows_arrive_mx(const MoeConfig& c) {
  return c.expert_precision.dispatch == ops::DispatchDtype::kMxfp8;
}

// What reads a permutation's expert rows: the weight gradient (the rows themselves), the MX
// product (their MX values), or both.
enum class RowReaders : uint8_t { kWeightGradient, kProduct, kBoth };

// Permutes `tokens` into the expert rows `rows` (allocated here) and returns what an MX product
// reading them multiplies: under an MX recipe their MX values along the hidden dimension, made by
// the permutation: in place when the rows arrive as MX values (with ep 1 the permutation rounds
// them, once; with EP the wire did) or when only the product reads them, else beside them;
// undefined when no MX product reads them.
Tensor permute_expert_rows(const MoeConfig& c, const MoeActivations& a, const Tensor& tokens,
                           Tensor& rows, RowReaders readers) {
  const ops::ExpertPrecision& p = c.expert_precision;
  const bool product = p.mx_forward_and_input() && readers != RowReaders::kWeightGradient;
  rows = Tensor::empty({a.perm.rows(), c.dim}, tokens.dtype(), tokens.device());
  Tensor values;
  if (rows_arrive_mx(c) || (product && readers == RowReaders::kProduct))
    values = rows;
  else if (product)
    values = Tensor::empty(rows.shape(), rows.dtype(), rows.device());
  const bool make = values.defined() && !(rows_arrive_mx(c) && a.exchange);
  const ops::MxValuesOut mx{&values, p.rule};
  ops::permute_rows(tokens, a.perm, rows, make ? &mx : nullptr);
  return product ? values : Tensor();
}

// On the GPU every expert's rows start on a 128-row boundary: the forward and input-gradient
// GEMMs then run whole row tiles per expert with one TMA descriptor per operand
// (ops/grouped_gemm.h), at the price of up to 127 rows of padding per expert.
int64_t segment_align(const MoeConfig& c, const Tensor& hn) {
  return c.pad_expert_rows && hn.device() == Device::kCUDA ? 128 : 1;
}
}  // namespace

void set_weight_gradient_tap(WeightGradientTap tap) {
  weight_gradient_tap() = std::move(tap);
}

void moe_fill(const MoeWeights& w, const MoeConfig& c, const MoeComms& comms, const Tensor& bias,
              const Tensor& hn, MoeActivations& a, FillFor fill) {
  const DType dt = hn.dtype();
  const Device dev = hn.device();
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
    a.aux_stats = ops::router_aux_stats(a.routing);
    if (comms.batch) {
      comms.batch->all_reduce(a.aux_stats.tokens_per_expert);
      comms.batch->all_reduce(a.aux_stats.score_sum);
      // Every rank's micro-batch holds the same number of tokens (a packed batch: rows x
      // seq_len), so the batch's count needs no collective: a host tensor's all-reduce would
      // wait for the device, which a captured pass cannot.
      a.aux_stats.tokens.data<int64_t>()[0] *= comms.batch->size();
    }
    a.aux_loss = ops::router_aux_loss(a.aux_stats);
    if (comms.ep) {
      // The plan dispatches the tokens and their routing weights with their choices.
      std::vector<DispatchRows> with;
      if (!a.xr.defined()) with.push_back({&hn, &a.xr, c.expert_precision});
      if (!a.wr.defined()) with.push_back({&a.routing.expert_weight, &a.wr});
      a.exchange = std::make_shared<ExpertExchange>(*comms.ep, a.routing.expert_index, c.n_experts,
                                                    comms.exchange, with);
      ops::make_expert_permutation(a.exchange->local_index(), c.n_experts / comms.ep->size(),
                                   a.perm, segment_align(c, hn), a.exchange->local_rows());
    } else {
      ops::make_expert_permutation(a.routing.expert_index, c.n_experts, a.perm,
                                   segment_align(c, hn));
    }
  }
  if (a.exchange && !a.xr.defined()) a.xr = a.exchange->dispatch(hn, c.expert_precision);
  if (a.exchange && !a.wr.defined()) a.wr = a.exchange->dispatch(a.routing.expert_weight);
  const ops::ExpertPrecision& prec = c.expert_precision;
  // Whether anything past the forward's products reads the rows and SwiGLU output made here: a
  // backward fill's are its own; a forward's are read by the backward unless it makes them again.
  const bool rows_read = fill == FillFor::kBackward || c.forward_rows == ForwardRows::kKept;
  // The forward product's rows: their MX values under an MX recipe, when it runs in this fill.
  Tensor xe_mx;
  if (!a.xe.defined())
    xe_mx = permute_expert_rows(c, a, tokens_here(a, hn), a.xe,
                                a.gate_up.defined() ? RowReaders::kWeightGradient
                                : rows_read         ? RowReaders::kBoth
                                                    : RowReaders::kProduct);
  if (!a.row_weight.defined()) {
    // Each choice's routing weight moved to its expert row: the scatter (Rt, k, 1) -> (R, 1) that
    // is unpermute_rows' backward.
    const Tensor& weight = weights_here(a);
    Tensor rows = Tensor::empty({a.perm.rows(), 1}, weight.dtype(), dev);
    ops::unpermute_rows_backward(weight.reshape({weight.dim(0), weight.dim(1), 1}), a.perm, rows);
    a.row_weight = rows.reshape({a.perm.rows()});
  }
  const int64_t r = a.xe.dim(0);
  if (!a.gate_up.defined()) {
    a.gate_up = Tensor::empty({r, 2 * c.moe_dim}, dt, dev);
    const ops::MxOperands made{w.gate_up_mx, rows_arrive_mx(c) ? &a.xe
                                             : xe_mx.defined() ? &xe_mx
                                                               : nullptr};
    ops::expert_gemm_forward(a.xe, w.w_gate_up, a.perm.expert_rows(), prec, a.gate_up, made);
  }
  if (!a.act.defined()) {
    a.act = Tensor::empty({r, c.moe_dim}, dt, dev);
    std::optional<ops::MxValuesOut> mx;
    if (prec.mx_forward_and_input() && fill == FillFor::kForward) {
      a.act_mx = rows_read ? Tensor::empty(a.act.shape(), dt, dev) : a.act;
      mx = ops::MxValuesOut{&a.act_mx, prec.rule};
    }
    ops::swiglu_forward(a.gate_up, a.act, swiglu_rows(a), mx ? &*mx : nullptr);
  }
}

void moe_combine(const MoeWeights& w, const MoeConfig& c, MoeActivations& a, Tensor& out,
                 const Tensor* residual) {
  Tensor ye = Tensor::empty({a.act.dim(0), c.dim}, a.act.dtype(), a.act.device());
  ops::expert_gemm_forward(a.act, w.w_down, a.perm.expert_rows(), c.expert_precision, ye,
                           {w.down_mx, a.act_mx.defined() ? &a.act_mx : nullptr});
  a.act_mx = Tensor();
  if (!a.exchange) return ops::combine_forward(ye, a.perm, out, residual);
  // Each received token's expert outputs summed here, then one row back per (token, rank).
  Tensor partial = Tensor::empty({a.xr.dim(0), c.dim}, ye.dtype(), ye.device());
  ops::combine_forward(ye, a.perm, partial);
  a.exchange->combine(partial, out, residual);
}

Tensor moe_backward(const MoeWeights& w, MoeWeights& g, const MoeConfig& c, const Tensor& hn,
                    const MoeActivations& a, const Tensor& dout, double aux_grad,
                    ops::Accumulate expert_grads) {
  const int64_t n = hn.dim(0), r = a.xe.dim(0), here = tokens_here(a, hn).dim(0);
  const DType dt = hn.dtype();
  const Device dev = hn.device();
  const ops::ExpertRows rows = a.perm.expert_rows();
  // The combine's backward: every expert row receives its token's gradient (the routing weights
  // are in the rows' activations). dY travels as the dispatch sends the rows (MX values along the
  // hidden dimension with an MXFP8 dispatch); the input-gradient product takes its MX values,
  // made by the permutation as the forward's rows' are.
  const ops::ExpertPrecision& prec = c.expert_precision;
  const Tensor dy_here = a.exchange ? a.exchange->dispatch(dout, prec) : dout;
  Tensor dye;
  Tensor dye_mx = permute_expert_rows(c, a, dy_here, dye, RowReaders::kBoth);
  Tensor dact = Tensor::empty({r, c.moe_dim}, dt, dev);
  ops::expert_gemm_backward_input(dye, w.w_down, rows, prec, dact,
                                  {w.down_mx, dye_mx.defined() ? &dye_mx : nullptr});
  dye_mx = Tensor();
  tap_weight_gradient("down", a.act, dye, rows);
  ops::expert_gemm_backward_weight(a.act, dye, rows, c.expert_precision, g.w_down, expert_grads);

  Tensor dgate_up = Tensor::empty({r, 2 * c.moe_dim}, dt, dev);
  Tensor drow_weight = Tensor::empty({r, 1}, a.row_weight.dtype(), dev);
  Tensor drow_weight_flat = drow_weight.reshape({r});
  Tensor dgate_up_mx;
  std::optional<ops::MxValuesOut> dgate_up_values;
  if (prec.mx_forward_and_input()) {
    dgate_up_mx = Tensor::empty(dgate_up.shape(), dt, dev);
    dgate_up_values = ops::MxValuesOut{&dgate_up_mx, prec.rule};
  }
  ops::swiglu_backward(a.gate_up, dact, dgate_up, swiglu_rows(a), &drow_weight_flat,
                       dgate_up_values ? &*dgate_up_values : nullptr);
  // The routing weights' gradient, back from the expert rows to the choices (N, k); with EP a
  // choice's gradient comes from its expert's rank, zeros from the others.
  const DType wt = a.routing.expert_weight.dtype();
  Tensor dweight = Tensor::empty({n, c.top_k}, wt, dev);
  Tensor dweight_here = a.exchange ? Tensor::empty({here, c.top_k}, wt, dev) : dweight;
  Tensor dweight_rows = dweight_here.reshape({here, c.top_k, 1});
  ops::unpermute_rows(drow_weight, a.perm, dweight_rows);
  Tensor dxe = Tensor::empty({r, c.dim}, dt, dev);
  ops::expert_gemm_backward_input(dgate_up, w.w_gate_up, rows, prec, dxe,
                                  {w.gate_up_mx, dgate_up_mx.defined() ? &dgate_up_mx : nullptr});
  dgate_up_mx = Tensor();
  tap_weight_gradient("gate_up", a.xe, dgate_up, rows);
  ops::expert_gemm_backward_weight(a.xe, dgate_up, rows, c.expert_precision, g.w_gate_up,
                                   expert_grads);

  // The dispatch's backward: each token's rows summed where they are, then across the ranks,
  // with the routing weights' gradient in the same exchange.
  Tensor dhn = Tensor::empty({n, c.dim}, dt, dev);
  Tensor dx_here = a.exchange ? Tensor::empty({here, c.dim}, dt, dev) : dhn;
  ops::permute_rows_backward(dxe, a.perm, dx_here);
  if (a.exchange) a.exchange->combine({{&dweight_here, &dweight}, {&dx_here, &dhn}});

  Tensor dlogits = Tensor::empty({n, c.n_experts}, a.routing.scores.dtype(), dev);
  ops::router_backward(a.routing, router_options(c), a.aux_stats, dweight, aux_grad, dlogits);
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
