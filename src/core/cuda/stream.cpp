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
  // The allocator keeps the blocks freed on this stream under its handle (core/tensor.cpp), and a
  // stream made later may get the same handle: its work must be done before they can be reused.
  // A failed wait (a fault is sticky and shows again at the next call) leaves no error behind
  // for a later launch check to misname.
  if (cudaStreamSynchronize(stream_) != cudaSuccess) (void)cudaGetLastError();
  cudaStreamDestroy(stream_);
}

}  // namespace mt::cuda
