// Numbers read from text strictly: the whole text, decimal, nothing else. Checkpoint metadata,
// the data position and the command line read integers through here ("1e3", "20abc", "" and
// " 5" are not integers).
#pragma once
#include <charconv>
#include <cstdint>
#include <optional>
#include <string_view>

namespace mt {

// A decimal integer (a leading '-' allowed) spanning all of `text`; nullopt otherwise.
inline std::optional<int64_t> parse_int64(std::string_view text) {
  int64_t v = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, v);
  if (text.empty() || ec != std::errc() || ptr != end) return std::nullopt;
  return v;
}

}  // namespace mt
