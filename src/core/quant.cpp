#include "core/quant.h"

#include <array>
#include <utility>

#include "core/enum_names.h"

namespace mt {

namespace {
constexpr std::array<EnumName<QuantAxis>, 2> kAxes{
    {{QuantAxis::kDim0, "dim0"}, {QuantAxis::kDim1, "dim1"}}};
constexpr std::array<EnumName<QuantBlock>, 3> kBlocks{{{QuantBlock::kMx32, "1x32"},
                                                       {QuantBlock::kRow128, "1x128"},
                                                       {QuantBlock::kTile128, "128x128"}}};
constexpr std::array<EnumName<MxScaleRule>, 2> kScaleRules{
    {{MxScaleRule::kFloor, "floor"}, {MxScaleRule::kRceil, "rceil"}}};
constexpr std::array<EnumName<Fp8ScaleRule>, 2> kFp8ScaleRules{
    {{Fp8ScaleRule::kFp32, "fp32"}, {Fp8ScaleRule::kPow2, "pow2"}}};

int64_t block_size(QuantBlock b) {
  return b == QuantBlock::kMx32 ? kMxBlock : kFp8Block;
}
}  // namespace

std::string_view quant_axis_name(QuantAxis a) {
  return enum_name(kAxes, a);
}

std::string_view quant_block_name(QuantBlock b) {
  return enum_name(kBlocks, b);
}

std::string_view mx_scale_rule_name(MxScaleRule r) {
  return enum_name(kScaleRules, r);
}

bool parse_mx_scale_rule(std::string_view name, MxScaleRule* out) {
  return parse_enum(kScaleRules, name, out);
}

std::string_view fp8_scale_rule_name(Fp8ScaleRule r) {
  return enum_name(kFp8ScaleRules, r);
}

bool parse_fp8_scale_rule(std::string_view name, Fp8ScaleRule* out) {
  return parse_enum(kFp8ScaleRules, name, out);
}

void check_unquantized(const char* op, const char* role, const Tensor& t) {
  MT_CHECK(t.dtype() == DType::kF32 || t.dtype() == DType::kBF16 || t.dtype() == DType::kF64,
           "{}: {} must be f32, bf16 or f64, got {}", op, role, dtype_name(t.dtype()));
}

Shape QuantTensor::data_shape(const Shape& shape, QuantBlock block, QuantAxis axis) {
  MT_CHECK(shape.size() >= 2, "a quantized tensor needs at least 2 dimensions, got {}",
           shape_str(shape));
  for (int64_t d : shape)
    MT_CHECK(d >= 0, "quantized tensor shape {} has a negative size", shape_str(shape));
  const Shape s = axis == QuantAxis::kDim1 ? transposed_shape(shape) : shape;
  const int64_t n = block_size(block);
  MT_CHECK(s.back() % n == 0,
           "quantized tensor {} in {} blocks along {}: the blocked dimension ({}) must be a "
           "multiple of {}",
           shape_str(shape), quant_block_name(block), quant_axis_name(axis), s.back(), n);
  MT_CHECK(block != QuantBlock::kTile128 || s[s.size() - 2] % n == 0,
           "quantized tensor {} in 128x128 tiles: both of the last two dimensions must be "
           "multiples of 128",
           shape_str(shape));
  return s;
}

Shape QuantTensor::scales_shape(const Shape& shape, QuantBlock block, QuantAxis axis) {
  Shape s = data_shape(shape, block, axis);
  if (block == QuantBlock::kMx32) {
    s.back() /= kMxBlock;
    return s;
  }
  s = shape;  // the FP8 formats: the logical orientation
  const size_t r = s.size() - 2, c = s.size() - 1;
  if (block == QuantBlock::kTile128 || axis == QuantAxis::kDim1) s[r] /= kFp8Block;
  if (block == QuantBlock::kTile128 || axis == QuantAxis::kDim0) s[c] /= kFp8Block;
  return s;
}

QuantTensor QuantTensor::allocate(const Shape& shape, QuantBlock block, QuantAxis axis,
                                  Device device, Tensor (*make)(const Shape&, DType, Device)) {
  QuantTensor t;
  t.data_ = make(data_shape(shape, block, axis), DType::kE4M3, device);
  t.scales_ = make(scales_shape(shape, block, axis),
                   block == QuantBlock::kMx32 ? DType::kE8M0 : DType::kF32, device);
  t.shape_ = shape;
  t.block_ = block;
  t.axis_ = axis;
  return t;
}

QuantTensor QuantTensor::empty(const Shape& shape, QuantBlock block, QuantAxis axis,
                               Device device) {
  return allocate(shape, block, axis, device, &Tensor::empty);
}

QuantTensor QuantTensor::poisoned(const Shape& shape, QuantBlock block, QuantAxis axis,
                                  Device device) {
  return allocate(shape, block, axis, device, &Tensor::poisoned);
}

QuantTensor QuantTensor::to(Device device) const {
  QuantTensor t = *this;
  t.data_ = data_.to(device);
  t.scales_ = scales_.to(device);
  return t;
}

QuantTensor QuantTensor::stored_as_dim0() const {
  MT_CHECK(block_ == QuantBlock::kMx32 || axis_ == QuantAxis::kDim0,
           "an FP8 tensor's scales are in the logical orientation: it cannot be read transposed");
  QuantTensor t = *this;
  t.shape_ = data_.shape();
  t.axis_ = QuantAxis::kDim0;
  return t;
}

QuantTensor QuantTensor::rows(int64_t begin, int64_t end) const {
  MT_CHECK(shape_.size() == 2 && axis_ == QuantAxis::kDim0 && block_ != QuantBlock::kTile128,
           "QuantTensor::rows: a matrix stored along dim0 in 1 x n blocks, got {} in {} blocks "
           "along {}",
           shape_str(shape_), quant_block_name(block_),
           axis_ == QuantAxis::kDim0 ? "dim0" : "dim1");
  QuantTensor t = *this;
  t.data_ = data_.slice_rows(begin, end);
  t.scales_ = scales_.slice_rows(begin, end);
  t.shape_ = {end - begin, shape_[1]};
  return t;
}

}  // namespace mt
