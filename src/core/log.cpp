#include "core/log.h"

#include <spdlog/sinks/base_sink.h>
#include <spdlog/spdlog.h>

#include <cstdio>
#include <memory>
#include <mutex>

namespace mt::log {

namespace {

// Below warn to stdout, warn and above to stderr, so that `2>` captures exactly the one-line
// diagnosis; every line flushed (ranks' lines interleave whole, and a crash loses none).
class SplitSink final : public spdlog::sinks::base_sink<std::mutex> {
 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    spdlog::memory_buf_t line;
    formatter_->format(msg, line);
    std::FILE* out = msg.level >= spdlog::level::warn ? stderr : stdout;
    std::fwrite(line.data(), 1, line.size(), out);
    std::fflush(out);
  }
  void flush_() override {
    std::fflush(stdout);
    std::fflush(stderr);
  }
};

std::string pattern(int rank) {
  return fmt::format("[moetrain %l r{}] %v", rank);
}

spdlog::logger& logger() {
  static const std::shared_ptr<spdlog::logger> l = [] {
    auto made = std::make_shared<spdlog::logger>("moetrain", std::make_shared<SplitSink>());
    made->set_pattern(pattern(0));
    made->set_level(spdlog::level::info);
    return made;
  }();
  return *l;
}

spdlog::level::level_enum to_spdlog(Level l) {
  switch (l) {
    case Level::kDebug:
      return spdlog::level::debug;
    case Level::kInfo:
      return spdlog::level::info;
    case Level::kWarn:
      return spdlog::level::warn;
    case Level::kError:
      return spdlog::level::err;
  }
  return spdlog::level::info;
}

}  // namespace

void set_level(Level l) {
  logger().set_level(to_spdlog(l));
}
void set_rank(int rank) {
  logger().set_pattern(pattern(rank));
}

void write(Level l, const std::string& msg) {
  logger().log(to_spdlog(l), msg);
}

}  // namespace mt::log
