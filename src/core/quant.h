// Quantized tensors: FP8 E4M3 elements in blocks that share one scale, in one of the formats of
// core/quant_format.h's QuantBlock:
//   kMx32 (OCP MX v1.0 as torchao's MXTensor holds it): 32 consecutive values along one
//     dimension share an E8M0 scale 2^(s - 127) (0xFF: NaN); element = from_e4m3(q) * 2^(s-127).
//   kRow128 (DeepSeek-V3's activations): 128 consecutive values along one dimension share an f32
//     scale; element = from_e4m3(q) * scale.
//   kTile128 (DeepSeek-V3's weights): each 128 x 128 tile of the last two dimensions shares an
//     f32 scale.
//
// A logical tensor (..., R, C) (leading dimensions batch independent matrices, e.g. experts) is
// stored along one of its last two dimensions (its axis):
//   kDim0: data (..., R, C) as is.     kDim1: data (..., C, R), the transpose.
// Call the stored data (..., P, Q): the 1 x n formats' blocks run along Q (a block is contiguous
// bytes; a GEMM reads the data as a K-major operand whose K is Q). The scales are stored
//   kMx32:    (..., P, Q / 32) in the stored orientation, a block's scale the next byte of its
//             scale row (torchao's layout);
//   kRow128:  in the logical orientation: (..., R, C / 128) along dim0, (..., R / 128, C) along
//             dim1;
//   kTile128: in the logical orientation, (..., R / 128, C / 128), whichever the axis: a weight's
//             two stored layouts share one scale tensor's values.
// The FP8 layouts are the ones CUTLASS's grouped blockwise kernels read per expert without
// knowing the experts' row counts (ops/cuda/cutlass/fp8_gemm_sm90.cuh).
// The blocked dimensions must be multiples of the block (an mt::Error names the size); callers
// that quantize ragged groups (expert rows) pad each group to it.
#pragma once
#include "core/quant_format.h"
#include "core/tensor.h"

namespace mt {

// The unquantized side of a conversion (quantize's input, dequantize's output) is f32, bf16 or
// f64: an mt::Error naming op and role otherwise.
void check_unquantized(const char* op, const char* role, const Tensor& t);

class QuantTensor {
 public:
  QuantTensor() = default;
  // Allocates data and scales for the logical `shape` (at least 2 dims) in `block`s stored along
  // `axis`; the blocked dimensions must be multiples of the block (an mt::Error names them).
  static QuantTensor empty(const Shape& shape, QuantBlock block, QuantAxis axis,
                           Device device = Device::kCPU);
  // Data and scales filled with bytes no quantization of finite input writes (0xFF: NaN; an f32
  // scale of all ones bits is a NaN too).
  static QuantTensor poisoned(const Shape& shape, QuantBlock block, QuantAxis axis,
                              Device device = Device::kCPU);
  // The stored shapes for a logical shape (see the header comment).
  static Shape data_shape(const Shape& shape, QuantBlock block, QuantAxis axis);
  static Shape scales_shape(const Shape& shape, QuantBlock block, QuantAxis axis);

  bool defined() const { return data_.defined(); }
  const Shape& shape() const { return shape_; }  // logical
  QuantBlock block() const { return block_; }
  QuantAxis axis() const { return axis_; }
  Device device() const { return data_.device(); }
  Tensor& data() { return data_; }  // e4m3
  const Tensor& data() const { return data_; }
  Tensor& scales() { return scales_; }  // e8m0 (kMx32) or f32
  const Tensor& scales() const { return scales_; }
  int64_t numel() const { return data_.numel(); }
  size_t nbytes() const { return data_.nbytes() + scales_.nbytes(); }
  QuantTensor to(Device device) const;
  // The same bytes read as stored along dim0 of the stored shape: a dim1 tensor of logical
  // (..., R, C) is the dim0 tensor of (..., C, R) (its transpose). A dim0 tensor is returned as is.
  QuantTensor stored_as_dim0() const;
  // Rows [begin, end) of a matrix stored along dim0 in 1 x n blocks (kMx32 or kRow128): a view
  // of its data and scales.
  QuantTensor rows(int64_t begin, int64_t end) const;

 private:
  static QuantTensor allocate(const Shape& shape, QuantBlock block, QuantAxis axis, Device device,
                              Tensor (*make)(const Shape&, DType, Device));
  Tensor data_;
  Tensor scales_;
  Shape shape_;
  QuantBlock block_ = QuantBlock::kMx32;
  QuantAxis axis_ = QuantAxis::kDim0;
};

}  // namespace mt
