// The expert exchange's device path: rows written straight into the peers' memory over NVLink
// through a dist::PeerWindow (NCCL's symmetric memory and a device communicator with one LSA
// barrier per CTA). One send kernel passes a barrier (every peer is done
// with its buffer), stores every part of each row at its place in the peer's window through the
// peer's LSA pointer (an MXFP8 part quantized on the way: E4M3 data and E8M0 scales, two lanes
// per 32-element block; an FP8 part: E4M3 data and f32 scales, 16 or 32 lanes per 128-element
// block) together with the per-peer rows, and passes a second barrier (every row has landed); one
// receive kernel then moves this rank's window into the callers' tensors (an MXFP8 part
// dequantized on the way, an FP8 part's bytes and scales as they are, a summed part added up into
// its rows: combine's reduction as it reads the window). Nothing waits on the host, so a CUDA graph
// can hold it. Needs every rank in one LSA team (one node, P2P) and the NCCL release it was built
// against at run time (the device API has no ABI guarantee across releases).
//
// The same two kernels run over ranks emulated on one GPU (emulated_scatter: the peers' windows
// as plain pointers, the barriers replaced by the order of the launches), which is how one GPU
// tests everything but the barriers and the LSA pointers.
#pragma once
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>

#include "core/quant_format.h"
#include "dist/peer_window.h"

namespace mt::moe {

inline constexpr int kLsaMaxParts = 6;

// How a part crosses: its bytes in units of 16, 4 or 1 bytes (the widest its rows and pointers
// allow), MXFP8 quantized from bf16 or f32 rows (and dequantized into them on arrival), or FP8
// blockwise quantized from bf16 or f32 rows (arriving as E4M3 data and f32 scales).
enum class LsaCodec : uint8_t { kCopy16, kCopy4, kCopy1, kMxfp8Bf16, kMxfp8F32, kFp8Bf16, kFp8F32 };

// How a part arrives: its places copied (or decoded) into recv, or, for a kCopy part of bf16 or
// f32 rows, summed into recv's rows (ScatterPart::sum_index, row_scatter.h): row m = residual[m]
// (none: 0) + the places sum_index[m * ranks + j] for j < ranks in that order (-1: none), fp32
// math, one rounding. kCopy16 sums 16-byte packs (recv, residual and the rows 16-byte aligned), the
// other copy codecs an element at a time.
enum class LsaSum : uint8_t { kNone, kBf16, kF32 };

struct LsaPart {
  const void* send = nullptr;   // n rows of width elements of elem_bytes
  void* recv = nullptr;         // ranks * capacity rows of the same (sums: sum_rows rows)
  void* recv_scales = nullptr;  // FP8: ranks * capacity rows of width / 128 f32 scales
  int64_t width = 0;
  int64_t elem_bytes = 0;
  LsaCodec codec = LsaCodec::kCopy1;
  MxScaleRule rule = MxScaleRule::kRceil;
  Fp8ScaleRule fp8_scale = Fp8ScaleRule::kFp32;
  size_t data_offset = 0, scales_offset = 0;  // in the window (scatter_window)
  LsaSum sum = LsaSum::kNone;
  const int32_t* sum_index = nullptr;  // (sum_rows, ranks) places
  const void* residual = nullptr;      // (sum_rows, width) or null
  int64_t sum_rows = 0;
};

// One scatter: slot i32 (n, ranks) on the device: row t of every part goes to peer p's window at
// place (rank * capacity + slot[t, p]) (-1: not to p); row p of to_peers (peer_row_bytes, a
// multiple of 4) to peer p's per-peer rows at row `rank`, which arrive in from_peers.
struct LsaPlan {
  LsaPart parts[kLsaMaxParts];
  int n_parts = 0;
  int64_t n = 0;
  const int32_t* slot = nullptr;
  int64_t capacity = 0;
  const void* to_peers = nullptr;
  void* from_peers = nullptr;
  int64_t peer_row_bytes = 0;
  size_t peer_offset = 0;
  size_t window_bytes = 0;  // what the layout needs
};

// The send kernel, then the receive kernel, on `stream`, through `window`'s LSA pointers and
// barriers (cudaErrorInvalidValue when the plan needs more than the window).
cudaError_t lsa_scatter(const dist::PeerWindow& window, const LsaPlan& plan, cudaStream_t stream);

// The same kernels over `ranks` (at most 8) ranks emulated on this GPU: plans[r] is rank r's
// plan, windows[r] its receive buffer (plans[r].window_bytes of device memory). Every rank's send
// kernel runs, then every rank's receive kernel, on `stream`, with `ctas` blocks.
cudaError_t emulated_scatter(const LsaPlan* plans, int ranks, void* const* windows, int ctas,
                             cudaStream_t stream);

}  // namespace mt::moe
