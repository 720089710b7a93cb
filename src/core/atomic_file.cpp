#include "core/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "core/error.h"

namespace mt {

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)), tmp_(path_ + ".tmp") {
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd_ < 0) throw IoError(fmt::format("cannot write '{}': {}", tmp_, std::strerror(errno)));
}

AtomicFile::~AtomicFile() {
  if (fd_ < 0) return;
  ::close(fd_);
  ::unlink(tmp_.c_str());
}

void AtomicFile::write_at(uint64_t offset, const void* data, size_t n) {
  MT_CHECK(fd_ >= 0, "write to '{}' after commit", path_);
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::pwrite(fd_, p, n, static_cast<off_t>(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      throw IoError(fmt::format("cannot write '{}': {}", tmp_, std::strerror(errno)));
    }
    p += w;
    offset += static_cast<uint64_t>(w);
    n -= static_cast<size_t>(w);
  }
}

void AtomicFile::commit() {
  MT_CHECK(fd_ >= 0, "'{}' committed twice", path_);
  const int fd = fd_;
  fd_ = -1;
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp_.c_str());
    throw IoError(fmt::format("cannot flush '{}': {}", tmp_, std::strerror(err)));
  }
  if (std::rename(tmp_.c_str(), path_.c_str()) != 0)
    throw IoError(fmt::format("cannot rename '{}' to '{}': {}", tmp_, path_, std::strerror(errno)));
}

void write_file_atomically(const std::string& path, const std::string& bytes) {
  AtomicFile f(path);
  f.write_at(0, bytes.data(), bytes.size());
  f.commit();
}

}  // namespace mt
