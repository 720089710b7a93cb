#include "core/profile.h"

#include <sys/resource.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <utility>

#if MOETRAIN_HAS_CUDA
#include <nvtx3/nvToolsExt.h>  // header-only: a no-op unless a profiler (nsys) is attached
#endif

namespace mt::profile {

namespace {
// Every Phase and Span is also an NVTX range, so an Nsight Systems timeline shows the step's
// phases over the kernels they queued.
void range_push(const char* name) {
#if MOETRAIN_HAS_CUDA
  nvtxRangePushA(name);
#else
  (void)name;
#endif
}
void range_pop() {
#if MOETRAIN_HAS_CUDA
  nvtxRangePop();
#endif
}

struct Totals {
  std::mutex mutex;
  std::vector<std::pair<std::string, double>> ms;
  std::vector<std::pair<std::string, int64_t>> peaks;
  void (*sync)() = nullptr;
  int64_t (*peak_probe)() = nullptr;
};

Totals& totals() {
  static Totals t;
  return t;
}

// Adds ms to the entry named `name` (appended in order of first use).
void add_ms(std::vector<std::pair<std::string, double>>& totals, const char* name, double ms) {
  for (auto& [n, total] : totals)
    if (n == name) {
      total += ms;
      return;
    }
  totals.emplace_back(name, ms);
}

struct PendingSpan {
  const char* name;
  void* start;
  void* end;
};

struct SpanTotals {
  std::vector<PendingSpan> pending;  // device marks not yet read
  std::vector<std::pair<std::string, double>> ms;
};

SpanTotals& span_totals() {
  thread_local SpanTotals t;
  return t;
}

DeviceClock& device_clock() {
  static DeviceClock c{};
  return c;
}

void wait_for_device() {
  if (totals().sync) totals().sync();
}

}  // namespace

bool enabled() {
  static const bool on = [] {
    const char* v = std::getenv("MOETRAIN_PROFILE");
    return v && std::strcmp(v, "0") != 0 && *v != '\0';
  }();
  return on;
}

void set_device_sync(void (*sync)()) {
  totals().sync = sync;
}

void set_peak_probe(int64_t (*peak_bytes)()) {
  totals().peak_probe = peak_bytes;
}

namespace {
thread_local const char* innermost_phase = nullptr;
}  // namespace

const char* current_phase() {
  return innermost_phase;
}

Phase::Phase(const char* name) : name_(name), parent_(innermost_phase) {
  innermost_phase = name;
  range_push(name);
  if (!enabled()) return;
  wait_for_device();
  if (totals().peak_probe) peak_at_start_ = totals().peak_probe();
  start_ = std::chrono::steady_clock::now();
}

Phase::~Phase() {
  innermost_phase = parent_;
  range_pop();
  if (!enabled()) return;
  wait_for_device();
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start_).count();
  Totals& t = totals();
  const int64_t peak = t.peak_probe ? t.peak_probe() : 0;
  const std::lock_guard lock(t.mutex);
  add_ms(t.ms, name_, ms);
  if (peak > peak_at_start_) t.peaks.emplace_back(name_, peak);
}

int64_t peak_host_bytes() {
  struct rusage u {};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<int64_t>(u.ru_maxrss) * 1024;  // Linux reports KiB
}

std::vector<std::pair<std::string, int64_t>> take_peaks() {
  Totals& t = totals();
  const std::lock_guard lock(t.mutex);
  return std::exchange(t.peaks, {});
}

void set_device_clock(DeviceClock clock) {
  device_clock() = clock;
}

Span::Span(const char* name, bool on_device)
    : name_(name), on_device_(on_device && device_clock().mark) {
  range_push(name);
  if (on_device_)
    device_start_ = device_clock().mark();
  else
    host_start_ = std::chrono::steady_clock::now();
}

Span::~Span() {
  range_pop();
  SpanTotals& t = span_totals();
  if (!on_device_) {
    add_ms(t.ms, name_,
           std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - host_start_)
               .count());
    return;
  }
  if (!device_start_) return;  // capturing
  void* end = device_clock().mark();
  if (end)
    t.pending.push_back({name_, device_start_, end});
  else
    device_clock().release(device_start_);
}

std::vector<std::pair<std::string, double>> take_spans() {
  SpanTotals& t = span_totals();
  const DeviceClock& clock = device_clock();
  for (const PendingSpan& p : t.pending) {
    add_ms(t.ms, p.name, clock.ms_between(p.start, p.end));
    clock.release(p.start);
    clock.release(p.end);
  }
  t.pending.clear();
  return std::exchange(t.ms, {});
}

std::vector<std::pair<std::string, double>> take() {
  Totals& t = totals();
  const std::lock_guard lock(t.mutex);
  return std::exchange(t.ms, {});
}

}  // namespace mt::profile
