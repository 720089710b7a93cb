// What every Tensor-level CUDA wrapper (ops.cpp, moe_ops.cpp, gemm.cpp, cudnn/) needs of its
// operands: the kernels' storage type of a GPU tensor, and device scratch from the caching
// allocator (after the first step it never reaches cudaMalloc).
#pragma once
#include "core/tensor.h"
#include "ops/cuda/kernels.h"

namespace mt::cuda {

inline DType storage_of(const Tensor& t, const char* name = "operand") {
  MT_CHECK(t.device() == Device::kCUDA, "{} must be on the GPU", name);
  MT_CHECK(dtype_info(t.dtype()).kernel_storage, "{} must be f32 or bf16 on the GPU, got {}", name,
           dtype_name(t.dtype()));
  return t.dtype();
}

inline Tensor gpu_empty(const Shape& s, DType d) {
  return Tensor::empty(s, d, Device::kCUDA);
}

// t itself when it is on the GPU, else a device copy (statistics a caller may hold on the host).
inline Tensor on_device(const Tensor& t) {
  return t.device() == Device::kCUDA ? t : t.to(Device::kCUDA);
}

}  // namespace mt::cuda
