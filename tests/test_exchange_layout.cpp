// The expert-parallel exchange's layouts (ops/exchange_layout.h): the CPU reference's hand-checked
// cases and, in the Gpu* cases (ctest label `gpu`), the kernels against it.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "op_testing.h"
#include "ops/exchange_layout.h"
#if MOETRAIN_HAS_CUDA
#include "gpu_case.h"
#endif

namespace mt {
namespace {

// Two ranks of two experts: the tokens each rank receives and the choices as its experts.
TEST(Permute, PeerAndLocalChoices) {
  Tensor index = i32({3, 0, 1, 0, 2, 3, 1, 2});
  index = index.reshape({4, 2});
  Tensor peers = Tensor::poisoned({4, 2}, DType::kI32);
  ops::peer_choices(index, 2, 2, peers);
  const std::vector<int> want = {0, 1, 0, -1, -1, 1, 0, 1};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(peers.item(i), want[i]) << i;
  // Each token's place in each peer's region: the tokens for that peer numbered in order, the
  // regions 10 rows apart.
  Tensor slots = Tensor::poisoned({4, 2}, DType::kI32);
  ops::peer_slots(peers, 10, slots);
  const std::vector<int> want_slots = {0, 10, 1, -1, -1, 11, 2, 12};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(slots.item(i), want_slots[i]) << i;
  Tensor counts = Tensor::poisoned({2, 3}, DType::kI64);
  ops::peer_counts(index, 2, 2, counts);
  // Rank 0: expert 0 twice, expert 1 twice, 3 tokens; rank 1: expert 2 twice, 3 twice, 3 tokens.
  const std::vector<int> want_counts = {2, 2, 3, 2, 2, 3};
  for (int i = 0; i < 6; ++i) EXPECT_EQ(counts.item(i), want_counts[i]) << i;
  Tensor local = Tensor::poisoned({4, 2}, DType::kI32);
  ops::local_choices(index, 1, 2, local);
  const std::vector<int> want_local = {1, -1, -1, -1, 0, 1, -1, 0};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(local.item(i), want_local[i]) << i;
}

// Three rows to two ranks of three places: each row at p * 3 + its slot for every rank it goes to,
// the places no row names left as they were; a slot past the places is named.
TEST(Permute, PlaceRowsPutsEachRowAtItsPlaces) {
  Tensor x = i32({10, 11, 20, 21, 30, 31}).reshape({3, 2});
  Tensor slot = i32({0, -1, 1, 0, -1, 2}).reshape({3, 2});
  Tensor out = Tensor::empty({6, 2}, DType::kI32);
  std::fill(out.data<int32_t>(), out.data<int32_t>() + 12, -7);
  ops::place_rows(x, slot, 3, out);
  const std::vector<int> want = {10, 11, 20, 21, -7, -7, 20, 21, -7, -7, 30, 31};
  for (int i = 0; i < 12; ++i) EXPECT_EQ(out.item(i), want[i]) << i;
  Tensor bad = i32({0, -1, 1, 0, -1, 3}).reshape({3, 2});
  const std::string e = error_of([&] { ops::place_rows(x, bad, 3, out); });
  EXPECT_NE(e.find("slot 3 of row 2 for rank 1: 3 places per rank"), std::string::npos) << e;
}

#if MOETRAIN_HAS_CUDA
// ops::place_rows on the GPU against the CPU, every byte of the output (both start from the same
// poison, so the places no row names must stay as they were): rows of 16-, 4- and 1-byte units,
// 1 to 8 peers, a third of the slots -1.
TEST(GpuExpertChoices, PlaceRowsMatchesTheCpu) {
  if (cuda::device_count() == 0) GTEST_FAIL() << "no GPU: run this test on the GPU machine";
  const uint64_t seed = fresh_seed();
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 gen(seed);
  const int64_t n = 777;
  for (const auto& [dtype, width] : std::vector<std::pair<DType, int64_t>>{
           {DType::kBF16, 2048}, {DType::kI32, 8}, {DType::kF32, 3}, {DType::kBF16, 3}})
    for (int peers : {1, 3, 8}) {
      const std::string what = std::string(dtype_name(dtype)) + " x " + std::to_string(width) +
                               ", " + std::to_string(peers) + " peers";
      const int64_t capacity = n + 5;
      Tensor slot = Tensor::empty({n, peers}, DType::kI32);
      std::vector<int32_t> next(peers, 0);
      for (int64_t t = 0; t < n; ++t)
        for (int p = 0; p < peers; ++p)
          slot.data<int32_t>()[t * peers + p] = gen() % 3 == 0 ? -1 : next[p]++;
      Tensor x = Tensor::empty({n, width}, dtype);
      for (size_t i = 0; i < x.nbytes(); ++i) static_cast<uint8_t*>(x.raw())[i] = gen() % 251;
      Tensor want = Tensor::poisoned({peers * capacity, width}, dtype);
      Tensor got = want.to(Device::kCUDA);
      ops::place_rows(x, slot, capacity, want);
      ops::place_rows(x.to(Device::kCUDA), slot.to(Device::kCUDA), capacity, got);
      const Tensor host = got.to(Device::kCPU);
      EXPECT_EQ(std::memcmp(host.raw(), want.raw(), want.nbytes()), 0) << what;
    }
}

// The peer slots' scan over many tiles (4096 tokens each) and tiles partly filled, against the
// host, bit for bit: random peer choices, every token for every peer, none for one peer.
TEST(GpuExpertChoices, PeerSlotsOverManyTilesMatchTheHost) {
  if (cuda::device_count() == 0) GTEST_FAIL() << "no GPU: run this test on the GPU machine";
  const uint64_t seed = fresh_seed();
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 gen(seed);
  for (const int64_t n : {int64_t{1}, int64_t{4096}, int64_t{4097}, int64_t{50001}})
    for (const int peers : {1, 2, 3, 8})
      for (const std::string fill : {"random", "all", "none_for_the_last"}) {
        const std::string what =
            std::to_string(n) + " tokens, " + std::to_string(peers) + " peers, " + fill;
        Tensor to = Tensor::empty({n, peers}, DType::kI32);
        for (int64_t t = 0; t < n; ++t)
          for (int p = 0; p < peers; ++p) {
            const bool goes = fill == "all" || (fill == "random" ? gen() % 3 != 0 : p + 1 < peers);
            to.data<int32_t>()[t * peers + p] = goes ? p : -1;
          }
        Tensor want = Tensor::empty({n, peers}, DType::kI32);
        Tensor got = Tensor::poisoned({n, peers}, DType::kI32, Device::kCUDA);
        ops::peer_slots(to, n, want);
        ops::peer_slots(to.to(Device::kCUDA), n, got);
        const Tensor host = got.to(Device::kCPU);
        EXPECT_EQ(std::memcmp(host.raw(), want.raw(), want.nbytes()), 0) << what;
        // The last token for peer 0 takes its region's last place when every token goes there.
        if (fill == "all") {
          EXPECT_EQ(host.data<int32_t>()[(n - 1) * peers], n - 1) << what;
        }
      }
}

// The expert-parallel choices on the device against the host reference, bit for bit, outputs
// poisoned first: peer_choices, peer_counts and local_choices over 1, 2, 4 and 8 ranks, then the
// receiving rank's permutation with the other ranks' choices skipped (dense with the exact count
// and more rows than routed, padded to 128) and the row moves and sums over it. Routings:
// random, every token's first choice on one expert, and every choice on rank 0's experts (the
// other ranks route nothing).
TEST(GpuExpertChoices, MatchTheHostReference) {
  if (cuda::device_count() == 0) GTEST_FAIL() << "no GPU: run this test on the GPU machine";
  const uint64_t seed = fresh_seed();
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 gen(seed);
  const int64_t n = 3000, k = 8, experts = 128, width = 200;
  auto same = [](const Tensor& gpu_t, const Tensor& cpu_t, const std::string& what) {
    const Tensor host = gpu_t.to(Device::kCPU);
    ASSERT_EQ(host.nbytes(), cpu_t.nbytes()) << what;
    EXPECT_EQ(std::memcmp(host.raw(), cpu_t.raw(), cpu_t.nbytes()), 0) << what;
  };
  for (const std::string routing : {"random", "one_expert", "one_rank"}) {
    Tensor index = Tensor::empty({n, k}, DType::kI32);
    for (int64_t t = 0; t < n; ++t) {
      std::vector<int32_t> pool(experts);
      std::iota(pool.begin(), pool.end(), 0);
      std::shuffle(pool.begin(), pool.end(), gen);
      if (routing == "one_expert")
        std::swap(pool[0], pool[std::find(pool.begin(), pool.end(), 5) - pool.begin()]);
      if (routing == "one_rank") std::sort(pool.begin(), pool.end());  // experts 0..k-1
      for (int64_t j = 0; j < k; ++j) index.data<int32_t>()[t * k + j] = pool[j];
    }
    const Tensor gindex = index.to(Device::kCUDA);
    for (const int peers : {1, 2, 4, 8}) {
      const std::string what = routing + ", " + std::to_string(peers) + " ranks";
      const int64_t local = experts / peers;
      Tensor cp = Tensor::empty({n, peers}, DType::kI32);
      Tensor gp = Tensor::poisoned({n, peers}, DType::kI32, Device::kCUDA);
      ops::peer_choices(index, peers, local, cp);
      ops::peer_choices(gindex, peers, local, gp);
      same(gp, cp, what + ": peer choices");
      for (const int64_t region : {int64_t{0}, n}) {
        Tensor cslot = Tensor::empty({n, peers}, DType::kI32);
        Tensor gslot = Tensor::poisoned({n, peers}, DType::kI32, Device::kCUDA);
        ops::peer_slots(cp, region, cslot);
        ops::peer_slots(gp, region, gslot);
        same(gslot, cslot, what + ": peer slots, regions of " + std::to_string(region));
      }
      Tensor cc = Tensor::empty({peers, local + 1}, DType::kI64);
      Tensor gc = Tensor::poisoned({peers, local + 1}, DType::kI64, Device::kCUDA);
      ops::peer_counts(index, peers, local, cc);
      ops::peer_counts(gindex, peers, local, gc);
      same(gc, cc, what + ": peer counts");
      const int rank = peers - 1;
      Tensor cl = Tensor::empty({n, k}, DType::kI32);
      Tensor gl = Tensor::poisoned({n, k}, DType::kI32, Device::kCUDA);
      ops::local_choices(index, rank, local, cl);
      ops::local_choices(gindex, rank, local, gl);
      same(gl, cl, what + ": local choices");
      int64_t routed = 0;
      for (int64_t e = 0; e < local; ++e) routed += cc.data<int64_t>()[rank * (local + 1) + e];
      for (const auto& [align, rows] :
           {std::pair<int64_t, int64_t>{1, routed}, {1, routed + 77}, {128, routed}}) {
        const std::string w =
            what + ", align " + std::to_string(align) + ", " + std::to_string(rows) + " rows";
        ops::ExpertPermutation c, g;
        ops::make_expert_permutation(cl, local, c, align, rows);
        ops::make_expert_permutation(gl, local, g, align, rows);
        same(g.source_token, c.source_token, w + ": source tokens");
        same(g.row_of_choice, c.row_of_choice, w + ": rows of choices");
        same(g.expert_offsets, c.expert_offsets, w + ": offsets");
        if (align > 1) same(g.segments, c.segments, w + ": segments");
        // Moves are copies (bit for bit); the sums run in f32 over the same order.
        const Tensor x = testing::randn({n, width}, seed + 1, 1.0, DType::kF32);
        Tensor cx = Tensor::zeros({c.rows(), width}, DType::kF32);
        Tensor gx = Tensor::zeros({g.rows(), width}, DType::kF32, Device::kCUDA);
        ops::permute_rows(x, c, cx);
        ops::permute_rows(x.to(Device::kCUDA), g, gx);
        same(gx, cx, w + ": permute");
        Tensor cu = Tensor::empty({n, k, width}, DType::kF32);
        Tensor gu = Tensor::poisoned({n, k, width}, DType::kF32, Device::kCUDA);
        ops::unpermute_rows(cx, c, cu);
        ops::unpermute_rows(gx, g, gu);
        same(gu, cu, w + ": unpermute (zeros for the other ranks' choices)");
        Tensor cs = Tensor::empty({n, width}, DType::kF32);
        Tensor gs = Tensor::poisoned({n, width}, DType::kF32, Device::kCUDA);
        ops::combine_forward(cx, c, cs);
        ops::combine_forward(gx, g, gs);
        same(gs, cs, w + ": sum of each token's rows");
        const Tensor wt = testing::randn({n, k, 1}, seed + 2, 1.0, DType::kF32);
        Tensor cw = Tensor::zeros({c.rows(), 1}, DType::kF32);
        Tensor gw = Tensor::zeros({g.rows(), 1}, DType::kF32, Device::kCUDA);
        ops::unpermute_rows_backward(wt, c, cw);
        ops::unpermute_rows_backward(wt.to(Device::kCUDA), g, gw);
        same(gw, cw, w + ": weights into rows");
      }
    }
  }
}
#endif  // MOETRAIN_HAS_CUDA

}  // namespace
}  // namespace mt
