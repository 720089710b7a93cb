// The CUDA kernels' launch API: raw pointers, sizes and a stream (DeepEP's habit), so that the
// .cu files need neither Tensor nor fmt. Each returns the launch's cudaError_t; the Tensor-level
// wrappers (ops.cpp) check shapes and dtypes and turn errors into mt::Error.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace mt::cuda::kernels {

enum class Storage { kF32, kBF16 };  // element type of activations; math is fp32

cudaError_t rmsnorm_forward(Storage s, const void* x, const void* w, float eps, void* y,
                            float* rstd, int64_t n, int64_t d, cudaStream_t stream);
// dx overwritten; dw accumulated through `partial` (chunks x d floats, chunks = rmsnorm_chunks(n)).
int rmsnorm_chunks(int64_t n);
cudaError_t rmsnorm_backward(Storage s, const void* x, const void* w, const float* rstd,
                             const void* dy, void* dx, void* dw, float* partial, int64_t n,
                             int64_t d, cudaStream_t stream);
cudaError_t rope(Storage s, const void* x, const int32_t* pos, double theta, int direction,
                 void* y, int64_t n, int64_t heads, int64_t head_dim, cudaStream_t stream);
cudaError_t swiglu_forward(Storage s, const void* h, void* a, int64_t m, int64_t f,
                           cudaStream_t stream);
cudaError_t swiglu_backward(Storage s, const void* h, const void* da, void* dh, int64_t m,
                            int64_t f, cudaStream_t stream);
// loss (n floats) receives each row's loss (0 where masked).
cudaError_t cross_entropy_forward(Storage s, const void* logits, const int32_t* targets,
                                  const uint8_t* mask, float* lse, float* loss, int64_t n,
                                  int64_t v, cudaStream_t stream);
cudaError_t cross_entropy_backward(Storage s, const void* logits, const int32_t* targets,
                                   const uint8_t* mask, const float* lse, float scale,
                                   void* dlogits, int64_t n, int64_t v, cudaStream_t stream);
// Grouped GEMM over experts, bf16 operands, offsets i64 (experts + 1) on the device.
// out (m, n) rows of expert e = a rows (k wide) @ w[e]; w[e] is (k, n) row-major, or with
// b_transposed (n, k) row-major used as its transpose. out is f32 or bf16 (out_f32).
cudaError_t grouped_gemm_rows(const void* a, const void* w, const int64_t* offsets, int experts,
                              int64_t m, int64_t k, int64_t n, bool b_transposed, void* out,
                              bool out_f32, cudaStream_t stream);
// dw[e] (k, n) += x_e^T dy_e over the expert's rows; experts without rows are left alone.
cudaError_t grouped_gemm_weight(const void* x, const void* dy, const int64_t* offsets, int experts,
                                int64_t k, int64_t n, void* dw, bool out_f32, cudaStream_t stream);

// The same three products through CUTLASS's Hopper grouped kernels (TMA + wgmma), all group
// arguments built on the device from the offsets. lhs/rhs/out as the products' comments in
// cutlass/grouped_gemm_sm90.cuh; out is bf16 (forward, input gradient) or f32 (weight gradient,
// accumulated). workspace: device memory of at least *_workspace(experts) bytes.
#if MOETRAIN_HAS_CUTLASS
size_t cutlass_grouped_forward_workspace(int experts);
size_t cutlass_grouped_input_gradient_workspace(int experts);
size_t cutlass_grouped_weight_gradient_workspace(int experts);
cudaError_t cutlass_grouped_forward(const int64_t* offsets, int experts, const void* lhs,
                                    const void* rhs, void* out, int64_t m, int64_t k, int64_t n,
                                    void* workspace, size_t workspace_size, cudaStream_t stream);
cudaError_t cutlass_grouped_input_gradient(const int64_t* offsets, int experts, const void* lhs,
                                           const void* rhs, void* out, int64_t m, int64_t k,
                                           int64_t n, void* workspace, size_t workspace_size,
                                           cudaStream_t stream);
cudaError_t cutlass_grouped_weight_gradient(const int64_t* offsets, int experts, const void* lhs,
                                            const void* rhs, void* out, int64_t m, int64_t k,
                                            int64_t n, void* workspace, size_t workspace_size,
                                            cudaStream_t stream);
#endif

struct AdamWScalars {
  float beta1, beta2, decay, step_size, sqrt_bc2, eps;
};
cudaError_t adamw(float* p, const float* g, float* m, float* v, AdamWScalars s, int64_t n,
                  cudaStream_t stream);

}  // namespace mt::cuda::kernels
