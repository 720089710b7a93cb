// Where a step's time goes: with MOETRAIN_PROFILE=1 every Phase waits for the device at both
// ends (so phases never overlap, which slows the step a little) and adds its wall time to a
// per-name total; the trainer logs and clears the totals after each step. Off, a Phase costs one
// branch.
#pragma once
#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace mt::profile {

bool enabled();
// The device wait (cudaDeviceSynchronize on the GPU); none on the CPU.
void set_device_sync(void (*sync)());

// The innermost live Phase on this thread (its name), or null: kept whether or not profiling is
// on, so errors can say where they happened.
const char* current_phase();

class Phase {
 public:
  explicit Phase(const char* name);
  ~Phase();
  Phase(const Phase&) = delete;
  Phase& operator=(const Phase&) = delete;

 private:
  const char* name_;
  const char* parent_;
  std::chrono::steady_clock::time_point start_;
  int64_t peak_at_start_ = 0;
};

// This process's peak resident host memory so far, in bytes (getrusage's maxrss).
int64_t peak_host_bytes();

// Milliseconds per phase name since the last call, in order of first use; clears them.
std::vector<std::pair<std::string, double>> take();

// Where memory peaks: with a probe set (the device's high-water mark of tensor bytes), each Phase
// reads it at both ends, and one that ends with it higher than it started is recorded with the
// mark it left. Nested phases end first, so the innermost phase that raised a mark comes first.
void set_peak_probe(int64_t (*peak_bytes)());
// {phase, high-water mark it left} since the last call, in the order the phases ended; clears them.
std::vector<std::pair<std::string, int64_t>> take_peaks();

// Device time of one kind of work, measured without waiting for it (always on, unlike Phase): a
// Span marks the thread's stream at both ends (CUDA events on the GPU, the host clock on the CPU)
// and take_spans() reads the marks once the device has passed them. Per thread, so in-process
// ranks keep their own. Inside a CUDA graph capture a span records nothing (a captured mark could
// not be timed).
struct DeviceClock {
  void* (*mark)();  // a mark recorded on the thread's stream; null while it is capturing
  double (*ms_between)(void* from, void* to);  // waits for `to`
  void (*release)(void* mark);
};
void set_device_clock(DeviceClock clock);

class Span {
 public:
  Span(const char* name, bool on_device);
  ~Span();
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  const char* name_;
  void* device_start_ = nullptr;
  bool on_device_;
  std::chrono::steady_clock::time_point host_start_;
};

// Milliseconds per span name recorded by this thread since its last call; clears them.
std::vector<std::pair<std::string, double>> take_spans();

}  // namespace mt::profile
