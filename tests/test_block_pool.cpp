// The GPU caching allocator's pool (core/block_pool.h) over a fake backend with a fixed capacity:
// best fit, splitting, merging, small segments, what it returns, and a random sequence that never
// hands out overlapping memory.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <random>
#include <vector>

#include "core/block_pool.h"
#include "core/error.h"

namespace mt {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

// Segments at fresh addresses (never touched: the pool only does arithmetic on them), refused
// past `capacity` bytes held at once.
struct FakeDevice {
  explicit FakeDevice(size_t capacity) : capacity(capacity) {}
  size_t capacity, held = 0;
  int64_t allocations = 0;
  uintptr_t next = uintptr_t{1} << 40;
  std::map<void*, size_t> live;
  BlockPool::Backend backend() {
    return {[this](size_t bytes) -> void* {
              if (held + bytes > capacity) return nullptr;
              void* p = reinterpret_cast<void*>(next);
              next += bytes + 4096;  // segments apart, as the driver's are
              held += bytes;
              ++allocations;
              live[p] = bytes;
              return p;
            },
            [this](void* p) {
              held -= live.at(p);
              live.erase(p);
            }};
  }
};

TEST(BlockPool, ReusesFreedMemoryForOtherSizesBySplittingAndMerging) {
  FakeDevice dev(64 * kMiB);
  BlockPool pool(dev.backend());
  void* a = pool.allocate(6 * kMiB);  // one 6 MiB segment
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(pool.reserved_bytes(), 6 * kMiB);
  pool.release(a);
  // Another phase asks for 4 and 2 MiB: both cut from the freed segment, no new one.
  void* b = pool.allocate(4 * kMiB);
  void* c = pool.allocate(2 * kMiB);
  ASSERT_NE(b, nullptr);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(dev.allocations, 1);
  EXPECT_EQ(b, a);  // best fit from the segment's start
  EXPECT_EQ(static_cast<char*>(c), static_cast<char*>(a) + 4 * kMiB);
  // Freed in either order, the two merge back into the whole segment, which is returned.
  pool.release(c);
  pool.release(b);
  EXPECT_EQ(pool.release_free_segments(), 6 * kMiB);
  EXPECT_EQ(dev.held, 0u);
  EXPECT_EQ(pool.reserved_bytes(), 0u);
}

TEST(BlockPool, MergesWithBothNeighboursAndKeepsSegmentsApart) {
  FakeDevice dev(64 * kMiB);
  BlockPool pool(dev.backend());
  void* x = pool.allocate(3 * kMiB);  // a 4 MiB segment: 3 used, 1 free
  void* y = pool.allocate(1 * kMiB);  // the free MiB
  EXPECT_EQ(dev.allocations, 1);
  void* z = pool.allocate(4 * kMiB);  // a second segment
  EXPECT_EQ(dev.allocations, 2);
  pool.release(x);
  EXPECT_EQ(pool.release_free_segments(), 0u);  // the first segment is still half in use
  pool.release(y);  // merges with x's block: the first segment whole again
  // Both segments wholly free now (8 MiB), returned whole.
  pool.release(z);
  EXPECT_EQ(pool.release_free_segments(), 8 * kMiB);
  EXPECT_EQ(dev.held, 0u);
}

TEST(BlockPool, SmallRequestsShareSmallSegments) {
  FakeDevice dev(64 * kMiB);
  BlockPool pool(dev.backend());
  std::vector<void*> small;
  for (int i = 0; i < 150; ++i) small.push_back(pool.allocate(10000));  // rounded to 10240
  EXPECT_EQ(dev.allocations, 1);  // 150 x 10 KiB in one 2 MiB segment
  void* large = pool.allocate(3 * kMiB);
  EXPECT_EQ(dev.allocations, 2);  // never cut from the small segment
  for (void* p : small) pool.release(p);
  pool.release(large);
  EXPECT_EQ(pool.release_free_segments(), 2 * kMiB + 4 * kMiB);
}

TEST(BlockPool, RefusesWhatTheBackendCannotHoldAndServesItOnceFreed) {
  FakeDevice dev(8 * kMiB);
  BlockPool pool(dev.backend());
  void* a = pool.allocate(6 * kMiB);
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(pool.allocate(4 * kMiB), nullptr);  // 6 + 4 > 8, nothing free to cut
  pool.release(a);
  void* b = pool.allocate(4 * kMiB);  // cut from the freed 6 MiB
  EXPECT_NE(b, nullptr);
  EXPECT_EQ(dev.allocations, 1);
  pool.release(b);
}

TEST(BlockPool, RefusesAReleaseOfWhatItDidNotHandOut) {
  FakeDevice dev(64 * kMiB);
  BlockPool pool(dev.backend());
  void* a = pool.allocate(3 * kMiB);
  pool.release(a);
  EXPECT_THROW(pool.release(a), Error);  // twice
  int local = 0;
  EXPECT_THROW(pool.release(&local), Error);
}

TEST(BlockPool, RandomSequencesNeverOverlapAndReturnEverything) {
  FakeDevice dev(size_t{1} << 34);
  BlockPool pool(dev.backend());
  std::mt19937_64 rng(5);
  std::map<uintptr_t, size_t> live;  // start -> requested bytes
  auto check_no_overlap = [&] {
    uintptr_t end = 0;
    for (const auto& [start, bytes] : live) {
      ASSERT_GE(start, end) << "two live blocks overlap";
      end = start + bytes;
    }
  };
  for (int i = 0; i < 20000; ++i) {
    if (live.empty() || (live.size() < 400 && rng() % 2 == 0)) {
      const size_t bytes = rng() % 4 == 0 ? 1 + rng() % 100000 : 1 + rng() % (12 * kMiB);
      void* p = pool.allocate(bytes);
      ASSERT_NE(p, nullptr);
      live[reinterpret_cast<uintptr_t>(p)] = bytes;
    } else {
      auto it = live.begin();
      std::advance(it, static_cast<long>(rng() % live.size()));
      pool.release(reinterpret_cast<void*>(it->first));
      live.erase(it);
    }
    if (i % 500 == 0) check_no_overlap();
  }
  check_no_overlap();
  for (const auto& [start, bytes] : live) pool.release(reinterpret_cast<void*>(start));
  const size_t reserved = pool.reserved_bytes();
  EXPECT_EQ(pool.release_free_segments(), reserved);
  EXPECT_EQ(dev.held, 0u);
}

}  // namespace
}  // namespace mt
