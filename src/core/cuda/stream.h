// Streams beside the thread's own (core/cuda/check.h: cuda::stream()), and the points where one
// waits for another. A CUDA runtime service, not op code: work moves to a side stream by a
// StreamScope, and every op queues on whatever stream() is.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/cuda/check.h"  // cuda::stream(), cuda::StreamScope

namespace mt::cuda {

// What a fence recorded or waited for while the thread's stream is being captured becomes: an
// external node of the graph (the replay records it, or waits for its latest record when the
// replay runs, so that a captured pass can wait for work queued outside its graph: an optimizer
// step on a side stream), or an edge within the graph (another stream's work captured with the
// thread's, forked from it and joined back: the expert exchange's lane).
enum class FenceReach : uint8_t { kBeyondGraph, kWithinGraph };

// A point in a stream's work that other streams wait for.
class Fence {
 public:
  explicit Fence(FenceReach reach = FenceReach::kBeyondGraph);
  ~Fence();
  Fence(const Fence&) = delete;
  Fence& operator=(const Fence&) = delete;
  void record();      // after the work queued on the thread's stream so far
  void wait() const;  // the thread's stream waits for the latest record (none: no wait)

 private:
  cudaEvent_t event_ = nullptr;
  FenceReach reach_;
};

// A non-blocking stream of the current device, owned; destroying it waits for its work.
class SideStream {
 public:
  SideStream();
  ~SideStream();
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

}  // namespace mt::cuda
