// Where a layer's expert exchanges run. On the GPU, a stream beside the thread's own: the
// experts compute on one chunk of tokens while another chunk's exchange crosses (moe_layer.h,
// MoeComms::chunks). Each run starts after the work the thread's stream has queued so far; the
// layer joins a run before it reads what the run made, and joins every run before it returns, so
// that a captured pass holds both streams' work in its one graph. On the CPU a run is the
// caller's own code, in order.
//
// Memory (core/tensor.cpp): a block returns to the stream it was allocated on and only that
// stream reuses it, so what a run allocates is safe from the thread's stream. What the thread's
// stream allocated and a run reads or writes must stay alive until the run is joined (the layer
// keeps such tensors until then), and a run releases nothing that the thread's stream uses.
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <memory>

#include "core/tensor.h"

namespace mt::moe {

class ExchangeLane {
 public:
  ExchangeLane();
  ~ExchangeLane();
  ExchangeLane(const ExchangeLane&) = delete;
  ExchangeLane& operator=(const ExchangeLane&) = delete;

  // The end of a run: what join() waits for. The lane keeps the last kPoints ends; a point is
  // joined before that many more runs have started (a layer makes at most two per chunk).
  using Point = int64_t;
  static constexpr int kPoints = 64;

  // Runs `work` (host code whose GPU work on `device` goes to the lane) and returns its end.
  Point run(Device device, const std::function<void()>& work);
  // The thread's stream waits for the lane's work up to p (every run before it included). On the
  // GPU the wait is a profile::Span named kExposedSpan: the exchange time the overlap left exposed.
  void join(Point p);
  static constexpr const char* kExposedSpan = "exposed.ep_exchange";

 private:
  struct Streams;  // the CUDA stream and the marks, made at the first GPU run
  std::unique_ptr<Streams> streams_;
  Point next_ = 0;
  std::array<bool, kPoints> on_gpu_{};  // whether point p % kPoints ended GPU work
};

}  // namespace mt::moe
