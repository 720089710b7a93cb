#include "core/mx.h"

#include <array>
#include <utility>

#include "core/enum_names.h"

namespace mt {

namespace {
constexpr std::array<EnumName<MxAxis>, 2> kAxes{{{MxAxis::kDim0, "dim0"}, {MxAxis::kDim1, "dim1"}}};
constexpr std::array<EnumName<MxScaleRule>, 2> kScaleRules{
    {{MxScaleRule::kFloor, "floor"}, {MxScaleRule::kRceil, "rceil"}}};
}  // namespace

std::string_view mx_axis_name(MxAxis a) {
  return enum_name(kAxes, a);
}

std::string_view mx_scale_rule_name(MxScaleRule r) {
  return enum_name(kScaleRules, r);
}

bool parse_mx_scale_rule(std::string_view name, MxScaleRule* out) {
  return parse_enum(kScaleRules, name, out);
}

Shape MxTensor::data_shape(const Shape& shape, MxAxis axis) {
  MT_CHECK(shape.size() >= 2, "an MX tensor needs at least 2 dimensions, got {}", shape_str(shape));
  for (int64_t d : shape)
    MT_CHECK(d >= 0, "MX tensor shape {} has a negative size", shape_str(shape));
  const Shape s = axis == MxAxis::kDim1 ? transposed_shape(shape) : shape;
  MT_CHECK(s.back() % kMxBlock == 0,
           "MX tensor {} quantized along {}: the blocked dimension ({}) must be a multiple of {}",
           shape_str(shape), mx_axis_name(axis), s.back(), kMxBlock);
  return s;
}

Shape MxTensor::scales_shape(const Shape& shape, MxAxis axis) {
  Shape s = data_shape(shape, axis);
  s.back() /= kMxBlock;
  return s;
}

MxTensor MxTensor::allocate(const Shape& shape, MxAxis axis, Device device,
                            Tensor (*make)(const Shape&, DType, Device)) {
  MxTensor t;
  t.data_ = make(data_shape(shape, axis), DType::kE4M3, device);
  t.scales_ = make(scales_shape(shape, axis), DType::kE8M0, device);
  t.shape_ = shape;
  t.axis_ = axis;
  return t;
}

MxTensor MxTensor::empty(const Shape& shape, MxAxis axis, Device device) {
  return allocate(shape, axis, device, &Tensor::empty);
}

MxTensor MxTensor::poisoned(const Shape& shape, MxAxis axis, Device device) {
  return allocate(shape, axis, device, &Tensor::poisoned);
}

MxTensor MxTensor::to(Device device) const {
  MxTensor t = *this;
  t.data_ = data_.to(device);
  t.scales_ = scales_.to(device);
  return t;
}

MxTensor MxTensor::stored_as_dim0() const {
  MxTensor t = *this;
  t.shape_ = data_.shape();
  t.axis_ = MxAxis::kDim0;
  return t;
}

}  // namespace mt
