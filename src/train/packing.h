// How documents become rows (docs/data_format.md): `stream` lays them end to end and cuts at row
// boundaries (pre-training, as torchtitan); `whole` puts each document in one row, never split,
// by first-fit decreasing over a window of upcoming documents, the row's tail padded (SFT, as
// TRL, torchtune and axolotl pack). Documents longer than a row are truncated, dropped or refused.
#pragma once
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace mt {

enum class Packing { kWhole, kStream };
enum class Overlong { kTruncate, kDrop, kError };

std::string_view packing_name(Packing p);    // "whole", "stream"
std::string_view overlong_name(Overlong o);  // "truncate", "drop", "error"
bool parse_packing(std::string_view name, Packing* out);
bool parse_overlong(std::string_view name, Overlong* out);

// First-fit decreasing: items of the given lengths (each at most `capacity`) into bins of
// `capacity`: the longest first (equal lengths in input order), each into the first opened bin
// with room, else a new one. Returns each bin's item indices in placement order, bins in the
// order they were opened. O(n log n): a max-tree over the bins' free space finds the first fit.
std::vector<std::vector<int64_t>> first_fit_decreasing(std::span<const int64_t> lengths,
                                                       int64_t capacity);

}  // namespace mt
