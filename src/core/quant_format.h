// The quantized formats' constants and choices, without Tensor (the CUDA kernels include this):
// core/quant.h describes the formats and holds the tensor type.
#pragma once
#include <cstdint>
#include <string_view>

namespace mt {

inline constexpr int64_t kMxBlock = 32;
inline constexpr int64_t kFp8Block = 128;  // DeepSeek-V3's blocks: 1 x 128 and 128 x 128

enum class QuantAxis : uint8_t { kDim0, kDim1 };

// The blocks that share one scale (core/quant.h gives each one's stored layout):
//   kMx32:    1 x 32 along the axis, E8M0 scales (OCP MX, torchao's MXTensor).
//   kRow128:  1 x 128 along the axis, f32 scales (DeepSeek-V3's activations and gradients).
//   kTile128: 128 x 128 tiles, f32 scales (DeepSeek-V3's weights).
enum class QuantBlock : uint8_t { kMx32, kRow128, kTile128 };

// How an FP8 block's f32 scale follows from its largest magnitude amax (model.fp8_scale), with
// amax' = max(amax, kFp8AmaxFloor):
//   kFp32: scale = fl32(amax' / 448), elements q = e4m3(fl32(x * fl32(448 / amax')))
//          (DeepGEMM's per-token and per-block casts);
//   kPow2: scale = 2^ceil(log2(fl32(amax' / 448))), q = e4m3(x / scale) (exact division): the
//          scales are powers of two, so dequantization is exact in any float type (DeepGEMM's
//          UE8M0 option).
// E4M3 saturates at +-448 and rounds to nearest even. A block with a NaN or infinity gets a NaN
// scale and NaN elements (0x7F): the loss check names the step.
enum class Fp8ScaleRule : uint8_t { kFp32, kPow2 };
inline constexpr float kFp8AmaxFloor = 1e-12f;  // torchao's float8 blockwise EPS

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
// parallel.ep_dispatch_dtype calls "bf16"); as MXFP8 (E4M3 data and E8M0 scales, 1 x 32 blocks
// along the row), arriving as their MX values in the rows' dtype (ops::mx_round_trip along the
// row); or as FP8 blockwise ("fp8_blockwise": E4M3 data and f32 scales, 1 x 128 blocks along the
// row, the Fp8ScaleRule given), arriving as those FP8 rows (kRow128 along dim0), which the FP8
// products take as they are.
enum class RowWire : uint8_t { kAsIs, kMxfp8, kFp8 };

std::string_view quant_axis_name(QuantAxis a);         // "dim0", "dim1"
std::string_view quant_block_name(QuantBlock b);       // "1x32", "1x128", "128x128"
std::string_view fp8_scale_rule_name(Fp8ScaleRule r);  // "fp32", "pow2"
bool parse_fp8_scale_rule(std::string_view name, Fp8ScaleRule* out);
std::string_view mx_scale_rule_name(MxScaleRule r);  // "floor", "rceil"
bool parse_mx_scale_rule(std::string_view name, MxScaleRule* out);

}  // namespace mt
