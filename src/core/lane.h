// Work beside the thread's stream. On the GPU, a stream of its own: the expert exchanges, which
// cross while the experts compute on another chunk of tokens (moe_layer.h, MoeComms::chunks), and
// a block's forward FP8 tiles, made while the block before it runs (fsdp.h, UnitSchedule). Each
// run starts after the work the thread's stream has queued so far; its user joins a run before
// it reads what the run made, and joins every run before its pass ends, so that a captured pass
// holds both streams' work in its one graph. On the CPU a run is the caller's own code, in order.
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

namespace mt {

class Lane {
 public:
  // exposed_span: the profile span (core/profile.h) that times the thread's stream standing still
  // at a join, a literal.
  explicit Lane(const char* exposed_span);
  ~Lane();
  Lane(const Lane&) = delete;
  Lane& operator=(const Lane&) = delete;

  // The end of a run: what join() waits for. The lane keeps the last kPoints ends; a point is
  // joined before that many more runs have started (an MoE layer makes at most two per chunk;
  // FSDP's tiles one a unit, joined before the next starts).
  using Point = int64_t;
  static constexpr int kPoints = 64;

  // Runs `work` (host code whose GPU work on `device` goes to the lane) and returns its end.
  Point run(Device device, const std::function<void()>& work);
  // The thread's stream waits for the lane's work up to p (every run before it included). On the
  // GPU the wait is a profile::Span named exposed_span: the lane's time the overlap left exposed.
  void join(Point p);

 private:
  const char* exposed_span_;
  struct Streams;  // the CUDA stream and the marks, made at the first GPU run
  std::unique_ptr<Streams> streams_;
  Point next_ = 0;
  std::array<bool, kPoints> on_gpu_{};  // whether point p % kPoints ended GPU work
};

}  // namespace mt
