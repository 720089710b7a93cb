// The expert-parallel exchange's layout kernels (exchange_layout.cu) behind
// ops/exchange_layout.h.
// Raw pointers, sizes and a stream (DeepEP's habit): the .cu files need neither Tensor nor fmt;
// each call returns its launch's cudaError_t.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace mt::cuda::kernels {

// ops::peer_choices (out i32 (n, peers)) and ops::local_choices (n entries).
cudaError_t peer_choices(const int32_t* index, int64_t n, int k, int peers, int per_peer,
                         int32_t* out, cudaStream_t stream);
// received: null, or i64 (peers, per_peer + 1) counts whose last column masks each region of
// `region` rows (k entries each) past its count.
cudaError_t local_choices(const int32_t* index, int64_t n, int k, int first, int per_peer,
                          const int64_t* received, int64_t region, int32_t* out,
                          cudaStream_t stream);
// ops::peer_slots: to_peer and out i32 (n, peers).
cudaError_t peer_slots(const int32_t* to_peer, int64_t n, int peers, int64_t region_rows,
                       int32_t* out, cudaStream_t stream);
cudaError_t region_slots(const int64_t* received, int peers, int width, int64_t capacity,
                         int32_t* out, cudaStream_t stream);
// ops::place_rows over rows of row_bytes.
cudaError_t place_rows(const void* x, int64_t n, int64_t row_bytes, const int32_t* slot, int peers,
                       int64_t capacity, void* out, cudaStream_t stream);
// ops::peer_counts: counts i64 (peers, per_peer + 1); peers * (per_peer + 1) ints of shared memory.
cudaError_t peer_counts(const int32_t* index, int64_t n, int k, int peers, int per_peer,
                        int64_t* counts, cudaStream_t stream);

}  // namespace mt::cuda::kernels
