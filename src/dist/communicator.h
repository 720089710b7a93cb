// Collectives over a process group. Tensors are contiguous; all ranks call each collective in
// the same order with the same shapes (as NCCL requires). Backends: in-process threads (CPU
// tests, any world size) and NCCL (one process per GPU).
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/mx_format.h"
#include "core/tensor.h"

namespace mt::dist {

// The most ranks one job may have: a bound that catches a typo in parallel.world or WORLD_SIZE
// before anything is allocated for it.
inline constexpr int64_t kMaxWorld = 65536;

// A collective started in the background: wait() orders its completion before whatever the
// caller queues next (on the GPU, the compute stream waits for it; the host does not). The
// handle keeps the collective's input alive until then.
class PendingCollective {
 public:
  virtual ~PendingCollective() = default;
  virtual void wait() = 0;
};

// One part of a row scatter: send (n, W) rows in the sender's order, any dtype (kMxfp8: f32, bf16
// or f64, which is rounded to f32 first; W a multiple of 32); recv (size * capacity, W) of send's
// dtype, allocated by the caller.
//
// With sum_index (i32 (M, size)) the part arrives summed instead (an as-is part of float rows):
// recv (M, W) row m = residual[m] (when given) + the places sum_index[m, j] for j in order (-1:
// none), fp32 math, one rounding: ops::combine_forward over the places, which a device path
// does as it reads its receive buffer, writing no places.
struct ScatterPart {
  const Tensor* send = nullptr;
  Tensor* recv = nullptr;
  RowWire wire = RowWire::kAsIs;
  MxScaleRule rule = MxScaleRule::kRceil;
  const Tensor* sum_index = nullptr;
  const Tensor* residual = nullptr;
};

// A scatter of several parts with one layout: slot i32 (n, size): row t of every part goes to
// peer p's recv at row rank * capacity + slot[t, p], or nowhere for -1. A peer's slots are
// distinct, below `capacity` and increase with t. Rows of recv no peer wrote are undefined.
// Beside the rows, optionally, one row per peer (the counts that say which places hold rows):
// row p of to_peers (size, C) arrives as row `rank` of peer p's from_peers (size, C).
struct RowScatter {
  const Tensor* slot = nullptr;
  int64_t capacity = 0;
  std::vector<ScatterPart> parts;
  const Tensor* to_peers = nullptr;
  Tensor* from_peers = nullptr;
};

// What a part puts in the device path's receive buffer per place (the layout of
// scatter_window): its row as it crosses.
struct ScatterRowShape {
  int64_t width = 0;      // W
  size_t elem_bytes = 0;  // of the rows' dtype
  RowWire wire = RowWire::kAsIs;
};
// The device path's receive buffer for a scatter of these parts over `ranks` ranks of `capacity`
// places, with per-peer rows of peer_row_bytes: the per-peer rows (ranks of them), then each
// part's places (an MXFP8 part's E4M3 data, then its scales), every section 16-byte aligned.
struct ScatterWindow {
  size_t peer_rows = 0;              // offset of the per-peer rows (0)
  std::vector<size_t> data, scales;  // per part: offset of its rows (and MXFP8 scales)
  size_t bytes = 0;                  // the whole
};
ScatterWindow scatter_window(int ranks, int64_t capacity, const std::vector<ScatterRowShape>& parts,
                             size_t peer_row_bytes);

// Checks a scatter's tensors against each other over `ranks` ranks (an mt::Error names the
// first that does not fit).
void check_row_scatter(const RowScatter& s, int ranks);

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
  // Rows to peers into fixed places, for exchanges whose counts stay on the device (RowScatter
  // above): every part's rows go where the slots say. Nothing is read on the host, so a CUDA
  // graph can hold it. The default lays each peer's region out whole and sends it with
  // all_to_all (capacity rows per peer, the empty places too); NCCL within one node writes every
  // part straight into the peers' buffers from one kernel (symmetric memory over NVLink),
  // quantizing an MXFP8 part as it sends it.
  virtual void scatter_rows(const RowScatter& s);
  // One part of rows as they are.
  void scatter_rows(const Tensor& send, const Tensor& slot, int64_t capacity, Tensor& recv);
  // Reserves the device path's buffer for scatter_rows of up to `bytes` (ScatterWindow::bytes),
  // moved by `ctas` thread blocks, once, before any capture (registering it is collective);
  // returns the bytes reserved, 0 when this backend has no device path (scatter_rows then takes
  // the default; *why says why). A scatter larger than the reserve takes the default too.
  virtual size_t reserve_scatter(size_t bytes, int ctas, std::string* why) {
    (void)bytes;
    (void)ctas;
    *why = "this backend has no device path";
    return 0;
  }
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
