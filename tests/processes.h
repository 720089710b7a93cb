// Test helpers for whole runs of the moetrain binary: run a command, read a metrics file.
#pragma once
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace mt::testing {

struct Proc {
  int code;
  std::string output;  // stdout and stderr together
};

// The moetrain binary and the source tree: MOETRAIN_BIN and MOETRAIN_SOURCE_DIR in the
// environment (the GPU machine's bundle and its copy of the repository), else the build's own.
inline std::string moetrain_binary() {
  const char* env = std::getenv("MOETRAIN_BIN");
  return env ? env : MOETRAIN_BINARY;
}
inline std::string source_dir() {
  const char* env = std::getenv("MOETRAIN_SOURCE_DIR");
  return env ? env : MOETRAIN_SOURCE_DIR;
}

// A temporary file name of this process's own: ctest runs tests of the same binary as
// concurrent processes, which must not share output files.
inline std::string unique_temp_path(const std::string& stem) {
  static std::atomic<int> counter{0};
  return (std::filesystem::temp_directory_path() /
          ("mt_" + std::to_string(getpid()) + "_" + std::to_string(counter++) + "_" + stem))
      .string();
}

// The whole text of a file (empty when it does not exist).
inline std::string read_file(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

inline Proc run_cmd(const std::string& cmd) {
  const std::string out = unique_temp_path("cmd_out.txt");
  const int status = std::system((cmd + " >" + out + " 2>&1").c_str());
  Proc p{WIFEXITED(status) ? WEXITSTATUS(status) : -1, read_file(out)};
  std::filesystem::remove(out);
  return p;
}

// The children of a process, and whether one has ended (or is a zombie).
inline std::vector<pid_t> children_of(pid_t parent) {
  std::vector<pid_t> out;
  std::ifstream in("/proc/" + std::to_string(parent) + "/task/" + std::to_string(parent) +
                   "/children");
  for (pid_t p; in >> p;) out.push_back(p);
  return out;
}
inline bool gone(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string pid_field, comm, state;
  if (!(stat >> pid_field >> comm >> state)) return true;
  return state == "Z" || state == "X";
}

// `cmd` started through the shell (exec'd, so the pid is the command's), output to `log`.
inline pid_t spawn(const std::string& cmd, const std::string& log) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    const std::string line = "exec " + cmd + " >" + log + " 2>&1";
    ::execl("/bin/sh", "sh", "-c", line.c_str(), static_cast<char*>(nullptr));
    std::_Exit(127);
  }
  return pid;
}

// The exit code of a process this one started (128 + the signal that killed it).
inline int wait_code(pid_t pid) {
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// A TCP port free on this machine now (for ranks started by hand, as torchrun would).
inline int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

// One value per step from a --metrics file (JSON lines).
inline std::vector<double> metric(const std::string& metrics_path, const char* key) {
  std::ifstream in(metrics_path);
  std::vector<double> values;
  std::string line;
  while (std::getline(in, line))
    values.push_back(nlohmann::json::parse(line).at(key).get<double>());
  return values;
}

}  // namespace mt::testing
