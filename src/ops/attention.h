// Causal attention over packed variable-length documents with grouped-query heads.
// Document s owns tokens [cu_seqlens[s], cu_seqlens[s+1]); a token attends to itself and the
// earlier tokens of its own document only. Query head h reads kv head h / (H / KV).
#pragma once
#include <cstdint>

#include "core/tensor.h"

namespace mt::ops {

// Packed documents. The longest length travels with the boundaries (the data loader knows it)
// so the GPU kernels size their grids without reading the boundaries back from the device.
struct Documents {
  Tensor cu_seqlens;       // i32 (S + 1), on the activations' device
  int64_t max_length = 0;  // >= every document's length (the CPU checks; the GPU trusts it)
  // How many documents are longer than long_document_threshold(max_length, N), known on the host
  // (count_long_documents), or -1: not known. The GPU backward plans those apart from the rest.
  int64_t long_count = -1;
};
// The longest document of host boundaries.
int64_t max_document_length(const Tensor& cu_seqlens);

// The shape the GPU attention plans for: the document count and the longest length (at least
// 64, at most the tokens) rounded up to powers of two, so that batches of any packing share a
// few cuDNN plans and captured passes. Padding with empty documents changes no result.
struct PlannedDocuments {
  int64_t count = 0;
  int64_t longest = 0;
};
PlannedDocuments planned_documents(int64_t count, int64_t longest, int64_t tokens);

// The GPU backward's split. cuDNN's deterministic backward keeps partial sums whose size grows
// with its plan's document count times the square of its longest length, so one plan for a step
// of one long document beside a hundred short ones sizes every document as the long one (tens of
// GiB). Documents longer than a quarter of the planned longest (their count known on the host)
// are planned at the longest, the rest at that quarter: each class's workspace about its own.
int64_t long_document_threshold(int64_t longest, int64_t tokens);
// Documents of host boundaries longer than long_document_threshold(longest, tokens), tokens the
// last boundary.
int64_t count_long_documents(const Tensor& cu_seqlens, int64_t longest);
// The long documents' planned count: a power of two (0 for none; -1 stays unknown).
int64_t planned_long_documents(int64_t long_count);

// How the GPU computes attention; the CPU ignores it. Tests and benchmarks name a kernel and the
// backward's algorithm; the model takes the defaults.
enum class AttentionKernel : uint8_t {
  kAuto,       // cuDNN's fused SDPA where it applies (bf16, head dims multiples of 8 up to 256)
  kCudnn,      // cuDNN's, or an error where it does not apply
  kReference,  // the reference kernel (ops/cuda/attention.cu): any head dims, f32 or bf16
};
enum class Determinism : uint8_t {
  kDeterministic,  // a resumed run repeats the uninterrupted one bit for bit
  kFast,           // cuDNN's non-deterministic backward (atomics)
};
struct AttentionGpu {
  AttentionKernel kernel = AttentionKernel::kAuto;
  Determinism backward = Determinism::kDeterministic;
  // cuDNN's backward runs over groups of KV heads (with their query heads) when its workspace for
  // all heads at once would exceed this; the results are the same bit for bit.
  int64_t workspace_budget_bytes = int64_t{1} << 30;
};
// Whether this build has cuDNN's attention (the cuDNN frontend was found at configure time).
bool cudnn_attention_available();

// q (N, H, Dqk), k (N, KV, Dqk), v (N, KV, Dv), cu_seqlens i32 (S + 1) with cu_seqlens[S] = N.
// out (N, H, Dv); lse (N, H) = log sum_j exp(scale * q.k_j), saved so backward never re-runs
// the forward softmax normalisation.
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Documents& docs,
                       double scale, Tensor& out, Tensor& lse, const AttentionGpu& gpu = {});
// dq, dk, dv overwritten.
void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                        const Tensor& lse, const Tensor& dout, const Documents& docs, double scale,
                        Tensor& dq, Tensor& dk, Tensor& dv, const AttentionGpu& gpu = {});

// Context parallelism. A packed row of `row_tokens` tokens is dealt to cp ranks in 2 cp equal
// chunks, rank r holding chunks r and 2 cp - 1 - r: each rank pairs an early chunk (little causal
// work) with a late one (much), so every rank's causal work is the same when the row is one
// document. Several rows lie end to end; a rank holds its two chunks of each, row by row.
struct ContextChunks {
  int64_t row_tokens = 0;
  int64_t cp = 1;
  int64_t rank = 0;
  int64_t chunk() const { return row_tokens / (2 * cp); }
  // The row position (the rows laid end to end) where this rank's chunk `slot` of row `row`
  // starts: slot 0 is chunk rank, slot 1 chunk 2 cp - 1 - rank (the CUDA layout kernel,
  // ops/cuda/attention.cu, computes the same).
  int64_t chunk_start(int64_t row, int64_t slot) const {
    return row * row_tokens + (slot == 0 ? rank : 2 * cp - 1 - rank) * chunk();
  }
};
// The row positions rank `c.rank` holds over `rows` rows laid end to end, increasing (i32
// (rows x row_tokens / cp), on the host). row_tokens must be a multiple of 2 cp (an mt::Error
// names the sizes and train.seq_len).
Tensor context_parallel_rows(const ContextChunks& c, int64_t rows = 1);

// A context-parallel rank's attention: its tokens' queries against the whole rows' keys and
// values (all-gathered from the CP group). q (Nq, H, Dqk) holds the rank's queries (Nq = rows x
// row_tokens / cp, context_parallel_rows' positions); k (N, KV, Dqk), v (N, KV, Dv) and docs are
// the whole rows' (N = rows x row_tokens). out (Nq, H, Dv) and lse (Nq, H) are the whole rows'
// attention at the rank's positions: documents crossing chunk boundaries are kept whole. On the
// GPU through cuDNN's SDPA (bf16; each chunk's part of each document is a ragged sequence whose
// queries end its keys: a bottom-right causal mask).
void attention_forward_rows(const Tensor& q, const ContextChunks& chunks, const Tensor& k,
                            const Tensor& v, const Documents& docs, double scale, Tensor& out,
                            Tensor& lse, const AttentionGpu& gpu = {});
// dq (Nq) overwritten; dk and dv (N, the whole rows) overwritten with this rank's share of the
// rows' key and value gradients: summed over the CP group (the reduce-scatter) they are the rows'.
void attention_backward_rows(const Tensor& q, const ContextChunks& chunks, const Tensor& k,
                             const Tensor& v, const Tensor& out, const Tensor& lse,
                             const Tensor& dout, const Documents& docs, double scale, Tensor& dq,
                             Tensor& dk, Tensor& dv, const AttentionGpu& gpu = {});

}  // namespace mt::ops
