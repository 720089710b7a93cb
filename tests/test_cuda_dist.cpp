// The NCCL communicator on the GPUs of this machine: ranks as threads of this process, one GPU
// each (LOCAL_RANK = rank), the NCCL id passed over the in-process communicator. Every
// collective against values computed here, on device tensors and on host tensors (staged).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>

#include "core/cuda/check.h"
#include "core/cuda/device.h"
#include "core/cuda/graph.h"
#include "core/quant.h"
#include "core/rng.h"
#include "dist/nccl_backend.h"
#include "moe/exchange/lsa.h"
#include "moe/exchange/row_scatter.h"
#include "moe/moe_layer.h"
#include "ops/elementwise.h"
#include "ops/fp8.h"
#include "ops/mx.h"
#include "ops/permute.h"
#include "processes.h"
#include "testing.h"

namespace mt {
namespace {

// Runs fn on `world` ranks, each with its NCCL communicator.
void with_nccl(int world, const std::function<void(dist::Communicator&)>& fn) {
  dist::run_in_process(
      world,
      [&](dist::Communicator& boot) {
        dist::Rendezvous r;
        r.rank = boot.rank();
        r.world = world;
        r.local_rank = boot.rank();
        r.timeout_s = 120;
        const auto nccl = dist::connect_nccl_world(r, boot);
        fn(*nccl);
      },
      180.0);
}

Tensor filled(int64_t n, DType t, const std::function<double(int64_t)>& value) {
  Tensor h = Tensor::empty({n}, DType::kF64);
  for (int64_t i = 0; i < n; ++i) h.set_item(i, value(i));
  return h.to(t).to(Device::kCUDA);
}

void check_collectives(dist::Communicator& c) {
  const int r = c.rank(), w = c.size();
  const int64_t n = 1000;
  // all_gather, f32 and bf16 (integers small enough to be exact in bf16).
  for (DType t : {DType::kF32, DType::kBF16}) {
    const Tensor send = filled(n, t, [&](int64_t i) { return 10 * r + i % 7; });
    Tensor recv = Tensor::poisoned({n * w}, t, Device::kCUDA);
    c.all_gather(send, recv);
    const Tensor got = recv.to(Device::kCPU).to(DType::kF64);
    for (int p = 0; p < w; ++p)
      for (int64_t i = 0; i < n; i += 97)
        ASSERT_EQ(got.item(p * n + i), 10 * p + i % 7) << dtype_name(t) << " from " << p;
  }
  // The background all-gather (FSDP's prefetch): it sends what the compute stream wrote just
  // before (a device copy still queued), and what runs after wait() reads the result.
  {
    const int64_t big = int64_t{1} << 22;
    const Tensor source = filled(big, DType::kBF16, [&](int64_t i) { return r + i % 5; });
    Tensor send = Tensor::zeros({big}, DType::kBF16, Device::kCUDA);
    send.copy_from(source);  // queued on the compute stream, not waited for
    Tensor recv = Tensor::poisoned({big * w}, DType::kBF16, Device::kCUDA);
    auto pending = c.all_gather_async(send, recv);
    pending->wait();
    const Tensor got = recv.to(Device::kCPU).to(DType::kF64);
    for (int p = 0; p < w; ++p)
      for (int64_t i = 0; i < big; i += 4099)
        ASSERT_EQ(got.item(p * big + i), p + i % 5) << "background all_gather from " << p;
  }
  // reduce_scatter: rank r keeps chunk r of the sum.
  const Tensor send = filled(n * w, DType::kF32, [&](int64_t i) { return r + 0.5 * i; });
  Tensor mine = Tensor::poisoned({n}, DType::kF32, Device::kCUDA);
  c.reduce_scatter(send, mine);
  const Tensor got = mine.to(Device::kCPU);
  const double rank_sum = w * (w - 1) / 2.0;
  for (int64_t i = 0; i < n; i += 31)
    ASSERT_DOUBLE_EQ(got.item(i), rank_sum + w * 0.5 * (r * n + i));
  // The background reduce-scatter (FSDP's gradient reduction): its input is written by a queued
  // copy and dropped by the caller right after the start (the handle keeps it alive); the
  // result is read after wait().
  {
    const int64_t big = int64_t{1} << 22;
    const Tensor source = filled(big * w, DType::kF32, [&](int64_t i) { return r + i % 9; });
    Tensor send = Tensor::zeros({big * w}, DType::kF32, Device::kCUDA);
    send.copy_from(source);
    Tensor chunk = Tensor::poisoned({big}, DType::kF32, Device::kCUDA);
    auto pending = c.reduce_scatter_async(send, chunk);
    send = Tensor();
    pending->wait();
    pending.reset();
    const Tensor sum = chunk.to(Device::kCPU);
    for (int64_t i = 0; i < big; i += 4099)
      ASSERT_DOUBLE_EQ(sum.item(i), rank_sum + w * static_cast<double>((r * big + i) % 9))
          << "background reduce_scatter at " << i;
  }
  // all_reduce on a host tensor (the trainer's counts) and on a device one.
  Tensor count = Tensor::empty({1}, DType::kI64);
  count.set_item(0, r + 1);
  c.all_reduce(count);
  EXPECT_EQ(count.item(0), w * (w + 1) / 2);
  Tensor dev = filled(3, DType::kF64, [&](int64_t i) { return i * (r + 1); });
  c.all_reduce(dev);
  EXPECT_EQ(dev.to(Device::kCPU).item(2), 2.0 * w * (w + 1) / 2);
  // all_to_all: rank r sends r + p + 1 rows of width 3, valued 100 r + p, to peer p.
  std::vector<int64_t> send_rows(w), recv_rows(w);
  int64_t total_send = 0, total_recv = 0;
  for (int p = 0; p < w; ++p) {
    total_send += send_rows[p] = r + p + 1;
    total_recv += recv_rows[p] = p + r + 1;
  }
  Tensor rows = Tensor::empty({total_send, 3}, DType::kF32);
  for (int p = 0, at = 0; p < w; ++p)
    for (int64_t k = 0; k < send_rows[p] * 3; ++k) rows.set_item(at++, 100 * r + p);
  Tensor out = Tensor::poisoned({total_recv, 3}, DType::kBF16, Device::kCUDA);
  c.all_to_all(rows.to(DType::kBF16).to(Device::kCUDA), send_rows, out, recv_rows);
  const Tensor arrived = out.to(Device::kCPU).to(DType::kF64);
  for (int p = 0, at = 0; p < w; ++p)
    for (int64_t k = 0; k < recv_rows[p] * 3; ++k)
      ASSERT_EQ(arrived.item(at++), 100 * p + r) << "row from " << p;
  // split: even and odd ranks.
  const auto half = c.split(r % 2, r);
  EXPECT_EQ(half->size(), (w + 1 - r % 2) / 2);
  EXPECT_EQ(half->rank(), r / 2);
  Tensor one = Tensor::empty({1}, DType::kF32);
  one.set_item(0, 1.0);
  half->all_reduce(one);
  EXPECT_EQ(one.item(0), half->size());
  c.barrier();
}

TEST(Nccl, CollectivesOnOneGpu) {
  if (cuda::device_count() == 0) GTEST_FAIL() << "no GPU: run this test on the GPU machine";
  with_nccl(1, check_collectives);
}

TEST(Nccl, CollectivesAcrossTwoGpus) {
  if (cuda::device_count() < 2) GTEST_SKIP() << "needs two GPUs (the nvidia-h200-x2 machine)";
  with_nccl(2, check_collectives);
}

// The tiny preset on the GPU, as the moetrain binary's `train` arguments.
std::string tiny_on_gpu() {
  return " train --config " + testing::source_dir() +
         "/configs/tiny.toml --set hardware.device=cuda";
}

// Runs `bin + common` once per case (name, its flags) with --metrics; every run must exit 0.
struct CaseRuns {
  std::map<std::string, std::string> metrics, logs;  // by case name
};
void run_cases(const std::string& common,
               const std::vector<std::pair<std::string, std::string>>& cases, CaseRuns& out) {
  for (const auto& [name, set] : cases) {
    out.metrics[name] = testing::unique_temp_path(name + ".jsonl");
    const testing::Proc run = testing::run_cmd(testing::moetrain_binary() + common + set +
                                               " --metrics " + out.metrics[name]);
    ASSERT_EQ(run.code, 0) << name << "\n" << run.output;
    out.logs[name] = run.output;
  }
}

// Each of `others`' losses, aux losses and gradient norms over `steps` steps equals the
// reference case's, to the bit.
void expect_same_steps(const CaseRuns& r, const std::string& reference,
                       const std::vector<std::string>& others, size_t steps) {
  for (const char* key : {"loss", "aux_loss", "grad_norm"}) {
    const auto want = testing::metric(r.metrics.at(reference), key);
    ASSERT_EQ(want.size(), steps) << reference;
    for (const std::string& other : others) {
      const auto got = testing::metric(r.metrics.at(other), key);
      ASSERT_EQ(got.size(), steps) << other;
      for (size_t s = 0; s < steps; ++s)
        EXPECT_EQ(got[s], want[s]) << other << " " << key << " step " << s + 1;
    }
  }
}

// Issue 3's proof on two GPUs: three steps of the tiny model with world 2 (ep 1 and 2) over
// NCCL against one GPU holding the whole global batch, in bf16: the same losses and gradient
// norms within bf16 tolerance (forced-balanced routing: bf16 near-ties cannot flip a choice).
TEST(Nccl, TwoGpuTrainingMatchesOneGpu) {
  if (cuda::device_count() < 2) GTEST_SKIP() << "needs two GPUs (the nvidia-h200-x2 machine)";
  const std::string bin = testing::moetrain_binary();
  const std::string common = tiny_on_gpu() +
                             " --set model.routing=balanced"
                             " --set train.warmup_steps=1 --steps 3";
  const std::string one = testing::unique_temp_path("one_gpu.jsonl");
  const testing::Proc single =
      testing::run_cmd(bin + common + " --set train.batch_rows=16 --metrics " + one);
  ASSERT_EQ(single.code, 0) << single.output;
  for (const int ep : {1, 2}) {
    const std::string two =
        testing::unique_temp_path("two_gpus_ep" + std::to_string(ep) + ".jsonl");
    const testing::Proc pair =
        testing::run_cmd(bin + " launch -n 2 --" + common + " --set train.batch_rows=8" +
                         " --set parallel.ep=" + std::to_string(ep) + " --metrics " + two);
    ASSERT_EQ(pair.code, 0) << pair.output;
    for (const char* key : {"loss", "grad_norm"}) {
      const auto a = testing::metric(one, key), b = testing::metric(two, key);
      ASSERT_EQ(a.size(), 3u);
      ASSERT_EQ(b.size(), 3u) << pair.output;
      for (size_t s = 0; s < a.size(); ++s)
        EXPECT_NEAR(b[s], a[s], 2e-2 * std::abs(a[s])) << key << " step " << s + 1 << " ep " << ep;
    }
  }
}

// Graphs on several GPUs: with ep 1 every pass (FSDP gathers and reductions included) is
// captured and replayed over NCCL; the same run eagerly gives the same losses and gradient norms
// to the bit (same kernels, same collectives, same order). A host sync inside the capture, with
// collectives in flight, stops the run with an error that names it.
// Context parallelism on two GPUs (issue 36): cp = 2, each GPU half of every row, against one
// GPU holding the rows whole, with ep = 1 and 2, graphed and eager: the same losses and gradient
// norms within the bf16 tolerance above.
TEST(Nccl, TwoGpuContextParallelMatchesOneGpu) {
  if (cuda::device_count() < 2) GTEST_SKIP() << "needs two GPUs (the nvidia-h200-x2 machine)";
  const std::string bin = testing::moetrain_binary();
  const std::string common = tiny_on_gpu() +
                             " --set model.routing=balanced"
                             " --set train.warmup_steps=1 --set train.batch_rows=8 --steps 3";
  const std::string one = testing::unique_temp_path("one_gpu_cp.jsonl");
  const testing::Proc single = testing::run_cmd(bin + common + " --metrics " + one);
  ASSERT_EQ(single.code, 0) << single.output;
  for (const int ep : {1, 2})
    for (const char* graphs : {"true", "false"}) {
      const std::string name = fmt::format("two_gpus_cp2_ep{}_graphs_{}", ep, graphs);
      const std::string two = testing::unique_temp_path(name + ".jsonl");
      const testing::Proc pair =
          testing::run_cmd(bin + " launch -n 2 --" + common +
                           " --set parallel.cp=2 --set parallel.ep=" + std::to_string(ep) +
                           " --set hardware.cuda_graphs=" + graphs + " --metrics " + two);
      ASSERT_EQ(pair.code, 0) << name << "\n" << pair.output;
      for (const char* key : {"loss", "grad_norm"}) {
        const auto a = testing::metric(one, key), b = testing::metric(two, key);
        ASSERT_EQ(a.size(), 3u);
        ASSERT_EQ(b.size(), 3u) << pair.output;
        for (size_t s = 0; s < a.size(); ++s)
          EXPECT_NEAR(b[s], a[s], 2e-2 * std::abs(a[s])) << key << " step " << s + 1 << " " << name;
      }
    }
}

TEST(Nccl, TwoGpuGraphedPassesMatchEager) {
  if (cuda::device_count() < 2) GTEST_SKIP() << "needs two GPUs (the nvidia-h200-x2 machine)";
  const std::string bin = testing::moetrain_binary();
  const std::string common =
      " launch -n 2 --" + tiny_on_gpu() + " --set parallel.ep=1 --set train.batch_rows=8 --steps 6";
  CaseRuns r;
  ASSERT_NO_FATAL_FAILURE(run_cases(common,
                                    {{"graphed", " --set hardware.cuda_graphs=true"},
                                     {"eager", " --set hardware.cuda_graphs=false"}},
                                    r));
  EXPECT_NE(r.logs["graphed"].find("captured the training pass"), std::string::npos)
      << r.logs["graphed"];
  // A host wait after the first layer's collectives were recorded: exit 1, named.
  const testing::Proc synced = testing::run_cmd("MOETRAIN_FAULT_HOST_WAIT=1 " + bin + common +
                                                " --set hardware.cuda_graphs=true");
  EXPECT_EQ(synced.code, 1) << synced.output;
  EXPECT_NE(synced.output.find("host sync inside a CUDA graph capture"), std::string::npos)
      << synced.output;
  EXPECT_NE(synced.output.find("in phase 'test.injected_host_wait'"), std::string::npos)
      << synced.output;
  expect_same_steps(r, "eager", {"graphed"}, 6);
}

// A scatter's parts for the device-path tests: rows of every codec the kernels have (16-, 4- and
// 1-byte copies, MXFP8 from bf16 with a partial last warp step, MXFP8 from f32), valued by their
// source rank, their magnitudes spread over many scales (a zero block, subnormal ones).
struct ScatterCase {
  Tensor slot, choices, weights, narrow, rows, rows_f32, counts;
  static constexpr int64_t kWidth = 544, kWidthF32 = 96;
  ScatterCase(int rank, int ranks, int64_t n, std::vector<int32_t>* sent) {
    slot = Tensor::empty({n, ranks}, DType::kI32);
    sent->assign(ranks, 0);
    const CounterRng rng{17, static_cast<uint64_t>(rank)};
    for (int64_t t = 0; t < n; ++t)
      for (int p = 0; p < ranks; ++p)
        slot.data<int32_t>()[t * ranks + p] = rng.below(t * ranks + p, 10) < 7 ? (*sent)[p]++ : -1;
    auto spread = [&](int64_t width, uint64_t seed, DType dt) {
      Tensor x = Tensor::empty({n, width}, DType::kF32);
      const CounterRng g{seed, static_cast<uint64_t>(rank)};
      for (int64_t i = 0; i < n * width; ++i) {
        const int64_t t = i / width, block = i % width / 32;
        const int shift = static_cast<int>((t * 7 + block * 13) % 40) - (t % 5 == 2 ? 140 : 20);
        x.data<float>()[i] =
            t % 5 == 1 && block == 0 ? 0.0f : std::ldexp(static_cast<float>(g.normal(i)), shift);
      }
      return x.to(dt);
    };
    choices = Tensor::empty({n, 8}, DType::kI32);
    for (int64_t i = 0; i < n * 8; ++i)
      choices.data<int32_t>()[i] = static_cast<int32_t>(1000 * rank + i);
    weights = spread(3, 5, DType::kF32);
    narrow = spread(3, 6, DType::kBF16);
    rows = spread(kWidth, 7, DType::kBF16);
    rows_f32 = spread(kWidthF32, 8, DType::kF32);
    counts = Tensor::empty({ranks, 2}, DType::kI64);
    for (int p = 0; p < ranks; ++p) {
      counts.data<int64_t>()[2 * p] = (*sent)[p];
      counts.data<int64_t>()[2 * p + 1] = 100 * rank + p;
    }
  }
  std::vector<const Tensor*> parts() const { return {&choices, &weights, &narrow, &rows}; }
};

// What rank `to` must hold in recv[i] (part i of ScatterCase's parts, then rows_f32) at the
// places rank `from` wrote: the rows as they are, the MXFP8 parts as their MX values (the CPU
// reference's round trip), bit for bit; and from's per-peer row.
void expect_scattered(const ScatterCase& from_case, int from, int to, int ranks, int64_t n,
                      const std::vector<Tensor>& recv, const Tensor& counts_in, MxScaleRule rule,
                      const char* what) {
  std::vector<Tensor> want = {from_case.choices, from_case.weights, from_case.narrow,
                              Tensor::empty(from_case.rows.shape(), DType::kBF16),
                              Tensor::empty(from_case.rows_f32.shape(), DType::kF32)};
  ops::mx_round_trip(from_case.rows, QuantAxis::kDim0, rule, want[3]);
  ops::mx_round_trip(from_case.rows_f32, QuantAxis::kDim0, rule, want[4]);
  for (size_t i = 0; i < want.size(); ++i) {
    const Tensor got = recv[i].to(Device::kCPU);
    const size_t row_bytes = want[i].nbytes() / n;
    for (int64_t t = 0; t < n; ++t) {
      const int32_t s = from_case.slot.data<int32_t>()[t * ranks + to];
      if (s < 0) continue;
      const auto* g = static_cast<const char*>(got.raw()) + (from * n + s) * row_bytes;
      const auto* w = static_cast<const char*>(want[i].raw()) + t * row_bytes;
      ASSERT_EQ(std::memcmp(g, w, row_bytes), 0)
          << what << ": part " << i << ", row " << t << " from " << from << " to " << to;
    }
  }
  const Tensor c = counts_in.to(Device::kCPU);
  EXPECT_EQ(c.item(2 * from), from_case.counts.item(2 * to)) << what;
  EXPECT_EQ(c.item(2 * from + 1), 100 * from + to) << what;
}

// The device path's two kernels over 1 to 4 ranks emulated on one GPU (every peer's window on
// this GPU, the barriers replaced by the order of the launches), every codec in one scatter,
// against the definition computed on the host; outputs poisoned first. What this cannot test,
// the barriers and the LSA pointers, the next test and the two-GPU tests do.
TEST(LsaScatter, EmulatedRanksPlaceEveryPartOfEveryCodec) {
  if (cuda::device_count() == 0) GTEST_FAIL() << "no GPU: run this test on the GPU machine";
  const int64_t n = 301;
  for (const MxScaleRule rule : {MxScaleRule::kRceil, MxScaleRule::kFloor})
    for (int ranks = 1; ranks <= 4; ++ranks) {
      const std::string what =
          std::to_string(ranks) + " ranks, " + std::string(mx_scale_rule_name(rule));
      std::vector<ScatterCase> cases;
      std::vector<std::vector<int32_t>> sent(ranks);
      for (int r = 0; r < ranks; ++r) cases.emplace_back(r, ranks, n, &sent[r]);
      struct OnDevice {
        std::vector<Tensor> send, recv;
        Tensor slot, counts, counts_in, window;
        moe::LsaPlan plan;
      };
      std::vector<OnDevice> dev(ranks);
      std::vector<void*> windows(ranks);
      for (int r = 0; r < ranks; ++r) {
        OnDevice& d = dev[r];
        for (const Tensor* t : cases[r].parts()) d.send.push_back(t->to(Device::kCUDA));
        d.send.push_back(cases[r].rows_f32.to(Device::kCUDA));
        moe::RowScatter s;
        d.slot = cases[r].slot.to(Device::kCUDA);
        s.slot = &d.slot;
        s.capacity = n;
        d.recv.reserve(d.send.size());
        for (size_t i = 0; i < d.send.size(); ++i) {
          d.recv.push_back(
              Tensor::poisoned({ranks * n, d.send[i].dim(1)}, d.send[i].dtype(), Device::kCUDA));
          s.parts.push_back(
              {&d.send[i], &d.recv[i], i >= 3 ? RowWire::kMxfp8 : RowWire::kAsIs, rule});
        }
        d.counts = cases[r].counts.to(Device::kCUDA);
        d.counts_in = Tensor::poisoned({ranks, 2}, DType::kI64, Device::kCUDA);
        s.to_peers = &d.counts;
        s.from_peers = &d.counts_in;
        moe::check_row_scatter(s, ranks);
        ASSERT_TRUE(moe::make_lsa_plan(s, ranks, SIZE_MAX, &d.plan)) << what;
        // The codecs this case exists to cover, one per part.
        const moe::LsaCodec codecs[] = {moe::LsaCodec::kCopy16, moe::LsaCodec::kCopy4,
                                        moe::LsaCodec::kCopy1, moe::LsaCodec::kMxfp8Bf16,
                                        moe::LsaCodec::kMxfp8F32};
        ASSERT_EQ(d.plan.n_parts, 5) << what;
        for (int i = 0; i < 5; ++i)
          EXPECT_EQ(d.plan.parts[i].codec, codecs[i]) << what << " part " << i;
        d.window = Tensor::poisoned({static_cast<int64_t>(d.plan.window_bytes)}, DType::kU8,
                                    Device::kCUDA);
        windows[r] = d.window.raw();
      }
      std::vector<moe::LsaPlan> plans;
      for (const OnDevice& d : dev) plans.push_back(d.plan);
      ASSERT_EQ(cudaSuccess,
                moe::emulated_scatter(plans.data(), ranks, windows.data(), 8, cuda::stream()));
      cuda::synchronize();
      for (int to = 0; to < ranks; ++to)
        for (int from = 0; from < ranks; ++from)
          ASSERT_NO_FATAL_FAILURE(expect_scattered(cases[from], from, to, ranks, n, dev[to].recv,
                                                   dev[to].counts_in, rule, what.c_str()));
    }
}

// The FP8 codecs over 1 to 3 emulated ranks: bf16 and f32 rows quantized by the send kernel in
// 1 x 128 blocks arrive as the bytes and scales ops::fp8_quantize gives on the host, bit for bit,
// both scale rules, beside a copied part; receive rows poisoned first.
TEST(LsaScatter, EmulatedRanksCarryFp8RowsAsTheSenderQuantizedThem) {
  if (cuda::device_count() == 0) GTEST_FAIL() << "no GPU: run this test on the GPU machine";
  const int64_t n = 203;
  const int64_t widths[] = {640, 256};
  for (const Fp8ScaleRule rule : {Fp8ScaleRule::kFp32, Fp8ScaleRule::kPow2})
    for (int ranks = 1; ranks <= 3; ++ranks) {
      const std::string what =
          std::to_string(ranks) + " ranks, " + std::string(fp8_scale_rule_name(rule));
      struct Rank {
        Tensor slot, ids;
        std::vector<Tensor> rows;  // host: bf16 (n, 640), f32 (n, 256)
        std::vector<Tensor> send;
        std::vector<QuantTensor> recv;
        Tensor slot_dev, ids_dev, ids_in, window;
        moe::LsaPlan plan;
      };
      std::vector<Rank> rk(ranks);
      std::vector<void*> windows(ranks);
      for (int r = 0; r < ranks; ++r) {
        Rank& d = rk[r];
        d.slot = Tensor::empty({n, ranks}, DType::kI32);
        const CounterRng rng{23, static_cast<uint64_t>(r)};
        std::vector<int32_t> next(ranks, 0);
        for (int64_t t = 0; t < n; ++t)
          for (int p = 0; p < ranks; ++p)
            d.slot.data<int32_t>()[t * ranks + p] =
                rng.below(t * ranks + p, 10) < 7 ? next[p]++ : -1;
        d.ids = Tensor::empty({n, 4}, DType::kI32);
        for (int64_t i = 0; i < n * 4; ++i)
          d.ids.data<int32_t>()[i] = static_cast<int32_t>(100000 * r + i);
        for (int k = 0; k < 2; ++k) {  // a scale per block, over 2^-20 .. 2^20
          Tensor x = testing::randn({n, widths[k]}, 300 + 10 * r + k).to(DType::kF32);
          for (int64_t i = 0; i < x.numel(); ++i)
            x.data<float>()[i] *= std::ldexp(1.0f, static_cast<int>((i / 128 * 11) % 41) - 20);
          d.rows.push_back(x.to(k == 0 ? DType::kBF16 : DType::kF32));
          d.send.push_back(d.rows[k].to(Device::kCUDA));
          d.recv.push_back(QuantTensor::poisoned({ranks * n, widths[k]}, QuantBlock::kRow128,
                                                 QuantAxis::kDim0, Device::kCUDA));
        }
        d.slot_dev = d.slot.to(Device::kCUDA);
        d.ids_dev = d.ids.to(Device::kCUDA);
        d.ids_in = Tensor::poisoned({ranks * n, 4}, DType::kI32, Device::kCUDA);
        moe::RowScatter s;
        s.slot = &d.slot_dev;
        s.capacity = n;
        s.parts.push_back({&d.ids_dev, &d.ids_in});
        for (int k = 0; k < 2; ++k) {
          moe::ScatterPart part{&d.send[k], nullptr, RowWire::kFp8};
          part.recv_fp8 = &d.recv[k];
          part.fp8_scale = rule;
          s.parts.push_back(part);
        }
        moe::check_row_scatter(s, ranks);
        ASSERT_TRUE(moe::make_lsa_plan(s, ranks, SIZE_MAX, &d.plan)) << what;
        ASSERT_EQ(d.plan.n_parts, 3) << what;
        EXPECT_EQ(d.plan.parts[1].codec, moe::LsaCodec::kFp8Bf16) << what;
        EXPECT_EQ(d.plan.parts[2].codec, moe::LsaCodec::kFp8F32) << what;
        d.window = Tensor::poisoned({static_cast<int64_t>(d.plan.window_bytes)}, DType::kU8,
                                    Device::kCUDA);
        windows[r] = d.window.raw();
      }
      std::vector<moe::LsaPlan> plans;
      for (const Rank& d : rk) plans.push_back(d.plan);
      ASSERT_EQ(cudaSuccess,
                moe::emulated_scatter(plans.data(), ranks, windows.data(), 8, cuda::stream()));
      cuda::synchronize();
      for (int to = 0; to < ranks; ++to) {
        const Tensor ids_in = rk[to].ids_in.to(Device::kCPU);
        for (int k = 0; k < 2; ++k) {
          const int64_t w = widths[k], blocks = w / 128;
          const QuantTensor got = rk[to].recv[k].to(Device::kCPU);
          for (int from = 0; from < ranks; ++from) {
            QuantTensor want = QuantTensor::empty({n, w}, QuantBlock::kRow128, QuantAxis::kDim0);
            ops::fp8_quantize(rk[from].rows[k], rule, want);
            int64_t places = 0;
            for (int64_t t = 0; t < n; ++t) {
              const int32_t slot = rk[from].slot.data<int32_t>()[t * ranks + to];
              if (slot < 0) continue;
              ++places;
              const int64_t place = from * n + slot;
              ASSERT_EQ(std::memcmp(static_cast<const uint8_t*>(got.data().raw()) + place * w,
                                    static_cast<const uint8_t*>(want.data().raw()) + t * w, w),
                        0)
                  << what << ": part " << k << ", row " << t << " from " << from << " to " << to;
              ASSERT_EQ(
                  std::memcmp(got.scales().data<float>() + place * blocks,
                              want.scales().data<float>() + t * blocks, blocks * sizeof(float)),
                  0)
                  << what << ": scales of part " << k << ", row " << t << " from " << from;
              ASSERT_EQ(std::memcmp(ids_in.data<int32_t>() + place * 4,
                                    rk[from].ids.data<int32_t>() + t * 4, 4 * sizeof(int32_t)),
                        0)
                  << what;
            }
            EXPECT_GT(places, 0) << what;
          }
        }
      }
    }
}

// Summed parts (combine's reduction as it reads the window): each of ScatterCase's float parts
// summed into m rows, row i of it the places of peer q's row (3i + q) % n where it came here (-1
// for some), with a residual on two parts. Every codec's sum (16-byte packs of bf16 and f32, an
// element at a time for rows of 3) against the definition: the same scatter's places, then
// ops::combine_forward on the GPU, bit for bit; outputs poisoned first.
struct SumCase {
  std::vector<Tensor> send, places, sums, want, residual;
  Tensor slot, index, window;
  moe::LsaPlan plan, sum_plan;
};

void plan_sums(const std::vector<ScatterCase>& cases, int r, int ranks, int64_t n, int64_t m,
               SumCase& d) {
  const ScatterCase& mine = cases[r];
  for (const Tensor* t : {&mine.weights, &mine.narrow, &mine.rows, &mine.rows_f32})
    d.send.push_back(t->to(Device::kCUDA));
  d.slot = mine.slot.to(Device::kCUDA);
  Tensor index = Tensor::empty({m, ranks}, DType::kI32);
  for (int q = 0; q < ranks; ++q) {
    std::vector<int32_t> place(n, -1);  // of q's rows at this rank
    int32_t at = 0;
    for (int64_t t = 0; t < n; ++t)
      if (cases[q].slot.data<int32_t>()[t * ranks + r] >= 0)
        place[t] = static_cast<int32_t>(q * n + at++);
    for (int64_t i = 0; i < m; ++i)
      index.data<int32_t>()[i * ranks + q] = i % 7 == 3 ? -1 : place[(3 * i + q) % n];
  }
  d.index = index.to(Device::kCUDA);
  moe::RowScatter plain, summed;
  plain.slot = summed.slot = &d.slot;
  plain.capacity = summed.capacity = n;
  d.places.reserve(4);
  d.sums.reserve(4);
  d.residual.reserve(4);
  for (size_t i = 0; i < 4; ++i) {
    const Tensor& x = d.send[i];
    d.places.push_back(Tensor::poisoned({ranks * n, x.dim(1)}, x.dtype(), Device::kCUDA));
    d.sums.push_back(Tensor::poisoned({m, x.dim(1)}, x.dtype(), Device::kCUDA));
    d.residual.push_back(
        i >= 2 ? testing::randn({m, x.dim(1)}, 60 + i + 10 * r).to(x.dtype()).to(Device::kCUDA)
               : Tensor());
    plain.parts.push_back({&x, &d.places[i]});
    summed.parts.push_back(
        {&x, &d.sums[i], RowWire::kAsIs, {}, &d.index, i >= 2 ? &d.residual[i] : nullptr});
  }
  moe::check_row_scatter(summed, ranks);
  ASSERT_TRUE(moe::make_lsa_plan(plain, ranks, SIZE_MAX, &d.plan));
  ASSERT_TRUE(moe::make_lsa_plan(summed, ranks, SIZE_MAX, &d.sum_plan));
  const moe::LsaSum sums[] = {moe::LsaSum::kF32, moe::LsaSum::kBf16, moe::LsaSum::kBf16,
                              moe::LsaSum::kF32};
  const moe::LsaCodec codecs[] = {moe::LsaCodec::kCopy4, moe::LsaCodec::kCopy1,
                                  moe::LsaCodec::kCopy16, moe::LsaCodec::kCopy16};
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(d.sum_plan.parts[i].sum, sums[i]) << "part " << i;
    EXPECT_EQ(d.sum_plan.parts[i].codec, codecs[i]) << "part " << i;
  }
  d.window =
      Tensor::poisoned({static_cast<int64_t>(d.plan.window_bytes)}, DType::kU8, Device::kCUDA);
}

// The definition from the places: ops::combine_forward over them.
void sums_from_places(SumCase& d) {
  ops::ExpertPermutation back;
  back.row_of_choice = d.index.reshape({d.index.numel()});
  for (size_t i = 0; i < 4; ++i) {
    d.want.push_back(Tensor::poisoned(d.sums[i].shape(), d.sums[i].dtype(), Device::kCUDA));
    ops::combine_forward(d.places[i], back, d.want[i],
                         d.residual[i].defined() ? &d.residual[i] : nullptr);
  }
}

void expect_sums(const SumCase& d, const std::string& what) {
  for (size_t i = 0; i < 4; ++i) {
    const Tensor got = d.sums[i].to(Device::kCPU), want = d.want[i].to(Device::kCPU);
    ASSERT_TRUE(all_finite(want)) << what << ": part " << i;  // every named place was written
    EXPECT_EQ(std::memcmp(got.raw(), want.raw(), got.nbytes()), 0) << what << ": part " << i;
  }
}

TEST(LsaScatter, EmulatedRanksSumTheirPlacesAsTheyArrive) {
  if (cuda::device_count() == 0) GTEST_FAIL() << "no GPU: run this test on the GPU machine";
  const int64_t n = 301, m = 97;
  for (int ranks = 1; ranks <= 4; ++ranks) {
    const std::string what = std::to_string(ranks) + " ranks";
    std::vector<ScatterCase> cases;
    std::vector<std::vector<int32_t>> sent(ranks);
    for (int r = 0; r < ranks; ++r) cases.emplace_back(r, ranks, n, &sent[r]);
    std::vector<SumCase> dev(ranks);
    std::vector<void*> windows(ranks);
    std::vector<moe::LsaPlan> plain, summed;
    for (int r = 0; r < ranks; ++r) {
      ASSERT_NO_FATAL_FAILURE(plan_sums(cases, r, ranks, n, m, dev[r])) << what;
      windows[r] = dev[r].window.raw();
      plain.push_back(dev[r].plan);
      summed.push_back(dev[r].sum_plan);
    }
    ASSERT_EQ(cudaSuccess,
              moe::emulated_scatter(plain.data(), ranks, windows.data(), 8, cuda::stream()));
    for (SumCase& d : dev) sums_from_places(d);
    ASSERT_EQ(cudaSuccess,
              moe::emulated_scatter(summed.data(), ranks, windows.data(), 8, cuda::stream()));
    cuda::synchronize();
    for (int r = 0; r < ranks; ++r) expect_sums(dev[r], what + ", rank " + std::to_string(r));
  }
}

// The same through NCCL on one GPU: the device path (its window, LSA pointer and barriers) sums
// as the default path (places through NCCL's all-to-all, then ops::combine_forward) does, bit for
// bit, eagerly and replayed from a CUDA graph.
TEST(LsaScatter, OneRankThroughNcclSumsAsTheAllToAllPath) {
  if (cuda::device_count() == 0) GTEST_FAIL() << "no GPU: run this test on the GPU machine";
  with_nccl(1, [](dist::Communicator& c) {
    const int64_t n = 301, m = 97;
    std::vector<ScatterCase> cases;
    std::vector<int32_t> sent;
    cases.emplace_back(0, 1, n, &sent);
    SumCase d;
    ASSERT_NO_FATAL_FAILURE(plan_sums(cases, 0, 1, n, m, d));
    std::string why;
    const size_t reserved = c.reserve_peer_window(1 << 20, 8, &why);
    ASSERT_GT(reserved, 0u) << why;
    for (size_t i = 0; i < 4; ++i)
      d.want.push_back(Tensor::poisoned(d.sums[i].shape(), d.sums[i].dtype(), Device::kCUDA));
    moe::RowScatter s;
    s.slot = &d.slot;
    s.capacity = n;
    for (size_t i = 0; i < 4; ++i)
      s.parts.push_back({&d.send[i],
                         &d.want[i],
                         RowWire::kAsIs,
                         {},
                         &d.index,
                         i >= 2 ? &d.residual[i] : nullptr});
    moe::LsaPlan plan;
    ASSERT_TRUE(moe::make_lsa_plan(s, 1, reserved, &plan));  // the device path takes it
    moe::scatter_rows(c, s, moe::ScatterPath::kAllToAll);    // the definition's path
    for (size_t i = 0; i < 4; ++i) s.parts[i].recv = &d.sums[i];
    moe::scatter_rows(c, s);
    cuda::synchronize();
    expect_sums(d, "one NCCL rank");
    auto graph = cuda::Graph::capture([&] { moe::scatter_rows(c, s); });
    for (Tensor& t : d.sums) cudaMemset(t.raw(), 0xFF, t.nbytes());
    graph->launch();
    cuda::synchronize();
    expect_sums(d, "one NCCL rank, graphed");
  });
}

// The device path through NCCL itself on one GPU (a one-rank window, its LSA pointer and
// barriers) and the path without it (regions through NCCL's all-to-all): every codec in one
// scatter, as the definition says, eagerly and replayed from a CUDA graph.
TEST(LsaScatter, OneRankThroughNcclPlacesEveryPart) {
  if (cuda::device_count() == 0) GTEST_FAIL() << "no GPU: run this test on the GPU machine";
  with_nccl(1, [](dist::Communicator& c) {
    const int64_t n = 301;
    std::vector<int32_t> sent;
    const ScatterCase host(0, 1, n, &sent);
    std::vector<Tensor> send, recv;
    for (const Tensor* t : host.parts()) send.push_back(t->to(Device::kCUDA));
    send.push_back(host.rows_f32.to(Device::kCUDA));
    Tensor slot = host.slot.to(Device::kCUDA), counts = host.counts.to(Device::kCUDA);
    Tensor counts_in = Tensor::poisoned({1, 2}, DType::kI64, Device::kCUDA);
    moe::RowScatter s;
    s.slot = &slot;
    s.capacity = n;
    recv.reserve(send.size());
    for (size_t i = 0; i < send.size(); ++i) {
      recv.push_back(Tensor::poisoned({n, send[i].dim(1)}, send[i].dtype(), Device::kCUDA));
      s.parts.push_back({&send[i], &recv[i], i >= 3 ? RowWire::kMxfp8 : RowWire::kAsIs});
    }
    s.to_peers = &counts;
    s.from_peers = &counts_in;
    std::string why;
    const size_t reserved = c.reserve_peer_window(1 << 20, 8, &why);
    ASSERT_GT(reserved, 0u) << why;
    moe::LsaPlan plan;
    ASSERT_TRUE(moe::make_lsa_plan(s, 1, reserved, &plan));  // the device path takes it
    moe::scatter_rows(c, s);
    cuda::synchronize();
    expect_scattered(host, 0, 0, 1, n, recv, counts_in, MxScaleRule::kRceil, "one NCCL rank");
    // The path without the device API (each region whole through NCCL's all-to-all) gives the same.
    for (size_t i = 0; i < recv.size(); ++i) {
      recv[i] = Tensor::poisoned(recv[i].shape(), recv[i].dtype(), Device::kCUDA);
      s.parts[i].recv = &recv[i];
    }
    counts_in = Tensor::poisoned({1, 2}, DType::kI64, Device::kCUDA);
    moe::scatter_rows(c, s, moe::ScatterPath::kAllToAll);
    cuda::synchronize();
    expect_scattered(host, 0, 0, 1, n, recv, counts_in, MxScaleRule::kRceil,
                     "one NCCL rank, all-to-all");
    // Neither path waits for the host: both are captured as CUDA graphs and replay correctly.
    for (const bool device_path : {true, false}) {
      auto graph = cuda::Graph::capture([&] {
        if (device_path)
          moe::scatter_rows(c, s);
        else
          moe::scatter_rows(c, s, moe::ScatterPath::kAllToAll);
      });
      for (Tensor& t : recv) cudaMemset(t.raw(), 0xFF, t.nbytes());
      cudaMemset(counts_in.raw(), 0xFF, counts_in.nbytes());
      graph->launch();
      cuda::synchronize();
      expect_scattered(
          host, 0, 0, 1, n, recv, counts_in, MxScaleRule::kRceil,
          device_path ? "one NCCL rank, graphed" : "one NCCL rank, all-to-all graphed");
    }
  });
}

// The layer's tokens in chunks on one NCCL rank (its exchange on, through the device path:
// nothing crosses, every kernel runs). With the exchanges on the lane beside the experts the
// layer gives, bit for bit, the chunks run in turn on the thread's stream, eagerly and replayed
// from one CUDA graph that holds both streams (and so does one chunk, its backward's combine on
// the lane beside the weight gradients); and the chunks give the layer in one chunk to the
// rounding of the experts' weight gradients, which add the chunks' products in turn.
TEST(MoeLayer, OneRankChunksOnTheLaneGiveTheChunksInTurn) {
  if (cuda::device_count() == 0) GTEST_FAIL() << "no GPU: run this test on the GPU machine";
  with_nccl(1, [](dist::Communicator& comm) {
    const int64_t n = 1000, d = 256, f = 128, e = 16, k = 4;
    moe::MoeConfig c;
    c.dim = d;
    c.moe_dim = f;
    c.n_experts = e;
    c.top_k = k;
    std::string why;
    ASSERT_GT(comm.reserve_peer_window(
                  moe::ExpertExchange::window_bytes(1, n, k, e, d, DType::kBF16, {}), 16, &why),
              0u)
        << why;
    auto input = [](const Shape& s, uint64_t seed, double scale) {
      Tensor t = Tensor::empty(s, DType::kF32);
      const CounterRng rng{seed, 5};
      for (int64_t i = 0; i < t.numel(); ++i) t.set_item(i, scale * rng.normal(i));
      return t.to(DType::kBF16).to(Device::kCUDA);
    };
    const moe::MoeWeights w{input({d, e}, 1, 0.1), input({e, d, 2 * f}, 2, 0.06),
                            input({e, f, d}, 3, 0.09)};
    const Tensor hn = input({n, d}, 4, 1.0), dout = input({n, d}, 5, 1.0);
    struct Result {
      Tensor out, dhn;
      moe::MoeWeights g;
    };
    auto poisoned_result = [&] {
      return Result{Tensor::poisoned({n, d}, DType::kBF16, Device::kCUDA),
                    Tensor::poisoned({n, d}, DType::kBF16, Device::kCUDA),
                    {Tensor::zeros({d, e}, DType::kF32, Device::kCUDA),
                     Tensor::poisoned(w.w_gate_up.shape(), DType::kF32, Device::kCUDA),
                     Tensor::poisoned(w.w_down.shape(), DType::kF32, Device::kCUDA)}};
    };
    // One layer into res (allocated outside, so that a replay writes the same buffers).
    auto layer = [&](const moe::MoeComms& comms, Result& res) {
      moe::MoeActivations a;
      moe::moe_fill(w, c, comms, Tensor(), hn, a);
      moe::moe_combine(w, c, comms, a, res.out);
      res.dhn.copy_from(
          moe::moe_backward(w, res.g, c, comms, hn, a, dout, 0.01, ops::Accumulate::kNo));
    };
    auto host = [](const Result& r) {
      return std::vector<Tensor>{
          r.out.to(Device::kCPU).to(DType::kF32), r.dhn.to(Device::kCPU).to(DType::kF32),
          r.g.router.to(Device::kCPU), r.g.w_gate_up.to(Device::kCPU), r.g.w_down.to(Device::kCPU)};
    };
    const char* names[] = {"output", "d hn", "d router", "d w_gate_up", "d w_down"};
    Lane lane(moe::kExchangeExposedSpan);
    const moe::MoeComms in_turn{&comm, nullptr, moe::ExchangeMode::kDeviceCounts, 3, nullptr};
    const moe::MoeComms beside{&comm, nullptr, moe::ExchangeMode::kDeviceCounts, 3, &lane};
    const moe::MoeComms whole{&comm, nullptr, moe::ExchangeMode::kDeviceCounts, 1, nullptr};
    const moe::MoeComms whole_beside{&comm, nullptr, moe::ExchangeMode::kDeviceCounts, 1, &lane};
    Result ref = poisoned_result(), lane_eager = poisoned_result(), one = poisoned_result(),
           one_lane = poisoned_result();
    layer(in_turn, ref);
    layer(beside, lane_eager);
    layer(whole, one);
    layer(whole_beside, one_lane);
    // Graphed: the warm-up runs eagerly, the second run is captured and replayed; the buffers
    // the graph writes are poisoned again before a last replay.
    Result graphed = poisoned_result();
    cuda::CapturedWork work;
    for (int run = 0; run < 3; ++run) {
      const bool replayed = work.run([&] { layer(beside, graphed); }, "the chunked layer");
      EXPECT_EQ(replayed, run > 0) << "run " << run;
      if (run == 1) {
        for (Tensor* t : {&graphed.out, &graphed.dhn, &graphed.g.w_gate_up, &graphed.g.w_down})
          cudaMemset(t->raw(), 0xFF, t->nbytes());
        cudaMemset(graphed.g.router.raw(), 0, graphed.g.router.nbytes());
      }
    }
    cuda::synchronize();
    const std::vector<Tensor> r = host(ref), l = host(lane_eager), gr = host(graphed),
                              o = host(one), ol = host(one_lane);
    for (size_t i = 0; i < r.size(); ++i) {
      // One chunk, its backward's combine on the lane beside the weight gradients.
      EXPECT_EQ(relative_error(ol[i], o[i]), 0.0) << names[i] << ": one chunk on the lane";
      EXPECT_GT(ops::sum_of_squares(r[i]), 0.0) << names[i];
      EXPECT_EQ(relative_error(l[i], r[i]), 0.0) << names[i] << ": on the lane, eager";
      EXPECT_EQ(relative_error(gr[i], r[i]), 0.0) << names[i] << ": on the lane, replayed";
      // bf16 rows (output, d hn: half an ulp is 2e-3) and f32 sums in another order.
      EXPECT_LE(relative_error(o[i], r[i]), i < 2 ? 4e-3 : 1e-5) << names[i] << ": one chunk";
    }
  });
}

// The device-initiated exchange (rows written into the peer's memory by a kernel, counts never
// on the host) against the host-count reference, with ep 2 and the untrained router's uneven
// routing: the same rows reach the same experts in the same order and come back summed in the
// same order, so the losses, load-balancing losses and gradient norms of six steps agree to the
// bit; and captured as one CUDA graph per pass, replayed, it gives the eager run's numbers.
TEST(Nccl, TwoGpuDeviceExchangeMatchesTheHostCountReference) {
  if (cuda::device_count() < 2) GTEST_SKIP() << "needs two GPUs (the nvidia-h200-x2 machine)";
  const std::string kMx =
      " --set model.expert_recipe=mxfp8_wgrad_with_hp --set parallel.ep_dispatch_dtype=mxfp8";
  const std::string common =
      " launch -n 2 --" + tiny_on_gpu() + " --set parallel.ep=2 --set train.batch_rows=8 --steps 6";
  CaseRuns r;
  ASSERT_NO_FATAL_FAILURE(run_cases(
      common,
      {{"host", " --set parallel.ep_exchange=host --set hardware.cuda_graphs=false"},
       {"device", " --set parallel.ep_exchange=device --set hardware.cuda_graphs=false"},
       {"device_graphed", " --set parallel.ep_exchange=device --set hardware.cuda_graphs=true"},
       {"host_mx", " --set parallel.ep_exchange=host --set hardware.cuda_graphs=false" + kMx},
       {"device_mx", " --set parallel.ep_exchange=device --set hardware.cuda_graphs=true" + kMx},
       {"host_chunks",
        " --set parallel.ep_exchange=host --set hardware.cuda_graphs=false --set "
        "parallel.ep_chunks=3"},
       {"device_chunks",
        " --set parallel.ep_exchange=device --set hardware.cuda_graphs=true --set "
        "parallel.ep_chunks=3"}},
      r));
  EXPECT_NE(r.logs["device"].find("expert exchange: device-initiated"), std::string::npos)
      << r.logs["device"];
  EXPECT_NE(r.logs["device_graphed"].find("captured the training pass"), std::string::npos)
      << r.logs["device_graphed"];
  expect_same_steps(r, "host", {"device", "device_graphed"}, 6);
  // The MXFP8 wire: quantized in the send kernel, dequantized in the receive kernel, as the
  // reference quantizes before its all-to-all and dequantizes after.
  expect_same_steps(r, "host_mx", {"device_mx"}, 6);
  // The layer's tokens in three chunks, each exchange on the lane beside the experts (the device
  // run captured with both streams), against the reference in the same chunks.
  expect_same_steps(r, "host_chunks", {"device_chunks"}, 6);
}

// A peer dying mid-run, with the survivor's passes replayed as CUDA graphs (their collectives
// were captured: nothing on the host waits in a collective call) and eager: the rank's NCCL
// watchdog (handed each replay, `watch_queued`) must stop it with the cause, well before the
// shell's timeout, and not hang. Two ranks started by hand, as torchrun would, so no launcher
// stops the survivor.
TEST(Nccl, ADeadPeerStopsTheSurvivor) {
  if (cuda::device_count() < 2) GTEST_SKIP() << "needs two GPUs (the nvidia-h200-x2 machine)";
  const std::string bin = testing::moetrain_binary();
  for (const auto& [graphs, ep] : {std::pair{true, 1}, std::pair{false, 1}, std::pair{true, 2}}) {
    SCOPED_TRACE(std::string(graphs ? "graphed passes" : "eager passes") + ", ep " +
                 std::to_string(ep));
    const std::string env =
        "WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MOETRAIN_TIMEOUT_S=20 MASTER_PORT=" +
        std::to_string(testing::free_port());
    const std::string args = tiny_on_gpu() + " --set parallel.ep=" + std::to_string(ep) +
                             " --set train.batch_rows=8 --set train.log_every=1"
                             " --steps 12 --set hardware.cuda_graphs=" +
                             (graphs ? "true" : "false");
    const std::string out0 = testing::unique_temp_path("survivor_rank0.txt");
    // Rank 1 exits (code 17, no goodbye) in step 7 after its token count, before its pass: rank
    // 0 is left in step 7's pass (a replay, when graphed).
    const testing::Proc p =
        testing::run_cmd("((" + env + " RANK=0 LOCAL_RANK=0 timeout 150 " + bin + args + " >" +
                         out0 + " 2>&1; echo rank0=$? >>" + out0 + ") & " + env +
                         " RANK=1 LOCAL_RANK=1 MOETRAIN_FAULT_EXIT=1:7:pass " + bin + args +
                         "; echo rank1=$?; wait)");
    EXPECT_NE(p.output.find("rank1=17"), std::string::npos) << p.output;
    const std::string rank0 = testing::read_file(out0);
    std::printf("rank 0's output:\n%s\n", rank0.c_str());  // which way it stopped, for the record
    // It got to step 6 (replaying, when graphed), then failed on its own (exit 1, not the
    // shell's 124), naming the cause: its next collective threw after the watchdog's abort, or,
    // when the abort did not release it, the watchdog ended the process.
    if (graphs) {
      EXPECT_NE(rank0.find("captured the training pass"), std::string::npos);
    }
    EXPECT_NE(rank0.find("step     6"), std::string::npos);
    EXPECT_NE(rank0.find("rank0=1\n"), std::string::npos);
    EXPECT_TRUE(rank0.find("a peer died") != std::string::npos ||
                rank0.find("NCCL reported") != std::string::npos);
    EXPECT_EQ(rank0.find("step     8 "), std::string::npos) << "went on past the dead peer";
  }
}

}  // namespace
}  // namespace mt
