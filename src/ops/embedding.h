#pragma once
#include "core/tensor.h"

namespace mt::ops {

// out (N, D) = table (V, D) rows at ids (N), i32.
void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out);
// dtable (V, D) accumulates dout rows (N, D) at ids.
void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable);

}  // namespace mt::ops
