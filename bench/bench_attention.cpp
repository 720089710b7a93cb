// Attention forward and forward + backward on packed causal documents at Qwen3-30B-A3B's heads
// (32 query / 4 kv heads, head dim 128), 16384 tokens, bf16: 8 documents of 2048 tokens, a ragged
// packing (random lengths, up to 4096), and one 4096-token document beside 12, 63 or 127 short
// ones (a whole-packed fine-tuning step). TFLOP/s on the causal FLOPs (sum over documents of
// 2 L^2 D H forward; backward counted as 2.5x forward, as PyTorch's benchmarks do). JSON lines.
// The PyTorch comparator (SDPA, cuDNN and flash backends) is bench/attention_torch.py.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "bench/bench_util.h"
#include "core/rng.h"
#include "ops/attention.h"

namespace {

struct Packing {
  const char* name;
  std::vector<int32_t> cu;
};

Packing uniform(int64_t n, int64_t len) {
  Packing p{"8x2048", {0}};
  for (int64_t at = len; at <= n; at += len) p.cu.push_back(static_cast<int32_t>(at));
  return p;
}

// Lengths uniform in [1, 4096] until the tokens run out (the last one takes the rest).
Packing ragged(int64_t n) {
  Packing p{"ragged", {0}};
  const mt::CounterRng rng{11, 2};
  for (int64_t i = 0; p.cu.back() < n; ++i) {
    const int64_t len = 1 + static_cast<int64_t>(rng.below(i, 4096));
    p.cu.push_back(static_cast<int32_t>(std::min<int64_t>(n, p.cu.back() + len)));
  }
  return p;
}

double causal_forward_flops(const std::vector<int32_t>& cu, int64_t heads, int64_t dim) {
  double flops = 0;
  for (size_t s = 0; s + 1 < cu.size(); ++s) {
    const double len = cu[s + 1] - cu[s];
    flops += 2.0 * len * len * dim * heads;
  }
  return flops;
}

// A packed fine-tuning step: one document of 4096 tokens beside `small` of equal length sharing
// the rest (whole packing puts a long sample's row and rows of many short ones in one step).
Packing one_long(int64_t n, int64_t small, const char* name) {
  Packing p{name, {0, 4096}};
  for (int64_t i = 1; i <= small; ++i)
    p.cu.push_back(static_cast<int32_t>(4096 + (n - 4096) * i / small));
  return p;
}

}  // namespace

int main() {
  using mt::Device;
  using mt::DType;
  using mt::Tensor;
  const int64_t n = 16384, h = 32, kv = 4, d = 128;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const Tensor q = mt::bench::random_bf16({n, h, d}, 1, 1.0),
               k = mt::bench::random_bf16({n, kv, d}, 2, 1.0),
               v = mt::bench::random_bf16({n, kv, d}, 3, 1.0),
               dout = mt::bench::random_bf16({n, h, d}, 4, 1.0);
  Tensor out = Tensor::empty({n, h, d}, DType::kBF16, Device::kCUDA),
         lse = Tensor::empty({n, h}, DType::kF32, Device::kCUDA);
  Tensor dq = Tensor::empty(q.shape(), DType::kBF16, Device::kCUDA),
         dk = Tensor::empty(k.shape(), DType::kBF16, Device::kCUDA),
         dv = Tensor::empty(v.shape(), DType::kBF16, Device::kCUDA);
  for (const Packing& p : {uniform(n, 2048), ragged(n), one_long(n, 12, "4096+12"),
                           one_long(n, 63, "4096+63"), one_long(n, 127, "4096+127")}) {
    Tensor cu = Tensor::empty({static_cast<int64_t>(p.cu.size())}, DType::kI32);
    for (size_t i = 0; i < p.cu.size(); ++i) cu.set_item(static_cast<int64_t>(i), p.cu[i]);
    const mt::ops::Documents docs{cu.to(Device::kCUDA), mt::ops::max_document_length(cu)};
    const double fwd_flops = causal_forward_flops(p.cu, h, d);
    const auto report = [&](const char* impl, const char* pass, double ms, double flops) {
      std::printf(
          "{\"bench\":\"attention\",\"impl\":\"%s\",\"pass\":\"%s\",\"packing\":\"%s\","
          "\"documents\":%zu,\"longest\":%lld,\"tokens\":%lld,\"heads\":%lld,\"kv_heads\":%lld,"
          "\"head_dim\":%lld,\"ms\":%.4f,\"tflops\":%.1f}\n",
          impl, pass, p.name, p.cu.size() - 1, static_cast<long long>(docs.max_length),
          static_cast<long long>(n), static_cast<long long>(h), static_cast<long long>(kv),
          static_cast<long long>(d), ms, flops / (ms * 1e-3) / 1e12);
    };
    const mt::ops::AttentionGpu cudnn{mt::ops::AttentionKernel::kCudnn};
    const auto forward = [&] { mt::ops::attention_forward(q, k, v, docs, scale, out, lse, cudnn); };
    report("cudnn", "fwd", mt::bench::median_ms(forward), fwd_flops);
    for (bool deterministic : {true, false}) {
      const double ms = mt::bench::median_ms([&] {
        forward();
        mt::ops::attention_backward(
            q, k, v, out, lse, dout, docs, scale, dq, dk, dv,
            {mt::ops::AttentionKernel::kCudnn,
             deterministic ? mt::ops::Determinism::kDeterministic : mt::ops::Determinism::kFast});
      });
      report(deterministic ? "cudnn_deterministic" : "cudnn", "fwd+bwd", ms, 3.5 * fwd_flops);
    }
    const double ref_ms = mt::bench::median_ms(
        [&] {
          mt::ops::attention_forward(q, k, v, docs, scale, out, lse,
                                     {mt::ops::AttentionKernel::kReference});
        },
        1, 3);
    report("reference_kernel", "fwd", ref_ms, fwd_flops);
    std::fflush(stdout);
  }
}
