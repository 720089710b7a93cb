#include "model/precision.h"

#include "core/error.h"

namespace mt {

PrecisionPlan plan_precision(const ModelConfig& m, const ParallelConfig& p) {
  PrecisionPlan plan;
  plan.experts = m.expert_precision;
  plan.experts.dispatch = p.ep_dispatch_dtype;
  if (const std::string why = plan.experts.invalid_combination(); !why.empty())
    throw ConfigError("config: " + why);
  plan.expert_mx_copies = plan.experts.mx_forward_and_input();
  plan.backward_copies =
      m.checkpoint == CheckpointPolicy::kFull ? ops::MxCopyUse::kBoth : ops::MxCopyUse::kBackward;
  return plan;
}

}  // namespace mt
