// Helpers of the op families' tests (tests/test_<family>.cpp): the CPU side's short-hands.
#pragma once
#include <algorithm>
#include <initializer_list>

#include "core/tensor.h"
#include "testing.h"

namespace mt {
namespace {

using testing::dot;
using testing::error_of;
using testing::gradcheck;
using testing::kGradTol;
using testing::randn;

inline Tensor i32(std::initializer_list<int32_t> v) {
  Tensor t = Tensor::empty({static_cast<int64_t>(v.size())}, DType::kI32);
  std::copy(v.begin(), v.end(), t.data<int32_t>());
  return t;
}

inline Tensor like(const Tensor& t) {
  return Tensor::poisoned(t.shape(), t.dtype());
}

}  // namespace
}  // namespace mt
