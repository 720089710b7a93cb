#include "dist/communicator.h"

#include <vector>

#include "ops/permute.h"

namespace mt::dist {

// The slots read on the host become the send layout (peer-major, slot order: a permutation over
// the peers whose rows are the slots' order, since they increase with t), the row counts of one
// all_to_all, and each peer's block placed at its region of recv.
void Communicator::scatter_rows(const Tensor& send, const Tensor& slot, int64_t capacity,
                                Tensor& recv) {
  const int peers = size();
  const int64_t n = send.dim(0);
  MT_CHECK(send.ndim() == 2 && recv.ndim() == 2 && send.dtype() == recv.dtype() &&
               recv.dim(0) == peers * capacity && recv.dim(1) == send.dim(1),
           "scatter_rows of {} {} into {} {} ({} places per rank, {} ranks)",
           dtype_name(send.dtype()), shape_str(send.shape()), dtype_name(recv.dtype()),
           shape_str(recv.shape()), capacity, peers);
  expect_shape(slot, {n, peers}, "scatter slots");
  expect_dtype(slot, DType::kI32, "scatter slots");
  const Tensor host = slot.to(Device::kCPU);
  const int32_t* s = host.data<int32_t>();
  std::vector<int64_t> send_rows(peers, 0);
  for (int64_t t = 0; t < n; ++t)
    for (int p = 0; p < peers; ++p) {
      const int32_t at = s[t * peers + p];
      if (at < 0) continue;
      MT_CHECK(at == send_rows[p] && at < capacity,
               "scatter slot {} of row {} for rank {}: slots must run 0, 1, ... below {}", at, t, p,
               capacity);
      ++send_rows[p];
    }
  ops::ExpertPermutation layout;
  layout.expert_offsets = Tensor::empty({peers + 1}, DType::kI64);
  int64_t* off = layout.expert_offsets.data<int64_t>();
  off[0] = 0;
  for (int p = 0; p < peers; ++p) off[p + 1] = off[p] + send_rows[p];
  layout.source_token = Tensor::empty({off[peers]}, DType::kI32);
  layout.row_of_choice = Tensor::empty({n * peers}, DType::kI32);
  for (int64_t t = 0; t < n; ++t)
    for (int p = 0; p < peers; ++p) {
      const int32_t at = s[t * peers + p];
      const int64_t row = at < 0 ? -1 : off[p] + at;
      layout.row_of_choice.data<int32_t>()[t * peers + p] = static_cast<int32_t>(row);
      if (row >= 0) layout.source_token.data<int32_t>()[row] = static_cast<int32_t>(t);
    }
  const Device device = send.device();
  layout.source_token = layout.source_token.to(device);
  layout.row_of_choice = layout.row_of_choice.to(device);
  layout.segments = layout.expert_offsets;
  Tensor ordered = Tensor::empty({off[peers], send.dim(1)}, send.dtype(), device);
  ops::permute_rows(send, layout, ordered);

  // Each peer's row count for this rank, then the rows.
  Tensor counts = Tensor::empty({peers}, DType::kI64), theirs = Tensor::empty({peers}, DType::kI64);
  for (int p = 0; p < peers; ++p) counts.data<int64_t>()[p] = send_rows[p];
  const std::vector<int64_t> one(peers, 1);
  Tensor counts_dev = counts.to(device), theirs_dev = theirs.to(device);
  all_to_all(counts_dev, one, theirs_dev, one);
  theirs = theirs_dev.to(Device::kCPU);
  std::vector<int64_t> recv_rows(peers);
  int64_t total = 0;
  for (int p = 0; p < peers; ++p) total += recv_rows[p] = theirs.data<int64_t>()[p];
  Tensor received = Tensor::empty({total, send.dim(1)}, send.dtype(), device);
  all_to_all(ordered, send_rows, received, recv_rows);
  const int64_t width = send.dim(1);
  int64_t at = 0;
  for (int p = 0; p < peers; ++p) {
    if (recv_rows[p] == 0) continue;
    Tensor region = recv.view(p * capacity * width, {recv_rows[p], width});
    region.copy_from(received.view(at * width, {recv_rows[p], width}));
    at += recv_rows[p];
  }
}

}  // namespace mt::dist
