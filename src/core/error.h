// Errors: one exception type per kind of bad input, each mapped to a process exit code, and
// MT_CHECK for internal invariants (always on, release builds included).
#pragma once
#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace mt {

// Exit codes mean something (STYLE.md): scripts can tell a typo from a crash.
enum class ExitCode : int {
  kOk = 0,
  kInternal = 1,     // a bug: an MT_CHECK failed
  kConfig = 2,       // unknown key, wrong type, impossible shape, bad command line
  kData = 3,         // truncated or corrupt data file
  kCheckpoint = 4,   // missing, corrupt or mismatched checkpoint
  kNumerical = 5,    // NaN/Inf in the loss or gradients
  kOutOfMemory = 6,  // the GPU cannot hold what the config asks for
  kStopped = 7,      // stopped by a signal at a step boundary (train/stop_request.h)
  kIo = 8,           // a write failed (a full disk, a path gone): the last good checkpoint stays
};

class Error : public std::runtime_error {
 public:
  Error(ExitCode code, const std::string& msg) : std::runtime_error(msg), code_(code) {}
  ExitCode code() const { return code_; }

 private:
  ExitCode code_;
};

struct ConfigError : Error {
  explicit ConfigError(const std::string& m) : Error(ExitCode::kConfig, m) {}
};
struct DataError : Error {
  explicit DataError(const std::string& m) : Error(ExitCode::kData, m) {}
};
struct CheckpointError : Error {
  explicit CheckpointError(const std::string& m) : Error(ExitCode::kCheckpoint, m) {}
};
struct NumericalError : Error {
  explicit NumericalError(const std::string& m) : Error(ExitCode::kNumerical, m) {}
};
struct IoError : Error {
  explicit IoError(const std::string& m) : Error(ExitCode::kIo, m) {}
};
// Not a failure: the run stopped where it was asked to, its state saved (the message says where).
struct StoppedBySignal : Error {
  explicit StoppedBySignal(const std::string& m) : Error(ExitCode::kStopped, m) {}
};

// The host waited for the GPU inside a CUDA graph capture (a bug: a graphed pass must never
// wait for the host); the message names the copy and the phase it happened in.
struct HostSyncInCapture : Error {
  explicit HostSyncInCapture(const std::string& m) : Error(ExitCode::kInternal, m) {}
};

[[noreturn]] void check_failed(const char* expr, const char* file, int line,
                               const std::string& msg);

}  // namespace mt

// Internal invariant; the message may use fmt syntax.
#define MT_CHECK(cond, ...)                                                               \
  do {                                                                                    \
    if (!(cond)) ::mt::check_failed(#cond, __FILE__, __LINE__, fmt::format(__VA_ARGS__)); \
  } while (0)
