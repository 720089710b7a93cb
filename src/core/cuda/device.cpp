// GPU discovery, the whole-device wait and the event clock: what the CLI and the profiler need
// without pulling in the kernels' headers (host code only: compiled as C++).
#include "core/cuda/device.h"

#include <cuda_runtime.h>

#include <vector>

#include "core/cuda/check.h"
#include "core/profile.h"

namespace mt::cuda {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

int64_t device_memory_bytes() {
  size_t free_bytes = 0, total = 0;
  if (cudaMemGetInfo(&free_bytes, &total) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return static_cast<int64_t>(total);
}

void synchronize() {
  cudaDeviceSynchronize();
}

void clear_last_error() {
  (void)cudaGetLastError();
}

bool pin_host_memory(void* p, size_t bytes) {
  if (cudaHostRegister(p, bytes, cudaHostRegisterDefault) == cudaSuccess) return true;
  (void)cudaGetLastError();
  return false;
}

void unpin_host_memory(void* p) {
  if (cudaHostUnregister(p) != cudaSuccess) (void)cudaGetLastError();
}

namespace {

// Events are reused: a step marks a few per layer, and creating one costs more than recording it.
std::vector<cudaEvent_t>& free_events() {
  thread_local std::vector<cudaEvent_t> events;
  return events;
}

void* mark() {
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  MT_CUDA_CHECK(cudaStreamIsCapturing(stream(), &capturing));
  if (capturing != cudaStreamCaptureStatusNone) return nullptr;
  cudaEvent_t e;
  if (free_events().empty()) {
    MT_CUDA_CHECK(cudaEventCreate(&e));
  } else {
    e = free_events().back();
    free_events().pop_back();
  }
  MT_CUDA_CHECK(cudaEventRecord(e, stream()));
  return e;
}

double ms_between(void* from, void* to) {
  MT_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(to)));
  float ms = 0;
  MT_CUDA_CHECK(
      cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(from), static_cast<cudaEvent_t>(to)));
  return ms;
}

void release(void* event) {
  free_events().push_back(static_cast<cudaEvent_t>(event));
}

}  // namespace

void use_device_clock() {
  profile::set_device_clock({&mark, &ms_between, &release});
}

std::string device_name(int index) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, index) != cudaSuccess) return "unknown";
  return prop.name;
}

}  // namespace mt::cuda
