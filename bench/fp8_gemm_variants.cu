// Workbench for the FP8 blockwise grouped GEMM's configuration (src/ops/cuda/cutlass/
// fp8_gemm_sm90.cuh): times schedules and clusters of a row product over raw device operands
// (fp8_gemm_variants_main.cpp makes them and prints the JSON lines). The winner goes into
// fp8_gemm_sm90_rows.cu through the GPU tests.
#include <cuda_runtime.h>

#include "bench/fp8_gemm_variants.h"
#include "bench/workbench.cuh"
#include "ops/cuda/cutlass/fp8_gemm_sm90.cuh"

namespace {

using cute::_1;
using cute::_2;
using cute::GMMA::Major;
namespace f = mt::cuda::fp8_sm90;

template <class C>
double time_rows(const mt::cuda::kernels::ExpertSegments& seg, int experts, const f::Call& call) {
  void* ws = nullptr;
  const size_t bytes = f::workspace_bytes<C>(experts);
  WORKBENCH_CHECK(cudaMalloc(&ws, bytes));
  const double ms = workbench::median_ms([&] {
    WORKBENCH_CHECK((f::run<f::Product::kRows, C>(seg, experts, call, ws, bytes, false, nullptr)));
  });
  WORKBENCH_CHECK(cudaFree(ws));
  return ms;
}

template <Major SfbMajor>
double time_variant(int variant, const Fp8RowsProblem& p) {
  const mt::cuda::kernels::ExpertSegments seg{p.offsets, p.offsets};
  const f::Call call{{p.a, p.sfa, p.b, p.sfb, p.out}, p.m, p.q, p.p};
  using K = cute::Shape<_1, _1, _1>;
  using M2 = cute::Shape<_2, _1, _1>;
  using N2 = cute::Shape<_1, _2, _1>;
  switch (variant) {
    case 0:
      return time_rows<f::Config<f::Product::kRows, f::Cooperative, Major::K, SfbMajor, K>>(
          seg, p.experts, call);
    case 1:
      return time_rows<f::Config<f::Product::kRows, f::Cooperative, Major::K, SfbMajor, M2>>(
          seg, p.experts, call);
    case 2:
      return time_rows<f::Config<f::Product::kRows, f::Cooperative, Major::K, SfbMajor, N2>>(
          seg, p.experts, call);
    default:
      return time_rows<f::Config<f::Product::kRows, f::Pingpong, Major::K, SfbMajor, M2>>(
          seg, p.experts, call);
  }
}

}  // namespace

const char* const kFp8Variants[kFp8VariantCount] = {"cooperative_1x1", "cooperative_2x1",
                                                    "cooperative_1x2", "pingpong_2x1"};

double time_fp8_rows_variant(int variant, const Fp8RowsProblem& p) {
  return p.weight_transposed ? time_variant<Major::MN>(variant, p)
                             : time_variant<Major::K>(variant, p);
}
