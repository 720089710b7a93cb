#include "core/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>

#include "core/error.h"

namespace mt {

namespace {

// All of [data, data + n) at `offset`; 0 or the errno of the failure.
int write_all(int fd, const char* data, size_t n, uint64_t offset) {
  while (n > 0) {
    const ssize_t w = ::pwrite(fd, data, n, static_cast<off_t>(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    data += w;
    offset += static_cast<uint64_t>(w);
    n -= static_cast<size_t>(w);
  }
  return 0;
}

constexpr size_t kDirectAlign = 4096;           // O_DIRECT's offsets, sizes and addresses
constexpr size_t kDirectBuffer = size_t{32} << 20;  // each of the two

}  // namespace

// append's state: two aligned buffers, the one being filled, and the other's write in flight.
struct AtomicFile::Direct {
  int fd = -1;  // the temporary opened again with O_DIRECT; -1: the filesystem refuses it
  std::unique_ptr<char, decltype(&std::free)> buffers{nullptr, &std::free};
  int filling = 0;
  size_t filled = 0;
  uint64_t offset = 0;          // the file offset of the filling buffer's first byte
  std::future<int> pending;     // the other buffer's write: 0 or its errno
  char* buffer(int i) const { return buffers.get() + static_cast<size_t>(i) * kDirectBuffer; }
};

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)), tmp_(path_ + ".tmp") {
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd_ < 0) throw IoError(fmt::format("cannot write '{}': {}", tmp_, std::strerror(errno)));
}

AtomicFile::~AtomicFile() {
  if (direct_ && direct_->pending.valid()) direct_->pending.wait();  // it writes our buffer
  if (direct_ && direct_->fd >= 0) ::close(direct_->fd);
  if (fd_ < 0) return;
  ::close(fd_);
  ::unlink(tmp_.c_str());
}

void AtomicFile::write_at(uint64_t offset, const void* data, size_t n) {
  MT_CHECK(fd_ >= 0, "write to '{}' after commit", path_);
  MT_CHECK(!direct_, "write_at and append mixed on '{}'", path_);
  if (const int err = write_all(fd_, static_cast<const char*>(data), n, offset))
    throw IoError(fmt::format("cannot write '{}': {}", tmp_, std::strerror(err)));
}

void AtomicFile::wait_pending() {
  if (!direct_->pending.valid()) return;
  if (const int err = direct_->pending.get())
    throw IoError(fmt::format("cannot write '{}': {}", tmp_, std::strerror(err)));
}

void AtomicFile::append(const void* data, size_t n) {
  MT_CHECK(fd_ >= 0, "write to '{}' after commit", path_);
  if (!direct_) {
    direct_ = std::make_unique<Direct>();
    direct_->buffers.reset(
        static_cast<char*>(std::aligned_alloc(kDirectAlign, 2 * kDirectBuffer)));
    if (!direct_->buffers) throw IoError(fmt::format("no memory to write '{}'", tmp_));
    direct_->fd = ::open(tmp_.c_str(), O_WRONLY | O_DIRECT);  // else through the page cache
  }
  Direct& d = *direct_;
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const size_t take = std::min(n, kDirectBuffer - d.filled);
    std::memcpy(d.buffer(d.filling) + d.filled, p, take);
    d.filled += take;
    p += take;
    n -= take;
    if (d.filled < kDirectBuffer) break;
    wait_pending();  // the other buffer is free again
    const int fd = d.fd >= 0 ? d.fd : fd_;
    d.pending = std::async(std::launch::async, write_all, fd, d.buffer(d.filling), kDirectBuffer,
                           d.offset);
    d.filling ^= 1;
    d.filled = 0;
    d.offset += kDirectBuffer;
  }
}

void AtomicFile::commit() {
  MT_CHECK(fd_ >= 0, "'{}' committed twice", path_);
  if (direct_) {  // the last buffer: its aligned part as the others, the rest through the cache
    Direct& d = *direct_;
    wait_pending();
    const size_t aligned = d.fd >= 0 ? d.filled / kDirectAlign * kDirectAlign : 0;
    int err = aligned > 0 ? write_all(d.fd, d.buffer(d.filling), aligned, d.offset) : 0;
    if (err == 0)
      err = write_all(fd_, d.buffer(d.filling) + aligned, d.filled - aligned, d.offset + aligned);
    if (err != 0) throw IoError(fmt::format("cannot write '{}': {}", tmp_, std::strerror(err)));
  }
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

std::optional<std::string> cannot_write_in(const std::string& dir, const std::string& name) {
  const std::filesystem::path probe = std::filesystem::path(dir) / name;
  std::ofstream out(probe);
  out << "moetrain";
  out.flush();
  if (!out) return std::strerror(errno);
  out.close();
  std::error_code ec;
  std::filesystem::remove(probe, ec);
  return std::nullopt;
}

void write_file_atomically(const std::string& path, const std::string& bytes) {
  AtomicFile f(path);
  f.write_at(0, bytes.data(), bytes.size());
  f.commit();
}

}  // namespace mt
