// The attention CPU reference (attention.cpp), called by ops/attention.h's front door once it has
// checked the shapes and the documents' boundaries.
#pragma once
#include "core/tensor.h"
#include "ops/attention.h"

namespace mt::ops::cpu {

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Documents& docs,
                       double scale, Tensor& out, Tensor& lse);
void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                        const Tensor& lse, const Tensor& dout, const Documents& docs, double scale,
                        Tensor& dq, Tensor& dk, Tensor& dv);

// Context-parallel rows (ops/attention.h): the queries at `rows` of the whole row.
void attention_forward_rows(const Tensor& q, const int32_t* rows, const Tensor& k, const Tensor& v,
                            const Documents& docs, double scale, Tensor& out, Tensor& lse);
void attention_backward_rows(const Tensor& q, const int32_t* rows, const Tensor& k, const Tensor& v,
                             const Tensor& out, const Tensor& lse, const Tensor& dout,
                             const Documents& docs, double scale, Tensor& dq, Tensor& dk,
                             Tensor& dv);

}  // namespace mt::ops::cpu
