// MX quantization kernels (ops/mx.h): bit-exact with the CPU reference (ops/cpu/mx.cpp), which
// follows torchao's to_mx. Both are memory-bound: each reads the input once with 16-byte loads
// and writes 1 byte per element plus 1 per 32.
//   dim0: lanes own 16 bytes of a row; the 32 / P lanes of a block reduce its amax by shuffles.
//   dim1: a tile of the input is staged in shared memory by coalesced loads; a thread then owns
//         whole blocks of its columns, their amax and their 32 output bytes (a row of the
//         transposed data).
#include <type_traits>

#include "ops/cuda/common.cuh"
#include "ops/cuda/expert_tiles.h"
#include "ops/cuda/mx.cuh"
#include "ops/cuda/mx.h"

namespace mt::cuda {

namespace {

template <class T>
struct Chunk {  // 16 bytes of input as P floats
  static constexpr int P = 16 / sizeof(T);
  float v[P];
  __device__ __forceinline__ void load(const T* p) {
    const Pack<T> pk = load_pack(p);
#pragma unroll
    for (int i = 0; i < P; ++i) v[i] = pk.v[i];
  }
  __device__ __forceinline__ uint32_t amax_bits() const {
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < P; ++i) m = max(m, magnitude_bits(v[i]));
    return m;
  }
};

// P bytes of E4M3 (P = 8 or 4) stored with one access.
template <int P>
__device__ __forceinline__ void store_e4m3(uint8_t* out, const float* v, float factor) {
  uint32_t w[P / 4];
#pragma unroll
  for (int i = 0; i < P / 4; ++i)
    w[i] = e4m3x2(v[4 * i], v[4 * i + 1], factor) |
           (static_cast<uint32_t>(e4m3x2(v[4 * i + 2], v[4 * i + 3], factor)) << 16);
  if constexpr (P == 8)
    *reinterpret_cast<uint2*>(out) = make_uint2(w[0], w[1]);
  else
    *reinterpret_cast<uint32_t*>(out) = w[0];
}

constexpr int kQuantizeThreads = 256;
constexpr int kDim0ChunksPerThread = 4;  // 64 bytes of loads in flight per thread

// The dim0 passes' chunks: this thread's u-th, and all of them loaded at once (those in range).
__device__ __forceinline__ int64_t dim0_chunk(int u) {
  return (static_cast<int64_t>(blockIdx.x) * kDim0ChunksPerThread + u) * kQuantizeThreads +
         threadIdx.x;
}
template <class T>
__device__ __forceinline__ void load_dim0_chunks(const T* x, int64_t chunks,
                                                 Chunk<T> (&c)[kDim0ChunksPerThread]) {
#pragma unroll
  for (int u = 0; u < kDim0ChunksPerThread; ++u) {
    const int64_t g = dim0_chunk(u);
    if (g < chunks) c[u].load(x + g * Chunk<T>::P);
  }
}

// x viewed as chunks of 16 bytes; chunk g belongs to block g / (32 / P).
template <class T>
__global__ void __launch_bounds__(kQuantizeThreads)
    mx_quantize_dim0_kernel(const T* __restrict__ x, int64_t chunks, MxScaleRule rule,
                            uint8_t* __restrict__ data, uint8_t* __restrict__ scales) {
  constexpr int P = Chunk<T>::P, kLanesPerBlock = kMxBlock / P;
  Chunk<T> c[kDim0ChunksPerThread];
  load_dim0_chunks(x, chunks, c);
#pragma unroll
  for (int u = 0; u < kDim0ChunksPerThread; ++u) {
    const int64_t g = dim0_chunk(u);
    // Chunks come in whole blocks (the row length is a multiple of 32), so a block's lanes are
    // all in range or all out; the shuffles below stay within a block's lanes.
    uint32_t m = g < chunks ? c[u].amax_bits() : 0;
#pragma unroll
    for (int o = 1; o < kLanesPerBlock; o <<= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (g >= chunks) continue;
    const BlockScale bs = block_scale(rule, m);
    store_e4m3<P>(data + g * P, c[u].v, bs.factor);
    if (threadIdx.x % kLanesPerBlock == 0) scales[g / kLanesPerBlock] = bs.s;
  }
}

// Quantize then dequantize along dim0 in one pass (ops::mx_round_trip): the dim0 quantization's
// lanes, writing the values (TOut; an f32 input is rounded to bf16 first for a bf16 output)
// instead of the bytes. out may be x.
template <class T, class TOut>
__global__ void __launch_bounds__(kQuantizeThreads)
    mx_round_trip_dim0_kernel(const T* x, int64_t chunks, MxScaleRule rule, TOut* out) {
  constexpr int P = Chunk<T>::P;
  Chunk<T> c[kDim0ChunksPerThread];
  load_dim0_chunks(x, chunks, c);
#pragma unroll
  for (int u = 0; u < kDim0ChunksPerThread; ++u) {
    const int64_t g = dim0_chunk(u);
    round_to<TOut>(c[u].v);
    mx_round_trip_lanes<P>(c[u].v, rule, g < chunks);  // whole blocks: see the quantization
    if (g < chunks) store_run<TOut, P>(out + g * P, c[u].v);
  }
}

// dim1 tiles: 128 rows (four blocks) x 64 columns of one matrix, staged in shared memory by
// coalesced 16-byte accesses; then adjacent lanes walk the blocks of one column, so that a
// column's 128 transposed bytes (one line) are written (quantize) or read (dequantize) by
// neighbouring lanes. Rows 16 apart map onto the same banks; word columns are XOR-swizzled by
// 4 * (row / 16) so the lanes of a warp, which walk different 16-row groups, read different
// banks (the swizzle keeps 16-byte chunks whole).
template <class T, int kColumns>
struct Dim1Tile {
  static constexpr int kRows = 4 * kMxBlock;
  static constexpr int kCols = kColumns;
  static constexpr int kColsPerWord = 4 / sizeof(T);
  static constexpr int kWords = kCols / kColsPerWord;  // per row: 32 (bf16) or 64 (f32)
  static constexpr int kChunksPerRow = kWords / 4;
  static_assert(kRows / 16 * 4 <= kWords, "the swizzle stays within a row");
  __align__(16) uint32_t words[kRows * kWords];

  __device__ __forceinline__ static int swizzled(int r, int w) {
    return r * kWords + (w ^ (r / 16 * 4));
  }
  __device__ __forceinline__ uint4& chunk(int r, int w) {  // w: a multiple of 4
    return *reinterpret_cast<uint4*>(&words[swizzled(r, w)]);
  }
  // Element (r, c); the rows of a 16-row group are kCols elements apart.
  __device__ __forceinline__ T& element(int r, int c) {
    return reinterpret_cast<T*>(&words[swizzled(r, c / kColsPerWord)])[c % kColsPerWord];
  }
  // copy(r, w) for every 16-byte chunk (four words from word w of row r) inside rows x cols.
  template <int kThreads, class Copy>
  __device__ __forceinline__ void for_each_chunk(int rows, int cols, Copy&& copy) {
    static_assert(kRows * kChunksPerRow % kThreads == 0);
#pragma unroll
    for (int u = 0; u < kRows * kChunksPerRow / kThreads; ++u) {
      const int c = u * kThreads + threadIdx.x;
      const int r = c / kChunksPerRow, w = c % kChunksPerRow * 4;
      if (r < rows && w * kColsPerWord < cols) copy(r, w);
    }
  }
};

struct TileOrigin {  // where a dim1 tile lies: matrix b, rows from r0, columns from c0
  int64_t b, r0, c0;
  int rows, cols;  // the tile's extent (a multiple of 32 rows, of the 16-byte column group)
};

template <class Tile>
__device__ __forceinline__ TileOrigin dim1_tile_origin(int64_t rows, int64_t cols) {
  TileOrigin o;
  o.b = blockIdx.z;
  o.r0 = static_cast<int64_t>(blockIdx.y) * Tile::kRows;
  o.c0 = static_cast<int64_t>(blockIdx.x) * Tile::kCols;
  o.rows = static_cast<int>(rows - o.r0 < Tile::kRows ? rows - o.r0 : Tile::kRows);
  o.cols = static_cast<int>(cols - o.c0 < Tile::kCols ? cols - o.c0 : Tile::kCols);
  return o;
}

template <class Tile>
dim3 dim1_grid(int64_t batch, int64_t rows, int64_t cols) {
  return dim3(static_cast<unsigned>((cols + Tile::kCols - 1) / Tile::kCols),
              static_cast<unsigned>((rows + Tile::kRows - 1) / Tile::kRows),
              static_cast<unsigned>(batch));
}

// The quantize tile: 256 bytes of each of its 128 rows (128 bf16 or 64 f32 columns, 32 KiB),
// loaded by cp.async (no registers held: four 512-thread CTAs per multiprocessor keep 128 KiB in
// flight); docs/benchmarks-history.md has the versions measured.
template <class T>
using QuantizeTile = Dim1Tile<T, 256 / sizeof(T)>;
template <class T>
using DequantizeTile = Dim1Tile<T, 64>;

// Eight lanes per column: lane pair (block, half) holds 16 values, the pair's amax meets by one
// shuffle, and each lane stores 16 bytes: a warp's store writes four whole 128-byte lines. A
// thread takes every 64th column of the tile (a column step).
constexpr int kDim1QuantizeThreads = 512;

// What a dim1 pass writes for each half block (16 values of column `out_row`'s block
// `block_row`, already as the input's values): the E4M3 bytes and scale (quantize), or the MX
// values in the stored layout (the transposed round trip).
struct Dim1Bytes {
  uint8_t* data;
  uint8_t* scales;
  __device__ __forceinline__ void operator()(int64_t out_row, int64_t block_row, int half,
                                             int64_t rows, const float* v,
                                             const BlockScale& bs) const {
    constexpr int kHalf = kMxBlock / 2;
    uint32_t w[kHalf / 4];
#pragma unroll
    for (int i = 0; i < kHalf / 4; ++i)
      w[i] = e4m3x2(v[4 * i], v[4 * i + 1], bs.factor) |
             (static_cast<uint32_t>(e4m3x2(v[4 * i + 2], v[4 * i + 3], bs.factor)) << 16);
    *reinterpret_cast<uint4*>(data + out_row * rows + block_row * kMxBlock + half * kHalf) =
        make_uint4(w[0], w[1], w[2], w[3]);
    if (half == 0) scales[out_row * (rows / kMxBlock) + block_row] = bs.s;
  }
};

template <class TOut>
struct Dim1Values {
  TOut* out;
  __device__ __forceinline__ void operator()(int64_t out_row, int64_t block_row, int half,
                                             int64_t rows, const float* v,
                                             const BlockScale& bs) const {
    constexpr int kHalf = kMxBlock / 2;
    const float scale = e8m0_value(bs.s);
    float q[kHalf];
#pragma unroll
    for (int i = 0; i < kHalf; i += 2) {
      const float2 pair = mx_values2(v[i], v[i + 1], bs, scale);
      q[i] = pair.x;
      q[i + 1] = pair.y;
    }
    store_run<TOut, kHalf>(out + out_row * rows + block_row * kMxBlock + half * kHalf, q);
  }
};

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const auto s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}

// A dim1 pass that writes nothing along dim0.
struct NoDim0 {};

// The dim1 pass over x (T), each value first rounded to TValue (the dtype the values are read
// in: a copy of f32 weights made in bf16 quantizes their bf16 values). Each column step's
// columns are their own cp.async group: the next step's loads stay in flight while this one is
// converted. With a dim0 writer, the tile's blocks along its rows are then written from the same
// shared memory (both MX copies of a weight from one read).
template <class T, class TValue, class Out, class Out0 = NoDim0>
__global__ void __launch_bounds__(kDim1QuantizeThreads, 4)
    mx_dim1_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, MxScaleRule rule, Out write,
                   Out0 write_dim0 = {}) {
  using Tile = QuantizeTile<T>;
  constexpr int kColumnStep = kDim1QuantizeThreads / 8, kHalf = kMxBlock / 2;
  constexpr int kSteps = Tile::kCols / kColumnStep;
  constexpr int kStepChunks = Tile::kChunksPerRow / kSteps;  // per row
  static_assert(
      Tile::kCols % kColumnStep == 0 && Tile::kRows * kStepChunks % kDim1QuantizeThreads == 0,
      "whole column steps, whole loads per thread");
  __shared__ Tile tile;
  const TileOrigin o = dim1_tile_origin<Tile>(rows, cols);
  const T* src = x + (o.b * rows + o.r0) * cols + o.c0;
#pragma unroll
  for (int step = 0; step < kSteps; ++step) {
#pragma unroll
    for (int u = 0; u < Tile::kRows * kStepChunks / kDim1QuantizeThreads; ++u) {
      const int c = u * kDim1QuantizeThreads + threadIdx.x;
      const int r = c / kStepChunks, w = (c % kStepChunks + step * kStepChunks) * 4;
      if (r < o.rows && w * Tile::kColsPerWord < o.cols)
        cp_async16(&tile.chunk(r, w), src + r * cols + w * Tile::kColsPerWord);
    }
    asm volatile("cp.async.commit_group;\n" ::);
  }
  const int half = threadIdx.x % 2, blk = threadIdx.x / 2 % 4;
  const int64_t block_row = o.r0 / kMxBlock + blk;
#pragma unroll
  for (int col = threadIdx.x / 8; col < Tile::kCols; col += kColumnStep) {
    // This step's columns have landed (every thread runs every step: the barrier is uniform).
    if (kSteps == 2 && col < kColumnStep)
      asm volatile("cp.async.wait_group 1;\n" ::);
    else
      asm volatile("cp.async.wait_group 0;\n" ::);
    __syncthreads();
    // Every lane runs the shuffle below; those outside the tile store nothing.
    const bool active = blk * kMxBlock < o.rows && col < o.cols;
    // The lane's 16 rows share one swizzle (one 16-row group): one address, then fixed offsets.
    const T* column = &tile.element(blk * kMxBlock + half * kHalf, col);
    float v[kHalf];
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < kHalf; ++i) {
      if constexpr (std::is_same_v<T, TValue>)
        v[i] = active ? to_float(column[i * Tile::kCols]) : 0.0f;
      else
        v[i] = active ? to_float(from_float<TValue>(to_float(column[i * Tile::kCols]))) : 0.0f;
      m = max(m, magnitude_bits(v[i]));
    }
    m = max(m, __shfl_xor_sync(0xffffffffu, m, 1));
    if (!active) continue;
    // Column c0 + col of matrix b: a row of the transposed (stored) layout.
    write(o.b * cols + o.c0 + col, block_row, half, rows, v, block_scale(rule, m));
  }
  if constexpr (!std::is_same_v<Out0, NoDim0>) {
    // The last column step waited for every load and synchronised: the whole tile is visible.
    // Lane pair (row, block) holds the block's two halves, read as 16-byte chunks (a quarter
    // warp meets in two (f32) or four (bf16) of the eight 16-byte bank groups; starting each
    // lane at its own chunk spilled the registers and ran slower, docs/benchmarks-history.md).
    constexpr int kBlocksPerRow = Tile::kCols / kMxBlock;
    constexpr int kPerChunk = 16 / sizeof(T);
    constexpr int kLanes = Tile::kRows * kBlocksPerRow * 2;
    static_assert(kLanes % kDim1QuantizeThreads == 0, "every thread runs every round");
#pragma unroll
    for (int lane = threadIdx.x; lane < kLanes; lane += kDim1QuantizeThreads) {
      const int h = lane % 2, blk0 = lane / 2 % kBlocksPerRow, r = lane / 2 / kBlocksPerRow;
      const bool active = r < o.rows && blk0 * kMxBlock < o.cols;
      float v[kHalf];
      uint32_t m = 0;
#pragma unroll
      for (int j = 0; j < kHalf / kPerChunk; ++j) {
        const int c = blk0 * kMxBlock + h * kHalf + j * kPerChunk;
        const uint4 raw = active ? tile.chunk(r, c / Tile::kColsPerWord) : make_uint4(0, 0, 0, 0);
        const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int k = 0; k < kPerChunk; ++k) {
          float& value = v[j * kPerChunk + k];
          if constexpr (std::is_same_v<T, TValue>)
            value = to_float(e[k]);
          else
            value = to_float(from_float<TValue>(to_float(e[k])));
          m = max(m, magnitude_bits(value));
        }
      }
      m = max(m, __shfl_xor_sync(0xffffffffu, m, 1));
      // Row r0 + r of matrix b, its block (c0 / 32 + blk0), in x's layout.
      if (active)
        write_dim0((o.b * rows + o.r0 + r), o.c0 / kMxBlock + blk0, h, cols, v,
                   block_scale(rule, m));
    }
  }
}

// 16 E4M3 bytes of one block, decoded (exactly: every product is an f32) into v.
__device__ __forceinline__ void decode16(const uint8_t* q, float scale, float* v) {
  const uint4 raw = *reinterpret_cast<const uint4*>(q);
  const __nv_fp8_e4m3* e = reinterpret_cast<const __nv_fp8_e4m3*>(&raw);
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = __fmul_rn(static_cast<float>(e[i]), scale);
}

template <class T>
__device__ __forceinline__ void store16(T* out, const float* v) {
  constexpr int P = Pack<T>::kSize;
#pragma unroll
  for (int i = 0; i < 16; i += P) {
    Pack<T> pk;
#pragma unroll
    for (int k = 0; k < P; ++k) pk.v[k] = v[i + k];
    store_pack(out + i, pk);
  }
}

// dim0: thread g decodes bytes [16 g, 16 g + 16), half a block, in place.
template <class T>
__global__ void mx_dequantize_dim0_kernel(const uint8_t* __restrict__ data,
                                          const uint8_t* __restrict__ scales, int64_t groups,
                                          T* __restrict__ out) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= groups) return;
  float v[16];
  decode16(data + 16 * g, e8m0_value(scales[g / 2]), v);
  store16(out + 16 * g, v);
}

// dim1: the quantize kernel run backwards: thread (column, block) decodes its 32 bytes (four
// lanes read a 128-byte line) into the shared tile, which then goes out row by row.
template <class T>
__global__ void __launch_bounds__(kQuantizeThreads)
    mx_dequantize_dim1_kernel(const uint8_t* __restrict__ data, const uint8_t* __restrict__ scales,
                              int64_t rows, int64_t cols, T* __restrict__ out) {
  using Tile = DequantizeTile<T>;
  __shared__ Tile tile;
  const TileOrigin o = dim1_tile_origin<Tile>(rows, cols);
  const int blk = threadIdx.x % 4, col = threadIdx.x / 4;  // four lanes read a column's line
  static_assert(Tile::kCols * 4 == kQuantizeThreads, "four lanes per column");
  if (blk * kMxBlock < o.rows && col < o.cols) {
    const int64_t in_row = o.b * cols + o.c0 + col, block_row = o.r0 / kMxBlock + blk;
    const float scale = e8m0_value(scales[in_row * (rows / kMxBlock) + block_row]);
    float v[kMxBlock];
    decode16(data + in_row * rows + block_row * kMxBlock, scale, v);
    decode16(data + in_row * rows + block_row * kMxBlock + 16, scale, v + 16);
#pragma unroll
    for (int g = 0; g < 2; ++g) {  // two 16-row groups, one swizzle each
      T* column = &tile.element(blk * kMxBlock + 16 * g, col);
#pragma unroll
      for (int i = 0; i < 16; ++i) column[i * Tile::kCols] = from_float<T>(v[16 * g + i]);
    }
  }
  __syncthreads();
  T* dst = out + (o.b * rows + o.r0) * cols + o.c0;
  tile.template for_each_chunk<kQuantizeThreads>(o.rows, o.cols, [&](int r, int w) {
    *reinterpret_cast<uint4*>(dst + r * cols + w * Tile::kColsPerWord) = tile.chunk(r, w);
  });
}

// The weight gradient's operands: blocks of 32 rows from each expert's first row. prefix[e] is
// the number of blocks before expert e (its last block may be short: zero-padded).
__global__ void expert_block_prefix_kernel(const int64_t* offsets, int experts, int64_t* prefix) {
  if (threadIdx.x != 0) return;
  int64_t total = 0;
  for (int e = 0; e < experts; ++e) {
    prefix[e] = total;
    total += (offsets[e + 1] - offsets[e] + kMxBlock - 1) / kMxBlock;
  }
  prefix[experts] = total;
}

// Thread (block g, column c): the block's 32 values down column c, quantized and dequantized in
// place of the originals. A warp reads 32 adjacent columns of a row at a time.
template <class T>
__global__ void mx_round_trip_expert_rows_kernel(const T* __restrict__ x, int64_t k,
                                                 kernels::ExpertSegments rows, int experts,
                                                 const int64_t* __restrict__ prefix,
                                                 MxScaleRule rule, T* __restrict__ out) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= k) return;
  for (int64_t g = blockIdx.y; g < prefix[experts]; g += gridDim.y) {
    const int lo = kernels::last_start_at_or_before(prefix, experts, g);  // g's expert
    const int64_t b = g - prefix[lo];
    const int64_t first = rows.segments[lo] + b * kMxBlock;
    const int64_t remaining = rows.offsets[lo + 1] - rows.offsets[lo] - b * kMxBlock;
    const int n = remaining < kMxBlock ? static_cast<int>(remaining) : kMxBlock;
    float v[kMxBlock];
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < kMxBlock; ++i) {
      v[i] = i < n ? to_float(x[(first + i) * k + c]) : 0.0f;
      m = max(m, magnitude_bits(v[i]));
    }
    const BlockScale bs = block_scale(rule, m);
    const float scale = e8m0_value(bs.s);
#pragma unroll
    for (int i = 0; i < kMxBlock; ++i) {
      if (i >= n) break;
      __nv_fp8_e4m3 q;
      q.__x = __nv_cvt_float_to_fp8(__fmul_rn(v[i], bs.factor), __NV_SATFINITE, __NV_E4M3);
      out[(first + i) * k + c] = from_float<T>(__fmul_rn(static_cast<float>(q), scale));
    }
  }
}

}  // namespace

namespace kernels {

cudaError_t mx_quantize(DType in, const void* x, QuantAxis axis, MxScaleRule rule, int64_t batch,
                        int64_t rows, int64_t cols, uint8_t* data, uint8_t* scales,
                        cudaStream_t stream) {
  const int64_t n = batch * rows * cols;
  if (n == 0) return cudaSuccess;
  dispatch_storage(in, [&](auto tag) {
    using T = decltype(tag);
    constexpr int P = Chunk<T>::P;
    const T* px = static_cast<const T*>(x);
    if (axis == QuantAxis::kDim0) {
      const int64_t chunks = n / P;
      const int64_t per_cta = int64_t{kQuantizeThreads} * kDim0ChunksPerThread;
      mx_quantize_dim0_kernel<T><<<static_cast<unsigned>((chunks + per_cta - 1) / per_cta),
                                   kQuantizeThreads, 0, stream>>>(px, chunks, rule, data, scales);
    } else {
      mx_dim1_kernel<T, T, Dim1Bytes>
          <<<dim1_grid<QuantizeTile<T>>(batch, rows, cols), kDim1QuantizeThreads, 0, stream>>>(
              px, rows, cols, rule, Dim1Bytes{data, scales});
    }
  });
  return cudaGetLastError();
}

cudaError_t mx_dequantize(DType out, const uint8_t* data, const uint8_t* scales, QuantAxis axis,
                          int64_t batch, int64_t rows, int64_t cols, void* dst,
                          cudaStream_t stream) {
  const int64_t n = batch * rows * cols;
  if (n == 0) return cudaSuccess;
  dispatch_storage(out, [&](auto tag) {
    using T = decltype(tag);
    T* o = static_cast<T*>(dst);
    if (axis == QuantAxis::kDim0) {
      const int64_t groups = n / 16;
      mx_dequantize_dim0_kernel<T>
          <<<static_cast<unsigned>((groups + kBlock - 1) / kBlock), kBlock, 0, stream>>>(
              data, scales, groups, o);
    } else {
      mx_dequantize_dim1_kernel<T>
          <<<dim1_grid<DequantizeTile<T>>(batch, rows, cols), kQuantizeThreads, 0, stream>>>(
              data, scales, rows, cols, o);
    }
  });
  return cudaGetLastError();
}

cudaError_t mx_round_trip(DType in, const void* x, QuantAxis axis, MxScaleRule rule, int64_t batch,
                          int64_t rows, int64_t cols, DType out, void* dst, cudaStream_t stream) {
  const int64_t n = batch * rows * cols;
  if (n == 0) return cudaSuccess;
  dispatch_storage(in, [&](auto tag) {
    using T = decltype(tag);
    dispatch_storage(out, [&](auto out_tag) {
      using TOut = decltype(out_tag);
      TOut* o = static_cast<TOut*>(dst);
      if (axis == QuantAxis::kDim0) {
        const int64_t chunks = n / Chunk<T>::P;
        const int64_t per_cta = int64_t{kQuantizeThreads} * kDim0ChunksPerThread;
        mx_round_trip_dim0_kernel<T, TOut>
            <<<static_cast<unsigned>((chunks + per_cta - 1) / per_cta), kQuantizeThreads, 0,
               stream>>>(static_cast<const T*>(x), chunks, rule, o);
      } else {
        mx_dim1_kernel<T, TOut, Dim1Values<TOut>>
            <<<dim1_grid<QuantizeTile<T>>(batch, rows, cols), kDim1QuantizeThreads, 0, stream>>>(
                static_cast<const T*>(x), rows, cols, rule, Dim1Values<TOut>{o});
      }
    });
  });
  return cudaGetLastError();
}

cudaError_t mx_round_trip_both_axes(DType in, const void* x, MxScaleRule rule, int64_t batch,
                                    int64_t rows, int64_t cols, DType out, void* dim0,
                                    void* transposed, cudaStream_t stream) {
  if (batch * rows * cols == 0) return cudaSuccess;
  dispatch_storage(in, [&](auto tag) {
    using T = decltype(tag);
    dispatch_storage(out, [&](auto out_tag) {
      using TOut = decltype(out_tag);
      mx_dim1_kernel<T, TOut, Dim1Values<TOut>, Dim1Values<TOut>>
          <<<dim1_grid<QuantizeTile<T>>(batch, rows, cols), kDim1QuantizeThreads, 0, stream>>>(
              static_cast<const T*>(x), rows, cols, rule,
              Dim1Values<TOut>{static_cast<TOut*>(transposed)},
              Dim1Values<TOut>{static_cast<TOut*>(dim0)});
    });
  });
  return cudaGetLastError();
}

cudaError_t mx_round_trip_expert_rows(DType t, const void* x, int64_t m, int64_t k,
                                      ExpertSegments rows, int experts, int64_t* block_prefix,
                                      MxScaleRule rule, void* out, cudaStream_t stream) {
  if (m == 0 || k == 0 || experts == 0) return cudaSuccess;
  expert_block_prefix_kernel<<<1, 32, 0, stream>>>(rows.offsets, experts, block_prefix);
  const int64_t max_blocks = (m + kMxBlock - 1) / kMxBlock + experts;  // ceil per expert
  const dim3 grid(static_cast<unsigned>((k + kBlock - 1) / kBlock),
                  static_cast<unsigned>(max_blocks < 65535 ? max_blocks : 65535));
  dispatch_storage(t, [&](auto tag) {
    using T = decltype(tag);
    mx_round_trip_expert_rows_kernel<T><<<grid, kBlock, 0, stream>>>(
        static_cast<const T*>(x), k, rows, experts, block_prefix, rule, static_cast<T*>(out));
  });
  return cudaGetLastError();
}

}  // namespace kernels

}  // namespace mt::cuda
