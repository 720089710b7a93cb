// The rotary-embedding CPU reference (rope.cpp), called by ops/rope.h's front door once it has
// checked the arguments.
#pragma once
#include "core/tensor.h"

namespace mt::ops::cpu {

// direction +1 rotates forward, -1 applies the transpose (the backward).
void rope_apply(const Tensor& x, const Tensor& positions, double theta, int direction, Tensor& y);

}  // namespace mt::ops::cpu
