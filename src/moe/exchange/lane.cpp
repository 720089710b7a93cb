#include "moe/exchange/lane.h"

#include "core/error.h"
#include "core/profile.h"
#if MOETRAIN_HAS_CUDA
#include "core/cuda/stream.h"
#endif

namespace mt::moe {

struct ExchangeLane::Streams {
#if MOETRAIN_HAS_CUDA
  Streams() {
    for (auto& e : ends) e = std::make_unique<cuda::Fence>(cuda::FenceReach::kWithinGraph);
  }
  cuda::SideStream side;
  cuda::Fence start{cuda::FenceReach::kWithinGraph};       // where the latest run forks from
  std::array<std::unique_ptr<cuda::Fence>, kPoints> ends;  // each run's end on the lane
#endif
};

ExchangeLane::ExchangeLane() = default;
ExchangeLane::~ExchangeLane() = default;

ExchangeLane::Point ExchangeLane::run(Device device, const std::function<void()>& work) {
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
  MT_CHECK(false, "a GPU exchange in a build without CUDA");
#endif
  return p;
}

void ExchangeLane::join(Point p) {
  MT_CHECK(p >= 0 && p < next_ && next_ - p <= kPoints,
           "exchange lane: point {} joined with {} runs made (the lane keeps the last {})", p,
           next_, kPoints);
  if (!on_gpu_[p % kPoints]) return;
#if MOETRAIN_HAS_CUDA
  // Marks on the thread's stream before and after the wait: the time between them is the time
  // it stood still for the exchange (zero when the run ended before the stream got here).
  const profile::Span exposed(kExposedSpan, true);
  streams_->ends[p % kPoints]->wait();
#endif
}

}  // namespace mt::moe
