// Workbench question: what do the expert GEMMs lose to the grouped (pointer-array) kernel's
// per-group TMA descriptor updates? At the balanced shape (every expert 1024 rows) each product
// is also a plain batched GEMM over the experts, which CUTLASS runs with fixed descriptors
// (one per operand, the expert as the batch coordinate): its time bounds what a grouped kernel
// with fixed descriptors could gain. The grouped kernel is also timed on ragged experts (rows in
// [0.5, 1.5) x the mean). Same tiles and schedules as shipped, one process. JSON lines.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "ops/cuda/cutlass/grouped_gemm_fixed_sm90.cuh"
#include "ops/cuda/cutlass/grouped_gemm_sm90.cuh"
#include "workbench.cuh"

namespace bound {

using namespace cute;
using cutlass::layout::ColumnMajor;
using cutlass::layout::RowMajor;
using mt::cuda::grouped_sm90::Product;
namespace g = mt::cuda::grouped_sm90;
using bf = cutlass::bfloat16_t;

using workbench::fill_random;
using workbench::median_ms;
#define CHECK WORKBENCH_CHECK

// The non-array (batched) kernels' schedules.
using BatchedCooperative = mt::cuda::fixed_sm90::Cooperative;
using BatchedPingpong = mt::cuda::fixed_sm90::Pingpong;

// The batched twin of grouped_sm90::Config: problem (M, N, K, L = experts), fixed strides,
// CUTLASS's own scheduler.
template <class LayoutA, class LayoutB, class Out, class Tile, class Schedule>
using Batched = mt::cuda::fixed_sm90::KernelConfig<
    cutlass::detail::TagToStrideA_t<LayoutA>, cutlass::detail::TagToStrideB_t<LayoutB>,
    cutlass::detail::TagToStrideC_t<RowMajor>, Out, Tile, Schedule, void>;

struct Buffers {
  int experts;
  int64_t rows;  // per expert
  const bf* x;
  const bf* w;
  const bf* dy;
  bf* out;
  float* dw;
  const int64_t* offsets;         // balanced
  const int64_t* ragged_offsets;  // rows in [0.5, 1.5) x the mean, summing to the same total
};

// Product P as one batched GEMM (balanced experts only).
template <Product P, class B>
float time_batched(const Buffers& s, int64_t k, int64_t n) {
  using Out = typename B::Kernel::ElementD;
  const int L = s.experts;
  int M, N, K;
  const void *a, *b;
  void* d;
  if constexpr (P == Product::kForward) {
    M = s.rows, N = n, K = k, a = s.x, b = s.w, d = s.out;
  } else if constexpr (P == Product::kInputGradient) {
    M = s.rows, N = k, K = n, a = s.dy, b = s.w, d = s.out;
  } else {
    M = k, N = n, K = s.rows, a = s.x, b = s.dy, d = s.dw;
  }
  using SA = typename B::Kernel::StrideA;
  using SB = typename B::Kernel::StrideB;
  using SC = typename B::Kernel::StrideC;
  const auto sa = cutlass::make_cute_packed_stride(SA{}, {M, K, L});
  const auto sb = cutlass::make_cute_packed_stride(SB{}, {N, K, L});
  const auto sc = cutlass::make_cute_packed_stride(SC{}, {M, N, L});
  typename B::Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kBatched,
      {M, N, K, L},
      {static_cast<const bf*>(a), sa, static_cast<const bf*>(b), sb},
      {{1.0f, 0.0f}, static_cast<Out*>(d), sc, static_cast<Out*>(d), sc}};
  args.hw_info = cutlass::KernelHardwareInfo::make_kernel_hardware_info<typename B::Kernel>(0);
  typename B::Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) {
    std::printf("{\"error\": \"batched cannot implement\"}\n");
    std::exit(1);
  }
  void* ws = nullptr;
  CHECK(cudaMalloc(&ws, std::max<size_t>(B::Gemm::get_workspace_size(args), 256)));
  CHECK(cudaMemset(d, 0xFF, sizeof(Out) * size_t(M) * N * L));  // poisoned: NaN
  auto call = [&] {
    if (gemm.initialize(args, ws) != cutlass::Status::kSuccess ||
        gemm.run() != cutlass::Status::kSuccess) {
      std::printf("{\"error\": \"batched run\"}\n");
      std::exit(1);
    }
  };
  const float ms = median_ms(call);
  CHECK(cudaGetLastError());
  cudaFree(ws);
  return ms;
}

// Bytes of product P's output.
template <Product P, class C>
size_t output_bytes(const Buffers& s, int64_t k, int64_t n) {
  if constexpr (P == Product::kWeightGradient)
    return sizeof(typename C::ElementOutput) * s.experts * k * n;
  else
    return sizeof(bf) * s.rows * s.experts * (P == Product::kForward ? n : k);
}

// Times product P through the grouped kernel (output poisoned first).
template <Product P, class C>
float time_grouped(const Buffers& s, const int64_t* offsets, int64_t k, int64_t n) {
  const size_t bytes = g::workspace_bytes<P, C>(s.experts);
  void* ws = nullptr;
  CHECK(cudaMalloc(&ws, bytes));
  const void* lhs = P == Product::kInputGradient ? static_cast<const void*>(s.dy) : s.x;
  const void* rhs = P == Product::kWeightGradient ? static_cast<const void*>(s.dy) : s.w;
  void* out = P == Product::kWeightGradient ? static_cast<void*>(s.dw) : s.out;
  CHECK(cudaMemset(out, 0xFF, output_bytes<P, C>(s, k, n)));
  const int64_t m = s.rows * s.experts;
  const float ms = median_ms([&] {
    CHECK(
        (g::run<P, C>({offsets, offsets}, s.experts, lhs, rhs, out, m, k, n, ws, bytes, nullptr)));
  });
  cudaFree(ws);
  return ms;
}

const char* name(Product p) {
  return p == Product::kForward ? "forward" : p == Product::kInputGradient ? "dx" : "dw";
}

// One product and tile: the grouped kernel on balanced and ragged experts, the batched kernel on
// balanced ones (the same FLOPs in all three); the batched output is checked word for word
// against the grouped one on the same balanced experts.
template <Product P, class Grouped, class Batch>
void compare(const Buffers& s, int64_t k, int64_t n, const char* tile) {
  const double flop = 2.0 * s.rows * s.experts * k * n;
  const size_t bytes = output_bytes<P, Grouped>(s, k, n);
  const void* out = P == Product::kWeightGradient ? static_cast<const void*>(s.dw) : s.out;
  void* reference = nullptr;
  CHECK(cudaMalloc(&reference, bytes));
  const float balanced = time_grouped<P, Grouped>(s, s.offsets, k, n);
  CHECK(cudaMemcpy(reference, out, bytes, cudaMemcpyDeviceToDevice));
  const float ragged = time_grouped<P, Grouped>(s, s.ragged_offsets, k, n);
  const float batched = time_batched<P, Batch>(s, k, n);
  const unsigned long long differing =
      workbench::differences(static_cast<const uint32_t*>(out),
                             static_cast<const uint32_t*>(reference), bytes / 4)
          .differing;
  cudaFree(reference);
  auto tflops = [&](float ms) { return flop / (ms * 1e-3) / 1e12; };
  std::printf(
      "{\"bench\": \"fixed_descriptor_bound\", \"product\": \"%s\", \"shape\": \"k%ld n%ld\", "
      "\"tile\": \"%s\", \"grouped_ms\": %.4f, \"grouped_tflops\": %.1f, "
      "\"grouped_ragged_ms\": %.4f, \"grouped_ragged_tflops\": %.1f, \"batched_ms\": %.4f, "
      "\"batched_tflops\": %.1f, \"batched_gain\": %.3f, \"batched_words_differing\": %llu}\n",
      name(P), static_cast<long>(k), static_cast<long>(n), tile, balanced, tflops(balanced), ragged,
      tflops(ragged), batched, tflops(batched), balanced / batched, differing);
  std::fflush(stdout);
}

}  // namespace bound

int main() {
  using namespace bound;
  using Wide = Shape<_128, _256, _64>;
  using Square = Shape<_128, _128, _64>;
  const int experts = 128;
  const int64_t rows = 1024, m = experts * rows, big = 2048;
  bf *x, *w, *dy, *out;
  float* dw;
  int64_t *off, *ragged;
  CHECK(cudaMalloc(&x, sizeof(bf) * m * big));
  CHECK(cudaMalloc(&w, sizeof(bf) * experts * big * big));
  CHECK(cudaMalloc(&dy, sizeof(bf) * m * big));
  CHECK(cudaMalloc(&out, sizeof(bf) * m * big));
  CHECK(cudaMalloc(&dw, sizeof(float) * experts * big * big));
  CHECK(cudaMalloc(&off, sizeof(int64_t) * (experts + 1)));
  const auto h_off = workbench::offsets_of(workbench::expert_rows(experts, rows, false));
  CHECK(cudaMemcpy(off, h_off.data(), sizeof(int64_t) * h_off.size(), cudaMemcpyHostToDevice));
  const auto h_ragged = workbench::offsets_of(workbench::expert_rows(experts, rows, true));
  CHECK(cudaMalloc(&ragged, sizeof(int64_t) * (experts + 1)));
  CHECK(cudaMemcpy(ragged, h_ragged.data(), sizeof(int64_t) * h_ragged.size(),
                   cudaMemcpyHostToDevice));
  fill_random<<<1024, 256>>>(x, m * big, 1, 1.0f);
  fill_random<<<1024, 256>>>(w, experts * big * big, 2, 0.05f);
  fill_random<<<1024, 256>>>(dy, m * big, 3, 1.0f);
  CHECK(cudaDeviceSynchronize());
  const Buffers s{experts, rows, x, w, dy, out, dw, off, ragged};
  for (auto [k, n] : {std::pair<int64_t, int64_t>{2048, 1536}, {768, 2048}}) {
    compare<mt::cuda::grouped_sm90::Product::kForward,
            g::Config<RowMajor, RowMajor, bf, Wide, g::NoCluster, g::Cooperative>,
            Batched<RowMajor, RowMajor, bf, Wide, BatchedCooperative>>(s, k, n, "coop 128x256");
    compare<mt::cuda::grouped_sm90::Product::kForward,
            g::Config<RowMajor, RowMajor, bf, Square, g::NoCluster, g::Pingpong>,
            Batched<RowMajor, RowMajor, bf, Square, BatchedPingpong>>(s, k, n, "pingpong 128x128");
    compare<mt::cuda::grouped_sm90::Product::kInputGradient,
            g::Config<RowMajor, ColumnMajor, bf, Wide, g::NoCluster, g::Cooperative>,
            Batched<RowMajor, ColumnMajor, bf, Wide, BatchedCooperative>>(s, k, n, "coop 128x256");
    compare<mt::cuda::grouped_sm90::Product::kWeightGradient,
            g::Config<ColumnMajor, RowMajor, float, Square, g::NoCluster, g::Pingpong>,
            Batched<ColumnMajor, RowMajor, float, Square, BatchedPingpong>>(s, k, n,
                                                                            "pingpong 128x128");
  }
  return 0;
}
