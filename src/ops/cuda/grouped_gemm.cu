// Grouped GEMMs for the experts, version 1: bf16 tensor cores through WMMA (mma.sync), one
// 128x128 output tile per block, a single shared-memory stage. The row offsets of the experts
// stay on the device: the grid is sized for the worst case (ceil(M/128) + E row tiles) and each
// block finds its (expert, row tile) by walking the offsets, so no count ever reaches the host.
// Faster versions (wgmma, TMA, pipelining) are measured against this one.
#include <mma.h>

#include "ops/cuda/grouped_gemm.h"

#include "ops/cuda/common.cuh"

namespace mt::cuda {

namespace {

using namespace nvcuda;
using bf16 = __nv_bfloat16;

constexpr int kBM = 128, kBN = 128, kBK = 32;
constexpr int kThreads = 256;  // 8 warps: 2 along M x 4 along N, each 64 x 32
constexpr int kPad = 8;        // bf16 elements of row padding against bank conflicts
constexpr int kVec = 8;        // bf16 per 16-byte load

struct Smem {
  bf16 a[kBM * (kBK + kPad)];  // A tile: row-major (m, k), or col-major (k, m) for dW
  bf16 b[kBN * (kBK + kPad) > kBK*(kBN + kPad) ? kBN*(kBK + kPad) : kBK*(kBN + kPad)];
  float stage[8][16 * 16];  // per-warp epilogue staging of one fragment
};
static_assert(sizeof(Smem) <= 48 * 1024, "static shared memory limit");

// Copies a tile of `rows` x `cols` (cols contiguous in global memory) into shared memory at
// dst[r * dst_ld + c]; rows at or past row_end and cols at or past col_end read as zero.
__device__ void load_tile(const bf16* src, int64_t src_ld, int64_t row0, int64_t row_end,
                          int64_t col0, int64_t col_end, bf16* dst, int dst_ld, int rows,
                          int cols) {
  const int vecs_per_row = cols / kVec;
  for (int v = threadIdx.x; v < rows * vecs_per_row; v += kThreads) {
    const int r = v / vecs_per_row, c = (v % vecs_per_row) * kVec;
    const int64_t gr = row0 + r, gc = col0 + c;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (gr < row_end && gc < col_end) val = *reinterpret_cast<const uint4*>(src + gr * src_ld + gc);
    *reinterpret_cast<uint4*>(dst + r * dst_ld + c) = val;
  }
}

// Writes one 16x16 fp32 fragment to out (ld out_ld) at (row0, col0) within the bounds,
// converting to bf16 or keeping f32, adding the old value when accumulating.
__device__ void store_fragment(const wmma::fragment<wmma::accumulator, 16, 16, 16, float>& acc,
                               float* stage, void* out, bool out_f32, int64_t out_ld, int64_t row0,
                               int64_t row_end, int64_t col0, int64_t col_end, bool accumulate) {
  wmma::store_matrix_sync(stage, acc, 16, wmma::mem_row_major);
  __syncwarp();
  const int lane = threadIdx.x % 32;
  for (int i = lane; i < 256; i += 32) {
    const int64_t r = row0 + i / 16, c = col0 + i % 16;
    if (r >= row_end || c >= col_end) continue;
    if (out_f32) {
      float* o = static_cast<float*>(out) + r * out_ld + c;
      *o = accumulate ? *o + stage[i] : stage[i];
    } else {
      bf16* o = static_cast<bf16*>(out) + r * out_ld + c;
      *o = __float2bfloat16_rn(accumulate ? __bfloat162float(*o) + stage[i] : stage[i]);
    }
  }
  __syncwarp();
}

// Finds this block's (expert, first row) from the device offsets; false when it has no tile.
__device__ bool find_row_tile(kernels::ExpertSegments layout, int experts, int64_t tile,
                              int* expert, int64_t* row0, int64_t* row_end) {
  for (int e = 0; e < experts; ++e) {
    const int64_t rows = layout.offsets[e + 1] - layout.offsets[e];
    const int64_t tiles = (rows + kBM - 1) / kBM;
    if (tile < tiles) {
      *expert = e;
      *row0 = layout.segments[e] + tile * kBM;
      *row_end = layout.segments[e] + rows;
      return true;
    }
    tile -= tiles;
  }
  return false;
}

// out rows of expert e = a rows @ B_e, where B_e is w[e] (k x n, row-major) or, with
// b_transposed, w[e]^T for w[e] stored (n x k) row-major.
__global__ void __launch_bounds__(kThreads)
    grouped_rows_kernel(const bf16* a, const bf16* w, kernels::ExpertSegments layout, int experts,
                        int64_t k, int64_t n, bool b_transposed, void* out, bool out_f32) {
  __shared__ Smem s;
  int e;
  int64_t row0, row_end;
  if (!find_row_tile(layout, experts, blockIdx.y, &e, &row0, &row_end)) return;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kBN;
  const bf16* we = w + static_cast<int64_t>(e) * k * n;
  const int warp = threadIdx.x / 32, wm = warp / 4, wn = warp % 4;

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[4][2];
  for (auto& row : acc)
    for (auto& f : row) wmma::fill_fragment(f, 0.0f);

  for (int64_t k0 = 0; k0 < k; k0 += kBK) {
    load_tile(a, k, row0, row_end, k0, k, s.a, kBK + kPad, kBM, kBK);
    if (!b_transposed)  // B (k, n) row-major: tile rows k0.., cols col0..
      load_tile(we, n, k0, k, col0, n, s.b, kBN + kPad, kBK, kBN);
    else  // B = w^T, w (n, k): tile stored col-major as (col, k)
      load_tile(we, k, col0, n, k0, k, s.b, kBK + kPad, kBN, kBK);
    __syncthreads();
    for (int kk = 0; kk < kBK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fa[4];
      for (int i = 0; i < 4; ++i)
        wmma::load_matrix_sync(fa[i], s.a + (wm * 64 + i * 16) * (kBK + kPad) + kk, kBK + kPad);
      for (int j = 0; j < 2; ++j) {
        const int c = wn * 32 + j * 16;
        if (!b_transposed) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> fb;
          wmma::load_matrix_sync(fb, s.b + kk * (kBN + kPad) + c, kBN + kPad);
          for (int i = 0; i < 4; ++i) wmma::mma_sync(acc[i][j], fa[i], fb, acc[i][j]);
        } else {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> fb;
          wmma::load_matrix_sync(fb, s.b + c * (kBK + kPad) + kk, kBK + kPad);
          for (int i = 0; i < 4; ++i) wmma::mma_sync(acc[i][j], fa[i], fb, acc[i][j]);
        }
      }
    }
    __syncthreads();
  }
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 2; ++j)
      store_fragment(acc[i][j], s.stage[warp], out, out_f32, n, row0 + wm * 64 + i * 16, row_end,
                     col0 + wn * 32 + j * 16, n, false);
}

// dw[e] (k x n) (+)= x_e^T (k x rows) @ dy_e (rows x n): the reduction runs over the expert's
// rows.
__global__ void __launch_bounds__(kThreads)
    grouped_weight_kernel(const bf16* x, const bf16* dy, kernels::ExpertSegments layout, int64_t k,
                          int64_t n, void* dw, bool out_f32, bool accumulate) {
  __shared__ Smem s;
  const int e = blockIdx.z;
  const int64_t begin = layout.segments[e], end = begin + layout.offsets[e + 1] - layout.offsets[e];
  if (begin == end) return;  // an expert without rows keeps its gradient
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kBM;  // along k
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kBN;
  const int warp = threadIdx.x / 32, wm = warp / 4, wn = warp % 4;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[4][2];
  for (auto& row : acc)
    for (auto& f : row) wmma::fill_fragment(f, 0.0f);
  for (int64_t r0 = begin; r0 < end; r0 += kBK) {
    // A = x_e^T: tile (m = k-index, r) stored col-major as s.a[r * (kBM + kPad) + m].
    load_tile(x, k, r0, end, m0, k, s.a, kBM + kPad, kBK, kBM);
    load_tile(dy, n, r0, end, col0, n, s.b, kBN + kPad, kBK, kBN);
    __syncthreads();
    for (int kk = 0; kk < kBK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::col_major> fa[4];
      for (int i = 0; i < 4; ++i)
        wmma::load_matrix_sync(fa[i], s.a + kk * (kBM + kPad) + wm * 64 + i * 16, kBM + kPad);
      for (int j = 0; j < 2; ++j) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> fb;
        wmma::load_matrix_sync(fb, s.b + kk * (kBN + kPad) + wn * 32 + j * 16, kBN + kPad);
        for (int i = 0; i < 4; ++i) wmma::mma_sync(acc[i][j], fa[i], fb, acc[i][j]);
      }
    }
    __syncthreads();
  }
  void* dwe = out_f32
                  ? static_cast<void*>(static_cast<float*>(dw) + static_cast<int64_t>(e) * k * n)
                  : static_cast<void*>(static_cast<bf16*>(dw) + static_cast<int64_t>(e) * k * n);
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 2; ++j)
      store_fragment(acc[i][j], s.stage[warp], dwe, out_f32, n, m0 + wm * 64 + i * 16, k,
                     col0 + wn * 32 + j * 16, n, accumulate);
}

__global__ void zero_empty_groups_kernel(const int64_t* offsets, void* out, int64_t elems,
                                         bool out_f32) {
  const int e = blockIdx.y;
  if (offsets[e] != offsets[e + 1]) return;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < elems;
       i += int64_t{gridDim.x} * blockDim.x) {
    if (out_f32)
      static_cast<float*>(out)[e * elems + i] = 0.f;
    else
      static_cast<bf16*>(out)[e * elems + i] = __float2bfloat16_rn(0.f);
  }
}

}  // namespace

namespace kernels {

cudaError_t grouped_gemm_rows(const void* a, const void* w, ExpertSegments rows, int experts,
                              int64_t m, int64_t k, int64_t n, bool b_transposed, void* out,
                              bool out_f32, cudaStream_t stream) {
  if (m == 0 || n == 0) return cudaSuccess;
  const dim3 grid((n + kBN - 1) / kBN, (m + kBM - 1) / kBM + experts);
  grouped_rows_kernel<<<grid, kThreads, 0, stream>>>(static_cast<const bf16*>(a),
                                                     static_cast<const bf16*>(w), rows, experts, k,
                                                     n, b_transposed, out, out_f32);
  return cudaGetLastError();
}

cudaError_t grouped_gemm_weight(const void* x, const void* dy, ExpertSegments rows, int experts,
                                int64_t k, int64_t n, void* dw, bool out_f32, bool accumulate,
                                cudaStream_t stream) {
  if (k == 0 || n == 0 || experts == 0) return cudaSuccess;
  const dim3 grid((n + kBN - 1) / kBN, (k + kBM - 1) / kBM, experts);
  grouped_weight_kernel<<<grid, kThreads, 0, stream>>>(static_cast<const bf16*>(x),
                                                       static_cast<const bf16*>(dy), rows, k, n, dw,
                                                       out_f32, accumulate);
  return cudaGetLastError();
}

cudaError_t zero_empty_groups(const int64_t* offsets, int experts, void* out, int64_t group_elems,
                              bool out_f32, cudaStream_t stream) {
  if (experts == 0 || group_elems == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((group_elems + 255) / 256, 64)),
                  static_cast<unsigned>(experts));
  zero_empty_groups_kernel<<<grid, 256, 0, stream>>>(offsets, out, group_elems, out_f32);
  return cudaGetLastError();
}

}  // namespace kernels
}  // namespace mt::cuda
