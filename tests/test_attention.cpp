// Attention over packed documents (ops/attention.h): the CPU reference (hand-checked cases, fp64
// finite-difference gradients of L = sum(out * G) with a fixed random G) and, in the Gpu* cases
// (ctest label `gpu`), the CUDA kernels against it (tests/gpu_case.h).
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
#include "ops/attention.h"
#if MOETRAIN_HAS_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda/device.h"
#include "core/cuda/graph.h"
#include "gpu_case.h"
#endif

namespace mt {
namespace {

struct AttnCase {
  Tensor q, k, v;
  ops::Documents docs;
  double scale;
};

AttnCase attn_case() {
  // 3 documents (lengths 3, 1, 4), 4 query heads over 2 kv heads, Dqk 8 != Dv 6.
  return {randn({8, 4, 8}, 1, 0.7),
          randn({8, 2, 8}, 2, 0.7),
          randn({8, 2, 6}, 3),
          {i32({0, 3, 4, 8}), 4},
          1.0 / std::sqrt(8.0)};
}

TEST(Attention, SingleTokenDocumentCopiesItsValue) {
  AttnCase c = attn_case();
  Tensor out = Tensor::poisoned({8, 4, 6}, DType::kF64),
         lse = Tensor::poisoned({8, 4}, DType::kF64);
  ops::attention_forward(c.q, c.k, c.v, c.docs, c.scale, out, lse);
  EXPECT_TRUE(all_finite(out) && all_finite(lse));
  for (int h = 0; h < 4; ++h) {
    const int g = h / 2;
    for (int d = 0; d < 6; ++d)
      EXPECT_NEAR(out.item((3 * 4 + h) * 6 + d), c.v.item((3 * 2 + g) * 6 + d), 1e-14);
    double s = 0;
    for (int d = 0; d < 8; ++d) s += c.q.item((3 * 4 + h) * 8 + d) * c.k.item((3 * 2 + g) * 8 + d);
    EXPECT_NEAR(lse.item(3 * 4 + h), s * c.scale, 1e-14);
  }
}

TEST(Attention, MatchesDenseSoftmaxAndIsolatesDocuments) {
  AttnCase c = attn_case();
  Tensor out = Tensor::poisoned({8, 4, 6}, DType::kF64),
         lse = Tensor::poisoned({8, 4}, DType::kF64);
  ops::attention_forward(c.q, c.k, c.v, c.docs, c.scale, out, lse);
  // Token 6 (document 2 = tokens 4..7), head 3 -> kv head 1: explicit softmax over tokens 4..6.
  double w[3], z = 0;
  for (int j = 4; j <= 6; ++j) {
    double s = 0;
    for (int d = 0; d < 8; ++d) s += c.q.item((6 * 4 + 3) * 8 + d) * c.k.item((j * 2 + 1) * 8 + d);
    z += (w[j - 4] = std::exp(s * c.scale));
  }
  for (int d = 0; d < 6; ++d) {
    double ref = 0;
    for (int j = 4; j <= 6; ++j) ref += w[j - 4] / z * c.v.item((j * 2 + 1) * 6 + d);
    EXPECT_NEAR(out.item((6 * 4 + 3) * 6 + d), ref, 1e-13);
  }
  EXPECT_NEAR(lse.item(6 * 4 + 3), std::log(z), 1e-13);
  // Changing a later document's keys leaves earlier documents alone.
  Tensor out2 = like(out);
  c.k.set_item((5 * 2 + 0) * 8, 10.0);
  ops::attention_forward(c.q, c.k, c.v, c.docs, c.scale, out2, lse);
  for (int64_t i = 0; i < 4 * 4 * 6; ++i) EXPECT_EQ(out.item(i), out2.item(i));
}

TEST(Attention, Gradients) {
  AttnCase c = attn_case();
  Tensor g = randn({8, 4, 6}, 4);
  Tensor out = Tensor::poisoned({8, 4, 6}, DType::kF64),
         lse = Tensor::poisoned({8, 4}, DType::kF64);
  auto loss = [&] {
    ops::attention_forward(c.q, c.k, c.v, c.docs, c.scale, out, lse);
    return dot(out, g);
  };
  loss();
  Tensor dq = like(c.q), dk = like(c.k), dv = like(c.v);
  ops::attention_backward(c.q, c.k, c.v, out, lse, g, c.docs, c.scale, dq, dk, dv);
  EXPECT_LT(gradcheck(loss, c.q, dq), kGradTol);
  EXPECT_LT(gradcheck(loss, c.k, dk), kGradTol);
  EXPECT_LT(gradcheck(loss, c.v, dv), kGradTol);
}

// Context parallelism's chunks: rank r holds chunks r and 2 cp - 1 - r of 2 cp; together the
// ranks hold the row once, and over one document every rank's causal work is the same.
TEST(ContextParallel, RanksPairAHeadChunkWithATailChunk) {
  const int64_t n = 24, cp = 3;
  std::vector<int> seen(n, 0);
  for (int64_t r = 0; r < cp; ++r) {
    const Tensor rows = ops::context_parallel_rows({n, cp, r});
    ASSERT_EQ(rows.numel(), n / cp);
    const int32_t* p = rows.data<int32_t>();
    EXPECT_EQ(p[0], r * 4);                 // chunk r
    EXPECT_EQ(p[4], (2 * cp - 1 - r) * 4);  // chunk 2 cp - 1 - r
    int64_t work = 0;                       // keys each query attends to, causal over one document
    for (int64_t a = 0; a < rows.numel(); ++a) {
      ++seen[p[a]];
      work += p[a] + 1;
      if (a > 0) {
        EXPECT_GT(p[a], p[a - 1]);
      }
    }
    EXPECT_EQ(work, 100) << "rank " << r;  // (1 + ... + 24) / 3
  }
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(seen[i], 1) << "position " << i;
  const std::string odd = testing::error_of([] { ops::context_parallel_rows({30, 4, 0}); });
  EXPECT_NE(odd.find("train.seq_len must be a multiple of 8"), std::string::npos) << odd;
  // Two rows: each row's chunks in turn, the second row's shifted by its length.
  const Tensor two = ops::context_parallel_rows({n, cp, 1}, 2),
               one = ops::context_parallel_rows({n, cp, 1});
  ASSERT_EQ(two.numel(), 2 * one.numel());
  for (int64_t a = 0; a < one.numel(); ++a) {
    EXPECT_EQ(two.item(a), one.item(a));
    EXPECT_EQ(two.item(one.numel() + a), one.item(a) + n);
  }
}

// The CP ranks' attention against the gathered keys and values gives the whole row's: each
// rank's outputs, log-sum-exps and query gradients are the row's at its positions, and the key
// and value gradients summed over the ranks (the reduce-scatter) are the row's, with documents
// crossing chunk boundaries.
TEST(ContextParallel, RanksTogetherComputeTheWholeRowsAttention) {
  const int64_t n = 48, h = 4, kv = 2, dqk = 8, dvw = 6;
  const Tensor q = randn({n, h, dqk}, 11, 0.7), k = randn({n, kv, dqk}, 12, 0.7),
               v = randn({n, kv, dvw}, 13), dout = randn({n, h, dvw}, 14);
  const ops::Documents docs{i32({0, 5, 19, 30, 48}), 18};
  const double scale = 1.0 / std::sqrt(8.0);
  Tensor out = Tensor::poisoned({n, h, dvw}, DType::kF64),
         lse = Tensor::poisoned({n, h}, DType::kF64);
  ops::attention_forward(q, k, v, docs, scale, out, lse);
  Tensor dq = like(q), dk = like(k), dv = like(v);
  ops::attention_backward(q, k, v, out, lse, dout, docs, scale, dq, dk, dv);
  for (int64_t cp : {2, 3, 4}) {
    Tensor dk_sum = Tensor::zeros(k.shape(), DType::kF64),
           dv_sum = Tensor::zeros(v.shape(), DType::kF64);
    for (int64_t r = 0; r < cp; ++r) {
      const ops::ContextChunks chunks{n, cp, r};
      const Tensor rows = ops::context_parallel_rows(chunks);
      const int64_t nq = rows.numel();
      auto take = [&](const Tensor& t) {  // the rank's positions of a whole-row tensor
        const int64_t w = t.numel() / n;
        Tensor out_rows = t.ndim() == 3 ? Tensor::empty({nq, t.dim(1), t.dim(2)}, DType::kF64)
                                        : Tensor::empty({nq, t.dim(1)}, DType::kF64);
        for (int64_t a = 0; a < nq; ++a)
          for (int64_t c = 0; c < w; ++c)
            out_rows.set_item(a * w + c, t.item(rows.data<int32_t>()[a] * w + c));
        return out_rows;
      };
      const Tensor qr = take(q), dout_r = take(dout);
      Tensor o = Tensor::poisoned({nq, h, dvw}, DType::kF64),
             l = Tensor::poisoned({nq, h}, DType::kF64);
      ops::attention_forward_rows(qr, chunks, k, v, docs, scale, o, l);
      EXPECT_LT(relative_error(o, take(out)), 1e-13) << "cp " << cp << " rank " << r;
      EXPECT_LT(relative_error(l, take(lse)), 1e-13) << "cp " << cp << " rank " << r;
      Tensor dqr = Tensor::poisoned(qr.shape(), DType::kF64),
             dkr = Tensor::poisoned(k.shape(), DType::kF64),
             dvr = Tensor::poisoned(v.shape(), DType::kF64);
      ops::attention_backward_rows(qr, chunks, k, v, o, l, dout_r, docs, scale, dqr, dkr, dvr);
      EXPECT_LT(relative_error(dqr, take(dq)), 1e-12) << "cp " << cp << " rank " << r;
      for (int64_t i = 0; i < dk.numel(); ++i) dk_sum.set_item(i, dk_sum.item(i) + dkr.item(i));
      for (int64_t i = 0; i < dv.numel(); ++i) dv_sum.set_item(i, dv_sum.item(i) + dvr.item(i));
    }
    EXPECT_LT(relative_error(dk_sum, dk), 1e-12) << "cp " << cp;
    EXPECT_LT(relative_error(dv_sum, dv), 1e-12) << "cp " << cp;
  }
}

TEST(ContextParallel, RowsGradients) {
  const int64_t n = 16, h = 4, kv = 2;
  Tensor k = randn({n, kv, 8}, 21, 0.7), v = randn({n, kv, 6}, 22);
  const ops::Documents docs{i32({0, 3, 11, 16}), 8};
  const ops::ContextChunks chunks{n, 2, 1};  // chunks 1 and 2: positions 4..11
  const int64_t nq = n / 2;
  Tensor q = randn({nq, h, 8}, 23, 0.7), g = randn({nq, h, 6}, 24);
  const double scale = 1.0 / std::sqrt(8.0);
  Tensor out = Tensor::poisoned({nq, h, 6}, DType::kF64),
         lse = Tensor::poisoned({nq, h}, DType::kF64);
  auto loss = [&] {
    ops::attention_forward_rows(q, chunks, k, v, docs, scale, out, lse);
    return dot(out, g);
  };
  loss();
  Tensor dq = like(q), dk = like(k), dv = like(v);
  ops::attention_backward_rows(q, chunks, k, v, out, lse, g, docs, scale, dq, dk, dv);
  EXPECT_LT(gradcheck(loss, q, dq), kGradTol);
  EXPECT_LT(gradcheck(loss, k, dk), kGradTol);
  EXPECT_LT(gradcheck(loss, v, dv), kGradTol);
  // A rank's queries are a cp-th of whole rows.
  const std::string partial = testing::error_of([&] {
    ops::attention_forward_rows(q, {12, 2, 1}, k, v, docs, scale, out, lse);
  });
  EXPECT_NE(partial.find("context-parallel rank 1 of 2 with rows of 12: 8 queries against 16 keys"),
            std::string::npos)
      << partial;
}
TEST(Attention, PlannedDocumentsRoundUpToPowersOfTwoWithinTheTokens) {
  const ops::PlannedDocuments a = ops::planned_documents(5, 300, 4096);
  EXPECT_EQ(a.count, 8);
  EXPECT_EQ(a.longest, 512);
  const ops::PlannedDocuments b = ops::planned_documents(1, 3, 40);  // floor 64, cut at 40
  EXPECT_EQ(b.count, 1);
  EXPECT_EQ(b.longest, 40);
  const ops::PlannedDocuments c = ops::planned_documents(16, 4096, 16384);  // already powers
  EXPECT_EQ(c.count, 16);
  EXPECT_EQ(c.longest, 4096);
}

// The backward's split: a quarter of the planned longest (700 plans at 1024: 256), the documents
// past it counted from host boundaries (300 and 700; 256 itself is not past it), their planned
// count a power of two.
TEST(Attention, LongDocumentsAreThosePastAQuarterOfThePlannedLongest) {
  EXPECT_EQ(ops::long_document_threshold(700, 4096), 256);
  EXPECT_EQ(ops::long_document_threshold(4096, 16384), 1024);
  EXPECT_EQ(ops::long_document_threshold(3, 40), 10);  // the plan's longest is cut at the tokens
  Tensor cu = Tensor::empty({7}, DType::kI32);
  const int32_t bounds[] = {0, 300, 301, 358, 1058, 1314, 1400};  // 300, 1, 57, 700, 256, 86
  for (int i = 0; i < 7; ++i) cu.set_item(i, bounds[i]);
  EXPECT_EQ(ops::count_long_documents(cu, ops::max_document_length(cu)), 2);
  EXPECT_EQ(ops::planned_long_documents(-1), -1);
  EXPECT_EQ(ops::planned_long_documents(0), 0);
  EXPECT_EQ(ops::planned_long_documents(3), 4);
  EXPECT_EQ(ops::planned_long_documents(4), 4);
}

TEST(Attention, LongestDocumentIsCheckedAndComputed) {
  AttnCase c = attn_case();
  EXPECT_EQ(ops::max_document_length(c.docs.cu_seqlens), 4);
  Tensor out = Tensor::poisoned({8, 4, 6}, DType::kF64),
         lse = Tensor::poisoned({8, 4}, DType::kF64);
  c.docs.max_length = 3;  // understated: the GPU would size its grid too small
  EXPECT_THROW(ops::attention_forward(c.q, c.k, c.v, c.docs, c.scale, out, lse), Error);
}

#if MOETRAIN_HAS_CUDA

struct GpuAttention : GpuCase {};

TEST_P(GpuAttention, AttentionPackedCausalGqa) {
  // Documents of 300, 1, 57 and 700 tokens; 8 query heads over 2 kv heads; Dqk 64, Dv 32.
  const std::vector<int32_t> cu = {0, 300, 301, 358, 1058};
  const int64_t n = 1058, h = 8, kv = 2, dqk = 64, dv = 32;
  Tensor cus = Tensor::empty({5}, DType::kI32);
  for (int i = 0; i < 5; ++i) cus.set_item(i, cu[i]);
  const Tensor q = input({n, h, dqk}), k = input({n, kv, dqk}), v = input({n, kv, dv});
  const Tensor dout = input({n, h, dv});
  const double scale = 1.0 / std::sqrt(static_cast<double>(dqk));
  Tensor out = Tensor::empty({n, h, dv}, DType::kF32), lse = Tensor::empty({n, h}, DType::kF32);
  ops::attention_forward(q, k, v, {cus, 700}, scale, out, lse);
  Tensor dq = Tensor::empty(q.shape(), DType::kF32), dk = Tensor::empty(k.shape(), DType::kF32);
  Tensor dvv = Tensor::empty(v.shape(), DType::kF32);
  ops::attention_backward(q, k, v, out, lse, dout, {cus, 700}, scale, dq, dk, dvv);

  const Tensor gq = gpu(q), gk = gpu(k), gv = gpu(v);
  const ops::Documents gcu{cus.to(Device::kCUDA), 700};
  Tensor gout = gpu_out({n, h, dv}), glse = gpu_out({n, h}, DType::kF32);
  ops::attention_forward(gq, gk, gv, gcu, scale, gout, glse);
  expect_close(gout, out, "attention out");
  expect_close(glse, lse, "attention lse");
  Tensor gdq = gpu_out(q.shape()), gdk = gpu_out(k.shape()), gdv = gpu_out(v.shape());
  // The backward reads the GPU's own forward output, as training does.
  ops::attention_backward(gq, gk, gv, gout, glse, gpu(dout), gcu, scale, gdq, gdk, gdv);
  expect_close(gdq, dq, "attention dq");
  expect_close(gdk, dk, "attention dk");
  expect_close(gdv, dvv, "attention dv");
}

// bf16 values (held in f32) for q, k, v and dout over the packed documents `cus`, and the CPU
// reference's attention of them (f32): what the cuDNN cases compare against.
struct CudnnCase {
  ops::Documents docs;
  Tensor q, k, v, dout, out, lse, dq, dk, dv;
};
CudnnCase cudnn_case(const Tensor& cus, int64_t h, int64_t kv, int64_t d, double scale,
                     uint64_t seed) {
  const int64_t n = cus.item(cus.numel() - 1);
  const auto bf16_values = [&](const Shape& s, uint64_t stream) {
    return testing::randn(s, seed + stream, 1.0, DType::kF32).to(DType::kBF16).to(DType::kF32);
  };
  CudnnCase c{{cus, ops::max_document_length(cus)},
              bf16_values({n, h, d}, 1),
              bf16_values({n, kv, d}, 2),
              bf16_values({n, kv, d}, 3),
              bf16_values({n, h, d}, 4),
              Tensor::empty({n, h, d}, DType::kF32),
              Tensor::empty({n, h}, DType::kF32),
              Tensor::empty({n, h, d}, DType::kF32),
              Tensor::empty({n, kv, d}, DType::kF32),
              Tensor::empty({n, kv, d}, DType::kF32)};
  ops::attention_forward(c.q, c.k, c.v, c.docs, scale, c.out, c.lse);
  ops::attention_backward(c.q, c.k, c.v, c.out, c.lse, c.dout, c.docs, scale, c.dq, c.dk, c.dv);
  return c;
}

// cuDNN's fused SDPA at Qwen3's head shape against the CPU reference (bf16 inputs, fp32 math):
// five documents (padded to eight empty-tailed ones inside) including a one-token document,
// then a second packing that builds another graph. Deterministic backward repeats bit for bit, and
// gives the same bits run over groups of heads.
TEST(GpuCudnnAttention, MatchesReferenceOnPackedDocuments) {
  if (cuda::device_count() == 0) GTEST_FAIL() << "no GPU: run this test on the GPU machine";
  const ops::AttentionGpu kCudnn{ops::AttentionKernel::kCudnn};
  // A zero workspace budget: as many head groups as there are KV heads.
  const ops::AttentionGpu kCudnnSplit{ops::AttentionKernel::kCudnn,
                                      ops::Determinism::kDeterministic, 0};
  const ops::AttentionGpu kCudnnFast{ops::AttentionKernel::kCudnn, ops::Determinism::kFast};
  if (!ops::cudnn_attention_available()) GTEST_FAIL() << "built without the cuDNN frontend";
  const uint64_t seed = fresh_seed();
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  const int64_t h = 16, kv = 2, d = 128;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  // One long document beside 40 short ones: the backward plans the long one apart.
  std::vector<int32_t> one_long = {0, 700};
  for (int i = 1; i <= 40; ++i) one_long.push_back(700 + 10 * i - (i % 3));
  for (const std::vector<int32_t>& cu : {std::vector<int32_t>{0, 300, 301, 358, 1058, 1100},
                                         std::vector<int32_t>{0, 1024, 1100}, one_long}) {
    const int64_t docs = static_cast<int64_t>(cu.size()) - 1;
    Tensor cus = Tensor::empty({docs + 1}, DType::kI32);
    for (int64_t i = 0; i <= docs; ++i) cus.set_item(i, cu[i]);
    const CudnnCase ref = cudnn_case(cus, h, kv, d, scale, seed);
    const ops::Documents& host_docs = ref.docs;
    const Tensor &q = ref.q, &k = ref.k, &v = ref.v, &dout = ref.dout, &out = ref.out,
                 &lse = ref.lse, &dq = ref.dq, &dk = ref.dk, &dv = ref.dv;

    const auto dev = [](const Tensor& t) { return t.to(DType::kBF16).to(Device::kCUDA); };
    const auto poisoned = [](const Shape& s, DType t) {
      return Tensor::poisoned(s, t, Device::kCUDA);
    };
    const ops::Documents docs_gpu{cus.to(Device::kCUDA), host_docs.max_length};
    const Tensor gq = dev(q), gk = dev(k), gv = dev(v), gdout = dev(dout);
    Tensor gout = poisoned(out.shape(), DType::kBF16), glse = poisoned(lse.shape(), DType::kF32);
    ops::attention_forward(gq, gk, gv, docs_gpu, scale, gout, glse, kCudnn);
    const auto close = [&](const Tensor& got, const Tensor& ref, double tol, const char* what) {
      const Tensor host = got.to(Device::kCPU).to(DType::kF32);
      ASSERT_TRUE(all_finite(host)) << what << ": unwritten (NaN) or non-finite";
      EXPECT_LT(relative_error(host, ref), tol) << what << ", " << docs << " documents";
    };
    close(gout, out, 1e-2, "cudnn out");
    close(glse, lse, 1e-4, "cudnn lse");
    Tensor grad[2][3];
    for (Tensor* g : grad) {
      g[0] = poisoned(q.shape(), DType::kBF16);
      g[1] = poisoned(k.shape(), DType::kBF16);
      g[2] = poisoned(v.shape(), DType::kBF16);
      ops::attention_backward(gq, gk, gv, gout, glse, gdout, docs_gpu, scale, g[0], g[1], g[2],
                              kCudnn);
    }
    close(grad[0][0], dq, 2e-2, "cudnn dq");
    close(grad[0][1], dk, 2e-2, "cudnn dk");
    close(grad[0][2], dv, 2e-2, "cudnn dv");
    // Split by KV-head groups (a zero workspace budget: as many groups as there are KV heads):
    // every head's sums keep their order, so the gradients are the same bit for bit.
    Tensor split[3] = {poisoned(q.shape(), DType::kBF16), poisoned(k.shape(), DType::kBF16),
                       poisoned(v.shape(), DType::kBF16)};
    ops::attention_backward(gq, gk, gv, gout, glse, gdout, docs_gpu, scale, split[0], split[1],
                            split[2], kCudnnSplit);
    for (int i = 0; i < 3; ++i) {
      const Tensor a = grad[0][i].to(Device::kCPU), b = grad[1][i].to(Device::kCPU),
                   c = split[i].to(Device::kCPU);
      EXPECT_EQ(std::memcmp(a.raw(), b.raw(), a.nbytes()), 0) << "deterministic backward " << i;
      EXPECT_EQ(std::memcmp(a.raw(), c.raw(), a.nbytes()), 0) << "backward by head groups " << i;
    }
    Tensor fast[3] = {poisoned(q.shape(), DType::kBF16), poisoned(k.shape(), DType::kBF16),
                      poisoned(v.shape(), DType::kBF16)};
    ops::attention_backward(gq, gk, gv, gout, glse, gdout, docs_gpu, scale, fast[0], fast[1],
                            fast[2], kCudnnFast);
    close(fast[0], dq, 2e-2, "cudnn dq (non-deterministic)");
    close(fast[1], dk, 2e-2, "cudnn dk (non-deterministic)");
    close(fast[2], dv, 2e-2, "cudnn dv (non-deterministic)");
    // The long documents planned apart from the rest (their count known, as the loader gives
    // it): the reference's gradients, deterministic, and the same split by head groups.
    ops::Documents counted = docs_gpu;
    counted.long_count = ops::count_long_documents(cus, host_docs.max_length);
    Tensor apart[3][3];
    for (int r = 0; r < 3; ++r) {
      for (int i = 0; i < 3; ++i)
        apart[r][i] = poisoned(i == 0 ? q.shape() : k.shape(), DType::kBF16);
      ops::attention_backward(gq, gk, gv, gout, glse, gdout, counted, scale, apart[r][0],
                              apart[r][1], apart[r][2], r == 2 ? kCudnnSplit : kCudnn);
    }
    close(apart[0][0], dq, 2e-2, "cudnn dq (long documents apart)");
    close(apart[0][1], dk, 2e-2, "cudnn dk (long documents apart)");
    close(apart[0][2], dv, 2e-2, "cudnn dv (long documents apart)");
    for (int i = 0; i < 3; ++i) {
      const Tensor a = apart[0][i].to(Device::kCPU), b = apart[1][i].to(Device::kCPU),
                   c = apart[2][i].to(Device::kCPU);
      EXPECT_EQ(std::memcmp(a.raw(), b.raw(), a.nbytes()), 0) << "apart, deterministic " << i;
      EXPECT_EQ(std::memcmp(a.raw(), c.raw(), a.nbytes()), 0) << "apart, by head groups " << i;
    }
  }
}

// A context-parallel rank's attention through cuDNN, the cp ranks of one group emulated in one
// process: two rows of 512 tokens at Qwen3's head shape, documents crossing chunk and row-half
// boundaries (cu 0, 100, 400, 512 | 512, 1024). Each rank's output, LSE and dQ against the whole
// rows' CPU attention at its positions, its dK/dV share against the CPU reference of its rows, and
// the shares summed over the ranks against the rows' dK/dV (bf16 tolerances); the backward repeats
// bit for bit, and a captured forward + backward replays to the same bits.
TEST(GpuCudnnAttention, ContextParallelRanksMatchTheWholeRows) {
  if (cuda::device_count() == 0) GTEST_FAIL() << "no GPU: run this test on the GPU machine";
  if (!ops::cudnn_attention_available()) GTEST_FAIL() << "built without the cuDNN frontend";
  const uint64_t seed = fresh_seed();
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  const int64_t row = 512, n = 2 * row, h = 16, kv = 2, d = 128;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const Tensor cus = i32({0, 100, 400, 512, 1024});
  const CudnnCase ref = cudnn_case(cus, h, kv, d, scale, seed);
  ASSERT_EQ(ref.q.dim(0), n);
  const ops::Documents& host_docs = ref.docs;
  const Tensor &q = ref.q, &k = ref.k, &v = ref.v, &dout = ref.dout, &out = ref.out, &lse = ref.lse,
               &dq = ref.dq, &dk = ref.dk, &dv = ref.dv;
  const auto dev = [](const Tensor& t) { return t.to(DType::kBF16).to(Device::kCUDA); };
  const auto poisoned = [](const Shape& shape, DType t) {
    return Tensor::poisoned(shape, t, Device::kCUDA);
  };
  const auto host = [](const Tensor& t) { return t.to(Device::kCPU).to(DType::kF32); };
  const auto close = [&](const Tensor& got, const Tensor& ref, double tol,
                         const std::string& what) {
    const Tensor mine = host(got);
    ASSERT_TRUE(all_finite(mine)) << what << ": unwritten (NaN) or non-finite";
    EXPECT_LT(relative_error(mine, ref), tol) << what;
  };
  const ops::Documents docs_gpu{cus.to(Device::kCUDA), host_docs.max_length};
  const Tensor gk = dev(k), gv = dev(v);
  for (const int64_t cp : {2, 4}) {
    Tensor dk_sum = Tensor::zeros(k.shape(), DType::kF32),
           dv_sum = Tensor::zeros(v.shape(), DType::kF32);
    for (int64_t r = 0; r < cp; ++r) {
      const std::string at = fmt::format("cp {} rank {}", cp, r);
      const ops::ContextChunks chunks{row, cp, r};
      const Tensor rows = ops::context_parallel_rows(chunks, 2);
      const int64_t nq = rows.numel();
      auto take = [&](const Tensor& t) {  // the rank's positions of a whole-rows tensor
        const int64_t w = t.numel() / n;
        Shape shape = t.shape();
        shape[0] = nq;
        Tensor picked = Tensor::empty(shape, DType::kF32);
        for (int64_t a = 0; a < nq; ++a)
          for (int64_t c = 0; c < w; ++c)
            picked.set_item(a * w + c, t.item(rows.data<int32_t>()[a] * w + c));
        return picked;
      };
      const Tensor qr = take(q), dout_r = take(dout);
      // The CPU reference of this rank's share of dK and dV.
      Tensor dq_cpu = Tensor::empty(qr.shape(), DType::kF32),
             dk_cpu = Tensor::empty(k.shape(), DType::kF32),
             dv_cpu = Tensor::empty(v.shape(), DType::kF32);
      ops::attention_backward_rows(qr, chunks, k, v, take(out), take(lse), dout_r, host_docs, scale,
                                   dq_cpu, dk_cpu, dv_cpu);
      const Tensor gq = dev(qr), gdout = dev(dout_r);
      Tensor gout = poisoned({nq, h, d}, DType::kBF16), glse = poisoned({nq, h}, DType::kF32);
      ops::attention_forward_rows(gq, chunks, gk, gv, docs_gpu, scale, gout, glse);
      close(gout, take(out), 1e-2, "out, " + at);
      close(glse, take(lse), 1e-4, "lse, " + at);
      Tensor grad[2][3];
      for (Tensor* g : grad) {
        g[0] = poisoned(qr.shape(), DType::kBF16);
        g[1] = poisoned(k.shape(), DType::kBF16);
        g[2] = poisoned(v.shape(), DType::kBF16);
        ops::attention_backward_rows(gq, chunks, gk, gv, gout, glse, gdout, docs_gpu, scale, g[0],
                                     g[1], g[2]);
      }
      close(grad[0][0], take(dq), 2e-2, "dq, " + at);
      close(grad[0][1], dk_cpu, 2e-2, "dk share, " + at);
      close(grad[0][2], dv_cpu, 2e-2, "dv share, " + at);
      for (int i = 0; i < 3; ++i) {
        const Tensor a = grad[0][i].to(Device::kCPU), b = grad[1][i].to(Device::kCPU);
        EXPECT_EQ(std::memcmp(a.raw(), b.raw(), a.nbytes()), 0)
            << "deterministic " << i << ", " << at;
      }
      const Tensor share_k = host(grad[0][1]), share_v = host(grad[0][2]);
      for (int64_t i = 0; i < dk_sum.numel(); ++i)
        dk_sum.set_item(i, dk_sum.item(i) + share_k.item(i));
      for (int64_t i = 0; i < dv_sum.numel(); ++i)
        dv_sum.set_item(i, dv_sum.item(i) + share_v.item(i));
      // Captured: the same bits as eager.
      Tensor cap_out = poisoned({nq, h, d}, DType::kBF16), cap_lse = poisoned({nq, h}, DType::kF32);
      Tensor cap[3] = {poisoned(qr.shape(), DType::kBF16), poisoned(k.shape(), DType::kBF16),
                       poisoned(v.shape(), DType::kBF16)};
      cuda::CapturedWork work;
      auto body = [&] {
        ops::attention_forward_rows(gq, chunks, gk, gv, docs_gpu, scale, cap_out, cap_lse);
        ops::attention_backward_rows(gq, chunks, gk, gv, cap_out, cap_lse, gdout, docs_gpu, scale,
                                     cap[0], cap[1], cap[2]);
      };
      EXPECT_FALSE(work.run(body, "the context-parallel attention"));
      for (Tensor* t : {&cap_out, &cap_lse, &cap[0], &cap[1], &cap[2]}) t->fill_(std::nan(""));
      EXPECT_TRUE(work.run(body, "the context-parallel attention"));
      const std::pair<const Tensor*, const Tensor*> same[] = {{&cap_out, &gout},
                                                              {&cap_lse, &glse},
                                                              {&cap[0], &grad[0][0]},
                                                              {&cap[1], &grad[0][1]},
                                                              {&cap[2], &grad[0][2]}};
      for (const auto& [a_dev, b_dev] : same) {
        const Tensor a = a_dev->to(Device::kCPU), b = b_dev->to(Device::kCPU);
        EXPECT_EQ(std::memcmp(a.raw(), b.raw(), a.nbytes()), 0) << "replay, " << at;
      }
    }
    EXPECT_LT(relative_error(dk_sum, dk), 2e-2) << "summed dk, cp " << cp;
    EXPECT_LT(relative_error(dv_sum, dv), 2e-2) << "summed dv, cp " << cp;
  }
}

MOETRAIN_GPU_CASES(GpuAttention);

#endif  // MOETRAIN_HAS_CUDA

}  // namespace
}  // namespace mt
