#include "moe/expert_exchange.h"

#include <array>
#include <numeric>

#include "core/enum_names.h"
#include "core/profile.h"
#include "ops/mx.h"

namespace mt::moe {

namespace {
constexpr std::array<EnumName<ExchangeMode>, 2> kModes = {{
    {ExchangeMode::kHostCounts, "host"},
    {ExchangeMode::kDeviceCounts, "device"},
}};
}  // namespace

std::string_view exchange_mode_name(ExchangeMode m) {
  return enum_name(kModes, m);
}

bool parse_exchange_mode(std::string_view name, ExchangeMode* out) {
  return parse_enum(kModes, name, out);
}

ExpertExchange::ExpertExchange(dist::Communicator& ep, const Tensor& expert_index, int64_t experts,
                               ExchangeMode mode)
    : ep_(&ep), mode_(mode), tokens_(expert_index.dim(0)) {
  const Device device = expert_index.device();
  const profile::Span span("ep.counts", device == Device::kCUDA);
  const int peers = ep.size();
  MT_CHECK(experts % peers == 0, "{} experts over {} EP ranks", experts, peers);
  const int64_t local = experts / peers;
  Tensor to_peer = Tensor::empty({tokens_, peers}, DType::kI32, device);
  ops::peer_choices(expert_index, peers, local, to_peer);
  if (mode == ExchangeMode::kHostCounts)
    plan_host_counts(expert_index, to_peer, local);
  else
    plan_device_counts(expert_index, to_peer, local);
}

// counts = [sent | received], each (peers, L + 1): per rank its experts' choices, then its
// tokens. Rank p gets row p of what is sent; both halves are read on the host at once.
void ExpertExchange::plan_host_counts(const Tensor& expert_index, const Tensor& to_peer,
                                      int64_t local) {
  const Device device = expert_index.device();
  const int peers = ep_->size();
  Tensor counts = Tensor::empty({2 * peers, local + 1}, DType::kI64, device);
  Tensor sent = counts.view(0, {peers, local + 1});
  Tensor received = counts.view(peers * (local + 1), {peers, local + 1});
  ops::peer_counts(expert_index, peers, local, sent);
  const std::vector<int64_t> one_row(peers, 1);
  ep_->all_to_all(sent, one_row, received, one_row);
  const Tensor host = counts.to(Device::kCPU);
  const int64_t* c = host.data<int64_t>();
  send_tokens_.assign(peers, 0);
  recv_tokens_.assign(peers, 0);
  for (int p = 0; p < peers; ++p) {
    send_tokens_[p] = c[p * (local + 1) + local];
    recv_tokens_[p] = c[(peers + p) * (local + 1) + local];
    for (int64_t e = 0; e < local; ++e) local_rows_ += c[(peers + p) * (local + 1) + e];
  }
  received_tokens_ = std::accumulate(recv_tokens_.begin(), recv_tokens_.end(), int64_t{0});
  ops::make_expert_permutation(
      to_peer, peers, to_peers_, 1,
      std::accumulate(send_tokens_.begin(), send_tokens_.end(), int64_t{0}));
  const Tensor choices = dispatch(expert_index);
  local_index_ = Tensor::empty(choices.shape(), DType::kI32, device);
  ops::local_choices(choices, ep_->rank(), local, local_index_);
}

// The counts go device to device (a fixed all-to-all of one row per rank) and stay there: they
// mark which places of each region hold a token (local_choices, region_slots).
void ExpertExchange::plan_device_counts(const Tensor& expert_index, const Tensor& to_peer,
                                        int64_t local) {
  const Device device = expert_index.device();
  const int peers = ep_->size();
  const int64_t k = expert_index.dim(1);
  Tensor sent = Tensor::empty({peers, local + 1}, DType::kI64, device);
  Tensor received = Tensor::empty({peers, local + 1}, DType::kI64, device);
  ops::peer_counts(expert_index, peers, local, sent);
  const std::vector<int64_t> one_row(peers, 1);
  ep_->all_to_all(sent, one_row, received, one_row);

  received_tokens_ = peers * tokens_;
  local_rows_ = received_tokens_ * std::min(k, local);
  ops::make_expert_permutation(to_peer, peers, to_peers_, 1, tokens_ * peers);
  send_slot_ = Tensor::empty({tokens_, peers}, DType::kI32, device);
  ops::slots_within_experts(to_peer, to_peers_, 0, send_slot_);
  // Combine's rows come back into the same regions: token t's row from rank p at p * N + slot.
  from_peers_.row_of_choice = Tensor::empty({tokens_ * peers}, DType::kI32, device);
  Tensor back_rows = from_peers_.row_of_choice.reshape({tokens_, peers});
  ops::slots_within_experts(to_peer, to_peers_, tokens_, back_rows);
  return_slot_ = Tensor::empty({received_tokens_, peers}, DType::kI32, device);
  ops::region_slots(received, tokens_, return_slot_);
  const Tensor choices = send_rows(expert_index);
  local_index_ = Tensor::empty(choices.shape(), DType::kI32, device);
  ops::local_choices(choices, ep_->rank(), local, local_index_, &received);
}

Tensor ExpertExchange::send_rows(const Tensor& rows) const {
  const Device device = rows.device();
  Tensor received = Tensor::empty({received_tokens_, rows.dim(1)}, rows.dtype(), device);
  if (mode_ == ExchangeMode::kDeviceCounts) {
    ep_->scatter_rows(rows, send_slot_, tokens_, received);
    return received;
  }
  Tensor send = Tensor::empty({to_peers_.rows(), rows.dim(1)}, rows.dtype(), device);
  ops::permute_rows(rows, to_peers_, send);
  ep_->all_to_all(send, send_tokens_, received, recv_tokens_);
  return received;
}

Tensor ExpertExchange::dispatch(const Tensor& rows, const ops::ExpertPrecision& wire) const {
  const Device device = rows.device();
  const profile::Span span("ep.dispatch", device == Device::kCUDA);
  MT_CHECK(rows.ndim() == 2 && rows.dim(0) == tokens_, "dispatch of {} rows for {} tokens",
           shape_str(rows.shape()), tokens_);
  if (wire.dispatch == ops::DispatchDtype::kBf16) return send_rows(rows);
  // Each token quantized once, before it is sent (to one rank or several).
  MxTensor out = MxTensor::empty(rows.shape(), MxAxis::kDim0, device);
  ops::mx_quantize(rows, wire.rule, out);
  MxTensor in = MxTensor::empty({received_tokens_, rows.dim(1)}, MxAxis::kDim0, device);
  in.data() = send_rows(out.data());
  in.scales() = send_rows(out.scales());
  Tensor received = Tensor::empty({received_tokens_, rows.dim(1)}, rows.dtype(), device);
  ops::mx_dequantize(in, received);
  return received;
}

void ExpertExchange::combine(const Tensor& rows, Tensor& out, const Tensor* residual) const {
  const profile::Span span("ep.combine", rows.device() == Device::kCUDA);
  MT_CHECK(rows.ndim() == 2 && rows.dim(0) == received_tokens_,
           "combine of {} rows for {} received tokens", shape_str(rows.shape()), received_tokens_);
  expect_shape(out, {tokens_, rows.dim(1)}, "combined rows");
  if (mode_ == ExchangeMode::kDeviceCounts) {
    Tensor back = Tensor::empty({received_tokens_, rows.dim(1)}, rows.dtype(), rows.device());
    ep_->scatter_rows(rows, return_slot_, tokens_, back);
    return ops::combine_forward(back, from_peers_, out, residual);
  }
  Tensor back = Tensor::empty({to_peers_.rows(), rows.dim(1)}, rows.dtype(), rows.device());
  ep_->all_to_all(rows, recv_tokens_, back, send_tokens_);
  ops::combine_forward(back, to_peers_, out, residual);
}

}  // namespace mt::moe
