#include "moe/expert_exchange.h"

#include <cstring>

namespace mt::moe {

namespace {
// out[i] = in[index[i]] (gather) or out[index[i]] = in[i] (scatter), whole rows of bytes.
enum class Direction { kGather, kScatter };
void move_rows(const Tensor& in, Tensor& out, const std::vector<int64_t>& index, Direction dir) {
  const int64_t rows = static_cast<int64_t>(index.size());
  if (rows == 0) return;
  const size_t row_bytes = in.nbytes() / in.dim(0);
  const char* src = static_cast<const char*>(in.raw());
  char* dst = static_cast<char*>(out.raw());
  for (int64_t i = 0; i < rows; ++i) {
    if (dir == Direction::kGather)
      std::memcpy(dst + i * row_bytes, src + index[i] * row_bytes, row_bytes);
    else
      std::memcpy(dst + index[i] * row_bytes, src + i * row_bytes, row_bytes);
  }
}
}  // namespace

ExpertExchange::ExpertExchange(dist::Communicator& ep, const Tensor& expert_offsets) : ep_(&ep) {
  const int peers = ep.size();
  const int64_t experts = expert_offsets.numel() - 1;
  MT_CHECK(experts % peers == 0, "{} experts over {} EP ranks", experts, peers);
  const int64_t local = experts / peers;
  const int64_t* off = expert_offsets.data<int64_t>();

  // Exchange per-expert counts: peer p gets the counts of its experts.
  Tensor send_counts = Tensor::empty({experts, 1}, DType::kI64);
  for (int64_t e = 0; e < experts; ++e) send_counts.data<int64_t>()[e] = off[e + 1] - off[e];
  Tensor recv_counts = Tensor::empty({experts, 1}, DType::kI64);  // (peer, local expert)
  const std::vector<int64_t> per_peer(peers, local);
  ep.all_to_all(send_counts, per_peer, recv_counts, per_peer);

  send_rows_.assign(peers, 0);
  recv_rows_.assign(peers, 0);
  for (int p = 0; p < peers; ++p) {
    send_rows_[p] = off[(p + 1) * local] - off[p * local];
    for (int64_t e = 0; e < local; ++e) recv_rows_[p] += recv_counts.data<int64_t>()[p * local + e];
  }
  // Start of (peer p, local expert e) in the receive buffer.
  std::vector<int64_t> start(peers * local);
  int64_t at = 0;
  for (int p = 0; p < peers; ++p)
    for (int64_t e = 0; e < local; ++e) {
      start[p * local + e] = at;
      at += recv_counts.data<int64_t>()[p * local + e];
    }
  local_offsets_ = Tensor::zeros({local + 1}, DType::kI64);
  for (int64_t e = 0; e < local; ++e) {
    for (int p = 0; p < peers; ++p) {
      const int64_t n = recv_counts.data<int64_t>()[p * local + e];
      for (int64_t i = 0; i < n; ++i) expert_major_source_.push_back(start[p * local + e] + i);
    }
    local_offsets_.data<int64_t>()[e + 1] = static_cast<int64_t>(expert_major_source_.size());
  }
}

Tensor ExpertExchange::dispatch(const Tensor& rows) const {
  const int64_t width = rows.dim(1);
  Tensor received = Tensor::empty({received_rows(), width}, rows.dtype());
  ep_->all_to_all(rows, send_rows_, received, recv_rows_);
  Tensor out = Tensor::empty({received_rows(), width}, rows.dtype());
  move_rows(received, out, expert_major_source_, Direction::kGather);
  return out;
}

Tensor ExpertExchange::combine(const Tensor& rows) const {
  const int64_t width = rows.dim(1);
  Tensor source_major = Tensor::empty({received_rows(), width}, rows.dtype());
  move_rows(rows, source_major, expert_major_source_, Direction::kScatter);
  int64_t total = 0;
  for (int64_t n : send_rows_) total += n;
  Tensor out = Tensor::empty({total, width}, rows.dtype());
  ep_->all_to_all(source_major, recv_rows_, out, send_rows_);
  return out;
}

}  // namespace mt::moe
