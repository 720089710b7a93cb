// The FP8 GEMM workbench's two halves: the timed CUTLASS instantiations (fp8_gemm_variants.cu,
// no Tensor: nvcc never sees fmt) and the set-up with the engine's ops
// (fp8_gemm_variants_main.cpp).
#pragma once
#include <cstdint>

struct Fp8RowsProblem {
  const int64_t* offsets;  // dense segments on the device
  int experts;
  int64_t m, q, p;
  const void* a;
  const float* sfa;
  const void* b;
  const float* sfb;
  void* out;
  bool weight_transposed;  // the forward's b = w^T (MN-major scales) or the input gradient's w
};

constexpr int kFp8VariantCount = 4;
extern const char* const kFp8Variants[kFp8VariantCount];
double time_fp8_rows_variant(int variant, const Fp8RowsProblem& p);
