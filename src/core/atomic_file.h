#pragma once
#include <string>

namespace mt {

// Writes `bytes` to path.tmp, flushes it to disk, then renames over `path`: a reader sees the
// old file or the new one, never a torn one. Throws CheckpointError on failure.
void write_file_atomically(const std::string& path, const std::string& bytes);

}  // namespace mt
