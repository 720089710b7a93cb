// Attention through cuDNN's fused SDPA (attention_cudnn.cpp) behind ops/attention.h: host code
// over Tensors, which builds and caches the cuDNN frontend's graphs and takes their workspaces
// from the caching allocator. Built where the cuDNN frontend was found (MOETRAIN_HAS_CUDNN).
// Operands are checked by the front door; bf16 on the GPU, lse f32 (N, H).
#pragma once
#include <cstdint>

#include "core/tensor.h"
#include "ops/attention.h"

namespace mt::cuda {

bool cudnn_attention_supports(const Tensor& q, const Tensor& v);
void cudnn_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                             const ops::Documents& docs, double scale, Tensor& out, Tensor& lse);
// Over groups of KV heads where the workspace of all at once would exceed the budget.
void cudnn_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                              const Tensor& lse, const Tensor& dout, const ops::Documents& docs,
                              double scale, ops::Determinism determinism, Tensor& dq, Tensor& dk,
                              Tensor& dv, int64_t workspace_budget_bytes);

// A context-parallel rank's queries (ops::attention_forward_rows): each of its chunks' part of
// each document is one ragged sequence of queries over the document's keys up to the chunk's
// end, under a bottom-right causal mask; both chunks of every row in one pass.
void cudnn_attention_forward_chunks(const Tensor& q, const ops::ContextChunks& chunks,
                                    const Tensor& k, const Tensor& v, const ops::Documents& docs,
                                    double scale, Tensor& out, Tensor& lse);
// The backward of the rank's chunk `slot` (0: chunk rank, 1: chunk 2 cp - 1 - rank) of every row:
// dq written at that chunk's queries, dk and dv at the keys its sequences read (the rest left as
// they are: the two slots' key ranges overlap, so the front door zeroes and adds).
void cudnn_attention_backward_chunks(const Tensor& q, const ops::ContextChunks& chunks,
                                     const Tensor& k, const Tensor& v, const Tensor& out,
                                     const Tensor& lse, const Tensor& dout,
                                     const ops::Documents& docs, double scale,
                                     ops::Determinism determinism, int slot, Tensor& dq, Tensor& dk,
                                     Tensor& dv, int64_t workspace_budget_bytes);

}  // namespace mt::cuda
