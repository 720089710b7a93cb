// Distributed training on in-process ranks: the collectives, the mesh, the expert exchange, and
// the proof that any (world, ep) reproduces the single-rank loss, gradients and parameters.
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
#include "moe/expert_exchange.h"
#include "moe/moe_layer.h"
#include "ops/elementwise.h"
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

TEST(InProcess, CollectivesForEveryWorldSize) {
  for (int world : {1, 2, 3, 4}) {
    run_in_process(world, [&](Communicator& c) {
      const int r = c.rank();
      Tensor mine = Tensor::empty({2}, DType::kF64);
      mine.set_item(0, 10 * r);
      mine.set_item(1, 10 * r + 1);
      Tensor all = Tensor::poisoned({2 * world}, DType::kF64);
      c.all_gather(mine, all);
      for (int p = 0; p < world; ++p) {
        EXPECT_EQ(all.item(2 * p), 10 * p);
        EXPECT_EQ(all.item(2 * p + 1), 10 * p + 1);
      }
      // reduce_scatter: element i of every rank's input is r + i; chunk r sums over ranks.
      Tensor in = Tensor::empty({3 * world}, DType::kF64);
      for (int i = 0; i < 3 * world; ++i) in.set_item(i, r + i);
      Tensor out = Tensor::poisoned({3}, DType::kF64);
      c.reduce_scatter(in, out);
      const double rank_sum = world * (world - 1) / 2.0;
      for (int i = 0; i < 3; ++i) EXPECT_EQ(out.item(i), rank_sum + world * (3 * r + i));
      Tensor counts = Tensor::empty({1}, DType::kI64);
      counts.set_item(0, r + 1);
      c.all_reduce(counts);
      EXPECT_EQ(counts.item(0), world * (world + 1) / 2);
    });
  }
}

TEST(InProcess, AllToAllDeliversRowsBySourceAndUnevenCounts) {
  const int world = 3;
  run_in_process(world, [&](Communicator& c) {
    const int r = c.rank();
    // Rank r sends (r + p) rows to peer p; each row is [source, destination, index].
    std::vector<int64_t> send(world), recv(world);
    int64_t total = 0, in_total = 0;
    for (int p = 0; p < world; ++p) {
      send[p] = r + p;
      recv[p] = p + r;
      total += send[p];
      in_total += recv[p];
    }
    Tensor s = Tensor::empty({total, 3}, DType::kF64);
    int64_t row = 0;
    for (int p = 0; p < world; ++p)
      for (int i = 0; i < send[p]; ++i, ++row) {
        s.set_item(row * 3, r);
        s.set_item(row * 3 + 1, p);
        s.set_item(row * 3 + 2, i);
      }
    Tensor got = Tensor::poisoned({in_total, 3}, DType::kF64);
    c.all_to_all(s, send, got, recv);
    row = 0;
    for (int p = 0; p < world; ++p)
      for (int i = 0; i < recv[p]; ++i, ++row) {
        EXPECT_EQ(got.item(row * 3), p);
        EXPECT_EQ(got.item(row * 3 + 1), r);
        EXPECT_EQ(got.item(row * 3 + 2), i);
      }
  });
}

TEST(InProcess, AFailingRankStopsTheOthersWithItsError) {
  try {
    run_in_process(3, [](Communicator& c) {
      if (c.rank() == 1) throw DataError("rank 1 read a bad file");
      c.barrier();
    });
    FAIL() << "the failure must propagate";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 read a bad file"), std::string::npos);
  }
}

TEST(InProcess, AMissingRankTimesOutWithItsState) {
  try {
    run_in_process(
        2,
        [](Communicator& c) {
          if (c.rank() == 0) c.barrier();
        },
        /*timeout_s=*/0.3);
    FAIL() << "a rank that never arrives must time out";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("rank 0 timed out"), std::string::npos) << msg;
    EXPECT_NE(msg.find("1 of 2 ranks arrived"), std::string::npos) << msg;
  }
}

TEST(Mesh, GroupsAndValidation) {
  std::mutex mu;
  run_in_process(4, [&](Communicator& c) {
    dist::DeviceMesh mesh(c, {4, 2}, 8);
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_EQ(mesh.ep().size(), 2);
    EXPECT_EQ(mesh.dp_shard_mod_ep().size(), 2);
    EXPECT_EQ(mesh.ep().rank(), c.rank() % 2);
    EXPECT_EQ(mesh.dp_shard_mod_ep().rank(), c.rank() / 2);
    EXPECT_EQ(mesh.first_local_expert(), 4 * (c.rank() % 2));
  });
  EXPECT_THROW((dist::MeshShape{4, 3}.validate(12)), ConfigError);
  EXPECT_THROW((dist::MeshShape{4, 4}.validate(6)), ConfigError);
}

// Mixed precision: a sharded group gathers only its compute copy, in the compute dtype (bf16),
// equal to the cast of the full fp32 parameters; an expert group's gradient buffer starts
// unwritten (the first GEMM overwrites it), a dense one zeroed.
TEST(Fsdp, MixedPrecisionGathersTheBf16CopyOnly) {
  std::mutex mu;
  run_in_process(2, [&](Communicator& c) {
    ParamGroup g = make_param_group(ParamKind::kExpert, {{"w", {5, 3}}, {"v", {4}}}, DType::kF32);
    allocate_group(g);
    for (int64_t i = 0; i < g.numel; ++i) g.params.set_item(i, 0.1 * i + 1.0 / 3.0);
    const Tensor full = g.params.clone();
    place_group(g, Device::kCPU, DType::kBF16);
    fsdp::shard_group(g, c);
    fsdp::gather(g);
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_FALSE(g.params.defined());  // no fp32 gather
    ASSERT_TRUE(g.compute.defined());
    EXPECT_EQ(g.compute.dtype(), DType::kBF16);
    const Tensor cast = full.to(DType::kBF16);
    for (int64_t i = 0; i < g.numel; ++i) EXPECT_EQ(g.compute.item(i), cast.item(i)) << i;
    EXPECT_EQ(g.weight(1).item(3), cast.item(g.specs[1].offset + 3));
    fsdp::begin_backward(g);
    EXPECT_TRUE(g.grads_unwritten);
    fsdp::release(g);
    EXPECT_FALSE(g.compute.defined());
  });
}

// A group with a master-weight spec (the router) gathers its fp32 masters and casts the bf16
// copy locally: the master spec reads the fp32 values, the others the bf16 cast; release drops
// both; unsharded, the master spec reads the params while the rest read the cast copy.
TEST(Fsdp, AMasterWeightSpecIsReadInFp32) {
  std::mutex mu;
  auto make = [] {
    std::vector<ParamSpec> specs = {{"w", {5, 3}}, {"router", {4, 2}}};
    specs[1].master_weight = true;
    ParamGroup g = make_param_group(ParamKind::kDense, specs, DType::kF32);
    allocate_group(g);
    for (int64_t i = 0; i < g.numel; ++i) g.params.set_item(i, 0.1 * i + 1.0 / 3.0);
    return g;
  };
  run_in_process(2, [&](Communicator& c) {
    ParamGroup g = make();
    const Tensor full = g.params.clone(), cast = full.to(DType::kBF16);
    place_group(g, Device::kCPU, DType::kBF16);
    fsdp::shard_group(g, c);
    fsdp::gather(g);
    std::lock_guard<std::mutex> lock(mu);
    ASSERT_TRUE(g.params.defined() && g.compute.defined());
    EXPECT_EQ(g.weight(1).dtype(), DType::kF32);
    EXPECT_EQ(g.weight(0).dtype(), DType::kBF16);
    for (int64_t i = 0; i < 8; ++i) {
      EXPECT_EQ(g.weight(1).item(i), full.item(g.specs[1].offset + i)) << i;
      EXPECT_NE(g.weight(1).item(i), cast.item(g.specs[1].offset + i)) << "not rounded " << i;
    }
    for (int64_t i = 0; i < 15; ++i) EXPECT_EQ(g.weight(0).item(i), cast.item(i)) << i;
    fsdp::release(g);
    EXPECT_FALSE(g.params.defined() || g.compute.defined());
  });
  ParamGroup one = make();
  place_group(one, Device::kCPU, DType::kBF16);
  fsdp::gather(one);
  EXPECT_EQ(one.weight(1).dtype(), DType::kF32);
  EXPECT_EQ(one.weight(0).dtype(), DType::kBF16);
}

// Forwards every collective to `inner`, counting the all-gathers.
class CountingComm final : public Communicator {
 public:
  explicit CountingComm(Communicator& inner) : inner_(&inner) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  void all_gather(const Tensor& send, Tensor& recv) override {
    ++gathers;
    inner_->all_gather(send, recv);
  }
  void reduce_scatter(const Tensor& send, Tensor& recv) override {
    inner_->reduce_scatter(send, recv);
  }
  void all_reduce(Tensor& t) override { inner_->all_reduce(t); }
  void all_to_all(const Tensor& send, const std::vector<int64_t>& send_rows, Tensor& recv,
                  const std::vector<int64_t>& recv_rows) override {
    inner_->all_to_all(send, send_rows, recv, recv_rows);
  }
  void barrier() override { inner_->barrier(); }
  std::unique_ptr<Communicator> split(int color, int key) override {
    return inner_->split(color, key);
  }
  int gathers = 0;

 private:
  Communicator* inner_;
};

// A unit schedule over four units on 2 ranks: an embedding-like unit 0 (its backward reads no
// parameters), a dense unit 1 and an MX-only unit 2 (an expert matrix under an MX recipe), all
// sharded, and an MX-only unit 3 that is not (experts with ep = world). Reshard::kAfterBackward
// holds units 1 and 2 from their forward to their backward: one all-gather each instead of two,
// and unit 2's backward MX copy made at the forward, equal to the one a backward gather makes;
// units 0 and 3 (nothing to gather again) are released after their forward under either policy,
// and nothing is held once the pass is done.
TEST(Fsdp, ReshardAfterBackwardGathersEachUnitOncePerPass) {
  std::mutex mu;
  // Units 2's and 3's backward copies as their backward read them (rank 0), by policy.
  std::map<std::pair<fsdp::Reshard, size_t>, Tensor> backward_copy;
  for (const fsdp::Reshard reshard : {fsdp::Reshard::kAfterForward, fsdp::Reshard::kAfterBackward})
    run_in_process(2, [&](Communicator& c) {
      const bool hold = reshard == fsdp::Reshard::kAfterBackward;
      CountingComm counted(c);
      std::vector<ParamUnit> units(4);
      for (size_t u = 0; u < units.size(); ++u) {
        std::vector<ParamSpec> specs = {{"w" + std::to_string(u), {32, 64}}};
        specs[0].mx_copies = u >= 2;
        ParamGroup g = make_param_group(ParamKind::kDense, specs, DType::kF32);
        allocate_group(g);
        init_params(g, 5 + u, 0.3);
        place_group(g, Device::kCPU, DType::kBF16);
        if (u < 3) fsdp::shard_group(g, counted);
        units[u].name = "unit" + std::to_string(u);
        units[u].groups.push_back(std::move(g));
      }
      auto weights_held = [&](size_t u) {
        const ParamGroup& g = units[u].groups[0];
        return g.sharded() ? g.compute.defined() || g.params.defined() || !g.mx.empty()
                           : !g.mx.empty();
      };
      fsdp::UnitSchedule s(units, 1.0, {false, true, true, true}, ops::MxCopyUse::kBackward,
                           reshard);
      for (size_t u = 0; u < units.size(); ++u) {
        s.forward_begin(u);
        s.forward_end(u);
      }
      const int forward_gathers = counted.gathers;
      {
        std::lock_guard<std::mutex> lock(mu);
        EXPECT_EQ(forward_gathers, 3);
        EXPECT_FALSE(weights_held(0));
        EXPECT_EQ(weights_held(1), hold);
        EXPECT_EQ(units[1].groups[0].compute.defined(), hold);
        EXPECT_EQ(weights_held(2), hold);
        EXPECT_FALSE(weights_held(3));
        const ParamGroup& mx = units[2].groups[0];
        if (hold) {  // the MX copies of both passes, the gathered weights dropped
          EXPECT_TRUE(mx.mx[0].along_k.defined() && mx.mx[0].along_n.defined());
          EXPECT_FALSE(mx.compute.defined() || mx.params.defined());
        }
      }
      for (size_t u = units.size(); u-- > 0;) {
        s.backward_begin(u);
        {
          std::lock_guard<std::mutex> lock(mu);
          EXPECT_EQ(weights_held(u), u > 0) << "unit " << u;
          if (u >= 2 && c.rank() == 0)
            backward_copy[{reshard, u}] = units[u].groups[0].mx[0].along_n.clone();
        }
        s.backward_end(u);
      }
      s.backward_done();
      std::lock_guard<std::mutex> lock(mu);
      EXPECT_EQ(counted.gathers - forward_gathers, hold ? 0 : 2);
      for (size_t u = 0; u < units.size(); ++u) EXPECT_FALSE(weights_held(u)) << "unit " << u;
    });
  ASSERT_EQ(backward_copy.size(), 4u);
  for (size_t u : {2, 3}) {
    const Tensor& a = backward_copy[{fsdp::Reshard::kAfterForward, u}];
    const Tensor& b = backward_copy[{fsdp::Reshard::kAfterBackward, u}];
    ASSERT_EQ(a.numel(), b.numel());
    double sum = 0;
    for (int64_t i = 0; i < a.numel(); ++i) sum += std::abs(a.item(i));
    EXPECT_GT(sum, 0.0);
    for (int64_t i = 0; i < a.numel(); ++i)
      ASSERT_EQ(a.item(i), b.item(i)) << "unit " << u << " " << i;
  }
}

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

// scatter_rows' default path (each region whole through all_to_all): every row at rank *
// capacity + its slot in each peer's buffer, rows with slot -1 nowhere; i32 rows of 3. A slot
// past the capacity is refused.
TEST(InProcess, ScatterRowsPlacesEveryRowAtItsSlot) {
  const int world = 3;
  const int64_t n = 5, capacity = 7;
  run_in_process(world, [&](Communicator& c) {
    const int r = c.rank();
    // Row t goes to peer p when (t + p + r) % 3 != 0, at the count of earlier rows to p.
    Tensor slot = Tensor::empty({n, world}, DType::kI32);
    std::vector<int32_t> next(world, 0);
    for (int64_t t = 0; t < n; ++t)
      for (int p = 0; p < world; ++p)
        slot.data<int32_t>()[t * world + p] = (t + p + r) % 3 != 0 ? next[p]++ : -1;
    Tensor rows = Tensor::empty({n, 3}, DType::kI32);
    for (int64_t i = 0; i < n * 3; ++i)
      rows.data<int32_t>()[i] = static_cast<int32_t>(1000 * r + i);
    Tensor recv = Tensor::empty({world * capacity, 3}, DType::kI32);
    std::fill(recv.data<int32_t>(), recv.data<int32_t>() + recv.numel(), -7);
    c.scatter_rows(rows, slot, capacity, recv);
    for (int q = 0; q < world; ++q) {
      int64_t s = 0;
      for (int64_t t = 0; t < n; ++t) {
        if ((t + r + q) % 3 == 0) continue;  // q's row t to this rank
        for (int64_t d = 0; d < 3; ++d)
          EXPECT_EQ(recv.data<int32_t>()[(q * capacity + s) * 3 + d], 1000 * q + t * 3 + d)
              << "from " << q << " row " << t;
        ++s;
      }
    }
    Tensor bad = slot.clone();
    bad.data<int32_t>()[0] = static_cast<int32_t>(capacity);
    const std::string e = testing::error_of([&] { c.scatter_rows(rows, bad, capacity, recv); });
    EXPECT_NE(e.find("slot 7 of row 0 for rank 0: 7 places per rank"), std::string::npos) << e;
  });
}

// A scatter of several parts with one layout (the default path): an i32 part, an f64 part, an
// MXFP8 part of f32 rows (arriving as their MX values along the row, bit for bit: the wire's
// quantization is ops::mx_quantize, each rule) and the per-peer rows, in one call; every row at
// rank * capacity + its slot; parts and per-peer rows that do not fit are named.
TEST(InProcess, ScatterRowsMovesEveryPartWithOneLayout) {
  const int world = 3;
  const int64_t n = 6, capacity = 8, width = 64;
  for (const MxScaleRule rule : {MxScaleRule::kRceil, MxScaleRule::kFloor})
    run_in_process(world, [&](Communicator& c) {
      const int r = c.rank();
      // Row t goes to peer p when (t + 2p + r) % 4 != 0.
      auto goes = [](int64_t t, int p, int from) { return (t + 2 * p + from) % 4 != 0; };
      Tensor slot = Tensor::empty({n, world}, DType::kI32);
      std::vector<int32_t> next(world, 0);
      for (int64_t t = 0; t < n; ++t)
        for (int p = 0; p < world; ++p)
          slot.data<int32_t>()[t * world + p] = goes(t, p, r) ? next[p]++ : -1;
      auto ids_of = [&](int from) {
        Tensor ids = Tensor::empty({n, 3}, DType::kI32);
        for (int64_t i = 0; i < n * 3; ++i)
          ids.data<int32_t>()[i] = static_cast<int32_t>(1000 * from + i);
        return ids;
      };
      // Rows spread over magnitudes (several scales per row, a zero block, a subnormal one).
      auto rows_of = [&](int from) {
        Tensor x = testing::randn({n, width}, 50 + from).to(DType::kF32);
        for (int64_t t = 0; t < n; ++t)
          for (int64_t d = 0; d < width; ++d) {
            float* v = x.data<float>() + t * width + d;
            if (d < 32 && t == 1)
              *v = 0.0f;
            else
              *v *= std::ldexp(1.0f,
                               static_cast<int>((t * 7 + d / 32 * 13) % 40) - (t == 2 ? 140 : 20));
          }
        return x;
      };
      const Tensor ids = ids_of(r);
      const Tensor f64 = testing::randn({n, 5}, 40 + r);
      const Tensor x = rows_of(r);
      Tensor ids_in = Tensor::empty({world * capacity, 3}, DType::kI32);
      Tensor f64_in = Tensor::poisoned({world * capacity, 5}, DType::kF64);
      Tensor x_in = Tensor::poisoned({world * capacity, width}, DType::kF32);
      Tensor counts = Tensor::empty({world, 2}, DType::kI64);
      for (int p = 0; p < world; ++p) {
        counts.data<int64_t>()[p * 2] = next[p];
        counts.data<int64_t>()[p * 2 + 1] = 10 * r + p;
      }
      Tensor counts_in = Tensor::poisoned({world, 2}, DType::kI64);
      dist::RowScatter s;
      s.slot = &slot;
      s.capacity = capacity;
      s.parts = {{&ids, &ids_in}, {&f64, &f64_in}, {&x, &x_in, dist::RowWire::kMxfp8, rule}};
      s.to_peers = &counts;
      s.from_peers = &counts_in;
      c.scatter_rows(s);
      for (int q = 0; q < world; ++q) {
        const Tensor theirs = ids_of(q), their_f64 = testing::randn({n, 5}, 40 + q);
        Tensor their_mx = Tensor::empty({n, width}, DType::kF32);
        ops::mx_round_trip(rows_of(q), MxAxis::kDim0, rule, their_mx);
        int64_t at = 0;
        for (int64_t t = 0; t < n; ++t) {
          if (!goes(t, r, q)) continue;
          const int64_t place = q * capacity + at++;
          for (int64_t d = 0; d < 3; ++d)
            ASSERT_EQ(ids_in.data<int32_t>()[place * 3 + d], theirs.data<int32_t>()[t * 3 + d]);
          for (int64_t d = 0; d < 5; ++d)
            ASSERT_EQ(f64_in.item(place * 5 + d), their_f64.item(t * 5 + d));
          ASSERT_EQ(std::memcmp(x_in.data<float>() + place * width,
                                their_mx.data<float>() + t * width, width * sizeof(float)),
                    0)
              << "MXFP8 row " << t << " from " << q;
        }
        EXPECT_EQ(counts_in.item(q * 2), at) << "count from " << q;
        EXPECT_EQ(counts_in.item(q * 2 + 1), 10 * q + r);
      }
      // The MX values differ from the rows (the test would pass on a plain copy otherwise).
      Tensor mine = Tensor::empty({n, width}, DType::kF32);
      ops::mx_round_trip(x, MxAxis::kDim0, rule, mine);
      EXPECT_NE(std::memcmp(mine.data<float>(), x.data<float>(), x.nbytes()), 0);

      Tensor narrow = Tensor::empty({world * capacity, 4}, DType::kF64);
      dist::RowScatter bad = s;
      bad.parts = {{&f64, &narrow}};
      bad.to_peers = nullptr;
      bad.from_peers = nullptr;
      std::string e = testing::error_of([&] { c.scatter_rows(bad); });
      EXPECT_NE(e.find("scatter_rows of f64 (6, 5) into f64 (24, 4)"), std::string::npos) << e;
      Tensor odd = Tensor::empty({n, 40}, DType::kF32),
             odd_in = Tensor::empty({world * capacity, 40}, DType::kF32);
      bad.parts = {{&odd, &odd_in, dist::RowWire::kMxfp8}};
      e = testing::error_of([&] { c.scatter_rows(bad); });
      EXPECT_NE(e.find("an MXFP8 part of f32 (6, 40) (needs f32, bf16 or f64 rows"),
                std::string::npos)
          << e;
      bad.parts = {};
      bad.to_peers = &counts;
      e = testing::error_of([&] { c.scatter_rows(bad); });
      EXPECT_NE(e.find("per-peer rows need both"), std::string::npos) << e;
    });
}

// A summed part (the default path: its places, then ops::combine_forward): each of M rows is its
// residual plus the places its index names, in index order, written out in f64 here by hand;
// -1 entries add nothing. A wrong index shape and an MXFP8 summed part are named.
TEST(InProcess, ScatterRowsSumsAPartIntoItsRows) {
  const int world = 3;
  const int64_t n = 5, capacity = 6, width = 4, m = 7;
  run_in_process(world, [&](Communicator& c) {
    const int r = c.rank();
    auto goes = [](int64_t t, int p, int from) { return (t + p + from) % 3 != 0; };
    Tensor slot = Tensor::empty({n, world}, DType::kI32);
    std::vector<int32_t> next(world, 0);
    for (int64_t t = 0; t < n; ++t)
      for (int p = 0; p < world; ++p)
        slot.data<int32_t>()[t * world + p] = goes(t, p, r) ? next[p]++ : -1;
    const Tensor rows = testing::randn({n, width}, 70 + r);
    // Row i sums, from each peer q, the place of q's (i + q) % n-th row when it came here.
    Tensor index = Tensor::empty({m, world}, DType::kI32);
    std::vector<std::vector<int64_t>> source(m, std::vector<int64_t>(world, -1));
    for (int q = 0; q < world; ++q) {
      std::vector<int32_t> place_of(n, -1);
      int32_t at = 0;
      for (int64_t t = 0; t < n; ++t)
        if (goes(t, r, q)) place_of[t] = static_cast<int32_t>(q * capacity + at++);
      for (int64_t i = 0; i < m; ++i) {
        const int64_t t = (i + q) % n;
        index.data<int32_t>()[i * world + q] = i == 3 ? -1 : place_of[t];
        if (i != 3 && place_of[t] >= 0) source[i][q] = t;
      }
    }
    const Tensor residual = testing::randn({m, width}, 80 + r);
    for (const bool with_residual : {false, true}) {
      Tensor out = Tensor::poisoned({m, width}, DType::kF64);
      dist::RowScatter s;
      s.slot = &slot;
      s.capacity = capacity;
      s.parts = {
          {&rows, &out, dist::RowWire::kAsIs, {}, &index, with_residual ? &residual : nullptr}};
      c.scatter_rows(s);
      int64_t summed = 0;
      for (int64_t i = 0; i < m; ++i)
        for (int64_t d = 0; d < width; ++d) {
          double want = with_residual ? residual.item(i * width + d) : 0.0;
          for (int q = 0; q < world; ++q)
            if (source[i][q] >= 0) {
              want += testing::randn({n, width}, 70 + q).item(source[i][q] * width + d);
              summed += d == 0;
            }
          ASSERT_EQ(out.item(i * width + d), want) << "row " << i << ", column " << d;
        }
      EXPECT_GT(summed, m);  // rows of several peers were added up
    }
    Tensor out = Tensor::empty({m, width}, DType::kF64);
    Tensor short_index = index.slice_rows(0, m - 1);
    dist::RowScatter bad;
    bad.slot = &slot;
    bad.capacity = capacity;
    bad.parts = {{&rows, &out, dist::RowWire::kAsIs, {}, &short_index}};
    std::string e = testing::error_of([&] { c.scatter_rows(bad); });
    EXPECT_NE(e.find("scatter_rows of f64 (5, 4) into f64 (7, 4)"), std::string::npos) << e;
    const Tensor wide = testing::randn({n, 32}, 90).to(DType::kF32);
    Tensor wide_out = Tensor::empty({m, 32}, DType::kF32);
    bad.parts = {{&wide, &wide_out, dist::RowWire::kMxfp8, {}, &index}};
    e = testing::error_of([&] { c.scatter_rows(bad); });
    EXPECT_NE(e.find("a summed part of f32 rows on the MXFP8 wire"), std::string::npos) << e;
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
        auto layer = [&](int64_t chunks, moe::ExchangeLane* lane) {
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
        moe::ExchangeLane lane;
        for (const int64_t chunks : {1, 2, 3, 5})
          for (moe::ExchangeLane* l : {static_cast<moe::ExchangeLane*>(nullptr), &lane}) {
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
  mx.dispatch = ops::DispatchDtype::kMxfp8;
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
    ops::mx_round_trip(x, MxAxis::kDim0, mx.rule, mxv);
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

// --- equivalence with one rank -------------------------------------------------------------

std::vector<std::string> small_model(int64_t rows_per_rank) {
  return {"model.vocab_size=32",
          "model.dim=8",
          "model.n_layers=2",
          "model.n_heads=4",
          "model.n_kv_heads=2",
          "model.head_dim=6",
          "model.n_experts=8",
          "model.top_k=2",
          "model.moe_dim=5",
          "model.init_std=0.5",
          "model.compute_dtype=f64",
          "model.aux_loss_coef=0.01",
          "model.bias_update_rate=0.001",
          "data.languages=2",
          "data.branching=2",
          "data.min_doc_len=4",
          "data.max_doc_len=12",
          "train.seq_len=16",
          "train.batch_rows=" + std::to_string(rows_per_rank),
          "train.grad_accum=2",
          "train.steps=3",
          "train.warmup_steps=1",
          "train.log_every=100"};
}

struct Snapshot {
  std::vector<StepMetrics> metrics;
  std::map<std::string, Tensor> params, grads;  // full tensors by name (experts: all E)
};

// Full tensors by name from a model whose groups may be sharded and hold E/ep experts.
void collect(Qwen3Moe& model, int64_t n_experts, Snapshot& out, std::mutex& mu) {
  for (auto& u : model.units())
    for (auto& g : u.groups) {
      auto full = [&](const Tensor& shard) {
        if (!g.sharded()) return shard.clone();
        Tensor all = Tensor::empty({shard.numel() * g.comm->size()}, shard.dtype());
        g.comm->all_gather(shard, all);
        return all;
      };
      const Tensor p = full(g.shard), dp = full(g.grad_shard);
      std::lock_guard<std::mutex> lock(mu);
      for (const ParamSpec& s : g.specs) {
        Shape whole = s.shape;
        if (g.kind == ParamKind::kExpert) whole[0] = n_experts;
        for (auto* dst : {&out.params, &out.grads})
          if (!dst->count(s.name)) dst->emplace(s.name, Tensor::poisoned(whole, DType::kF64));
        const int64_t n = shape_numel(s.shape);
        out.params[s.name].view(s.init_offset, {n}).copy_from(p.view(s.offset, {n}));
        out.grads[s.name].view(s.init_offset, {n}).copy_from(dp.view(s.offset, {n}));
      }
    }
}

// Routing that a config cannot ask for: a router bias of 10 on experts 0 and 1 (the bias only
// steers the choice), so every token chooses both (top-2) and experts 2..7 receive nothing; with
// ep > 1 every rank but the first receives no token.
void concentrate_routing(Trainer& t) {
  for (Tensor& b : t.model().router_biases()) {
    b.zero_();
    b.set_item(0, 10.0);
    b.set_item(1, 10.0);
  }
}

Snapshot train(int world, int ep, int64_t steps, const std::vector<std::string>& extra = {},
               const std::function<void(Trainer&)>& prepare = {}) {
  const int64_t rows = 2;
  std::vector<std::string> sets = small_model(world == 0 ? 0 : rows);
  sets.insert(sets.end() - 1, extra.begin(), extra.end());  // the last one is replaced below
  Snapshot snap;
  std::mutex mu;
  if (world == 0) {  // the single-rank reference holding the whole global batch of 4 ranks
    sets.back() = "train.log_every=100";
    sets.push_back("train.batch_rows=" + std::to_string(rows * 4));
    Trainer t(parse_config_string("", sets));
    if (prepare) prepare(t);
    RunOptions o;
    o.steps = steps;
    snap.metrics = t.run(o);
    collect(t.model(), 8, snap, mu);
    return snap;
  }
  sets.push_back("parallel.world=" + std::to_string(world));
  sets.push_back("parallel.ep=" + std::to_string(ep));
  // Every world covers the same 4-rank global batch: fewer ranks take more rows each.
  sets.push_back("train.batch_rows=" + std::to_string(rows * 4 / world));
  const Config c = parse_config_string("", sets);
  run_in_process(world, [&](Communicator& comm) {
    Trainer t(c, &comm);
    if (prepare) prepare(t);
    RunOptions o;
    o.steps = steps;
    const auto m = t.run(o);
    collect(t.model(), 8, snap, mu);
    if (comm.rank() == 0) snap.metrics = m;
  });
  return snap;
}

void expect_same(const std::map<std::string, Tensor>& a, const std::map<std::string, Tensor>& b,
                 double tol, const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : b) {
    ASSERT_TRUE(a.count(name)) << name;
    EXPECT_LE(relative_error(a.at(name), t), tol) << what << " " << name;
  }
}

// (W, ep) against one rank holding the whole batch, with each routing: the router's (learned),
// the benchmarks' fixed patterns, and every token on experts 0 and 1 (concentrate_routing); with
// ep > 1 also with the layer's tokens in chunks, each with its own exchange.
struct EquivalenceCase {
  int world, ep;
  const char* routing = "learned";  // model.routing, or "concentrated"
  const char* exchange = "device";  // parallel.ep_exchange
  int chunks = 1;                   // parallel.ep_chunks
};
class Equivalence : public ::testing::TestWithParam<EquivalenceCase> {};

TEST_P(Equivalence, OneStepLossAndGradientsThenThreeStepsParameters) {
  const auto [world, ep, routing, exchange, chunks] = GetParam();
  const bool concentrated = std::string(routing) == "concentrated";
  std::vector<std::string> sets = {
      std::string("model.routing=") + (concentrated ? "learned" : routing),
      std::string("parallel.ep_exchange=") + exchange,
      "parallel.ep_chunks=" + std::to_string(chunks)};
  // The fixed patterns run over each rank's token positions: skewed's cold round-robin has period
  // 6 (E = 8: 6 cold experts), so micro-batches of a multiple of 6 tokens route as the whole
  // batch does.
  if (std::string(routing) == "skewed") sets.push_back("train.seq_len=24");
  const std::function<void(Trainer&)> prepare =
      concentrated ? std::function<void(Trainer&)>(concentrate_routing) : nullptr;
  const Snapshot ref1 = train(0, 1, 1, sets, prepare), got1 = train(world, ep, 1, sets, prepare);
  EXPECT_NEAR(got1.metrics[0].loss, ref1.metrics[0].loss, 1e-10 * ref1.metrics[0].loss);
  EXPECT_NEAR(got1.metrics[0].aux_loss, ref1.metrics[0].aux_loss, 1e-10 * ref1.metrics[0].aux_loss);
  EXPECT_NEAR(got1.metrics[0].grad_norm, ref1.metrics[0].grad_norm,
              1e-10 * ref1.metrics[0].grad_norm);
  expect_same(got1.grads, ref1.grads, 1e-10, "gradient");
  // Time in dispatch/combine is reported exactly when experts are split over ranks.
  if (ep > 1)
    EXPECT_GT(got1.metrics[0].exchange_ms, 0.0);
  else
    EXPECT_EQ(got1.metrics[0].exchange_ms, 0.0);
  // On CPU ranks every exchange is waited for: all of it is exposed.
  EXPECT_EQ(got1.metrics[0].exchange_exposed_ms, got1.metrics[0].exchange_ms);
  EXPECT_EQ(ref1.metrics[0].exchange_ms, 0.0);
  if (concentrated)  // experts 2..7 had no rows: their gradients are zero, the others' not
    for (int64_t e = 0; e < 8; ++e) {
      const Tensor& g = ref1.grads.at("layers.0.moe.w_down");
      const int64_t per = g.numel() / 8;
      double sum = 0;
      for (int64_t i = e * per; i < (e + 1) * per; ++i) sum += std::abs(g.item(i));
      EXPECT_EQ(sum == 0.0, e >= 2) << "expert " << e;
    }
  const Snapshot ref3 = train(0, 1, 3, sets, prepare), got3 = train(world, ep, 3, sets, prepare);
  for (int s = 0; s < 3; ++s)
    EXPECT_NEAR(got3.metrics[s].loss, ref3.metrics[s].loss, 1e-10 * ref3.metrics[s].loss);
  expect_same(got3.params, ref3.params, 1e-10, "parameter");
}

// Whole packing of an SFT file (documents of 2 to 20 tokens in rows of 17: some fill a row, some
// are truncated, the rest padded) with a blend of two files: any (W, ep) gives the single rank's
// loss, gradients, routing statistics and, after three steps, parameters; the padding is reported.
TEST(EquivalenceWhole, SftBlendMatchesOneRank) {
  std::vector<std::string> paths;
  for (int f = 0; f < 2; ++f) {
    TokenDocuments docs;
    docs.doc_offsets = {0};
    const CounterRng rng{static_cast<uint64_t>(f), 12};
    for (int d = 0; d < 30; ++d) {
      const int64_t len = 2 + rng.below(d, 19);
      for (int64_t i = 0; i < len; ++i) {
        docs.tokens.push_back(rng.below(100 * d + i + 50, 32));
        docs.loss_mask.push_back(i % 3 != 0);
      }
      docs.doc_offsets.push_back(docs.tokens.size());
    }
    paths.push_back(testing::unique_temp_path("whole_equiv_" + std::to_string(f) + ".tok"));
    write_token_file(paths.back(), docs);
  }
  const std::vector<std::string> sets = {
      "data.source=sft",
      "data.mix=[{path=\"" + paths[0] + "\", weight=2}, {path=\"" + paths[1] + "\", weight=1}]",
      "data.pack_window=6"};
  for (const auto& [world, ep] : {std::pair{2, 1}, std::pair{2, 2}, std::pair{4, 2}}) {
    const Snapshot ref1 = train(0, 1, 1, sets), got1 = train(world, ep, 1, sets);
    const StepMetrics &r = ref1.metrics[0], &g = got1.metrics[0];
    EXPECT_NEAR(g.loss, r.loss, 1e-10 * r.loss);
    EXPECT_NEAR(g.aux_loss, r.aux_loss, 1e-10 * r.aux_loss);
    EXPECT_GT(r.pad_fraction, 0.0);
    EXPECT_EQ(g.pad_fraction, r.pad_fraction);
    EXPECT_EQ(g.expert_load_max_over_mean, r.expert_load_max_over_mean);
    EXPECT_EQ(g.idle_expert_fraction, r.idle_expert_fraction);
    ASSERT_EQ(r.expert_load_max_over_mean.size(), 2u);
    EXPECT_GE(r.expert_load_max_over_mean[0], 1.0);
    expect_same(got1.grads, ref1.grads, 1e-10, "gradient");
    const Snapshot ref3 = train(0, 1, 3, sets), got3 = train(world, ep, 3, sets);
    expect_same(got3.params, ref3.params, 1e-10, "parameter");
  }
  for (const std::string& p : paths) std::filesystem::remove(p);
}

// MX expert recipes: every quantization that runs along a row (the forward's and input
// gradient's operands) sees the same rows however the batch is split, so mxfp8_wgrad_with_hp is
// equivalent at every (W, ep). mxfp8 also blocks each expert's rows along the tokens for the
// weight gradient: with W = ep an expert receives the batch's rows for it in the single rank's
// order, so the blocks are the same; with W > ep each rank of an EP group blocks its own rows
// (as torchao's per-rank grouped GEMM does) and the single-rank run is not the reference.
struct MxCase {
  int world, ep;
  const char* recipe;
  const char* dispatch = "bf16";  // parallel.ep_dispatch_dtype (mxfp8 with mxfp8: requant_dim1)
  int chunks = 1;  // parallel.ep_chunks (not with mxfp8: each chunk blocks its own rows)
};
class EquivalenceMx : public ::testing::TestWithParam<MxCase> {};

TEST_P(EquivalenceMx, OneStepGradientsThenThreeStepsParameters) {
  const MxCase m = GetParam();
  std::vector<std::string> mx = {"model.dim=32", "model.moe_dim=32",
                                 std::string("model.expert_recipe=") + m.recipe,
                                 std::string("parallel.ep_dispatch_dtype=") + m.dispatch,
                                 "parallel.ep_chunks=" + std::to_string(m.chunks)};
  if (std::string(m.dispatch) == "mxfp8" && std::string(m.recipe) == "mxfp8")
    mx.push_back("model.requant_dim1=true");
  const Snapshot ref1 = train(0, 1, 1, mx), got1 = train(m.world, m.ep, 1, mx);
  EXPECT_NEAR(got1.metrics[0].loss, ref1.metrics[0].loss, 1e-10 * ref1.metrics[0].loss);
  expect_same(got1.grads, ref1.grads, 1e-10, "gradient");
  const Snapshot ref3 = train(0, 1, 3, mx), got3 = train(m.world, m.ep, 3, mx);
  expect_same(got3.params, ref3.params, 1e-10, "parameter");
  // Not the bf16 run: the recipe changed the gradients.
  const Snapshot plain = train(0, 1, 1, {"model.dim=32", "model.moe_dim=32"});
  EXPECT_GT(
      relative_error(ref1.grads.at("layers.0.moe.w_down"), plain.grads.at("layers.0.moe.w_down")),
      1e-4);
}

INSTANTIATE_TEST_SUITE_P(
    WorldEpRecipe, EquivalenceMx,
    ::testing::Values(MxCase{2, 1, "mxfp8_wgrad_with_hp"}, MxCase{4, 2, "mxfp8_wgrad_with_hp"},
                      MxCase{4, 4, "mxfp8_wgrad_with_hp"}, MxCase{2, 2, "mxfp8"},
                      MxCase{4, 4, "mxfp8"}, MxCase{4, 2, "mxfp8_wgrad_with_hp", "mxfp8"},
                      MxCase{2, 2, "mxfp8", "mxfp8"},
                      MxCase{4, 2, "mxfp8_wgrad_with_hp", "mxfp8", 3}),
    [](const auto& info) {
      return "W" + std::to_string(info.param.world) + "_ep" + std::to_string(info.param.ep) + "_" +
             info.param.recipe + "_dispatch_" + info.param.dispatch +
             (info.param.chunks > 1 ? "_chunks" + std::to_string(info.param.chunks) : "");
    });

INSTANTIATE_TEST_SUITE_P(
    WorldEpRouting, Equivalence,
    ::testing::Values(
        EquivalenceCase{1, 1}, EquivalenceCase{2, 1}, EquivalenceCase{2, 2}, EquivalenceCase{4, 2},
        EquivalenceCase{4, 4}, EquivalenceCase{2, 2, "skewed"}, EquivalenceCase{4, 4, "skewed"},
        EquivalenceCase{4, 2, "balanced"}, EquivalenceCase{2, 2, "concentrated"},
        EquivalenceCase{4, 4, "concentrated"}, EquivalenceCase{2, 2, "learned", "host"},
        EquivalenceCase{4, 2, "skewed", "host"}, EquivalenceCase{4, 4, "concentrated", "host"},
        EquivalenceCase{2, 2, "learned", "device", 2}, EquivalenceCase{4, 2, "skewed", "device", 3},
        EquivalenceCase{4, 4, "concentrated", "device", 3},
        EquivalenceCase{2, 2, "balanced", "host", 2}),
    [](const auto& info) {
      return "W" + std::to_string(info.param.world) + "_ep" + std::to_string(info.param.ep) + "_" +
             info.param.routing + "_" + info.param.exchange +
             (info.param.chunks > 1 ? "_chunks" + std::to_string(info.param.chunks) : "");
    });

// Holding the units from forward to backward (parallel.reshard_after_forward = false) changes
// when they are gathered and their MX copies made, not what is computed: every step's loss, the
// last step's gradients and the parameters after three steps bit for bit with the default, with
// expert parallelism, an MX recipe with MXFP8 dispatch (also on one rank, where nothing is
// sharded and the setting changes nothing), and full activation checkpointing (whose backward
// reruns the forward's products).
TEST(Fsdp, ReshardAfterBackwardChangesNoBit) {
  struct Case {
    int world, ep;
    std::vector<std::string> sets;
  };
  const std::vector<std::string> mx = {"model.dim=32", "model.moe_dim=32",
                                       "model.expert_recipe=mxfp8_wgrad_with_hp",
                                       "parallel.ep_dispatch_dtype=mxfp8"};
  std::vector<std::string> full = mx;
  full.push_back("model.checkpoint=full");
  for (const Case& k :
       {Case{2, 1, {}}, Case{4, 2, {}}, Case{4, 2, mx}, Case{2, 1, full}, Case{1, 1, mx}}) {
    std::vector<std::string> held = k.sets;
    held.push_back("parallel.reshard_after_forward=false");
    const Snapshot a = train(k.world, k.ep, 3, k.sets), b = train(k.world, k.ep, 3, held);
    const std::string what = "W" + std::to_string(k.world) + " ep" + std::to_string(k.ep) +
                             (k.sets.empty() ? "" : " " + k.sets.back());
    ASSERT_EQ(a.metrics.size(), 3u) << what;
    ASSERT_EQ(b.metrics.size(), 3u) << what;
    for (int s = 0; s < 3; ++s) EXPECT_EQ(b.metrics[s].loss, a.metrics[s].loss) << what;
    expect_same(b.grads, a.grads, 0.0, what + " gradient");
    expect_same(b.params, a.params, 0.0, what + " parameter");
    const Tensor& w_down = a.grads.at("layers.0.moe.w_down");
    double sum = 0;
    for (int64_t i = 0; i < w_down.numel(); ++i) sum += std::abs(w_down.item(i));
    EXPECT_GT(sum, 0.0) << what;
  }
}

}  // namespace
}  // namespace mt

namespace mt {
namespace {

// The contract an optimizer update beside the passes relies on (ParamUnit::await_update, the
// GPU's hardware.overlap_optimizer): a pass calls a unit's hook before it reads the unit's
// parameters (its gather, an FSDP prefetch of its shards) or writes its gradients, and the
// gradients zero_grad left are zeroed, not added to. Here each hook applies the unit's "update"
// (its master shards scaled) only when called, and the gradients are poisoned before zero_grad:
// the pass must give the loss and gradients, bit for bit, of a pass after the update applied at
// once, on one rank and on sharded in-process ranks (prefetches, expert parallelism).
TEST(Fsdp, PassesWaitForEachUnitsUpdateBeforeReadingItOrWritingItsGradients) {
  for (const auto& [world, ep] : {std::pair{1, 1}, std::pair{2, 1}, std::pair{2, 2}}) {
    SCOPED_TRACE(fmt::format("world {}, ep {}", world, ep));
    std::vector<std::string> sets = small_model(2);
    sets.push_back("parallel.world=" + std::to_string(world));
    sets.push_back("parallel.ep=" + std::to_string(ep));
    const Config c = parse_config_string("", sets);
    run_in_process(world, [&](Communicator& comm) {
      Trainer t(c, world > 1 ? &comm : nullptr);
      RunOptions one;
      one.steps = 1;
      t.run(one);  // gradients and moments of a step: what a real update follows
      Qwen3Moe& model = t.model();
      auto data = make_data_loader(c);
      const Batch b = data->next(c.train.batch_rows, c.train.seq_len);
      const LossScale scale{1.0 / static_cast<double>(b.masked_tokens()), c.model.aux_loss_coef};
      std::vector<Tensor> before;
      for (auto& u : model.units())
        for (auto& g : u.groups) before.push_back(g.shard.clone());
      const auto update = [](ParamUnit& u) {
        for (auto& g : u.groups) ops::scale_(g.shard, 1.0 + 1.0 / 64);
      };
      const auto pass = [&](bool deferred) {
        size_t k = 0;
        for (auto& u : model.units())
          for (auto& g : u.groups) {
            g.shard.copy_from(before[k++]);
            g.grad_shard.copy_from(Tensor::poisoned(g.grad_shard.shape(), g.grad_shard.dtype()));
            g.compute = Tensor();  // a cast copy of the old values would be stale
          }
        std::vector<int> calls(model.units().size(), 0);
        for (size_t i = 0; i < model.units().size(); ++i) {
          ParamUnit& u = model.units()[i];
          if (!deferred) {
            update(u);
            continue;
          }
          u.await_update = [&u, &calls, i, &update] {
            if (calls[i]++ == 0) update(u);
          };
        }
        model.zero_grad();
        const MicroBatchLosses l = model.forward_backward(b, scale);
        for (auto& u : model.units()) u.await_update = nullptr;
        for (size_t i = 0; deferred && i < calls.size(); ++i)
          EXPECT_GT(calls[i], 0) << model.units()[i].name << ": its update was never awaited";
        std::vector<Tensor> grads;
        for (auto& u : model.units())
          for (auto& g : u.groups) grads.push_back(g.grad_shard.clone());
        return std::pair{l.ce_sum, grads};
      };
      const auto [at_once_loss, at_once] = pass(false);
      const auto [deferred_loss, deferred] = pass(true);
      EXPECT_EQ(deferred_loss, at_once_loss);
      ASSERT_EQ(deferred.size(), at_once.size());
      for (size_t k = 0; k < at_once.size(); ++k) {
        ASSERT_TRUE(all_finite(at_once[k])) << "group " << k << ": the poison was added to";
        EXPECT_EQ(std::memcmp(deferred[k].raw(), at_once[k].raw(), at_once[k].nbytes()), 0)
            << "group " << k;
      }
    });
  }
}

TEST(DistCheckpoint, ShardedResumeIsBitIdenticalAndAnotherEpIsResharded) {
  const std::string dir = (std::filesystem::temp_directory_path() / "mt_dist_ckpt").string();
  std::filesystem::remove_all(dir);
  std::vector<std::string> sets = small_model(2);
  sets.push_back("parallel.world=4");
  sets.push_back("parallel.ep=2");
  sets.push_back("train.steps=4");
  sets.push_back("checkpoint.dir=\"" + dir + "\"");
  sets.push_back("checkpoint.every=2");
  const Config c = parse_config_string("", sets);
  Snapshot straight, resumed;
  std::mutex mu;
  run_in_process(4, [&](Communicator& comm) {
    Trainer t(c, &comm);
    t.run({});
    collect(t.model(), 8, straight, mu);
  });
  run_in_process(4, [&](Communicator& comm) {
    Trainer t(c, &comm);
    RunOptions o;
    o.resume = dir + "/step_00000002";
    t.run(o);
    collect(t.model(), 8, resumed, mu);
  });
  expect_same(resumed.params, straight.params, 0.0, "parameter");  // bit-identical

  // Another ep: the checkpoint is resharded, and the run goes on to the same parameters (to the
  // rounding of the other summation order, as the equivalence suite).
  sets.push_back("parallel.ep=4");
  const Config other = parse_config_string("", sets);
  Snapshot resharded;
  run_in_process(4, [&](Communicator& comm) {
    Trainer t(other, &comm);
    RunOptions o;
    o.resume = dir + "/step_00000002";
    o.existing = ExistingCheckpoints::kOverwrite;
    t.run(o);
    collect(t.model(), 8, resharded, mu);
  });
  expect_same(resharded.params, straight.params, 1e-10, "parameter after resharding");
}

// Rank files that disagree (two steps in one directory, or rank 0's file copied as rank 1's)
// stop every rank at load with the same error, before any collective of training (issue 17:
// rank 0 finished and rank 1 waited 300 s).
// Resharding: a checkpoint written at (1, 1) resumes at (4, 2), whose checkpoint resumes at
// (2, 2), whose checkpoint resumes at (1, 1): the last file holds every parameter, moment and
// router bias of the first bit for bit, with its step, data position and run.
TEST(DistCheckpoint, ReshardingOverWorldsAndEpKeepsEveryTensor) {
  namespace fs = std::filesystem;
  const std::string root = testing::unique_temp_path("reshard");
  auto config = [&](int world, int ep, const std::string& dir) {
    std::vector<std::string> sets = small_model(8 / world);
    sets.push_back("train.steps=2");
    sets.push_back("checkpoint.every=2");
    sets.push_back("checkpoint.dir=\"" + dir + "\"");
    sets.push_back("parallel.world=" + std::to_string(world));
    sets.push_back("parallel.ep=" + std::to_string(ep));
    return parse_config_string("", sets);
  };
  const std::string first = root + "/w1";
  Trainer(config(1, 1, first)).run({});
  std::string from = first;
  for (const auto& [world, ep] : {std::pair{4, 2}, std::pair{2, 2}}) {
    const std::string to = root + "/w" + std::to_string(world) + "ep" + std::to_string(ep);
    run_in_process(world, [&](Communicator& comm) {
      Trainer t(config(world, ep, to), &comm);
      t.resume(from);
      EXPECT_EQ(t.step(), 2);
      t.save(to);
    });
    from = to;
  }
  const std::string last = root + "/back";
  Trainer t(config(1, 1, last));
  t.resume(from);
  const std::string written = t.save(last);
  const SafetensorsFile a = read_safetensors(first + "/step_00000002.safetensors");
  const SafetensorsFile b = read_safetensors(written);
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (const auto& [name, ta] : a.tensors) {
    ASSERT_TRUE(b.tensors.count(name)) << name;
    const Tensor& tb = b.tensors.at(name);
    ASSERT_EQ(ta.nbytes(), tb.nbytes()) << name;
    EXPECT_EQ(std::memcmp(ta.raw(), tb.raw(), ta.nbytes()), 0) << name;
  }
  for (const char* key : {"step", "data_position", "run_id"})
    EXPECT_EQ(a.metadata.at(key), b.metadata.at(key)) << key;
  fs::remove_all(root);
}

TEST(DistCheckpoint, RankFilesThatDisagreeStopEveryRank) {
  namespace fs = std::filesystem;
  const std::string dir = (fs::temp_directory_path() / "mt_dist_mixed").string();
  fs::remove_all(dir);
  std::vector<std::string> sets = small_model(2);
  sets.push_back("parallel.world=2");
  sets.push_back("train.steps=4");
  sets.push_back("checkpoint.dir=\"" + dir + "\"");
  sets.push_back("checkpoint.every=2");
  const Config c = parse_config_string("", sets);
  run_in_process(2, [&](Communicator& comm) { Trainer(c, &comm).run({}); });
  const fs::path two = fs::path(dir) / "step_00000002", four = fs::path(dir) / "step_00000004";
  auto resume_fails_on_every_rank = [&](const std::string& names) {
    std::atomic<int> refused{0};
    try {
      run_in_process(2, [&](Communicator& comm) {
        Trainer t(c, &comm);
        RunOptions o;
        o.resume = two.string();
        try {
          t.run(o);
        } catch (const CheckpointError& e) {
          EXPECT_NE(std::string(e.what()).find(names), std::string::npos) << e.what();
          ++refused;
          throw;
        }
      });
    } catch (const CheckpointError&) {
    }
    EXPECT_EQ(refused.load(), 2) << names;
  };
  fs::copy_file(four / "rank_1.safetensors", two / "rank_1.safetensors",
                fs::copy_options::overwrite_existing);
  resume_fails_on_every_rank("different steps: rank 0's is step 2, rank 1's step 4");
  fs::copy_file(two / "rank_0.safetensors", two / "rank_1.safetensors",
                fs::copy_options::overwrite_existing);
  resume_fails_on_every_rank("rank 1 read a file written by rank 0");
  // The same step and rank from another run (same config, its own run id).
  const std::string other_dir = dir + "_other";
  fs::remove_all(other_dir);
  std::vector<std::string> other_sets = sets;
  other_sets.push_back("checkpoint.dir=\"" + other_dir + "\"");
  const Config other = parse_config_string("", other_sets);
  run_in_process(2, [&](Communicator& comm) { Trainer(other, &comm).run({}); });
  fs::copy_file(fs::path(other_dir) / "step_00000002" / "rank_1.safetensors",
                two / "rank_1.safetensors", fs::copy_options::overwrite_existing);
  resume_fails_on_every_rank("the ranks' files are from different runs");
  fs::remove_all(other_dir);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace mt

// --- one process per rank: the launcher and the socket backend ----------------------------
namespace mt {
namespace {

using testing::Proc;
using testing::run_cmd;

std::vector<double> losses(const std::string& metrics) {
  return testing::metric(metrics, "loss");
}

const std::string kLaunchArgs = std::string(" train --config ") + MOETRAIN_SOURCE_DIR +
                                "/configs/tiny.toml --set parallel.ep=2 --set train.batch_rows=2"
                                " --set train.seq_len=64 --steps 4";

TEST(Launch, ProcessesGiveTheSameLossesAsInProcessRanks) {
  const auto tmp = std::filesystem::temp_directory_path();
  const std::string a = (tmp / "mt_launch_a.jsonl").string(),
                    b = (tmp / "mt_launch_b.jsonl").string();
  std::filesystem::remove(a);
  std::filesystem::remove(b);
  const Proc launched =
      run_cmd(std::string(MOETRAIN_BINARY) + " launch -n 2 --" + kLaunchArgs + " --metrics " + a);
  ASSERT_EQ(launched.code, 0) << launched.output;
  const Proc threads = run_cmd(std::string(MOETRAIN_BINARY) + kLaunchArgs +
                               " --set parallel.world=2 --metrics " + b);
  ASSERT_EQ(threads.code, 0) << threads.output;
  const auto la = losses(a), lb = losses(b);
  ASSERT_EQ(la.size(), 4u);
  EXPECT_EQ(la, lb);  // the hub sums in rank order, as the in-process backend
}

TEST(Launch, ADeadRankStopsTheJobWithItsName) {
  const Proc p = run_cmd("MOETRAIN_FAULT_EXIT=1:2 MOETRAIN_TIMEOUT_S=60 timeout 120 " +
                         std::string(MOETRAIN_BINARY) + " launch -n 2 --" + kLaunchArgs);
  // Non-zero and not the timeout's 124: nobody hung. The first rank reaped sets the code (the
  // dead rank's 17, or rank 0's 1 after it saw rank 1 disconnect).
  EXPECT_TRUE(p.code == 17 || p.code == 1) << p.code << "\n" << p.output;
  EXPECT_NE(p.output.find("rank 1 exited with code 17"), std::string::npos) << p.output;
}

// The launched ranks of a launcher, from /proc (its children), and whether a process is gone
// (no such pid, or a zombie nobody reaps in a container).
// Issue 17: killing `moetrain launch` left its ranks training. SIGTERM is forwarded (the ranks
// stop at their next step boundary and the launcher exits with their code, 7); after SIGKILL,
// which it cannot forward, the ranks stop with it (parent-death signal: SIGTERM).
TEST(Launch, RanksDieWithTheirLauncher) {
  const std::string long_run = std::string(" train --config ") + MOETRAIN_SOURCE_DIR +
                               "/configs/tiny.toml --set parallel.ep=2 --set train.steps=100000";
  for (int sig : {SIGTERM, SIGKILL}) {
    const pid_t launcher = ::fork();
    ASSERT_GE(launcher, 0);
    if (launcher == 0) {
      const std::string cmd = std::string("exec ") + MOETRAIN_BINARY + " launch -n 2 --" +
                              long_run + " >/dev/null 2>&1";
      ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
      std::_Exit(127);
    }
    std::vector<pid_t> ranks;
    for (int i = 0; i < 100 && ranks.size() < 2; ++i) {  // up to 10 s for both ranks to start
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      ranks = testing::children_of(launcher);
    }
    ASSERT_EQ(ranks.size(), 2u) << "signal " << sig;
    std::this_thread::sleep_for(std::chrono::seconds(1));  // training, past the rendezvous
    ::kill(launcher, sig);
    int status = 0;
    ::waitpid(launcher, &status, 0);
    if (sig == SIGTERM) {
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 7) << status;
    }
    bool all_gone = false;
    for (int i = 0; i < 100 && !all_gone; ++i) {  // up to 10 s
      all_gone = std::all_of(ranks.begin(), ranks.end(), testing::gone);
      if (!all_gone) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    EXPECT_TRUE(all_gone) << "signal " << sig << ": ranks outlived their launcher";
    for (pid_t p : ranks) ::kill(p, SIGKILL);  // never leave one behind
  }
}

// One step of the tiny preset as rank `rank` of `world` started by hand (torchrun's environment)
// with its master at 127.0.0.1:port and a rendezvous deadline of `timeout_s`; the shell's
// timeout of 60 s turns a hang into exit 124.
std::string rank_of_tiny_run(int world, int rank, int port, int timeout_s) {
  return fmt::format(
      "WORLD_SIZE={} RANK={} MASTER_ADDR=127.0.0.1 MASTER_PORT={} MOETRAIN_TIMEOUT_S={} timeout 60 "
      "{} train --config {}/configs/tiny.toml --steps 1",
      world, rank, port, timeout_s, MOETRAIN_BINARY, MOETRAIN_SOURCE_DIR);
}

// A WORLD_SIZE larger than the ranks started: rank 0 names the ranks that never arrived when
// its rendezvous times out (issue 17: it waited and named none).
TEST(SocketBackend, RendezvousNamesTheRanksThatNeverArrived) {
  const int port = testing::free_port();
  const auto start = std::chrono::steady_clock::now();
  const Proc p = run_cmd(rank_of_tiny_run(3, 0, port, 2));
  EXPECT_NE(p.code, 0);
  EXPECT_NE(p.code, 124) << "hung";
  EXPECT_NE(p.output.find("only 1 of 3 ranks connected within 2 s; rank(s) 1, 2 never did"),
            std::string::npos)
      << p.output;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
}

// A master whose SYNs are dropped: a listening socket on this host whose accept queue is full
// (Linux then drops new SYNs, as a firewall would). The rank gives up at MOETRAIN_TIMEOUT_S,
// naming the address, instead of waiting out the kernel's own connect retries (134 s with a 10 s
// timeout, issue 17).
TEST(SocketBackend, AMasterThatDropsSynsFailsAtTheDeadline) {
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(listener, 0), 0);
  ASSERT_EQ(::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  std::vector<int> fillers;  // never accepted: they fill the queue
  for (int i = 0; i < 4; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    (void)::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    fillers.push_back(fd);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const int port = ntohs(addr.sin_port);
  const auto start = std::chrono::steady_clock::now();
  const Proc p = run_cmd(rank_of_tiny_run(2, 1, port, 3));
  EXPECT_NE(p.code, 0);
  EXPECT_NE(p.code, 124) << "hung";
  EXPECT_NE(p.output.find("rank 1: cannot reach rank 0 at 127.0.0.1:" + std::to_string(port) +
                          " within 3 s"),
            std::string::npos)
      << p.output;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(15));
  for (int fd : fillers) ::close(fd);
  ::close(listener);
}

TEST(SocketBackend, TheSurvivorsNameTheDeadRank) {
  // Two ranks started by hand (as torchrun would), no launcher to stop the survivor: rank 0
  // must fail on its own, naming rank 1, long before the collective timeout.
  const std::string env = "WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MOETRAIN_TIMEOUT_S=60 MASTER_PORT=" +
                          std::to_string(testing::free_port());
  const std::string out0 = testing::unique_temp_path("rank0.txt");
  const Proc p =
      run_cmd("((" + env + " RANK=0 timeout 120 " + MOETRAIN_BINARY + kLaunchArgs + " >" + out0 +
              " 2>&1; echo rank0=$? >>" + out0 + ") & " + env + " RANK=1 MOETRAIN_FAULT_EXIT=1:2 " +
              MOETRAIN_BINARY + kLaunchArgs + "; echo rank1=$?; wait)");
  EXPECT_NE(p.output.find("rank1=17"), std::string::npos) << p.output;
  const std::string rank0 = testing::read_file(out0);
  EXPECT_NE(rank0.find("rank 1 disconnected"), std::string::npos) << rank0;
  EXPECT_NE(rank0.find("rank0=1"), std::string::npos) << rank0;  // failed, did not time out
}

// The scaling script (issue 5's table, meant for eight GPUs) end to end on two CPU ranks with
// the tiny preset: one JSON line per (ep, routing) of W = 2, each with its throughput, and the
// exchange time exactly where experts are split over ranks.
TEST(Launch, ScalingScriptReportsEveryEpAndRouting) {
  const std::string out = testing::unique_temp_path("scaling");
  const Proc p =
      run_cmd("OUT=" + out +
              " BENCH_CONFIG=configs/tiny.toml BENCH_SET='train.steps=4 train.seq_len=64 "
              "train.batch_rows=2 hardware.device=cpu' " +
              MOETRAIN_SOURCE_DIR + "/scripts/bench-scaling.sh " + MOETRAIN_BINARY + " 2 2");
  ASSERT_EQ(p.code, 0) << p.output;
  std::istringstream lines(p.output);
  std::string line;
  std::map<std::string, nlohmann::json> cases;  // by overrides
  while (std::getline(lines, line)) {
    if (line.empty() || line[0] != '{') continue;
    const nlohmann::json j = nlohmann::json::parse(line);
    ASSERT_FALSE(j.contains("error")) << line;
    cases[j.at("overrides").get<std::string>()] = j;
  }
  ASSERT_EQ(cases.size(), 6u) << p.output;  // ep 2 and 1, three routings each
  for (const auto& [overrides, j] : cases) {
    EXPECT_EQ(j.at("gpus").get<int>(), 2) << overrides;
    EXPECT_EQ(j.at("preset").get<std::string>(), "tiny") << overrides;
    EXPECT_GT(j.at("tokens_per_s_per_gpu").get<double>(), 0.0) << overrides;
    const bool split = overrides.find("parallel.ep=2") != std::string::npos;
    EXPECT_EQ(j.contains("exchange_ms"), split) << overrides;
    EXPECT_EQ(j.contains("exchange_exposed_ms"), split) << overrides;
    if (split) {
      EXPECT_GT(j.at("exchange_ms").get<double>(), 0.0) << overrides;
    }
  }
  std::filesystem::remove_all(out);
}

TEST(Launch, BadTorchrunEnvironmentIsAConfigError) {
  const Proc p =
      run_cmd("WORLD_SIZE=2 RANK=5 MASTER_PORT=1 " + std::string(MOETRAIN_BINARY) + kLaunchArgs);
  EXPECT_EQ(p.code, 2) << p.output;
  EXPECT_NE(p.output.find("RANK=5 must be below WORLD_SIZE=2"), std::string::npos) << p.output;
  const Proc q = run_cmd("WORLD_SIZE=two RANK=0 " + std::string(MOETRAIN_BINARY) + kLaunchArgs);
  EXPECT_EQ(q.code, 2) << q.output;
  EXPECT_NE(q.output.find("WORLD_SIZE='two'"), std::string::npos) << q.output;
}

}  // namespace
}  // namespace mt
