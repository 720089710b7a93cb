// Preemption (a scheduler's SIGTERM, an operator's SIGINT, SIGUSR1): the first such signal asks
// the run to stop at the next step boundary, where every rank agrees on it (with the step's first
// collective), writes a checkpoint and exits with ExitCode::kStopped. A second signal, or
// `deadline_s` after the first (0: no deadline), ends the process at once by the signal's default
// action: checkpoints are written atomically, so the last complete one stays. The flag is the
// one piece of process-wide state a signal handler can set.
#pragma once

namespace mt {

// Installs the handlers (idempotent).
void install_stop_handlers(double deadline_s);
// The signal that asked to stop, 0 while none has.
int stop_requested();
// Forgets a request (tests that run several trainers in one process).
void clear_stop_request();

}  // namespace mt
