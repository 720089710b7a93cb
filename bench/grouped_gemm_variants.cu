// Workbench for the CUTLASS grouped GEMM configuration: times tile shapes, clusters and
// schedules of each expert product (forward, dx, dw) at both Qwen3-30B-A3B expert shapes
// (gate|up: k 2048, n 1536; down: k 768, n 2048), on balanced experts and on ragged ones
// (rows drawn between 0.5x and 1.5x the mean, not multiples of the tile). JSON lines; the winner
// goes into src/ops/cuda/cutlass/grouped_gemm_sm90.cuh through the GPU tests. VARIANTS_PRODUCT
// picks one product; VARIANTS_ORDERS times the f32 weight gradient's tiles under the scheduler's
// tile orders instead (VARIANTS_PAIRED: candidates in turn over rounds); VARIANTS_ONCE launches
// each once, untimed, for a profiler.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string_view>
#include <type_traits>
#include <vector>

#include "ops/cuda/cutlass/grouped_gemm_sm90.cuh"
#include "workbench.cuh"

namespace variants {

using cute::_1;
using cute::_128;
using cute::_2;
using cute::_256;
using cute::_64;
using cute::Shape;
using cutlass::layout::ColumnMajor;
using cutlass::layout::RowMajor;
using mt::cuda::grouped_sm90::Config;
using mt::cuda::grouped_sm90::Cooperative;
using mt::cuda::grouped_sm90::Pingpong;
using mt::cuda::grouped_sm90::Product;
using bf = cutlass::bfloat16_t;

using workbench::fill_random;
#define CHECK WORKBENCH_CHECK

// One problem: offsets on the device and the buffers every product reads or writes.
struct Problem {
  const char* routing;
  int experts;
  int64_t m, k, n;
  const int64_t* offsets;
  const bf* x;   // (m, k)
  const bf* w;   // (experts, k, n)
  const bf* dy;  // (m, n)
  bf* out;       // (m, max(k, n)) bf16
  float* dw;     // (experts, k, n) f32
};

const char* product_name(Product p) {
  return p == Product::kForward ? "forward" : p == Product::kInputGradient ? "dx" : "dw";
}

using mt::cuda::grouped_sm90::TileOrder;

const char* raster_name(TileOrder order) {
  return order.raster == TileOrder::Raster::kAlongN ? "n" : "m";
}

double tflops(const Problem& pr, double ms) {
  return 2.0 * pr.m * pr.k * pr.n / (ms * 1e-3) / 1e12;
}

// VARIANTS_ONCE=1: each variant launched once, untimed (for a profiler's counters).
const bool kOnce = std::getenv("VARIANTS_ONCE") != nullptr;

// One variant's call, its workspace owned until the end of the process.
template <Product P, class C>
std::function<void()> make_call(const Problem& pr, TileOrder order) {
  const size_t bytes = mt::cuda::grouped_sm90::workspace_bytes<P, C>(pr.experts);
  void* ws = nullptr;
  CHECK(cudaMalloc(&ws, bytes));
  const void* lhs = P == Product::kInputGradient ? static_cast<const void*>(pr.dy) : pr.x;
  const void* rhs = P == Product::kWeightGradient ? static_cast<const void*>(pr.dy) : pr.w;
  // The weight gradient in f32 or bf16 (the f32 buffer holds either).
  void* out = P == Product::kWeightGradient ? static_cast<void*>(pr.dw) : pr.out;
  return [=] {
    CHECK((mt::cuda::grouped_sm90::run<P, C>({pr.offsets, pr.offsets}, pr.experts, lhs, rhs, out,
                                             pr.m, pr.k, pr.n, ws, bytes, nullptr, false, order)));
  };
}

template <Product P, class C>
void time_variant(const char* name, const Problem& pr, TileOrder order = {}) {
  const std::function<void()> call = make_call<P, C>(pr, order);
  const char* raster = raster_name(order);
  if (kOnce) {
    call();
    CHECK(cudaDeviceSynchronize());
    std::printf(
        "{\"bench\": \"grouped_variant_once\", \"product\": \"%s\", \"shape\": \"k%ld n%ld\", "
        "\"routing\": \"%s\", \"variant\": \"%s\", \"raster\": \"%s\", \"swizzle\": %d}\n",
        product_name(P), static_cast<long>(pr.k), static_cast<long>(pr.n), pr.routing, name, raster,
        order.swizzle);
    std::fflush(stdout);
    return;
  }
  const double med = workbench::median_ms(call);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  // The same calls queued back to back: what the GPU takes when the host is never waited for
  // (the difference to `ms` is launch and argument set-up latency).
  constexpr int kQueued = 20;
  cudaEventRecord(a);
  for (int i = 0; i < kQueued; ++i) call();
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float queued = 0;
  cudaEventElapsedTime(&queued, a, b);
  queued /= kQueued;
  std::printf(
      "{\"bench\": \"grouped_variant\", \"product\": \"%s\", \"shape\": \"k%ld n%ld\", "
      "\"routing\": \"%s\", \"variant\": \"%s\", \"raster\": \"%s\", \"swizzle\": %d, "
      "\"out\": \"%s\", \"ms\": %.4f, \"tflops\": %.1f, \"ms_queued\": %.4f}\n",
      product_name(P), static_cast<long>(pr.k), static_cast<long>(pr.n), pr.routing, name, raster,
      order.swizzle, std::is_same_v<typename C::ElementOutput, float> ? "f32" : "bf16", med,
      tflops(pr, med), queued);
  std::fflush(stdout);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
}

// The f32 weight gradient's two tiles (pingpong 128x128 shipped, cooperative 128x256) under the
// scheduler's tile orders (VARIANTS_ORDERS=1): whether the operands' reuse in L2 bounds it. With
// VARIANTS_PAIRED=1, a few candidates timed in turn over rounds (the GPU's clock drifts between
// readings by more than they differ), each against the shipped one in the same round.
template <class A, class B, class Out, Product P>
void time_orders(const Problem& pr) {
  using Shipped = Config<A, B, Out, Shape<_128, _128, _64>, Shape<_1, _1, _1>, Pingpong>;
  using Wide = Config<A, B, Out, Shape<_128, _256, _64>, Shape<_1, _1, _1>, Cooperative>;
  using R = TileOrder::Raster;
  if (!std::getenv("VARIANTS_PAIRED")) {
    for (const auto raster : {R::kAlongM, R::kAlongN})
      for (const int swizzle : {1, 2, 4, 8}) {
        time_variant<P, Shipped>("pingpong 128x128x64 1x1", pr, {raster, swizzle});
        time_variant<P, Wide>("coop 128x256x64 1x1", pr, {raster, swizzle});
      }
    return;
  }
  struct Candidate {
    const char* name;
    TileOrder order;
    std::function<void()> call;
    std::vector<double> ms, ratio;
  };
  std::vector<Candidate> c;
  const auto add = [&](const char* name, TileOrder order, std::function<void()> call) {
    c.push_back({name, order, std::move(call), {}, {}});
  };
  add("pingpong 128x128x64 1x1", {R::kAlongM, 1}, make_call<P, Shipped>(pr, {R::kAlongM, 1}));
  add("pingpong 128x128x64 1x1", {R::kAlongN, 2}, make_call<P, Shipped>(pr, {R::kAlongN, 2}));
  add("coop 128x256x64 1x1", {R::kAlongM, 1}, make_call<P, Wide>(pr, {R::kAlongM, 1}));
  add("coop 128x256x64 1x1", {R::kAlongN, 1}, make_call<P, Wide>(pr, {R::kAlongN, 1}));
  constexpr int kRounds = 7;
  for (int round = 0; round < kRounds; ++round)
    for (Candidate& v : c) {
      v.ms.push_back(workbench::median_ms(v.call));
      v.ratio.push_back(c[0].ms.back() / v.ms.back());
    }
  const auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  for (const Candidate& v : c) {
    const double ms = median(v.ms);
    std::printf(
        "{\"bench\": \"grouped_variant_paired\", \"product\": \"%s\", \"shape\": \"k%ld n%ld\", "
        "\"routing\": \"%s\", \"variant\": \"%s\", \"raster\": \"%s\", \"swizzle\": %d, "
        "\"ms\": %.4f, \"tflops\": %.1f, \"speedup_vs_shipped\": %.3f, \"min_max\": [%.3f, "
        "%.3f]}\n",
        product_name(P), static_cast<long>(pr.k), static_cast<long>(pr.n), pr.routing, v.name,
        raster_name(v.order), v.order.swizzle, ms, tflops(pr, ms), median(v.ratio),
        *std::min_element(v.ratio.begin(), v.ratio.end()),
        *std::max_element(v.ratio.begin(), v.ratio.end()));
    std::fflush(stdout);
  }
}

template <class A, class B, class Out, Product P>
void time_product(const Problem& pr) {
  // The shipped ones (cooperative wide, pingpong square) and the next candidates.
  time_variant<P, Config<A, B, Out, Shape<_128, _256, _64>, Shape<_1, _1, _1>, Cooperative>>(
      "coop 128x256x64 1x1", pr);
  time_variant<P, Config<A, B, Out, Shape<_128, _128, _64>, Shape<_1, _1, _1>, Pingpong>>(
      "pingpong 128x128x64 1x1", pr);
  time_variant<P, Config<A, B, Out, Shape<_128, _128, _64>, Shape<_1, _2, _1>, Pingpong>>(
      "pingpong 128x128x64 1x2", pr);
  time_variant<P, Config<A, B, Out, Shape<_128, _64, _64>, Shape<_1, _1, _1>, Pingpong>>(
      "pingpong 128x64x64 1x1", pr);
  time_variant<P, Config<A, B, Out, Shape<_256, _128, _64>, Shape<_1, _1, _1>, Cooperative>>(
      "coop 256x128x64 1x1", pr);
  time_variant<P, Config<A, B, Out, Shape<_128, _128, _128>, Shape<_1, _1, _1>, Cooperative>>(
      "coop 128x128x128 1x1", pr);
}

}  // namespace variants

int main() {
  using namespace variants;
  const int experts = 128;
  const int64_t mean_rows = 1024, m = experts * mean_rows, big = 2048;
  int64_t* d_off;
  bf *x, *w, *dy, *out;
  float* dw;
  CHECK(cudaMalloc(&d_off, sizeof(int64_t) * (experts + 1)));
  CHECK(cudaMalloc(&x, sizeof(bf) * m * big));
  CHECK(cudaMalloc(&w, sizeof(bf) * experts * big * big));
  CHECK(cudaMalloc(&dy, sizeof(bf) * m * big));
  CHECK(cudaMalloc(&out, sizeof(bf) * m * big));
  CHECK(cudaMalloc(&dw, sizeof(float) * experts * big * big));
  fill_random<<<1024, 256>>>(x, m * big, 1, 1.0f);
  fill_random<<<1024, 256>>>(w, experts * big * big, 2, 0.05f);
  fill_random<<<1024, 256>>>(dy, m * big, 3, 1.0f);
  CHECK(cudaDeviceSynchronize());
  const char* only = std::getenv("VARIANTS_PRODUCT");  // forward, dx or dw; unset: all three
  auto wanted = [&](Product p) { return !only || std::string_view(only) == product_name(p); };
  for (bool ragged : {false, true}) {
    const auto off = workbench::offsets_of(workbench::expert_rows(experts, mean_rows, ragged));
    CHECK(cudaMemcpy(d_off, off.data(), sizeof(int64_t) * off.size(), cudaMemcpyHostToDevice));
    for (auto [k, n] : {std::pair<int64_t, int64_t>{2048, 1536}, {768, 2048}}) {
      const Problem pr{ragged ? "ragged" : "balanced", experts, m, k, n, d_off, x, w, dy, out, dw};
      if (std::getenv("VARIANTS_ORDERS")) {
        time_orders<ColumnMajor, RowMajor, float, Product::kWeightGradient>(pr);
        continue;
      }
      if (wanted(Product::kForward)) time_product<RowMajor, RowMajor, bf, Product::kForward>(pr);
      if (wanted(Product::kInputGradient))
        time_product<RowMajor, ColumnMajor, bf, Product::kInputGradient>(pr);
      if (wanted(Product::kWeightGradient)) {
        time_product<ColumnMajor, RowMajor, float, Product::kWeightGradient>(pr);
        // Written in bf16, as torch._grouped_mm writes it: what the f32 output costs.
        time_product<ColumnMajor, RowMajor, bf, Product::kWeightGradient>(pr);
      }
    }
  }
  return 0;
}
