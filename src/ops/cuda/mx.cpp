// Tensor-level wrappers of the MX kernels (mx.cu); shapes and dtypes are checked by ops/mx.h.
#include <cstdint>

#include "core/cuda/check.h"
#include "core/profile.h"
#include "ops/cuda/kernels.h"
#include "ops/cuda/operands.h"
#include "ops/cuda/ops.h"

namespace mt::cuda {

namespace {

struct Matrices {  // the logical shape as (batch, rows, cols)
  int64_t batch, rows, cols;
};

Matrices matrices_of(const Shape& s) {
  const int64_t rows = s[s.size() - 2], cols = s[s.size() - 1];
  return {rows * cols == 0 ? 0 : shape_numel(s) / (rows * cols), rows, cols};
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// The kernels move 16 bytes at a time through the unquantized side; along dim1 they also step
// down its rows, which must keep that alignment.
void check_readable(const char* op, const Tensor& t, MxAxis axis) {
  const Matrices m = matrices_of(t.shape());
  MT_CHECK(aligned16(t.raw()), "{} on the GPU needs a 16-byte aligned tensor", op);
  MT_CHECK(axis == MxAxis::kDim0 || (m.cols * dtype_size(t.dtype())) % 16 == 0,
           "{} along dim1 on the GPU needs rows of a multiple of 16 bytes; {} has {} {} columns",
           op, shape_str(t.shape()), m.cols, dtype_name(t.dtype()));
}

}  // namespace

void mx_quantize(const Tensor& x, MxScaleRule rule, MxTensor& out) {
  const profile::Phase phase("gpu.mx_quantize");
  const DType in = storage_of(x, "mx_quantize input");
  const Matrices m = matrices_of(x.shape());
  check_readable("mx_quantize", x, out.axis());
  MT_CUDA_CHECK(kernels::mx_quantize(in, x.raw(), out.axis(), rule, m.batch, m.rows, m.cols,
                                     static_cast<uint8_t*>(out.data().raw()),
                                     static_cast<uint8_t*>(out.scales().raw()), stream()));
}

void mx_dequantize(const MxTensor& q, Tensor& out) {
  const profile::Phase phase("gpu.mx_dequantize");
  const DType dt = storage_of(out, "mx_dequantize output");
  const Matrices m = matrices_of(q.shape());
  check_readable("mx_dequantize", out, q.axis());
  MT_CUDA_CHECK(kernels::mx_dequantize(dt, static_cast<const uint8_t*>(q.data().raw()),
                                       static_cast<const uint8_t*>(q.scales().raw()), q.axis(),
                                       m.batch, m.rows, m.cols, out.raw(), stream()));
}

void mx_round_trip(const Tensor& x, MxAxis axis, MxScaleRule rule, Tensor& out) {
  const profile::Phase phase("gpu.mx_round_trip");
  const DType in = storage_of(x, "mx_round_trip input");
  const DType dt = storage_of(out, "mx_round_trip output");
  const Matrices m = matrices_of(x.shape());
  check_readable("mx_round_trip", x, axis);
  check_readable("mx_round_trip", out, MxAxis::kDim0);
  MT_CUDA_CHECK(kernels::mx_round_trip(in, x.raw(), axis, rule, m.batch, m.rows, m.cols, dt,
                                       out.raw(), stream()));
}

void mx_round_trip_both_axes(const Tensor& x, MxScaleRule rule, Tensor& dim0, Tensor& transposed) {
  const profile::Phase phase("gpu.mx_round_trip_both_axes");
  const DType in = storage_of(x, "mx_round_trip_both_axes input");
  const DType dt = storage_of(dim0, "mx_round_trip_both_axes output");
  const Matrices m = matrices_of(x.shape());
  check_readable("mx_round_trip_both_axes", x, MxAxis::kDim1);
  check_readable("mx_round_trip_both_axes", dim0, MxAxis::kDim0);
  check_readable("mx_round_trip_both_axes", transposed, MxAxis::kDim0);
  MT_CUDA_CHECK(kernels::mx_round_trip_both_axes(in, x.raw(), rule, m.batch, m.rows, m.cols, dt,
                                                 dim0.raw(), transposed.raw(), stream()));
}

void mx_round_trip_expert_rows(const Tensor& x, const ops::ExpertRows& rows, MxScaleRule rule,
                               Tensor& out) {
  const profile::Phase phase("gpu.mx_round_trip_expert_rows");
  const DType dt = storage_of(x, "mx_round_trip_expert_rows input");
  const int64_t experts = rows.offsets.numel() - 1;
  for (const Tensor* t : {&rows.offsets, &rows.segments}) {
    expect_dtype(*t, DType::kI64, "expert rows");
    MT_CHECK(t->device() == Device::kCUDA && t->numel() == experts + 1,
             "expert offsets and segments must be {} i64 on the GPU", experts + 1);
  }
  Tensor prefix = gpu_empty({experts + 1}, DType::kI64);
  MT_CUDA_CHECK(kernels::mx_round_trip_expert_rows(
      dt, x.raw(), x.dim(0), x.dim(1),
      {rows.offsets.data<int64_t>(), rows.segments.data<int64_t>()}, static_cast<int>(experts),
      prefix.data<int64_t>(), rule, out.raw(), stream()));
}

}  // namespace mt::cuda
