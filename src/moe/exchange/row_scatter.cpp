#include "moe/exchange/row_scatter.h"

#include <vector>

#include "core/quant.h"
#include "ops/exchange_layout.h"
#include "ops/expert_gemm.h"
#include "ops/fp8.h"
#include "ops/mx.h"
#include "ops/permute.h"
#if MOETRAIN_HAS_NCCL
#include <cuda_runtime_api.h>

#include "core/cuda/check.h"
#include "dist/peer_window.h"
#include "moe/exchange/lsa.h"
#endif

namespace mt::moe {

namespace {

size_t align16(size_t bytes) {
  return (bytes + 15) / 16 * 16;
}

// Rows of `send` to their places in every peer's `recv`: each peer's region laid out here whole
// (ops::place_rows), then one all_to_all of `capacity` rows per peer, which lands region by region
// in rank order, as recv is laid out. Nothing is read on the host (the counts are fixed), so a
// CUDA graph can hold it; the places no row was put at cross too, undefined.
void move_rows(dist::Communicator& c, const Tensor& send, const Tensor& slot, int64_t capacity,
               Tensor& recv) {
  const int peers = c.size();
  Tensor regions = Tensor::empty({peers * capacity, send.dim(1)}, send.dtype(), send.device());
  ops::place_rows(send, slot, capacity, regions);
  const std::vector<int64_t> rows(peers, capacity);
  c.all_to_all(regions, rows, recv, rows);
}

}  // namespace

ScatterWindow scatter_window(int ranks, int64_t capacity, const std::vector<ScatterRowShape>& parts,
                             size_t peer_row_bytes) {
  const auto places = static_cast<size_t>(ranks) * static_cast<size_t>(capacity);
  ScatterWindow w;
  w.bytes = align16(static_cast<size_t>(ranks) * peer_row_bytes);
  for (const ScatterRowShape& part : parts) {
    const auto width = static_cast<size_t>(part.width);
    w.data.push_back(w.bytes);
    if (part.wire == RowWire::kMxfp8) {
      w.bytes += align16(places * width);
      w.scales.push_back(w.bytes);
      w.bytes += align16(places * (width / kMxBlock));
    } else if (part.wire == RowWire::kFp8) {
      w.bytes += align16(places * width);
      w.scales.push_back(w.bytes);
      w.bytes += align16(places * (width / kFp8Block) * sizeof(float));
    } else {
      w.bytes += align16(places * width * part.elem_bytes);
      w.scales.push_back(w.bytes);
    }
  }
  return w;
}

namespace {
// An FP8 part: float rows of a multiple of 128 into recv_fp8 (1 x 128 blocks along dim0), not
// summed.
void check_fp8_part(const ScatterPart& part, int64_t n, int64_t places, Device device) {
  MT_CHECK(part.send && part.recv_fp8 && part.recv_fp8->defined(),
           "scatter_rows: an FP8 part without its send tensor or its FP8 receive rows");
  const Tensor& send = *part.send;
  const QuantTensor& recv = *part.recv_fp8;
  const DType t = send.dtype();
  MT_CHECK(send.ndim() == 2 && send.dim(0) == n && send.dim(1) % kFp8Block == 0 &&
               (t == DType::kF32 || t == DType::kBF16 || t == DType::kF64) &&
               send.device() == device,
           "scatter_rows: an FP8 part of {} {} (needs {} f32, bf16 or f64 rows of a multiple of {} "
           "on the slots' device)",
           dtype_name(t), shape_str(send.shape()), n, kFp8Block);
  MT_CHECK(
      recv.block() == QuantBlock::kRow128 && recv.axis() == QuantAxis::kDim0 &&
          recv.shape() == Shape({places, send.dim(1)}) && recv.device() == device,
      "scatter_rows: an FP8 part's receive rows are {} in {} blocks along {} (need ({}, {}) in "
      "1x128 blocks along dim0)",
      shape_str(recv.shape()), quant_block_name(recv.block()), quant_axis_name(recv.axis()), places,
      send.dim(1));
  MT_CHECK(!part.sum_index, "scatter_rows: an FP8 part cannot be summed as it arrives");
}
}  // namespace

void check_row_scatter(const RowScatter& s, int peers) {
  MT_CHECK(s.slot, "scatter_rows without slots");
  const Tensor& slot = *s.slot;
  const int64_t n = slot.ndim() == 2 ? slot.dim(0) : -1;
  expect_shape(slot, {n, peers}, "scatter slots");
  expect_dtype(slot, DType::kI32, "scatter slots");
  for (const ScatterPart& part : s.parts) {
    if (part.wire == RowWire::kFp8) {
      check_fp8_part(part, n, peers * s.capacity, slot.device());
      continue;
    }
    MT_CHECK(part.send && part.recv, "scatter_rows: a part without its send or recv tensor");
    const Tensor& send = *part.send;
    const Tensor& recv = *part.recv;
    const int64_t recv_rows = part.sum_index
                                  ? (part.sum_index->ndim() == 2 ? part.sum_index->dim(0) : -1)
                                  : peers * s.capacity;
    MT_CHECK(send.ndim() == 2 && recv.ndim() == 2 && send.dtype() == recv.dtype() &&
                 send.dim(0) == n && recv.dim(0) == recv_rows && recv.dim(1) == send.dim(1) &&
                 send.device() == slot.device() && recv.device() == slot.device(),
             "scatter_rows of {} {} into {} {} ({} places per rank, {} ranks, {} rows per part)",
             dtype_name(send.dtype()), shape_str(send.shape()), dtype_name(recv.dtype()),
             shape_str(recv.shape()), s.capacity, peers, n);
    const DType t = send.dtype();
    const bool float_rows = t == DType::kF32 || t == DType::kBF16 || t == DType::kF64;
    if (part.sum_index) {
      expect_shape(*part.sum_index, {recv_rows, peers}, "scatter sum index");
      expect_dtype(*part.sum_index, DType::kI32, "scatter sum index");
      MT_CHECK(part.wire == RowWire::kAsIs && float_rows,
               "scatter_rows: a summed part of {} rows on the {} wire (needs f32, bf16 or f64 "
               "rows as they are)",
               dtype_name(t), ops::dispatch_dtype_name(part.wire));
      if (part.residual) {
        expect_shape(*part.residual, recv.shape(), "scatter sum residual");
        expect_dtype(*part.residual, recv.dtype(), "scatter sum residual");
      }
    }
    if (part.wire == RowWire::kMxfp8)
      MT_CHECK(float_rows && send.dim(1) % kMxBlock == 0,
               "scatter_rows: an MXFP8 part of {} {} (needs f32, bf16 or f64 rows of a multiple "
               "of {})",
               dtype_name(t), shape_str(send.shape()), kMxBlock);
  }
  MT_CHECK(!s.to_peers == !s.from_peers,
           "scatter_rows: per-peer rows need both to_peers and from_peers");
  if (s.to_peers) {
    const int64_t width = s.to_peers->ndim() == 2 ? s.to_peers->dim(1) : -1;
    expect_shape(*s.to_peers, {peers, width}, "per-peer rows sent");
    expect_shape(*s.from_peers, {peers, width}, "per-peer rows received");
    MT_CHECK(s.from_peers->dtype() == s.to_peers->dtype(), "per-peer rows of {} into {}",
             dtype_name(s.to_peers->dtype()), dtype_name(s.from_peers->dtype()));
  }
}

#if MOETRAIN_HAS_NCCL
namespace {
// The scatter through the communicator's peer window, when it has one and the scatter fits it.
bool device_path(dist::Communicator& c, const RowScatter& s) {
  const dist::PeerWindow* window = c.peer_window();
  LsaPlan plan;
  if (!window || !make_lsa_plan(s, c.size(), window->bytes(), &plan)) return false;
  MT_CUDA_CHECK(lsa_scatter(*window, plan, cuda::stream()));
  // A peer that never arrives at the kernel's barriers leaves it spinning: the watchdog sees it
  // unfinished and ends the rank (a replayed graph's kernels are handed over by the trainer).
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  MT_CUDA_CHECK(cudaStreamIsCapturing(cuda::stream(), &capturing));
  if (capturing == cudaStreamCaptureStatusNone) c.watch_queued("scatter_rows");
  return true;
}
}  // namespace

bool make_lsa_plan(const RowScatter& s, int ranks, size_t window_limit, LsaPlan* plan) {
  if (s.parts.size() > static_cast<size_t>(kLsaMaxParts) || s.slot->device() != Device::kCUDA)
    return false;
  std::vector<ScatterRowShape> shapes;
  for (const ScatterPart& part : s.parts) {
    if (part.send->device() != Device::kCUDA) return false;
    shapes.push_back({part.send->dim(1), dtype_size(part.send->dtype()), part.wire});
  }
  const size_t peer_row_bytes = s.to_peers ? s.to_peers->nbytes() / ranks : 0;
  if (s.to_peers && (s.to_peers->device() != Device::kCUDA || peer_row_bytes % 4 != 0))
    return false;
  const ScatterWindow window = scatter_window(ranks, s.capacity, shapes, peer_row_bytes);
  if (window.bytes > window_limit) return false;
  *plan = LsaPlan{};
  plan->n_parts = static_cast<int>(s.parts.size());
  plan->n = s.slot->dim(0);
  plan->slot = s.slot->data<int32_t>();
  plan->capacity = s.capacity;
  plan->to_peers = s.to_peers ? s.to_peers->raw() : nullptr;
  plan->from_peers = s.from_peers ? s.from_peers->raw() : nullptr;
  plan->peer_row_bytes = static_cast<int64_t>(peer_row_bytes);
  plan->peer_offset = window.peer_rows;
  plan->window_bytes = window.bytes;
  for (size_t i = 0; i < s.parts.size(); ++i) {
    const ScatterPart& part = s.parts[i];
    LsaPart& out = plan->parts[i];
    out.send = part.send->numel() ? part.send->raw() : nullptr;
    if (part.wire == RowWire::kFp8) {
      Tensor& data = part.recv_fp8->data();
      out.recv = data.numel() ? data.raw() : nullptr;
      out.recv_scales = data.numel() ? part.recv_fp8->scales().raw() : nullptr;
    } else {
      out.recv = part.recv->numel() ? part.recv->raw() : nullptr;
    }
    out.width = part.send->dim(1);
    out.elem_bytes = static_cast<int64_t>(dtype_size(part.send->dtype()));
    out.rule = part.rule;
    out.fp8_scale = part.fp8_scale;
    out.data_offset = window.data[i];
    out.scales_offset = window.scales[i];
    const DType dt = part.send->dtype();
    const bool kernel_rows = dt == DType::kBF16 || dt == DType::kF32;  // what the kernels decode
    if (part.sum_index) {
      if (!kernel_rows) return false;
      out.sum = dt == DType::kBF16 ? LsaSum::kBf16 : LsaSum::kF32;
      out.sum_index = part.sum_index->data<int32_t>();
      out.residual = part.residual ? part.residual->raw() : nullptr;
      out.sum_rows = part.recv->dim(0);
    }
    const auto aligned = [&](size_t a) {
      return reinterpret_cast<uintptr_t>(out.send) % a == 0 &&
             reinterpret_cast<uintptr_t>(out.recv) % a == 0 &&
             reinterpret_cast<uintptr_t>(out.residual) % a == 0 &&
             static_cast<size_t>(out.width * out.elem_bytes) % a == 0;
    };
    if (part.wire != RowWire::kAsIs) {  // quantized by the send kernel from bf16 or f32 packs
      if (!aligned(16) || !kernel_rows) return false;
      const bool bf16 = dt == DType::kBF16;
      out.codec = part.wire == RowWire::kMxfp8 ? (bf16 ? LsaCodec::kMxfp8Bf16 : LsaCodec::kMxfp8F32)
                                               : (bf16 ? LsaCodec::kFp8Bf16 : LsaCodec::kFp8F32);
    } else {
      out.codec = aligned(16)  ? LsaCodec::kCopy16
                  : aligned(4) ? LsaCodec::kCopy4
                               : LsaCodec::kCopy1;
    }
  }
  return true;
}
#endif

void scatter_rows(dist::Communicator& c, const Tensor& send, const Tensor& slot, int64_t capacity,
                  Tensor& recv) {
  RowScatter s;
  s.slot = &slot;
  s.capacity = capacity;
  s.parts.push_back({&send, &recv});
  scatter_rows(c, s);
}

void scatter_rows(dist::Communicator& c, const RowScatter& s, ScatterPath path) {
  const int peers = c.size();
  check_row_scatter(s, peers);
#if MOETRAIN_HAS_NCCL
  if (path == ScatterPath::kBest && device_path(c, s)) return;
#else
  (void)path;
#endif
  // Each part's regions in one fixed-size all_to_all (an MXFP8 part quantized before and
  // dequantized after it, an FP8 part quantized before it), the per-peer rows in another: the path
  // for backends without a device path (CPU ranks, NCCL across nodes), and the reference the device
  // path is tested against.
  if (s.to_peers) {
    const std::vector<int64_t> one(peers, 1);
    c.all_to_all(*s.to_peers, one, *s.from_peers, one);
  }
  for (const ScatterPart& part : s.parts) {
    if (part.sum_index) {
      Tensor places = Tensor::empty({peers * s.capacity, part.send->dim(1)}, part.send->dtype(),
                                    part.send->device());
      move_rows(c, *part.send, *s.slot, s.capacity, places);
      ops::ExpertPermutation back;
      back.row_of_choice = part.sum_index->reshape({part.sum_index->numel()});
      ops::combine_forward(places, back, *part.recv, part.residual);
      continue;
    }
    if (part.wire == RowWire::kAsIs) {
      move_rows(c, *part.send, *s.slot, s.capacity, *part.recv);
      continue;
    }
    if (part.wire == RowWire::kFp8) {  // quantized once, its bytes and scales moved as they are
      QuantTensor out = QuantTensor::empty(part.send->shape(), QuantBlock::kRow128,
                                           QuantAxis::kDim0, part.send->device());
      ops::fp8_quantize(*part.send, part.fp8_scale, out);
      move_rows(c, out.data(), *s.slot, s.capacity, part.recv_fp8->data());
      move_rows(c, out.scales(), *s.slot, s.capacity, part.recv_fp8->scales());
      continue;
    }
    QuantTensor out = QuantTensor::empty(part.send->shape(), QuantBlock::kMx32, QuantAxis::kDim0,
                                         part.send->device());
    ops::mx_quantize(*part.send, part.rule, out);
    QuantTensor in = QuantTensor::empty(part.recv->shape(), QuantBlock::kMx32, QuantAxis::kDim0,
                                        part.recv->device());
    move_rows(c, out.data(), *s.slot, s.capacity, in.data());
    move_rows(c, out.scales(), *s.slot, s.capacity, in.scales());
    ops::mx_dequantize(in, *part.recv);
  }
}

}  // namespace mt::moe
