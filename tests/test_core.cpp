#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "core/atomic_file.h"
#include "core/dtype.h"
#include "core/profile.h"
#include "core/rng.h"
#include "core/tensor.h"
#include "processes.h"
#include "testing.h"
#if MOETRAIN_HAS_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda/device.h"
#include "core/cuda/graph.h"
#include "ops/elementwise.h"
#endif

namespace mt {

TEST(BF16, RoundsToNearestEven) {
  EXPECT_EQ(to_bf16(1.0f).bits, 0x3F80);
  // 1 + 2^-8 is exactly halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
  EXPECT_EQ(to_bf16(1.0f + std::ldexp(1.0f, -8)).bits, 0x3F80);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even): rounds up.
  EXPECT_EQ(to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)).bits, 0x3F82);
  // Just above halfway rounds up.
  EXPECT_EQ(to_bf16(std::bit_cast<float>(0x3F808001u)).bits, 0x3F81);
  EXPECT_EQ(from_bf16(to_bf16(-2.5f)), -2.5f);
  EXPECT_TRUE(std::isnan(from_bf16(to_bf16(NAN))));
  EXPECT_TRUE(std::isinf(from_bf16(to_bf16(INFINITY))));
}

// From f64 the value is rounded once: just above a tie, where a rounding to fp32 first would land
// on the tie and go to even; ties, exact values and the specials as from fp32; Tensor::set_item
// and to() round so too.
TEST(BF16, RoundsOnceFromF64) {
  const double above_tie = 1.0 + 0x1p-8 + 0x1p-30;  // fp32 would make it 1 + 2^-8 exactly
  EXPECT_EQ(to_bf16(static_cast<float>(above_tie)).bits, 0x3F80);
  EXPECT_EQ(to_bf16(above_tie).bits, 0x3F81);
  EXPECT_EQ(to_bf16(-above_tie).bits, 0xBF81);
  EXPECT_EQ(to_bf16(1.0 + 0x1p-8).bits, 0x3F80);  // a tie itself: even
  EXPECT_EQ(to_bf16(1.0 + 0x1p-8 - 0x1p-30).bits, 0x3F80);
  EXPECT_EQ(to_bf16(-2.5).bits, to_bf16(-2.5f).bits);
  EXPECT_TRUE(std::isnan(from_bf16(to_bf16(std::nan("")))));
  EXPECT_TRUE(std::isinf(from_bf16(to_bf16(1e300))));
  EXPECT_EQ(to_f16(1.0 + 0x1p-11 + 0x1p-40).bits, 0x3C01);  // fp32 first: 0x3C00
  EXPECT_EQ(to_f16(static_cast<float>(1.0 + 0x1p-11 + 0x1p-40)).bits, 0x3C00);
  Tensor t = Tensor::empty({2}, DType::kBF16);
  t.set_item(0, above_tie);
  t.set_item(1, -above_tie);
  EXPECT_EQ(t.data<bf16>()[0].bits, 0x3F81);
  EXPECT_EQ(t.data<bf16>()[1].bits, 0xBF81);
  Tensor f64 = Tensor::empty({1}, DType::kF64);
  f64.set_item(0, above_tie);
  EXPECT_EQ(f64.to(DType::kBF16).data<bf16>()[0].bits, 0x3F81);
}

TEST(F16, HandCheckedValues) {
  EXPECT_EQ(to_f16(1.0f).bits, 0x3C00);
  EXPECT_EQ(to_f16(-2.0f).bits, 0xC000);
  EXPECT_EQ(to_f16(65504.0f).bits, 0x7BFF);             // max finite
  EXPECT_EQ(to_f16(65519.0f).bits, 0x7BFF);             // below the halfway point to 2^16
  EXPECT_EQ(to_f16(65520.0f).bits, 0x7C00);             // halfway: ties to even, which is infinity
  EXPECT_EQ(to_f16(0x1p-24f).bits, 0x0001);             // least subnormal
  EXPECT_EQ(to_f16(0x1p-25f).bits, 0x0000);             // halfway to it: ties to even (zero)
  EXPECT_EQ(to_f16(0x1.8p-25f).bits, 0x0001);           // above halfway
  EXPECT_EQ(to_f16(0x1p-14f).bits, 0x0400);             // least normal
  EXPECT_EQ(to_f16(1.0f + 0x1p-11f).bits, 0x3C00);      // halfway 1 and 1 + 2^-10: even
  EXPECT_EQ(to_f16(1.0f + 3 * 0x1p-11f).bits, 0x3C02);  // halfway, odd below: up
  EXPECT_EQ(to_f16(2047.5f).bits, 0x6800);              // rounds up across the binade: 2048
  EXPECT_EQ(from_f16(f16{0x0001}), 0x1p-24f);
  EXPECT_EQ(from_f16(f16{0x7BFF}), 65504.0f);
  EXPECT_TRUE(std::isinf(from_f16(f16{0xFC00})) && from_f16(f16{0xFC00}) < 0);
  EXPECT_TRUE(std::isnan(from_f16(to_f16(NAN))));
}

TEST(F16, EveryValueRoundTripsAndEveryMidpointRoundsToEven) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const f16 h{static_cast<uint16_t>(b)};
    const float x = from_f16(h);
    if (std::isnan(x)) continue;
    ASSERT_EQ(to_f16(x).bits, h.bits) << std::hex << b;
    // The midpoint to the next value up in magnitude (finite, below the largest) goes to the
    // even one of the two.
    if ((b & 0x7FFF) >= 0x7BFF) continue;
    const float next = from_f16(f16{static_cast<uint16_t>(b + 1)});
    const double mid = (static_cast<double>(x) + next) / 2;
    ASSERT_EQ(static_cast<double>(static_cast<float>(mid)), mid);  // representable in fp32
    ASSERT_EQ(to_f16(static_cast<float>(mid)).bits, (b & 1) ? b + 1 : b) << std::hex << b;
  }
}

TEST(E4M3, HandCheckedValues) {
  EXPECT_EQ(to_e4m3(1.0f), 0x38);     // exponent 7 (bias 7), mantissa 0
  EXPECT_EQ(to_e4m3(448.0f), 0x7E);   // max finite
  EXPECT_EQ(to_e4m3(1000.0f), 0x7E);  // saturates
  EXPECT_EQ(to_e4m3(-1000.0f), 0xFE);
  EXPECT_EQ(to_e4m3(std::ldexp(1.0f, -9)), 0x01);  // smallest subnormal
  EXPECT_EQ(to_e4m3(std::ldexp(1.0f, -6)), 0x08);  // smallest normal
  EXPECT_EQ(to_e4m3(1.0625f), 0x38);               // halfway 1 and 1.125: ties to even (1.0)
  EXPECT_EQ(to_e4m3(1.1875f), 0x3A);               // halfway 1.125 and 1.25: ties to even (1.25)
  EXPECT_EQ(to_e4m3(0.0f), 0x00);
  EXPECT_TRUE(std::isnan(from_e4m3(to_e4m3(NAN))));
  EXPECT_EQ(from_e4m3(0x7E), 448.0f);
  EXPECT_EQ(from_e4m3(0x01), std::ldexp(1.0f, -9));
  // Every finite code round-trips.
  for (int c = 0; c < 256; ++c) {
    const float v = from_e4m3(static_cast<uint8_t>(c));
    if (std::isnan(v) || (c & 0x7F) == 0) continue;
    EXPECT_EQ(to_e4m3(v), c) << "code " << c;
  }
}

TEST(E8M0, Scales) {
  EXPECT_EQ(from_e8m0(127), 1.0f);
  EXPECT_EQ(from_e8m0(130), 8.0f);
  EXPECT_EQ(from_e8m0(0), std::ldexp(1.0f, -127));
  EXPECT_TRUE(std::isnan(from_e8m0(0xFF)));
}

TEST(Philox, KnownAnswer) {
  // Random123's known-answer vector for philox4x32-10 with zero counter and key.
  const Philox4x32 r = philox4x32_10(Philox4x32{{0, 0, 0, 0}}, 0, 0);
  EXPECT_EQ(r.v[0], 0x6627e8d5u);
  EXPECT_EQ(r.v[1], 0xe169c58du);
  EXPECT_EQ(r.v[2], 0xbc57ac4cu);
  EXPECT_EQ(r.v[3], 0x9b00dbd8u);
}

TEST(Philox, NormalMoments) {
  const CounterRng rng{42, 3};
  double s = 0, s2 = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    const double x = rng.normal(i);
    s += x;
    s2 += x * x;
  }
  EXPECT_NEAR(s / n, 0.0, 0.01);
  EXPECT_NEAR(s2 / n, 1.0, 0.01);
}

TEST(Tensor, ViewsShareStorageAndCheckBounds) {
  Tensor t = Tensor::zeros({4, 3}, DType::kF32);
  Tensor rows = t.slice_rows(1, 3);
  rows.fill_(2.0);
  EXPECT_EQ(t.item(2), 0.0);
  EXPECT_EQ(t.item(3), 2.0);
  EXPECT_EQ(t.item(8), 2.0);
  EXPECT_EQ(t.item(9), 0.0);
  EXPECT_THROW(t.view(10, {3}), Error);
  EXPECT_THROW(t.data<double>(), Error);
}

TEST(Tensor, TransposedShapeSwapsTheLastTwoDimensions) {
  EXPECT_EQ(transposed_shape({3, 5}), (Shape{5, 3}));
  EXPECT_EQ(transposed_shape({2, 3, 5}), (Shape{2, 5, 3}));
  EXPECT_NE(testing::error_of([] { transposed_shape({7}); }).find("transposing (7)"),
            std::string::npos);
}

TEST(Tensor, PoisonIsNotFinite) {
  EXPECT_FALSE(all_finite(Tensor::poisoned({5}, DType::kF32)));
  EXPECT_EQ(relative_error(Tensor::poisoned({3}, DType::kF64), Tensor::zeros({3}, DType::kF64)),
            INFINITY);
}

TEST(Tensor, MemoryStatsTrackPeak) {
  reset_peak_memory(Device::kCPU);
  const int64_t before = memory_stats(Device::kCPU).current_bytes;
  {
    Tensor t = Tensor::empty({1024}, DType::kF64);
    EXPECT_EQ(memory_stats(Device::kCPU).current_bytes, before + 8192);
  }
  EXPECT_EQ(memory_stats(Device::kCPU).current_bytes, before);
  EXPECT_GE(memory_stats(Device::kCPU).peak_bytes, before + 8192);
}

// The profiler (MOETRAIN_PROFILE=1): phases add up per name, in order of first use, and take()
// clears them. The variable is read once per process, so it is set before the first phase.
TEST(Profile, PhasesSumPerNameAndTakeClears) {
  setenv("MOETRAIN_PROFILE", "1", 1);
  ASSERT_TRUE(profile::enabled());
  int device_waits = 0;
  static int* waits = &device_waits;
  profile::set_device_sync([] { ++*waits; });
  for (int i = 0; i < 2; ++i) {
    const profile::Phase a("first");
    std::this_thread::sleep_for(std::chrono::milliseconds(3));
  }
  { const profile::Phase b("second"); }
  const auto phases = profile::take();
  ASSERT_EQ(phases.size(), 2u);
  EXPECT_EQ(phases[0].first, "first");
  EXPECT_GE(phases[0].second, 6.0);
  EXPECT_EQ(phases[1].first, "second");
  EXPECT_EQ(device_waits, 6);  // both ends of every phase
  EXPECT_TRUE(profile::take().empty());
  profile::set_device_sync(nullptr);
}

// Where memory peaks: a phase that ends with the probe's high-water mark above where it began is
// recorded with that mark, nested phases first; one that raised nothing is not; take_peaks()
// clears. Real CPU tensors move the mark (the trainer's probe for the CPU).
TEST(Profile, PhasesThatRaiseThePeakAreNamedInnermostFirst) {
  setenv("MOETRAIN_PROFILE", "1", 1);
  ASSERT_TRUE(profile::enabled());
  profile::set_peak_probe([] { return memory_stats(Device::kCPU).peak_bytes; });
  reset_peak_memory(Device::kCPU);
  const int64_t base = memory_stats(Device::kCPU).peak_bytes;
  {
    const profile::Phase outer("outer");
    { const profile::Phase quiet("quiet"); }  // allocates nothing: raises nothing
    const profile::Phase inner("inner");
    Tensor t = Tensor::empty({1 << 20}, DType::kF64);  // 8 MiB above the mark
  }
  const auto peaks = profile::take_peaks();
  ASSERT_EQ(peaks.size(), 2u);
  EXPECT_EQ(peaks[0].first, "inner");
  EXPECT_EQ(peaks[1].first, "outer");
  EXPECT_EQ(peaks[0].second, base + (int64_t{8} << 20));
  EXPECT_EQ(peaks[1].second, peaks[0].second);
  EXPECT_TRUE(profile::take_peaks().empty());
  (void)profile::take();
  profile::set_peak_probe(nullptr);
}

// Spans (always on): host spans add up per name on their thread; device spans keep their marks
// until take_spans() reads them through the device clock, which then gets every mark back.
TEST(Profile, SpansSumPerNameAndReadDeviceMarksOnTake) {
  for (int i = 0; i < 2; ++i) {
    const profile::Span s("host", false);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  auto host = profile::take_spans();
  ASSERT_EQ(host.size(), 1u);
  EXPECT_EQ(host[0].first, "host");
  EXPECT_GE(host[0].second, 4.0);
  EXPECT_TRUE(profile::take_spans().empty());

  // A fake device clock: marks are numbered, 1.5 ms between consecutive marks.
  static int next = 0, released = 0;
  profile::set_device_clock(
      {[]() -> void* { return reinterpret_cast<void*>(static_cast<intptr_t>(++next)); },
       [](void* a, void* b) {
         return 1.5 *
                static_cast<double>(reinterpret_cast<intptr_t>(b) - reinterpret_cast<intptr_t>(a));
       },
       [](void*) { ++released; }});
  { const profile::Span a("ep.dispatch", true); }
  {
    const profile::Span b("ep.combine", true);
    const profile::Span c("ep.dispatch", true);  // nested: marks 3 .. 6 and 4 .. 5
  }
  EXPECT_EQ(released, 0);  // nothing read before take
  const auto device = profile::take_spans();
  ASSERT_EQ(device.size(), 2u);
  EXPECT_EQ(device[0].first, "ep.dispatch");
  EXPECT_DOUBLE_EQ(device[0].second, 1.5 + 1.5);  // marks 1..2 and 4..5
  EXPECT_EQ(device[1].first, "ep.combine");
  EXPECT_DOUBLE_EQ(device[1].second, 4.5);  // marks 3..6
  EXPECT_EQ(released, 6);
  profile::set_device_clock({});
}

// append: pieces of every size (empty, a few bytes, across the 32 MiB buffers and their 4 KiB
// alignment, a tail of 5 bytes) come back byte for byte; nothing is at the path before commit,
// and an uncommitted file leaves neither the path nor its temporary behind.
TEST(AtomicFile, AppendedPiecesReadBackExactly) {
  const std::string path = testing::unique_temp_path("append.bin");
  std::vector<char> want;
  {
    AtomicFile f(path);
    const CounterRng rng{3, 1};
    const std::vector<size_t> sizes = {
        0, 7, 4089, (size_t{32} << 20) - 4096, 1 << 20, 4096, (size_t{40} << 20) + 3, 12345, 5};
    uint64_t k = 0;
    for (const size_t n : sizes) {
      std::vector<char> piece(n);
      for (char& c : piece) c = static_cast<char>(rng.u32(k++));
      f.append(piece.data(), piece.size());
      want.insert(want.end(), piece.begin(), piece.end());
    }
    EXPECT_FALSE(std::filesystem::exists(path));
    f.commit();
  }
  std::ifstream in(path, std::ios::binary);
  const std::vector<char> got((std::istreambuf_iterator<char>(in)), {});
  ASSERT_EQ(got.size(), want.size());
  EXPECT_TRUE(got == want);
  std::filesystem::remove(path);
  {
    AtomicFile f(path);
    const std::vector<char> piece(size_t{33} << 20, 'x');
    f.append(piece.data(), piece.size());
  }
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
}

#if MOETRAIN_HAS_CUDA
// Tensors on the GPU (ctest label `gpu`): the caching allocator, its peak and its out-of-memory
// path.
TEST(GpuTensor, RoundTripZeroFillAndPeakMemory) {
  if (cuda::device_count() == 0) GTEST_FAIL() << "no GPU";
  const Tensor host = testing::randn({1000, 3}, 5, 1.0, DType::kF32);
  Tensor dev = host.to(Device::kCUDA);
  EXPECT_EQ(relative_error(dev, host), 0.0);
  dev.zero_();
  EXPECT_EQ(dev.to(Device::kCPU).item(2999), 0.0);
  dev.fill_(2.5);
  EXPECT_EQ(dev.item(1234), 2.5);
  reset_peak_memory(Device::kCUDA);
  const int64_t before = memory_stats(Device::kCUDA).current_bytes;
  { Tensor big = Tensor::empty({1 << 20}, DType::kF32, Device::kCUDA); }
  EXPECT_EQ(memory_stats(Device::kCUDA).current_bytes, before);
  EXPECT_GE(memory_stats(Device::kCUDA).peak_bytes, before + (4 << 20));
}

// An allocation the GPU cannot hold: exit code 6 and a message with the sizes and the settings
// that need less; the allocator stays usable.
TEST(GpuTensor, OutOfMemoryNamesTheSizesAndTheSettings) {
  if (cuda::device_count() == 0) GTEST_FAIL() << "no GPU";
  const int64_t too_many = int64_t{1} << 40;  // 4 TiB of f32
  try {
    Tensor huge = Tensor::empty({too_many}, DType::kF32, Device::kCUDA);
    ADD_FAILURE() << "4 TiB were allocated";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ExitCode::kOutOfMemory);
    const std::string m = e.what();
    for (const char* part :
         {"out of GPU memory", "4096.00 GiB more", "model.checkpoint", "hardware.cuda_graphs"})
      EXPECT_NE(m.find(part), std::string::npos) << part << " not in: " << m;
  }
  Tensor small = Tensor::empty({1024}, DType::kF32, Device::kCUDA);
  small.fill_(1.0);
  EXPECT_EQ(small.item(1023), 1.0);
}

// Out of memory outside a capture, the graph pool's free blocks go back to the driver: an
// allocation that fits only without them succeeds, the pool's generation moves on, and captured
// work is captured again instead of replaying into memory it no longer owns.
TEST(GpuTensor, OutOfMemoryReleasesTheGraphPoolAndWorkIsCapturedAgain) {
  if (cuda::device_count() == 0) GTEST_FAIL() << "no GPU";
  Tensor out = Tensor::zeros({1024}, DType::kF32, Device::kCUDA);
  Tensor ones = Tensor::empty({1024}, DType::kF32, Device::kCUDA);
  ones.fill_(1.0);
  auto body = [&] {  // device work only (capturable), through a graph-pool block
    Tensor t = Tensor::empty({1024}, DType::kF32, Device::kCUDA);
    t.copy_from(ones);
    ops::scale_(t, 3.0);
    out.copy_from(t);
  };
  cuda::CapturedWork work;
  EXPECT_FALSE(work.run(body, "the test's work"));  // eager: warms up
  EXPECT_TRUE(work.run(body, "the test's work"));   // captured, replayed
  // Nearly all free memory into the graph pool, then back into its cache.
  const int64_t chunk = int64_t{1} << 30;
  int64_t held = 0;
  {
    const GraphPoolScope pool;
    std::vector<Tensor> blocks;
    for (;;) {
      size_t free_bytes = 0, total_bytes = 0;
      ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);
      if (free_bytes < static_cast<size_t>(2 * chunk)) break;
      blocks.push_back(Tensor::empty({chunk}, DType::kU8, Device::kCUDA));
      held += chunk;
    }
  }
  ASSERT_GT(held, 8 * chunk);
  const int64_t generation = graph_pool_generation();
  {
    Tensor big = Tensor::empty({held}, DType::kU8, Device::kCUDA);  // fits only without them
    EXPECT_TRUE(big.defined());
  }
  EXPECT_EQ(graph_pool_generation(), generation + 1);
  out.zero_();
  EXPECT_FALSE(work.run(body, "the test's work"));  // stale: eager again
  EXPECT_EQ(out.item(1023), 3.0);
  EXPECT_TRUE(work.run(body, "the test's work"));  // captured again
  out.zero_();
  EXPECT_TRUE(work.run(body, "the test's work"));
  EXPECT_EQ(out.to(Device::kCPU).item(5), 3.0);
}
#endif  // MOETRAIN_HAS_CUDA

}  // namespace mt
