// `moetrain launch -n N -- <args>`: starts N copies of this binary on this host with the
// environment torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and waits.
// When one rank fails (non-zero exit or a signal), the launcher says which, stops the others
// (SIGTERM, then SIGKILL after a grace period) and exits with the failed rank's code. SIGTERM,
// SIGINT or SIGUSR1 to the launcher is passed on to every rank, which stop at their next step
// boundary with a checkpoint (train/stop_request.h): the launcher then exits with their code
// (7); a second such signal stops them at once.
#pragma once
#include <string>
#include <vector>

namespace mt::dist {

struct LaunchOptions {
  int nproc = 1;
  std::vector<std::string> args;  // the moetrain arguments of every rank, e.g. {"train", ...}
  int master_port = 0;            // 0: a free port
  double grace_s = 10.0;
};

int launch_local(const LaunchOptions& opt);

}  // namespace mt::dist
