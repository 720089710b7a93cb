// The communicators: in-process ranks (the collectives, their failures, the row scatter of the
// expert exchange), the mesh, and one process per rank (the launcher, the socket backend).
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
#include "moe/exchange/row_scatter.h"
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
    moe::scatter_rows(c, rows, slot, capacity, recv);
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
    const std::string e =
        testing::error_of([&] { moe::scatter_rows(c, rows, bad, capacity, recv); });
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
      moe::RowScatter s;
      s.slot = &slot;
      s.capacity = capacity;
      s.parts = {{&ids, &ids_in}, {&f64, &f64_in}, {&x, &x_in, RowWire::kMxfp8, rule}};
      s.to_peers = &counts;
      s.from_peers = &counts_in;
      moe::scatter_rows(c, s);
      for (int q = 0; q < world; ++q) {
        const Tensor theirs = ids_of(q), their_f64 = testing::randn({n, 5}, 40 + q);
        Tensor their_mx = Tensor::empty({n, width}, DType::kF32);
        ops::mx_round_trip(rows_of(q), QuantAxis::kDim0, rule, their_mx);
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
      ops::mx_round_trip(x, QuantAxis::kDim0, rule, mine);
      EXPECT_NE(std::memcmp(mine.data<float>(), x.data<float>(), x.nbytes()), 0);

      Tensor narrow = Tensor::empty({world * capacity, 4}, DType::kF64);
      moe::RowScatter bad = s;
      bad.parts = {{&f64, &narrow}};
      bad.to_peers = nullptr;
      bad.from_peers = nullptr;
      std::string e = testing::error_of([&] { moe::scatter_rows(c, bad); });
      EXPECT_NE(e.find("scatter_rows of f64 (6, 5) into f64 (24, 4)"), std::string::npos) << e;
      Tensor odd = Tensor::empty({n, 40}, DType::kF32),
             odd_in = Tensor::empty({world * capacity, 40}, DType::kF32);
      bad.parts = {{&odd, &odd_in, RowWire::kMxfp8}};
      e = testing::error_of([&] { moe::scatter_rows(c, bad); });
      EXPECT_NE(e.find("an MXFP8 part of f32 (6, 40) (needs f32, bf16 or f64 rows"),
                std::string::npos)
          << e;
      bad.parts = {};
      bad.to_peers = &counts;
      e = testing::error_of([&] { moe::scatter_rows(c, bad); });
      EXPECT_NE(e.find("per-peer rows need both"), std::string::npos) << e;
    });
}

// An FP8 part (the default path): each row arrives at its places as the bytes and scales
// ops::fp8_quantize gives its sender's row (f32 and bf16 rows, both scale rules), beside an as-is
// part; FP8 parts that do not fit are named.
TEST(InProcess, ScatterRowsCarriesFp8RowsAsTheirSenderQuantizedThem) {
  const int world = 3;
  const int64_t n = 5, capacity = 6, width = 384, blocks = width / 128;
  for (const DType dt : {DType::kF32, DType::kBF16})
    for (const Fp8ScaleRule rule : {Fp8ScaleRule::kFp32, Fp8ScaleRule::kPow2})
      run_in_process(world, [&](Communicator& c) {
        const int r = c.rank();
        // Row t goes to peer p when (t + p + r) % 3 != 1.
        auto goes = [](int64_t t, int p, int from) { return (t + p + from) % 3 != 1; };
        Tensor slot = Tensor::empty({n, world}, DType::kI32);
        std::vector<int32_t> next(world, 0);
        for (int64_t t = 0; t < n; ++t)
          for (int p = 0; p < world; ++p)
            slot.data<int32_t>()[t * world + p] = goes(t, p, r) ? next[p]++ : -1;
        auto rows_of = [&](int from) {  // a scale per block, a zero block in row 1
          Tensor x = testing::randn({n, width}, 90 + from).to(DType::kF32);
          for (int64_t i = 0; i < x.numel(); ++i)
            x.data<float>()[i] *=
                i / 128 == 4 ? 0.0f : std::ldexp(1.0f, static_cast<int>((i / 128) % 5) * 4 - 8);
          return x.to(dt);
        };
        const Tensor x = rows_of(r);
        const Tensor ids = testing::randn({n, 2}, 95 + r);
        QuantTensor x_in =
            QuantTensor::poisoned({world * capacity, width}, QuantBlock::kRow128, QuantAxis::kDim0);
        Tensor ids_in = Tensor::poisoned({world * capacity, 2}, DType::kF64);
        moe::RowScatter s;
        s.slot = &slot;
        s.capacity = capacity;
        moe::ScatterPart fp8{&x, nullptr, RowWire::kFp8};
        fp8.recv_fp8 = &x_in;
        fp8.fp8_scale = rule;
        s.parts = {{&ids, &ids_in}, fp8};
        moe::scatter_rows(c, s);
        int64_t rows_seen = 0;
        for (int q = 0; q < world; ++q) {
          const Tensor theirs = rows_of(q), their_ids = testing::randn({n, 2}, 95 + q);
          QuantTensor want = QuantTensor::empty({n, width}, QuantBlock::kRow128, QuantAxis::kDim0);
          ops::fp8_quantize(theirs, rule, want);
          int64_t at = 0;
          for (int64_t t = 0; t < n; ++t) {
            if (!goes(t, r, q)) continue;
            const int64_t place = q * capacity + at++;
            ++rows_seen;
            ASSERT_EQ(
                std::memcmp(static_cast<const uint8_t*>(x_in.data().raw()) + place * width,
                            static_cast<const uint8_t*>(want.data().raw()) + t * width, width),
                0)
                << "FP8 row " << t << " from " << q;
            ASSERT_EQ(std::memcmp(x_in.scales().data<float>() + place * blocks,
                                  want.scales().data<float>() + t * blocks, blocks * sizeof(float)),
                      0)
                << "scales of row " << t << " from " << q;
            ASSERT_EQ(ids_in.item(place * 2 + 1), their_ids.item(t * 2 + 1));
          }
        }
        EXPECT_GT(rows_seen, 0);

        moe::RowScatter bad = s;
        Tensor odd = Tensor::empty({n, 200}, dt);
        moe::ScatterPart part = fp8;
        part.send = &odd;
        bad.parts = {part};
        std::string e = testing::error_of([&] { moe::scatter_rows(c, bad); });
        EXPECT_NE(e.find("an FP8 part of " + std::string(dtype_name(dt)) + " (5, 200)"),
                  std::string::npos)
            << e;
        QuantTensor narrow =
            QuantTensor::empty({world * capacity, 256}, QuantBlock::kRow128, QuantAxis::kDim0);
        part = fp8;
        part.recv_fp8 = &narrow;
        bad.parts = {part};
        e = testing::error_of([&] { moe::scatter_rows(c, bad); });
        EXPECT_NE(e.find("receive rows are (18, 256) in 1x128 blocks along dim0 (need (18, 384)"),
                  std::string::npos)
            << e;
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
      moe::RowScatter s;
      s.slot = &slot;
      s.capacity = capacity;
      s.parts = {{&rows, &out, RowWire::kAsIs, {}, &index, with_residual ? &residual : nullptr}};
      moe::scatter_rows(c, s);
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
    moe::RowScatter bad;
    bad.slot = &slot;
    bad.capacity = capacity;
    bad.parts = {{&rows, &out, RowWire::kAsIs, {}, &short_index}};
    std::string e = testing::error_of([&] { moe::scatter_rows(c, bad); });
    EXPECT_NE(e.find("scatter_rows of f64 (5, 4) into f64 (7, 4)"), std::string::npos) << e;
    const Tensor wide = testing::randn({n, 32}, 90).to(DType::kF32);
    Tensor wide_out = Tensor::empty({m, 32}, DType::kF32);
    bad.parts = {{&wide, &wide_out, RowWire::kMxfp8, {}, &index}};
    e = testing::error_of([&] { moe::scatter_rows(c, bad); });
    EXPECT_NE(e.find("a summed part of f32 rows on the mxfp8 wire"), std::string::npos) << e;
  });
}

// --- one process per rank: the launcher and the socket backend ---

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

// Context parallelism in processes: two ranks splitting every row (cp = 2) give the in-process
// ranks' losses bit for bit and one rank's holding the rows whole to f32 rounding.
TEST(Launch, ContextParallelProcessesMatchOneRank) {
  const auto tmp = std::filesystem::temp_directory_path();
  const std::string a = (tmp / "mt_launch_cp_a.jsonl").string(),
                    b = (tmp / "mt_launch_cp_b.jsonl").string(),
                    one = (tmp / "mt_launch_cp_one.jsonl").string();
  for (const std::string& f : {a, b, one}) std::filesystem::remove(f);
  const std::string args = std::string(" train --config ") + MOETRAIN_SOURCE_DIR +
                           "/configs/tiny.toml --set train.batch_rows=2 --set train.seq_len=64"
                           " --steps 4";
  const Proc launched = run_cmd(std::string(MOETRAIN_BINARY) + " launch -n 2 --" + args +
                                " --set parallel.cp=2 --metrics " + a);
  ASSERT_EQ(launched.code, 0) << launched.output;
  const Proc threads = run_cmd(std::string(MOETRAIN_BINARY) + args +
                               " --set parallel.world=2 --set parallel.cp=2 --metrics " + b);
  ASSERT_EQ(threads.code, 0) << threads.output;
  const Proc alone = run_cmd(std::string(MOETRAIN_BINARY) + args + " --metrics " + one);
  ASSERT_EQ(alone.code, 0) << alone.output;
  const auto la = losses(a), lb = losses(b), lo = losses(one);
  ASSERT_EQ(la.size(), 4u);
  EXPECT_EQ(la, lb);
  ASSERT_EQ(lo.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_NEAR(la[i], lo[i], 1e-5 * lo[i]) << "step " << i + 1;
  const Proc odd = run_cmd(std::string(MOETRAIN_BINARY) + args +
                           " --set parallel.world=2 --set parallel.cp=2 --set train.seq_len=66");
  EXPECT_EQ(odd.code, 2) << odd.output;
  EXPECT_NE(odd.output.find("train.seq_len = 66 must be a multiple of 2 x parallel.cp = 4"),
            std::string::npos)
      << odd.output;
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
