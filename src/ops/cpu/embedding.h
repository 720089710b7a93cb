// The embedding CPU reference (embedding.cpp), called by ops/embedding.h's front door once it has
// checked the arguments.
#pragma once
#include "core/tensor.h"

namespace mt::ops::cpu {

void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out);
void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable);

}  // namespace mt::ops::cpu
