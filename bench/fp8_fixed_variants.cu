// Workbench for our FP8 kernel over the padded layout (src/ops/cuda/cutlass/
// fp8_gemm_sm90_fixed.cuh): the MoE layer's four row products (128 experts of about 1024 rows)
// with each tile shape, and with the probes that leave one part out (the promotion, the MMAs, A's
// scale loads) to see which part bounds a shape. JSON lines: time, TFLOP/s over the rows, the
// ratio to the 128 x 128 tile (`vs_shipped`, the product before two row tiles a CTA shipped), and
// each variant's output against that one's (bits that differ; a probe's output is not the
// product and differs). `waves` 2: a CTA's tile is two row tiles of one expert (256 rows, what
// ships), each weight tile read into shared memory once for both. `cluster` 2: two CTAs over a
// run's column tiles, A multicast to both (not shipped: slower, docs/benchmarks-history.md).
// `rows` ragged: experts of 512 to 1536 rows, odd row-tile counts among them. The variants run
// twice in turn: the GPU slows as it warms within a job, so compare neighbours. Built twice
// (CMakeLists.txt): as the product is compiled, and with ptxas's --register-usage-level=10 (`ptxas`
// in each line says which).
#include <cuda_runtime.h>

#include <cstdio>

#include "bench/workbench.cuh"
#include "ops/cuda/cutlass/fp8_gemm_sm90_fixed.cuh"

namespace {

namespace f = mt::cuda::fp8_fixed_sm90;
namespace k = mt::cuda::kernels;

constexpr int kExperts = 128;
constexpr int64_t kRowsPerExpert = 1024;

// Finite E4M3 bytes of magnitudes 2^-1 .. 7.5, both signs (exponent fields 6 .. 9: never NaN).
__global__ void fill_e4m3(uint8_t* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const uint32_t h = workbench::hash(i, seed);
    p[i] = static_cast<uint8_t>((h & 0x80) | (0x30 + ((h >> 8) & 0x1F)));
  }
}

struct Product {
  const char* name;
  int64_t p, q;
  k::Fp8WeightScales scales;
};

const char* probe_name(f::Probe probe) {
  switch (probe) {
    case f::Probe::kNone:
      return "none";
    case f::Probe::kNoPromotion:
      return "no_promotion";
    case f::Probe::kNoScaleLoads:
      return "no_scale_loads";
    default:
      return "no_mma";
  }
}

struct Buffers {
  const int64_t* segments;
  k::Fp8Operands ops;
  void* workspace;
  size_t workspace_bytes;
  int64_t capacity;
  bool ragged;
};

template <int kTileN, f::Probe kProbe, int kCluster = 1, int kWaves = 1>
void time_variant(const Product& pr, const Buffers& b, const __nv_bfloat16* shipped,
                  double shipped_ms, double* ms_out) {
  const auto call = [&] {
    WORKBENCH_CHECK((f::run<kTileN, kProbe, kCluster, kWaves>(
        b.segments, kExperts, b.ops, pr.scales, b.capacity, pr.p, pr.q, b.workspace,
        b.workspace_bytes, nullptr)));
  };
  WORKBENCH_CHECK(cudaMemset(b.ops.out, 0xFF, b.capacity * pr.p * 2));  // poison: NaN
  call();
  WORKBENCH_CHECK(cudaDeviceSynchronize());
  const double ms = workbench::median_ms(call);
  if (ms_out) *ms_out = ms;
  workbench::Differences d{};
  if (shipped)
    d = workbench::differences(static_cast<const __nv_bfloat16*>(b.ops.out), shipped,
                               b.capacity * pr.p);
  const double flops = 2.0 * b.capacity * pr.p * pr.q;
  std::printf(
      "{\"bench\": \"fp8_fixed_variant\", \"product\": \"%s\", \"shape\": \"%lld rows, Q %lld, P "
      "%lld\", \"rows\": \"%s\", \"tile_n\": %d, \"waves\": %d, \"cluster\": %d, \"probe\": "
      "\"%s\", \"ptxas\": \"%s\", \"ms\": %.4f, \"tflops\": %.1f, \"vs_shipped\": %.3f, "
      "\"differing\": %llu, \"max_abs\": %.3g}\n",
      pr.name, static_cast<long long>(b.capacity), static_cast<long long>(pr.q),
      static_cast<long long>(pr.p), b.ragged ? "ragged" : "balanced", kTileN, kWaves, kCluster,
      probe_name(kProbe), WORKBENCH_PTXAS, ms, flops / (ms * 1e-3) / 1e12,
      shipped_ms > 0 ? shipped_ms / ms : 1.0, d.differing, d.max_abs);
  std::fflush(stdout);
}

// Balanced: every expert 1024 rows (8 row tiles). Ragged: 1024 +- up to 512 rows in pairs of
// experts, each start rounded up to 128 (odd row-tile counts: runs of one row tile too).
void run_product(const Product& pr, bool ragged) {
  std::vector<int64_t> seg(kExperts + 1, 0);
  for (int e = 0; e < kExperts; ++e) {
    const int64_t delta = ragged ? (e / 2 * 997 % 1025) - 512 : 0;
    const int64_t rows = kRowsPerExpert + (e % 2 == 0 ? delta : -delta);
    seg[e + 1] = (seg[e] + rows + 127) / 128 * 128;
  }
  const int64_t capacity = seg[kExperts];
  int64_t* segments = nullptr;
  uint8_t *a = nullptr, *w = nullptr;
  float *sfa = nullptr, *sfb = nullptr;
  __nv_bfloat16 *out = nullptr, *shipped = nullptr;
  void* ws = nullptr;
  const size_t ws_bytes = f::workspace_bytes<128>(capacity, pr.p, pr.q);
  WORKBENCH_CHECK(cudaMalloc(&segments, seg.size() * sizeof(int64_t)));
  WORKBENCH_CHECK(
      cudaMemcpy(segments, seg.data(), seg.size() * sizeof(int64_t), cudaMemcpyHostToDevice));
  WORKBENCH_CHECK(cudaMalloc(&a, capacity * pr.q));
  WORKBENCH_CHECK(cudaMalloc(&w, kExperts * pr.p * pr.q));
  WORKBENCH_CHECK(cudaMalloc(&sfa, capacity * (pr.q / 128) * sizeof(float)));
  WORKBENCH_CHECK(cudaMalloc(&sfb, kExperts * (pr.p / 128) * (pr.q / 128) * sizeof(float)));
  WORKBENCH_CHECK(cudaMalloc(&out, capacity * pr.p * 2));
  WORKBENCH_CHECK(cudaMalloc(&shipped, capacity * pr.p * 2));
  WORKBENCH_CHECK(cudaMalloc(&ws, ws_bytes));
  fill_e4m3<<<1024, 256>>>(a, capacity * pr.q, 11);
  fill_e4m3<<<1024, 256>>>(w, kExperts * pr.p * pr.q, 12);
  workbench::fill_random<<<1024, 256>>>(sfa, capacity * (pr.q / 128), 13, 1.0f / 64);
  workbench::fill_random<<<1024, 256>>>(sfb, kExperts * (pr.p / 128) * (pr.q / 128), 14, 1.0f / 64);
  const Buffers b{segments, {a, sfa, w, sfb, out}, ws, ws_bytes, capacity, ragged};

  using f::Probe;
  double shipped_ms = 0;
  time_variant<128, Probe::kNone>(pr, b, nullptr, 0, &shipped_ms);
  WORKBENCH_CHECK(cudaMemcpy(shipped, out, capacity * pr.p * 2, cudaMemcpyDeviceToDevice));
  // Each variant twice, in turn: the GPU slows as it warms within a job.
  for (int pass = 0; pass < 2; ++pass) {
    time_variant<128, Probe::kNone, 1, 2>(pr, b, shipped, shipped_ms, nullptr);
    time_variant<128, Probe::kNone, 2, 2>(pr, b, shipped, shipped_ms, nullptr);
    time_variant<160, Probe::kNone>(pr, b, shipped, shipped_ms, nullptr);
    if (pass == 0) time_variant<128, Probe::kNone>(pr, b, shipped, shipped_ms, nullptr);
  }
  if (!ragged) {
    time_variant<128, Probe::kNoPromotion>(pr, b, shipped, shipped_ms, nullptr);
    time_variant<128, Probe::kNoMma>(pr, b, shipped, shipped_ms, nullptr);
    time_variant<128, Probe::kNoMma, 1, 2>(pr, b, shipped, shipped_ms, nullptr);
    time_variant<128, Probe::kNone, 1, 2>(pr, b, shipped, shipped_ms, nullptr);
    time_variant<128, Probe::kNoScaleLoads, 1, 2>(pr, b, shipped, shipped_ms, nullptr);
    time_variant<128, Probe::kNone, 1, 2>(pr, b, shipped, shipped_ms, nullptr);
    time_variant<128, Probe::kNoMma, 2, 2>(pr, b, shipped, shipped_ms, nullptr);
    time_variant<128, Probe::kNone, 2>(pr, b, shipped, shipped_ms, nullptr);
  }

  for (void* p : {static_cast<void*>(segments), static_cast<void*>(a), static_cast<void*>(w),
                  static_cast<void*>(sfa), static_cast<void*>(sfb), static_cast<void*>(out),
                  static_cast<void*>(shipped), ws})
    cudaFree(p);
}

}  // namespace

int main() {
  // The forward reads b = w^T's scales along P, the input gradient b = w's along its contraction.
  const Product products[] = {
      {"gate_up_forward", 1536, 2048, k::Fp8WeightScales::kMnMajor},
      {"down_forward", 2048, 768, k::Fp8WeightScales::kMnMajor},
      {"down_input_gradient", 768, 2048, k::Fp8WeightScales::kKMajor},
      {"gate_up_input_gradient", 2048, 1536, k::Fp8WeightScales::kKMajor},
  };
  for (const bool ragged : {false, true})
    for (const Product& pr : products) run_product(pr, ragged);
  return 0;
}
