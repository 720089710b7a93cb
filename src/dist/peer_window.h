// A window of device memory that every rank of an NCCL communicator can write into its peers'
// copies of (NCCL's symmetric memory over NVLink: ncclMemAlloc, registered once on the
// communicator), with a device communicator of `ctas` LSA barriers: the transport a
// device-initiated exchange writes through (moe/exchange/lsa.h). The window and the device
// communicator belong to the NCCL communicator: it owns this object, frees it before itself, and
// leaks it after an abort (nothing of NCCL's is safe to call then).
#pragma once
#include <nccl.h>

#include <cstddef>
#include <memory>
#include <string>

namespace mt::dist {

class PeerWindow {
 public:
  // Collective over comm. Null (with *why set) when the ranks are not all in one LSA team (one
  // node with peer access) or NCCL refuses the window.
  static std::unique_ptr<PeerWindow> create(ncclComm_t comm, size_t bytes, int ctas,
                                            std::string* why);
  ~PeerWindow();
  PeerWindow(const PeerWindow&) = delete;
  PeerWindow& operator=(const PeerWindow&) = delete;

  size_t bytes() const;
  // The device handles the kernels write through (dist/peer_window.cuh: the LSA pointers and
  // barriers), for nvcc code only.
  struct State;
  const State& state() const { return *s_; }

 private:
  explicit PeerWindow(std::unique_ptr<State> s);
  std::unique_ptr<State> s_;
};

}  // namespace mt::dist
