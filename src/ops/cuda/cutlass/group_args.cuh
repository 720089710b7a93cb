// What CUTLASS's pointer-array grouped kernels (grouped_gemm_sm90.cuh, fp8_gemm_sm90.cuh) share
// in building their arguments: one device allocation carved into the per-group arrays, the
// plain epilogue (D = alpha acc + beta C, alpha 1, beta 0 or 1), and the SM count.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/kernel_hardware_info.h"

namespace mt::cuda::cutlass_groups {

constexpr size_t round256(size_t bytes) {
  return (bytes + 255) / 256 * 256;
}

// Hands out consecutive 256-byte aligned arrays of one allocation; with a null base it only
// counts their bytes (`used`).
struct Carver {
  char* base = nullptr;
  size_t used = 0;
  template <class T>
  void take(T*& field, size_t count) {
    field = base ? reinterpret_cast<T*>(base + used) : nullptr;
    used += round256(sizeof(T) * count);
  }
};

// The epilogue's linear combination with scalar alpha 1 and beta 1 (accumulate into the output)
// or 0 (overwrite: the epilogue never reads it).
template <class Fusion>
void plain_epilogue(Fusion& f, bool accumulate) {
  f.alpha = 1.0f;
  f.beta = accumulate ? 1.0f : 0.0f;
  f.alpha_ptr = nullptr;
  f.beta_ptr = nullptr;
  f.alpha_ptr_array = nullptr;
  f.beta_ptr_array = nullptr;
  f.dAlpha = {cute::_0{}, cute::_0{}, 0};
  f.dBeta = {cute::_0{}, cute::_0{}, 0};
}

// The GPU's SM count for Kernel, read once (one GPU per process).
template <class Kernel>
const cutlass::KernelHardwareInfo& hardware_info() {
  static const cutlass::KernelHardwareInfo hw =
      cutlass::KernelHardwareInfo::make_kernel_hardware_info<Kernel>(0);
  return hw;
}

// Checks, initialises (its own workspace after the group arrays) and launches a grouped GEMM.
template <class Gemm>
cudaError_t launch(const typename Gemm::Arguments& args, void* workspace, cudaStream_t stream) {
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return cudaErrorInvalidValue;
  if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess)
    return cudaErrorInvalidValue;
  if (gemm.run(stream) != cutlass::Status::kSuccess) return cudaErrorLaunchFailure;
  return cudaGetLastError();
}

}  // namespace mt::cuda::cutlass_groups
