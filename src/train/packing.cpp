#include "train/packing.h"

#include <algorithm>
#include <array>
#include <numeric>

#include "core/enum_names.h"
#include "core/error.h"

namespace mt {

namespace {
constexpr std::array<EnumName<Packing>, 2> kPackings = {{
    {Packing::kWhole, "whole"},
    {Packing::kStream, "stream"},
}};
constexpr std::array<EnumName<Overlong>, 3> kOverlongs = {{
    {Overlong::kTruncate, "truncate"},
    {Overlong::kDrop, "drop"},
    {Overlong::kError, "error"},
}};
}  // namespace

std::string_view packing_name(Packing p) {
  return enum_name(kPackings, p);
}
std::string_view overlong_name(Overlong o) {
  return enum_name(kOverlongs, o);
}
bool parse_packing(std::string_view name, Packing* out) {
  return parse_enum(kPackings, name, out);
}
bool parse_overlong(std::string_view name, Overlong* out) {
  return parse_enum(kOverlongs, name, out);
}

std::vector<std::vector<int64_t>> first_fit_decreasing(std::span<const int64_t> lengths,
                                                       int64_t capacity) {
  const int64_t n = static_cast<int64_t>(lengths.size());
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return lengths[a] > lengths[b]; });
  // At most n bins. free_[leaf] is a bin's free space (unopened bins: all of it, so the first
  // unopened bin is the fit when no opened one has room); inner nodes hold their subtree's max.
  int64_t leaves = 1;
  while (leaves < std::max<int64_t>(n, 1)) leaves *= 2;
  std::vector<int64_t> free(2 * leaves, capacity);
  std::vector<std::vector<int64_t>> bins;
  for (const int64_t item : order) {
    const int64_t len = lengths[item];
    MT_CHECK(len >= 0 && len <= capacity, "item of length {} for bins of {}", len, capacity);
    int64_t node = 1;
    while (node < leaves) node = free[2 * node] >= len ? 2 * node : 2 * node + 1;
    const int64_t bin = node - leaves;
    if (bin == static_cast<int64_t>(bins.size())) bins.emplace_back();
    bins[bin].push_back(item);
    free[node] -= len;
    for (node /= 2; node >= 1; node /= 2) free[node] = std::max(free[2 * node], free[2 * node + 1]);
  }
  return bins;
}

}  // namespace mt
