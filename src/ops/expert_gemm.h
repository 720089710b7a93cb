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
// The forward and input-gradient MX products run ops::mx_grouped_gemm: the rows quantized along
// the contraction, the weight's MX values (quantized and dequantized along it) in the compute
// dtype. The weight gradient's MX product runs the emulated path: both operands quantized and
// dequantized along the tokens (mx_round_trip_expert_rows), then the grouped GEMM.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

#include "core/mx.h"
#include "core/tensor.h"
#include "ops/grouped_gemm.h"

namespace mt::ops {

enum class ExpertRecipe : uint8_t { kBf16, kMxfp8, kMxfp8WgradWithHp };
std::string_view expert_recipe_name(ExpertRecipe r);  // "bf16", "mxfp8", "mxfp8_wgrad_with_hp"
bool parse_expert_recipe(std::string_view name, ExpertRecipe* out);

// What the expert rows travel as in the dispatch (and the output gradient in the backward of
// the combine): bf16, or MXFP8 (1 x 32 blocks along the hidden dimension). The GEMMs then take
// rows quantized along dim0; rows cannot be quantized along the tokens (dim1) from them as from
// the original, so MXFP8 dispatch goes with mxfp8_wgrad_with_hp, or with mxfp8 and requant_dim1
// (the weight gradient re-quantizes the dequantized rows along dim1; docs/numerics.md).
enum class DispatchDtype : uint8_t { kBf16, kMxfp8 };
std::string_view dispatch_dtype_name(DispatchDtype d);  // "bf16", "mxfp8"
bool parse_dispatch_dtype(std::string_view name, DispatchDtype* out);

struct ExpertPrecision {
  ExpertRecipe recipe = ExpertRecipe::kBf16;
  MxScaleRule rule = MxScaleRule::kRceil;  // torchao's MXFP8 training recipes use RCEIL
  DispatchDtype dispatch = DispatchDtype::kBf16;
  bool requant_dim1 = false;

  bool mx_forward_and_input() const { return recipe != ExpertRecipe::kBf16; }
  bool mx_weight_gradient() const { return recipe == ExpertRecipe::kMxfp8; }
  // The combination's error (the coupling rule above), or empty when it is valid.
  std::string invalid_combination() const;
};

// A weight's MX copies, ops::mx_grouped_gemm's b operands, in w's dtype: w (E, K, N) quantized
// along K and stored transposed, (E, N, K), for the forward; quantized along N, (E, K, N), for the
// input gradient. FSDP makes them once per gather, or on one rank once per optimizer step
// (fsdp::refresh_mx_copies); the products make their own when given none.
struct MxWeightCopies {
  Tensor along_k;
  Tensor along_n;
};
// Writes w's copies into `out`: allocated when undefined, else overwritten in place (a captured
// step keeps their addresses).
void make_mx_weight_copies(const Tensor& w, MxScaleRule rule, MxWeightCopies& out);

// The rows as the dispatch delivers them: with MXFP8 dispatch, quantized along dim0 and
// dequantized (the emulated wire), in place; nothing otherwise.
void dispatched_rows(const ExpertPrecision& p, Tensor& rows);

// Shapes as ops/grouped_gemm.h: x (M, K), w (E, K, N), out (M, N).
// `copies`: w's MX copies when made beforehand (the MX recipes; ignored by bf16).
void expert_gemm_forward(const Tensor& x, const Tensor& w, const ExpertRows& rows,
                         const ExpertPrecision& p, Tensor& out,
                         const MxWeightCopies* copies = nullptr);
void expert_gemm_backward_input(const Tensor& dy, const Tensor& w, const ExpertRows& rows,
                                const ExpertPrecision& p, Tensor& dx,
                                const MxWeightCopies* copies = nullptr);
void expert_gemm_backward_weight(const Tensor& x, const Tensor& dy, const ExpertRows& rows,
                                 const ExpertPrecision& p, Tensor& dw,
                                 Accumulate accumulate = Accumulate::kYes);

}  // namespace mt::ops
