// The FP8 blockwise conversions' front door (ops/fp8.h): the arguments checked once, then the CPU
// reference (ops/cpu/fp8.cpp) or the kernels (ops/cuda/fp8.cu).
#include "ops/fp8.h"

#include "ops/cpu/fp8.h"
#include "ops/dispatch.h"
#if MOETRAIN_HAS_CUDA
#include "core/profile.h"
#include "ops/cuda/fp8.h"
#include "ops/cuda/operands.h"
#endif

namespace mt::ops {

namespace {

void check_fp8(const char* op, const char* role, const Tensor& t, const QuantTensor& q) {
  MT_CHECK(q.defined(), "{}: the FP8 tensor is not allocated", op);
  MT_CHECK(q.block() == QuantBlock::kRow128 || q.block() == QuantBlock::kTile128,
           "{}: the tensor is in {} blocks; FP8 blockwise is 1x128 or 128x128", op,
           quant_block_name(q.block()));
  MT_CHECK(t.shape() == q.shape(), "{}: {} {} does not match the FP8 tensor's {}", op, role,
           shape_str(t.shape()), shape_str(q.shape()));
  check_unquantized(op, role, t);
  MT_CHECK(t.device() == q.device(), "{}: {} and FP8 tensor on different devices", op, role);
}

// The weight gradient's operand layout: segments on 128-row boundaries.
void check_expert_rows(const char* op, const Tensor& x, const ExpertRows& rows) {
  MT_CHECK(x.ndim() == 2, "{}: x must be a matrix, got {}", op, shape_str(x.shape()));
  MT_CHECK(rows.align % kFp8Block == 0,
           "{}: the experts' segments must start on 128-row boundaries (ExpertRows::align {})", op,
           rows.align);
  MT_CHECK(rows.offsets.device() == x.device() && rows.segments.device() == x.device(),
           "{}: the expert layout must be on x's device", op);
  if (on_gpu(x)) return;
  const int64_t* seg = rows.segments.data<int64_t>();
  for (int64_t e = 0; e < rows.segments.numel(); ++e)
    MT_CHECK(seg[e] % kFp8Block == 0, "{}: expert {}'s segment starts at row {}", op, e, seg[e]);
}

#if MOETRAIN_HAS_CUDA
void check_aligned(const char* op, const void* p) {
  MT_CHECK(reinterpret_cast<uintptr_t>(p) % 16 == 0, "{} on the GPU needs 16-byte aligned data",
           op);
}
#endif

}  // namespace

void check_fp8_rows(const char* op, const Tensor& out, const Fp8RowsOut* fp8) {
  if (!fp8) return;
  MT_CHECK(
      fp8->rows && fp8->rows->defined() && fp8->rows->shape() == out.shape() &&
          fp8->rows->block() == QuantBlock::kRow128 && fp8->rows->axis() == QuantAxis::kDim0 &&
          fp8->rows->device() == out.device(),
      "{}: the FP8 rows must be 1x128 blocks along dim0 of the output's shape {} on its device", op,
      shape_str(out.shape()));
}

void write_fp8_rows(const Tensor& out, const Fp8RowsOut& fp8) {
  fp8_quantize(out, fp8.rule, *fp8.rows);
}

void fp8_quantize(const Tensor& x, Fp8ScaleRule rule, QuantTensor& out) {
  check_fp8("fp8_quantize", "input", x, out);
#if MOETRAIN_HAS_CUDA
  if (on_gpu(x)) {
    const profile::Phase phase("gpu.fp8_quantize");
    const DType in = cuda::storage_of(x, "fp8_quantize input");
    check_aligned("fp8_quantize", x.raw());
    const Shape& s = x.shape();
    const auto [batch, rows, cols] = cuda::matrices_of(s);
    auto* data = static_cast<uint8_t*>(out.data().raw());
    if (out.block() == QuantBlock::kTile128) {
      const bool dim0 = out.axis() == QuantAxis::kDim0;
      MT_CUDA_CHECK(cuda::kernels::fp8_quantize_tiles(in, x.raw(), batch, rows, cols, rule,
                                                      dim0 ? data : nullptr, dim0 ? nullptr : data,
                                                      out.scales().data<float>(), cuda::stream()));
      return;
    }
    if (out.axis() == QuantAxis::kDim0) {
      MT_CUDA_CHECK(cuda::kernels::fp8_quantize_rows(in, x.raw(), x.numel() / cols, cols, rule,
                                                     data, out.scales().data<float>(),
                                                     cuda::stream()));
      return;
    }
    MT_CHECK(x.ndim() == 2 && cols % 8 == 0,
             "fp8_quantize along dim1 on the GPU takes a matrix of a multiple of 8 columns, got {}",
             shape_str(s));
    MT_CUDA_CHECK(cuda::kernels::fp8_quantize_columns(in, x.raw(), rows, cols, nullptr, 0, rule,
                                                      data, out.scales().data<float>(),
                                                      cuda::stream()));
    return;
  }
#endif
  cpu::fp8_quantize(x, rule, out);
}

QuantTensor fp8_rows(const Tensor& x, Fp8ScaleRule rule) {
  QuantTensor out =
      QuantTensor::empty(x.shape(), QuantBlock::kRow128, QuantAxis::kDim0, x.device());
  fp8_quantize(x, rule, out);
  return out;
}

void fp8_quantize_both_axes(const Tensor& w, Fp8ScaleRule rule, QuantTensor& dim0,
                            QuantTensor& dim1) {
  check_fp8("fp8_quantize_both_axes", "w", w, dim0);
  check_fp8("fp8_quantize_both_axes", "w", w, dim1);
  MT_CHECK(dim0.block() == QuantBlock::kTile128 && dim1.block() == QuantBlock::kTile128 &&
               dim0.axis() == QuantAxis::kDim0 && dim1.axis() == QuantAxis::kDim1,
           "fp8_quantize_both_axes: the copies must be 128x128 tiles along dim0 and dim1");
#if MOETRAIN_HAS_CUDA
  if (on_gpu(w)) {
    const profile::Phase phase("gpu.fp8_quantize_both_axes");
    const DType in = cuda::storage_of(w, "fp8_quantize_both_axes input");
    check_aligned("fp8_quantize_both_axes", w.raw());
    const auto [batch, rows, cols] = cuda::matrices_of(w.shape());
    MT_CUDA_CHECK(cuda::kernels::fp8_quantize_tiles(
        in, w.raw(), batch, rows, cols, rule, static_cast<uint8_t*>(dim0.data().raw()),
        static_cast<uint8_t*>(dim1.data().raw()), dim0.scales().data<float>(), cuda::stream()));
    dim1.scales().copy_from(dim0.scales());
    return;
  }
#endif
  cpu::fp8_quantize(w, rule, dim0);
  cpu::fp8_quantize(w, rule, dim1);
}

void fp8_transpose_tiles(const QuantTensor& in, QuantTensor& out) {
  MT_CHECK(in.defined() && out.defined(), "fp8_transpose_tiles: a tensor is not allocated");
  MT_CHECK(in.block() == QuantBlock::kTile128 && out.block() == QuantBlock::kTile128 &&
               in.axis() != out.axis(),
           "fp8_transpose_tiles: 128x128 tiles into the other axis expected, got {} blocks along "
           "dim{} into {} blocks along dim{}",
           quant_block_name(in.block()), in.axis() == QuantAxis::kDim0 ? 0 : 1,
           quant_block_name(out.block()), out.axis() == QuantAxis::kDim0 ? 0 : 1);
  MT_CHECK(in.shape() == out.shape(), "fp8_transpose_tiles: shapes {} and {} differ",
           shape_str(in.shape()), shape_str(out.shape()));
  MT_CHECK(in.device() == out.device(), "fp8_transpose_tiles: tensors on different devices");
#if MOETRAIN_HAS_CUDA
  if (in.device() == Device::kCUDA) {
    const profile::Phase phase("gpu.fp8_transpose_tiles");
    check_aligned("fp8_transpose_tiles", in.data().raw());
    check_aligned("fp8_transpose_tiles", out.data().raw());
    const auto [batch, p, q] = cuda::matrices_of(in.data().shape());  // stored (..., P, Q)
    MT_CUDA_CHECK(cuda::kernels::fp8_transpose_tiles(
        static_cast<const uint8_t*>(in.data().raw()), batch, p, q,
        static_cast<uint8_t*>(out.data().raw()), cuda::stream()));
    out.scales().copy_from(in.scales());
    return;
  }
#endif
  cpu::fp8_transpose_tiles(in, out);
}

void fp8_round_trip(const Tensor& x, QuantBlock block, QuantAxis axis, Fp8ScaleRule rule,
                    Tensor& out) {
  MT_CHECK(!on_gpu(x) && !on_gpu(out), "fp8_round_trip is the CPU's definition");
  QuantTensor q = QuantTensor::empty(x.shape(), block, axis);
  fp8_quantize(x, rule, q);
  fp8_dequantize(q, out);
}

void fp8_dequantize(const QuantTensor& q, Tensor& out) {
  check_fp8("fp8_dequantize", "output", out, q);
#if MOETRAIN_HAS_CUDA
  if (on_gpu(out)) {
    MT_CHECK(q.block() == QuantBlock::kRow128 && q.axis() == QuantAxis::kDim0,
             "fp8_dequantize on the GPU takes 1x128 blocks along dim0, got {} blocks along {}",
             quant_block_name(q.block()), quant_axis_name(q.axis()));
    const profile::Phase phase("gpu.fp8_dequantize");
    const DType dt = cuda::storage_of(out, "fp8_dequantize output");
    check_aligned("fp8_dequantize", out.raw());
    const int64_t cols = out.shape().back();
    MT_CUDA_CHECK(cuda::kernels::fp8_dequantize_rows(
        static_cast<const uint8_t*>(q.data().raw()), q.scales().data<float>(),
        cols == 0 ? 0 : out.numel() / cols, cols, dt, out.raw(), cuda::stream()));
    return;
  }
#endif
  cpu::fp8_dequantize(q, out);
}

Shape fp8_expert_rows_shape(const Tensor& x) {
  MT_CHECK(x.ndim() == 2, "the FP8 expert rows of a matrix, got {}", shape_str(x.shape()));
  return {(x.dim(0) + kFp8Block - 1) / kFp8Block * kFp8Block, x.dim(1)};
}

void fp8_quantize_expert_rows(const Tensor& x, const ExpertRows& rows, Fp8ScaleRule rule,
                              QuantTensor& out) {
  check_expert_rows("fp8_quantize_expert_rows", x, rows);
  check_unquantized("fp8_quantize_expert_rows", "x", x);
  MT_CHECK(out.defined() && out.block() == QuantBlock::kRow128 && out.axis() == QuantAxis::kDim1 &&
               out.shape() == fp8_expert_rows_shape(x) && out.device() == x.device(),
           "fp8_quantize_expert_rows: out must be {} in 1x128 blocks along dim1 on x's device "
           "(fp8_expert_rows_shape), got {} in {} blocks along {}",
           shape_str(fp8_expert_rows_shape(x)), shape_str(out.shape()),
           quant_block_name(out.block()), quant_axis_name(out.axis()));
#if MOETRAIN_HAS_CUDA
  if (on_gpu(x)) {
    const profile::Phase phase("gpu.fp8_quantize_expert_rows");
    const int64_t experts = rows.offsets.numel() - 1, m = out.shape()[0];
    const DType in = cuda::storage_of(x, "fp8_quantize_expert_rows input");
    MT_CHECK(x.dim(1) % 8 == 0 && reinterpret_cast<uintptr_t>(x.raw()) % 16 == 0,
             "fp8_quantize_expert_rows on the GPU reads 16-byte packs: a width of a multiple of 8 "
             "(got {}) and 16-byte aligned rows",
             x.dim(1));
    const cuda::kernels::ExpertSegments layout = cuda::device_segments(rows);
    MT_CUDA_CHECK(cuda::kernels::fp8_quantize_columns(
        in, x.raw(), m, x.dim(1), &layout, static_cast<int>(experts), rule,
        static_cast<uint8_t*>(out.data().raw()), out.scales().data<float>(), cuda::stream()));
    return;
  }
#endif
  cpu::fp8_quantize_expert_rows(x, rows, rule, out);
}

void fp8_round_trip_expert_rows(const Tensor& x, const ExpertRows& rows, Fp8ScaleRule rule,
                                Tensor& out) {
  MT_CHECK(!on_gpu(x) && !on_gpu(out), "fp8_round_trip_expert_rows is the CPU's definition");
  MT_CHECK(x.ndim() == 2 && out.shape() == x.shape(),
           "fp8_round_trip_expert_rows: x must be a matrix and out its shape, got {} and {}",
           shape_str(x.shape()), shape_str(out.shape()));
  MT_CHECK(out.dtype() == DType::kF32 || out.dtype() == DType::kF64,
           "fp8_round_trip_expert_rows: out must be f32 or f64, got {}", dtype_name(out.dtype()));
  cpu::fp8_round_trip_expert_rows(x, rows, rule, out);
}

}  // namespace mt::ops
