// A whole file mapped read-only: its pages are read from disk when touched and can be dropped
// again, so a reader of a file larger than its memory holds only what it is using. Safetensors
// checkpoints and token files are read through it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace mt {

// A read of a mapped file that the file no longer covers (truncated while mapped) raises SIGBUS;
// with this handler installed such a fault prints one line naming the file and exits 3
// (ExitCode::kData) instead of dying by the signal. Other SIGBUS faults keep their default.
void install_mapped_file_fault_handler();

class MappedFile {
 public:
  MappedFile() = default;
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  // Maps `path`. False, with the reason in *why ("it does not exist", "it is not a regular file",
  // or the system's), when it cannot; an empty file maps to no bytes.
  bool open(const std::string& path, std::string* why);
  const uint8_t* data() const { return static_cast<const uint8_t*>(map_); }
  size_t size() const { return size_; }
  // Drops the pages read so far from this process (they stay in the page cache and are read
  // again if touched).
  void release_pages() const;

 private:
  void* map_ = nullptr;
  size_t size_ = 0;
};

}  // namespace mt
