#include "core/log.h"

#include <cstdio>
#include <mutex>

namespace mt::log {

namespace {
struct Logger {
  Level level = Level::kInfo;
  int rank = 0;
  std::mutex mu;
};
Logger& logger() {
  static Logger l;
  return l;
}
}  // namespace

void set_level(Level l) {
  logger().level = l;
}
void set_rank(int rank) {
  logger().rank = rank;
}

void write(Level l, const std::string& msg) {
  Logger& g = logger();
  if (l < g.level) return;
  static const char* kNames[] = {"debug", "info", "warn", "error"};
  std::lock_guard<std::mutex> lock(g.mu);
  // Errors go to stderr so that `2>` captures exactly the one-line diagnosis.
  std::FILE* out = l >= Level::kWarn ? stderr : stdout;
  std::fprintf(out, "[moetrain %s r%d] %s\n", kNames[static_cast<int>(l)], g.rank, msg.c_str());
  std::fflush(out);
}

}  // namespace mt::log
