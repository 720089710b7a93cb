// What the front doors (ops/<family>.cpp) need of a GPU branch's
// operands: the kernels' storage type of a GPU tensor, and device scratch from the caching
// allocator (after the first step it never reaches cudaMalloc).
#pragma once
#include "core/cuda/check.h"
#include "core/profile.h"
#include "core/tensor.h"
#include "ops/cuda/fp8.h"
#include "ops/cuda/mx.h"
#include "ops/cuda/permute.h"
#include "ops/fp8.h"
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

// A shape of at least two dims as (batch, rows, cols): the matrices of its last two dims.
struct Matrices {
  int64_t batch, rows, cols;
};
inline Matrices matrices_of(const Shape& s) {
  const int64_t rows = s[s.size() - 2], cols = s[s.size() - 1];
  return {rows * cols == 0 ? 0 : shape_numel(s) / (rows * cols), rows, cols};
}

inline Tensor gpu_empty(const Shape& s, DType d) {
  return Tensor::empty(s, d, Device::kCUDA);
}

// A kernel's device scratch of `bytes`.
inline Tensor gpu_workspace(size_t bytes) {
  return gpu_empty({static_cast<int64_t>(bytes)}, DType::kU8);
}

// Where the experts' rows are, as the kernels read it (the layout's tensors on the GPU).
inline kernels::ExpertSegments device_segments(const ops::ExpertRows& rows) {
  return {rows.offsets.data<int64_t>(), rows.segments.data<int64_t>()};
}

// t itself when it is on the GPU, else a device copy (statistics a caller may hold on the host).
inline Tensor on_device(const Tensor& t) {
  return t.device() == Device::kCUDA ? t : t.to(Device::kCUDA);
}

// dst[i] = src[index[i]] (a zero row for a negative index; i32 index on the GPU), rows moved as
// 2- or 4-byte units whatever their dtype: the embedding's lookup and the unpermutation.
inline void gather_rows(const Tensor& src, const Tensor& index, Tensor& dst) {
  const profile::Phase phase("gpu.gather_rows");
  MT_CHECK(src.dtype() == dst.dtype(), "gather of {} rows into {}", dtype_name(src.dtype()),
           dtype_name(dst.dtype()));
  const CopyUnits u = copy_units(src, dst.dim(1));
  MT_CUDA_CHECK(kernels::gather_rows(u.storage, src.raw(), index.data<int32_t>(), dst.raw(),
                                     dst.dim(0), u.per_row, stream()));
}

// The MX values a row writer's kernel writes beside its rows of `width` elements of `storage`
// (ops::MxValuesOut, nullable): mx when the kernel can fuse them (kernels::can_fuse_mx_values
// over the rows' pointers and mx's own), else none, and the front door then runs
// ops::write_mx_values after the kernel.
inline kernels::MxValuesOut fused_mx_values(const ops::MxValuesOut* mx, DType storage,
                                            int64_t width,
                                            std::initializer_list<const void*> row_pointers) {
  const kernels::MxValuesOut none = kernels::kNoMxValues;
  if (!mx) return none;
  for (const void* p : row_pointers)
    if (!kernels::can_fuse_mx_values(storage, width, {p})) return none;
  if (!kernels::can_fuse_mx_values(storage, width, {mx->values->raw()})) return none;
  return {mx->values->raw(), mx->rule};
}

// Runs a kernel that can write an output's FP8 rows (ops::Fp8RowsOut), launch(rows) taking them as
// the kernels do (data null: none) and returning its cudaError_t: with fp8's rows fused where the
// kernel can, else (cudaErrorNotSupported, nothing launched) without them and then the second
// step, write_fp8_rows of out.
template <class Launch>
void launch_with_fp8_rows(const ops::Fp8RowsOut* fp8, const Tensor& out, Launch&& launch) {
  if (fp8) {
    const cudaError_t err =
        launch(kernels::Fp8RowsOut{static_cast<uint8_t*>(fp8->rows->data().raw()),
                                   fp8->rows->scales().data<float>(), fp8->rule});
    if (err != cudaErrorNotSupported) {
      MT_CUDA_CHECK(err);
      return;
    }
  }
  MT_CUDA_CHECK(launch(kernels::kNoFp8Rows));
  if (fp8) ops::write_fp8_rows(out, *fp8);
}

}  // namespace mt::cuda
