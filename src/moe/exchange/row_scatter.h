// Rows to peers into fixed places (the expert exchange's transport,
// moe/exchange/expert_exchange.h): every part's rows go where the slots say, and nothing is read on
// the host, so a CUDA graph can hold it. Where the communicator has a peer window (NCCL within one
// node: dist/peer_window.h), one kernel writes every part straight into the peers' windows
// (moe/exchange/lsa.h), quantizing an MXFP8 part as it sends it; elsewhere each peer's region is
// laid out whole and sent with all_to_all (capacity rows per peer, the empty places too), the
// reference the device path is tested against.
#pragma once
#include <cstdint>
#include <vector>

#include "core/quant.h"
#include "core/tensor.h"
#include "dist/communicator.h"

namespace mt::moe {

// One part of a row scatter: send (n, W) rows in the sender's order, any dtype (kMxfp8 and kFp8:
// f32, bf16 or f64, which is rounded to f32 first; W a multiple of 32, 128 for kFp8); recv
// (size * capacity, W) of send's dtype, allocated by the caller. An FP8 part (kFp8) arrives in
// recv_fp8 instead, (size * capacity, W) in 1 x 128 blocks along dim0: each row quantized once by
// its sender (ops::fp8_quantize with fp8_scale), its bytes and scales as they crossed.
//
// With sum_index (i32 (M, size)) the part arrives summed instead (an as-is part of float rows):
// recv (M, W) row m = residual[m] (when given) + the places sum_index[m, j] for j in order (-1:
// none), fp32 math, one rounding: ops::combine_forward over the places, which a device path
// does as it reads its receive buffer, writing no places.
struct ScatterPart {
  const Tensor* send = nullptr;
  Tensor* recv = nullptr;
  RowWire wire = RowWire::kAsIs;
  MxScaleRule rule = MxScaleRule::kRceil;
  const Tensor* sum_index = nullptr;
  const Tensor* residual = nullptr;
  QuantTensor* recv_fp8 = nullptr;
  Fp8ScaleRule fp8_scale = Fp8ScaleRule::kFp32;
};

// A scatter of several parts with one layout: slot i32 (n, size): row t of every part goes to
// peer p's recv at row rank * capacity + slot[t, p], or nowhere for -1. A peer's slots are
// distinct, below `capacity` and increase with t. Rows of recv no peer wrote are undefined.
// Beside the rows, optionally, one row per peer (the counts that say which places hold rows):
// row p of to_peers (size, C) arrives as row `rank` of peer p's from_peers (size, C).
struct RowScatter {
  const Tensor* slot = nullptr;
  int64_t capacity = 0;
  std::vector<ScatterPart> parts;
  const Tensor* to_peers = nullptr;
  Tensor* from_peers = nullptr;
};

// What a part puts in the device path's receive buffer per place (the layout of
// scatter_window): its row as it crosses.
struct ScatterRowShape {
  int64_t width = 0;      // W
  size_t elem_bytes = 0;  // of the rows' dtype
  RowWire wire = RowWire::kAsIs;
};
// The device path's receive buffer for a scatter of these parts over `ranks` ranks of `capacity`
// places, with per-peer rows of peer_row_bytes: the per-peer rows (ranks of them), then each
// part's places (an MXFP8 or FP8 part's E4M3 data, then its scales), every section 16-byte
// aligned.
struct ScatterWindow {
  size_t peer_rows = 0;              // offset of the per-peer rows (0)
  std::vector<size_t> data, scales;  // per part: offset of its rows (and MXFP8 scales)
  size_t bytes = 0;                  // the whole
};
ScatterWindow scatter_window(int ranks, int64_t capacity, const std::vector<ScatterRowShape>& parts,
                             size_t peer_row_bytes);

// Checks a scatter's tensors against each other over `ranks` ranks (an mt::Error names the
// first that does not fit).
void check_row_scatter(const RowScatter& s, int ranks);

// Which path a scatter takes: the device path where the communicator has one and the scatter fits
// it, else all_to_all; or all_to_all always (the reference, for tests).
enum class ScatterPath : uint8_t { kBest, kAllToAll };
void scatter_rows(dist::Communicator& c, const RowScatter& s,
                  ScatterPath path = ScatterPath::kBest);
// One part of rows as they are.
void scatter_rows(dist::Communicator& c, const Tensor& send, const Tensor& slot, int64_t capacity,
                  Tensor& recv);

#if MOETRAIN_HAS_NCCL
struct LsaPlan;
// The device path's plan for a checked scatter over `ranks` ranks (moe/exchange/lsa.h), or false
// when that path cannot take it: host tensors, more parts than its kernel holds, a window larger
// than window_limit, rows or pointers an MXFP8 or FP8 part cannot read 16 bytes at a time, a
// summed part of f64 rows.
bool make_lsa_plan(const RowScatter& s, int ranks, size_t window_limit, LsaPlan* plan);
#endif

}  // namespace mt::moe
