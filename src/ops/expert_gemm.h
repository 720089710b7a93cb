// The experts' three GEMMs under a precision recipe, with torchao's semantics for its MXFP8 MoE
// training recipes (mxfp8_grouped_mm.py). Each MX product multiplies operands quantized along
// its contraction dimension (32-element blocks, ops/mx.h) and accumulates their exact products:
//   forward  out = x w:      x along K (dim0), w[e] (K, N) along K (dim1)
//   input    dx  = dy w^T:   dy along N (dim0), w[e] along N (dim0)
//   weight   dw  = x^T dy:   x and dy along the tokens, each expert's rows in 32-row blocks from
//                            its first row (zero-padded): mx_round_trip_expert_rows
// kBf16 quantizes nothing (the compute dtype: bf16 on the GPU, f32/f64 on the CPU); kMxfp8
// quantizes all three; kMxfp8WgradWithHp all but the weight gradient, which takes the
// unquantized operands.
//
// The FP8 blockwise recipes (DeepSeek-V3's; ops/fp8.h, ops/fp8_gemm.h) quantize the rows in
// 1 x 128 blocks along the contraction and the weights in 128 x 128 tiles (f32 scales,
// model.fp8_scale), and the weight gradient's operands in 128-row blocks along the tokens from
// each expert's first row: kFp8Blockwise all three products, kFp8WgradWithHp the forward and
// input gradient (the weight gradient in the compute dtype). On the GPU they run on the FP8
// tensor cores; the CPU computes the definition (exact dequantization, f64 products).
//
// Every MX product multiplies the operands' MX values (quantized and dequantized: exact in the
// compute dtype) with the compute dtype's grouped GEMM. sm_90 has no block-scaled MMA, so bf16
// tensor cores do the MX products whichever way; the E4M3 bytes are expanded where it costs
// least: by the kernel that writes each operand (the weights' copies once per use, the rows by
// the permutation and SwiGLU kernels through ops::MxValuesOut), so the product runs at the bf16
// GEMM's rate. ops::mx_grouped_gemm, which expands E4M3 rows inside the GEMM, computes the same
// values (tested bit for bit) and is slower (docs/benchmarks-history.md).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

#include "core/quant.h"
#include "core/tensor.h"
#include "ops/grouped_gemm.h"

namespace mt::ops {

enum class ExpertRecipe : uint8_t {
  kBf16,
  kMxfp8,
  kMxfp8WgradWithHp,
  kFp8Blockwise,
  kFp8WgradWithHp
};
// "bf16", "mxfp8", "mxfp8_wgrad_with_hp", "fp8_blockwise", "fp8_wgrad_with_hp"
std::string_view expert_recipe_name(ExpertRecipe r);
bool parse_expert_recipe(std::string_view name, ExpertRecipe* out);

// What the expert rows travel as in the dispatch (and the output gradient in the backward of
// the combine): as they are (bf16), or MXFP8 (core/quant_format.h's RowWire). The GEMMs then take
// rows quantized along dim0; rows cannot be quantized along the tokens (dim1) from them as from
// the original, so MXFP8 dispatch goes with mxfp8_wgrad_with_hp, or with mxfp8 and requant_dim1
// (the weight gradient re-quantizes the dequantized rows along dim1; docs/numerics.md).
std::string_view dispatch_dtype_name(RowWire d);  // "bf16", "mxfp8": parallel.ep_dispatch_dtype
bool parse_dispatch_dtype(std::string_view name, RowWire* out);

struct ExpertPrecision {
  ExpertRecipe recipe = ExpertRecipe::kBf16;
  MxScaleRule rule = MxScaleRule::kRceil;        // torchao's MXFP8 training recipes use RCEIL
  Fp8ScaleRule fp8_scale = Fp8ScaleRule::kFp32;  // DeepSeek-V3's f32 scales
  RowWire dispatch = RowWire::kAsIs;
  bool requant_dim1 = false;

  bool mx_forward_and_input() const {
    return recipe == ExpertRecipe::kMxfp8 || recipe == ExpertRecipe::kMxfp8WgradWithHp;
  }
  bool mx_weight_gradient() const { return recipe == ExpertRecipe::kMxfp8; }
  bool fp8_forward_and_input() const {
    return recipe == ExpertRecipe::kFp8Blockwise || recipe == ExpertRecipe::kFp8WgradWithHp;
  }
  bool fp8_weight_gradient() const { return recipe == ExpertRecipe::kFp8Blockwise; }
  // The block the recipe's quantization needs the expert dims (model.dim, model.moe_dim) to be
  // multiples of: 32 (MX), 128 (FP8 blockwise), 1 (bf16).
  int64_t dim_multiple() const;
  // The combination's error (the coupling rule above), or empty when it is valid.
  std::string invalid_combination() const;
};

// A weight's quantized copies for the forward and the input gradient, each the b of
// out = a b^T (grouped_gemm_backward_input's shape). MX recipes: the MX values in the compute
// dtype, w (E, K, N) quantized along K and stored transposed, (E, N, K), for the forward, along N,
// (E, K, N), for the input gradient. FP8 recipes: E4M3 in 128 x 128 tiles with f32 scales, stored
// along dim1 (w^T) for the forward and dim0 for the input gradient (ops/fp8_gemm.h). FSDP makes
// them once for each pass that gathers the weights (fsdp::gather); the products make their own
// when given none.
struct WeightCopies {
  Tensor along_k;
  Tensor along_n;
  QuantTensor fp8_forward;
  QuantTensor fp8_input;
};
// Which copies a use of the weights needs: the forward's, the input gradient's, or both.
enum class CopyUse : uint8_t { kForward, kBackward, kBoth };
// Writes w's copies for `use` under p's recipe into `out` (w in any float dtype, rounded to
// `dtype` first, as the products see the compute copy; MX copies in `dtype`): each allocated when
// undefined, else overwritten in place (a captured step keeps their addresses); the copies `use`
// does not need are left as they are. Both from one read of w where `use` asks for both.
void make_weight_copies(const Tensor& w, const ExpertPrecision& p, DType dtype, CopyUse use,
                        WeightCopies& out);

// What the caller made beforehand for the forward and input-gradient MX and FP8 products
// (ignored by bf16): the weight's copies, (MX) the rows' MX values along the contraction (dim0),
// e.g. by the kernel that wrote the rows (ops::MxValuesOut), or the rows themselves when they
// arrived as MX values (an MXFP8 dispatch), and (FP8) the rows quantized along the contraction
// (ops::Fp8RowsOut). The product makes what is not given.
struct QuantOperands {
  const WeightCopies* weight = nullptr;
  const Tensor* rows = nullptr;
  const QuantTensor* fp8_rows = nullptr;
};

// Shapes as ops/grouped_gemm.h: x (M, K), w (E, K, N), out (M, N).
void expert_gemm_forward(const Tensor& x, const Tensor& w, const ExpertRows& rows,
                         const ExpertPrecision& p, Tensor& out, const QuantOperands& made = {});
void expert_gemm_backward_input(const Tensor& dy, const Tensor& w, const ExpertRows& rows,
                                const ExpertPrecision& p, Tensor& dx,
                                const QuantOperands& made = {});
void expert_gemm_backward_weight(const Tensor& x, const Tensor& dy, const ExpertRows& rows,
                                 const ExpertPrecision& p, Tensor& dw,
                                 Accumulate accumulate = Accumulate::kYes);

}  // namespace mt::ops
