// Dense GEMMs on the GPU through cuBLASLt: bf16 or f32 operands, fp32 accumulation, output f32
// or the operands' dtype. Row-major tensors are handed to column-major cuBLAS as their
// transposes: C (M, N) = op(a) op(b) is computed as C^T = op(b)^T op(a)^T.
#include "ops/cuda/gemm.h"

#include <cublasLt.h>

#include <mutex>

#include "core/cuda/check.h"

#define MT_CUBLAS_CHECK(expr)                                                                     \
  do {                                                                                            \
    const cublasStatus_t mt_st_ = (expr);                                                         \
    if (mt_st_ != CUBLAS_STATUS_SUCCESS)                                                          \
      throw ::mt::Error(::mt::ExitCode::kInternal,                                                \
                        fmt::format("cuBLAS error {} in {} at {}:{}",                             \
                                    cublasLtGetStatusString(mt_st_), #expr, __FILE__, __LINE__)); \
  } while (0)

namespace mt::cuda::kernels {

namespace {

constexpr size_t kWorkspaceBytes = 32u << 20;  // what cuBLASLt's Hopper kernels ask for at most

// One handle and workspace per process (one GPU per process), created on first use.
struct Lt {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  Lt() {
    MT_CUBLAS_CHECK(cublasLtCreate(&handle));
    MT_CUDA_CHECK(cudaMalloc(&workspace, kWorkspaceBytes));
  }
};
Lt& lt() {
  static Lt* instance = new Lt();  // never destroyed: the driver may be gone at exit
  return *instance;
}

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::kF32:
      return CUDA_R_32F;
    case DType::kBF16:
      return CUDA_R_16BF;
    default:
      MT_CHECK(false, "GPU gemm needs f32 or bf16, got {}", dtype_name(t));
  }
}

struct Layout {
  cublasLtMatrixLayout_t desc = nullptr;
  Layout(cudaDataType_t t, int64_t rows, int64_t cols, int64_t ld) {
    MT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&desc, t, rows, cols, ld));
  }
  ~Layout() { cublasLtMatrixLayoutDestroy(desc); }
};

}  // namespace

void gemm(DType in, const void* a, ops::Transpose op_of_a, const void* b, ops::Transpose op_of_b,
          DType out, const void* c, void* d, int64_t m, int64_t n, int64_t k, float beta,
          cudaStream_t stream) {
  const bool ta = op_of_a == ops::Transpose::kYes, tb = op_of_b == ops::Transpose::kYes;
  cublasLtMatmulDesc_t op = nullptr;
  MT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  // cuBLAS's A is our b, its B is our a (see the top of the file).
  const cublasOperation_t op_a = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  MT_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  MT_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  const cudaDataType_t in_type = cuda_type(in), out_type = cuda_type(out);
  const Layout la(in_type, tb ? k : n, tb ? n : k, tb ? k : n);
  const Layout lb(in_type, ta ? m : k, ta ? k : m, ta ? m : k);
  const Layout ld(out_type, n, m, n);
  cublasLtMatmulPreference_t pref = nullptr;
  MT_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const size_t ws = kWorkspaceBytes;
  MT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  cublasLtMatmulHeuristicResult_t heur{};
  int found = 0;
  MT_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(lt().handle, op, la.desc, lb.desc, ld.desc,
                                                 ld.desc, pref, 1, &heur, &found));
  MT_CHECK(found > 0, "cuBLASLt has no algorithm for {}x{}x{} ({})", m, n, k, dtype_name(in));
  const float alpha = 1.0f;
  MT_CUBLAS_CHECK(cublasLtMatmul(lt().handle, op, &alpha, b, la.desc, a, lb.desc, &beta, c, ld.desc,
                                 d, ld.desc, &heur.algo, lt().workspace, ws, stream));
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatmulDescDestroy(op);
}

}  // namespace mt::cuda::kernels
