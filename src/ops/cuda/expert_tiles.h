// How the fixed-layout kernels (cutlass/grouped_gemm_fixed_sm90.cuh,
// cutlass/fp8_gemm_sm90_fixed.cuh) tile a padded expert row layout: every expert's rows start on a
// multiple of kFixedRowTile, so each row tile belongs to one expert, and a table built on the
// device from the segments lists the tiles. Plain header: the kernels that build the tables and the
// CPU tests that check them share these definitions.
#pragma once
#include <cstdint>

#include "core/host_device.h"

namespace mt::cuda::kernels {

inline constexpr int64_t kFixedRowTile = 128;  // the segments' alignment the fixed kernels need

// The last i in [0, n) with starts[i] <= v, for ascending starts with starts[0] <= v.
template <class T>
MT_HOST_DEVICE inline int last_start_at_or_before(const T* starts, int n, int64_t v) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (starts[mid] <= v)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// Row tiles of expert e: from its start to the next expert's (segments[experts] the end, which
// may fall inside a row tile).
MT_HOST_DEVICE inline int64_t expert_row_tiles(const int64_t* segments, int e) {
  return (segments[e + 1] - segments[e] + kFixedRowTile - 1) / kFixedRowTile;
}

// A table whose CTA tiles are runs of up to `waves` row tiles of one expert, each expert's from its
// first (its last run may be shorter), by `columns` column tiles. An expert of t row tiles has
// ceil(t / waves) runs, at most t and at most (t + waves - 1) / waves: summed over the experts, at
// most the capacity's row tiles and at most (row tiles + experts (waves - 1)) / waves. The
// entries a table of `capacity` rows holds at most:
inline int64_t expert_run_entries(int64_t capacity, int experts, int waves, int64_t columns) {
  const int64_t row_tiles = (capacity + kFixedRowTile - 1) / kFixedRowTile;
  const int64_t bound = (row_tiles + int64_t{experts} * (waves - 1) + waves - 1) / waves;
  return (row_tiles < bound ? row_tiles : bound) * columns;
}

// first_run[e] = the runs of the experts before e, for e = 0 .. experts (experts + 1 values; the
// last is every run).
MT_HOST_DEVICE inline void count_expert_runs(const int64_t* segments, int experts, int waves,
                                             int64_t* first_run) {
  int64_t runs = 0;
  for (int e = 0; e < experts; ++e) {
    first_run[e] = runs;
    runs += (expert_row_tiles(segments, e) + waves - 1) / waves;
  }
  first_run[experts] = runs;
}

// Entry i of the table, (run i / columns, column tile i % columns): its first row tile, column
// tile, expert and row tiles (1 .. waves), or row tile -1 past the last run.
struct ExpertRun {
  int32_t row_tile, column, expert, row_tiles;
};
MT_HOST_DEVICE inline ExpertRun expert_run_entry(const int64_t* segments, const int64_t* first_run,
                                                 int experts, int waves, int columns, int64_t i) {
  const int64_t run = i / columns;
  const int column = static_cast<int>(i - run * columns);
  if (run >= first_run[experts]) return {-1, 0, 0, 0};
  const int e = last_start_at_or_before(first_run, experts, run);
  const int64_t first = (run - first_run[e]) * waves;  // within the expert
  const int64_t left = expert_row_tiles(segments, e) - first;
  return {static_cast<int32_t>(segments[e] / kFixedRowTile + first), column, e,
          static_cast<int32_t>(left < waves ? left : waves)};
}

}  // namespace mt::cuda::kernels
