#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

namespace mt {

// A file written under path.tmp and renamed over `path` only by commit() (after fsync): a reader
// sees the old file or the whole new one, never a torn one. Destroyed uncommitted, the temporary
// is removed. Errors are CheckpointErrors naming the file.
class AtomicFile {
 public:
  explicit AtomicFile(std::string path);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  // Writes `n` bytes at byte `offset` (any order; gaps read as zeros), through the page cache.
  void write_at(uint64_t offset, const void* data, size_t n);
  // Appends `n` bytes after those appended before (the first at offset 0): the way for large
  // files, written from page-aligned buffers with O_DIRECT where the filesystem allows it, two of
  // them, so that filling one overlaps the disk's write of the other. (Through the page cache a
  // process holding tens of GB writes at a third of the disk's rate: the copy and the kernel's
  // dirty-page throttling; docs/reliability.md.) Not mixed with write_at.
  void append(const void* data, size_t n);
  void commit();
  const std::string& path() const { return path_; }

 private:
  struct Direct;
  void wait_pending();
  std::string path_, tmp_;
  int fd_ = -1;
  std::unique_ptr<Direct> direct_;  // append's buffers, made by its first call
};

// Whether a file can be written in `dir` (the probe `name`, removed again): the system's reason
// when it cannot, nullopt when it can. For output paths checked before the work that fills them.
std::optional<std::string> cannot_write_in(const std::string& dir, const std::string& name);

// The whole file in one AtomicFile.
void write_file_atomically(const std::string& path, const std::string& bytes);

}  // namespace mt
