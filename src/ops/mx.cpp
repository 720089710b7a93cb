// The MX conversions' front door (ops/mx.h): the arguments checked once, then the CPU reference
// (ops/cpu/mx.cpp) or the kernels (ops/cuda/mx.cu). On the CPU a round trip is a quantization and
// a dequantization; on the GPU one kernel pass.
#include "ops/mx.h"

#include <cstdint>

#include "ops/cpu/mx.h"
#include "ops/dispatch.h"
#include "ops/elementwise.h"
#if MOETRAIN_HAS_CUDA
#include "core/profile.h"
#include "ops/cuda/mx.h"
#include "ops/cuda/operands.h"
#endif

namespace mt::ops {

namespace {

// ... of the MX tensor's logical shape, on its device.
void check_operands(const char* op, const char* role, const Tensor& t, const QuantTensor& q) {
  MT_CHECK(q.defined(), "{}: the MX tensor is not allocated", op);
  MT_CHECK(q.block() == QuantBlock::kMx32, "{}: the tensor is in {} blocks, not MX's 1x32", op,
           quant_block_name(q.block()));
  MT_CHECK(t.shape() == q.shape(), "{}: {} {} does not match the MX tensor's {}", op, role,
           shape_str(t.shape()), shape_str(q.shape()));
  check_unquantized(op, role, t);
  MT_CHECK(t.device() == q.device(), "{}: {} and MX tensor on different devices", op, role);
}

// x's values as `dtype` holds them: x itself, or a rounded copy.
Tensor rounded_to(const Tensor& x, DType dtype) {
  if (x.dtype() == dtype) return x;
  Tensor out = Tensor::empty(x.shape(), dtype, x.device());
  convert(x, out);
  return out;
}

#if MOETRAIN_HAS_CUDA
// The kernels move 16 bytes at a time through the unquantized side; along dim1 they also step
// down its rows, which must keep that alignment.
void check_readable(const char* op, const Tensor& t, QuantAxis axis) {
  const cuda::Matrices m = cuda::matrices_of(t.shape());
  MT_CHECK(reinterpret_cast<uintptr_t>(t.raw()) % 16 == 0,
           "{} on the GPU needs a 16-byte aligned tensor", op);
  MT_CHECK(axis == QuantAxis::kDim0 || (m.cols * dtype_size(t.dtype())) % 16 == 0,
           "{} along dim1 on the GPU needs rows of a multiple of 16 bytes; {} has {} {} columns",
           op, shape_str(t.shape()), m.cols, dtype_name(t.dtype()));
}

// One pass on the GPU: x quantized along `axis` and dequantized into out (dim1: transposed).
void gpu_round_trip(const char* op, const Tensor& x, QuantAxis axis, MxScaleRule rule,
                    Tensor& out) {
  const profile::Phase phase("gpu.mx_round_trip");
  const DType in = cuda::storage_of(x, "mx_round_trip input");
  const DType dt = cuda::storage_of(out, "mx_round_trip output");
  const cuda::Matrices m = cuda::matrices_of(x.shape());
  check_readable(op, x, axis);
  check_readable(op, out, QuantAxis::kDim0);
  MT_CUDA_CHECK(cuda::kernels::mx_round_trip(in, x.raw(), axis, rule, m.batch, m.rows, m.cols, dt,
                                             out.raw(), cuda::stream()));
}
#endif

}  // namespace

void mx_quantize(const Tensor& x, MxScaleRule rule, QuantTensor& out) {
  check_operands("mx_quantize", "input", x, out);
#if MOETRAIN_HAS_CUDA
  if (on_gpu(x)) {
    const profile::Phase phase("gpu.mx_quantize");
    const DType in = cuda::storage_of(x, "mx_quantize input");
    const cuda::Matrices m = cuda::matrices_of(x.shape());
    check_readable("mx_quantize", x, out.axis());
    MT_CUDA_CHECK(cuda::kernels::mx_quantize(in, x.raw(), out.axis(), rule, m.batch, m.rows, m.cols,
                                             static_cast<uint8_t*>(out.data().raw()),
                                             static_cast<uint8_t*>(out.scales().raw()),
                                             cuda::stream()));
    return;
  }
#endif
  cpu::mx_quantize(x, rule, out);
}

void mx_dequantize(const QuantTensor& q, Tensor& out) {
  check_operands("mx_dequantize", "output", out, q);
#if MOETRAIN_HAS_CUDA
  if (on_gpu(out)) {
    const profile::Phase phase("gpu.mx_dequantize");
    const DType dt = cuda::storage_of(out, "mx_dequantize output");
    const cuda::Matrices m = cuda::matrices_of(q.shape());
    check_readable("mx_dequantize", out, q.axis());
    MT_CUDA_CHECK(cuda::kernels::mx_dequantize(dt, static_cast<const uint8_t*>(q.data().raw()),
                                               static_cast<const uint8_t*>(q.scales().raw()),
                                               q.axis(), m.batch, m.rows, m.cols, out.raw(),
                                               cuda::stream()));
    return;
  }
#endif
  cpu::mx_dequantize(q, out);
}

void mx_round_trip(const Tensor& x, QuantAxis axis, MxScaleRule rule, Tensor& out) {
  MT_CHECK(out.shape() == x.shape() && out.device() == x.device(),
           "mx_round_trip: output {} {} must have the input's shape {} and device",
           dtype_name(out.dtype()), shape_str(out.shape()), shape_str(x.shape()));
  check_unquantized("mx_round_trip", "x", x);
  check_unquantized("mx_round_trip", "output", out);
#if MOETRAIN_HAS_CUDA
  if (on_gpu(x) && axis == QuantAxis::kDim0) {
    MT_CHECK(x.ndim() >= 1 && x.dim(x.ndim() - 1) % kMxBlock == 0,
             "mx_round_trip along dim0 needs rows of a multiple of {} elements; got {}", kMxBlock,
             shape_str(x.shape()));
    return gpu_round_trip("mx_round_trip", x, QuantAxis::kDim0, rule, out);
  }
#endif
  QuantTensor q = QuantTensor::empty(x.shape(), QuantBlock::kMx32, axis, x.device());
  mx_quantize(rounded_to(x, out.dtype()), rule, q);
  mx_dequantize(q, out);
}

void mx_round_trip_transposed(const Tensor& x, MxScaleRule rule, Tensor& out) {
  MT_CHECK(x.ndim() >= 2 && out.device() == x.device(),
           "mx_round_trip_transposed: x must have two dimensions or more, out on its device; got "
           "{}",
           shape_str(x.shape()));
  expect_shape(out, transposed_shape(x.shape()), "mx_round_trip_transposed output");
  check_unquantized("mx_round_trip_transposed", "x", x);
  check_unquantized("mx_round_trip_transposed", "output", out);
#if MOETRAIN_HAS_CUDA
  if (on_gpu(x)) {
    MT_CHECK(x.dim(x.ndim() - 2) % kMxBlock == 0,
             "mx_round_trip_transposed needs a multiple of {} rows; got {}", kMxBlock,
             shape_str(x.shape()));
    return gpu_round_trip("mx_round_trip_transposed", x, QuantAxis::kDim1, rule, out);
  }
#endif
  QuantTensor q = QuantTensor::empty(x.shape(), QuantBlock::kMx32, QuantAxis::kDim1, x.device());
  mx_quantize(rounded_to(x, out.dtype()), rule, q);
  mx_dequantize(q.stored_as_dim0(), out);
}

void mx_round_trip_both_axes(const Tensor& x, MxScaleRule rule, Tensor& dim0, Tensor& transposed) {
  MT_CHECK(
      x.ndim() >= 2 && x.dim(x.ndim() - 1) % kMxBlock == 0 && x.dim(x.ndim() - 2) % kMxBlock == 0,
      "mx_round_trip_both_axes needs x (..., R, C) with R and C multiples of {}; got {}", kMxBlock,
      shape_str(x.shape()));
  MT_CHECK(dim0.dtype() == transposed.dtype(),
           "mx_round_trip_both_axes: the outputs must share one dtype; got {} and {}",
           dtype_name(dim0.dtype()), dtype_name(transposed.dtype()));
  expect_shape(dim0, x.shape(), "mx_round_trip_both_axes dim0 output");
  expect_shape(transposed, transposed_shape(x.shape()),
               "mx_round_trip_both_axes transposed output");
  MT_CHECK(dim0.device() == x.device() && transposed.device() == x.device(),
           "mx_round_trip_both_axes: the outputs must be on the input's device");
  check_unquantized("mx_round_trip_both_axes", "x", x);
  check_unquantized("mx_round_trip_both_axes", "output", dim0);
#if MOETRAIN_HAS_CUDA
  if (on_gpu(x)) {
    const profile::Phase phase("gpu.mx_round_trip_both_axes");
    const DType in = cuda::storage_of(x, "mx_round_trip_both_axes input");
    const DType dt = cuda::storage_of(dim0, "mx_round_trip_both_axes output");
    const cuda::Matrices m = cuda::matrices_of(x.shape());
    check_readable("mx_round_trip_both_axes", x, QuantAxis::kDim1);
    check_readable("mx_round_trip_both_axes", dim0, QuantAxis::kDim0);
    check_readable("mx_round_trip_both_axes", transposed, QuantAxis::kDim0);
    MT_CUDA_CHECK(cuda::kernels::mx_round_trip_both_axes(in, x.raw(), rule, m.batch, m.rows, m.cols,
                                                         dt, dim0.raw(), transposed.raw(),
                                                         cuda::stream()));
    return;
  }
#endif
  mx_round_trip(x, QuantAxis::kDim0, rule, dim0);
  mx_round_trip_transposed(x, rule, transposed);
}

void check_mx_values(const char* op, const Tensor& out, const MxValuesOut* mx) {
  if (!mx) return;
  MT_CHECK(mx->values && mx->values->shape() == out.shape() && mx->values->dtype() == out.dtype() &&
               mx->values->device() == out.device(),
           "{}: the MX values' tensor must match the output {} {}", op, dtype_name(out.dtype()),
           shape_str(out.shape()));
  MT_CHECK(out.ndim() == 2 && out.dim(1) % kMxBlock == 0,
           "{}: MX values along rows need a multiple of {} columns; the output is {}", op, kMxBlock,
           shape_str(out.shape()));
}

void write_mx_values(const Tensor& out, const MxValuesOut& mx) {
  mx_round_trip(out, QuantAxis::kDim0, mx.rule, *mx.values);
}

void mx_round_trip_expert_rows(const Tensor& x, const ExpertRows& rows, MxScaleRule rule,
                               Tensor& out) {
  MT_CHECK(x.ndim() == 2 && out.shape() == x.shape() && out.dtype() == x.dtype() &&
               out.device() == x.device(),
           "mx_round_trip_expert_rows: x must be a matrix and out alike; got {} {} and {} {}",
           dtype_name(x.dtype()), shape_str(x.shape()), dtype_name(out.dtype()),
           shape_str(out.shape()));
  check_unquantized("mx_round_trip_expert_rows", "x", x);
  const int64_t experts = rows.offsets.numel() - 1;
  for (const Tensor* t : {&rows.offsets, &rows.segments}) {
    expect_dtype(*t, DType::kI64, "expert rows");
    MT_CHECK(t->device() == x.device() && t->numel() == experts + 1,
             "expert offsets and segments must be {} i64 on the rows' device", experts + 1);
  }
#if MOETRAIN_HAS_CUDA
  if (on_gpu(x)) {
    const profile::Phase phase("gpu.mx_round_trip_expert_rows");
    const DType dt = cuda::storage_of(x, "mx_round_trip_expert_rows input");
    Tensor prefix = cuda::gpu_empty({experts + 1}, DType::kI64);
    MT_CUDA_CHECK(cuda::kernels::mx_round_trip_expert_rows(
        dt, x.raw(), x.dim(0), x.dim(1), cuda::device_segments(rows), static_cast<int>(experts),
        prefix.data<int64_t>(), rule, out.raw(), cuda::stream()));
    return;
  }
#endif
  cpu::mx_round_trip_expert_rows(x, rows, rule, out);
}

}  // namespace mt::ops
