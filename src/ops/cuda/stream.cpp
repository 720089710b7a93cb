#include "ops/cuda/stream.h"

#include "core/cuda_check.h"

namespace mt::cuda {

namespace {
bool capturing() {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  MT_CUDA_CHECK(cudaStreamIsCapturing(stream(), &status));
  return status == cudaStreamCaptureStatusActive;
}
}  // namespace

Fence::Fence() {
  MT_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
}

Fence::~Fence() {
  cudaEventDestroy(event_);  // waits already queued on it still hold
}

void Fence::record() {
  MT_CUDA_CHECK(cudaEventRecordWithFlags(
      event_, stream(), capturing() ? cudaEventRecordExternal : cudaEventRecordDefault));
}

void Fence::wait() const {
  MT_CUDA_CHECK(cudaStreamWaitEvent(stream(), event_,
                                    capturing() ? cudaEventWaitExternal : cudaEventWaitDefault));
}

SideStream::SideStream() {
  MT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
}

SideStream::~SideStream() {
  cudaStreamDestroy(stream_);  // returns at once; the work queued on it still runs
}

}  // namespace mt::cuda
