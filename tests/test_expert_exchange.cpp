// The expert exchange on in-process ranks: each token once per EP rank, combine its adjoint,
// the plan's own dispatch, and the MoE layer's chunks.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "core/rng.h"
#include "dist/communicator.h"
#include "dist/mesh.h"
#include "fsdp/fsdp.h"
#include "moe/exchange/expert_exchange.h"
#include "moe/moe_layer.h"
#include "ops/elementwise.h"
#include "ops/fp8.h"
#include "ops/mx.h"
#include "processes.h"
#include "testing.h"
#include "train/checkpoint.h"
#include "train/data_loader.h"
#include "train/token_file.h"
#include "train/trainer.h"

namespace mt {
namespace {

using dist::Communicator;
using dist::run_in_process;

// Routings of 6 tokens, top-2 over 4 experts on 2 ranks (experts 0, 1 on rank 0; 2, 3 on rank
// 1), by name: each rank's tokens differ (rank r's token t chooses by (t + r)).
Tensor exchange_routing(const std::string& kind, int rank) {
  const int64_t n = 6, k = 2;
  Tensor index = Tensor::empty({n, k}, DType::kI32);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = 0; j < k; ++j) {
      int32_t e = 0;
      if (kind == "spread")  // some tokens on one rank only, some on both
        e = static_cast<int32_t>((t + rank + j * (1 + t % 2)) % 4);
      else if (kind == "one_rank")  // every choice on rank 0: rank 1 receives nothing
        e = static_cast<int32_t>(j);
      else if (kind == "one_expert")  // every token's first choice is expert 3
        e = j == 0 ? 3 : static_cast<int32_t>((t + rank) % 3);
      index.data<int32_t>()[t * k + j] = e;
    }
  return index;
}

// Runs fn on two in-process ranks for each exchange mode and routing of exchange_routing, with
// the rank's routing and a name for the case.
void for_each_exchange_case(
    const std::function<void(Communicator&, moe::ExchangeMode, const Tensor& index,
                             const std::string& kind, const std::string& what)>& fn) {
  for (const moe::ExchangeMode mode :
       {moe::ExchangeMode::kHostCounts, moe::ExchangeMode::kDeviceCounts})
    for (const std::string kind : {"spread", "one_rank", "one_expert"}) {
      const std::string what = kind + " " + std::string(moe::exchange_mode_name(mode));
      run_in_process(
          2, [&](Communicator& c) { fn(c, mode, exchange_routing(kind, c.rank()), kind, what); });
    }
}

// The exchange against its definition, computed on the host from both ranks' routings: rank q
// receives, from each source p in order, the tokens of p with a choice on q, in token order,
// with their choices as q's experts (-1 elsewhere): packed (host counts) or from place p * N of
// p's region (device counts, the places past a region's tokens marked -1). Combine sums, for
// each token, the rows of the ranks it went to, and is dispatch's adjoint.
TEST(ExpertExchange, SendsEachTokenOncePerRankAndCombineIsItsAdjoint) {
  const int world = 2;
  const int64_t n = 6, k = 2, experts = 4, width = 3;
  for_each_exchange_case([&](Communicator& c, moe::ExchangeMode mode, const Tensor& index,
                             const std::string& kind, const std::string& what) {
    const int r = c.rank();
    moe::ExpertExchange ex(c, index, experts, mode);
    const bool packed = mode == moe::ExchangeMode::kHostCounts;
    // The expected arrivals: (source, token) at a receive row, and their local choices.
    std::vector<std::pair<int, int64_t>> want;
    std::vector<int64_t> at;
    std::vector<int32_t> want_local;
    int64_t want_rows = 0;
    for (int p = 0; p < world; ++p) {
      const Tensor theirs = exchange_routing(kind, p);
      int64_t slot = 0;
      for (int64_t t = 0; t < n; ++t) {
        bool here = false;
        for (int64_t j = 0; j < k; ++j) here |= theirs.data<int32_t>()[t * k + j] / 2 == r;
        if (!here) continue;
        want.emplace_back(p, t);
        at.push_back(packed ? static_cast<int64_t>(at.size()) : p * n + slot++);
        for (int64_t j = 0; j < k; ++j) {
          const int32_t e = theirs.data<int32_t>()[t * k + j];
          want_local.push_back(e / 2 == r ? e % 2 : -1);
          want_rows += e / 2 == r;
        }
      }
    }
    ASSERT_EQ(ex.received_tokens(), packed ? static_cast<int64_t>(want.size()) : world * n) << what;
    if (packed)
      EXPECT_EQ(ex.local_rows(), want_rows) << what;
    else
      EXPECT_GE(ex.local_rows(), want_rows) << what;
    std::vector<bool> arrived(ex.received_tokens(), false);
    for (size_t i = 0; i < want.size(); ++i) {
      arrived[at[i]] = true;
      for (int64_t j = 0; j < k; ++j)
        EXPECT_EQ(ex.local_index().data<int32_t>()[at[i] * k + j], want_local[i * k + j])
            << what << " " << i;
    }
    for (int64_t i = 0; i < ex.received_tokens(); ++i) {
      if (arrived[i]) continue;
      for (int64_t j = 0; j < k; ++j)
        EXPECT_EQ(ex.local_index().data<int32_t>()[i * k + j], -1) << what << " place " << i;
    }
    // Rows named by their source: 100 * rank + token.
    Tensor x = Tensor::empty({n, width}, DType::kF64);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t d = 0; d < width; ++d) x.set_item(t * width + d, 100 * r + t + 0.25 * d);
    const Tensor got = ex.dispatch(x);
    for (size_t i = 0; i < want.size(); ++i)
      EXPECT_EQ(got.item(at[i] * width),
                100.0 * want[i].first + static_cast<double>(want[i].second))
          << what << " row " << i;
    // Adjoint: <dispatch(x), y> summed over ranks equals <x, combine(y)> summed over ranks
    // (over the places that hold a token: the others are undefined).
    const Tensor xr = testing::randn({n, width}, 10 + r);
    Tensor yr = testing::randn({ex.received_tokens(), width}, 20 + r);
    Tensor dx = ex.dispatch(xr);
    for (int64_t i = 0; i < ex.received_tokens(); ++i) {
      if (arrived[i]) continue;
      for (int64_t d = 0; d < width; ++d) dx.set_item(i * width + d, 0.0);
    }
    Tensor cy = Tensor::poisoned({n, width}, DType::kF64);
    ex.combine(yr, cy);
    Tensor dots = Tensor::empty({2}, DType::kF64);
    dots.set_item(0, testing::dot(dx, yr));
    dots.set_item(1, testing::dot(xr, cy));
    c.all_reduce(dots);
    EXPECT_NEAR(dots.item(0), dots.item(1), 1e-12 * (1 + std::abs(dots.item(0)))) << what;
    // Combine with a residual adds it.
    const Tensor res = testing::randn({n, width}, 30 + r);
    Tensor with = Tensor::poisoned({n, width}, DType::kF64);
    ex.combine(yr, with, &res);
    for (int64_t i = 0; i < n * width; ++i)
      EXPECT_NEAR(with.item(i), cy.item(i) + res.item(i), 1e-14) << what;
  });
}
// The layer with its tokens in chunks, each with its own exchange, against the layer in one
// chunk, on two ranks in f64 (each rank its own tokens and its half of the experts), for each
// exchange mode, with and without a lane (on the CPU a lane runs the exchanges in order) and with
// every routing the router gives here: the learned one, balanced, and all of a rank's tokens on
// one expert (a bias of 10 on it). Every token's rows and their sums are the same, so the output,
// d hn and the router's gradient are equal bit for bit; the experts' weight gradients add the
// chunks' products in turn (1e-12).
TEST(MoeLayer, ChunksGiveTheUnchunkedLayersOutputAndGradients) {
  const int64_t n = 23, d = 8, f = 6, e = 4;
  moe::MoeConfig c;
  c.dim = d;
  c.moe_dim = f;
  c.n_experts = e;
  c.top_k = 2;
  for (const moe::ExchangeMode mode :
       {moe::ExchangeMode::kHostCounts, moe::ExchangeMode::kDeviceCounts})
    for (const std::string routing : {"learned", "balanced", "one_expert"})
      run_in_process(2, [&](Communicator& comm) {
        const int r = comm.rank();
        c.routing =
            routing == "balanced" ? ops::RoutingMode::kBalanced : ops::RoutingMode::kLearned;
        Tensor bias = Tensor::zeros({e}, DType::kF64);
        if (routing == "one_expert") bias.set_item(3, 10.0);
        const moe::MoeWeights w{testing::randn({d, e}, 7, 0.5),
                                testing::randn({e / 2, d, 2 * f}, 11 + r, 0.4),
                                testing::randn({e / 2, f, d}, 13 + r, 0.4)};
        const Tensor hn = testing::randn({n, d}, 17 + r), dout = testing::randn({n, d}, 19 + r);
        struct Result {
          Tensor out, dhn;
          moe::MoeWeights g;
        };
        auto layer = [&](int64_t chunks, Lane* lane) {
          moe::MoeComms comms{&comm, &comm, mode, chunks, lane};
          moe::MoeActivations a;
          moe::moe_fill(w, c, comms, bias, hn, a);
          EXPECT_EQ(static_cast<int64_t>(a.chunks.size()), chunks);
          for (size_t i = 0; i < a.chunks.size(); ++i) {  // consecutive, in order, all tokens
            EXPECT_EQ(a.chunks[i].begin, i == 0 ? 0 : a.chunks[i - 1].end);
            EXPECT_GT(a.chunks[i].end, a.chunks[i].begin);
          }
          EXPECT_EQ(a.chunks.back().end, n);
          Result res{Tensor::poisoned({n, d}, DType::kF64),
                     Tensor(),
                     {Tensor::zeros(w.router.shape(), DType::kF64),
                      Tensor::poisoned(w.w_gate_up.shape(), DType::kF64),
                      Tensor::poisoned(w.w_down.shape(), DType::kF64)}};
          moe::moe_combine(w, c, comms, a, res.out);
          res.dhn = moe::moe_backward(w, res.g, c, comms, hn, a, dout, 0.01, ops::Accumulate::kNo);
          return res;
        };
        const Result one = layer(1, nullptr);
        Lane lane(moe::kExchangeExposedSpan);
        for (const int64_t chunks : {1, 2, 3, 5})
          for (Lane* l : {static_cast<Lane*>(nullptr), &lane}) {
            const std::string what = routing + " " + std::string(moe::exchange_mode_name(mode)) +
                                     " chunks " + std::to_string(chunks) +
                                     (l ? " on the lane" : "") + " rank " + std::to_string(r);
            const Result got = layer(chunks, l);
            EXPECT_EQ(relative_error(got.out, one.out), 0.0) << what;
            EXPECT_EQ(relative_error(got.dhn, one.dhn), 0.0) << what;
            EXPECT_EQ(relative_error(got.g.router, one.g.router), 0.0) << what;
            EXPECT_LE(relative_error(got.g.w_gate_up, one.g.w_gate_up), 1e-12) << what;
            EXPECT_LE(relative_error(got.g.w_down, one.g.w_down), 1e-12) << what;
          }
        // Not a layer of zeros: every output and gradient holds values.
        for (const Tensor* t : {&one.out, &one.dhn, &one.g.router, &one.g.w_gate_up, &one.g.w_down})
          EXPECT_GT(ops::sum_of_squares(*t), 0.0) << routing;
      });
}

// The plan's own dispatch (DispatchRows: with device counts in the exchange that sends the
// choices and counts) gives what dispatch gives after the plan, rows and MXFP8 rows alike, in
// both modes; and the receive buffer it needs is what window_bytes says.
TEST(ExpertExchange, ThePlansDispatchEqualsDispatchAfterIt) {
  const int64_t n = 6, experts = 4, width = 64;
  ops::ExpertPrecision mx;
  mx.recipe = ops::ExpertRecipe::kMxfp8WgradWithHp;
  mx.dispatch = RowWire::kMxfp8;
  for_each_exchange_case([&](Communicator& c, moe::ExchangeMode mode, const Tensor& index,
                             const std::string&, const std::string& what) {
    const int r = c.rank();
    const Tensor x = testing::randn({n, width}, 60 + r).to(DType::kF32);
    const Tensor w = testing::randn({n, 2}, 70 + r).to(DType::kF32);
    Tensor x_there, x_mx_there, w_there;
    moe::ExpertExchange ex(c, index, experts, mode,
                           {{&x, &x_there}, {&x, &x_mx_there, mx}, {&w, &w_there}});
    const moe::ExpertExchange after(c, index, experts, mode);
    const std::vector<std::pair<Tensor, Tensor>> pairs = {{x_there, after.dispatch(x)},
                                                          {x_mx_there, after.dispatch(x, mx)},
                                                          {w_there, after.dispatch(w)}};
    // Compare the places that hold a token (local_index has a choice there, or the row
    // came through the host path, which packs them).
    for (size_t i = 0; i < pairs.size(); ++i) {
      const auto& [got, want] = pairs[i];
      ASSERT_EQ(got.shape(), want.shape()) << what;
      const int64_t wd = got.dim(1);
      for (int64_t row = 0; row < got.dim(0); ++row) {
        bool held = mode == moe::ExchangeMode::kHostCounts;
        for (int64_t j = 0; j < 2; ++j)
          held |= after.local_index().data<int32_t>()[row * 2 + j] >= 0;
        if (!held) continue;
        EXPECT_EQ(std::memcmp(got.data<float>() + row * wd, want.data<float>() + row * wd,
                              wd * sizeof(float)),
                  0)
            << what << " part " << i << " row " << row;
      }
    }
    Tensor mxv = Tensor::empty({n, width}, DType::kF32);
    ops::mx_round_trip(x, QuantAxis::kDim0, mx.rule, mxv);
    EXPECT_NE(std::memcmp(mxv.data<float>(), x.data<float>(), x.nbytes()), 0);
  });
  // The plan's exchange with rows of 2048 bf16 at top-8 of 128 over 2 ranks, 16 places: the
  // choices, the rows and the weights per place, the counts, each section 16-byte aligned.
  const size_t places = 2 * 16;
  EXPECT_EQ(moe::ExpertExchange::window_bytes(2, 16, 8, 128, 2048, DType::kBF16, {}),
            (2 * 65 * 8 + 15) / 16 * 16 + places * (8 * 4 + 2048 * 2 + 8 * 4));
  // With the MXFP8 wire the backward's combine (the weights' gradient, bf16 rows) is the larger.
  EXPECT_EQ(moe::ExpertExchange::window_bytes(2, 16, 8, 128, 2048, DType::kBF16, mx),
            places * (8 * 4 + 2048 * 2));
}

// The FP8 wire, bit for bit with quantize-then-send: every token's FP8 rows (dispatch_fp8, and the
// plan's own dispatch of them) are the bytes and scales ops::fp8_quantize gives its sender's rows,
// sent as they are (dispatch of the data and of the scales), in both modes and with both scale
// rules; dispatch refuses the FP8 wire, and the window holds the FP8 rows' bytes.
TEST(ExpertExchange, TheFp8WireDeliversWhatTheSenderQuantized) {
  const int64_t n = 6, experts = 4, width = 256;
  for (const Fp8ScaleRule rule : {Fp8ScaleRule::kFp32, Fp8ScaleRule::kPow2}) {
    ops::ExpertPrecision fp8;
    fp8.recipe = ops::ExpertRecipe::kFp8WgradWithHp;
    fp8.dispatch = RowWire::kFp8;
    fp8.fp8_scale = rule;
    for_each_exchange_case([&](Communicator& c, moe::ExchangeMode mode, const Tensor& index,
                               const std::string& kind, const std::string& what) {
      const int r = c.rank();
      // bf16 rows over magnitudes: each 128-element block of a row has its own scale.
      Tensor x = testing::randn({n, width}, 80 + r).to(DType::kF32);
      for (int64_t i = 0; i < x.numel(); ++i)
        x.data<float>()[i] *= std::ldexp(1.0f, static_cast<int>((i / 128) % 7) * 3 - 9);
      x = x.to(DType::kBF16);
      Tensor x_there;
      QuantTensor planned;
      moe::ExpertExchange ex(c, index, experts, mode, {{&x, &x_there, fp8, &planned}});
      EXPECT_FALSE(x_there.defined()) << what;
      const QuantTensor got = ex.dispatch_fp8(x, rule);
      QuantTensor sent =
          QuantTensor::empty(x.shape(), QuantBlock::kRow128, QuantAxis::kDim0, x.device());
      ops::fp8_quantize(x, rule, sent);
      const Tensor want_data = ex.dispatch(sent.data()), want_scales = ex.dispatch(sent.scales());
      ASSERT_EQ(got.shape(), Shape({ex.received_tokens(), width})) << what;
      ASSERT_EQ(planned.shape(), got.shape()) << what;
      int64_t compared = 0;
      for (int64_t row = 0; row < got.shape()[0]; ++row) {
        bool held = mode == moe::ExchangeMode::kHostCounts;
        for (int64_t j = 0; j < 2; ++j) held |= ex.local_index().data<int32_t>()[row * 2 + j] >= 0;
        if (!held) continue;
        ++compared;
        for (const QuantTensor* q : {&got, static_cast<const QuantTensor*>(&planned)}) {
          EXPECT_EQ(std::memcmp(static_cast<const uint8_t*>(q->data().raw()) + row * width,
                                static_cast<const uint8_t*>(want_data.raw()) + row * width, width),
                    0)
              << what << " row " << row;
          EXPECT_EQ(std::memcmp(q->scales().data<float>() + row * (width / 128),
                                want_scales.data<float>() + row * (width / 128),
                                (width / 128) * sizeof(float)),
                    0)
              << what << " scales of row " << row;
        }
      }
      if (kind != "one_rank" || r == 0) {  // one_rank: rank 1 receives nothing
        EXPECT_GT(compared, 0) << what;
      }
      // Not a plain copy: the FP8 values differ from the rows.
      Tensor values = Tensor::empty(x.shape(), DType::kF32);
      ops::fp8_dequantize(sent, values);
      EXPECT_GT(relative_error(values, x.to(DType::kF32)), 1e-3) << what;
      const std::string e = testing::error_of([&] { ex.dispatch(x, fp8); });
      EXPECT_NE(e.find("call dispatch_fp8"), std::string::npos) << e;
    });
  }
  // The plan's window with the FP8 wire: 2048 E4M3 bytes and 16 f32 scales per place beside the
  // choices and weights; the backward's combine of bf16 rows is larger.
  ops::ExpertPrecision fp8;
  fp8.recipe = ops::ExpertRecipe::kFp8WgradWithHp;
  fp8.dispatch = RowWire::kFp8;
  const size_t places = 2 * 16;
  EXPECT_EQ(moe::ExpertExchange::window_bytes(2, 16, 8, 128, 2048, DType::kBF16, fp8),
            places * (8 * 4 + 2048 * 2));
  EXPECT_EQ(moe::scatter_window(2, 16, {{2048, 2, RowWire::kFp8}}, 0).bytes,
            places * 2048 + places * 16 * 4);
}

// --- equivalence with one rank -------------------------------------------------------------

}  // namespace
}  // namespace mt
