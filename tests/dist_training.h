// The multi-rank tests' training helpers (tests/test_equivalence.cpp, test_fsdp.cpp,
// test_dist_checkpoint.cpp): the small model, a run on in-process ranks, and what it left (the
// loss, every gradient and parameter, gathered from the ranks by name).
#pragma once
#include <gtest/gtest.h>

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "dist/communicator.h"
#include "model/qwen3_moe.h"
#include "testing.h"
#include "train/trainer.h"

namespace mt {
namespace {

using dist::Communicator;
using dist::run_in_process;

inline std::vector<std::string> small_model(int64_t rows_per_rank) {
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
inline void collect(Qwen3Moe& model, int64_t n_experts, Snapshot& out, std::mutex& mu) {
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
inline void concentrate_routing(Trainer& t) {
  for (Tensor& b : t.model().router_biases()) {
    b.zero_();
    b.set_item(0, 10.0);
    b.set_item(1, 10.0);
  }
}

inline Snapshot train(int world, int ep, int64_t steps, const std::vector<std::string>& extra = {},
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
  // Every world covers the same 4-rank global batch: fewer data-parallel ranks (world / cp, with
  // "parallel.cp=N" among `extra`) take more rows each.
  int cp = 1;
  for (const std::string& e : extra)
    if (e.rfind("parallel.cp=", 0) == 0) cp = std::stoi(e.substr(12));
  sets.push_back("train.batch_rows=" + std::to_string(rows * 4 * cp / world));
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

inline void expect_same(const std::map<std::string, Tensor>& a,
                        const std::map<std::string, Tensor>& b, double tol,
                        const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : b) {
    ASSERT_TRUE(a.count(name)) << name;
    EXPECT_LE(relative_error(a.at(name), t), tol) << what << " " << name;
  }
}

}  // namespace
}  // namespace mt
