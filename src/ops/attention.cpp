// The attention front door (ops/attention.h): the shapes checked once (and on the CPU the
// documents' boundaries), then the CPU reference (ops/cpu/attention.cpp) or on the GPU cuDNN's
// fused SDPA (ops/cuda/attention_cudnn.cpp) or the reference kernel (ops/cuda/attention.cu); the
// documents' planning the GPU paths share.
#include "ops/attention.h"

#include <algorithm>
#include <bit>

#include "ops/cpu/attention.h"
#include "ops/dispatch.h"
#include "ops/elementwise.h"
#if MOETRAIN_HAS_CUDA
#include "core/profile.h"
#include "ops/cuda/attention.h"
#include "ops/cuda/operands.h"
#if MOETRAIN_HAS_CUDNN
#include "ops/cuda/attention_cudnn.h"
#endif
#endif

namespace mt::ops {

namespace {

struct AttnDims {
  int64_t n, h, kv, dqk, dv, docs;
};

// The documents of n tokens on the activations' device; on the CPU also their boundaries.
void check_documents(const Documents& docs, int64_t n, Device device) {
  const Tensor& cu_seqlens = docs.cu_seqlens;
  const int64_t count = cu_seqlens.numel() - 1;
  expect_dtype(cu_seqlens, DType::kI32, "cu_seqlens");
  MT_CHECK(cu_seqlens.ndim() == 1 && count >= 1, "cu_seqlens must hold S + 1 >= 2 boundaries");
  MT_CHECK(cu_seqlens.device() == device, "cu_seqlens must be on the activations' device");
  if (device != Device::kCPU) return;  // the loader checked the boundaries it sends to the GPU
  const int32_t* cu = cu_seqlens.data<int32_t>();
  MT_CHECK(cu[0] == 0 && cu[count] == n, "cu_seqlens must run from 0 to {}", n);
  for (int64_t s = 0; s < count; ++s) {
    MT_CHECK(cu[s] <= cu[s + 1], "cu_seqlens decreases at {}", s);
    MT_CHECK(cu[s + 1] - cu[s] <= docs.max_length,
             "document {} has {} tokens, more than the "
             "stated longest {}",
             s, cu[s + 1] - cu[s], docs.max_length);
  }
}

AttnDims check_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Documents& docs) {
  MT_CHECK(q.ndim() == 3 && k.ndim() == 3 && v.ndim() == 3, "attention needs (N, heads, dim)");
  AttnDims d{q.dim(0), q.dim(1), k.dim(1), q.dim(2), v.dim(2), docs.cu_seqlens.numel() - 1};
  expect_shape(k, {d.n, d.kv, d.dqk}, "attention k");
  expect_shape(v, {d.n, d.kv, d.dv}, "attention v");
  MT_CHECK(d.kv > 0 && d.h % d.kv == 0, "query heads {} not a multiple of kv heads {}", d.h, d.kv);
  check_documents(docs, d.n, q.device());
  return d;
}

// A context-parallel rank's operands: q (Nq, H, Dqk) its queries (its two chunks of each row),
// the whole rows' k, v and documents.
AttnDims check_rows(const Tensor& q, const ContextChunks& c, const Tensor& k, const Tensor& v,
                    const Documents& docs) {
  MT_CHECK(q.ndim() == 3 && k.ndim() == 3 && v.ndim() == 3, "attention needs (N, heads, dim)");
  AttnDims d{k.dim(0), q.dim(1), k.dim(1), q.dim(2), v.dim(2), docs.cu_seqlens.numel() - 1};
  expect_shape(k, {d.n, d.kv, d.dqk}, "attention k");
  expect_shape(v, {d.n, d.kv, d.dv}, "attention v");
  MT_CHECK(d.kv > 0 && d.h % d.kv == 0, "query heads {} not a multiple of kv heads {}", d.h, d.kv);
  MT_CHECK(c.cp >= 1 && c.rank >= 0 && c.rank < c.cp && c.row_tokens > 0 &&
               c.row_tokens % (2 * c.cp) == 0 && d.n % c.row_tokens == 0 && q.dim(0) * c.cp == d.n,
           "context-parallel rank {} of {} with rows of {}: {} queries against {} keys (a rank "
           "holds a cp-th of whole rows, in 2 cp equal chunks each)",
           c.rank, c.cp, c.row_tokens, q.dim(0), d.n);
  check_documents(docs, d.n, q.device());
  return d;
}

// Whether a context-parallel rank's attention runs on the GPU, where only cuDNN's does (the
// operands checked for it).
bool rows_on_gpu(const Tensor& q, const Tensor& v, const Tensor& lse, const AttnDims& d) {
  if (!on_gpu(q)) return false;
  expect_dtype(lse, DType::kF32, "attention lse (GPU)");
#if MOETRAIN_HAS_CUDNN
  MT_CHECK(cuda::cudnn_attention_supports(q, v),
           "context-parallel attention on the GPU runs through cuDNN: bf16 with head dims "
           "multiples of 8 up to 256, got {} {}/{}",
           dtype_name(q.dtype()), d.dqk, d.dv);
  return true;
#else
  (void)v;
  (void)d;
  MT_CHECK(false, "context-parallel attention on the GPU needs cuDNN (this build has none)");
  return false;
#endif
}

}  // namespace

int64_t max_document_length(const Tensor& cu_seqlens) {
  expect_dtype(cu_seqlens, DType::kI32, "cu_seqlens");
  MT_CHECK(cu_seqlens.device() == Device::kCPU, "max_document_length reads host boundaries");
  const int32_t* cu = cu_seqlens.data<int32_t>();
  int64_t longest = 0;
  for (int64_t s = 0; s + 1 < cu_seqlens.numel(); ++s)
    longest = std::max<int64_t>(longest, cu[s + 1] - cu[s]);
  return longest;
}

namespace {
// The power of two at or above max(x, floor).
int64_t pow2_at_least(int64_t x, int64_t floor) {
  return static_cast<int64_t>(std::bit_ceil(static_cast<uint64_t>(std::max(x, floor))));
}
}  // namespace

PlannedDocuments planned_documents(int64_t count, int64_t longest, int64_t tokens) {
  return {pow2_at_least(count, 1), std::min(pow2_at_least(longest, 64), tokens)};
}

int64_t long_document_threshold(int64_t longest, int64_t tokens) {
  return planned_documents(1, longest, tokens).longest / 4;
}

int64_t count_long_documents(const Tensor& cu_seqlens, int64_t longest) {
  expect_dtype(cu_seqlens, DType::kI32, "cu_seqlens");
  MT_CHECK(cu_seqlens.device() == Device::kCPU, "count_long_documents reads host boundaries");
  const int32_t* cu = cu_seqlens.data<int32_t>();
  const int64_t docs = cu_seqlens.numel() - 1;
  const int64_t threshold = long_document_threshold(longest, docs >= 0 ? cu[docs] : 0);
  int64_t count = 0;
  for (int64_t s = 0; s < docs; ++s) count += cu[s + 1] - cu[s] > threshold;
  return count;
}

int64_t planned_long_documents(int64_t long_count) {
  return long_count <= 0 ? long_count : pow2_at_least(long_count, 1);
}

bool cudnn_attention_available() {
#if MOETRAIN_HAS_CUDNN
  return true;
#else
  return false;
#endif
}

#if MOETRAIN_HAS_CUDA
namespace {
// cuDNN's where the options and the operands allow it.
bool use_cudnn(const Tensor& q, const Tensor& v, const AttentionGpu& gpu) {
  if (gpu.kernel == AttentionKernel::kReference) return false;
#if MOETRAIN_HAS_CUDNN
  const bool supported = cuda::cudnn_attention_supports(q, v);
#else
  const bool supported = false;
#endif
  MT_CHECK(gpu.kernel != AttentionKernel::kCudnn || supported,
           "cuDNN attention {} for {} q {} and v {} (it takes bf16, head dims multiples of 8 up "
           "to 256)",
           cudnn_attention_available() ? "does not apply" : "is not built in",
           dtype_name(q.dtype()), shape_str(q.shape()), shape_str(v.shape()));
  return supported;
}
}  // namespace
#endif

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Documents& docs,
                       double scale, Tensor& out, Tensor& lse, const AttentionGpu& gpu) {
  const AttnDims d = check_attention(q, k, v, docs);
  expect_shape(out, {d.n, d.h, d.dv}, "attention out");
  expect_shape(lse, {d.n, d.h}, "attention lse");
#if MOETRAIN_HAS_CUDA
  if (on_gpu(q)) {
    expect_dtype(lse, DType::kF32, "attention lse (GPU)");
    for (const Tensor* t : std::initializer_list<const Tensor*>{&k, &v, &out})
      cuda::same_storage_type(q, *t, "attention operand");
#if MOETRAIN_HAS_CUDNN
    if (use_cudnn(q, v, gpu)) return cuda::cudnn_attention_forward(q, k, v, docs, scale, out, lse);
#else
    use_cudnn(q, v, gpu);
#endif
    const profile::Phase phase("gpu.reference_attention_forward");
    MT_CUDA_CHECK(cuda::kernels::attention_forward(
        cuda::storage_of(q, "attention q"), q.raw(), k.raw(), v.raw(),
        docs.cu_seqlens.data<int32_t>(), static_cast<int>(d.docs), d.n, static_cast<int>(d.h),
        static_cast<int>(d.kv), static_cast<int>(d.dqk), static_cast<int>(d.dv),
        static_cast<float>(scale), out.raw(), lse.data<float>(), cuda::stream()));
    return;
  }
#endif
  (void)gpu;
  cpu::attention_forward(q, k, v, docs, scale, out, lse);
}

void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                        const Tensor& lse, const Tensor& dout, const Documents& docs, double scale,
                        Tensor& dq, Tensor& dk, Tensor& dv, const AttentionGpu& gpu) {
  const AttnDims d = check_attention(q, k, v, docs);
  expect_shape(out, {d.n, d.h, d.dv}, "attention out");
  expect_shape(lse, {d.n, d.h}, "attention lse");
  expect_shape(dout, {d.n, d.h, d.dv}, "attention dout");
  expect_shape(dq, q.shape(), "attention dq");
  expect_shape(dk, k.shape(), "attention dk");
  expect_shape(dv, v.shape(), "attention dv");
#if MOETRAIN_HAS_CUDA
  if (on_gpu(q)) {
    expect_dtype(lse, DType::kF32, "attention lse (GPU)");
    for (const Tensor* t : std::initializer_list<const Tensor*>{&k, &v, &out, &dout, &dq, &dk, &dv})
      cuda::same_storage_type(q, *t, "attention operand");
#if MOETRAIN_HAS_CUDNN
    if (use_cudnn(q, v, gpu))
      return cuda::cudnn_attention_backward(q, k, v, out, lse, dout, docs, scale, gpu.backward, dq,
                                            dk, dv, gpu.workspace_budget_bytes);
#else
    use_cudnn(q, v, gpu);
#endif
    const profile::Phase phase("gpu.reference_attention_backward");
    Tensor delta = cuda::gpu_empty({d.n, d.h}, DType::kF32);
    MT_CUDA_CHECK(cuda::kernels::attention_backward(
        cuda::storage_of(q, "attention q"), q.raw(), k.raw(), v.raw(), out.raw(), lse.data<float>(),
        dout.raw(), docs.cu_seqlens.data<int32_t>(), static_cast<int>(d.docs), d.n,
        static_cast<int>(d.h), static_cast<int>(d.kv), static_cast<int>(d.dqk),
        static_cast<int>(d.dv), static_cast<float>(scale), delta.data<float>(), dq.raw(), dk.raw(),
        dv.raw(), cuda::stream()));
    return;
  }
#endif
  (void)gpu;
  cpu::attention_backward(q, k, v, out, lse, dout, docs, scale, dq, dk, dv);
}

}  // namespace mt::ops

namespace mt::ops {

Tensor context_parallel_rows(const ContextChunks& c, int64_t rows) {
  MT_CHECK(c.cp >= 1 && c.rank >= 0 && c.rank < c.cp && rows >= 0,
           "context-parallel rank {} of {} over {} rows", c.rank, c.cp, rows);
  MT_CHECK(c.row_tokens % (2 * c.cp) == 0,
           "a row of {} tokens cannot be dealt to {} context-parallel ranks in 2 x {} = {} equal "
           "chunks: train.seq_len must be a multiple of {}",
           c.row_tokens, c.cp, c.cp, 2 * c.cp, 2 * c.cp);
  const int64_t chunk = c.chunk();
  Tensor out = Tensor::empty({rows * 2 * chunk}, DType::kI32);
  int32_t* r = out.data<int32_t>();
  for (int64_t b = 0; b < rows; ++b)
    for (int64_t slot = 0; slot < 2; ++slot)
      for (int64_t i = 0; i < chunk; ++i)
        r[(2 * b + slot) * chunk + i] = static_cast<int32_t>(c.chunk_start(b, slot) + i);
  return out;
}

void attention_forward_rows(const Tensor& q, const ContextChunks& chunks, const Tensor& k,
                            const Tensor& v, const Documents& docs, double scale, Tensor& out,
                            Tensor& lse, const AttentionGpu& gpu) {
  const AttnDims d = check_rows(q, chunks, k, v, docs);
  expect_shape(out, {q.dim(0), d.h, d.dv}, "attention out");
  expect_shape(lse, {q.dim(0), d.h}, "attention lse");
#if MOETRAIN_HAS_CUDNN
  if (rows_on_gpu(q, v, lse, d))
    return cuda::cudnn_attention_forward_chunks(q, chunks, k, v, docs, scale, out, lse);
#else
  rows_on_gpu(q, v, lse, d);
#endif
  (void)gpu;
  const Tensor rows = context_parallel_rows(chunks, d.n / chunks.row_tokens);
  cpu::attention_forward_rows(q, rows.data<int32_t>(), k, v, docs, scale, out, lse);
}

void attention_backward_rows(const Tensor& q, const ContextChunks& chunks, const Tensor& k,
                             const Tensor& v, const Tensor& out, const Tensor& lse,
                             const Tensor& dout, const Documents& docs, double scale, Tensor& dq,
                             Tensor& dk, Tensor& dv, const AttentionGpu& gpu) {
  const AttnDims d = check_rows(q, chunks, k, v, docs);
  for (const auto& [t, name] :
       {std::pair{&out, "attention out"}, std::pair{&dout, "attention dout"}})
    expect_shape(*t, {q.dim(0), d.h, d.dv}, name);
  expect_shape(lse, {q.dim(0), d.h}, "attention lse");
  expect_shape(dq, q.shape(), "attention dq");
  expect_shape(dk, k.shape(), "attention dk");
  expect_shape(dv, v.shape(), "attention dv");
#if MOETRAIN_HAS_CUDNN
  if (rows_on_gpu(q, v, lse, d)) {
    // Each pass covers one chunk of every row: the two chunks' key ranges overlap where a document
    // crosses both, so the second chunk's key and value gradients land apart and are added.
    dk.zero_();
    dv.zero_();
    cuda::cudnn_attention_backward_chunks(q, chunks, k, v, out, lse, dout, docs, scale,
                                          gpu.backward, /*slot=*/0, dq, dk, dv,
                                          gpu.workspace_budget_bytes);
    Tensor dk_late = Tensor::zeros(dk.shape(), dk.dtype(), Device::kCUDA),
           dv_late = Tensor::zeros(dv.shape(), dv.dtype(), Device::kCUDA);
    cuda::cudnn_attention_backward_chunks(q, chunks, k, v, out, lse, dout, docs, scale,
                                          gpu.backward, /*slot=*/1, dq, dk_late, dv_late,
                                          gpu.workspace_budget_bytes);
    add_(dk, dk_late);
    add_(dv, dv_late);
    return;
  }
#else
  rows_on_gpu(q, v, lse, d);
#endif
  (void)gpu;
  const Tensor rows = context_parallel_rows(chunks, d.n / chunks.row_tokens);
  cpu::attention_backward_rows(q, rows.data<int32_t>(), k, v, out, lse, dout, docs, scale, dq, dk,
                               dv);
}

}  // namespace mt::ops
