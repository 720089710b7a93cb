// The forward (short K) and input-gradient products of the expert GEMMs over 128-row segments
// with fixed TMA descriptors (see fixed_gemm_sm90.cuh), with the tiles and schedules the grouped
// kernels use for the same products.
#include "ops/cuda/cutlass/grouped_gemm_fixed_sm90.cuh"
#include "ops/cuda/grouped_gemm.h"

namespace mt::cuda::kernels {

namespace {
namespace f = fixed_sm90;
using cute::_128;
using cute::_256;
using cute::_64;
using cute::Shape;
using ForwardShortK = f::Config<f::Product::kForward, Shape<_128, _128, _64>, f::Pingpong>;
using InputGradient = f::Config<f::Product::kInputGradient, Shape<_128, _256, _64>, f::Cooperative>;
}  // namespace

size_t cutlass_fixed_forward_workspace(int64_t capacity, int64_t n) {
  return f::workspace_bytes(capacity, n, ForwardShortK::kTileN);
}
size_t cutlass_fixed_input_gradient_workspace(int64_t capacity, int64_t k) {
  return f::workspace_bytes(capacity, k, InputGradient::kTileN);
}

cudaError_t cutlass_fixed_forward(const int64_t* segments, int experts, const void* x,
                                  const void* w, void* out, int64_t capacity, int64_t k, int64_t n,
                                  void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (k > kCutlassShortK) return cudaErrorInvalidValue;  // the tile is the short-K one
  return f::run<f::Product::kForward, ForwardShortK>(segments, experts, x, w, out, capacity, k, n,
                                                     workspace, workspace_bytes, stream);
}

cudaError_t cutlass_fixed_input_gradient(const int64_t* segments, int experts, const void* dy,
                                         const void* w, void* dx, int64_t capacity, int64_t k,
                                         int64_t n, void* workspace, size_t workspace_bytes,
                                         cudaStream_t stream) {
  return f::run<f::Product::kInputGradient, InputGradient>(
      segments, experts, dy, w, dx, capacity, k, n, workspace, workspace_bytes, stream);
}

}  // namespace mt::cuda::kernels
