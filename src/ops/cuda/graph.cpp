#include "ops/cuda/graph.h"

#include <cuda_runtime_api.h>

#include <exception>

#include "core/cuda_check.h"

namespace mt::cuda {

struct Graph::Handles {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ~Handles() {
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
  }
};

Graph::Graph(std::unique_ptr<Handles> h) : h_(std::move(h)) {}
Graph::~Graph() = default;

std::unique_ptr<Graph> Graph::capture(const std::function<void()>& body) {
  auto h = std::make_unique<Handles>();
  // Relaxed: the caching allocator may still call cudaMalloc while the pool grows.
  MT_CUDA_CHECK(cudaStreamBeginCapture(stream(), cudaStreamCaptureModeRelaxed));
  std::exception_ptr failure;
  try {
    body();
  } catch (...) {
    failure = std::current_exception();
  }
  const cudaError_t end = cudaStreamEndCapture(stream(), &h->graph);
  (void)cudaGetLastError();  // an invalidated capture leaves its error behind; it is reported here
  if (failure) std::rethrow_exception(failure);
  MT_CHECK(end == cudaSuccess && h->graph != nullptr,
           "CUDA graph capture failed: {} ({}); the captured work waited for the host or used "
           "a call that a capture cannot record",
           cudaGetErrorName(end), cudaGetErrorString(end));
  MT_CUDA_CHECK(cudaGraphInstantiate(&h->exec, h->graph, 0));
  return std::unique_ptr<Graph>(new Graph(std::move(h)));
}

void Graph::launch() {
  MT_CUDA_CHECK(cudaGraphLaunch(h_->exec, stream()));
}

}  // namespace mt::cuda
