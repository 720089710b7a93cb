#include "moe/expert_exchange.h"

#include <algorithm>
#include <cstring>

#include "core/profile.h"

#if MOETRAIN_HAS_CUDA
#include "ops/cuda/ops.h"
#endif

namespace mt::moe {

namespace {

// out[i] = in[index[i]] for every row i of out; index i32 on the rows' device.
void gather_rows(const Tensor& in, const Tensor& index, Tensor& out) {
  if (out.dim(0) == 0) return;
#if MOETRAIN_HAS_CUDA
  if (in.device() == Device::kCUDA) return cuda::gather_rows(in, index, out);
#endif
  const size_t row_bytes = in.nbytes() / in.dim(0);
  const char* src = static_cast<const char*>(in.raw());
  char* dst = static_cast<char*>(out.raw());
  const int32_t* at = index.data<int32_t>();
  for (int64_t i = 0; i < out.dim(0); ++i)
    std::memcpy(dst + i * row_bytes, src + at[i] * row_bytes, row_bytes);
}

Tensor index_tensor(const std::vector<int32_t>& index, Device device) {
  Tensor t = Tensor::empty({static_cast<int64_t>(index.size())}, DType::kI32);
  std::copy(index.begin(), index.end(), t.data<int32_t>());
  return t.to(device);
}

}  // namespace

ExpertExchange::ExpertExchange(dist::Communicator& ep, const Tensor& device_offsets) : ep_(&ep) {
  const profile::Span span("ep.counts", device_offsets.device() == Device::kCUDA);
  const int peers = ep.size();
  const int64_t experts = device_offsets.numel() - 1;
  MT_CHECK(experts % peers == 0, "{} experts over {} EP ranks", experts, peers);
  const int64_t local = experts / peers;
  const Device device = device_offsets.device();
  // The counts go through the host (one sync per layer and direction, as torchtitan does).
  const Tensor expert_offsets = device_offsets.to(Device::kCPU);
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
  Tensor local_offsets = Tensor::zeros({local + 1}, DType::kI64);
  std::vector<int32_t> expert_major_source;
  for (int64_t e = 0; e < local; ++e) {
    for (int p = 0; p < peers; ++p) {
      const int64_t n = recv_counts.data<int64_t>()[p * local + e];
      for (int64_t i = 0; i < n; ++i)
        expert_major_source.push_back(static_cast<int32_t>(start[p * local + e] + i));
    }
    local_offsets.data<int64_t>()[e + 1] = static_cast<int64_t>(expert_major_source.size());
  }
  // Combine gathers with the inverse map: source-major row expert_major_source[i] is row i.
  std::vector<int32_t> source_major_source(expert_major_source.size());
  for (size_t i = 0; i < expert_major_source.size(); ++i)
    source_major_source[expert_major_source[i]] = static_cast<int32_t>(i);
  expert_major_source_ = index_tensor(expert_major_source, device);
  source_major_source_ = index_tensor(source_major_source, device);
  local_offsets_ = local_offsets.to(device);
}

Tensor ExpertExchange::dispatch(const Tensor& rows) const {
  const profile::Span span("ep.dispatch", rows.device() == Device::kCUDA);
  const int64_t width = rows.dim(1);
  Tensor received = Tensor::empty({received_rows(), width}, rows.dtype(), rows.device());
  ep_->all_to_all(rows, send_rows_, received, recv_rows_);
  Tensor out = Tensor::empty({received_rows(), width}, rows.dtype(), rows.device());
  gather_rows(received, expert_major_source_, out);
  return out;
}

Tensor ExpertExchange::combine(const Tensor& rows) const {
  const profile::Span span("ep.combine", rows.device() == Device::kCUDA);
  const int64_t width = rows.dim(1);
  Tensor source_major = Tensor::empty({received_rows(), width}, rows.dtype(), rows.device());
  gather_rows(rows, source_major_source_, source_major);
  int64_t total = 0;
  for (int64_t n : send_rows_) total += n;
  Tensor out = Tensor::empty({total, width}, rows.dtype(), rows.device());
  ep_->all_to_all(source_major, recv_rows_, out, send_rows_);
  return out;
}

}  // namespace mt::moe
