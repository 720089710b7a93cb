// How the router chooses: learned (top-k of the biased scores), or a fixed pattern for
// benchmarks and tests, whose routing weights are still the scores gathered at the chosen
// experts. The patterns, for token t's choice j of k over E experts:
// - balanced: expert (t*k + j) mod E: every expert the same load.
// - skewed: the first H = E/4 experts are hot and take half of all choices, the other C = E - H
//   the other half: a hot expert carries twice the mean load, a cold one 2/3 of it (max/mean
//   2.0 when 4 divides E and the hot choices spread evenly). Token t puts
//   h_t = floor((t+1)k/2) - floor(tk/2) choices on hot experts (k/2 each for even k), round-robin
//   over them from the floor(tk/2)-th hot choice, first, then the rest round-robin over the cold
//   ones. Distinct within a token while H and C are at least ceil(k/2) (ModelConfig checks).
// Plain header: the CPU reference and the CUDA router use the same definition.
#pragma once
#include <cstdint>

#include "core/host_device.h"

namespace mt::ops {

enum class RoutingMode : uint8_t { kLearned, kBalanced, kSkewed };

MT_HOST_DEVICE inline int64_t skewed_hot_experts(int64_t e) {
  return e / 4;
}

// The expert of (t, j) under a fixed pattern (not kLearned).
MT_HOST_DEVICE inline int32_t fixed_choice(RoutingMode mode, int64_t t, int64_t j, int64_t k,
                                           int64_t e) {
  if (mode == RoutingMode::kBalanced) return static_cast<int32_t>((t * k + j) % e);
  const int64_t hot = skewed_hot_experts(e), cold = e - hot;
  const int64_t hot_before = t * k / 2, hot_here = (t + 1) * k / 2 - hot_before;
  if (j < hot_here) return static_cast<int32_t>((hot_before + j) % hot);
  const int64_t cold_before = t * k - hot_before;
  return static_cast<int32_t>(hot + (cold_before + j - hot_here) % cold);
}

}  // namespace mt::ops
