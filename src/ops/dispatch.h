// Dtype dispatch for the CPU reference (ops/cpu/): the loops are templates over the compute type,
// instantiated for exactly two types (fp32 for training, fp64 for gradient checks); and the device
// choice of the front doors.
#pragma once
#include "core/tensor.h"

namespace mt::ops {

template <class F>
void dispatch_float(DType t, F&& f) {
  switch (t) {
    case DType::kF32:
      f(float{});
      break;
    case DType::kF64:
      f(double{});
      break;
    default:
      MT_CHECK(false, "op needs f32 or f64, got {}", dtype_name(t));
  }
}

// True when the op's tensors are on the GPU: the front door (ops/<family>.cpp) then launches its
// kernels (ops/cuda/<family>.h). A build without CUDA refuses GPU tensors at allocation already.
inline bool on_gpu(const Tensor& t) {
#if MOETRAIN_HAS_CUDA
  return t.device() == Device::kCUDA;
#else
  (void)t;
  return false;
#endif
}

}  // namespace mt::ops
