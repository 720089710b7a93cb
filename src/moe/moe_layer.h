// The MoE feed-forward of one block on a single rank: router -> expert-major permutation ->
// grouped SwiGLU experts -> weighted combine. Expert parallelism (src/dist) splits the same
// stages across ranks.
#pragma once
#include "core/tensor.h"
#include "model/config.h"
#include "ops/permute.h"
#include "ops/route.h"

namespace mt::moe {

struct MoeWeights {
  Tensor router;     // (D, E), the router's logits are hn @ router
  Tensor w_gate_up;  // (E, D, 2F), gate columns first
  Tensor w_down;     // (E, F, D)
};

// What the forward leaves for the backward. A field left undefined is recomputed by moe_fill.
struct MoeActivations {
  Tensor logits;                  // (N, E)       GEMM output
  ops::Routing routing;           // scores, choices, weights, counts
  ops::ExpertPermutation perm;    // expert-major layout
  Tensor xp;                      // (N*k, D)     permuted input rows (a gather)
  Tensor gate_up;                 // (N*k, 2F)    GEMM output
  Tensor act;                     // (N*k, F)     SwiGLU (elementwise)
  Tensor y;                       // (N*k, D)     GEMM output
  double aux_loss = 0;            // per-layer load-balancing loss (without coefficient)
};

ops::RouterOptions router_options(const ModelConfig& c);

// Computes every undefined field of `a` from hn (N, D). bias: (E) or undefined.
void moe_fill(const MoeWeights& w, const ModelConfig& c, const Tensor& bias, const Tensor& hn,
              MoeActivations& a);
// out (N, D) = combine of the expert outputs; requires a filled `a`.
void moe_combine(const MoeActivations& a, Tensor& out);
// Returns d hn (N, D); weight gradients accumulate into g. aux_grad = d(total) / d(aux_loss).
Tensor moe_backward(const MoeWeights& w, MoeWeights& g, const ModelConfig& c, const Tensor& hn,
                    const MoeActivations& a, const Tensor& dout, double aux_grad);

}  // namespace mt::moe
