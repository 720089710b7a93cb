// FP8 blockwise quantization kernels (ops/cuda/fp8.h). Each is bit-exact with the CPU reference
// (ops/cpu/fp8.cpp): the same amax, the same f32 scale and factor, the same E4M3 rounding.
#include "ops/cuda/fp8.cuh"
#include "ops/cuda/fp8.h"

namespace mt::cuda::kernels {

namespace {

constexpr int kB = static_cast<int>(kFp8Block);

// 1 x 128 along the rows: 16 lanes per block, 8 elements each (one or two 16-byte loads).
template <class T>
__global__ void quantize_rows_kernel(const T* x, int64_t blocks, Fp8ScaleRule rule, uint8_t* data,
                                     float* scales) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t block = t / 16;
  const bool active = block < blocks;
  const int64_t at = block * kB + (t % 16) * 8;
  float v[8] = {};
  if (active) {
    if constexpr (sizeof(T) == 2) {
      const Pack<T> p = load_pack(x + at);
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = p.v[i];
    } else {
      const Pack<T> p0 = load_pack(x + at), p1 = load_pack(x + at + 4);
#pragma unroll
      for (int i = 0; i < 4; ++i) v[i] = p0.v[i], v[4 + i] = p1.v[i];
    }
  }
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) m = max(m, magnitude(v[i]));
#pragma unroll
  for (int o = 1; o < 16; o <<= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (!active) return;
  const Fp8Scale s = fp8_scale(rule, m);
  uint2 q;
  q.x = fp8x2(v[0], v[1], s) | (static_cast<uint32_t>(fp8x2(v[2], v[3], s)) << 16);
  q.y = fp8x2(v[4], v[5], s) | (static_cast<uint32_t>(fp8x2(v[6], v[7], s)) << 16);
  *reinterpret_cast<uint2*>(data + at) = q;
  if (t % 16 == 0) scales[block] = s.scale;  // (row, block of the row) in that order
}

// 1 x 128 blocks along the rows back to T: 16 elements a thread (one 16-byte load of E4M3),
// from_e4m3(q) * scale exact in f64 (4 + 24 significant bits) and rounded once, as the CPU does.
template <class T>
__global__ void dequantize_rows_kernel(const uint8_t* data, const float* scales, int64_t groups,
                                       T* out) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= groups) return;
  const uint4 raw = reinterpret_cast<const uint4*>(data)[g];
  const double scale = scales[g / (kB / 16)];
  const auto* q = reinterpret_cast<const __nv_fp8x2_storage_t*>(&raw);
  alignas(16) T e[16];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(q[i], __NV_E4M3);
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
    if constexpr (sizeof(T) == 2) {
      e[2 * i] = __double2bfloat16(f.x * scale);
      e[2 * i + 1] = __double2bfloat16(f.y * scale);
    } else {
      e[2 * i] = __double2float_rn(f.x * scale);
      e[2 * i + 1] = __double2float_rn(f.y * scale);
    }
  }
  constexpr int kPacks = 16 * static_cast<int>(sizeof(T)) / 16;
#pragma unroll
  for (int b = 0; b < kPacks; ++b)
    reinterpret_cast<uint4*>(out + g * 16)[b] = reinterpret_cast<const uint4*>(e)[b];
}

// 128 x 128 tiles: one CTA of kTileThreads per tile (fp8.cuh's store_fp8_tile), the tile's rows
// read as 16-byte packs.
template <class T>
__global__ void __launch_bounds__(kTileThreads)
    quantize_tiles_kernel(const T* w, int64_t rows, int64_t cols, Fp8ScaleRule rule, uint8_t* dim0,
                          uint8_t* dim1, float* scales) {
  using Tile = Fp8TileThread<Pack<T>::kSize>;
  const TilePlace at = tile_place(rows, cols);
  const T* src = w + at.offset(Tile::row0(), Tile::col());
  float v[Tile::kPacks][Tile::P];
#pragma unroll
  for (int i = 0; i < Tile::kPacks; ++i) {
    const Pack<T> p = load_pack(src + int64_t{i} * Tile::kRowStep * cols);
#pragma unroll
    for (int j = 0; j < Tile::P; ++j) v[i][j] = p.v[j];
  }
  store_fp8_tile<Tile::P>(v, rule, at, dim0, dim1, scales);
}

// A weight's tiles into the other stored layout: one CTA of kTileThreads per 128 x 128 tile, its
// rows read as 16-byte runs (a warp: four whole rows) into a shared tile, written transposed
// (fp8.cuh's store_tile_transposed).
__global__ void __launch_bounds__(kTileThreads)
    transpose_tiles_kernel(const uint8_t* in, int64_t rows, int64_t cols, uint8_t* out) {
  constexpr int kRunsPerRow = kB / 16;
  constexpr int kRowStep = kTileThreads / kRunsPerRow;
  __shared__ alignas(16) uint8_t tile[kTileBytes];
  const TilePlace at = tile_place(rows, cols);
  const int r0 = threadIdx.x / kRunsPerRow, c = (threadIdx.x % kRunsPerRow) * 16;
  uint4 run[kB / kRowStep];
#pragma unroll
  for (int i = 0; i < kB / kRowStep; ++i)
    run[i] = *reinterpret_cast<const uint4*>(in + at.offset(r0 + i * kRowStep, c));
#pragma unroll
  for (int i = 0; i < kB / kRowStep; ++i)
    *reinterpret_cast<uint4*>(tile + tile_byte(r0 + i * kRowStep, c)) = run[i];
  __syncthreads();
  store_tile_transposed(tile, at, out);
}

// 1 x 128 down the columns: one CTA per 128-row block and 64 columns. The block's rows are read
// coalesced into shared memory (as floats), each column's amax is reduced by the four threads
// that share it, their bytes go through a second shared tile and leave as whole 16-byte runs of
// the transposed rows.
constexpr int kColumnThreads = 256;
constexpr int kColumnWidth = 64;               // columns per CTA
constexpr int kValuePitch = kColumnWidth + 8;  // floats per shared row: conflict-free reads
constexpr int kBytePitch = kB + 16;            // bytes per shared transposed row

template <class T>
__global__ void __launch_bounds__(kColumnThreads)
    quantize_columns_kernel(const T* x, int64_t m, int64_t k, ExpertSegments rows, int experts,
                            bool segmented, Fp8ScaleRule rule, uint8_t* data, float* scales) {
  __shared__ alignas(16) float values[kB * kValuePitch];
  __shared__ alignas(16) uint8_t bytes[kColumnWidth * kBytePitch];
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kB;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kColumnWidth;
  int64_t end = r0 + kB;  // the block's rows [r0, end) are read, the rest are zeros
  if (segmented) {
    // The expert whose segment holds r0: the last e with segments[e] <= r0 (empty experts
    // share their segment start with the next one); none past the last segment.
    if (r0 >= rows.segments[experts]) {
      end = r0;
    } else {
      int lo = 0, hi = experts;  // segments[lo] <= r0 < segments[hi]
      while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (rows.segments[mid] <= r0)
          lo = mid;
        else
          hi = mid;
      }
      end = min(r0 + kB, rows.segments[lo] + rows.offsets[lo + 1] - rows.offsets[lo]);
    }
  }
  // Load: 16-byte packs of a row, every one of a thread's loads issued before the first is used;
  // columns past k (a last partial CTA) read as zeros. Then into shared memory four floats a
  // store.
  constexpr int kPack = Pack<T>::kSize;
  constexpr int kPacksPerRow = kColumnWidth / kPack;
  constexpr int kLoads = kB * kPacksPerRow / kColumnThreads;
  static_assert(kLoads * kColumnThreads == kB * kPacksPerRow && kPack % 4 == 0);
  uint4 raw[kLoads];
#pragma unroll
  for (int l = 0; l < kLoads; ++l) {
    const int i = threadIdx.x + l * kColumnThreads;
    const int r = i / kPacksPerRow, c = (i % kPacksPerRow) * kPack;
    raw[l] = r0 + r < end && c0 + c < k
                 ? *reinterpret_cast<const uint4*>(x + (r0 + r) * k + c0 + c)
                 : make_uint4(0, 0, 0, 0);  // zero bits are zero in bf16 and f32
  }
#pragma unroll
  for (int l = 0; l < kLoads; ++l) {
    const int i = threadIdx.x + l * kColumnThreads;
    const int r = i / kPacksPerRow, c = (i % kPacksPerRow) * kPack;
    const T* e = reinterpret_cast<const T*>(&raw[l]);
#pragma unroll
    for (int j = 0; j < kPack; j += 4)
      *reinterpret_cast<float4*>(&values[r * kValuePitch + c + j]) =
          make_float4(to_float(e[j]), to_float(e[j + 1]), to_float(e[j + 2]), to_float(e[j + 3]));
  }
  __syncthreads();
  // Column c, rows q, q + 4, ...: the four threads of a column are adjacent lanes.
  const int c = threadIdx.x / 4, q = threadIdx.x % 4;
  uint32_t amax = 0;
#pragma unroll 8
  for (int i = 0; i < kB / 4; ++i)
    amax = max(amax, magnitude(values[(4 * i + q) * kValuePitch + c]));
  amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  const bool live = end > r0;
  const Fp8Scale s = live ? fp8_scale(rule, amax) : Fp8Scale{1.0f, 1.0f};
#pragma unroll 8
  for (int i = 0; i < kB / 4; i += 2) {
    const uint16_t pair = fp8x2(values[(4 * i + q) * kValuePitch + c],
                                values[(4 * (i + 1) + q) * kValuePitch + c], s);
    bytes[c * kBytePitch + 4 * i + q] = static_cast<uint8_t>(pair);
    bytes[c * kBytePitch + 4 * (i + 1) + q] = static_cast<uint8_t>(pair >> 8);
  }
  if (q == 0 && c0 + c < k) scales[blockIdx.y * k + c0 + c] = s.scale;
  __syncthreads();
  // Store: each column's 128 bytes as eight 16-byte runs of its transposed row.
  for (int i = threadIdx.x; i < kColumnWidth * (kB / 16); i += kColumnThreads) {
    const int col = i / (kB / 16), run = i % (kB / 16);
    if (c0 + col >= k) continue;
    *reinterpret_cast<uint4*>(data + (c0 + col) * m + r0 + run * 16) =
        *reinterpret_cast<const uint4*>(bytes + col * kBytePitch + run * 16);
  }
}

}  // namespace

cudaError_t fp8_quantize_rows(DType in, const void* x, int64_t rows, int64_t cols,
                              Fp8ScaleRule rule, uint8_t* data, float* scales,
                              cudaStream_t stream) {
  const int64_t blocks = rows * (cols / kB);
  if (blocks == 0) return cudaSuccess;
  const int64_t threads = blocks * 16;
  const unsigned grid = static_cast<unsigned>((threads + kBlock - 1) / kBlock);
  dispatch_storage(in, [&](auto tag) {
    using T = decltype(tag);
    quantize_rows_kernel<T>
        <<<grid, kBlock, 0, stream>>>(static_cast<const T*>(x), blocks, rule, data, scales);
  });
  return cudaGetLastError();
}

cudaError_t fp8_dequantize_rows(const uint8_t* data, const float* scales, int64_t rows,
                                int64_t cols, DType out_dtype, void* out, cudaStream_t stream) {
  const int64_t groups = rows * cols / 16;
  if (groups == 0) return cudaSuccess;
  const auto grid = static_cast<unsigned>((groups + kBlock - 1) / kBlock);
  dispatch_storage(out_dtype, [&](auto tag) {
    using T = decltype(tag);
    dequantize_rows_kernel<T>
        <<<grid, kBlock, 0, stream>>>(data, scales, groups, static_cast<T*>(out));
  });
  return cudaGetLastError();
}

cudaError_t fp8_quantize_tiles(DType in, const void* w, int64_t batch, int64_t rows, int64_t cols,
                               Fp8ScaleRule rule, uint8_t* dim0, uint8_t* dim1, float* scales,
                               cudaStream_t stream) {
  const int64_t tiles = batch * (rows / kB) * (cols / kB);
  if (tiles == 0) return cudaSuccess;
  dispatch_storage(in, [&](auto tag) {
    using T = decltype(tag);
    quantize_tiles_kernel<T><<<static_cast<unsigned>(tiles), kTileThreads, 0, stream>>>(
        static_cast<const T*>(w), rows, cols, rule, dim0, dim1, scales);
  });
  return cudaGetLastError();
}

cudaError_t fp8_transpose_tiles(const uint8_t* in, int64_t batch, int64_t rows, int64_t cols,
                                uint8_t* out, cudaStream_t stream) {
  const int64_t tiles = batch * (rows / kB) * (cols / kB);
  if (tiles == 0) return cudaSuccess;
  transpose_tiles_kernel<<<static_cast<unsigned>(tiles), kTileThreads, 0, stream>>>(in, rows, cols,
                                                                                    out);
  return cudaGetLastError();
}

cudaError_t fp8_quantize_columns(DType in, const void* x, int64_t m, int64_t k,
                                 const ExpertSegments* rows, int experts, Fp8ScaleRule rule,
                                 uint8_t* data, float* scales, cudaStream_t stream) {
  if (m == 0 || k == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((k + kColumnWidth - 1) / kColumnWidth),
                  static_cast<unsigned>(m / kB));
  const ExpertSegments layout = rows ? *rows : ExpertSegments{nullptr, nullptr};
  dispatch_storage(in, [&](auto tag) {
    using T = decltype(tag);
    quantize_columns_kernel<T><<<grid, kColumnThreads, 0, stream>>>(
        static_cast<const T*>(x), m, k, layout, experts, rows != nullptr, rule, data, scales);
  });
  return cudaGetLastError();
}

}  // namespace mt::cuda::kernels
