// One check macro for the CUDA runtime (cuBLAS and NCCL get theirs beside their backends): the
// failed statement, the error's name and the place, as an mt::Error.
#pragma once
#if MOETRAIN_HAS_CUDA
#include <cuda_runtime_api.h>

#include "core/error.h"

#define MT_CUDA_CHECK(expr)                                                           \
  do {                                                                                \
    const cudaError_t mt_err_ = (expr);                                               \
    if (mt_err_ != cudaSuccess)                                                       \
      throw ::mt::Error(                                                              \
          ::mt::ExitCode::kInternal,                                                  \
          fmt::format("CUDA error {} ({}) in {} at {}:{}", cudaGetErrorName(mt_err_), \
                      cudaGetErrorString(mt_err_), #expr, __FILE__, __LINE__));       \
  } while (0)

// After a kernel launch: launch-configuration errors now, not at the next sync.
#define MT_CUDA_CHECK_LAUNCH() MT_CUDA_CHECK(cudaGetLastError())

namespace mt::cuda {
namespace detail {
inline thread_local cudaStream_t current_stream = cudaStreamPerThread;
}
// The stream every op, copy and collective of the calling thread runs on: the per-thread default
// stream, or inside a StreamScope its stream. Each thread of the NCCL tests (one GPU each) has its
// own, and a CUDA graph can capture it (the legacy default stream cannot be captured).
inline cudaStream_t stream() {
  return detail::current_stream;
}
// While alive, the thread's work goes to `s` (core/cuda/stream.h: a side stream's work).
class StreamScope {
 public:
  explicit StreamScope(cudaStream_t s) : previous_(detail::current_stream) {
    detail::current_stream = s;
  }
  ~StreamScope() { detail::current_stream = previous_; }
  StreamScope(const StreamScope&) = delete;
  StreamScope& operator=(const StreamScope&) = delete;

 private:
  cudaStream_t previous_;
};
}  // namespace mt::cuda
#endif
