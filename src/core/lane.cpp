#include "core/lane.h"

#include "core/error.h"
#include "core/profile.h"
#if MOETRAIN_HAS_CUDA
#include "core/cuda/stream.h"
#endif

namespace mt {

struct Lane::Streams {
#if MOETRAIN_HAS_CUDA
  Streams() {
    for (auto& e : ends) e = std::make_unique<cuda::Fence>(cuda::FenceReach::kWithinGraph);
  }
  cuda::SideStream side;
  cuda::Fence start{cuda::FenceReach::kWithinGraph};       // where the latest run forks from
  std::array<std::unique_ptr<cuda::Fence>, kPoints> ends;  // each run's end on the lane
#endif
};

Lane::Lane(const char* exposed_span) : exposed_span_(exposed_span) {}
Lane::~Lane() = default;

Lane::Point Lane::run(Device device, const std::function<void()>& work) {
  const Point p = next_++;
  on_gpu_[p % kPoints] = device == Device::kCUDA;
  if (device != Device::kCUDA) {
    work();
    return p;
  }
#if MOETRAIN_HAS_CUDA
  if (!streams_) streams_ = std::make_unique<Streams>();
  Streams& s = *streams_;
  s.start.record();
  {
    const cuda::StreamScope beside(s.side.get());
    s.start.wait();
    work();
    s.ends[p % kPoints]->record();
  }
#else
  MT_CHECK(false, "lane {}: GPU work in a build without CUDA", exposed_span_);
#endif
  return p;
}

void Lane::join(Point p) {
  MT_CHECK(p >= 0 && p < next_ && next_ - p <= kPoints,
           "lane {}: point {} joined with {} runs made (the lane keeps the last {})", exposed_span_,
           p, next_, kPoints);
  if (!on_gpu_[p % kPoints]) return;
#if MOETRAIN_HAS_CUDA
  // Marks on the thread's stream before and after the wait: the time between them is the time
  // it stood still for the lane (zero when the run ended before the stream got here).
  const profile::Span exposed(exposed_span_, true);
  streams_->ends[p % kPoints]->wait();
#endif
}

}  // namespace mt
