// The CUDA kernels' launch API: raw pointers, sizes and a stream (DeepEP's habit), so that the
// .cu files need neither Tensor nor fmt. Each returns the launch's cudaError_t; the Tensor-level
// wrappers (ops/cuda/<family>.cpp) check shapes and dtypes and turn errors into mt::Error.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/dtype.h"
#include "core/mx_format.h"
#include "ops/routing_mode.h"

namespace mt::cuda::kernels {

// Element-wise kernels take their storage as a DType: f32 or bf16 (dtype_info(t).kernel_storage),
// math in fp32.

cudaError_t rmsnorm_forward(DType s, const void* x, const void* w, float eps, void* y, float* rstd,
                            int64_t n, int64_t d, cudaStream_t stream);
// dx overwritten; dw accumulated through `partial` (chunks x d floats, chunks = rmsnorm_chunks(n)).
int rmsnorm_chunks(int64_t n);
cudaError_t rmsnorm_backward(DType s, const void* x, const void* w, const float* rstd,
                             const void* dy, void* dx, void* dw, bool dw_f32, float* partial,
                             int64_t n, int64_t d, cudaStream_t stream);
cudaError_t rope(DType s, const void* x, const int32_t* pos, double theta, int direction, void* y,
                 int64_t n, int64_t heads, int64_t head_dim, cudaStream_t stream);
// The expert rows' extras of SwiGLU (ops/activation.h), each nullable: rows whose token is
// negative (padding) are skipped; a = weight[r] * silu(gate) * up; the backward writes
// dweight[r] = <da, silu(gate) * up> (with weight only).
struct SwigluRows {
  const int32_t* token;
  const float* weight;
  float* dweight;
};
// A second output of a row-writing kernel (ops::MxValuesOut): what it writes, quantized and
// dequantized along the rows (dim0), in the output's storage type; `values` may be the output
// itself (then only the MX values are written). Null: none. The fused kernels need rows of a
// multiple of 32 elements in 16-byte aligned packs; otherwise they return cudaErrorNotSupported
// and the caller writes the output, then ops::write_mx_values.
struct MxValuesOut {
  void* values;
  MxScaleRule rule;
};
// Both return cudaErrorNotSupported, launching nothing, for mx they cannot fuse.
cudaError_t swiglu_forward(DType s, const void* h, void* a, int64_t m, int64_t f, SwigluRows rows,
                           MxValuesOut mx, cudaStream_t stream);
cudaError_t swiglu_backward(DType s, const void* h, const void* da, void* dh, int64_t m, int64_t f,
                            SwigluRows rows, MxValuesOut mx, cudaStream_t stream);
// loss (n floats, scratch) receives each row's loss (0 where masked); *loss_sum (device) += their
// sum. The backward's scale is a device double.
cudaError_t cross_entropy_forward(DType s, const void* logits, const int32_t* targets,
                                  const uint8_t* mask, float* lse, float* loss, double* loss_sum,
                                  int64_t n, int64_t v, cudaStream_t stream);
cudaError_t cross_entropy_backward(DType s, const void* logits, const int32_t* targets,
                                   const uint8_t* mask, const float* lse, const double* scale,
                                   void* dlogits, int64_t n, int64_t v, cudaStream_t stream);
// Where the experts' rows are, on the device (ops::ExpertRows): expert e has
// offsets[e + 1] - offsets[e] rows from row segments[e] (segments == offsets when dense).
struct ExpertSegments {
  const int64_t* offsets;
  const int64_t* segments;
};

// Grouped GEMM over experts, bf16 operands.
// out (m, n) rows of expert e = a rows (k wide) @ w[e]; w[e] is (k, n) row-major, or with
// b_transposed (n, k) row-major used as its transpose. out is f32 or bf16 (out_f32).
cudaError_t grouped_gemm_rows(const void* a, const void* w, ExpertSegments rows, int experts,
                              int64_t m, int64_t k, int64_t n, bool b_transposed, void* out,
                              bool out_f32, cudaStream_t stream);
// dw[e] (k, n) (+)= x_e^T dy_e over the expert's rows (accumulate: add to dw, else overwrite);
// experts without rows are left alone (see zero_empty_groups).
cudaError_t grouped_gemm_weight(const void* x, const void* dy, ExpertSegments rows, int experts,
                                int64_t k, int64_t n, void* dw, bool out_f32, bool accumulate,
                                cudaStream_t stream);
// Zeroes out[e] (group_elems elements, f32 or bf16) of every group e without rows: what an
// overwriting weight gradient leaves unwritten.
cudaError_t zero_empty_groups(const int64_t* offsets, int experts, void* out, int64_t group_elems,
                              bool out_f32, cudaStream_t stream);

// The same three products through CUTLASS's Hopper grouped kernels (TMA + wgmma), all group
// arguments built on the device from the offsets. lhs/rhs/out as the products' comments in
// cutlass/grouped_gemm_sm90.cuh; out is bf16 (forward, input gradient) or f32 (weight gradient,
// accumulated or overwritten). workspace: device memory of at least *_workspace(experts) bytes.
// The forward's configuration for inner sizes up to this (pingpong square tiles; above it, the
// wide cooperative tile).
inline constexpr int64_t kCutlassShortK = 1024;
inline constexpr int64_t kFixedRowTile = 128;  // the segments' alignment the fixed kernels need
#if MOETRAIN_HAS_CUTLASS
size_t cutlass_grouped_forward_workspace(int experts);
size_t cutlass_grouped_input_gradient_workspace(int experts);
size_t cutlass_grouped_weight_gradient_workspace(int experts);
cudaError_t cutlass_grouped_forward(ExpertSegments rows, int experts, const void* lhs,
                                    const void* rhs, void* out, int64_t m, int64_t k, int64_t n,
                                    void* workspace, size_t workspace_size, cudaStream_t stream);
cudaError_t cutlass_grouped_input_gradient(ExpertSegments rows, int experts, const void* lhs,
                                           const void* rhs, void* out, int64_t m, int64_t k,
                                           int64_t n, void* workspace, size_t workspace_size,
                                           cudaStream_t stream);
// The forward (k <= kCutlassShortK) and input-gradient products over a layout whose segments
// start on multiples of 128 rows (ops::ExpertRows, align 128): capacity rows, padding included;
// fixed TMA descriptors, every tile's expert from a table built on the device from the segments.
// The padding's output rows are written and meaningless.
size_t cutlass_fixed_forward_workspace(int64_t capacity, int64_t n);
size_t cutlass_fixed_input_gradient_workspace(int64_t capacity, int64_t k);
cudaError_t cutlass_fixed_forward(const int64_t* segments, int experts, const void* x,
                                  const void* w, void* out, int64_t capacity, int64_t k, int64_t n,
                                  void* workspace, size_t workspace_bytes, cudaStream_t stream);
cudaError_t cutlass_fixed_input_gradient(const int64_t* segments, int experts, const void* dy,
                                         const void* w, void* dx, int64_t capacity, int64_t k,
                                         int64_t n, void* workspace, size_t workspace_bytes,
                                         cudaStream_t stream);
// The MX expert product (ops/mx_gemm.h) over segments starting on multiples of 128 rows:
// out (capacity, p) bf16 = A_e b[e]^T with A's E4M3 data (capacity, q) and E8M0 scales
// (capacity, q / 32), b (E, p, q) bf16; q a multiple of 32, p of 8; 16-byte aligned rows of
// a (q) and b (2 q bytes) for TMA. cutlass/mx_gemm_sm90.cu.
size_t mx_gemm_workspace(int64_t capacity, int64_t p);
cudaError_t mx_gemm(const int64_t* segments, int experts, const uint8_t* a_data,
                    const uint8_t* a_scales, const void* b, void* out, int64_t capacity, int64_t p,
                    int64_t q, void* workspace, size_t workspace_bytes, cudaStream_t stream);
cudaError_t cutlass_grouped_weight_gradient(ExpertSegments rows, int experts, const void* lhs,
                                            const void* rhs, void* out, int64_t m, int64_t k,
                                            int64_t n, void* workspace, size_t workspace_size,
                                            bool accumulate, cudaStream_t stream);
#endif

// --- attention (attention.cu): the reference GPU kernel, packed causal documents, GQA ---
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

// --- router (route.cu) ---
// The routing kernels keep one token's experts in a warp's registers and its choices in lanes.
constexpr int kMaxRoutedExperts = 1024;
constexpr int kMaxRoutedTopK = 16;
// logits, scores f32 (n, e); index i32 / weight f32 (n, k); counts i64 (e), zeroed here.
// *out = E / N^2 * sum_e counts[e] * score_sum[e] (the load-balancing loss), N = sum(counts) /
// top_k read on the device (0 when N is 0).
cudaError_t router_aux_loss(const int64_t* counts, const float* score_sum, int e, int top_k,
                            double* out, cudaStream_t stream);
// counts (e) = choices per expert of the tokens whose padding byte is 0 (index i32 (n, k)).
cudaError_t expert_counts(const int32_t* index, const uint8_t* padding, int64_t n, int e, int k,
                          int64_t* counts, cudaStream_t stream);
// pooled_counts[e] += counts[e], pooled_sum[e] += score_sum[e].
cudaError_t add_aux_stats(const int64_t* counts, const float* score_sum, int e,
                          int64_t* pooled_counts, float* pooled_sum, cudaStream_t stream);
cudaError_t router_forward(const float* logits, const float* bias, int64_t n, int e, int k,
                           bool norm_topk, ops::RoutingMode mode, float* scores, int32_t* index,
                           float* weight, int64_t* counts, cudaStream_t stream);
// out (e) = column sums of scores (n, e) over the rows whose padding byte is 0 (padding null:
// every row); partial: column_sum_workspace(e) bytes.
size_t column_sum_workspace(int e);
cudaError_t column_sum(const float* scores, const uint8_t* padding, int64_t n, int e,
                       float* partial, float* out, cudaStream_t stream);
// The aux term of token t's score gradient is aux_grad * E * counts[c] / N^2 (N = sum(counts) /
// k, the whole batch's real tokens, read on the device into the workspace's
// router_backward_workspace() bytes), 0 for padding tokens (padding null: none); dlogits f32
// (n, e).
size_t router_backward_workspace();
cudaError_t router_backward(const float* scores, const int32_t* index, const float* dweight,
                            const int64_t* counts, const uint8_t* padding, double aux_grad,
                            int64_t n, int e, int k, bool norm_topk, double* workspace,
                            float* dlogits, cudaStream_t stream);

// --- expert permutation and the exchange's layouts (permute.cu) ---
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
cudaError_t gather_rows(DType s, const void* src, const int32_t* index, void* dst, int64_t rows,
                        int64_t width, cudaStream_t stream);
// out[t] = residual[t] (when not null) + sum_j rows[row_of_choice[t*k + j]].
cudaError_t sum_token_rows(DType s, const void* rows, const int32_t* row_of_choice,
                           const void* residual, int64_t tokens, int k, void* out, int64_t width,
                           cudaStream_t stream);
// dst[row_of_choice[t, j]] = src[t] for t < tokens, j < k (each source row read once); with mx,
// its rows' MX values too (cudaErrorNotSupported, nothing launched, when it cannot fuse them).
cudaError_t scatter_token_rows(DType s, const void* src, const int32_t* row_of_choice,
                               int64_t tokens, int k, void* dst, int64_t width, MxValuesOut mx,
                               cudaStream_t stream);
// out[s] (width) += sum over r in [offsets[s], offsets[s+1]) of rows[order[r]], in order.
// out is f32 (out_f32) or the rows' type.
cudaError_t segment_sum_rows(DType s, const void* rows, const int32_t* order,
                             const int64_t* offsets, int64_t segments, int64_t width, void* out,
                             bool out_f32, cudaStream_t stream);

// --- MX quantization (mx.cu) ---
// MX quantization (ops/mx.h): x (batch, rows, cols), f32 or bf16, 16-byte aligned -> E4M3 data
// and E8M0 scales in core/mx.h's layout for `axis`, and back to f32 or bf16 in the logical
// layout (16-byte aligned). dim1 needs rows of a multiple of 16 bytes (cols * element size).
cudaError_t mx_quantize(DType in, const void* x, MxAxis axis, MxScaleRule rule, int64_t batch,
                        int64_t rows, int64_t cols, uint8_t* data, uint8_t* scales,
                        cudaStream_t stream);
cudaError_t mx_dequantize(DType out, const uint8_t* data, const uint8_t* scales, MxAxis axis,
                          int64_t batch, int64_t rows, int64_t cols, void* dst,
                          cudaStream_t stream);
// x (batch, rows, cols) quantized and dequantized (ops::mx_round_trip) in one pass, x's values
// first rounded to `out`'s type; 16-byte aligned. dim0: out in x's layout (may be x); dim1: out
// (batch, cols, rows), the values transposed into the quantized data's stored layout
// (ops::mx_round_trip_transposed), rows of a multiple of 16 bytes.
cudaError_t mx_round_trip(DType in, const void* x, MxAxis axis, MxScaleRule rule, int64_t batch,
                          int64_t rows, int64_t cols, DType out, void* dst, cudaStream_t stream);
// Both of mx_round_trip's outputs from one read of x: dim0 in x's layout and the dim1 values
// transposed (ops::mx_round_trip_both_axes); rows and cols multiples of 32, rows of a multiple of
// 16 bytes, 16-byte aligned.
cudaError_t mx_round_trip_both_axes(DType in, const void* x, MxScaleRule rule, int64_t batch,
                                    int64_t rows, int64_t cols, DType out, void* dim0,
                                    void* transposed, cudaStream_t stream);
// x (m, k) -> out: each expert's rows quantized and dequantized in 32-row blocks from its first
// row (ops::mx_round_trip_expert_rows); block_prefix: device scratch of experts + 1 i64.
cudaError_t mx_round_trip_expert_rows(DType t, const void* x, int64_t m, int64_t k,
                                      ExpertSegments rows, int experts, int64_t* block_prefix,
                                      MxScaleRule rule, void* out, cudaStream_t stream);

// --- element-wise (elementwise.cu) ---
// f32 -> bf16 (round to nearest even) or bf16 -> f32; `from` names the source type.
cudaError_t convert(DType from, const void* src, void* dst, int64_t n, cudaStream_t stream);
// Deterministic sum of x^2 into *result on the host (waits for the stream).
size_t sum_of_squares_workspace();
cudaError_t sum_of_squares(DType s, const void* x, int64_t n, void* workspace, double* result,
                           cudaStream_t stream);
cudaError_t scale(DType s, void* x, float factor, int64_t n, cudaStream_t stream);
cudaError_t add(DType s, const void* a, const void* b, void* out, int64_t n, cudaStream_t stream);

struct AdamWScalars {
  float beta1, beta2, decay, step_size, sqrt_bc2, eps, grad_scale;
};
// compute_bf16 (nullable) receives the updated parameters rounded to bf16; s points to device
// memory.
cudaError_t adamw(float* p, const float* g, float* m, float* v, void* compute_bf16,
                  const AdamWScalars* s, int64_t n, cudaStream_t stream);

}  // namespace mt::cuda::kernels
