// Context parallelism on the Qwen3-30B-A3B layer shapes (dim 2048, 32/4 heads of 128, 128
// experts of 768, top-8): one row of 32768 or 65536 tokens (one document: the long-context case)
// split over cp = 1, 2, 4, 8 ranks. Measured on one GPU, per rank: the attention forward + backward
// of each rank's queries against the row's keys (cuDNN, deterministic, as training runs it; the
// ranks' causal work is equal, ops::context_parallel_rows, but not their kernels' rates: the
// slowest rank's is the layer's) and the attention projections' GEMMs at a rank's tokens. Modelled
// (docs/benchmarks.md writes the model down): the bytes each rank receives in the layer's K/V
// all-gathers and dK/dV reduce-scatter and their time at MOETRAIN_CP_LINK_GBPS (default 200 GB/s
// per GPU, NCCL's measured rate between two H200s at 16-128 MiB: ../shared/GPU.md), and the
// per-rank activation memory of the 8-layer preset from the memory estimate (model/memory.h) under
// checkpoint none and selective. JSON lines.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "bench/bench_util.h"
#include "model/memory.h"
#include "ops/attention.h"
#include "ops/gemm.h"

namespace {

mt::ModelConfig preset(mt::CheckpointPolicy policy) {
  mt::ModelConfig m;
  m.vocab_size = 151936;
  m.dim = 2048;
  m.n_layers = 8;
  m.n_heads = 32;
  m.n_kv_heads = 4;
  m.head_dim = 128;
  m.n_experts = 128;
  m.top_k = 8;
  m.moe_dim = 768;
  m.loss_chunk_tokens = 8192;
  m.checkpoint = policy;
  m.device = mt::Device::kCUDA;
  return m;
}

}  // namespace

int main() {
  using mt::Device;
  using mt::DType;
  using mt::Tensor;
  const int64_t h = 32, kv = 4, d = 128, dim = 2048;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const char* link = std::getenv("MOETRAIN_CP_LINK_GBPS");
  const double gbps = link ? std::atof(link) : 200.0;
  for (const int64_t n : {32768, 65536}) {
    const Tensor k = mt::bench::random_bf16({n, kv, d}, 2, 1.0),
                 v = mt::bench::random_bf16({n, kv, d}, 3, 1.0);
    Tensor cu = Tensor::empty({2}, DType::kI32);
    cu.set_item(0, 0);
    cu.set_item(1, static_cast<double>(n));
    const mt::ops::Documents docs{cu.to(Device::kCUDA), n};
    for (const int64_t cp : {1, 2, 4, 8}) {
      const int64_t nq = n / cp;
      const Tensor q = mt::bench::random_bf16({nq, h, d}, 1, 1.0),
                   dout = mt::bench::random_bf16({nq, h, d}, 4, 1.0);
      Tensor out = Tensor::empty({nq, h, d}, DType::kBF16, Device::kCUDA),
             lse = Tensor::empty({nq, h}, DType::kF32, Device::kCUDA),
             dq = Tensor::empty(q.shape(), DType::kBF16, Device::kCUDA),
             dk = Tensor::empty(k.shape(), DType::kBF16, Device::kCUDA),
             dv = Tensor::empty(v.shape(), DType::kBF16, Device::kCUDA);
      // Every rank's (a step waits for the slowest): their key ranges differ.
      std::vector<double> rank_ms;
      for (int64_t r = 0; r < cp; ++r) {
        const mt::ops::ContextChunks chunks{n, cp, r};
        rank_ms.push_back(mt::bench::median_ms(
            [&] {
              if (cp == 1) {
                mt::ops::attention_forward(q, k, v, docs, scale, out, lse);
                mt::ops::attention_backward(q, k, v, out, lse, dout, docs, scale, dq, dk, dv);
              } else {
                mt::ops::attention_forward_rows(q, chunks, k, v, docs, scale, out, lse);
                mt::ops::attention_backward_rows(q, chunks, k, v, out, lse, dout, docs, scale, dq,
                                                 dk, dv);
              }
            },
            2, 5));
      }
      const double attention_ms = *std::max_element(rank_ms.begin(), rank_ms.end());
      // The projections at the rank's tokens: q|k|v (dim -> 4096 + 2 x 512) and o (4096 -> dim),
      // forward and both gradients.
      const Tensor x = mt::bench::random_bf16({nq, dim}, 5, 1.0),
                   a = mt::bench::random_bf16({nq, h * d}, 6, 1.0),
                   w_qkv = mt::bench::random_bf16({dim, (h + 2 * kv) * d}, 7, 0.02),
                   w_o = mt::bench::random_bf16({h * d, dim}, 8, 0.02);
      Tensor y_qkv = Tensor::empty({nq, (h + 2 * kv) * d}, DType::kBF16, Device::kCUDA),
             y_o = Tensor::empty({nq, dim}, DType::kBF16, Device::kCUDA),
             dx = Tensor::empty(x.shape(), DType::kBF16, Device::kCUDA),
             da = Tensor::empty(a.shape(), DType::kBF16, Device::kCUDA),
             dw_qkv = Tensor::zeros(w_qkv.shape(), DType::kBF16, Device::kCUDA),
             dw_o = Tensor::zeros(w_o.shape(), DType::kBF16, Device::kCUDA);
      const double projections_ms = mt::bench::median_ms(
          [&] {
            mt::ops::linear_forward(x, w_qkv, y_qkv);
            mt::ops::linear_forward(a, w_o, y_o);
            mt::ops::linear_backward(x, w_qkv, y_qkv, dx, dw_qkv);
            mt::ops::linear_backward(a, w_o, y_o, da, dw_o);
          },
          2, 5);
      // Each layer: K and V gathered in the forward and again in the backward, dK and dV
      // reduce-scattered; a rank receives (cp - 1) / cp of the rows' K and V each time.
      const double kv_bytes = static_cast<double>(n * kv * d * 2 * 2);
      const double received = cp == 1 ? 0.0 : 3.0 * kv_bytes * static_cast<double>(cp - 1) / cp;
      const double link_ms = received / (gbps * 1e9) * 1e3;
      mt::ParallelConfig p;
      p.world = cp;
      p.cp = cp;
      const double gib = 1024.0 * 1024.0 * 1024.0;
      const double act_none =
          mt::estimate_memory(preset(mt::CheckpointPolicy::kNone), p, n).activations / gib;
      const double act_selective =
          mt::estimate_memory(preset(mt::CheckpointPolicy::kSelective), p, n).activations / gib;
      std::printf(
          "{\"bench\":\"context_parallel\",\"tokens\":%lld,\"cp\":%lld,\"rank_tokens\":%lld,"
          "\"heads\":%lld,\"kv_heads\":%lld,\"head_dim\":%lld,\"attention_fwd_bwd_ms\":%.3f,"
          "\"attention_ranks_ms\":[%s],"
          "\"projections_fwd_bwd_ms\":%.3f,\"kv_received_mib_per_layer\":%.1f,"
          "\"kv_link_ms_model\":%.3f,\"link_gbps\":%.0f,"
          "\"activations_gib_8_layers_none\":%.2f,\"activations_gib_8_layers_selective\":%.2f}\n",
          static_cast<long long>(n), static_cast<long long>(cp), static_cast<long long>(nq),
          static_cast<long long>(h), static_cast<long long>(kv), static_cast<long long>(d),
          attention_ms, mt::bench::join(rank_ms).c_str(), projections_ms, received / (1 << 20),
          link_ms, gbps, act_none, act_selective);
      std::fflush(stdout);
    }
  }
}
