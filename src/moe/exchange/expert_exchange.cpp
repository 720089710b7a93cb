#include "moe/exchange/expert_exchange.h"

#include <algorithm>
#include <array>
#include <numeric>

#include "core/enum_names.h"
#include "core/profile.h"
#include "ops/fp8.h"
#include "ops/mx.h"

namespace mt::moe {

namespace {
// A part of the scatter on the FP8 wire: `rows` quantized by `rule` into `received`.
ScatterPart fp8_part(const Tensor& rows, QuantTensor& received, Fp8ScaleRule rule) {
  ScatterPart part{&rows, nullptr, RowWire::kFp8};
  part.recv_fp8 = &received;
  part.fp8_scale = rule;
  return part;
}

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
                               ExchangeMode mode, const std::vector<DispatchRows>& with)
    : ep_(&ep), mode_(mode), tokens_(expert_index.dim(0)) {
  const Device device = expert_index.device();
  const profile::Span span("ep.counts", device == Device::kCUDA);
  const int peers = ep.size();
  MT_CHECK(experts % peers == 0, "{} experts over {} EP ranks", experts, peers);
  const int64_t local = experts / peers;
  Tensor to_peer = Tensor::empty({tokens_, peers}, DType::kI32, device);
  ops::peer_choices(expert_index, peers, local, to_peer);
  if (mode == ExchangeMode::kHostCounts) {
    plan_host_counts(expert_index, to_peer, local);
    for (const DispatchRows& d : with) dispatch(d);
  } else {
    plan_device_counts(expert_index, to_peer, local, with);
  }
}

size_t ExpertExchange::window_bytes(int ep, int64_t tokens, int64_t top_k, int64_t experts,
                                    int64_t dim, DType row_dtype,
                                    const ops::ExpertPrecision& precision) {
  const std::vector<ScatterRowShape> parts = {
      {top_k, sizeof(int32_t), RowWire::kAsIs},          // the choices
      {dim, dtype_size(row_dtype), precision.dispatch},  // the rows
      {top_k, sizeof(float), RowWire::kAsIs},            // their routing weights
  };
  const size_t counts = static_cast<size_t>(experts / ep + 1) * sizeof(int64_t);
  const size_t plan = scatter_window(ep, tokens, parts, counts).bytes;
  // Combine sends rows as they are; the backward's combine the routing weights' gradient too.
  const size_t combine =
      scatter_window(
          ep, tokens,
          {{top_k, sizeof(float), RowWire::kAsIs}, {dim, dtype_size(row_dtype), RowWire::kAsIs}}, 0)
          .bytes;
  return std::max(plan, combine);
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

// One exchange sends the tokens' choices, the rows `with` names, and each rank's counts (a row per
// peer); the counts stay on the device and mark which places of each region hold a token
// (local_choices, region_slots).
void ExpertExchange::plan_device_counts(const Tensor& expert_index, const Tensor& to_peer,
                                        int64_t local, const std::vector<DispatchRows>& with) {
  const Device device = expert_index.device();
  const int peers = ep_->size();
  const int64_t k = expert_index.dim(1);
  Tensor sent = Tensor::empty({peers, local + 1}, DType::kI64, device);
  Tensor received = Tensor::empty({peers, local + 1}, DType::kI64, device);
  ops::peer_counts(expert_index, peers, local, sent);

  received_tokens_ = peers * tokens_;
  local_rows_ = received_tokens_ * std::min(k, local);
  send_slot_ = Tensor::empty({tokens_, peers}, DType::kI32, device);
  ops::peer_slots(to_peer, 0, send_slot_);
  // Combine's rows come back into the same regions: token t's row from rank p at p * N + slot.
  back_place_ = Tensor::empty({tokens_, peers}, DType::kI32, device);
  ops::peer_slots(to_peer, tokens_, back_place_);

  Tensor choices = Tensor::empty({received_tokens_, k}, DType::kI32, device);
  RowScatter s = dispatch_scatter();
  s.parts.push_back({&expert_index, &choices});
  for (const DispatchRows& d : with) {
    check_token_rows(*d.rows);
    if (d.precision.dispatch == RowWire::kFp8) {
      *d.out_fp8 = QuantTensor::empty({received_tokens_, d.rows->dim(1)}, QuantBlock::kRow128,
                                      QuantAxis::kDim0, device);
      s.parts.push_back(fp8_part(*d.rows, *d.out_fp8, d.precision.fp8_scale));
      continue;
    }
    *d.out = Tensor::empty({received_tokens_, d.rows->dim(1)}, d.rows->dtype(), device);
    s.parts.push_back({d.rows, d.out, d.precision.dispatch, d.precision.rule});
  }
  s.to_peers = &sent;
  s.from_peers = &received;
  scatter_rows(*ep_, s);
  return_slot_ = Tensor::empty({received_tokens_, peers}, DType::kI32, device);
  ops::region_slots(received, tokens_, return_slot_);
  local_index_ = Tensor::empty(choices.shape(), DType::kI32, device);
  ops::local_choices(choices, ep_->rank(), local, local_index_, &received);
}

void ExpertExchange::check_token_rows(const Tensor& rows) const {
  MT_CHECK(rows.ndim() == 2 && rows.dim(0) == tokens_, "dispatch of {} rows for {} tokens",
           shape_str(rows.shape()), tokens_);
}

RowScatter ExpertExchange::dispatch_scatter() const {
  RowScatter s;
  s.slot = &send_slot_;
  s.capacity = tokens_;
  return s;
}

Tensor ExpertExchange::send_rows(const Tensor& rows) const {
  const Device device = rows.device();
  Tensor received = Tensor::empty({received_tokens_, rows.dim(1)}, rows.dtype(), device);
  Tensor send = Tensor::empty({to_peers_.rows(), rows.dim(1)}, rows.dtype(), device);
  ops::permute_rows(rows, to_peers_, send);
  ep_->all_to_all(send, send_tokens_, received, recv_tokens_);
  return received;
}

Tensor ExpertExchange::dispatch(const Tensor& rows, const ops::ExpertPrecision& precision) const {
  const Device device = rows.device();
  const profile::Span span("ep.dispatch", device == Device::kCUDA);
  check_token_rows(rows);
  MT_CHECK(precision.dispatch != RowWire::kFp8,
           "ExpertExchange::dispatch on the FP8 wire delivers FP8 rows: call dispatch_fp8");
  Tensor received = Tensor::empty({received_tokens_, rows.dim(1)}, rows.dtype(), device);
  if (mode_ == ExchangeMode::kDeviceCounts) {  // an MXFP8 wire quantized as it is sent
    RowScatter s = dispatch_scatter();
    s.parts.push_back({&rows, &received, precision.dispatch, precision.rule});
    scatter_rows(*ep_, s);
    return received;
  }
  if (precision.dispatch == RowWire::kAsIs) return send_rows(rows);
  // Each token quantized once, before it is sent (to one rank or several).
  QuantTensor out = QuantTensor::empty(rows.shape(), QuantBlock::kMx32, QuantAxis::kDim0, device);
  ops::mx_quantize(rows, precision.rule, out);
  QuantTensor in = QuantTensor::empty({received_tokens_, rows.dim(1)}, QuantBlock::kMx32,
                                      QuantAxis::kDim0, device);
  in.data() = send_rows(out.data());
  in.scales() = send_rows(out.scales());
  ops::mx_dequantize(in, received);
  return received;
}

QuantTensor ExpertExchange::dispatch_fp8(const Tensor& rows, Fp8ScaleRule rule) const {
  const Device device = rows.device();
  const profile::Span span("ep.dispatch", device == Device::kCUDA);
  check_token_rows(rows);
  QuantTensor received = QuantTensor::empty({received_tokens_, rows.dim(1)}, QuantBlock::kRow128,
                                            QuantAxis::kDim0, device);
  if (mode_ == ExchangeMode::kDeviceCounts) {  // quantized as it is sent
    RowScatter s = dispatch_scatter();
    s.parts.push_back(fp8_part(rows, received, rule));
    scatter_rows(*ep_, s);
    return received;
  }
  // Each token quantized once, before it is sent (to one rank or several).
  QuantTensor out = QuantTensor::empty(rows.shape(), QuantBlock::kRow128, QuantAxis::kDim0, device);
  ops::fp8_quantize(rows, rule, out);
  received.data() = send_rows(out.data());
  received.scales() = send_rows(out.scales());
  return received;
}

void ExpertExchange::dispatch(const DispatchRows& d) const {
  if (d.precision.dispatch == RowWire::kFp8)
    *d.out_fp8 = dispatch_fp8(*d.rows, d.precision.fp8_scale);
  else
    *d.out = dispatch(*d.rows, d.precision);
}

void ExpertExchange::combine(const Tensor& rows, Tensor& out, const Tensor* residual) const {
  combine({{&rows, &out, residual}});
}

void ExpertExchange::combine(const std::vector<CombineRows>& parts) const {
  if (parts.empty()) return;
  const Device device = parts.front().rows->device();
  const profile::Span span("ep.combine", device == Device::kCUDA);
  for (const CombineRows& p : parts) {
    MT_CHECK(p.rows->ndim() == 2 && p.rows->dim(0) == received_tokens_,
             "combine of {} rows for {} received tokens", shape_str(p.rows->shape()),
             received_tokens_);
    expect_shape(*p.out, {tokens_, p.rows->dim(1)}, "combined rows");
  }
  if (mode_ == ExchangeMode::kDeviceCounts) {  // summed as they arrive
    RowScatter s;
    s.slot = &return_slot_;
    s.capacity = tokens_;
    for (const CombineRows& p : parts)
      s.parts.push_back({p.rows, p.out, RowWire::kAsIs, {}, &back_place_, p.residual});
    scatter_rows(*ep_, s);
    return;
  }
  for (const CombineRows& p : parts) {
    Tensor back = Tensor::empty({to_peers_.rows(), p.rows->dim(1)}, p.rows->dtype(), device);
    ep_->all_to_all(*p.rows, recv_tokens_, back, send_tokens_);
    ops::combine_forward(back, to_peers_, *p.out, p.residual);
  }
}

}  // namespace mt::moe
