#include "core/mapped_file.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "core/error.h"

namespace mt {

namespace {
// The mapped regions and the line to print when a read in one faults (SIGBUS: the file shrank
// under the mapping). Written before the handler can see an entry (count_ last), never freed:
// a handler may only read memory that stays.
struct FaultRegion {
  const uint8_t* begin = nullptr;
  const uint8_t* end = nullptr;
  char message[512] = {};
  size_t length = 0;
};
constexpr int kMaxRegions = 64;
FaultRegion g_regions[kMaxRegions];
std::atomic<int> g_region_count{0};

void on_sigbus(int sig, siginfo_t* info, void*) {
  const auto* at = static_cast<const uint8_t*>(info->si_addr);
  const int n = g_region_count.load(std::memory_order_acquire);
  for (int i = 0; i < n; ++i)
    if (at >= g_regions[i].begin && at < g_regions[i].end) {
      (void)!::write(STDERR_FILENO, g_regions[i].message, g_regions[i].length);
      ::_exit(static_cast<int>(ExitCode::kData));
    }
  ::signal(sig, SIG_DFL);  // not a mapped file's fault: the default (a crash, with its core)
  ::raise(sig);
}

void register_region(const void* map, size_t size, const std::string& path) {
  const int i = g_region_count.load();
  if (i >= kMaxRegions) return;  // past the table: such a fault stays a signal
  FaultRegion& r = g_regions[i];
  r.begin = static_cast<const uint8_t*>(map);
  r.end = r.begin + size;
  const std::string line = fmt::format(
      "moetrain: data: '{}' shrank or changed while it was read (a read past its end); exit 3\n",
      path.substr(0, 300));
  r.length = std::min(line.size(), sizeof(r.message));
  std::memcpy(r.message, line.data(), r.length);
  g_region_count.store(i + 1, std::memory_order_release);
}
}  // namespace

void install_mapped_file_fault_handler() {
  struct sigaction sa {};
  sa.sa_sigaction = on_sigbus;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_SIGINFO;
  ::sigaction(SIGBUS, &sa, nullptr);
}

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
  if (map_) register_region(map_, size_, path);
  return true;
}

void MappedFile::release_pages() const {
  if (map_) ::madvise(map_, size_, MADV_DONTNEED);
}

MappedFile::~MappedFile() {
  if (map_) ::munmap(map_, size_);
}

}  // namespace mt
