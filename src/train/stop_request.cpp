#include "train/stop_request.h"

#include <signal.h>
#include <sys/time.h>

#include <cmath>
#include <initializer_list>

namespace mt {

namespace {
volatile sig_atomic_t g_signal = 0;
struct itimerval g_deadline {};  // armed by the first signal (zero: none)

void on_stop_signal(int sig) {
  if (g_signal != 0) {  // the second: at once, by the default action
    ::signal(sig, SIG_DFL);
    ::raise(sig);
    return;
  }
  g_signal = sig;
  if (g_deadline.it_value.tv_sec != 0 || g_deadline.it_value.tv_usec != 0)
    ::setitimer(ITIMER_REAL, &g_deadline, nullptr);  // SIGALRM's default action ends the process
}
}  // namespace

void install_stop_handlers(double deadline_s) {
  g_deadline = {};
  if (deadline_s > 0) {
    g_deadline.it_value.tv_sec = static_cast<time_t>(deadline_s);
    g_deadline.it_value.tv_usec =
        static_cast<suseconds_t>((deadline_s - std::floor(deadline_s)) * 1e6);
  }
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // a read or write the signal lands in carries on
  for (const int sig : {SIGTERM, SIGINT, SIGUSR1}) ::sigaction(sig, &sa, nullptr);
}

int stop_requested() {
  return g_signal;
}

void clear_stop_request() {
  g_signal = 0;
}

}  // namespace mt
