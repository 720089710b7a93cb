// The GPU backend: NCCL, one process per GPU (the device is the rank's LOCAL_RANK).
//
// Each communicator's collectives run on its own stream, in issue order, ordered against the
// compute stream (the thread's, cuda::stream()) by events: a collective starts after the work
// queued before it, and compute queued after it waits for it (all_gather_async lets compute run
// on meanwhile: FSDP's prefetch). Host tensors (the trainer's scalars: token counts, loss sums)
// are staged through the device. all_to_all is grouped ncclSend/ncclRecv with per-peer row counts;
// split is ncclCommSplit.
//
// Failure: every collective records a CUDA event; a watchdog thread per communicator aborts it
// (ncclCommAbort) when the oldest outstanding collective has not finished within the timeout, or
// when NCCL reports an asynchronous error (a peer died). The aborted kernels return, and the next
// collective on this rank throws an mt::Error naming the collective, the rank and the cause, so
// every rank exits with a message instead of hanging.
#pragma once
#include <memory>

#include "dist/communicator.h"
#include "dist/socket_backend.h"

namespace mt::dist {

// Selects the GPU LOCAL_RANK and joins the NCCL world of r.world ranks. `bootstrap` is any
// communicator over the same ranks (the TCP one): it carries NCCL's unique id from rank 0.
std::unique_ptr<Communicator> connect_nccl_world(const Rendezvous& r, Communicator& bootstrap);

}  // namespace mt::dist
