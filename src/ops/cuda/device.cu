// GPU discovery. The CUDA kernels of every op arrive with the CUDA backend; until then this is
// what lets the trainer tell "no GPU" from "GPU present, kernels not built".
#include <cuda_runtime.h>

#include "ops/cuda/device.h"

namespace mt::cuda {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

void synchronize() {
  cudaDeviceSynchronize();
}

std::string device_name(int index) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, index) != cudaSuccess) return "unknown";
  return prop.name;
}

}  // namespace mt::cuda
