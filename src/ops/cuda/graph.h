// CUDA graph capture of a stretch of work on the thread's stream (cuda::stream()): captured once,
// then replayed with one launch. What the body queues must not wait for the host (no read-back,
// no synchronising call); a body that does makes capture() throw, naming the CUDA error, and
// leaves the stream usable.
#pragma once
#include <functional>
#include <memory>

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

}  // namespace mt::cuda
