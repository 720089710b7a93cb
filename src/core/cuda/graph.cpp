#include "core/cuda/graph.h"

#include <cuda_runtime_api.h>

#include <exception>

#include "core/cuda/check.h"
#include "core/log.h"
#include "core/tensor.h"

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

bool CapturedWork::run(const std::function<void()>& body, const std::string& what) {
  if (graph_ && generation_ != graph_pool_generation()) drop();  // its memory went back
  if (!graph_ && warmed_ && !failed_) {
    const MemoryStats before = memory_stats(Device::kCUDA);
    try {
      const GraphPoolScope pool;
      reset_peak_memory(Device::kCUDA);
      graph_ = Graph::capture(body);
      generation_ = graph_pool_generation();
      peak_bytes_ = memory_stats(Device::kCUDA).peak_bytes - before.current_bytes;
      log::info("captured {} as a CUDA graph", what);
    } catch (const HostSyncInCapture& e) {
      throw HostSyncInCapture(fmt::format("capturing {}: {}", what, e.what()));
    } catch (const Error& e) {
      failed_ = true;
      log::warn("CUDA graph capture of {} failed, running it eagerly: {}", what, e.what());
    }
    note_peak_memory(Device::kCUDA, before.peak_bytes);
  }
  if (graph_) {
    graph_->launch();
    note_peak_memory(Device::kCUDA, memory_stats(Device::kCUDA).current_bytes + peak_bytes_);
    return true;
  }
  const GraphPoolScope pool;
  body();
  warmed_ = true;
  return false;
}

void CapturedWork::drop() {
  graph_.reset();
  warmed_ = false;
}

}  // namespace mt::cuda
