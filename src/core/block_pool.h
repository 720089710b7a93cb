// A caching pool of device memory with best-fit reuse, block splitting and coalescing (the
// design of PyTorch's CUDA caching allocator, written for our allocator: core/tensor.cpp). The
// pool takes segments from a backend (cudaMalloc on the GPU; any function in the tests) and hands
// out blocks cut from them: a request takes the smallest free block that holds it, the rest of
// that block stays free, and a freed block merges with its free neighbours. So a step whose
// phases ask for different sizes (activations forward, gradients backward) reuses the same
// memory instead of returning it to the driver and asking again, which near the memory limit
// would flush the cache every step.
//
// Requests under 1 MiB are cut from 2 MiB segments of their own (small blocks do not fragment
// the large ones); larger ones from segments of their size rounded up to 2 MiB. Not thread-safe:
// the caller locks.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <utility>

namespace mt {

class BlockPool {
 public:
  // allocate returns null when the backend has no room; release returns a segment to it.
  struct Backend {
    std::function<void*(size_t)> allocate;
    std::function<void(void*)> release;
  };
  explicit BlockPool(Backend backend) : backend_(std::move(backend)) {}
  ~BlockPool();
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  // A block of at least `bytes` (rounded up to 512), or null when no free block holds it and the
  // backend refuses a new segment (the caller may release_free_segments, of this or another
  // pool, and try again).
  void* allocate(size_t bytes);
  // Returns a block allocate handed out; it merges with its segment's free neighbours.
  void release(void* p);
  // Returns every wholly free segment to the backend; the bytes returned.
  size_t release_free_segments();

  size_t reserved_bytes() const { return reserved_; }  // held from the backend
  int64_t backend_allocations() const { return backend_allocations_; }

  static constexpr size_t kRound = 512;
  static constexpr size_t kSmall = size_t{1} << 20;         // requests below: small segments
  static constexpr size_t kSmallSegment = size_t{2} << 20;  // a small segment's size
  static constexpr size_t kLargeRound = size_t{2} << 20;    // large segments' rounding

 private:
  struct Block {
    uintptr_t segment;  // its segment's start
    size_t size;
    bool free;
    bool small;  // cut from a small segment
  };
  using FreeKey = std::pair<size_t, uintptr_t>;  // (size, address): best fit, then lowest
  std::set<FreeKey>& free_set(bool small) { return small ? free_small_ : free_large_; }
  void insert_free(uintptr_t at, const Block& b);

  Backend backend_;
  std::map<uintptr_t, Block> blocks_;  // every block by address, in use or free
  std::set<FreeKey> free_small_, free_large_;
  std::map<uintptr_t, size_t> segments_;  // start -> size
  size_t reserved_ = 0;
  int64_t backend_allocations_ = 0;
};

}  // namespace mt
