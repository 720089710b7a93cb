// The exchange layouts' front door (ops/exchange_layout.h): the arguments checked once, then the
// CPU reference (ops/cpu/exchange_layout.cpp) or the kernels (ops/cuda/exchange_layout.cu).
#include "ops/exchange_layout.h"

#include <algorithm>
#include <climits>

#include "ops/cpu/exchange_layout.h"
#include "ops/dispatch.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/exchange_layout.h"
#include "ops/cuda/operands.h"
#endif

namespace mt::ops {

void peer_choices(const Tensor& expert_index, int64_t peers, int64_t experts_per_peer,
                  Tensor& out) {
  expect_dtype(expert_index, DType::kI32, "expert_index");
  const int64_t n = expert_index.dim(0);
  MT_CHECK(peers >= 1 && experts_per_peer >= 1, "{} peers of {} experts", peers, experts_per_peer);
  expect_shape(out, {n, peers}, "peer choices");
  expect_dtype(out, DType::kI32, "peer choices");
#if MOETRAIN_HAS_CUDA
  if (on_gpu(expert_index)) {
    MT_CUDA_CHECK(cuda::kernels::peer_choices(
        expert_index.data<int32_t>(), n, static_cast<int>(expert_index.dim(1)),
        static_cast<int>(peers), static_cast<int>(experts_per_peer), out.data<int32_t>(),
        cuda::stream()));
    return;
  }
#endif
  cpu::peer_choices(expert_index, peers, experts_per_peer, out);
}

void peer_counts(const Tensor& expert_index, int64_t peers, int64_t experts_per_peer, Tensor& out) {
  expect_dtype(expert_index, DType::kI32, "expert_index");
  expect_shape(out, {peers, experts_per_peer + 1}, "peer counts");
  expect_dtype(out, DType::kI64, "peer counts");
#if MOETRAIN_HAS_CUDA
  if (on_gpu(expert_index)) {
    MT_CHECK(out.numel() <= 8192, "{} exchange counts: more than one block's shared histogram",
             out.numel());
    MT_CUDA_CHECK(cuda::kernels::peer_counts(
        expert_index.data<int32_t>(), expert_index.dim(0), static_cast<int>(expert_index.dim(1)),
        static_cast<int>(peers), static_cast<int>(experts_per_peer), out.data<int64_t>(),
        cuda::stream()));
    return;
  }
#endif
  cpu::peer_counts(expert_index, peers, experts_per_peer, out);
}

void local_choices(const Tensor& expert_index, int64_t rank, int64_t experts_per_peer, Tensor& out,
                   const Tensor* received_counts) {
  expect_dtype(expert_index, DType::kI32, "expert_index");
  expect_shape(out, expert_index.shape(), "local choices");
  expect_dtype(out, DType::kI32, "local choices");
  const int64_t rows = expert_index.dim(0);
  if (received_counts) {
    expect_dtype(*received_counts, DType::kI64, "received counts");
    const int64_t peers = received_counts->dim(0);
    MT_CHECK(received_counts->ndim() == 2 && received_counts->dim(1) == experts_per_peer + 1 &&
                 rows % peers == 0,
             "received counts {} for {} rows of {} experts per rank",
             shape_str(received_counts->shape()), rows, experts_per_peer);
  }
#if MOETRAIN_HAS_CUDA
  if (on_gpu(expert_index)) {
    const Tensor received = received_counts ? cuda::on_device(*received_counts) : Tensor();
    MT_CUDA_CHECK(cuda::kernels::local_choices(
        expert_index.data<int32_t>(), expert_index.numel(), static_cast<int>(expert_index.dim(1)),
        static_cast<int>(rank * experts_per_peer), static_cast<int>(experts_per_peer),
        received_counts ? received.data<int64_t>() : nullptr,
        received_counts ? rows / received.dim(0) : rows, out.data<int32_t>(), cuda::stream()));
    return;
  }
#endif
  cpu::local_choices(expert_index, rank, experts_per_peer, out, received_counts);
}

void peer_slots(const Tensor& to_peer, int64_t region_rows, Tensor& out) {
  expect_dtype(to_peer, DType::kI32, "peer choices");
  MT_CHECK(to_peer.ndim() == 2, "peer choices of shape {}, expected (tokens, peers)",
           shape_str(to_peer.shape()));
  expect_shape(out, to_peer.shape(), "peer slots");
  expect_dtype(out, DType::kI32, "peer slots");
  const int64_t n = to_peer.dim(0), peers = to_peer.dim(1);
  MT_CHECK(peers * std::max<int64_t>(region_rows, n) <= INT32_MAX,
           "peer slots of {} tokens over {} peers ({} rows a region) pass i32", n, peers,
           region_rows);
#if MOETRAIN_HAS_CUDA
  if (on_gpu(to_peer)) {
    MT_CHECK(out.device() == Device::kCUDA, "peer slots must be on the GPU");
    MT_CUDA_CHECK(cuda::kernels::peer_slots(to_peer.data<int32_t>(), n, static_cast<int>(peers),
                                            region_rows, out.data<int32_t>(), cuda::stream()));
    return;
  }
#endif
  cpu::peer_slots(to_peer, region_rows, out);
}

void region_slots(const Tensor& received_counts, int64_t capacity, Tensor& out) {
  expect_dtype(received_counts, DType::kI64, "received counts");
  const int64_t peers = received_counts.dim(0);
  expect_shape(out, {peers * capacity, peers}, "region slots");
  expect_dtype(out, DType::kI32, "region slots");
#if MOETRAIN_HAS_CUDA
  if (on_gpu(received_counts)) {
    const Tensor received = cuda::on_device(received_counts);
    MT_CUDA_CHECK(cuda::kernels::region_slots(received.data<int64_t>(), static_cast<int>(peers),
                                              static_cast<int>(received.dim(1)), capacity,
                                              out.data<int32_t>(), cuda::stream()));
    return;
  }
#endif
  cpu::region_slots(received_counts, capacity, out);
}

void place_rows(const Tensor& x, const Tensor& slot, int64_t capacity, Tensor& out) {
  const int64_t n = x.dim(0), width = x.dim(1);
  const int64_t peers = slot.ndim() == 2 ? slot.dim(1) : -1;
  expect_shape(slot, {n, peers}, "place_rows slots");
  expect_dtype(slot, DType::kI32, "place_rows slots");
  expect_shape(out, {peers * capacity, width}, "placed rows");
  MT_CHECK(x.dtype() == out.dtype(), "place_rows of {} rows into {}", dtype_name(x.dtype()),
           dtype_name(out.dtype()));
#if MOETRAIN_HAS_CUDA
  if (on_gpu(x)) {
    const Tensor s = cuda::on_device(slot);
    MT_CUDA_CHECK(cuda::kernels::place_rows(
        x.raw(), n, width * static_cast<int64_t>(dtype_size(x.dtype())), s.data<int32_t>(),
        static_cast<int>(peers), capacity, out.raw(), cuda::stream()));
    return;
  }
#endif
  cpu::place_rows(x, slot, capacity, out);
}

}  // namespace mt::ops
