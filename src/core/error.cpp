#include "core/error.h"

namespace mt {

void check_failed(const char* expr, const char* file, int line, const std::string& msg) {
  throw Error(ExitCode::kInternal,
              fmt::format("internal check failed: {} ({}:{}): {}", expr, file, line, msg));
}

}  // namespace mt
