#include "dist/peer_window.cuh"
#include "moe/exchange/lsa.h"
#include "ops/cuda/fp8.cuh"
#include "ops/cuda/mx.cuh"

namespace mt::moe {

namespace {

using cuda::BlockScale;

constexpr int kThreads = 512;
constexpr int kMaxEmulatedRanks = 8;
// An MXFP8 part: each lane quantizes 16 consecutive elements (two lanes per 32-element block),
// so a warp covers 512 elements of a row per step and stores 16 bytes of E4M3 per lane and 16
// scale bytes from 16 lanes.
constexpr int kLaneElems = 16;
constexpr int kStepElems = 32 * kLaneElems;

// Where a peer's window lies: NCCL's LSA pointers, or plain pointers on this GPU (emulated).
struct LsaPeers {
  ncclDevComm comm;
  ncclWindow_t window;
  __device__ int rank() const { return comm.rank; }
  __device__ int ranks() const { return comm.nRanks; }
  __device__ char* at(int peer, size_t offset) const {
    return static_cast<char*>(ncclGetLsaPointer(window, offset, peer));
  }
};

struct LocalPeers {
  char* windows[kMaxEmulatedRanks];
  int self, count;
  __device__ int rank() const { return self; }
  __device__ int ranks() const { return count; }
  __device__ char* at(int peer, size_t offset) const { return windows[peer] + offset; }
};

template <class U, class Peers>
__device__ void send_copy(const Peers& peers, const LsaPart& part, int64_t t, const int32_t* slot,
                          int64_t capacity, int lane) {
  const int64_t row_bytes = part.width * part.elem_bytes;
  const int64_t units = row_bytes / static_cast<int64_t>(sizeof(U));
  const U* src = reinterpret_cast<const U*>(static_cast<const char*>(part.send) + t * row_bytes);
  for (int p = 0; p < peers.ranks(); ++p) {
    const int32_t s = slot[p];
    if (s < 0) continue;
    const size_t place = static_cast<size_t>(peers.rank()) * capacity + s;
    U* dst = reinterpret_cast<U*>(peers.at(p, part.data_offset + place * row_bytes));
    for (int64_t c = lane; c < units; c += 32) dst[c] = src[c];
  }
}

// The 16 / sizeof(T) elements of one 16-byte pack of T as floats.
template <class T>
__device__ __forceinline__ void load_pack(const T* src, float* v) {
  constexpr int kPer = 16 / sizeof(T);
  const uint4 raw = *reinterpret_cast<const uint4*>(src);
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < kPer; ++i) v[i] = cuda::to_float(e[i]);
}

template <class T>
__device__ __forceinline__ void load_lane(const T* src, float (&v)[kLaneElems]) {
  constexpr int kPer = 16 / sizeof(T);
#pragma unroll
  for (int b = 0; b < kLaneElems / kPer; ++b) load_pack(src + b * kPer, v + b * kPer);
}

// Row t quantized along the row (the rule of ops::mx_quantize, bit for bit) and stored to each
// peer it goes to: E4M3 at the place's data, the block scales at its scale row.
template <class T, class Peers>
__device__ void send_mx(const Peers& peers, const LsaPart& part, int64_t t, const int32_t* slot,
                        int64_t capacity, int lane) {
  const int64_t width = part.width;
  const T* src = static_cast<const T*>(part.send) + t * width;
  for (int64_t base = 0; base < width; base += kStepElems) {
    const int64_t e0 = base + int64_t{lane} * kLaneElems;
    const bool active = e0 < width;  // the width is a multiple of 32: a block is wholly in or out
    float v[kLaneElems];
    uint32_t m = 0;
    if (active) {
      load_lane(src + e0, v);
#pragma unroll
      for (int i = 0; i < kLaneElems; ++i) m = max(m, cuda::magnitude_bits(v[i]));
    }
    m = max(m, __shfl_xor_sync(0xffffffffu, m, 1));
    const BlockScale bs = cuda::block_scale(part.rule, m);
    uint4 q{};
    if (active) {
      alignas(16) uint16_t pairs[kLaneElems / 2];
#pragma unroll
      for (int i = 0; i < kLaneElems / 2; ++i)
        pairs[i] = cuda::e4m3x2(v[2 * i], v[2 * i + 1], bs.factor);
      q = *reinterpret_cast<const uint4*>(pairs);
    }
    // Lane j < 16 holds the scale of the step's block j (lanes 2j and 2j + 1 computed it).
    const auto scale = static_cast<uint8_t>(
        __shfl_sync(0xffffffffu, static_cast<uint32_t>(bs.s), (2 * lane) % 32));
    const int64_t blocks = (width - base < kStepElems ? width - base : kStepElems) / kMxBlock;
    for (int p = 0; p < peers.ranks(); ++p) {
      const int32_t s = slot[p];
      if (s < 0) continue;
      const size_t place = static_cast<size_t>(peers.rank()) * capacity + s;
      if (active) *reinterpret_cast<uint4*>(peers.at(p, part.data_offset + place * width + e0)) = q;
      if (lane < blocks)
        *reinterpret_cast<uint8_t*>(peers.at(
            p, part.scales_offset + place * (width / kMxBlock) + base / kMxBlock + lane)) = scale;
    }
  }
}

// Row t quantized in 1 x 128 blocks along the row (the rule of ops::fp8_quantize, bit for bit)
// and stored to each peer it goes to: E4M3 at the place's data, the f32 block scales at its scale
// row. A lane holds one 16-byte pack (P elements), so a block is 128 / P lanes.
template <class T, class Peers>
__device__ void send_fp8(const Peers& peers, const LsaPart& part, int64_t t, const int32_t* slot,
                         int64_t capacity, int lane) {
  constexpr int P = 16 / static_cast<int>(sizeof(T));
  constexpr int64_t kStep = 32 * P;
  const int64_t width = part.width, blocks = width / kFp8Block;
  const T* src = static_cast<const T*>(part.send) + t * width;
  for (int64_t base = 0; base < width; base += kStep) {
    const int64_t e0 = base + int64_t{lane} * P;
    const bool active = e0 < width;  // the width is a multiple of 128: a block is wholly in or out
    float v[P] = {};
    if (active) load_pack(src + e0, v);
    const cuda::Fp8Lane<P> q = cuda::fp8_lane<P>(v, active, part.fp8_scale);
    if (!active) continue;
    const bool first = lane % (kFp8Block / P) == 0;
    for (int p = 0; p < peers.ranks(); ++p) {
      const int32_t s = slot[p];
      if (s < 0) continue;
      const size_t place = static_cast<size_t>(peers.rank()) * capacity + s;
      cuda::store_fp8_bytes<P>(q, peers.at(p, part.data_offset + place * width + e0));
      if (first)
        *reinterpret_cast<float*>(peers.at(
            p, part.scales_offset + (place * blocks + e0 / kFp8Block) * sizeof(float))) = q.s.scale;
    }
  }
}

// Everything the send kernel does between its barriers: block 0 stores the per-peer rows; each
// warp moves whole tokens (t = w, w + warps, ... for warp w of the grid), every part of a token
// before the next.
template <class Peers>
__device__ void send_body(const Peers& peers, const LsaPlan& plan) {
  const int ranks = peers.ranks();
  if (blockIdx.x == 0 && plan.peer_row_bytes > 0) {
    const int64_t units = plan.peer_row_bytes / 4;
    for (int p = 0; p < ranks; ++p) {
      auto* dst = reinterpret_cast<uint32_t*>(
          peers.at(p, plan.peer_offset + static_cast<size_t>(peers.rank()) * plan.peer_row_bytes));
      const auto* src = reinterpret_cast<const uint32_t*>(static_cast<const char*>(plan.to_peers) +
                                                          p * plan.peer_row_bytes);
      for (int64_t i = threadIdx.x; i < units; i += blockDim.x) dst[i] = src[i];
    }
  }
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t{gridDim.x} * (blockDim.x / 32);
  for (int64_t t = blockIdx.x * int64_t{blockDim.x / 32} + threadIdx.x / 32; t < plan.n;
       t += warps) {
    const int32_t* slot = plan.slot + t * ranks;
#pragma unroll
    for (int i = 0; i < kLsaMaxParts; ++i) {
      if (i >= plan.n_parts) break;
      const LsaPart& part = plan.parts[i];
      switch (part.codec) {
        case LsaCodec::kCopy16:
          send_copy<uint4>(peers, part, t, slot, plan.capacity, lane);
          break;
        case LsaCodec::kCopy4:
          send_copy<uint32_t>(peers, part, t, slot, plan.capacity, lane);
          break;
        case LsaCodec::kCopy1:
          send_copy<uint8_t>(peers, part, t, slot, plan.capacity, lane);
          break;
        case LsaCodec::kMxfp8Bf16:
          send_mx<__nv_bfloat16>(peers, part, t, slot, plan.capacity, lane);
          break;
        case LsaCodec::kMxfp8F32:
          send_mx<float>(peers, part, t, slot, plan.capacity, lane);
          break;
        case LsaCodec::kFp8Bf16:
          send_fp8<__nv_bfloat16>(peers, part, t, slot, plan.capacity, lane);
          break;
        case LsaCodec::kFp8F32:
          send_fp8<float>(peers, part, t, slot, plan.capacity, lane);
          break;
      }
    }
  }
}

__global__ void __launch_bounds__(kThreads) lsa_send_kernel(LsaPeers peers, LsaPlan plan) {
  ncclLsaBarrierSession<ncclCoopCta> barrier{ncclCoopCta(), peers.comm, ncclTeamLsa(peers.comm),
                                             peers.comm.lsaBarrier, blockIdx.x};
  barrier.sync(ncclCoopCta(), ::cuda::memory_order_acq_rel);  // every peer is done with its buffer
  send_body(peers, plan);
  barrier.sync(ncclCoopCta(), ::cuda::memory_order_acq_rel);  // every row has landed
}

__global__ void __launch_bounds__(kThreads) local_send_kernel(LocalPeers peers, LsaPlan plan) {
  send_body(peers, plan);
}

template <class U>
__device__ void receive_copy(const char* from, void* to, int64_t bytes, int64_t at, int64_t step) {
  const int64_t units = bytes / static_cast<int64_t>(sizeof(U));
  const U* src = reinterpret_cast<const U*>(from);
  U* dst = static_cast<U*>(to);
  for (int64_t i = at; i < units; i += step) dst[i] = src[i];
}

// An MXFP8 part's places decoded into its rows' dtype: from_e4m3(q) * 2^(s - 127), exact in f32,
// rounded once (ops::mx_dequantize). A thread decodes 16 elements (one 16-byte load of data).
template <class T>
__device__ void receive_mx(const char* window, const LsaPart& part, int64_t places, int64_t at,
                           int64_t step) {
  const int64_t groups = places * part.width / kLaneElems;
  const char* data = window + part.data_offset;
  const auto* scales = reinterpret_cast<const uint8_t*>(window + part.scales_offset);
  T* out = static_cast<T*>(part.recv);
  for (int64_t g = at; g < groups; g += step) {
    const uint4 raw = reinterpret_cast<const uint4*>(data)[g];
    const float scale = cuda::e8m0_value(scales[g / (kMxBlock / kLaneElems)]);
    const auto* q = reinterpret_cast<const __nv_fp8x2_storage_t*>(&raw);
    float v[kLaneElems];
#pragma unroll
    for (int i = 0; i < kLaneElems / 2; ++i) {
      const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(q[i], __NV_E4M3);
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
      v[2 * i] = __fmul_rn(f.x, scale);
      v[2 * i + 1] = __fmul_rn(f.y, scale);
    }
    cuda::store_run<T, kLaneElems>(out + g * kLaneElems, v);
  }
}

// A summed part (LsaSum): recv row m = residual[m] + its places in j order, P elements a step
// (a 16-byte pack, or 1), fp32 math, one rounding: what ops::combine_forward gives.
template <class T, int P>
__device__ void receive_sum(const char* window, const LsaPart& part, int ranks, int64_t at,
                            int64_t step) {
  const int64_t per_row = part.width / P;
  const T* places = reinterpret_cast<const T*>(window + part.data_offset);
  const T* residual = static_cast<const T*>(part.residual);
  T* out = static_cast<T*>(part.recv);
  for (int64_t u = at; u < part.sum_rows * per_row; u += step) {
    const int64_t m = u / per_row, c = (u % per_row) * P;
    float acc[P] = {};
    if (residual) cuda::load_n<T, P>(residual + m * part.width + c, acc);
    for (int j = 0; j < ranks; ++j) {
      const int32_t place = part.sum_index[m * ranks + j];
      if (place < 0) continue;
      float x[P];
      cuda::load_n<T, P>(places + static_cast<int64_t>(place) * part.width + c, x);
#pragma unroll
      for (int i = 0; i < P; ++i) acc[i] += x[i];
    }
    cuda::store_n<T, P>(out + m * part.width + c, acc);
  }
}

template <class T>
__device__ void receive_sum(const char* window, const LsaPart& part, int ranks, int64_t at,
                            int64_t step) {
  if (part.codec == LsaCodec::kCopy16)
    receive_sum<T, 16 / sizeof(T)>(window, part, ranks, at, step);
  else
    receive_sum<T, 1>(window, part, ranks, at, step);
}

// This rank's window into the callers' tensors: the per-peer rows, then each part (whole
// sections: places no peer wrote carry whatever the window held, as the contract allows; a
// summed part reads only the places its index names).
__global__ void __launch_bounds__(256) receive_kernel(const char* window, LsaPlan plan, int ranks) {
  const int64_t at = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const int64_t step = int64_t{gridDim.x} * blockDim.x;
  if (plan.peer_row_bytes > 0)
    receive_copy<uint32_t>(window + plan.peer_offset, plan.from_peers, ranks * plan.peer_row_bytes,
                           at, step);
  const int64_t places = ranks * plan.capacity;
  for (int i = 0; i < plan.n_parts; ++i) {
    const LsaPart& part = plan.parts[i];
    if (part.sum != LsaSum::kNone) {
      if (part.sum == LsaSum::kBf16)
        receive_sum<__nv_bfloat16>(window, part, ranks, at, step);
      else
        receive_sum<float>(window, part, ranks, at, step);
      continue;
    }
    const char* from = window + part.data_offset;
    const int64_t bytes = places * part.width * part.elem_bytes;
    switch (part.codec) {
      case LsaCodec::kCopy16:
        receive_copy<uint4>(from, part.recv, bytes, at, step);
        break;
      case LsaCodec::kCopy4:
        receive_copy<uint32_t>(from, part.recv, bytes, at, step);
        break;
      case LsaCodec::kCopy1:
        receive_copy<uint8_t>(from, part.recv, bytes, at, step);
        break;
      case LsaCodec::kMxfp8Bf16:
        receive_mx<__nv_bfloat16>(window, part, places, at, step);
        break;
      case LsaCodec::kMxfp8F32:
        receive_mx<float>(window, part, places, at, step);
        break;
      case LsaCodec::kFp8Bf16:
      case LsaCodec::kFp8F32:  // the E4M3 bytes (16-byte aligned sections), then the scales
        receive_copy<uint4>(from, part.recv, places * part.width, at, step);
        receive_copy<uint32_t>(window + part.scales_offset, part.recv_scales,
                               places * (part.width / kFp8Block) * sizeof(float), at, step);
        break;
    }
  }
}

cudaError_t launch_receive(const char* window, const LsaPlan& plan, int ranks,
                           cudaStream_t stream) {
  int64_t units = ranks * plan.peer_row_bytes / 4;
  for (int i = 0; i < plan.n_parts; ++i) {
    const LsaPart& part = plan.parts[i];
    const int64_t rows = part.sum == LsaSum::kNone ? ranks * plan.capacity : part.sum_rows;
    units = std::max<int64_t>(units, rows * part.width / kLaneElems);
  }
  if (units == 0) return cudaSuccess;
  const auto blocks = static_cast<unsigned>(std::min<int64_t>((units + 255) / 256, 132 * 8));
  receive_kernel<<<blocks, 256, 0, stream>>>(window, plan, ranks);
  return cudaGetLastError();
}

}  // namespace

cudaError_t lsa_scatter(const dist::PeerWindow& window, const LsaPlan& plan, cudaStream_t stream) {
  const dist::PeerWindow::State& st = window.state();
  if (plan.window_bytes > st.bytes || plan.n_parts > kLsaMaxParts) return cudaErrorInvalidValue;
  // Every rank launches, even with no rows: the barriers need all of them.
  lsa_send_kernel<<<st.ctas, kThreads, 0, stream>>>(LsaPeers{st.dev, st.window}, plan);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  return launch_receive(static_cast<const char*>(st.buffer), plan, st.dev.nRanks, stream);
}

cudaError_t emulated_scatter(const LsaPlan* plans, int ranks, void* const* windows, int ctas,
                             cudaStream_t stream) {
  if (ranks < 1 || ranks > kMaxEmulatedRanks) return cudaErrorInvalidValue;
  LocalPeers peers{};
  for (int r = 0; r < ranks; ++r) peers.windows[r] = static_cast<char*>(windows[r]);
  peers.count = ranks;
  for (int r = 0; r < ranks; ++r) {
    if (plans[r].n_parts > kLsaMaxParts) return cudaErrorInvalidValue;
    peers.self = r;
    local_send_kernel<<<ctas, kThreads, 0, stream>>>(peers, plans[r]);
    if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  }
  for (int r = 0; r < ranks; ++r)
    if (cudaError_t err =
            launch_receive(static_cast<const char*>(windows[r]), plans[r], ranks, stream);
        err != cudaSuccess)
      return err;
  return cudaSuccess;
}

}  // namespace mt::moe
