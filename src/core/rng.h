// Counter-based RNG (Philox4x32-10, Salmon et al. 2011): every random number is a pure function
// of (seed, stream, index), so initialisation and data are the same on CPU and GPU, for any
// sharding and any thread order. Header-only and host/device-clean for the CUDA kernels.
#pragma once
#include <cmath>
#include <cstdint>

#include "core/host_device.h"

namespace mt {

struct Philox4x32 {
  uint32_t v[4];
};

MT_HOST_DEVICE inline Philox4x32 philox4x32_10(Philox4x32 ctr, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kM0) * ctr.v[0];
    const uint64_t p1 = static_cast<uint64_t>(kM1) * ctr.v[2];
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    ctr = Philox4x32{{hi1 ^ ctr.v[1] ^ k0, lo1, hi0 ^ ctr.v[3] ^ k1, lo0}};
    k0 += kW0;
    k1 += kW1;
  }
  return ctr;
}

// Random stream `stream` of generator `seed`; element `index` of it.
struct CounterRng {
  uint64_t seed = 0;
  uint64_t stream = 0;

  MT_HOST_DEVICE Philox4x32 block(uint64_t index) const {
    Philox4x32 c{{static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32),
                  static_cast<uint32_t>(stream), static_cast<uint32_t>(stream >> 32)}};
    return philox4x32_10(c, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  }
  MT_HOST_DEVICE uint32_t u32(uint64_t index) const { return block(index).v[0]; }
  // Uniform in (0, 1): 24 random bits, never exactly 0 or 1.
  MT_HOST_DEVICE double uniform(uint64_t index) const {
    return (static_cast<double>(u32(index) >> 8) + 0.5) / 16777216.0;
  }
  // Standard normal by Box-Muller on two words of one block.
  MT_HOST_DEVICE double normal(uint64_t index) const {
    const Philox4x32 b = block(index);
    const double u1 = (static_cast<double>(b.v[0] >> 8) + 0.5) / 16777216.0;
    const double u2 = (static_cast<double>(b.v[1] >> 8) + 0.5) / 16777216.0;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  // Uniform integer in [0, n).
  MT_HOST_DEVICE uint32_t below(uint64_t index, uint32_t n) const {
    return static_cast<uint32_t>((static_cast<uint64_t>(u32(index)) * n) >> 32);
  }
};

}  // namespace mt
