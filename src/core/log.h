// The one global: the process's logger (spdlog), each line "[moetrain LEVEL rRANK] message",
// info and below on stdout, warnings and errors on stderr. Everything else is owned state.
#pragma once
#include <fmt/format.h>

#include <string>

namespace mt::log {

enum class Level { kDebug, kInfo, kWarn, kError };
void set_level(Level l);
void set_rank(int rank);
void write(Level l, const std::string& msg);

template <class... A>
void info(fmt::format_string<A...> f, A&&... a) {
  write(Level::kInfo, fmt::format(f, std::forward<A>(a)...));
}
template <class... A>
void warn(fmt::format_string<A...> f, A&&... a) {
  write(Level::kWarn, fmt::format(f, std::forward<A>(a)...));
}
template <class... A>
void error(fmt::format_string<A...> f, A&&... a) {
  write(Level::kError, fmt::format(f, std::forward<A>(a)...));
}

}  // namespace mt::log
