// The attention kernels (attention.cu: the reference kernel and cuDNN's ragged layout) behind
// ops/attention.h.
// Raw pointers, sizes and a stream (DeepEP's habit): the .cu files need neither Tensor nor fmt;
// each call returns its launch's cudaError_t.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/dtype.h"

namespace mt::cuda::kernels {

// q (n, heads, dqk), k (n, kv_heads, dqk), v (n, kv_heads, dv), cu_seqlens i32 (docs + 1);
// out (n, heads, dv), lse f32 (n, heads).
cudaError_t attention_forward(DType s, const void* q, const void* k, const void* v,
                              const int32_t* cu_seqlens, int docs, int64_t n, int heads,
                              int kv_heads, int dqk, int dv, float scale, void* out, float* lse,
                              cudaStream_t stream);
// delta: f32 scratch (n, heads). dq, dk, dv overwritten.
cudaError_t attention_backward(DType s, const void* q, const void* k, const void* v,
                               const void* out, const float* lse, const void* dout,
                               const int32_t* cu_seqlens, int docs, int64_t n, int heads,
                               int kv_heads, int dqk, int dv, float scale, float* delta, void* dq,
                               void* dk, void* dvv, cudaStream_t stream);

// cuDNN's ragged description of packed documents: per document (padded_docs of them, the ones
// past `docs` empty) the element offset into q, k, v, out and lse (padded_docs + 1 entries:
// stride per token times the document's first token) and its length (padded_docs entries).
struct RaggedStrides {
  int32_t q, k, v, o, stats;  // elements per token
};
struct RaggedLayout {
  int32_t *q, *k, *v, *o, *stats, *seq_len;
};
cudaError_t attention_ragged_layout(const int32_t* cu_seqlens, int docs, int padded_docs,
                                    RaggedStrides strides, RaggedLayout out, cudaStream_t stream);
// The documents longer than `threshold` into `longer` (padded to longer_docs with empty ones),
// the rest into `rest` (padded to rest_docs), each class in document order. At most longer_docs
// documents may be longer (the host counted them); one block.
cudaError_t attention_ragged_layout_split(const int32_t* cu_seqlens, int docs, int threshold,
                                          int longer_docs, int rest_docs, RaggedStrides strides,
                                          RaggedLayout longer, RaggedLayout rest,
                                          cudaStream_t stream);

}  // namespace mt::cuda::kernels
