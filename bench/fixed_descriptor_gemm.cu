// Workbench: the expert GEMMs with fixed TMA descriptors over padded expert segments
// (bench/fixed_descriptor_gemm.cuh) against the shipped grouped kernels (the
// library's), at the Qwen3-30B-A3B expert shapes, on balanced experts and on ragged ones (rows
// drawn in [0.5, 1.5) x the mean). Every fixed-descriptor result is compared with the grouped
// one row by row (the padded layout maps back to the unpadded one), the outputs poisoned
// first. JSON lines.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "fixed_descriptor_gemm.cuh"
#include "ops/cuda/kernels.h"
#include "workbench.cuh"

namespace fixedbench {

using namespace cute;
namespace f = mt::cuda::fixed_sm90;
using bf = cutlass::bfloat16_t;
using f::Product;
#define CHECK WORKBENCH_CHECK

using Wide = Shape<_128, _256, _64>;
using Square = Shape<_128, _128, _64>;
using Forward = f::Config<Product::kForward, f::RowsKMajor, f::WeightsNMajor, f::OutRows, bf, Wide,
                          f::Cooperative>;
using ForwardShortK = f::Config<Product::kForward, f::RowsKMajor, f::WeightsNMajor, f::OutRows, bf,
                                Square, f::Pingpong>;
using InputGradient = f::Config<Product::kInputGradient, f::RowsKMajor, f::WeightsKMajor,
                                f::OutRows, bf, Wide, f::Cooperative>;
using WeightGradient = f::Config<Product::kWeightGradient, f::RowsMMajor, f::RowsMMajor,
                                 f::OutPerExpert, float, Square, f::Cooperative>;
// The down projection's forward as a plain batched GEMM through our scheduler (uniform mode).
using ForwardShortKBatched =
    f::Config<Product::kForward, Stride<int64_t, _1, int64_t>, f::WeightsNMajor,
              Stride<int64_t, _1, int64_t>, bf, Square, f::Pingpong>;
using WeightGradientWide = f::Config<Product::kWeightGradient, f::RowsMMajor, f::RowsMMajor,
                                     f::OutPerExpert, float, Wide, f::Cooperative>;

// Copies rows between the unpadded layout (expert e at offsets[e]) and the padded one (at
// segments[e]); pad rows of `padded` are zeroed when `to_padded`.
__global__ void move_rows(bf* padded, bf* unpadded, const int64_t* offsets, const int64_t* segments,
                          int experts, int64_t width, bool to_padded) {
  const int e = blockIdx.y;
  const int64_t rows = offsets[e + 1] - offsets[e];
  const int64_t seg_rows = segments[e + 1] - segments[e];
  for (int64_t r = blockIdx.x; r < seg_rows; r += gridDim.x) {
    bf* p = padded + (segments[e] + r) * width;
    for (int64_t c = threadIdx.x; c < width; c += blockDim.x) {
      if (to_padded) {
        p[c] = r < rows ? unpadded[(offsets[e] + r) * width + c] : bf(0.0f);
      } else if (r < rows) {
        unpadded[(offsets[e] + r) * width + c] = p[c];
      }
    }
  }
}

struct RowLayout {
  const char* routing = "";
  std::vector<int64_t> offsets, segments, counts;
  int64_t* d_offsets = nullptr;
  int64_t* d_segments = nullptr;
  int64_t* d_counts = nullptr;
  int4* d_block_info = nullptr;  // per 128-row block: {expert, first block, blocks}
};

RowLayout make_layout(const char* routing, int experts, int64_t mean, bool ragged) {
  RowLayout l;
  l.routing = routing;
  const int64_t m = experts * mean;
  l.counts = workbench::expert_rows(experts, mean, ragged);
  l.offsets = workbench::offsets_of(l.counts);
  std::vector<int64_t> padded(experts);
  for (int e = 0; e < experts; ++e)
    padded[e] = (l.counts[e] + f::kSegmentRows - 1) / f::kSegmentRows * f::kSegmentRows;
  l.segments = workbench::offsets_of(padded);
  auto upload = [](const std::vector<int64_t>& v) {
    int64_t* d;
    CHECK(cudaMalloc(&d, sizeof(int64_t) * v.size()));
    CHECK(cudaMemcpy(d, v.data(), sizeof(int64_t) * v.size(), cudaMemcpyHostToDevice));
    return d;
  };
  l.d_offsets = upload(l.offsets);
  l.d_segments = upload(l.segments);
  l.d_counts = upload(l.counts);
  std::vector<int4> info;  // every row block of the capacity; -1 past the last segment
  for (int e = 0; e < experts; ++e) {
    const int first = static_cast<int>(l.segments[e] / f::kSegmentRows);
    const int blocks = static_cast<int>(l.segments[e + 1] / f::kSegmentRows) - first;
    for (int b = 0; b < blocks; ++b) info.push_back(make_int4(e, first, blocks, 0));
  }
  const int64_t capacity_blocks = (m + experts * (f::kSegmentRows - 1)) / f::kSegmentRows;
  while (static_cast<int64_t>(info.size()) < capacity_blocks)
    info.push_back(make_int4(-1, 0, 0, 0));
  CHECK(cudaMalloc(&l.d_block_info, sizeof(int4) * std::max<size_t>(info.size(), 1)));
  CHECK(
      cudaMemcpy(l.d_block_info, info.data(), sizeof(int4) * info.size(), cudaMemcpyHostToDevice));
  return l;
}

struct Buffers {
  int experts;
  int64_t m, capacity;
  bf *x, *dy, *w;            // unpadded rows (m, 2048), weights (E, 2048, 2048)
  bf *x_pad, *dy_pad;        // padded rows (capacity, 2048)
  bf *out, *out_pad, *back;  // outputs (m | capacity, 2048)
  float *dw, *dw_fixed;      // (E, 2048, 2048)
  void* workspace;
  size_t workspace_bytes;
};

const char* name(Product p) {
  return p == Product::kForward ? "forward" : p == Product::kInputGradient ? "dx" : "dw";
}

// One product at one shape: grouped (library) and fixed, timed and compared.
template <Product P, class C>
void run_product(const Buffers& b, const RowLayout& l, int64_t k, int64_t n, const char* tile) {
  namespace kn = mt::cuda::kernels;
  const int E = b.experts;
  const bool dw = P == Product::kWeightGradient;
  const int64_t out_width = P == Product::kForward ? n : k;
  const bf* lhs = P == Product::kInputGradient ? b.dy : b.x;
  const bf* rhs = dw ? b.dy : b.w;
  const bf* lhs_pad = P == Product::kInputGradient ? b.dy_pad : b.x_pad;
  const bf* rhs_pad = dw ? b.dy_pad : b.w;
  auto grouped = [&] {
    if constexpr (P == Product::kForward)
      CHECK(kn::cutlass_grouped_forward(l.d_offsets, E, lhs, rhs, b.out, b.m, k, n, b.workspace,
                                        b.workspace_bytes, nullptr));
    else if constexpr (P == Product::kInputGradient)
      CHECK(kn::cutlass_grouped_input_gradient(l.d_offsets, E, lhs, rhs, b.out, b.m, k, n,
                                               b.workspace, b.workspace_bytes, nullptr));
    else
      CHECK(kn::cutlass_grouped_weight_gradient(l.d_offsets, E, lhs, rhs, b.dw, b.m, k, n,
                                                b.workspace, b.workspace_bytes, false, nullptr));
  };
  bool rows_fastest = true;
  const int4* block_info = nullptr;
  auto fixed = [&] {
    CHECK((f::run<C, P>(l.d_segments, l.d_counts, E, lhs_pad, rhs_pad,
                        dw ? static_cast<void*>(b.dw_fixed) : static_cast<void*>(b.out_pad),
                        b.capacity, k, n, b.workspace, b.workspace_bytes, nullptr, rows_fastest,
                        block_info)));
  };
  // Correctness: poison, run each once, compare (the fixed rows moved back to the unpadded
  // layout first).
  workbench::Differences d;
  if (dw) {
    CHECK(cudaMemset(b.dw, 0xFF, sizeof(float) * E * k * n));
    CHECK(cudaMemset(b.dw_fixed, 0xFF, sizeof(float) * E * k * n));
    grouped();
    fixed();
    d = workbench::differences(b.dw_fixed, b.dw, int64_t{E} * k * n);
  } else {
    CHECK(cudaMemset(b.out, 0xFF, sizeof(bf) * b.m * out_width));
    CHECK(cudaMemset(b.out_pad, 0xFF, sizeof(bf) * b.capacity * out_width));
    CHECK(cudaMemset(b.back, 0xFF, sizeof(bf) * b.m * out_width));
    grouped();
    fixed();
    move_rows<<<dim3(64, E), 256>>>(b.out_pad, b.back, l.d_offsets, l.d_segments, E, out_width,
                                    false);
    d = workbench::differences(b.back, b.out, b.m * out_width);
  }
  CHECK(cudaDeviceSynchronize());
  const float grouped_ms = workbench::median_ms(grouped);
  const double flop = 2.0 * b.m * k * n;
  for (const int variant : {0, 1, 2, 3}) {  // order m|n fastest, expert by walk|table
    const bool order = variant % 2 == 0, table = variant >= 2;
    if (dw && variant > 0) break;  // one order for the weight gradient
    rows_fastest = order;
    block_info = table ? l.d_block_info : nullptr;
    const float fixed_ms = workbench::median_ms(fixed);
    std::printf(
        "{\"bench\": \"fixed_descriptor_gemm\", \"product\": \"%s\", \"shape\": \"k%ld n%ld\", "
        "\"routing\": \"%s\", \"fixed_tile\": \"%s\", \"order\": \"%s\", \"grouped_ms\": %.4f, "
        "\"grouped_tflops\": %.1f, \"fixed_ms\": %.4f, \"fixed_tflops\": %.1f, \"speedup\": %.3f, "
        "\"padded_rows\": %ld, \"differing\": %llu, \"max_abs_difference\": %.3g}\n",
        name(P), static_cast<long>(k), static_cast<long>(n), l.routing, tile,
        dw      ? "expert, m fastest"
        : order ? "m fastest"
                : "n fastest",
        grouped_ms, flop / (grouped_ms * 1e-3) / 1e12, fixed_ms, flop / (fixed_ms * 1e-3) / 1e12,
        grouped_ms / fixed_ms, static_cast<long>(l.segments.back()), d.differing, d.max_abs);
    std::fflush(stdout);
  }
}

// Balanced experts only: the down projection's forward as a batched GEMM (x as (rows, k, E)),
// tiles from our scheduler in CUTLASS's batched order, against CUTLASS's own batched kernel
// (bench_batched_gemm_bound): is the scheduler or the operands' shape what costs?
void time_uniform_forward(const Buffers& b, int64_t rows, int64_t k, int64_t n) {
  using C = ForwardShortKBatched;
  const int E = b.experts;
  typename C::Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kBatched,
      {static_cast<int>(rows), static_cast<int>(n), static_cast<int>(k), E},
      {b.x, {k, _1{}, rows * k}, b.w, {_1{}, n, k * n}},
      {{1.0f, 0.0f}, b.out, {n, _1{}, rows * n}, b.out, {n, _1{}, rows * n}}};
  args.hw_info = cutlass::KernelHardwareInfo::make_kernel_hardware_info<typename C::Kernel>(0);
  args.scheduler.uniform = true;
  args.scheduler.experts = E;
  typename C::Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) {
    std::printf("{\"error\": \"uniform forward cannot implement\"}\n");
    return;
  }
  CHECK(cudaMemset(b.out, 0xFF, sizeof(bf) * b.m * n));
  const float ms = workbench::median_ms([&] {
    if (gemm.initialize(args, b.workspace) != cutlass::Status::kSuccess ||
        gemm.run() != cutlass::Status::kSuccess)
      std::printf("{\"error\": \"uniform forward run\"}\n");
  });
  CHECK(cudaGetLastError());
  std::printf(
      "{\"bench\": \"fixed_descriptor_gemm\", \"product\": \"forward\", \"shape\": \"k%ld n%ld\", "
      "\"routing\": \"balanced\", \"fixed_tile\": \"pingpong 128x128\", \"order\": \"batched "
      "(uniform)\", \"fixed_ms\": %.4f, \"fixed_tflops\": %.1f}\n",
      static_cast<long>(k), static_cast<long>(n), ms, 2.0 * b.m * k * n / (ms * 1e-3) / 1e12);
  std::fflush(stdout);
}

}  // namespace fixedbench

int main() {
  using namespace fixedbench;
  const int experts = 128;
  const int64_t mean = 1024, m = experts * mean, big = 2048;
  const int64_t capacity =
      (m + experts * (f::kSegmentRows - 1)) / f::kSegmentRows * f::kSegmentRows;
  Buffers b;
  b.experts = experts;
  b.m = m;
  b.capacity = capacity;
  CHECK(cudaMalloc(&b.x, sizeof(bf) * m * big));
  CHECK(cudaMalloc(&b.dy, sizeof(bf) * m * big));
  CHECK(cudaMalloc(&b.w, sizeof(bf) * experts * big * big));
  CHECK(cudaMalloc(&b.x_pad, sizeof(bf) * capacity * big));
  CHECK(cudaMalloc(&b.dy_pad, sizeof(bf) * capacity * big));
  CHECK(cudaMalloc(&b.out, sizeof(bf) * m * big));
  CHECK(cudaMalloc(&b.out_pad, sizeof(bf) * capacity * big));
  CHECK(cudaMalloc(&b.back, sizeof(bf) * m * big));
  CHECK(cudaMalloc(&b.dw, sizeof(float) * experts * big * big));
  CHECK(cudaMalloc(&b.dw_fixed, sizeof(float) * experts * big * big));
  b.workspace_bytes = size_t{64} << 20;
  CHECK(cudaMalloc(&b.workspace, b.workspace_bytes));
  workbench::fill_random<<<1024, 256>>>(b.x, m * big, 1, 1.0f);
  workbench::fill_random<<<1024, 256>>>(b.dy, m * big, 3, 1.0f);
  workbench::fill_random<<<1024, 256>>>(b.w, experts * big * big, 2, 0.05f);
  CHECK(cudaDeviceSynchronize());
  for (const bool ragged : {false, true}) {
    const RowLayout l = make_layout(ragged ? "ragged" : "balanced", experts, mean, ragged);
    // The padded copies of the rows (the widths the products read: 2048 covers both shapes'
    // row-major operands, whose rows are contiguous in the first k or n columns).
    for (auto [k, n] : {std::pair<int64_t, int64_t>{2048, 1536}, {768, 2048}}) {
      // x is (m, k) and dy (m, n): lay each out at its own width.
      move_rows<<<dim3(64, experts), 256>>>(b.x_pad, b.x, l.d_offsets, l.d_segments, experts, k,
                                            true);
      move_rows<<<dim3(64, experts), 256>>>(b.dy_pad, b.dy, l.d_offsets, l.d_segments, experts, n,
                                            true);
      CHECK(cudaDeviceSynchronize());
      if (k == 2048)
        run_product<fixedbench::Product::kForward, Forward>(b, l, k, n, "coop 128x256");
      else
        run_product<fixedbench::Product::kForward, ForwardShortK>(b, l, k, n, "pingpong 128x128");
      run_product<fixedbench::Product::kInputGradient, InputGradient>(b, l, k, n, "coop 128x256");
      run_product<fixedbench::Product::kWeightGradient, WeightGradient>(b, l, k, n,
                                                                        "coop 128x128 f32");
      run_product<fixedbench::Product::kWeightGradient, WeightGradientWide>(b, l, k, n,
                                                                            "coop 128x256 f32");
    }
  }
  time_uniform_forward(b, mean, 768, 2048);
  return 0;
}
