#include "dist/communicator.h"

#include <vector>

#include "core/mx.h"
#include "ops/mx.h"
#include "ops/permute.h"

namespace mt::dist {

namespace {

size_t align16(size_t bytes) {
  return (bytes + 15) / 16 * 16;
}

// Rows of `send` moved to their places in every peer's `recv` along `layout` (the host's reading
// of the slots): the rows peer-major, one all_to_all, each peer's block to its region.
void move_rows(Communicator& c, const Tensor& send, const ops::ExpertPermutation& layout,
               const std::vector<int64_t>& send_rows, const std::vector<int64_t>& recv_rows,
               int64_t capacity, Tensor& recv) {
  const Device device = send.device();
  const int64_t width = send.dim(1);
  int64_t total = 0;
  for (int64_t n : recv_rows) total += n;
  Tensor ordered = Tensor::empty({layout.rows(), width}, send.dtype(), device);
  ops::permute_rows(send, layout, ordered);
  Tensor received = Tensor::empty({total, width}, send.dtype(), device);
  c.all_to_all(ordered, send_rows, received, recv_rows);
  int64_t at = 0;
  for (size_t p = 0; p < recv_rows.size(); ++p) {
    if (recv_rows[p] == 0) continue;
    Tensor region = recv.view(static_cast<int64_t>(p) * capacity * width, {recv_rows[p], width});
    region.copy_from(received.view(at * width, {recv_rows[p], width}));
    at += recv_rows[p];
  }
}

}  // namespace

ScatterWindow scatter_window(int ranks, int64_t capacity, const std::vector<ScatterRowShape>& parts,
                             size_t peer_row_bytes) {
  const auto places = static_cast<size_t>(ranks) * static_cast<size_t>(capacity);
  ScatterWindow w;
  w.bytes = align16(static_cast<size_t>(ranks) * peer_row_bytes);
  for (const ScatterRowShape& part : parts) {
    const auto width = static_cast<size_t>(part.width);
    w.data.push_back(w.bytes);
    if (part.wire == RowWire::kMxfp8) {
      w.bytes += align16(places * width);
      w.scales.push_back(w.bytes);
      w.bytes += align16(places * (width / kMxBlock));
    } else {
      w.bytes += align16(places * width * part.elem_bytes);
      w.scales.push_back(w.bytes);
    }
  }
  return w;
}

void check_row_scatter(const RowScatter& s, int peers) {
  MT_CHECK(s.slot, "scatter_rows without slots");
  const Tensor& slot = *s.slot;
  const int64_t n = slot.ndim() == 2 ? slot.dim(0) : -1;
  expect_shape(slot, {n, peers}, "scatter slots");
  expect_dtype(slot, DType::kI32, "scatter slots");
  for (const ScatterPart& part : s.parts) {
    MT_CHECK(part.send && part.recv, "scatter_rows: a part without its send or recv tensor");
    const Tensor& send = *part.send;
    const Tensor& recv = *part.recv;
    MT_CHECK(send.ndim() == 2 && recv.ndim() == 2 && send.dtype() == recv.dtype() &&
                 send.dim(0) == n && recv.dim(0) == peers * s.capacity &&
                 recv.dim(1) == send.dim(1) && send.device() == slot.device() &&
                 recv.device() == slot.device(),
             "scatter_rows of {} {} into {} {} ({} places per rank, {} ranks, {} rows per part)",
             dtype_name(send.dtype()), shape_str(send.shape()), dtype_name(recv.dtype()),
             shape_str(recv.shape()), s.capacity, peers, n);
    if (part.wire == RowWire::kMxfp8)
      MT_CHECK((send.dtype() == DType::kF32 || send.dtype() == DType::kBF16 ||
                send.dtype() == DType::kF64) &&
                   send.dim(1) % kMxBlock == 0,
               "scatter_rows: an MXFP8 part of {} {} (needs f32, bf16 or f64 rows of a multiple "
               "of {})",
               dtype_name(send.dtype()), shape_str(send.shape()), kMxBlock);
  }
  MT_CHECK(!s.to_peers == !s.from_peers,
           "scatter_rows: per-peer rows need both to_peers and from_peers");
  if (s.to_peers) {
    const int64_t width = s.to_peers->ndim() == 2 ? s.to_peers->dim(1) : -1;
    expect_shape(*s.to_peers, {peers, width}, "per-peer rows sent");
    expect_shape(*s.from_peers, {peers, width}, "per-peer rows received");
    MT_CHECK(s.from_peers->dtype() == s.to_peers->dtype(), "per-peer rows of {} into {}",
             dtype_name(s.to_peers->dtype()), dtype_name(s.from_peers->dtype()));
  }
}

void Communicator::scatter_rows(const Tensor& send, const Tensor& slot, int64_t capacity,
                                Tensor& recv) {
  RowScatter s;
  s.slot = &slot;
  s.capacity = capacity;
  s.parts.push_back({&send, &recv});
  scatter_rows(s);
}

// The slots read on the host become the send layout (peer-major, slot order: a permutation over
// the peers whose rows are the slots' order, since they increase with t) and the row counts of
// one all_to_all per part; an MXFP8 part is quantized before and dequantized after its move.
void Communicator::scatter_rows(const RowScatter& s) {
  const int peers = size();
  check_row_scatter(s, peers);
  const Tensor& slot = *s.slot;
  const int64_t n = slot.dim(0);
  const int64_t capacity = s.capacity;
  if (s.to_peers) {
    const std::vector<int64_t> one(peers, 1);
    all_to_all(*s.to_peers, one, *s.from_peers, one);
  }
  if (s.parts.empty()) return;

  const Tensor host = slot.to(Device::kCPU);
  const int32_t* sl = host.data<int32_t>();
  std::vector<int64_t> send_rows(peers, 0);
  for (int64_t t = 0; t < n; ++t)
    for (int p = 0; p < peers; ++p) {
      const int32_t at = sl[t * peers + p];
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
      const int32_t at = sl[t * peers + p];
      const int64_t row = at < 0 ? -1 : off[p] + at;
      layout.row_of_choice.data<int32_t>()[t * peers + p] = static_cast<int32_t>(row);
      if (row >= 0) layout.source_token.data<int32_t>()[row] = static_cast<int32_t>(t);
    }
  const Device device = slot.device();
  layout.source_token = layout.source_token.to(device);
  layout.row_of_choice = layout.row_of_choice.to(device);
  layout.segments = layout.expert_offsets;

  // Each peer's row count for this rank, then the parts' rows.
  Tensor counts = Tensor::empty({peers}, DType::kI64), theirs = Tensor::empty({peers}, DType::kI64);
  for (int p = 0; p < peers; ++p) counts.data<int64_t>()[p] = send_rows[p];
  const std::vector<int64_t> one(peers, 1);
  Tensor counts_dev = counts.to(device), theirs_dev = theirs.to(device);
  all_to_all(counts_dev, one, theirs_dev, one);
  theirs = theirs_dev.to(Device::kCPU);
  std::vector<int64_t> recv_rows(peers);
  for (int p = 0; p < peers; ++p) recv_rows[p] = theirs.data<int64_t>()[p];
  for (const ScatterPart& part : s.parts) {
    if (part.wire == RowWire::kAsIs) {
      move_rows(*this, *part.send, layout, send_rows, recv_rows, capacity, *part.recv);
      continue;
    }
    const Shape shape = part.send->shape();
    MxTensor out = MxTensor::empty(shape, MxAxis::kDim0, part.send->device());
    ops::mx_quantize(*part.send, part.rule, out);
    // Rows no peer wrote stay undefined; here they decode whatever the buffer held (poisoned).
    MxTensor in = MxTensor::poisoned(part.recv->shape(), MxAxis::kDim0, part.recv->device());
    move_rows(*this, out.data(), layout, send_rows, recv_rows, capacity, in.data());
    move_rows(*this, out.scales(), layout, send_rows, recv_rows, capacity, in.scales());
    ops::mx_dequantize(in, *part.recv);
  }
}

}  // namespace mt::dist
