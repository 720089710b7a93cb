// The expert permutation's and row moves' kernels (permute.cu) behind ops/permute.h and
// ops/embedding.h.
// Raw pointers, sizes and a stream (DeepEP's habit): the .cu files need neither Tensor nor fmt;
// each call returns its launch's cudaError_t.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/dtype.h"
#include "ops/cuda/fp8.h"
#include "ops/cuda/mx.h"

namespace mt::cuda::kernels {

size_t permutation_workspace(int64_t m, int e);
// Stable expert-major layout of m = n*k choices: row_of_choice i32 (m), offsets i64 (e + 1).
// align 1: dense, source_token i32 (m), segments unused. align > 1: each expert's segment
// starts at a multiple of align rows (segments i64 (e + 1)), source_token i32 (rows, the
// caller's ops::permuted_rows) with -1 on the padding rows. skips: negative indices (choices
// not routed here) get row_of_choice -1, and rows past the routed ones name no token.
cudaError_t expert_permutation(const int32_t* expert_index, int64_t m, int k, int e, int64_t align,
                               bool skips, void* workspace, size_t workspace_bytes, int64_t rows,
                               int32_t* source_token, int32_t* row_of_choice, int64_t* offsets,
                               int64_t* segments, cudaStream_t stream);
cudaError_t gather_rows(DType s, const void* src, const int32_t* index, void* dst, int64_t rows,
                        int64_t width, cudaStream_t stream);
// out[t] = residual[t] (when not null) + sum_j rows[row_of_choice[t*k + j]].
cudaError_t sum_token_rows(DType s, const void* rows, const int32_t* row_of_choice,
                           const void* residual, int64_t tokens, int k, void* out, int64_t width,
                           cudaStream_t stream);
// dst[row_of_choice[t, j]] = src[t] for t < tokens, j < k (each source row read once); with mx,
// its rows' MX values too, with fp8 (data not null) their FP8 copies in 1 x 128 blocks
// (cudaErrorNotSupported, nothing launched, when it cannot fuse them: not both, rows of a
// multiple of 128 in s's 16-byte packs).
cudaError_t scatter_token_rows(DType s, const void* src, const int32_t* row_of_choice,
                               int64_t tokens, int k, void* dst, int64_t width, MxValuesOut mx,
                               Fp8RowsOut fp8, cudaStream_t stream);
// out[s] (width) += sum over r in [offsets[s], offsets[s+1]) of rows[order[r]], in order.
// out is f32 (out_f32) or the rows' type.
cudaError_t segment_sum_rows(DType s, const void* rows, const int32_t* order,
                             const int64_t* offsets, int64_t segments, int64_t width, void* out,
                             bool out_f32, cudaStream_t stream);

}  // namespace mt::cuda::kernels
