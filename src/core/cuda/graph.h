// CUDA graph capture of a stretch of work on the thread's stream (cuda::stream()): captured once,
// then replayed with one launch. What the body queues must not wait for the host (no read-back,
// no synchronising call); a body that does makes capture() throw, naming the CUDA error, and
// leaves the stream usable.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace mt::cuda {

class Graph {
 public:
  // Captures body's work (the work does not run); throws mt::Error when it cannot be captured.
  static std::unique_ptr<Graph> capture(const std::function<void()>& body);
  ~Graph();
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  void launch();  // queues one replay on the thread's stream

 private:
  struct Handles;
  explicit Graph(std::unique_ptr<Handles> h);
  std::unique_ptr<Handles> h_;
};

// One stretch of work that runs eagerly once (the warm-up makes cuDNN plans, cuBLASLt heuristics
// and the graph pool's blocks), is captured on its second run and replayed from then on. Every
// run allocates from the graph pool; a replay reports the capture's peak to the memory
// statistics. A capture that fails is warned about once (naming `what`) and leaves the work eager.
class CapturedWork {
 public:
  // Runs body's work; true when it ran as a replay. `what` names it in the log ("the optimizer
  // step").
  bool run(const std::function<void()>& body, const std::string& what);
  // A buffer the capture addresses moved: warm up and capture again.
  void drop();

 private:
  std::unique_ptr<Graph> graph_;
  int64_t generation_ = 0;  // graph_pool_generation() at capture
  int64_t peak_bytes_ = 0;  // what a replay adds to the device memory in use at its start
  bool warmed_ = false;
  bool failed_ = false;
};

}  // namespace mt::cuda
