#include "model/precision.h"

#include "core/error.h"

namespace mt {

PrecisionPlan plan_precision(const ModelConfig& m, const ParallelConfig& p) {
  PrecisionPlan plan;
  plan.experts = m.expert_precision;
  plan.experts.dispatch = p.ep_dispatch_dtype;
  if (const std::string why = plan.experts.invalid_combination(); !why.empty())
    throw ConfigError("config: " + why);
  plan.expert_weight_copies =
      plan.experts.mx_forward_and_input() || plan.experts.fp8_forward_and_input();
  plan.backward_copies =
      m.checkpoint == CheckpointPolicy::kFull ? ops::CopyUse::kBoth : ops::CopyUse::kBackward;
  return plan;
}

}  // namespace mt
