// FSDP on in-process ranks: mixed-precision gathers, fp32 master weights, the unit schedule
// (reshard_after_forward), and the optimizer hooks a pass waits for.
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
#include "dist_training.h"
#include "fsdp/fsdp.h"
#include "moe/exchange/expert_exchange.h"
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
        specs[0].quant_copies = u >= 2;
        ParamGroup g = make_param_group(ParamKind::kDense, specs, DType::kF32);
        g.precision.recipe = ops::ExpertRecipe::kMxfp8WgradWithHp;  // units 2, 3: MX copies
        allocate_group(g);
        init_params(g, 5 + u, 0.3);
        place_group(g, Device::kCPU, DType::kBF16);
        if (u < 3) fsdp::shard_group(g, counted);
        units[u].name = "unit" + std::to_string(u);
        units[u].groups.push_back(std::move(g));
      }
      auto weights_held = [&](size_t u) {
        const ParamGroup& g = units[u].groups[0];
        return g.sharded() ? g.compute.defined() || g.params.defined() || !g.copies.empty()
                           : !g.copies.empty();
      };
      fsdp::UnitSchedule s(units, 1.0, {false, true, true, true}, ops::CopyUse::kBackward, reshard);
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
          EXPECT_TRUE(mx.copies[0].along_k.defined() && mx.copies[0].along_n.defined());
          EXPECT_FALSE(mx.compute.defined() || mx.params.defined());
        }
      }
      for (size_t u = units.size(); u-- > 0;) {
        s.backward_begin(u);
        {
          std::lock_guard<std::mutex> lock(mu);
          EXPECT_EQ(weights_held(u), u > 0) << "unit " << u;
          if (u >= 2 && c.rank() == 0)
            backward_copy[{reshard, u}] = units[u].groups[0].copies[0].along_n.clone();
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

}  // namespace
}  // namespace mt
