#include "moe/expert_exchange.h"

#include <algorithm>
#include <cstring>
#include <numeric>

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

template <class T>
Tensor host_tensor(const std::vector<T>& values, DType dtype) {
  Tensor t = Tensor::empty({static_cast<int64_t>(values.size())}, dtype);
  std::copy(values.begin(), values.end(), t.data<T>());
  return t;
}

}  // namespace

ExchangeMaps exchange_maps_reference(const std::vector<int64_t>& recv_counts, int peers) {
  const int64_t local = static_cast<int64_t>(recv_counts.size()) / peers;
  // Start of (peer p, local expert e) in the receive buffer.
  std::vector<int64_t> start(recv_counts.size());
  int64_t at = 0;
  for (size_t s = 0; s < recv_counts.size(); ++s) {
    start[s] = at;
    at += recv_counts[s];
  }
  ExchangeMaps m;
  m.local_offsets.assign(local + 1, 0);
  for (int64_t e = 0; e < local; ++e) {
    for (int p = 0; p < peers; ++p)
      for (int64_t i = 0; i < recv_counts[p * local + e]; ++i)
        m.expert_major_source.push_back(static_cast<int32_t>(start[p * local + e] + i));
    m.local_offsets[e + 1] = static_cast<int64_t>(m.expert_major_source.size());
  }
  m.source_major_source.resize(m.expert_major_source.size());
  for (size_t i = 0; i < m.expert_major_source.size(); ++i)
    m.source_major_source[m.expert_major_source[i]] = static_cast<int32_t>(i);
  return m;
}

ExpertExchange::ExpertExchange(dist::Communicator& ep, const Tensor& expert_offsets) : ep_(&ep) {
  const Device device = expert_offsets.device();
  const bool gpu = device == Device::kCUDA;
  const profile::Span span("ep.counts", gpu);
  const int peers = ep.size();
  const int64_t experts = expert_offsets.numel() - 1;
  MT_CHECK(experts % peers == 0, "{} experts over {} EP ranks", experts, peers);
  const int64_t local = experts / peers;

  // counts = [sent per expert | received per (peer, local expert)]; peer p gets the counts of
  // its experts, then both halves are read on the host at once.
  Tensor counts = Tensor::empty({2 * experts}, DType::kI64, device);
  Tensor sent = counts.view(0, {experts, 1}), received = counts.view(experts, {experts, 1});
#if MOETRAIN_HAS_CUDA
  if (gpu) cuda::expert_counts(expert_offsets, sent);
#endif
  if (!gpu) {
    const int64_t* off = expert_offsets.data<int64_t>();
    for (int64_t e = 0; e < experts; ++e) sent.data<int64_t>()[e] = off[e + 1] - off[e];
  }
  const std::vector<int64_t> per_peer(peers, local);
  ep.all_to_all(sent, per_peer, received, per_peer);
  const Tensor host = counts.to(Device::kCPU);
  const int64_t* sent_counts = host.data<int64_t>();
  const std::vector<int64_t> recv_counts(sent_counts + experts, sent_counts + 2 * experts);

  send_rows_.assign(peers, 0);
  recv_rows_.assign(peers, 0);
  for (int p = 0; p < peers; ++p)
    for (int64_t e = 0; e < local; ++e) {
      send_rows_[p] += sent_counts[p * local + e];
      recv_rows_[p] += recv_counts[p * local + e];
    }
#if MOETRAIN_HAS_CUDA
  if (gpu) {
    const int64_t rows = std::accumulate(recv_rows_.begin(), recv_rows_.end(), int64_t{0});
    expert_major_source_ = Tensor::empty({rows}, DType::kI32, device);
    source_major_source_ = Tensor::empty({rows}, DType::kI32, device);
    local_offsets_ = Tensor::empty({local + 1}, DType::kI64, device);
    cuda::exchange_maps(received, peers, expert_major_source_, source_major_source_,
                        local_offsets_);
    return;
  }
#endif
  const ExchangeMaps m = exchange_maps_reference(recv_counts, peers);  // on the host
  expert_major_source_ = host_tensor(m.expert_major_source, DType::kI32);
  source_major_source_ = host_tensor(m.source_major_source, DType::kI32);
  local_offsets_ = host_tensor(m.local_offsets, DType::kI64);
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
  const int64_t total = std::accumulate(send_rows_.begin(), send_rows_.end(), int64_t{0});
  Tensor out = Tensor::empty({total, width}, rows.dtype(), rows.device());
  ep_->all_to_all(source_major, recv_rows_, out, send_rows_);
  return out;
}

}  // namespace mt::moe
