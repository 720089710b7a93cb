#include "core/block_pool.h"

#include <iterator>

#include "core/error.h"

namespace mt {

namespace {
size_t round_up(size_t n, size_t unit) {
  return (n + unit - 1) / unit * unit;
}
}  // namespace

BlockPool::~BlockPool() {
  for (const auto& [start, size] : segments_) backend_.release(reinterpret_cast<void*>(start));
}

void BlockPool::insert_free(uintptr_t at, const Block& b) {
  blocks_[at] = b;
  free_set(b.small).insert({b.size, at});
}

void* BlockPool::allocate(size_t bytes) {
  const size_t size = round_up(bytes == 0 ? 1 : bytes, kRound);
  const bool small = size < kSmall;
  std::set<FreeKey>& free = free_set(small);
  auto it = free.lower_bound({size, 0});
  if (it == free.end()) {  // a new segment
    const size_t segment = small ? kSmallSegment : round_up(size, kLargeRound);
    void* p = backend_.allocate(segment);
    if (p == nullptr) return nullptr;
    ++backend_allocations_;
    reserved_ += segment;
    const auto start = reinterpret_cast<uintptr_t>(p);
    segments_[start] = segment;
    insert_free(start, {start, segment, true, small});
    it = free.find({segment, start});
  }
  const uintptr_t at = it->second;
  free.erase(it);
  Block& b = blocks_.at(at);
  // Split off the rest when it can serve another request of the pool's kind.
  if (b.size - size >= (small ? kRound : kSmall)) {
    insert_free(at + size, {b.segment, b.size - size, true, small});
    b.size = size;
  }
  b.free = false;
  return reinterpret_cast<void*>(at);
}

void BlockPool::release(void* p) {
  auto it = blocks_.find(reinterpret_cast<uintptr_t>(p));
  MT_CHECK(it != blocks_.end() && !it->second.free,
           "BlockPool::release of {} that the pool did not hand out, or released twice", p);
  Block b = it->second;
  b.free = true;
  uintptr_t at = it->first;
  // Merge with the next block, then the previous one, where free and of the same segment.
  auto next = std::next(it);
  if (next != blocks_.end() && next->second.free && next->second.segment == b.segment) {
    free_set(b.small).erase({next->second.size, next->first});
    b.size += next->second.size;
    blocks_.erase(next);
  }
  if (it != blocks_.begin()) {
    auto prev = std::prev(it);
    if (prev->second.free && prev->second.segment == b.segment) {
      free_set(b.small).erase({prev->second.size, prev->first});
      b.size += prev->second.size;
      at = prev->first;
      blocks_.erase(it);
      it = prev;
    }
  }
  blocks_.erase(it);
  insert_free(at, b);
}

size_t BlockPool::release_free_segments() {
  size_t returned = 0;
  for (auto s = segments_.begin(); s != segments_.end();) {
    auto b = blocks_.find(s->first);
    if (b != blocks_.end() && b->second.free && b->second.size == s->second) {
      free_set(b->second.small).erase({b->second.size, b->first});
      blocks_.erase(b);
      backend_.release(reinterpret_cast<void*>(s->first));
      reserved_ -= s->second;
      returned += s->second;
      s = segments_.erase(s);
    } else {
      ++s;
    }
  }
  return returned;
}

}  // namespace mt
