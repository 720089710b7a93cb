#include "core/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "core/error.h"

namespace mt {

bool MappedFile::open(const std::string& path, std::string* why) {
  MT_CHECK(map_ == nullptr && size_ == 0, "'{}' mapped into a MappedFile already in use", path);
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    *why = "it does not exist";
    return false;
  }
  if (!std::filesystem::is_regular_file(path, ec)) {
    *why = "it is not a regular file";
    return false;
  }
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) {
    *why = std::strerror(errno);
    return false;
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    *why = std::strerror(errno);
    ::close(fd);
    return false;
  }
  const size_t size = static_cast<size_t>(st.st_size);
  void* map = size > 0 ? ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0) : nullptr;
  const int map_errno = errno;
  ::close(fd);
  if (map == MAP_FAILED) {
    *why = std::string("cannot map it: ") + std::strerror(map_errno);
    return false;
  }
  map_ = map;
  size_ = size;
  return true;
}

void MappedFile::release_pages() const {
  if (map_) ::madvise(map_, size_, MADV_DONTNEED);
}

MappedFile::~MappedFile() {
  if (map_) ::munmap(map_, size_);
}

}  // namespace mt
