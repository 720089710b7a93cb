// The router's CPU reference (route.cpp), called by ops/route.h's front door once it has checked
// the arguments.
#pragma once
#include "core/tensor.h"
#include "ops/route.h"

namespace mt::ops::cpu {

void router_forward(const Tensor& logits, const Tensor& bias, const RouterOptions& opt,
                    Routing& out);
AuxStats router_aux_stats(const Routing& r, const Tensor& padding);
void add_aux_stats(const AuxStats& layer, AuxStats& pooled);
Tensor router_aux_loss(const AuxStats& s);
void router_backward(const Routing& r, const RouterOptions& opt, const AuxStats& stats,
                     const Tensor& padding, const Tensor& dweight, double aux_grad,
                     Tensor& dlogits);

}  // namespace mt::ops::cpu
