// Rows written straight into the peers' memory over NVLink, with NCCL's device API: a symmetric
// buffer (ncclMemAlloc, registered once as a window on the communicator) and a device
// communicator with one LSA barrier per CTA. The scatter kernel passes a barrier (every peer has
// finished with its buffer), stores each row at its place in the peer's window through the
// peer's LSA pointer, passes a second barrier (every row has landed), and the window is copied
// into the caller's tensor. Nothing waits on the host, so a CUDA graph can hold it. Needs every
// rank in one LSA team (one node, P2P) and the NCCL release it was built against at run time
// (the device API has no ABI guarantee across releases).
#pragma once
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>
#include <memory>
#include <string>

namespace mt::dist {

class LsaScatter {
 public:
  // Collective over comm: a window of `bytes` and `ctas` barriers. Null (with *why set) when
  // the ranks are not all in one LSA team or NCCL refuses the window.
  static std::unique_ptr<LsaScatter> create(ncclComm_t comm, size_t bytes, int ctas,
                                            std::string* why);
  ~LsaScatter();
  LsaScatter(const LsaScatter&) = delete;
  LsaScatter& operator=(const LsaScatter&) = delete;

  size_t bytes() const;
  // send: n rows of row_bytes; slot i32 (n, ranks) on the device: row t goes to peer p's window
  // at row (rank * capacity + slot[t, p]) (-1: not to p); then `out` (ranks * capacity rows)
  // receives this rank's window. Everything on `stream`.
  cudaError_t scatter(const void* send, int64_t n, int64_t row_bytes, const int32_t* slot,
                      int64_t capacity, void* out, cudaStream_t stream);

 private:
  struct State;
  explicit LsaScatter(std::unique_ptr<State> s);
  std::unique_ptr<State> s_;
};

}  // namespace mt::dist
