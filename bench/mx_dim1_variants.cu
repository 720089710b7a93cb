// Workbench for the dim1 MX quantization (ops/cuda/mx.cu, mx_dim1_kernel): times tile shapes,
// thread counts and a persistent pipelined design against the shipped kernel and a same-size
// device copy, on the issue's 16384 x 2048 bf16 tensor and the experts' weights (128 x 2048 x
// 768), and checks every variant's bytes and scales against the shipped kernel's (which the GPU
// tests hold bit for bit to the CPU reference). JSON lines; the winner goes into mx.cu through
// test_mx's Gpu* cases. Built on request (`cmake --build build --target bench_mx_dim1_variants`).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "ops/cuda/mx.cuh"
#include "ops/cuda/mx.h"
#include "workbench.cuh"

namespace {

using mt::cuda::block_scale;
using mt::cuda::BlockScale;
using mt::cuda::e4m3x2;
using mt::cuda::magnitude_bits;
using mt::cuda::to_float;
using Bf16 = __nv_bfloat16;
constexpr int kMxBlock = 32;

// A bf16 tile of 128 rows x kCols columns, word columns XOR-swizzled by 4 * (row / 16) (the
// shipped kernel's layout).
template <int kCols>
struct Tile {
  static constexpr int kRows = 128, kWords = kCols / 2;
  __align__(16) uint32_t words[kRows * kWords];
  __device__ __forceinline__ static int swizzled(int r, int w) {
    return r * kWords + (w ^ (r / 16 * 4));
  }
  __device__ __forceinline__ uint32_t* chunk(int r, int w) { return &words[swizzled(r, w)]; }
  __device__ __forceinline__ const Bf16* element(int r, int c) const {
    return reinterpret_cast<const Bf16*>(&words[swizzled(r, c / 2)]) + c % 2;
  }
};

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const auto s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
template <int N>
__device__ __forceinline__ void wait_group() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
template <int... N>
__device__ __forceinline__ void wait_group_at(int n, std::integer_sequence<int, N...>) {
  ((n == N ? wait_group<N>() : void()), ...);
}

struct Origin {
  int64_t b, r0, c0;
  int rows, cols;
};
// Tile (b, row tile rt, column tile ct) of kCols columns: no division.
template <int kCols>
__device__ __forceinline__ Origin origin_of(int64_t b, int64_t rt, int64_t ct, int64_t rows,
                                            int64_t cols) {
  Origin o;
  o.b = b;
  o.r0 = rt * 128;
  o.c0 = ct * kCols;
  o.rows = static_cast<int>(rows - o.r0 < 128 ? rows - o.r0 : 128);
  o.cols = static_cast<int>(cols - o.c0 < kCols ? cols - o.c0 : kCols);
  return o;
}

// Loads columns [step * S, step * S + S) of the tile (S = kThreads / 8), one cp.async group.
template <int kThreads, int kCols>
__device__ __forceinline__ void load_step(Tile<kCols>& t, const Bf16* src, int64_t cols,
                                          const Origin& o, int step) {
  constexpr int kStep = kThreads / 8, kStepChunks = kStep / 8;  // 16-byte chunks per row
#pragma unroll
  for (int u = 0; u < 128 * kStepChunks / kThreads; ++u) {
    const int c = u * kThreads + threadIdx.x;
    const int r = c / kStepChunks, w = (c % kStepChunks + step * kStepChunks) * 4;
    if (r < o.rows && w * 2 < o.cols) cp_async16(t.chunk(r, w), src + r * cols + w * 2);
  }
  commit();
}

// Column `col` of the tile: the lane's 16 values, the block's amax by one shuffle, 16 bytes out.
template <int kCols>
__device__ __forceinline__ void convert_column(const Tile<kCols>& t, const Origin& o, int col,
                                               int64_t rows, int64_t cols, mt::MxScaleRule rule,
                                               uint8_t* data, uint8_t* scales) {
  const int half = threadIdx.x % 2, blk = threadIdx.x / 2 % 4;
  const bool active = blk * kMxBlock < o.rows && col < o.cols;
  const Bf16* column = t.element(blk * kMxBlock + half * 16, col);
  float v[16];
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    v[i] = active ? to_float(column[i * kCols]) : 0.0f;
    m = max(m, magnitude_bits(v[i]));
  }
  m = max(m, __shfl_xor_sync(0xffffffffu, m, 1));
  if (!active) return;
  const BlockScale bs = block_scale(rule, m);
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    w[i] = e4m3x2(v[4 * i], v[4 * i + 1], bs.factor) |
           (static_cast<uint32_t>(e4m3x2(v[4 * i + 2], v[4 * i + 3], bs.factor)) << 16);
  const int64_t out_row = o.b * cols + o.c0 + col, block_row = o.r0 / kMxBlock + blk;
  *reinterpret_cast<uint4*>(data + out_row * rows + block_row * kMxBlock + half * 16) =
      make_uint4(w[0], w[1], w[2], w[3]);
  if (half == 0) scales[out_row * (rows / kMxBlock) + block_row] = bs.s;
}

// One tile per CTA; its column steps are separate cp.async groups (the shipped design is
// <512, 128, 4>).
template <int kThreads, int kCols, int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    tile_kernel(const Bf16* __restrict__ x, int64_t rows, int64_t cols, mt::MxScaleRule rule,
                uint8_t* __restrict__ data, uint8_t* __restrict__ scales) {
  constexpr int kStep = kThreads / 8, kSteps = kCols / kStep;
  static_assert(kCols % kStep == 0);
  __shared__ Tile<kCols> tile;
  const Origin o = origin_of<kCols>(blockIdx.z, blockIdx.y, blockIdx.x, rows, cols);
  const Bf16* src = x + (o.b * rows + o.r0) * cols + o.c0;
#pragma unroll
  for (int s = 0; s < kSteps; ++s) load_step<kThreads, kCols>(tile, src, cols, o, s);
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    wait_group_at(kSteps - 1 - s, std::make_integer_sequence<int, kSteps>{});
    __syncthreads();
    convert_column(tile, o, threadIdx.x / 8 + s * kStep, rows, cols, rule, data, scales);
  }
}

// Persistent CTAs through a ring of kStages tiles (one cp.async group each, kThreads / 8
// columns a tile): kStages - 1 tiles' loads in flight while one converts. CTA (ct, j) keeps
// column tile ct and walks the (matrix, row tile) pairs j, j + gridDim.y, ...
template <int kThreads, int kStages, int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    ring_kernel(const Bf16* __restrict__ x, int64_t rows, int64_t cols, int64_t batch,
                mt::MxScaleRule rule, uint8_t* __restrict__ data, uint8_t* __restrict__ scales) {
  constexpr int kCols = kThreads / 8;
  extern __shared__ __align__(16) unsigned char smem[];
  Tile<kCols>* ring = reinterpret_cast<Tile<kCols>*>(smem);
  const int64_t row_tiles = (rows + 127) / 128;
  const int stride = gridDim.y;
  // The (matrix, row tile) of the walk's tiles: the next one to load and the one to convert.
  int64_t load_b = blockIdx.y / row_tiles, load_rt = blockIdx.y % row_tiles;
  int64_t conv_b = load_b, conv_rt = load_rt;
  auto advance = [&](int64_t& b, int64_t& rt) {
    rt += stride;
    while (rt >= row_tiles) {
      rt -= row_tiles;
      ++b;
    }
  };
  auto issue = [&](int stage) {
    if (load_b < batch) {
      const Origin o = origin_of<kCols>(load_b, load_rt, blockIdx.x, rows, cols);
      load_step<kThreads, kCols>(ring[stage], x + (o.b * rows + o.r0) * cols + o.c0, cols, o, 0);
      advance(load_b, load_rt);
    } else {
      commit();  // an empty group keeps the count uniform
    }
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) issue(s);
  for (int i = 0; conv_b < batch; ++i) {
    __syncthreads();  // the stage about to be refilled was converted by every thread
    issue((i + kStages - 1) % kStages);
    wait_group<kStages - 1>();
    __syncthreads();
    convert_column(ring[i % kStages], origin_of<kCols>(conv_b, conv_rt, blockIdx.x, rows, cols),
                   threadIdx.x / 8, rows, cols, rule, data, scales);
    advance(conv_b, conv_rt);
  }
}

struct Buffers {
  int64_t batch, rows, cols, n;
  std::vector<Bf16*> x;
  std::vector<uint8_t*> data, scales;
  Bf16* copy;
};

constexpr int kRotate = 4;

// Median over 10 samples of 20 back-to-back launches (rotating inputs), per launch.
template <class F>
double per_launch_ms(F&& f) {
  for (int i = 0; i < 8; ++i) f(i % kRotate);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> ms(10);
  for (float& t : ms) {
    cudaEventRecord(a);
    for (int i = 0; i < 20; ++i) f(i % kRotate);
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    cudaEventElapsedTime(&t, a, b);
    t /= 20;
  }
  std::sort(ms.begin(), ms.end());
  return ms[5];
}

struct Variant {
  const char* name;
  void (*launch)(const Buffers&, int i, mt::MxScaleRule rule);
};

template <int kThreads, int kCols, int kMinBlocks>
void launch_tiles(const Buffers& b, int i, mt::MxScaleRule rule) {
  const dim3 grid(static_cast<unsigned>((b.cols + kCols - 1) / kCols),
                  static_cast<unsigned>((b.rows + 127) / 128), static_cast<unsigned>(b.batch));
  tile_kernel<kThreads, kCols, kMinBlocks>
      <<<grid, kThreads>>>(b.x[i], b.rows, b.cols, rule, b.data[i], b.scales[i]);
}

template <int kThreads, int kStages, int kMinBlocks>
void launch_ring(const Buffers& b, int i, mt::MxScaleRule rule) {
  constexpr int kCols = kThreads / 8;
  constexpr int kSmem = kStages * sizeof(Tile<kCols>);
  static int slots = 0;
  if (slots == 0) {
    int per_sm = 0, sms = 0;
    WORKBENCH_CHECK(cudaFuncSetAttribute(ring_kernel<kThreads, kStages, kMinBlocks>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &per_sm, ring_kernel<kThreads, kStages, kMinBlocks>, kThreads, kSmem);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    slots = per_sm * sms;
    std::printf("{\"ring\": \"%d threads, %d stages\", \"ctas_per_sm\": %d}\n", kThreads, kStages,
                per_sm);
  }
  const int64_t col_tiles = (b.cols + kCols - 1) / kCols;
  const int64_t walks = b.batch * ((b.rows + 127) / 128);
  const int64_t per_col = std::max<int64_t>(1, std::min<int64_t>(slots / col_tiles, walks));
  ring_kernel<kThreads, kStages, kMinBlocks>
      <<<dim3(static_cast<unsigned>(col_tiles), static_cast<unsigned>(per_col)), kThreads, kSmem>>>(
          b.x[i], b.rows, b.cols, b.batch, rule, b.data[i], b.scales[i]);
}

void launch_shipped(const Buffers& b, int i, mt::MxScaleRule rule) {
  WORKBENCH_CHECK(mt::cuda::kernels::mx_quantize(mt::DType::kBF16, b.x[i], mt::QuantAxis::kDim1,
                                                 rule, b.batch, b.rows, b.cols, b.data[i],
                                                 b.scales[i], nullptr));
}

}  // namespace

int main() {
  const Variant variants[] = {
      {"shipped (512 threads, 128 x 128 tiles, 2 groups, 4/SM)", launch_shipped},
      {"tiles 512 threads, 128 x 128, 2 groups, 4/SM (copy of shipped)", launch_tiles<512, 128, 4>},
      {"tiles 512 threads, 128 x 64, 1 group, 4/SM", launch_tiles<512, 64, 4>},
      {"tiles 256 threads, 128 x 128, 4 groups, 6/SM", launch_tiles<256, 128, 6>},
      {"tiles 256 threads, 128 x 64, 2 groups, 8/SM", launch_tiles<256, 64, 8>},
      {"tiles 1024 threads, 128 x 128, 1 group, 2/SM", launch_tiles<1024, 128, 2>},
      {"ring 512 threads, 128 x 64 tiles, 3 stages, 4/SM", launch_ring<512, 3, 4>},
      {"ring 512 threads, 128 x 64 tiles, 2 stages, 4/SM", launch_ring<512, 2, 4>},
      {"ring 1024 threads, 128 x 128 tiles, 3 stages, 2/SM", launch_ring<1024, 3, 2>},
      {"ring 512 threads, 128 x 64 tiles, 4 stages, 3/SM", launch_ring<512, 4, 3>},
  };
  struct Shape {
    int64_t batch, rows, cols;
  };
  // MX_DIM1_SHAPES="BxRxC,...": other shapes (default: the issue's and the experts' weights);
  // MX_DIM1_SHIPPED_ONLY=1: the shipped kernel alone beside the copy.
  std::vector<Shape> shapes = {{1, 16384, 2048}, {128, 2048, 768}};
  if (const char* env = std::getenv("MX_DIM1_SHAPES")) {
    shapes.clear();
    for (const char* p = env; *p;) {
      long b = 0, r = 0, c = 0;
      int used = 0;
      if (std::sscanf(p, "%ldx%ldx%ld%n", &b, &r, &c, &used) != 3) break;
      shapes.push_back({b, r, c});
      p += used;
      if (*p == ',') ++p;
    }
  }
  const bool shipped_only = std::getenv("MX_DIM1_SHIPPED_ONLY") != nullptr;
  for (const Shape s : shapes) {
    Buffers b{s.batch, s.rows, s.cols, s.batch * s.rows * s.cols, {}, {}, {}, nullptr};
    for (int i = 0; i < kRotate; ++i) {
      Bf16* x;
      uint8_t *d, *sc;
      WORKBENCH_CHECK(cudaMalloc(&x, b.n * 2));
      WORKBENCH_CHECK(cudaMalloc(&d, b.n));
      WORKBENCH_CHECK(cudaMalloc(&sc, b.n / kMxBlock));
      workbench::fill_random<<<1024, 256>>>(x, b.n, 7 + i, 3.0f);
      b.x.push_back(x);
      b.data.push_back(d);
      b.scales.push_back(sc);
    }
    WORKBENCH_CHECK(cudaMalloc(&b.copy, b.n * 2));
    WORKBENCH_CHECK(cudaDeviceSynchronize());
    const double bytes = 3.0 * b.n + b.n / kMxBlock;
    std::vector<uint8_t> want_d(b.n), want_s(b.n / kMxBlock), got_d(b.n), got_s(b.n / kMxBlock);
    for (mt::MxScaleRule rule : {mt::MxScaleRule::kFloor, mt::MxScaleRule::kRceil}) {
      launch_shipped(b, 0, rule);
      WORKBENCH_CHECK(cudaMemcpy(want_d.data(), b.data[0], b.n, cudaMemcpyDeviceToHost));
      WORKBENCH_CHECK(
          cudaMemcpy(want_s.data(), b.scales[0], b.n / kMxBlock, cudaMemcpyDeviceToHost));
      for (int round = 0; round < 3; ++round) {
        const double copy_ms = per_launch_ms(
            [&](int i) { cudaMemcpyAsync(b.copy, b.x[i], b.n * 2, cudaMemcpyDeviceToDevice); });
        const double copy_gbps = 4.0 * b.n / (copy_ms * 1e-3) / 1e9;
        for (const Variant& v : variants) {
          if (shipped_only && &v != &variants[0]) continue;
          WORKBENCH_CHECK(cudaMemset(b.data[0], 0xA5, b.n));
          WORKBENCH_CHECK(cudaMemset(b.scales[0], 0xA5, b.n / kMxBlock));
          v.launch(b, 0, rule);
          WORKBENCH_CHECK(cudaGetLastError());
          WORKBENCH_CHECK(cudaMemcpy(got_d.data(), b.data[0], b.n, cudaMemcpyDeviceToHost));
          WORKBENCH_CHECK(
              cudaMemcpy(got_s.data(), b.scales[0], b.n / kMxBlock, cudaMemcpyDeviceToHost));
          const bool exact = got_d == want_d && got_s == want_s;
          const double ms = per_launch_ms([&](int i) { v.launch(b, i, rule); });
          const double gbps = bytes / (ms * 1e-3) / 1e9;
          std::printf(
              "{\"bench\": \"mx_dim1_variant\", \"shape\": \"%ldx%ldx%ld bf16\", \"rule\": \"%s\", "
              "\"round\": %d, \"variant\": \"%s\", \"ms\": %.4f, \"gb_per_s\": %.0f, "
              "\"copy_gb_per_s\": %.0f, \"ratio_to_copy\": %.3f, \"bit_exact\": %s}\n",
              static_cast<long>(s.batch), static_cast<long>(s.rows), static_cast<long>(s.cols),
              rule == mt::MxScaleRule::kFloor ? "floor" : "rceil", round, v.name, ms, gbps,
              copy_gbps, gbps / copy_gbps, exact ? "true" : "false");
        }
      }
    }
    for (int i = 0; i < kRotate; ++i) {
      cudaFree(b.x[i]);
      cudaFree(b.data[i]);
      cudaFree(b.scales[i]);
    }
    cudaFree(b.copy);
  }
  return 0;
}
