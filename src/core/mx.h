// MX (microscaling) tensors, OCP MX v1.0 as torchao's MXTensor holds them: FP8 E4M3 elements in
// blocks of kMxBlock consecutive values along one dimension, each block sharing an E8M0 scale
// 2^(s - 127) (0xFF: NaN). The element is decoded as from_e4m3(q) * 2^(s - 127).
//
// A logical tensor (..., R, C) (leading dimensions batch independent matrices, e.g. experts) is
// quantized along one of its last two dimensions:
//   kDim0: blocks run along each row (over C).        data (..., R, C)   scales (..., R, C/32)
//   kDim1: blocks run down each column (over R).     data (..., C, R)   scales (..., C, R/32)
// kDim1 is stored transposed (torchao's to_mx of the transpose), so in both layouts a block is
// 32 contiguous bytes and its scale the next byte of its scale row: a GEMM reads either as a
// K-major operand whose K runs along the blocks. The blocked dimension must be a multiple of
// kMxBlock; callers that quantize ragged groups (expert rows) pad each group to it.
#pragma once
#include "core/mx_format.h"
#include "core/tensor.h"

namespace mt {

class MxTensor {
 public:
  MxTensor() = default;
  // Allocates data and scales for the logical `shape` (at least 2 dims) quantized along `axis`;
  // the blocked dimension must be a multiple of kMxBlock (an mt::Error names it otherwise).
  static MxTensor empty(const Shape& shape, MxAxis axis, Device device = Device::kCPU);
  // Data and scales filled with bytes no quantization of finite input writes (0xFF: NaN).
  static MxTensor poisoned(const Shape& shape, MxAxis axis, Device device = Device::kCPU);
  // The stored shapes for a logical shape (see the header comment).
  static Shape data_shape(const Shape& shape, MxAxis axis);
  static Shape scales_shape(const Shape& shape, MxAxis axis);

  bool defined() const { return data_.defined(); }
  const Shape& shape() const { return shape_; }  // logical
  MxAxis axis() const { return axis_; }
  Device device() const { return data_.device(); }
  Tensor& data() { return data_; }  // e4m3
  const Tensor& data() const { return data_; }
  Tensor& scales() { return scales_; }  // e8m0
  const Tensor& scales() const { return scales_; }
  int64_t numel() const { return data_.numel(); }
  size_t nbytes() const { return data_.nbytes() + scales_.nbytes(); }
  MxTensor to(Device device) const;
  // The same bytes read as quantized along dim0 of the stored shape: a dim1 tensor of logical
  // (..., R, C) is the dim0 tensor of (..., C, R) (its transpose). A dim0 tensor is returned as is.
  MxTensor stored_as_dim0() const;

 private:
  static MxTensor allocate(const Shape& shape, MxAxis axis, Device device,
                           Tensor (*make)(const Shape&, DType, Device));
  Tensor data_;
  Tensor scales_;
  Shape shape_;
  MxAxis axis_ = MxAxis::kDim0;
};

}  // namespace mt
