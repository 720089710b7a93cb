// Test helper for resume: one config trained straight through, and trained to a checkpoint then
// resumed from it.
#pragma once
#include <fmt/format.h>

#include <memory>
#include <string>
#include <vector>

#include "train/trainer.h"

namespace mt::testing {

struct ResumeRuns {
  std::unique_ptr<Trainer> straight, resumed;
  std::vector<StepMetrics> straight_steps, resumed_steps;  // resumed: the steps after `stop`
};

// c trains its train.steps and checkpoints into `dir` at step `stop` (checkpoint.every).
inline ResumeRuns straight_and_resumed(const Config& c, const std::string& dir, int64_t stop) {
  ResumeRuns r;
  // The helper owns `dir`: both fresh runs start over there.
  RunOptions fresh;
  fresh.existing = ExistingCheckpoints::kOverwrite;
  r.straight = std::make_unique<Trainer>(c);
  r.straight_steps = r.straight->run(fresh);
  Trainer first(c);
  RunOptions stop_early;
  stop_early.steps = stop;
  stop_early.existing = ExistingCheckpoints::kOverwrite;
  first.run(stop_early);
  r.resumed = std::make_unique<Trainer>(c);
  RunOptions resume;
  resume.resume = fmt::format("{}/step_{:08d}.safetensors", dir, stop);
  r.resumed_steps = r.resumed->run(resume);
  return r;
}

}  // namespace mt::testing
