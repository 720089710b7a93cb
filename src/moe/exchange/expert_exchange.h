// Expert-parallel dispatch and combine, deduplicated: experts [p*L, (p+1)*L) live on EP rank p
// (L = E/ep), and a token crosses to each rank that holds one of its experts once, with its
// choices, whatever the number of them there. The receiving rank expands its tokens into
// expert-major rows itself (ops::make_expert_permutation over local_index(), whose entries for
// the other ranks' experts are -1) and, on the way back, sums each token's expert outputs before
// sending one row per (token, rank); the sender adds the ranks' rows in rank order. At top-8 of
// 128 experts over 2 ranks this moves a quarter of the rows a row per (token, expert) would.
//
// Rank q's tokens for rank p are sent in token order (their slot: a permutation over the ranks,
// ops::peer_choices); what arrives is grouped by source rank, so the expert-major rows are the
// order a row per (token, expert) exchange gives (source rank, then token). Dispatch and combine
// are linear and each is the other's adjoint. Two modes, the same rows in the same order:
//
// - kHostCounts (the reference): an all-to-all of (L + 1) counts per rank, one read of them on
//   the host, then all-to-alls of exactly the rows sent (the layer's one wait for the device, as
//   in torchtitan); every buffer has its exact size.
// - kDeviceCounts: nothing is read on the host, so a CUDA graph can hold the layer. Every rank
//   owns a region of N places (its micro-batch's tokens: the most it can send) in each peer's
//   receive buffer; rows go straight to their place (moe/exchange/row_scatter.h: a kernel over
//   NVLink with NCCL's symmetric memory within a node); the counts travel with the first rows,
//   device to device, and mark which places hold a token. The plan sends the tokens' choices,
//   their counts and the rows given to it (DispatchRows: the layer's activations and routing
//   weights) in one exchange. Buffers have the worst case's size: ep * N tokens received,
//   ep * N * min(k, L) expert rows (rows past the routed ones name no token and are skipped).
//
// The MXFP8 wire (precision.dispatch = RowWire::kMxfp8) sends 1 + 1/32 bytes per element instead
// of 2; with device counts the send kernel quantizes the rows and the receive kernel dequantizes
// them. The FP8 wire (RowWire::kFp8, DeepSeek-V3's 1 x 128 blocks) sends 1 + 4/128 bytes per
// element, quantized by the send kernel, and delivers the FP8 rows themselves (dispatch_fp8),
// which the FP8 products take without quantizing them again.
#pragma once
#include <vector>

#include "core/tensor.h"
#include "dist/communicator.h"
#include "moe/exchange/row_scatter.h"
#include "ops/exchange_layout.h"
#include "ops/expert_gemm.h"
#include "ops/permute.h"

namespace mt::moe {

enum class ExchangeMode : uint8_t { kHostCounts, kDeviceCounts };
std::string_view exchange_mode_name(ExchangeMode m);  // "host", "device"
bool parse_exchange_mode(std::string_view name, ExchangeMode* out);

// Rows in token order that the plan dispatches along with the tokens' choices (with device
// counts in the same exchange): *out is set to what dispatch(*rows, precision) returns, or on the
// FP8 wire (precision.dispatch = kFp8) *out_fp8 to what dispatch_fp8(*rows, precision.fp8_scale)
// returns.
struct DispatchRows {
  const Tensor* rows = nullptr;
  Tensor* out = nullptr;
  ops::ExpertPrecision precision = {};
  QuantTensor* out_fp8 = nullptr;
};

class ExpertExchange {
 public:
  // expert_index i32 (N, k): the choices of this rank's N tokens over all `experts`, on the
  // rows' device (every rank of the group has the same N). Collective over `ep`.
  ExpertExchange(dist::Communicator& ep, const Tensor& expert_index, int64_t experts,
                 ExchangeMode mode = ExchangeMode::kHostCounts,
                 const std::vector<DispatchRows>& with = {});

  // The receive buffer (bytes) that a device path needs for the largest exchange of a layer over
  // `ep` ranks of `tokens` tokens with top_k choices of `experts`: the plan's (the choices, the
  // counts, rows of `dim` elements of row_dtype on precision.dispatch's wire and their f32
  // routing weights) or the backward's combine (the weights' gradient and rows of row_dtype as
  // they are).
  static size_t window_bytes(int ep, int64_t tokens, int64_t top_k, int64_t experts, int64_t dim,
                             DType row_dtype, const ops::ExpertPrecision& precision);

  int64_t tokens() const { return tokens_; }  // N
  // Rows of dispatch's output: the tokens received (Rt), or with device counts ep * N places.
  int64_t received_tokens() const { return received_tokens_; }
  // Expert rows the receiving permutation needs: the choices of this rank's experts among the
  // received tokens (R <= Rt * k), or with device counts the most there can be.
  int64_t local_rows() const { return local_rows_; }
  // i32 (Rt, k): the received tokens' choices as this rank's experts numbered from 0, -1 where a
  // choice is another rank's expert (and for every place no token arrived at).
  const Tensor& local_index() const { return local_index_; }

  // rows (N, W) in token order, any dtype -> (Rt, W): each token to every rank holding one of
  // its experts, grouped by source rank, token order within a source. With precision.dispatch =
  // kMxfp8 the rows travel as MXFP8 (E4M3 data + E8M0 scales, 1 x 32 blocks along the row, the
  // precision's scale rule), dequantized on arrival into the rows' dtype: they arrive as their MX
  // values (ops::mx_round_trip along the row; W a multiple of 32). Not the FP8 wire:
  // dispatch_fp8.
  Tensor dispatch(const Tensor& rows, const ops::ExpertPrecision& precision = {}) const;
  // The same rows on the FP8 wire: each token quantized once, by its sender, in 1 x 128 blocks
  // along the row (ops::fp8_quantize with `rule`; f32, bf16 or f64 rows, W a multiple of 128),
  // arriving as those FP8 rows: (Rt, W), bytes and scales as they crossed.
  QuantTensor dispatch_fp8(const Tensor& rows, Fp8ScaleRule rule) const;
  // d's rows into *d.out (dispatch) or, on the FP8 wire, *d.out_fp8 (dispatch_fp8), as the
  // plan's own dispatch sets them.
  void dispatch(const DispatchRows& d) const;
  // rows (Rt, W) -> out (N, W): each token's rows from the ranks it went to, summed in rank
  // order, plus residual[t] when given (float dtypes). The adjoint of dispatch.
  void combine(const Tensor& rows, Tensor& out, const Tensor* residual = nullptr) const;
  // Several combines in one exchange (with device counts: the backward's weight and input
  // gradients), each as combine(*rows, *out, residual) gives.
  struct CombineRows {
    const Tensor* rows = nullptr;
    Tensor* out = nullptr;
    const Tensor* residual = nullptr;
  };
  void combine(const std::vector<CombineRows>& parts) const;

 private:
  void plan_host_counts(const Tensor& expert_index, const Tensor& to_peer, int64_t local);
  void plan_device_counts(const Tensor& expert_index, const Tensor& to_peer, int64_t local,
                          const std::vector<DispatchRows>& with);
  // Host counts: rows (N, W) -> (Rt, W) through all-to-all.
  Tensor send_rows(const Tensor& rows) const;
  // Device counts: a scatter with dispatch's layout (send_slot_, N places a rank), no parts yet.
  RowScatter dispatch_scatter() const;
  void check_token_rows(const Tensor& rows) const;  // (N, W), else an error naming both

  dist::Communicator* ep_;
  ExchangeMode mode_;
  int64_t tokens_ = 0, received_tokens_ = 0, local_rows_ = 0;
  // Host counts: the send layout, a permutation over the EP ranks whose rows are sent as they are.
  ops::ExpertPermutation to_peers_;
  std::vector<int64_t> send_tokens_, recv_tokens_;  // host counts: per rank
  Tensor send_slot_;    // device counts: i32 (N, ep), the token's place in rank p's region
                        // (ops::peer_slots: rank q's tokens for p in token order)
  Tensor return_slot_;  // device counts: i32 (ep * N, ep), where combine sends each place back
  // Device counts: i32 (N, ep), the place of token t's row back from rank p in combine's
  // receive buffer (-1: none), which combine sums as it arrives.
  Tensor back_place_;
  Tensor local_index_;
};

}  // namespace mt::moe
