// The MoE layer forward + backward at the Qwen3-30B-A3B shape (16384 tokens, dim 2048, expert
// dim 768, 128 experts, top-8, bf16), real and forced-balanced routing: JSON lines with the time
// and the ratio to the expert-GEMM floor (6 GEMMs at the dense ceiling measured in the run).
// The PyTorch comparator (eager and torch.compile) is bench/moe_layer_torch.py.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <vector>

#include "core/cuda_check.h"
#include "core/rng.h"
#include "moe/moe_layer.h"
#include "ops/gemm.h"

namespace {

using mt::Device;
using mt::DType;
using mt::Tensor;

Tensor random_bf16(const mt::Shape& s, uint64_t seed, double scale) {
  constexpr int64_t kBlock = 1 << 22;
  Tensor block = Tensor::empty({kBlock}, DType::kBF16);
  const mt::CounterRng rng{seed, 1};
  for (int64_t i = 0; i < kBlock; ++i)
    block.data<mt::bf16>()[i] = mt::to_bf16(static_cast<float>(scale * rng.normal(i)));
  Tensor t = Tensor::empty(s, DType::kBF16, Device::kCUDA);
  for (int64_t at = 0; at < t.numel(); at += kBlock) {
    const int64_t len = std::min(kBlock, t.numel() - at);
    Tensor dst = t.view(at, {len});
    dst.copy_from(block.view(0, {len}));
  }
  return t;
}

double median_ms(const std::function<void()>& fn, int warmup = 3, int reps = 10) {
  for (int i = 0; i < warmup; ++i) fn();
  cudaEvent_t a, b;
  MT_CUDA_CHECK(cudaEventCreate(&a));
  MT_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<float> ms(reps);
  for (float& t : ms) {
    MT_CUDA_CHECK(cudaEventRecord(a));
    fn();
    MT_CUDA_CHECK(cudaEventRecord(b));
    MT_CUDA_CHECK(cudaEventSynchronize(b));
    MT_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
  }
  std::sort(ms.begin(), ms.end());
  return ms[reps / 2];
}

}  // namespace

int main() {
  mt::ModelConfig c;
  c.dim = 2048;
  c.moe_dim = 768;
  c.n_experts = 128;
  c.top_k = 8;
  const int64_t n = 16384, d = c.dim, f = c.moe_dim, e = c.n_experts;
  const mt::moe::MoeWeights w{random_bf16({d, e}, 1, 0.02), random_bf16({e, d, 2 * f}, 2, 0.02),
                              random_bf16({e, f, d}, 3, 0.02)};
  mt::moe::MoeWeights g{Tensor::zeros({d, e}, DType::kF32, Device::kCUDA),
                        Tensor::zeros({e, d, 2 * f}, DType::kF32, Device::kCUDA),
                        Tensor::zeros({e, f, d}, DType::kF32, Device::kCUDA)};
  const Tensor hn = random_bf16({n, d}, 4, 1.0), dout = random_bf16({n, d}, 5, 1.0);

  // Ceiling for the floor: cuBLASLt bf16 at 8192^3 in this run.
  const Tensor a = random_bf16({8192, 8192}, 6, 1.0), b = random_bf16({8192, 8192}, 7, 1.0);
  Tensor cc = Tensor::empty({8192, 8192}, DType::kBF16, Device::kCUDA);
  const double dense_ms = median_ms([&] {
    mt::ops::gemm(a, mt::ops::Transpose::kNo, b, mt::ops::Transpose::kNo, cc,
                  mt::ops::Accumulate::kNo);
  });
  const double ceiling = 2.0 * 8192 * 8192 * 8192 / (dense_ms * 1e-3);
  // Expert GEMM FLOPs: forward 2 GEMMs (gate|up 2F wide, down), backward 4 (dx and dw of each).
  const double expert_flops = 3.0 * 2.0 * n * c.top_k * (d * 2 * f + f * d);
  const double floor_ms = expert_flops / ceiling * 1e3;

  for (bool balanced : {false, true}) {
    c.force_balanced_routing = balanced;
    // Stages, each timed on its own with the earlier stages' outputs ready (where the time goes).
    const double router_ms = median_ms([&] {
      mt::moe::MoeActivations act;
      act.xe = act.gate_up = act.act = act.y = hn;  // present: moe_fill stops after routing
      mt::moe::moe_fill(w, c, {}, Tensor(), hn, act);  // router GEMM, top-k, stats, permutation
    });
    mt::moe::MoeActivations full;
    const double fill_ms = median_ms([&] {
      full = mt::moe::MoeActivations();
      mt::moe::moe_fill(w, c, {}, Tensor(), hn, full);
    });
    Tensor out = Tensor::empty({n, d}, DType::kBF16, Device::kCUDA);
    const double combine_ms = median_ms([&] { mt::moe::moe_combine(full, out); });
    const double backward_ms =
        median_ms([&] { (void)mt::moe::moe_backward(w, g, c, hn, full, dout, 0.001); });
    std::printf("{\"bench\": \"moe_layer_stages\", \"routing\": \"%s\", \"router_topk_permutation_ms\": "
                "%.3f, \"forward_fill_ms\": %.3f, \"combine_ms\": %.3f, \"backward_ms\": %.3f}\n",
                balanced ? "balanced" : "real", router_ms, fill_ms, combine_ms, backward_ms);
    const double ms = median_ms([&] {
      mt::moe::MoeActivations act;
      mt::moe::moe_fill(w, c, {}, Tensor(), hn, act);
      Tensor layer_out = Tensor::empty({n, d}, DType::kBF16, Device::kCUDA);
      mt::moe::moe_combine(act, layer_out);
      (void)mt::moe::moe_backward(w, g, c, hn, act, dout, 0.001);
    });
    std::printf("{\"bench\": \"moe_layer_fwd_bwd\", \"shape\": \"16384 tok, dim 2048, F 768, 128 "
                "experts, top-8, bf16\", \"routing\": \"%s\", \"ms\": %.3f, "
                "\"expert_gemm_floor_ms\": %.3f, \"ratio_to_floor\": %.2f}\n",
                balanced ? "balanced" : "real", ms, floor_ms, ms / floor_ms);
    std::fflush(stdout);
  }
  return 0;
}
