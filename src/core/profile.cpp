#include "core/profile.h"

#include <cstdlib>
#include <cstring>
#include <mutex>

namespace mt::profile {

namespace {

struct Totals {
  std::mutex mutex;
  std::vector<std::pair<std::string, double>> ms;
  void (*sync)() = nullptr;
};

Totals& totals() {
  static Totals t;
  return t;
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

Phase::Phase(const char* name) : name_(name) {
  if (!enabled()) return;
  wait_for_device();
  start_ = std::chrono::steady_clock::now();
}

Phase::~Phase() {
  if (!enabled()) return;
  wait_for_device();
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start_).count();
  Totals& t = totals();
  const std::lock_guard lock(t.mutex);
  for (auto& [name, total] : t.ms)
    if (name == name_) {
      total += ms;
      return;
    }
  t.ms.emplace_back(name_, ms);
}

std::vector<std::pair<std::string, double>> take() {
  Totals& t = totals();
  const std::lock_guard lock(t.mutex);
  return std::exchange(t.ms, {});
}

}  // namespace mt::profile
