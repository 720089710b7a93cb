// GPU discovery and the whole-device wait: what the CLI and the profiler need without pulling in
// the kernels' headers.
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
