// The MX format's constants and choices, without Tensor (the CUDA kernels include this):
// core/mx.h describes the format and holds the tensor type.
#pragma once
#include <cstdint>
#include <string_view>

namespace mt {

inline constexpr int64_t kMxBlock = 32;

enum class MxAxis : uint8_t { kDim0, kDim1 };

// How a block's scale follows from its largest magnitude amax (torchao's ScaleCalculationMode):
//   kFloor: s = clamp(floor(log2(amax)) - 8, -127, 128) + 127 (the OCP spec's rule; 8 = the
//           exponent of E4M3's largest power of two, 256): values above 256 * 2^(s-127) * 1.75
//           saturate to +-448.
//   kRceil: s = clamp(ceil(log2(fl32(amax / 448))), -127, 127) + 127: amax / 2^(s-127) <= 448,
//           nothing saturates (cuBLAS's and TransformerEngine's rule).
// docs/numerics.md gives both rules' handling of zero, tiny, infinite and NaN blocks.
enum class MxScaleRule : uint8_t { kFloor, kRceil };

// How rows cross a wire (the expert exchange: the dispatch's rows and every part of a row
// scatter): as they are, in their own dtype (the GPU's bf16 activations, which the config key
// parallel.ep_dispatch_dtype calls "bf16"), or as MXFP8 (E4M3 data and E8M0 scales, 1 x 32 blocks
// along the row), arriving as their MX values in the rows' dtype (ops::mx_round_trip along the
// row).
enum class RowWire : uint8_t { kAsIs, kMxfp8 };

std::string_view mx_axis_name(MxAxis a);             // "dim0", "dim1"
std::string_view mx_scale_rule_name(MxScaleRule r);  // "floor", "rceil"
bool parse_mx_scale_rule(std::string_view name, MxScaleRule* out);

}  // namespace mt
