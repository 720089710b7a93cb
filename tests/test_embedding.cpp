// The embedding (ops/embedding.h): the CPU reference (hand-checked cases, fp64 finite-difference
// gradients of L = sum(out * G) with a fixed random G) and, in the Gpu* cases (ctest label `gpu`),
// the CUDA kernels against it (tests/gpu_case.h).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <tuple>

#include "op_testing.h"
#include "ops/embedding.h"
#if MOETRAIN_HAS_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda/device.h"
#include "core/cuda/graph.h"
#include "gpu_case.h"
#endif

namespace mt {
namespace {

TEST(Embedding, ForwardGathersAndBackwardAccumulates) {
  Tensor table = randn({5, 3}, 1), ids = i32({4, 0, 4});
  Tensor out = Tensor::poisoned({3, 3}, DType::kF64);
  ops::embedding_forward(ids, table, out);
  for (int c = 0; c < 3; ++c) {
    EXPECT_EQ(out.item(c), table.item(12 + c));
    EXPECT_EQ(out.item(3 + c), table.item(c));
  }
  Tensor g = randn({3, 3}, 2);
  auto loss = [&] {
    ops::embedding_forward(ids, table, out);
    return dot(out, g);
  };
  Tensor dt = Tensor::zeros(table.shape(), DType::kF64);
  ops::embedding_backward(ids, g, dt);
  EXPECT_LT(gradcheck(loss, table, dt), kGradTol);
  EXPECT_THROW(ops::embedding_forward(i32({5, 0, 0}), table, out), Error);
}

#if MOETRAIN_HAS_CUDA

struct GpuEmbedding : GpuCase {};

TEST_P(GpuEmbedding, EmbeddingGatherAndDeterministicBackward) {
  const int64_t vocab = 1000, d = 64, n = 4096;
  Tensor ids = Tensor::empty({n}, DType::kI32);
  const CounterRng rng{seed, 3};
  for (int64_t i = 0; i < n; ++i) ids.set_item(i, rng.below(i, 97) * 7);  // repeats, gaps
  const Tensor table = input({vocab, d}), dout = input({n, d});
  Tensor out = Tensor::empty({n, d}, DType::kF32), dtable = input({vocab, d}, 0.1);
  const Tensor dtable0 = dtable.clone();
  ops::embedding_forward(ids, table, out);
  ops::embedding_backward(ids, dout, dtable);
  const Tensor gids = ids.to(Device::kCUDA);
  Tensor gout = gpu_out({n, d}), gdtable = gpu(dtable0);
  ops::embedding_forward(gids, gpu(table), gout);
  ops::embedding_backward(gids, gpu(dout), gdtable);
  expect_close(gout, out, "embedding forward");
  expect_close(gdtable, dtable, "embedding backward (accumulated)");
  Tensor again = gpu(dtable0);
  ops::embedding_backward(gids, gpu(dout), again);
  const Tensor a = again.to(Device::kCPU), b = gdtable.to(Device::kCPU);
  EXPECT_EQ(std::memcmp(a.raw(), b.raw(), a.nbytes()), 0) << "embedding backward not deterministic";
}

MOETRAIN_GPU_CASES(GpuEmbedding);

#endif  // MOETRAIN_HAS_CUDA

}  // namespace
}  // namespace mt
