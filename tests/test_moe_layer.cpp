// The MoE layer (moe/moe_layer.h) on the GPU against the CPU (ctest label `gpu`, tests/gpu_case.h).
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

#include "model/config.h"
#include "moe/moe_layer.h"
#include "op_testing.h"
#if MOETRAIN_HAS_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda/device.h"
#include "core/cuda/graph.h"
#include "gpu_case.h"
#endif

namespace mt {
namespace {

#if MOETRAIN_HAS_CUDA

struct GpuMoeLayer : GpuCase {};

// Zeroed f32 gradients for a layer's weights, on the host and on the GPU.
std::pair<moe::MoeWeights, moe::MoeWeights> zero_grads(const moe::MoeWeights& w) {
  moe::MoeWeights cpu{Tensor::zeros(w.router.shape(), DType::kF32),
                      Tensor::zeros(w.w_gate_up.shape(), DType::kF32),
                      Tensor::zeros(w.w_down.shape(), DType::kF32)};
  moe::MoeWeights gpu{cpu.router.to(Device::kCUDA), cpu.w_gate_up.to(Device::kCUDA),
                      cpu.w_down.to(Device::kCUDA)};
  return {cpu, gpu};
}

TEST_P(GpuMoeLayer, MoeLayerForwardBackwardMatchesCpu) {
  if (GetParam() != DType::kBF16) GTEST_SKIP() << "the GPU layer runs bf16 rows";
  ModelConfig c;
  c.dim = 256;
  c.moe_dim = 128;
  c.n_experts = 16;
  c.top_k = 4;
  c.routing = ops::RoutingMode::kBalanced;  // fixed choices: bf16 vs f32 logits cannot flip a top-k
  const int64_t n = 512, e = c.n_experts, d = c.dim, f = c.moe_dim;
  moe::MoeWeights cw{input({d, e}, 0.1), input({e, d, 2 * f}, 0.06), input({e, f, d}, 0.09)};
  moe::MoeWeights gw{gpu(cw.router), gpu(cw.w_gate_up), gpu(cw.w_down)};
  auto [cg, gg] = zero_grads(cw);
  const Tensor hn = input({n, d}), dout = input({n, d});
  moe::MoeActivations ca, ga;
  moe::moe_fill(cw, c.moe(), {}, Tensor(), hn, ca);
  moe::moe_fill(gw, c.moe(), {}, Tensor(), gpu(hn), ga);
  Tensor cout_ = Tensor::empty({n, d}, DType::kF32), gout = gpu_out({n, d});
  moe::moe_combine(cw, c.moe(), {}, ca, cout_);
  moe::moe_combine(gw, c.moe(), {}, ga, gout);
  const Tensor cdh = moe::moe_backward(cw, cg, c.moe(), {}, hn, ca, dout, 0.01);
  const Tensor gdh = moe::moe_backward(gw, gg, c.moe(), {}, gpu(hn), ga, gpu(dout), 0.01);
  // A chain of bf16 GEMMs and activations: each stage rounds, so 2e-2 end to end.
  const double tol = 2e-2;
  EXPECT_LT(relative_error(gout.to(DType::kF32), cout_), tol) << "layer output";
  EXPECT_LT(relative_error(gdh.to(DType::kF32), cdh), tol) << "d hn";
  EXPECT_LT(relative_error(gg.router, cg.router), tol) << "d router";
  EXPECT_LT(relative_error(gg.w_gate_up, cg.w_gate_up), tol) << "d w_gate_up";
  EXPECT_LT(relative_error(gg.w_down, cg.w_down), tol) << "d w_down";
  EXPECT_NEAR(ga.aux_loss.item(0), ca.aux_loss.item(0), 1e-4 * ca.aux_loss.item(0));
}

// Mixed precision keeps the router in fp32 (ParamSpec::master_weight): with fp32 weights that
// bf16 cannot hold and a bf16 input, the logits and the router's weight gradient (here from the
// load-balancing loss alone, so that no bf16 expert output enters it) are the CPU's fp32 GEMMs
// on the up-cast input to fp32 accuracy, not bf16's; the input gradient is rounded once.
TEST_P(GpuMoeLayer, MoeRouterRunsInFp32OnMasterWeights) {
  if (GetParam() != DType::kBF16) GTEST_SKIP() << "mixed precision: bf16 rows, fp32 router";
  ModelConfig c;
  c.dim = 256;
  c.moe_dim = 64;
  c.n_experts = 32;
  c.top_k = 4;
  // Fixed choices (the comparison is of the math) with uneven counts: under balanced counts the
  // load-balancing loss is flat in the logits (its gradient is rounding noise).
  c.routing = ops::RoutingMode::kSkewed;
  const int64_t n = 1024, e = c.n_experts, d = c.dim, f = c.moe_dim;
  const Tensor router = testing::randn({d, e}, seed + 101, 0.1, DType::kF32);  // not bf16 values
  moe::MoeWeights cw{router, input({e, d, 2 * f}, 0.06), input({e, f, d}, 0.09)};
  moe::MoeWeights gw{router.to(Device::kCUDA), gpu(cw.w_gate_up), gpu(cw.w_down)};
  auto [cg, gg] = zero_grads(cw);
  const Tensor hn = input({n, d}), dout = Tensor::zeros({n, d}, DType::kF32);
  moe::MoeActivations ca, ga;
  moe::moe_fill(cw, c.moe(), {}, Tensor(), hn, ca);
  moe::moe_fill(gw, c.moe(), {}, Tensor(), gpu(hn), ga);
  ASSERT_EQ(ga.logits.dtype(), DType::kF32);
  const Tensor glogits = ga.logits.to(Device::kCPU);
  ASSERT_TRUE(all_finite(glogits));
  EXPECT_LT(relative_error(glogits, ca.logits), 1e-5) << "logits, seed " << seed;
  const Tensor cdh = moe::moe_backward(cw, cg, c.moe(), {}, hn, ca, dout, 1.0);
  const Tensor gdh = moe::moe_backward(gw, gg, c.moe(), {}, gpu(hn), ga, gpu(dout), 1.0);
  const Tensor grouter = gg.router.to(Device::kCPU);
  double norm = 0;
  for (int64_t i = 0; i < cg.router.numel(); ++i) norm += std::abs(cg.router.item(i));
  EXPECT_GT(norm, 0.0) << "the load-balancing loss gives the router a gradient";
  EXPECT_LT(relative_error(grouter, cg.router), 1e-5) << "router weight gradient, seed " << seed;
  EXPECT_LT(relative_error(gdh.to(Device::kCPU).to(DType::kF32), cdh), 4e-3) << "d hn (bf16)";
}

MOETRAIN_GPU_CASES(GpuMoeLayer);

#endif  // MOETRAIN_HAS_CUDA

}  // namespace
}  // namespace mt
