// The dense GEMM and the linear layers (ops/gemm.h): the CPU reference (hand-checked cases, fp64
// finite-difference gradients of L = sum(out * G) with a fixed random G) and, in the Gpu* cases
// (ctest label `gpu`), the CUDA kernels against it (tests/gpu_case.h).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <tuple>

#include "op_testing.h"
#include "ops/gemm.h"
#if MOETRAIN_HAS_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda/device.h"
#include "core/cuda/graph.h"
#include "gpu_case.h"
#endif

namespace mt {
namespace {

TEST(Gemm, MatchesNaiveLoopsForEveryTranspose) {
  const Tensor a = randn({5, 7}, 1), b = randn({7, 4}, 2);
  const Tensor at = randn({7, 5}, 1), bt = randn({4, 7}, 2);
  for (auto ta : {ops::Transpose::kNo, ops::Transpose::kYes})
    for (auto tb : {ops::Transpose::kNo, ops::Transpose::kYes}) {
      const Tensor& A = ta == ops::Transpose::kNo ? a : at;
      const Tensor& B = tb == ops::Transpose::kNo ? b : bt;
      Tensor c = Tensor::poisoned({5, 4}, DType::kF64);
      ops::gemm(A, ta, B, tb, c, ops::Accumulate::kNo);
      for (int i = 0; i < 5; ++i)
        for (int j = 0; j < 4; ++j) {
          double ref = 0;
          for (int p = 0; p < 7; ++p)
            ref += (ta == ops::Transpose::kNo ? A.item(i * 7 + p) : A.item(p * 5 + i)) *
                   (tb == ops::Transpose::kNo ? B.item(p * 4 + j) : B.item(j * 7 + p));
          EXPECT_NEAR(c.item(i * 4 + j), ref, 1e-12);
        }
    }
}

TEST(Linear, Gradients) {
  Tensor x = randn({4, 6}, 1), w = randn({6, 5}, 2), g = randn({4, 5}, 3);
  auto loss = [&] {
    Tensor y = Tensor::empty({4, 5}, DType::kF64);
    ops::linear_forward(x, w, y);
    return dot(y, g);
  };
  Tensor dx = like(x), dw = Tensor::zeros(w.shape(), DType::kF64);
  ops::linear_backward(x, w, g, dx, dw);
  EXPECT_LT(gradcheck(loss, x, dx), kGradTol);
  EXPECT_LT(gradcheck(loss, w, dw), kGradTol);
}

// The weight gradient alone adds x^T dy, or for a weight stored (out, in) and used transposed (a
// tied LM head's table) its transpose dy^T x, to what dw held; the pair with a transposed weight
// gives the input gradient dy w of the stored (out, in) w.
TEST(Linear, WeightGradientAloneInEitherStoredOrientation) {
  const Tensor x = randn({4, 6}, 1), g = randn({4, 5}, 3), w = randn({6, 5}, 2);
  Tensor want = w.clone(), want_t = Tensor::empty({5, 6}, DType::kF64);
  Tensor dx = like(x);
  ops::linear_backward(x, w, g, dx, want);
  for (int64_t j = 0; j < 5; ++j)
    for (int64_t i = 0; i < 6; ++i) want_t.set_item(j * 6 + i, want.item(i * 5 + j));
  Tensor dw = w.clone(), dw_t = Tensor::empty({5, 6}, DType::kF64);
  for (int64_t j = 0; j < 5; ++j)
    for (int64_t i = 0; i < 6; ++i) dw_t.set_item(j * 6 + i, w.item(i * 5 + j));
  ops::linear_backward_weight(x, g, dw);
  ops::linear_backward_weight(x, g, dw_t, ops::Transpose::kYes);
  EXPECT_LT(relative_error(dw, want), 1e-14);
  EXPECT_LT(relative_error(dw_t, want_t), 1e-14);
  EXPECT_GT(relative_error(want, w), 1e-3);        // the gradient added something
  Tensor wt = Tensor::empty({5, 6}, DType::kF64);  // w stored (out, in)
  for (int64_t j = 0; j < 5; ++j)
    for (int64_t i = 0; i < 6; ++i) wt.set_item(j * 6 + i, w.item(i * 5 + j));
  Tensor dx_t = like(x), dw_pair = Tensor::zeros({5, 6}, DType::kF64),
         want_dw = Tensor::zeros({5, 6}, DType::kF64);
  ops::linear_backward_weight(x, g, want_dw, ops::Transpose::kYes);
  ops::linear_backward(x, wt, g, dx_t, dw_pair, ops::Accumulate::kNo, ops::Transpose::kYes);
  EXPECT_LT(relative_error(dx_t, dx), 1e-14);  // dy (w^T)^T = dy w^T of the (in, out) weight
  EXPECT_LT(relative_error(dw_pair, want_dw), 1e-14);
}

TEST(Linear, ResidualInTheEpilogueEqualsTheSum) {
  const Tensor x = randn({4, 6}, 1), w = randn({6, 5}, 2), r = randn({4, 5}, 3);
  Tensor plain = Tensor::empty({4, 5}, DType::kF64), fused = Tensor::poisoned({4, 5}, DType::kF64);
  ops::linear_forward(x, w, plain);
  ops::linear_forward_residual(x, w, r, fused);
  for (int64_t i = 0; i < plain.numel(); ++i)
    EXPECT_NEAR(fused.item(i), plain.item(i) + r.item(i), 1e-13) << i;
  EXPECT_THROW(ops::linear_forward_residual(x, w, fused, fused), Error);  // in place: refused
}

#if MOETRAIN_HAS_CUDA

struct GpuGemm : GpuCase {};

TEST_P(GpuGemm, GemmEveryTransposeAndAccumulate) {
  const int64_t m = 384, n = 200, k = 264;
  for (auto ta : {ops::Transpose::kNo, ops::Transpose::kYes})
    for (auto tb : {ops::Transpose::kNo, ops::Transpose::kYes}) {
      const Tensor a = ta == ops::Transpose::kNo ? input({m, k}) : input({k, m});
      const Tensor b = tb == ops::Transpose::kNo ? input({k, n}) : input({n, k});
      Tensor c = input({m, n});
      const Tensor c0 = c.clone();
      Tensor gc_acc = gpu(c).to(DType::kF32);  // f32 output accumulating bf16/f32 products
      ops::gemm(a, ta, b, tb, c, ops::Accumulate::kYes);
      ops::gemm(gpu(a), ta, gpu(b), tb, gc_acc, ops::Accumulate::kYes);
      expect_close(gc_acc, c, "gemm accumulate into f32");
      Tensor gc_same = gpu(c0);  // accumulating in the operands' dtype (bf16: residual sums)
      ops::gemm(gpu(a), ta, gpu(b), tb, gc_same, ops::Accumulate::kYes);
      expect_close(gc_same, c, "gemm accumulate in place");
      Tensor ref = Tensor::empty({m, n}, DType::kF32), gc = gpu_out({m, n});
      ops::gemm(a, ta, b, tb, ref, ops::Accumulate::kNo);
      ops::gemm(gpu(a), ta, gpu(b), tb, gc, ops::Accumulate::kNo);
      expect_close(gc, ref, "gemm");
    }
  // The residual read by the epilogue (C) into another buffer (D).
  const Tensor x = input({m, k}), w = input({k, n}), r = input({m, n});
  Tensor ref = Tensor::empty({m, n}, DType::kF32), out = gpu_out({m, n});
  ops::linear_forward_residual(x, w, r, ref);
  ops::linear_forward_residual(gpu(x), gpu(w), gpu(r), out);
  expect_close(out, ref, "linear + residual epilogue");
}

MOETRAIN_GPU_CASES(GpuGemm);

#endif  // MOETRAIN_HAS_CUDA

}  // namespace
}  // namespace mt
