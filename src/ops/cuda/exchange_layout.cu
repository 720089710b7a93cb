// The expert-parallel exchange's layouts (ops/exchange_layout.h): peer choices and counts, slots,
// regions, placed rows. Deterministic: counts are integer atomics, slots prefix scans.
#include <cub/block/block_scan.cuh>

#include "ops/cuda/exchange_layout.h"

#include "ops/cuda/common.cuh"

namespace mt::cuda {

namespace {

// One thread per token: entry p of its row is p when a choice lies in [p*L, (p+1)*L), else -1.
__global__ void peer_choices_kernel(const int32_t* index, int64_t n, int k, int peers, int per_peer,
                                    int32_t* out) {
  const int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (t >= n) return;
  for (int p = 0; p < peers; ++p) out[t * peers + p] = -1;
  for (int j = 0; j < k; ++j) {
    const int p = index[t * k + j] / per_peer;
    out[t * peers + p] = p;
  }
}

// counts (peers, L + 1): per peer, its experts' choices, then the tokens with a choice there.
// A shared histogram per block, flushed with one atomic per bin.
__global__ void peer_counts_kernel(const int32_t* index, int64_t n, int k, int peers, int per_peer,
                                   int64_t* counts) {
  extern __shared__ int hist[];
  const int bins = peers * (per_peer + 1);
  zero_block_histogram(hist, bins);
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < n;
       t += int64_t{gridDim.x} * blockDim.x) {
    const int32_t* row = index + t * k;
    for (int j = 0; j < k; ++j) {
      const int p = row[j] / per_peer;
      atomicAdd(&hist[p * (per_peer + 1) + row[j] - p * per_peer], 1);
      bool first = true;  // the token's first choice on rank p counts the token
      for (int i = 0; i < j; ++i) first &= row[i] / per_peer != p;
      if (first) atomicAdd(&hist[p * (per_peer + 1) + per_peer], 1);
    }
  }
  flush_block_histogram(hist, bins, counts);
}

__global__ void local_choices_kernel(const int32_t* index, int64_t n, int k, int first,
                                     int per_peer, const int64_t* received, int64_t region,
                                     int32_t* out) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i >= n) return;
  const int64_t r = i / k;
  const bool written = !received || r % region < received[(r / region) * (per_peer + 1) + per_peer];
  const int local = index[i] - first;
  out[i] = written && local >= 0 && local < per_peer ? local : -1;
}

// One block per peer: the tokens in tiles of kSlotThreads x kSlotItems (each thread a run of
// kSlotItems consecutive tokens), a block-wide exclusive scan of the tokens for the peer within
// the tile, plus the tiles before it.
constexpr int kSlotThreads = 512;
constexpr int kSlotItems = 8;

__global__ void __launch_bounds__(kSlotThreads)
    peer_slots_kernel(const int32_t* to_peer, int64_t n, int peers, int64_t region_rows,
                      int32_t* out) {
  using Scan = cub::BlockScan<int, kSlotThreads>;
  __shared__ typename Scan::TempStorage scratch;
  const int p = blockIdx.x;
  int64_t before = p * region_rows;  // the places taken by the tiles before this one
  for (int64_t tile = 0; tile < n; tile += int64_t{kSlotThreads} * kSlotItems) {
    const int64_t first = tile + int64_t{threadIdx.x} * kSlotItems;
    int goes[kSlotItems], place[kSlotItems];
#pragma unroll
    for (int i = 0; i < kSlotItems; ++i)
      goes[i] = first + i < n && to_peer[(first + i) * peers + p] >= 0 ? 1 : 0;
    int in_tile = 0;
    Scan(scratch).ExclusiveSum(goes, place, in_tile);
#pragma unroll
    for (int i = 0; i < kSlotItems; ++i)
      if (first + i < n)
        out[(first + i) * peers + p] = goes[i] ? static_cast<int32_t>(before + place[i]) : -1;
    before += in_tile;
    __syncthreads();  // the scratch is reused by the next tile
  }
}

// A warp per row of x: each of its places, the row's units striding over the lanes.
template <class U>
__global__ void place_rows_kernel(const U* x, int64_t n, int64_t units, const int32_t* slot,
                                  int peers, int64_t capacity, U* out) {
  const int64_t warps = int64_t{gridDim.x} * (blockDim.x / 32);
  const int lane = threadIdx.x % 32;
  for (int64_t t = blockIdx.x * int64_t{blockDim.x / 32} + threadIdx.x / 32; t < n; t += warps)
    for (int p = 0; p < peers; ++p) {
      const int32_t s = slot[t * peers + p];
      if (s < 0 || s >= capacity) continue;
      U* dst = out + (p * capacity + s) * units;
      for (int64_t c = lane; c < units; c += 32) dst[c] = x[t * units + c];
    }
}

__global__ void region_slots_kernel(const int64_t* received, int peers, int width, int64_t capacity,
                                    int32_t* out) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i >= peers * capacity * peers) return;
  const int64_t j = i / peers;
  const int q = static_cast<int>(i % peers), p = static_cast<int>(j / capacity);
  const int64_t s = j % capacity;
  out[i] = q == p && s < received[p * width + width - 1] ? static_cast<int32_t>(s) : -1;
}

}  // namespace

namespace kernels {

cudaError_t peer_choices(const int32_t* index, int64_t n, int k, int peers, int per_peer,
                         int32_t* out, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  peer_choices_kernel<<<grid_for(n), kBlock, 0, stream>>>(index, n, k, peers, per_peer, out);
  return cudaGetLastError();
}

cudaError_t peer_counts(const int32_t* index, int64_t n, int k, int peers, int per_peer,
                        int64_t* counts, cudaStream_t stream) {
  const int bins = peers * (per_peer + 1);
  if (cudaError_t err = cudaMemsetAsync(counts, 0, sizeof(int64_t) * bins, stream);
      err != cudaSuccess)
    return err;
  if (n == 0) return cudaSuccess;
  const int grid = static_cast<int>(std::min<int64_t>((n + 255) / 256, 2 * sm_count()));
  peer_counts_kernel<<<grid, 256, sizeof(int) * bins, stream>>>(index, n, k, peers, per_peer,
                                                                counts);
  return cudaGetLastError();
}

cudaError_t local_choices(const int32_t* index, int64_t n, int k, int first, int per_peer,
                          const int64_t* received, int64_t region, int32_t* out,
                          cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  local_choices_kernel<<<(n + kBlock - 1) / kBlock, kBlock, 0, stream>>>(
      index, n, k, first, per_peer, received, region, out);
  return cudaGetLastError();
}

cudaError_t peer_slots(const int32_t* to_peer, int64_t n, int peers, int64_t region_rows,
                       int32_t* out, cudaStream_t stream) {
  if (n == 0 || peers == 0) return cudaSuccess;
  peer_slots_kernel<<<peers, kSlotThreads, 0, stream>>>(to_peer, n, peers, region_rows, out);
  return cudaGetLastError();
}

cudaError_t region_slots(const int64_t* received, int peers, int width, int64_t capacity,
                         int32_t* out, cudaStream_t stream) {
  const int64_t n = peers * capacity * peers;
  if (n == 0) return cudaSuccess;
  region_slots_kernel<<<(n + kBlock - 1) / kBlock, kBlock, 0, stream>>>(received, peers, width,
                                                                        capacity, out);
  return cudaGetLastError();
}

cudaError_t place_rows(const void* x, int64_t n, int64_t row_bytes, const int32_t* slot, int peers,
                       int64_t capacity, void* out, cudaStream_t stream) {
  if (n == 0 || row_bytes == 0 || peers == 0) return cudaSuccess;
  const auto aligned = [&](size_t a) {
    return row_bytes % static_cast<int64_t>(a) == 0 && reinterpret_cast<uintptr_t>(x) % a == 0 &&
           reinterpret_cast<uintptr_t>(out) % a == 0;
  };
  const auto blocks = static_cast<unsigned>(std::min<int64_t>((n + 7) / 8, 132 * 16));
  if (aligned(16))
    place_rows_kernel<uint4><<<blocks, kBlock, 0, stream>>>(static_cast<const uint4*>(x), n,
                                                            row_bytes / 16, slot, peers, capacity,
                                                            static_cast<uint4*>(out));
  else if (aligned(4))
    place_rows_kernel<uint32_t><<<blocks, kBlock, 0, stream>>>(static_cast<const uint32_t*>(x), n,
                                                               row_bytes / 4, slot, peers, capacity,
                                                               static_cast<uint32_t*>(out));
  else
    place_rows_kernel<uint8_t><<<blocks, kBlock, 0, stream>>>(static_cast<const uint8_t*>(x), n,
                                                              row_bytes, slot, peers, capacity,
                                                              static_cast<uint8_t*>(out));
  return cudaGetLastError();
}

}  // namespace kernels
}  // namespace mt::cuda
