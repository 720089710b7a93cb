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
  int32_t* seq_len_kv;  // the keys' lengths: seq_len itself except for a context-parallel rank's
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

// A context-parallel rank's sequences (ops::attention_forward_rows): for each of `rows` rows
// and each of its chunks slot_begin .. slot_begin + slots - 1 (slot 0: chunk rank, 1: chunk
// 2 cp - 1 - rank of 2 cp of `chunk` tokens) and each of padded_docs documents (those past `docs`
// empty), in that order: the queries of the document inside the chunk (offsets into the rank's
// q, out and lse, which hold its chunks row by row) and the document's keys from its start to the
// chunk's end (offsets into the whole rows' k and v), seq_len and seq_len_kv their counts (0 and
// 0 where the document misses the chunk). The offsets' last entries are the ends.
struct ContextGeometry {
  int32_t row_tokens, chunk, cp, rank, rows;
};
cudaError_t attention_chunk_layout(const int32_t* cu_seqlens, int docs, int padded_docs,
                                   ContextGeometry g, int slot_begin, int slots,
                                   RaggedStrides strides, RaggedLayout out, cudaStream_t stream);

}  // namespace mt::cuda::kernels
