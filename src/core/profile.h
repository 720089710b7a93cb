// Where a step's time goes: with MOETRAIN_PROFILE=1 every Phase waits for the device at both
// ends (so phases never overlap, which slows the step a little) and adds its wall time to a
// per-name total; the trainer logs and clears the totals after each step. Off, a Phase costs one
// branch.
#pragma once
#include <chrono>
#include <string>
#include <utility>
#include <vector>

namespace mt::profile {

bool enabled();
// The device wait (cudaDeviceSynchronize on the GPU); none on the CPU.
void set_device_sync(void (*sync)());

class Phase {
 public:
  explicit Phase(const char* name);
  ~Phase();
  Phase(const Phase&) = delete;
  Phase& operator=(const Phase&) = delete;

 private:
  const char* name_;
  std::chrono::steady_clock::time_point start_;
};

// Milliseconds per phase name since the last call, in order of first use; clears them.
std::vector<std::pair<std::string, double>> take();

}  // namespace mt::profile
