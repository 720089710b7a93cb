// Expert-parallel dispatch and combine. Rows leave the router in local expert-major order (all E
// experts); experts [p*E/ep, (p+1)*E/ep) live on EP rank p, so each peer's rows are one
// contiguous range. Dispatch sends them, then regroups what arrived (source-major) into
// expert-major order over this rank's experts; combine is the exact inverse. Both are linear
// maps and each is the other's backward.
//
// Counts: an all-to-all of E/ep counts per peer (on the GPU, device to device), then one read of
// the sent and received counts on the host, which NCCL needs for the row all-to-all's sizes (the
// layer's one wait for the device, as in torchtitan). The regrouping maps are built where the
// rows are (a kernel on the GPU; exchange_maps_reference on the host).
#pragma once
#include <vector>

#include "core/tensor.h"
#include "dist/communicator.h"

namespace mt::moe {

// The regrouping of received rows: recv_counts[p * local + e] rows arrive from peer p for local
// expert e, laid out peer-major (peer 0's rows for expert 0, 1, ..., then peer 1's, ...).
// Expert-major row i is receive row expert_major_source[i]; receive row j is expert-major row
// source_major_source[j]; expert e's rows are [local_offsets[e], local_offsets[e + 1]).
struct ExchangeMaps {
  std::vector<int32_t> expert_major_source, source_major_source;
  std::vector<int64_t> local_offsets;
};
ExchangeMaps exchange_maps_reference(const std::vector<int64_t>& recv_counts, int peers);

class ExpertExchange {
 public:
  // expert_offsets: i64 (E + 1) of the local permutation, on the rows' device. Collective over
  // `ep`; waits once for the device (the exchanged counts, read on the host).
  ExpertExchange(dist::Communicator& ep, const Tensor& expert_offsets);

  int64_t received_rows() const { return expert_major_source_.numel(); }
  // i64 (E/ep + 1): rows of local expert e are [off[e], off[e+1]) of dispatch's output.
  const Tensor& local_offsets() const { return local_offsets_; }

  // rows (M, D) in local expert-major order -> (R, D) rows for this rank's experts.
  Tensor dispatch(const Tensor& rows) const;
  // (R, D) -> (M, D) back in local expert-major order.
  Tensor combine(const Tensor& rows) const;

 private:
  dist::Communicator* ep_;
  std::vector<int64_t> send_rows_;  // per peer
  std::vector<int64_t> recv_rows_;  // per peer
  // Layout of the receive buffer: peer 0's rows (its rows for local expert 0, then 1, ...), then
  // peer 1's, ... Expert-major row i is receive-buffer row expert_major_source_[i], and
  // receive-buffer row j is expert-major row source_major_source_[j] (i32, on the rows' device).
  Tensor expert_major_source_;
  Tensor source_major_source_;
  Tensor local_offsets_;
};

}  // namespace mt::moe
