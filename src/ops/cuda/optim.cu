// Multi-tensor AdamW: one launch per flat parameter buffer (a whole unit's group), fp32 master
// weights and moments, PyTorch's update order (as the CPU reference).
#include "ops/cuda/common.cuh"
#include "ops/cuda/fp8.cuh"
#include "ops/cuda/optim.h"

namespace mt::cuda {

namespace {

// Every operation rounded on its own, in the CPU reference's order (no contraction into FMAs):
// the update is bit-identical to the CPU's f32 AdamW and does not depend on how the compiler
// schedules it (a one-ulp change here moves a whole training run).
__device__ __forceinline__ float adamw_update(float p, float g, float& m, float& v,
                                              const kernels::AdamWScalars& s) {
  const float gi = __fmul_rn(g, s.grad_scale);
  m = __fadd_rn(__fmul_rn(s.beta1, m), __fmul_rn(__fsub_rn(1.f, s.beta1), gi));
  v = __fadd_rn(__fmul_rn(s.beta2, v), __fmul_rn(__fmul_rn(__fsub_rn(1.f, s.beta2), gi), gi));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), s.sqrt_bc2), s.eps);
  return __fsub_rn(__fmul_rn(p, s.decay), __fdiv_rn(__fmul_rn(s.step_size, m), denom));
}

// Memory-bound (28-30 bytes per parameter): float4 loads and stores over the first `packs` x 4
// elements, then the scalar tail. The scalars are read from device memory, so that a captured
// optimizer step replays with each step's learning rate and clipping factor.
__global__ void adamw_kernel(float* p, const float* g, float* m, float* v, __nv_bfloat16* compute,
                             const kernels::AdamWScalars* scalars, int64_t n, int64_t packs) {
  const kernels::AdamWScalars s = *scalars;
  const int64_t first = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = first; i < packs; i += stride) {
    float4 pv = reinterpret_cast<const float4*>(p)[i];
    const float4 gv = reinterpret_cast<const float4*>(g)[i];
    float4 mv = reinterpret_cast<const float4*>(m)[i];
    float4 vv = reinterpret_cast<const float4*>(v)[i];
    pv.x = adamw_update(pv.x, gv.x, mv.x, vv.x, s);
    pv.y = adamw_update(pv.y, gv.y, mv.y, vv.y, s);
    pv.z = adamw_update(pv.z, gv.z, mv.z, vv.z, s);
    pv.w = adamw_update(pv.w, gv.w, mv.w, vv.w, s);
    reinterpret_cast<float4*>(p)[i] = pv;
    reinterpret_cast<float4*>(m)[i] = mv;
    reinterpret_cast<float4*>(v)[i] = vv;
    if (compute) {
      __nv_bfloat162* c = reinterpret_cast<__nv_bfloat162*>(compute + 4 * i);
      c[0] = __floats2bfloat162_rn(pv.x, pv.y);
      c[1] = __floats2bfloat162_rn(pv.z, pv.w);
    }
  }
  for (int64_t i = 4 * packs + first; i < n; i += stride) {
    const float pi = adamw_update(p[i], g[i], m[i], v[i], s);
    p[i] = pi;
    if (compute) compute[i] = __float2bfloat16_rn(pi);
  }
}

// The update of one 128 x 128 tile of a weight, then its FP8 tiles from the updated values (rounded
// to bf16 first when asked): the thread layout of fp8.cuh's store_fp8_tile over float4 packs, each
// pack's four arrays read and written once (the 28 bytes a parameter of adamw_kernel), the E4M3
// bytes (2 more) leaving from registers and one shared tile.
__global__ void __launch_bounds__(kTileThreads)
    adamw_fp8_tiles_kernel(float* p, const float* g, float* m, float* v,
                           const kernels::AdamWScalars* scalars, int64_t rows, int64_t cols,
                           bool round_bf16, Fp8ScaleRule rule, uint8_t* dim0, uint8_t* dim1,
                           float* scales0, float* scales1) {
  using Tile = Fp8TileThread<4>;
  const kernels::AdamWScalars s = *scalars;
  const TilePlace at = tile_place(rows, cols);
  const int64_t first = at.offset(Tile::row0(), Tile::col());
  float w[Tile::kPacks][4];
#pragma unroll
  for (int i = 0; i < Tile::kPacks; ++i) {
    const int64_t e = first + int64_t{i} * Tile::kRowStep * cols;
    float4 pv = *reinterpret_cast<const float4*>(p + e);
    const float4 gv = *reinterpret_cast<const float4*>(g + e);
    float4 mv = *reinterpret_cast<const float4*>(m + e);
    float4 vv = *reinterpret_cast<const float4*>(v + e);
    pv.x = adamw_update(pv.x, gv.x, mv.x, vv.x, s);
    pv.y = adamw_update(pv.y, gv.y, mv.y, vv.y, s);
    pv.z = adamw_update(pv.z, gv.z, mv.z, vv.z, s);
    pv.w = adamw_update(pv.w, gv.w, mv.w, vv.w, s);
    *reinterpret_cast<float4*>(p + e) = pv;
    *reinterpret_cast<float4*>(m + e) = mv;
    *reinterpret_cast<float4*>(v + e) = vv;
    w[i][0] = pv.x, w[i][1] = pv.y, w[i][2] = pv.z, w[i][3] = pv.w;
    if (round_bf16)
#pragma unroll
      for (int j = 0; j < 4; ++j) w[i][j] = __bfloat162float(__float2bfloat16_rn(w[i][j]));
  }
  store_fp8_tile<4>(w, rule, at, dim0, dim1, scales0, scales1);
}

}  // namespace

namespace kernels {

cudaError_t adamw(float* p, const float* g, float* m, float* v, void* compute_bf16,
                  const AdamWScalars* s, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const bool aligned =
      packable<float>(4, {p, g, m, v}) && reinterpret_cast<uintptr_t>(compute_bf16) % 8 == 0;
  const int64_t packs = aligned ? n / 4 : 0;
  adamw_kernel<<<grid_for(std::max<int64_t>(packs, 1)), kBlock, 0, stream>>>(
      p, g, m, v, static_cast<__nv_bfloat16*>(compute_bf16), s, n, packs);
  return cudaGetLastError();
}

cudaError_t adamw_fp8_tiles(float* p, const float* g, float* m, float* v, const AdamWScalars* s,
                            int64_t batch, int64_t rows, int64_t cols, DType tiles_from,
                            Fp8ScaleRule rule, uint8_t* dim0, uint8_t* dim1, float* scales0,
                            float* scales1, cudaStream_t stream) {
  const int64_t tiles = batch * (rows / kFp8Block) * (cols / kFp8Block);
  if (tiles == 0) return cudaSuccess;
  adamw_fp8_tiles_kernel<<<static_cast<unsigned>(tiles), kTileThreads, 0, stream>>>(
      p, g, m, v, s, rows, cols, tiles_from == DType::kBF16, rule, dim0, dim1, scales0, scales1);
  return cudaGetLastError();
}

}  // namespace kernels
}  // namespace mt::cuda
