// The device side of a PeerWindow (dist/peer_window.h), for the kernels that write through it.
#pragma once
#include <nccl_device.h>

#include "dist/peer_window.h"

namespace mt::dist {

struct PeerWindow::State {
  ncclComm_t comm = nullptr;
  void* buffer = nullptr;
  size_t bytes = 0;
  int ctas = 0;
  ncclWindow_t window{};
  ncclDevComm dev{};
  bool registered = false, dev_created = false;
};

}  // namespace mt::dist
