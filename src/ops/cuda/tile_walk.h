// The order in which a fixed-layout kernel's persistent CTAs take its (row run, column tile)
// entries (cutlass/fp8_gemm_sm90_fixed.cuh): bands of `band` runs, each band walked column by
// column, every run of the band in a column before the next column. A band of one run is the
// row-major order (a run's columns in turn: its rows stay in L2 while the weight streams past);
// a dense product with a weight larger than L2 (the LM head's) takes wider bands, so each weight
// tile is read from memory once per band instead of once per run. Plain header: the kernel and
// the CPU test share it.
#pragma once
#include <cstdint>

#include "core/host_device.h"

namespace mt::cuda::kernels {

// The row-major index (run * columns + column) of the i-th entry taken, for i < runs * columns
// (entries past them map to themselves: past every run).
MT_HOST_DEVICE inline int64_t banded_entry(int64_t i, int64_t runs, int64_t columns, int64_t band) {
  if (band <= 1 || i >= runs * columns) return i;
  const int64_t per_band = band * columns, first = i / per_band * band;
  const int64_t in_band = runs - first < band ? runs - first : band;
  const int64_t within = i - first * columns;
  return (first + within % in_band) * columns + within / in_band;
}

}  // namespace mt::cuda::kernels
