// The FP8 expert products' front door (ops/fp8_gemm.h): the operands checked once, then on the GPU
// our kernel for short contractions over padded layouts, else CUTLASS's blockwise-scaled grouped
// kernels (ops/cuda/fp8_gemm.h says which is faster where); on the CPU the definition: both
// operands dequantized exactly (f64), then the grouped GEMM in f64.
#include "ops/fp8_gemm.h"

#include "ops/dispatch.h"
#include "ops/fp8.h"
#if MOETRAIN_HAS_CUDA
#include "core/profile.h"
#include "ops/cuda/fp8_gemm.h"
#include "ops/cuda/operands.h"
#endif

namespace mt::ops {

namespace {

void check_quant(const char* op, const char* role, const QuantTensor& t, QuantBlock block,
                 QuantAxis axis, int64_t ndim) {
  MT_CHECK(t.defined() && t.block() == block && t.axis() == axis &&
               static_cast<int64_t>(t.shape().size()) == ndim,
           "{}: {} must be a {}-dimensional FP8 tensor in {} blocks along {}, got {} in {} blocks "
           "along {}",
           op, role, ndim, quant_block_name(block), quant_axis_name(axis), shape_str(t.shape()),
           quant_block_name(t.block()), quant_axis_name(t.axis()));
}

Tensor dequantized(const QuantTensor& q) {
  Tensor out = Tensor::empty(q.shape(), DType::kF64);
  fp8_dequantize(q, out);
  return out;
}

// The definition's result in out's dtype.
void write_result(const Tensor& f64, Tensor& out) {
  if (out.dtype() == DType::kF64) return out.copy_from(f64);
  for (int64_t i = 0; i < out.numel(); ++i) out.set_item(i, f64.item(i));
}

#if MOETRAIN_HAS_CUDA && MOETRAIN_HAS_CUTLASS
// The kernels' view of a product: both operands' E4M3 data and f32 scales, and the output.
cuda::kernels::Fp8Operands operands(const QuantTensor& a, const QuantTensor& b, Tensor& out) {
  return {a.data().raw(), a.scales().data<float>(), b.data().raw(), b.scales().data<float>(),
          out.raw()};
}

// b's scales are (K / 128, N / 128) of the weight: along b's rows for w^T (dim1), along its
// contraction for w (dim0).
cuda::kernels::Fp8WeightScales weight_scales(const QuantTensor& b) {
  return b.axis() == QuantAxis::kDim1 ? cuda::kernels::Fp8WeightScales::kMnMajor
                                      : cuda::kernels::Fp8WeightScales::kKMajor;
}
#endif

}  // namespace

void fp8_grouped_gemm(const QuantTensor& a, const QuantTensor& b, const ExpertRows& rows,
                      Tensor& out) {
  check_quant("fp8_grouped_gemm", "a", a, QuantBlock::kRow128, QuantAxis::kDim0, 2);
  MT_CHECK(b.defined() && b.block() == QuantBlock::kTile128 && b.shape().size() == 3,
           "fp8_grouped_gemm: b must be (experts, P, Q) in 128x128 tiles, got {} in {} blocks",
           shape_str(b.shape()), quant_block_name(b.block()));
  const Shape& bs = b.data().shape();  // stored (E, P, Q)
  const int64_t m = a.shape()[0], q = a.shape()[1], experts = bs[0], p = bs[1];
  MT_CHECK(bs[2] == q, "fp8_grouped_gemm: b's stored rows must be {} wide (a's), got {}", q,
           shape_str(bs));
  expect_shape(out, {m, p}, "fp8_grouped_gemm out");
  expect_shape(rows.offsets, {experts + 1}, "expert offsets");
  MT_CHECK(
      a.device() == b.device() && out.device() == b.device() && rows.offsets.device() == b.device(),
      "fp8_grouped_gemm: operands, output and expert layout must be on one device");
#if MOETRAIN_HAS_CUDA
  if (on_gpu(out)) {
#if MOETRAIN_HAS_CUTLASS
    const profile::Phase phase("gpu.fp8_grouped_gemm");
    expect_dtype(out, DType::kBF16, "fp8_grouped_gemm out (the GPU writes bf16)");
    const int e = static_cast<int>(experts);
    const cuda::kernels::Fp8Operands ops = operands(a, b, out);
    const cuda::kernels::Fp8WeightScales b_scales = weight_scales(b);
    if (rows.align % cuda::kernels::kFixedRowTile == 0) {
      expect_dtype(rows.segments, DType::kI64, "expert segments");
      MT_CHECK(rows.segments.device() == Device::kCUDA && rows.segments.numel() == experts + 1,
               "expert segments must be {} i64 on the GPU", experts + 1);
      Tensor ws = cuda::gpu_workspace(cuda::kernels::fp8_gemm_rows_fixed_workspace(m, p, q));
      MT_CUDA_CHECK(cuda::kernels::fp8_gemm_rows_fixed(rows.segments.data<int64_t>(), e, ops,
                                                       b_scales, m, p, q, ws.raw(), ws.nbytes(),
                                                       cuda::stream()));
      return;
    }
    Tensor ws = cuda::gpu_workspace(cuda::kernels::fp8_gemm_rows_workspace(e));
    MT_CUDA_CHECK(cuda::kernels::fp8_gemm_rows(cuda::device_segments(rows), e, ops, b_scales, m, p,
                                               q, cuda::kernels::Fp8Schedule::kCooperative,
                                               ws.raw(), ws.nbytes(), cuda::stream()));
    return;
#else
    MT_CHECK(false, "fp8_grouped_gemm on the GPU needs the CUTLASS build (MOETRAIN_HAS_CUTLASS)");
#endif
  }
#endif
  // b stored (E, P, Q) is w^T for a dim1 copy of w (E, Q, P) and w itself for a dim0 copy of
  // w (E, P, Q): a b[e]^T is the grouped GEMM's forward or transposed product over w.
  Tensor out64 = Tensor::empty({m, p}, DType::kF64);
  grouped_gemm(dequantized(a), dequantized(b),
               b.axis() == QuantAxis::kDim1 ? Transpose::kNo : Transpose::kYes, rows, out64);
  write_result(out64, out);
}

void fp8_grouped_gemm_weight(const QuantTensor& x, const QuantTensor& dy, const ExpertRows& rows,
                             Tensor& dw, Accumulate accumulate) {
  check_quant("fp8_grouped_gemm_weight", "x", x, QuantBlock::kRow128, QuantAxis::kDim1, 2);
  check_quant("fp8_grouped_gemm_weight", "dy", dy, QuantBlock::kRow128, QuantAxis::kDim1, 2);
  const int64_t m = x.shape()[0], k = x.shape()[1], n = dy.shape()[1];
  MT_CHECK(dy.shape()[0] == m, "fp8_grouped_gemm_weight: x has {} rows, dy {}", m, dy.shape()[0]);
  MT_CHECK(dw.ndim() == 3, "fp8_grouped_gemm_weight: dw must be (E, K, N), got {}",
           shape_str(dw.shape()));
  const int64_t experts = dw.dim(0);
  expect_shape(dw, {experts, k, n}, "fp8_grouped_gemm_weight dw");
  expect_shape(rows.offsets, {experts + 1}, "expert offsets");
  MT_CHECK(rows.align % kFp8Block == 0,
           "fp8_grouped_gemm_weight: the experts' segments must start on 128-row boundaries "
           "(ExpertRows::align {})",
           rows.align);
  MT_CHECK(x.device() == dw.device() && dy.device() == dw.device() &&
               rows.offsets.device() == dw.device(),
           "fp8_grouped_gemm_weight: operands, output and expert layout must be on one device");
#if MOETRAIN_HAS_CUDA
  if (on_gpu(dw)) {
#if MOETRAIN_HAS_CUTLASS
    const profile::Phase phase("gpu.fp8_grouped_gemm_weight");
    expect_dtype(dw, DType::kF32, "fp8_grouped_gemm_weight dw (the GPU accumulates in f32)");
    const int e = static_cast<int>(experts);
    const bool acc = accumulate == Accumulate::kYes;
    if (!acc)  // the GEMM writes only experts with rows
      MT_CUDA_CHECK(cuda::kernels::zero_empty_groups(rows.offsets.data<int64_t>(), e, dw.raw(),
                                                     k * n, true, cuda::stream()));
    Tensor ws = cuda::gpu_workspace(cuda::kernels::fp8_gemm_weight_workspace(e));
    const cuda::kernels::Fp8Operands ops = operands(x, dy, dw);
    MT_CUDA_CHECK(cuda::kernels::fp8_gemm_weight(cuda::device_segments(rows), e, ops, m, k, n, acc,
                                                 cuda::kernels::Fp8Schedule::kCooperative, ws.raw(),
                                                 ws.nbytes(), cuda::stream()));
    return;
#else
    MT_CHECK(false,
             "fp8_grouped_gemm_weight on the GPU needs the CUTLASS build (MOETRAIN_HAS_CUTLASS)");
#endif
  }
#endif
  MT_CHECK(dw.dtype() == DType::kF32 || dw.dtype() == DType::kF64,
           "fp8_grouped_gemm_weight: dw must be f32 or f64, got {}", dtype_name(dw.dtype()));
  Tensor dw64 = Tensor::empty(dw.shape(), DType::kF64);
  if (accumulate == Accumulate::kYes)
    for (int64_t i = 0; i < dw.numel(); ++i) dw64.set_item(i, dw.item(i));
  grouped_gemm_backward_weight(dequantized(x), dequantized(dy), rows, dw64, accumulate);
  write_result(dw64, dw);
}

void fp8_gemm(const QuantTensor& a, const QuantTensor& b, Tensor& out) {
  check_quant("fp8_gemm", "a", a, QuantBlock::kRow128, QuantAxis::kDim0, 2);
  MT_CHECK(b.defined() && b.block() == QuantBlock::kTile128 && b.shape().size() == 2,
           "fp8_gemm: b must be a matrix in 128x128 tiles, got {} in {} blocks",
           shape_str(b.shape()), quant_block_name(b.block()));
  const Shape& bs = b.data().shape();  // stored (P, Q)
  const int64_t m = a.shape()[0], q = a.shape()[1], p = bs[0];
  MT_CHECK(bs[1] == q, "fp8_gemm: b's stored rows must be {} wide (a's), got {}", q, shape_str(bs));
  expect_shape(out, {m, p}, "fp8_gemm out");
  MT_CHECK(a.device() == b.device() && out.device() == b.device(),
           "fp8_gemm: operands and output must be on one device");
#if MOETRAIN_HAS_CUDA
  if (on_gpu(out)) {
#if MOETRAIN_HAS_CUTLASS
    const profile::Phase phase("gpu.fp8_gemm");
    expect_dtype(out, DType::kBF16, "fp8_gemm out (the GPU writes bf16)");
    Tensor ws = cuda::gpu_workspace(cuda::kernels::fp8_gemm_dense_workspace(m, p, q));
    MT_CUDA_CHECK(cuda::kernels::fp8_gemm_dense(operands(a, b, out), weight_scales(b), m, p, q,
                                                ws.raw(), ws.nbytes(), cuda::stream()));
    return;
#else
    MT_CHECK(false, "fp8_gemm on the GPU needs the CUTLASS build (MOETRAIN_HAS_CUTLASS)");
#endif
  }
#endif
  MT_CHECK(out.dtype() == DType::kF32 || out.dtype() == DType::kF64,
           "fp8_gemm: out must be f32 or f64 on the CPU, got {}", dtype_name(out.dtype()));
  // b's logical matrix is w (Q, P) for a dim1 copy, w (P, Q) for a dim0 copy.
  Tensor out64 = Tensor::empty({m, p}, DType::kF64);
  gemm(dequantized(a), Transpose::kNo, dequantized(b),
       b.axis() == QuantAxis::kDim1 ? Transpose::kNo : Transpose::kYes, out64, Accumulate::kNo);
  write_result(out64, out);
}

Fp8LinearWeight fp8_linear_weight(const Tensor& w, Transpose tw, Fp8ScaleRule rule,
                                  Fp8LinearUse use) {
  MT_CHECK(w.ndim() == 2, "FP8 linear: w must be a matrix, got {}", shape_str(w.shape()));
  // Stored (out, in) for the forward, (in, out) for the input gradient: along dim1 of w (in,
  // out) gives its transpose, along dim0 its own layout.
  const QuantAxis forward_axis = tw == Transpose::kNo ? QuantAxis::kDim1 : QuantAxis::kDim0;
  const QuantAxis input_axis = tw == Transpose::kNo ? QuantAxis::kDim0 : QuantAxis::kDim1;
  const auto tiles = [&](QuantAxis axis) {
    return QuantTensor::empty(w.shape(), QuantBlock::kTile128, axis, w.device());
  };
  Fp8LinearWeight t;
  if (use != Fp8LinearUse::kInputGradient) t.forward = tiles(forward_axis);
  if (use != Fp8LinearUse::kForward) t.input_gradient = tiles(input_axis);
  if (use == Fp8LinearUse::kBoth) {
    QuantTensor& dim0 = forward_axis == QuantAxis::kDim0 ? t.forward : t.input_gradient;
    QuantTensor& dim1 = forward_axis == QuantAxis::kDim0 ? t.input_gradient : t.forward;
    fp8_quantize_both_axes(w, rule, dim0, dim1);
  } else {
    fp8_quantize(w, rule, use == Fp8LinearUse::kForward ? t.forward : t.input_gradient);
  }
  return t;
}

void fp8_linear_forward(const QuantTensor& x, const Tensor& w, Transpose tw, Fp8ScaleRule rule,
                        Tensor& y) {
  fp8_gemm(x, fp8_linear_weight(w, tw, rule, Fp8LinearUse::kForward).forward, y);
}

void fp8_linear_backward_input(const Tensor& dy, const Tensor& w, Transpose tw, Fp8ScaleRule rule,
                               Tensor& dx) {
  fp8_gemm(fp8_rows(dy, rule),
           fp8_linear_weight(w, tw, rule, Fp8LinearUse::kInputGradient).input_gradient, dx);
}

void fp8_linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy, Fp8ScaleRule rule,
                         Tensor& dx, Tensor& dw) {
  fp8_linear_backward_input(dy, w, Transpose::kNo, rule, dx);
  linear_backward_weight(x, dy, dw);
}

}  // namespace mt::ops
