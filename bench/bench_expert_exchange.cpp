// Expert-parallel dispatch + combine over NCCL on the GPUs of one machine: one process per GPU
// (this binary launches itself, as `moetrain launch` does), ep = all of them; 16384 tokens per
// rank, top-8 of 128 experts with random routing, rows of 2048 bf16. "exchange" is what the MoE
// layer's forward pays: the plan (counts, the send layout, the choices) with the dispatch of the
// rows and their routing weights, and combine,
// for each mode (moe/exchange/expert_exchange.h): host counts, device counts (rows written into the
// peers' memory by a kernel), and device counts replayed as a CUDA graph; and with the MXFP8
// wire on the dispatch. Comparators in the same job: the raw NCCL all-to-all of the same
// deduplicated rows with the counts known in advance, and the raw all-to-all of one row per
// (token, expert), the bytes the exchange sent before it was deduplicated. GB/s: the bytes that
// this GPU sends to the others in dispatch and combine, over the time. Last, the whole MoE layer
// (Qwen3-30B-A3B's expert shape, forward and backward, replayed as a CUDA graph) with its tokens
// in 1, 2 and 4 chunks, in turn and with each chunk's exchange on the lane beside the experts
// (moe_layer.h): what chunking costs and what the overlap hides of the exchange. JSON lines from
// rank 0.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>

#include "bench/bench_util.h"
#include "core/cuda/device.h"
#include "core/cuda/graph.h"
#include "dist/launcher.h"
#include "dist/nccl_backend.h"
#include "dist/socket_backend.h"
#include "moe/exchange/expert_exchange.h"
#include "moe/moe_layer.h"
#include "ops/permute.h"

namespace {

using mt::Device;
using mt::DType;
using mt::Tensor;

constexpr int64_t kTokens = 16384, kTopK = 8, kExperts = 128, kDim = 2048;

// Random routing: k distinct experts per token, as the router's output.
Tensor random_routing(int rank) {
  Tensor index = Tensor::empty({kTokens, kTopK}, DType::kI32);
  const mt::CounterRng rng{7, static_cast<uint64_t>(rank)};
  for (int64_t t = 0; t < kTokens; ++t)
    for (int64_t j = 0; j < kTopK; ++j) {
      int32_t e = 0;
      bool fresh = false;
      for (uint64_t draw = 0; !fresh; ++draw) {
        e = static_cast<int32_t>(rng.below((t * kTopK + j) * 64 + draw, kExperts));
        fresh = true;
        for (int64_t i = 0; i < j; ++i) fresh &= index.data<int32_t>()[t * kTopK + i] != e;
      }
      index.data<int32_t>()[t * kTopK + j] = e;
    }
  return index;
}

// The MoE layer (d 2048, F 768, top-8 of 128, learned routing on random weights), forward and
// backward, graphed, its exchange over `ep` with the tokens in chunks on the lane.
void layer_chunks(int rank, int world, mt::dist::Communicator& ep, int ctas) {
  constexpr int64_t kMoeDim = 768;
  mt::moe::MoeConfig c;
  c.dim = kDim;
  c.moe_dim = kMoeDim;
  c.n_experts = kExperts;
  c.top_k = kTopK;
  const int64_t local = kExperts / world;
  const mt::moe::MoeWeights w{mt::bench::random_bf16({kDim, kExperts}, 11, 0.02),
                              mt::bench::random_bf16({local, kDim, 2 * kMoeDim}, 12 + rank, 0.02),
                              mt::bench::random_bf16({local, kMoeDim, kDim}, 13 + rank, 0.02)};
  mt::moe::MoeWeights g{Tensor::zeros({kDim, kExperts}, DType::kF32, Device::kCUDA),
                        Tensor::empty(w.w_gate_up.shape(), DType::kF32, Device::kCUDA),
                        Tensor::empty(w.w_down.shape(), DType::kF32, Device::kCUDA)};
  const Tensor hn = mt::bench::random_bf16({kTokens, kDim}, 14 + rank, 1.0);
  const Tensor dout = mt::bench::random_bf16({kTokens, kDim}, 15 + rank, 1.0);
  Tensor out = Tensor::empty({kTokens, kDim}, DType::kBF16, Device::kCUDA);
  mt::Lane lane(mt::moe::kExchangeExposedSpan);
  // The chunks in turn and on the lane: what chunking costs the experts, what the lane hides.
  // Each its own captured graph, timed in three alternating rounds.
  struct Run {
    int64_t chunks;
    bool on_lane;
    mt::cuda::CapturedWork work;
    std::vector<double> ms;
  };
  Run runs[] = {{1, false, {}, {}},
                {1, true, {}, {}},
                {2, false, {}, {}},
                {2, true, {}, {}},
                {4, true, {}, {}}};
  for (int round = 0; round < 3; ++round)
    for (Run& r : runs) {
      const mt::moe::MoeComms comms{&ep, nullptr, mt::moe::ExchangeMode::kDeviceCounts, r.chunks,
                                    r.on_lane ? &lane : nullptr};
      auto body = [&] {
        mt::moe::MoeActivations a;
        mt::moe::moe_fill(w, c, comms, Tensor(), hn, a);
        mt::moe::moe_combine(w, c, comms, a, out);
        (void)mt::moe::moe_backward(w, g, c, comms, hn, a, dout, 0.001, mt::ops::Accumulate::kNo);
      };
      r.ms.push_back(mt::bench::median_ms([&] { r.work.run(body, "the MoE layer"); }));
    }
  for (const Run& r : runs) {
    if (rank != 0) continue;
    std::printf(
        "{\"bench\":\"moe_layer_ep_chunks\",\"gpus\":%d,\"tokens_per_rank\":%lld,\"dim\":%lld,"
        "\"moe_dim\":%lld,\"experts\":%lld,\"top_k\":%lld,\"chunks\":%lld,\"lane\":%s,"
        "\"ctas\":%d,\"ms\":%.3f,\"rounds_ms\":\"%s\"}\n",
        world, static_cast<long long>(kTokens), static_cast<long long>(kDim),
        static_cast<long long>(kMoeDim), static_cast<long long>(kExperts),
        static_cast<long long>(kTopK), static_cast<long long>(r.chunks),
        r.on_lane ? "true" : "false", ctas, mt::bench::median(r.ms), mt::bench::join(r.ms).c_str());
    std::fflush(stdout);
  }
}

void run(int rank, int world, mt::dist::Communicator& boot, mt::dist::Communicator& ep) {
  using mt::moe::ExchangeMode;
  const Tensor index = random_routing(rank);
  const Tensor gindex = index.to(Device::kCUDA);
  const Tensor x = mt::bench::random_bf16({kTokens, kDim}, 3 + rank, 1.0);
  Tensor y = Tensor::empty({kTokens, kDim}, DType::kBF16, Device::kCUDA);
  std::string why;
  const char* ctas_env = std::getenv("BENCH_CTAS");  // the exchange kernel's blocks
  const int ctas = ctas_env ? std::atoi(ctas_env) : 32;
  const size_t reserved =
      ep.reserve_peer_window(mt::moe::ExpertExchange::window_bytes(world, kTokens, kTopK, kExperts,
                                                                   kDim, DType::kBF16, {}),
                             ctas, &why);
  const Tensor weights = mt::bench::random_bf16({kTokens, kTopK}, 5 + rank, 1.0)
                             .to(Device::kCPU)
                             .to(DType::kF32)
                             .to(Device::kCUDA);

  // Rows crossing to other GPUs per rank and direction, deduplicated and per choice.
  const int64_t local = kExperts / world;
  std::vector<int64_t> token_rows(world, 0), choice_rows(world, 0);
  for (int64_t t = 0; t < kTokens; ++t) {
    std::vector<bool> to(world, false);
    for (int64_t j = 0; j < kTopK; ++j) {
      const int p = index.data<int32_t>()[t * kTopK + j] / static_cast<int>(local);
      ++choice_rows[p];
      to[p] = true;
    }
    for (int p = 0; p < world; ++p) token_rows[p] += to[p];
  }
  int64_t crossing = 0, crossing_per_choice = 0;
  for (int p = 0; p < world; ++p)
    if (p != rank) crossing += token_rows[p], crossing_per_choice += choice_rows[p];

  auto line = [&](const char* what, const char* wire, double ms, int64_t rows) {
    if (rank != 0) return;
    // Bytes this GPU sends to the others: the dispatch's rows on the wire, the combine's bf16.
    const double wire_bytes = wire[0] == 'm' ? 1.0 + 1.0 / 32 : 2.0;
    const double gb = static_cast<double>(rows) * kDim * (wire_bytes + 2.0) / 1e9;
    std::printf(
        "{\"bench\":\"expert_exchange\",\"what\":\"%s\",\"gpus\":%d,\"tokens_per_rank\":%lld,"
        "\"top_k\":%lld,\"experts\":%lld,\"dim\":%lld,\"wire\":\"%s\",\"ms\":%.3f,"
        "\"rows_crossing\":%lld,\"gb_s_out\":%.1f,\"nvlink_gb_s\":450,\"ctas\":%d}\n",
        what, world, static_cast<long long>(kTokens), static_cast<long long>(kTopK),
        static_cast<long long>(kExperts), static_cast<long long>(kDim), wire, ms,
        static_cast<long long>(rows), gb / (ms * 1e-3), ctas);
    std::fflush(stdout);
  };

  mt::ops::ExpertPrecision mx;
  mx.recipe = mt::ops::ExpertRecipe::kMxfp8WgradWithHp;
  mx.dispatch = mt::RowWire::kMxfp8;
  for (const ExchangeMode mode : {ExchangeMode::kHostCounts, ExchangeMode::kDeviceCounts})
    for (const bool mxfp8 : {false, true}) {
      const mt::ops::ExpertPrecision wire = mxfp8 ? mx : mt::ops::ExpertPrecision{};
      auto body = [&] {  // as the layer's forward: the rows and weights sent with the plan
        Tensor there, weights_there;
        const mt::moe::ExpertExchange exchange(ep, gindex, kExperts, mode,
                                               {{&x, &there, wire}, {&weights, &weights_there}});
        exchange.combine(there, y);
      };
      const std::string name =
          std::string("dispatch_combine_") + std::string(mt::moe::exchange_mode_name(mode));
      line(name.c_str(), mxfp8 ? "mxfp8" : "bf16", mt::bench::median_ms(body), crossing);
      if (mode != ExchangeMode::kDeviceCounts || reserved == 0) continue;
      auto graph = mt::cuda::Graph::capture(body);
      line((name + "_graphed").c_str(), mxfp8 ? "mxfp8" : "bf16",
           mt::bench::median_ms([&] { graph->launch(); }), crossing);
    }
  if (rank == 0 && reserved == 0)
    std::printf("{\"bench\":\"expert_exchange\",\"note\":\"no device path: %s\"}\n", why.c_str());

  // The raw all-to-alls, there and back.
  auto raw = [&](const std::vector<int64_t>& send_rows) {
    Tensor counts = Tensor::empty({world}, DType::kI64),
           all = Tensor::empty({world * world}, DType::kI64);
    for (int p = 0; p < world; ++p) counts.data<int64_t>()[p] = send_rows[p];
    boot.all_gather(counts, all);
    std::vector<int64_t> recv_rows(world);
    int64_t sent = 0, received = 0;
    for (int p = 0; p < world; ++p) {
      sent += send_rows[p];
      received += recv_rows[p] = all.data<int64_t>()[p * world + rank];
    }
    Tensor src = mt::bench::random_bf16({sent, kDim}, 5, 1.0);
    Tensor dst = Tensor::empty({received, kDim}, DType::kBF16, Device::kCUDA);
    Tensor back = Tensor::empty({sent, kDim}, DType::kBF16, Device::kCUDA);
    return mt::bench::median_ms([&] {
      ep.all_to_all(src, send_rows, dst, recv_rows);
      ep.all_to_all(dst, recv_rows, back, send_rows);
    });
  };
  line("raw_all_to_all_per_token", "bf16", raw(token_rows), crossing);
  line("raw_all_to_all_per_choice", "bf16", raw(choice_rows), crossing_per_choice);
  if (reserved > 0) layer_chunks(rank, world, ep, ctas);
}

}  // namespace

int main() {
  if (!std::getenv("RANK")) {
    const int world = mt::cuda::device_count();
    if (world < 1) {
      std::printf("{\"bench\":\"expert_exchange\",\"error\":\"no GPU\"}\n");
      return 0;
    }
    // One GPU: one rank, nothing crosses; the lines then give the exchange's fixed cost (the
    // plan, the kernels, the barriers and the window's copies), not a bandwidth.
    mt::dist::LaunchOptions o;
    o.nproc = world;
    o.args = {"rank"};
    return mt::dist::launch_local(o);
  }
  const mt::dist::Rendezvous r = mt::dist::rendezvous_from_env();
  const auto boot = mt::dist::connect_socket_world(r);
  const auto ep = mt::dist::connect_nccl_world(r, *boot);
  run(r.rank, r.world, *boot, *ep);
  return 0;
}
