#include "core/cuda/stream.h"

#include "core/cuda/check.h"

namespace mt::cuda {

namespace {
bool capturing() {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  MT_CUDA_CHECK(cudaStreamIsCapturing(stream(), &status));
  return status == cudaStreamCaptureStatusActive;
}
}  // namespace

Fence::Fence(FenceReach reach) : reach_(reach) {
  MT_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
}

Fence::~Fence() {
  cudaEventDestroy(event_);  // waits already queued on it still hold
}

void Fence::record() {
  const bool external = reach_ == FenceReach::kBeyondGraph && capturing();
  MT_CUDA_CHECK(cudaEventRecordWithFlags(
      event_, stream(), external ? cudaEventRecordExternal : cudaEventRecordDefault));
}

void Fence::wait() const {
  const bool external = reach_ == FenceReach::kBeyondGraph && capturing();
  MT_CUDA_CHECK(cudaStreamWaitEvent(stream(), event_,
                                    external ? cudaEventWaitExternal : cudaEventWaitDefault));
}

SideStream::SideStream() {
  MT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
}

SideStream::~SideStream() {
  cudaStreamDestroy(stream_);  // returns at once; the work queued on it still runs
}

}  // namespace mt::cuda
