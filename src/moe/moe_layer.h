// The MoE feed-forward of one block: router -> expert-major permutation -> (EP dispatch) ->
// grouped SwiGLU experts -> (EP combine) -> combine. The routing weight of each expert row scales
// its SwiGLU output (the down projection is linear, so this is the weighted combine of the expert
// outputs): the combine is a plain sum, and the backward needs no expert output, which is
// therefore not kept. Without expert parallelism the
// exchange is the identity and the experts are all E; with it, this rank computes its E/ep
// experts for the rows every EP peer routed to them.
#pragma once
#include <functional>
#include <memory>
#include <string_view>

#include "core/lane.h"
#include "core/tensor.h"
#include "dist/communicator.h"
#include "moe/exchange/expert_exchange.h"
#include "ops/expert_gemm.h"
#include "ops/gemm.h"
#include "ops/permute.h"
#include "ops/route.h"

namespace mt::moe {

// Whether the forward's expert rows and SwiGLU output are kept for the backward or dropped and
// made again there (the block's checkpointing policy). Recomputed, an MX recipe's forward writes
// only the MX values its products read, in place.
enum class ForwardRows : uint8_t { kKept, kRecomputed };

// What the layer needs of the model's configuration (model/config.h makes it: ModelConfig::moe).
struct MoeConfig {
  int64_t dim = 0, moe_dim = 0, n_experts = 0, top_k = 1;
  bool norm_topk_prob = true;
  ops::RoutingMode routing = ops::RoutingMode::kLearned;
  ops::ExpertPrecision expert_precision;
  // On the GPU, expert segments start on 128-row boundaries (ops/grouped_gemm.h).
  bool pad_expert_rows = true;
  ForwardRows forward_rows = ForwardRows::kKept;
};

struct MoeWeights {
  Tensor router;     // (D, E), the router's logits are hn @ router
  Tensor w_gate_up;  // (E_local, D, 2F), gate columns first
  Tensor w_down;     // (E_local, F, D)
  // Their quantized copies under an MX or FP8 recipe, when made beforehand (fsdp: at each gather);
  // null: the products make their own.
  const ops::WeightCopies* gate_up_copies = nullptr;
  const ops::WeightCopies* down_copies = nullptr;
};

// The most chunks a layer's tokens go through the experts in (MoeComms::chunks): each takes two
// of the lane's points a pass.
inline constexpr int64_t kMaxExchangeChunks = 16;
static_assert(2 * kMaxExchangeChunks + 2 <= Lane::kPoints);
// The exchange lane's exposed time (Lane's exposed_span): what the overlap left exposed.
inline constexpr const char* kExchangeExposedSpan = "exposed.ep_exchange";

// The process groups the layer talks to; null members mean "not split".
struct MoeComms {
  dist::Communicator* ep = nullptr;     // EP group: experts are spread over it
  dist::Communicator* batch = nullptr;  // every rank holding part of the batch (aux statistics)
  ExchangeMode exchange = ExchangeMode::kDeviceCounts;  // how the EP exchange sizes its rows
  // With EP: the layer's tokens go through the experts in this many chunks of consecutive tokens
  // (at most N), each with its own exchange. With a lane the exchanges run on it: the backward's
  // combine of each chunk crosses while the experts' weight gradients are computed (with one
  // chunk too), and with several chunks the experts compute on one chunk while the next chunk's
  // dispatch or the previous chunk's combine crosses; each chunk then pays its own products and
  // accumulates its share of the experts' weight gradients (docs/benchmarks-history.md has the
  // costs). Without a lane everything runs in turn, with the same results (the CPU ranks' tests).
  int64_t chunks = 1;
  Lane* lane = nullptr;
};

// One chunk of the layer's tokens on its way through the experts. Rt tokens here (with EP: the
// tokens received; without: Rt = N), R rows for this rank's experts (R = N*k without EP; a padded
// layout has more, see ops/permute.h).
struct MoeChunk {
  int64_t begin = 0, end = 0;                // its tokens: [begin, end) of the layer's N
  std::shared_ptr<ExpertExchange> exchange;  // EP: who sends what where (null without EP)
  ops::ExpertPermutation perm;               // the tokens here -> this rank's experts' rows
  Tensor xr;                                 // (Rt, D)      EP: the tokens received (comm output)
  QuantTensor xr_fp8;  // (Rt, D) EP on the FP8 wire: the tokens received as FP8 rows (xr: values)
  Tensor wr;           // (Rt, k)      EP: their routing weights (comm output)
  Tensor xe;           // (R, D)       the experts' input rows (a gather)
  Tensor row_weight;   // (R)          routing weight of each of those rows (a gather)
  Tensor gate_up;      // (R, 2F)      GEMM output
  Tensor act;          // (R, F)       row_weight * SwiGLU (elementwise)
  // Under an MX recipe, act's MX values for the down projection's forward: made with act by a
  // forward fill, consumed (and dropped) by moe_combine.
  Tensor act_mx;
  // Under an FP8 recipe, act's FP8 rows (1 x 128 along F) for the down projection's forward:
  // written with act by SwiGLU in a forward fill, consumed (and dropped) by moe_combine.
  QuantTensor act_fp8;
  // t's rows of this chunk's tokens (t has the layer's N rows).
  Tensor rows_of(const Tensor& t) const { return t.slice_rows(begin, end); }
};

// What the forward leaves for the backward. A field left undefined is recomputed by moe_fill;
// the chunks are made with the routing (one without EP).
struct MoeActivations {
  // u8 (N) or undefined, set by the caller: the tokens left out of the routing statistics (a
  // packed row's padding, Batch::padding). An input, not an activation.
  Tensor padding;
  Tensor logits;            // (N, E)       GEMM output
  ops::Routing routing;     // scores, choices, weights, counts
  ops::AuxStats aux_stats;  // of the whole batch (all ranks)
  std::vector<MoeChunk> chunks;
  Tensor aux_loss;  // per-layer load-balancing loss (no coefficient): one f64 on the device
  // Drops every chunk's expert rows, their routing weights and SwiGLU output (a checkpointing
  // policy: a fill gathers and computes them again; the exchange's outputs stay).
  void drop_expert_rows();
};

ops::RouterOptions router_options(const MoeConfig& c);

// Numerics studies (bench/bench_expert_gemm_error.cpp): when set, moe_backward calls it with the
// operands of each expert matrix's products just before its weight gradient, "down" then
// "gate_up" per layer (per chunk, with chunks), layers in the backward's order (the last first):
// the forward's input rows x (M, K), the output gradient dy (M, N) and the weight w (E, K, N), so
// out = x w, dx = dy w^T and dw = x^T dy. Eager passes only: a captured pass runs no host code. One
// process-wide observer; null (the default) costs nothing.
using ExpertOperandsTap =
    std::function<void(std::string_view product, const Tensor& x, const Tensor& dy, const Tensor& w,
                       const ops::ExpertRows& rows)>;
void set_expert_operands_tap(ExpertOperandsTap tap);

// What a fill is for: the forward (moe_combine follows), or the backward (refilling what it needs
// and the policy dropped: the forward's down projection is not rerun).
enum class FillFor : uint8_t { kForward, kBackward };
// Computes every undefined field of `a` from hn (N, D). bias: (E) or undefined.
void moe_fill(const MoeWeights& w, const MoeConfig& c, const MoeComms& comms, const Tensor& bias,
              const Tensor& hn, MoeActivations& a, FillFor fill = FillFor::kForward);
// out (N, D) = the experts' down projection of a.act, back in token order and summed over each
// token's choices (+ residual, in the same pass); requires a filled `a` (its act_mx is used and
// dropped). The expert outputs are not kept.
void moe_combine(const MoeWeights& w, const MoeConfig& c, const MoeComms& comms, MoeActivations& a,
                 Tensor& out, const Tensor* residual = nullptr);
// Returns d hn (N, D); weight gradients accumulate into g. aux_grad = d(total) / d(aux_loss).
// expert_grads: kYes adds to g's expert gradients, kNo overwrites them (their first write of a
// step); the router gradient always accumulates.
Tensor moe_backward(const MoeWeights& w, MoeWeights& g, const MoeConfig& c, const MoeComms& comms,
                    const Tensor& hn, const MoeActivations& a, const Tensor& dout, double aux_grad,
                    ops::Accumulate expert_grads = ops::Accumulate::kYes);

}  // namespace mt::moe
