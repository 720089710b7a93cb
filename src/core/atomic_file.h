#pragma once
#include <cstdint>
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
  // Writes `n` bytes at byte `offset` (any order; gaps read as zeros).
  void write_at(uint64_t offset, const void* data, size_t n);
  void commit();
  const std::string& path() const { return path_; }

 private:
  std::string path_, tmp_;
  int fd_ = -1;
};

// The whole file in one AtomicFile.
void write_file_atomically(const std::string& path, const std::string& bytes);

}  // namespace mt
