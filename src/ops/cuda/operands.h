// What every Tensor-level CUDA wrapper (ops/cuda/<family>.cpp, cudnn/) needs of its
// operands: the kernels' storage type of a GPU tensor, and device scratch from the caching
// allocator (after the first step it never reaches cudaMalloc).
#pragma once
#include "core/cuda/check.h"
#include "core/tensor.h"
#include "ops/cuda/kernels.h"
#include "ops/mx.h"

namespace mt::cuda {

inline DType storage_of(const Tensor& t, const char* name = "operand") {
  MT_CHECK(t.device() == Device::kCUDA, "{} must be on the GPU", name);
  MT_CHECK(dtype_info(t.dtype()).kernel_storage, "{} must be f32 or bf16 on the GPU, got {}", name,
           dtype_name(t.dtype()));
  return t.dtype();
}

// How rows of `width` elements of t move unchanged through the row kernels: as f32 or bf16 bits
// (4- or 2-byte units), 1-byte dtypes (MX data and scales) in groups of 4 or 2 of a row.
struct CopyUnits {
  DType storage;
  int64_t per_row;
};
inline CopyUnits copy_units(const Tensor& t, int64_t width) {
  MT_CHECK(t.device() == Device::kCUDA, "rows must be on the GPU");
  const int64_t bytes = width * static_cast<int64_t>(dtype_size(t.dtype()));
  if (bytes % 4 == 0) return {DType::kF32, bytes / 4};
  MT_CHECK(bytes % 2 == 0, "rows of {} x {} ({} bytes) cannot be moved on the GPU (even bytes)",
           width, dtype_name(t.dtype()), bytes);
  return {DType::kBF16, bytes / 2};
}

// a and b have the same dtype, b on the GPU (an output beside its input).
inline void same_storage_type(const Tensor& a, const Tensor& b, const char* name) {
  MT_CHECK(a.dtype() == b.dtype() && b.device() == Device::kCUDA,
           "{} is {} on {}, expected {} on the GPU", name, dtype_name(b.dtype()),
           b.device() == Device::kCUDA ? "the GPU" : "the CPU", dtype_name(a.dtype()));
}

inline Tensor gpu_empty(const Shape& s, DType d) {
  return Tensor::empty(s, d, Device::kCUDA);
}

// t itself when it is on the GPU, else a device copy (statistics a caller may hold on the host).
inline Tensor on_device(const Tensor& t) {
  return t.device() == Device::kCUDA ? t : t.to(Device::kCUDA);
}

// The kernels' view of an ops::MxValuesOut (null: none).
inline kernels::MxValuesOut mx_values_out(const ops::MxValuesOut* mx) {
  return mx ? kernels::MxValuesOut{mx->values->raw(), mx->rule}
            : kernels::MxValuesOut{nullptr, MxScaleRule::kRceil};
}

// A row writer's launch with mx (ops::MxValuesOut, nullable): whether its kernel wrote the MX
// values. A kernel that cannot fuse them returns cudaErrorNotSupported, launching nothing: then
// `launch(nullptr)` writes the output alone and the caller runs ops::write_mx_values.
template <class Launch>
bool launch_row_writer(const ops::MxValuesOut* mx, Launch&& launch) {
  const cudaError_t err = launch(mx);
  if (mx && err == cudaErrorNotSupported) {
    MT_CUDA_CHECK(launch(nullptr));
    return false;
  }
  MT_CUDA_CHECK(err);
  return mx != nullptr;
}

}  // namespace mt::cuda
