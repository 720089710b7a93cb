// The multi-process CPU backend: one process per rank on one or several hosts, connected over
// TCP to a hub thread in rank 0's process (MASTER_ADDR:MASTER_PORT). Every collective sends each
// member's contribution to the hub, which answers each member once all have arrived; sums run
// in group-rank order, so results match the in-process backend bit for bit.
//
// Wire format of a message (both directions), little-endian:
//   u32 magic 'MTCM' | u32 op | u32 group | u32 status (0 ok, 1 error) | u64 seq | u64 bytes
//   followed by `bytes` of payload (an error's payload is its text).
// A rank that exits or disconnects makes the hub fail every other rank's collective with a
// message naming it; a collective that some rank never joins fails after the timeout.
#pragma once
#include <memory>
#include <string>

#include "dist/communicator.h"

namespace mt::dist {

// What torchrun (and `moetrain launch`) put in the environment.
struct Rendezvous {
  int rank = 0;
  int world = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  double timeout_s = 300.0;  // MOETRAIN_TIMEOUT_S
};

// True when WORLD_SIZE is set: this process is one rank of a launched job.
bool launched_by_env();
// Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (and MOETRAIN_TIMEOUT_S); a
// missing or malformed variable is a ConfigError naming it.
Rendezvous rendezvous_from_env();

// Connects this rank (rank 0 also starts the hub). Collective over all ranks of the job.
std::unique_ptr<Communicator> connect_socket_world(const Rendezvous& r);

}  // namespace mt::dist
