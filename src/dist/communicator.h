// Collectives over a process group. Tensors are contiguous; all ranks call each collective in
// the same order with the same shapes (as NCCL requires). Backends: in-process threads (CPU
// tests, any world size) and NCCL (one process per GPU).
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace mt::dist {

// The most ranks one job may have: a bound that catches a typo in parallel.world or WORLD_SIZE
// before anything is allocated for it.
inline constexpr int64_t kMaxWorld = 65536;

// A collective started in the background: wait() orders its completion before whatever the
// caller queues next (on the GPU, the compute stream waits for it; the host does not). The
// handle keeps the collective's input alive until then.
class PeerWindow;

class PendingCollective {
 public:
  virtual ~PendingCollective() = default;
  virtual void wait() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // recv (size * n) = the ranks' send (n) laid end to end in rank order.
  virtual void all_gather(const Tensor& send, Tensor& recv) = 0;
  // The same, overlapping what the caller queues until wait() (NCCL: on the communicator's own
  // stream). recv must not be read, nor send written, before wait(). Backends that cannot
  // overlap gather now.
  virtual std::unique_ptr<PendingCollective> all_gather_async(const Tensor& send, Tensor& recv);
  // recv (n / size) = this rank's chunk of the element-wise sum of every rank's send (n).
  virtual void reduce_scatter(const Tensor& send, Tensor& recv) = 0;
  // The same in the background, as all_gather_async (FSDP's gradient reduction overlaps the
  // next layer's backward).
  virtual std::unique_ptr<PendingCollective> reduce_scatter_async(const Tensor& send, Tensor& recv);
  // Element-wise sum in place (floating and integer dtypes).
  virtual void all_reduce(Tensor& t) = 0;
  // Rows of equal width (send.numel() / rows): send_rows[p] rows go to peer p, in peer order;
  // recv_rows[p] rows arrive from peer p, in peer order.
  virtual void all_to_all(const Tensor& send, const std::vector<int64_t>& send_rows, Tensor& recv,
                          const std::vector<int64_t>& recv_rows) = 0;
  // The device path of a row scatter (moe/exchange/row_scatter.h): a window of at least
  // `bytes` that every rank can write into its peers' copies of, moved by `ctas` thread blocks
  // (dist/peer_window.h), reserved once, before any capture (registering it is collective).
  // Returns the bytes reserved, 0 where this backend has none (*why says why); the window is
  // peer_window() from then on, owned by the communicator.
  virtual size_t reserve_peer_window(size_t bytes, int ctas, std::string* why) {
    (void)bytes;
    (void)ctas;
    *why = "this backend has no device path";
    return 0;
  }
  virtual const PeerWindow* peer_window() const { return nullptr; }
  virtual void barrier() = 0;
  // Hands the work queued so far on the compute stream to the failure watchdog, named `what`:
  // a replayed CUDA graph's collectives, which were captured once and never issued as such.
  // Backends without a watchdog on device work ignore it.
  virtual void watch_queued(const char* what) { (void)what; }
  // Collective: ranks with the same color form a new group, ordered by key (then old rank).
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;
};

// Backends that cannot overlap run the collective at once.
struct FinishedCollective final : PendingCollective {
  void wait() override {}
};

inline std::unique_ptr<PendingCollective> Communicator::all_gather_async(const Tensor& send,
                                                                         Tensor& recv) {
  all_gather(send, recv);
  return std::make_unique<FinishedCollective>();
}

inline std::unique_ptr<PendingCollective> Communicator::reduce_scatter_async(const Tensor& send,
                                                                             Tensor& recv) {
  reduce_scatter(send, recv);
  return std::make_unique<FinishedCollective>();
}

// Runs fn(comm) on `world_size` threads, each with its own in-process communicator. An
// exception on any rank fails the collectives of the others (they throw instead of hanging) and
// is rethrown here. A rank waiting longer than timeout_s in a collective throws, naming the
// rank and the collective.
void run_in_process(int world_size, const std::function<void(Communicator&)>& fn,
                    double timeout_s = 300.0);

}  // namespace mt::dist
