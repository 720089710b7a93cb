#include "dist/launcher.h"

#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <random>
#include <thread>

#include "core/error.h"

namespace mt::dist {

namespace {

// A port for the rendezvous hub, below Linux's ephemeral range (32768-60999 by default): a port
// the kernel handed out may be taken again, between this check and rank 0's bind, by any
// outgoing connection (NCCL opens many), and rank 0 then fails with "address in use". Ports
// tried from a random start (two launches at once pick different ones); bind checks each.
int free_port() {
  std::random_device rd;
  const int first = 20000, count = 12000, start = static_cast<int>(rd() % count);
  for (int i = 0; i < count; ++i) {
    const int port = first + (start + i) % count;
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) break;
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    ::close(fd);
    if (ok) return port;
  }
  throw Error(ExitCode::kInternal, "launch: cannot find a free port in [20000, 32000)");
}

std::string describe(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with code {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status))
    return fmt::format("was killed by signal {} ({})", WTERMSIG(status),
                       strsignal(WTERMSIG(status)));
  return "stopped";
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

// SIGINT, SIGTERM or SIGUSR1 received by the launcher (0: none), and how many: each is forwarded
// to every rank.
volatile sig_atomic_t g_forward_signal = 0;
volatile sig_atomic_t g_signals = 0;
void remember_signal(int sig) {
  g_forward_signal = sig;
  g_signals = g_signals + 1;
}

}  // namespace

int launch_local(const LaunchOptions& opt) {
  if (opt.nproc < 1) throw ConfigError(fmt::format("launch: -n {} must be >= 1", opt.nproc));
  if (opt.args.empty())
    throw ConfigError("launch: nothing to run (usage: launch -n N -- train ...)");
  const int port = opt.master_port ? opt.master_port : free_port();
  // No SA_RESTART: the signal interrupts waitpid, and the loop below forwards it.
  struct sigaction forward {};
  forward.sa_handler = remember_signal;
  sigemptyset(&forward.sa_mask);
  for (const int sig : {SIGINT, SIGTERM, SIGUSR1}) ::sigaction(sig, &forward, nullptr);
  const pid_t launcher = ::getpid();
  std::vector<pid_t> pids(opt.nproc, -1);
  for (int r = 0; r < opt.nproc; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0)
      throw Error(ExitCode::kInternal, fmt::format("launch: fork: {}", std::strerror(errno)));
    if (pid == 0) {
      // A rank dies with its launcher, however the launcher ends (even SIGKILL); if the
      // launcher is already gone, the rank does not start.
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (::getppid() != launcher) std::_Exit(128 + SIGTERM);
      for (const int sig : {SIGINT, SIGTERM, SIGUSR1}) ::signal(sig, SIG_DFL);
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(opt.nproc).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      std::vector<char*> argv;
      std::string self = "moetrain";
      argv.push_back(self.data());
      std::vector<std::string> args = opt.args;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv("/proc/self/exe", argv.data());
      std::fprintf(stderr, "moetrain launch: exec failed: %s\n", std::strerror(errno));
      std::_Exit(127);
    }
    pids[r] = pid;
  }
  int result = 0, running = opt.nproc;
  bool stopping = false;   // the ranks were told to stop (a failure, or a second signal)
  bool forwarded = false;  // a signal was passed on: the ranks stop at a step boundary
  int signals_seen = 0;
  auto deadline = std::chrono::steady_clock::time_point::max();
  // Sends `sig` to every rank still running; after the grace period they get SIGKILL.
  const auto stop_all = [&](int sig, int exit_code) {
    result = exit_code;
    stopping = true;
    deadline = std::chrono::steady_clock::now() +
               std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                   std::chrono::duration<double>(opt.grace_s));
    for (pid_t p : pids)
      if (p > 0) ::kill(p, sig);
  };
  while (running > 0) {
    if (const int seen = g_signals; seen != signals_seen && !stopping) {
      signals_seen = seen;
      const int sig = g_forward_signal;
      if (!forwarded) {
        // The ranks finish their step, write a checkpoint and exit (ExitCode::kStopped), in their
        // own time (checkpoint.signal_deadline_s bounds it): no deadline here.
        std::fprintf(stderr,
                     "moetrain launch: %s received; %d rank(s) stop at their next step "
                     "boundary (again to stop them at once)\n",
                     strsignal(sig), running);
        forwarded = true;
        for (pid_t p : pids)
          if (p > 0) ::kill(p, sig);
      } else {
        std::fprintf(stderr, "moetrain launch: %s received again; stopping %d rank(s) now\n",
                     strsignal(sig), running);
        stop_all(sig, 128 + sig);
      }
    }
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, stopping || forwarded ? WNOHANG : 0);
    if (pid == 0) {  // stopping, nobody exited yet
      if (std::chrono::steady_clock::now() > deadline) {
        for (pid_t p : pids)
          if (p > 0) ::kill(p, SIGKILL);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    if (pid < 0) {
      if (errno == EINTR) continue;
      break;
    }
    const int rank = static_cast<int>(std::find(pids.begin(), pids.end(), pid) - pids.begin());
    if (rank >= opt.nproc) continue;
    pids[rank] = -1;
    --running;
    // Stopped as asked (a signal to the launcher or to any rank: the ranks agree at a step
    // boundary and each writes its part of the checkpoint): their own code, not a failure.
    if (!stopping && WIFEXITED(status) &&
        WEXITSTATUS(status) == static_cast<int>(ExitCode::kStopped)) {
      result = WEXITSTATUS(status);
      continue;
    }
    const bool failed = !WIFEXITED(status) || WEXITSTATUS(status) != 0;
    const bool our_kill =
        stopping && WIFSIGNALED(status) &&
        (WTERMSIG(status) == SIGTERM || WTERMSIG(status) == SIGKILL || WTERMSIG(status) == SIGINT);
    // Every failure is reported: when two ranks die close together, reap order is not cause.
    if (failed && !our_kill)
      std::fprintf(stderr, "moetrain launch: rank %d %s%s\n", rank, describe(status).c_str(),
                   stopping ? "" : fmt::format("; stopping the other {} rank(s)", running).c_str());
    if (failed && !stopping) stop_all(SIGTERM, exit_code_of(status));
  }
  return result;
}

}  // namespace mt::dist
