// Reference attention: one (document, head) at a time, double accumulation, probabilities
// recomputed in backward from the saved log-sum-exp.
#include "ops/attention.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include "ops/dispatch.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/ops.h"
#endif

namespace mt::ops {

namespace {

struct AttnDims {
  int64_t n, h, kv, dqk, dv, docs;
};

AttnDims check_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Documents& docs) {
  const Tensor& cu_seqlens = docs.cu_seqlens;
  MT_CHECK(q.ndim() == 3 && k.ndim() == 3 && v.ndim() == 3, "attention needs (N, heads, dim)");
  AttnDims d{q.dim(0), q.dim(1), k.dim(1), q.dim(2), v.dim(2), cu_seqlens.numel() - 1};
  expect_shape(k, {d.n, d.kv, d.dqk}, "attention k");
  expect_shape(v, {d.n, d.kv, d.dv}, "attention v");
  MT_CHECK(d.kv > 0 && d.h % d.kv == 0, "query heads {} not a multiple of kv heads {}", d.h, d.kv);
  expect_dtype(cu_seqlens, DType::kI32, "cu_seqlens");
  const int32_t* cu = cu_seqlens.data<int32_t>();
  MT_CHECK(d.docs >= 1 && cu[0] == 0 && cu[d.docs] == d.n, "cu_seqlens must run from 0 to {}", d.n);
  for (int64_t s = 0; s < d.docs; ++s) {
    MT_CHECK(cu[s] <= cu[s + 1], "cu_seqlens decreases at {}", s);
    MT_CHECK(cu[s + 1] - cu[s] <= docs.max_length,
             "document {} has {} tokens, more than the "
             "stated longest {}",
             s, cu[s + 1] - cu[s], docs.max_length);
  }
  return d;
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

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Documents& docs,
                       double scale, Tensor& out, Tensor& lse) {
#if MOETRAIN_HAS_CUDA
  if (on_gpu(q)) return cuda::attention_forward(q, k, v, docs, scale, out, lse);
#endif
  const AttnDims d = check_attention(q, k, v, docs);
  expect_shape(out, {d.n, d.h, d.dv}, "attention out");
  expect_shape(lse, {d.n, d.h}, "attention lse");
  const int32_t* cu = docs.cu_seqlens.data<int32_t>();
  const int64_t group = d.h / d.kv;
  dispatch_float(q.dtype(), [&](auto tag) {
    using T = decltype(tag);
#pragma omp parallel for collapse(2) schedule(dynamic)
    for (int64_t s = 0; s < d.docs; ++s) {
      for (int64_t head = 0; head < d.h; ++head) {
        const int64_t g = head / group;
        std::vector<double> p;
        std::vector<double> acc(d.dv);
        for (int64_t i = cu[s]; i < cu[s + 1]; ++i) {
          const T* qi = q.data<T>() + (i * d.h + head) * d.dqk;
          p.assign(i - cu[s] + 1, 0.0);
          double m = -std::numeric_limits<double>::infinity();
          for (int64_t j = cu[s]; j <= i; ++j) {
            const T* kj = k.data<T>() + (j * d.kv + g) * d.dqk;
            double dot = 0;
            for (int64_t c = 0; c < d.dqk; ++c) dot += static_cast<double>(qi[c]) * kj[c];
            p[j - cu[s]] = dot * scale;
            m = std::max(m, dot * scale);
          }
          double sum = 0;
          for (double& x : p) sum += (x = std::exp(x - m));
          std::fill(acc.begin(), acc.end(), 0.0);
          for (int64_t j = cu[s]; j <= i; ++j) {
            const T* vj = v.data<T>() + (j * d.kv + g) * d.dv;
            const double pj = p[j - cu[s]] / sum;
            for (int64_t c = 0; c < d.dv; ++c) acc[c] += pj * vj[c];
          }
          T* oi = out.data<T>() + (i * d.h + head) * d.dv;
          for (int64_t c = 0; c < d.dv; ++c) oi[c] = static_cast<T>(acc[c]);
          lse.data<T>()[i * d.h + head] = static_cast<T>(m + std::log(sum));
        }
      }
    }
  });
}

void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                        const Tensor& lse, const Tensor& dout, const Documents& docs, double scale,
                        Tensor& dq, Tensor& dk, Tensor& dv) {
#if MOETRAIN_HAS_CUDA
  if (on_gpu(q)) return cuda::attention_backward(q, k, v, out, lse, dout, docs, scale, dq, dk, dv);
#endif
  const AttnDims d = check_attention(q, k, v, docs);
  expect_shape(dout, {d.n, d.h, d.dv}, "attention dout");
  expect_shape(dq, q.shape(), "attention dq");
  expect_shape(dk, k.shape(), "attention dk");
  expect_shape(dv, v.shape(), "attention dv");
  const int32_t* cu = docs.cu_seqlens.data<int32_t>();
  const int64_t group = d.h / d.kv;
  dispatch_float(q.dtype(), [&](auto tag) {
    using T = decltype(tag);
    // One thread owns a (document, kv head) pair: it is the only writer of those dk/dv rows.
#pragma omp parallel for collapse(2) schedule(dynamic)
    for (int64_t s = 0; s < d.docs; ++s) {
      for (int64_t g = 0; g < d.kv; ++g) {
        const int64_t len = cu[s + 1] - cu[s];
        std::vector<double> dk_acc(len * d.dqk, 0.0), dv_acc(len * d.dv, 0.0);
        for (int64_t head = g * group; head < (g + 1) * group; ++head) {
          for (int64_t i = cu[s]; i < cu[s + 1]; ++i) {
            const T* qi = q.data<T>() + (i * d.h + head) * d.dqk;
            const T* doi = dout.data<T>() + (i * d.h + head) * d.dv;
            const T* oi = out.data<T>() + (i * d.h + head) * d.dv;
            const double l = lse.data<T>()[i * d.h + head];
            double delta = 0;  // rowsum(dO * O)
            for (int64_t c = 0; c < d.dv; ++c) delta += static_cast<double>(doi[c]) * oi[c];
            std::vector<double> dqi(d.dqk, 0.0);
            for (int64_t j = cu[s]; j <= i; ++j) {
              const T* kj = k.data<T>() + (j * d.kv + g) * d.dqk;
              const T* vj = v.data<T>() + (j * d.kv + g) * d.dv;
              double dot = 0, dp = 0;
              for (int64_t c = 0; c < d.dqk; ++c) dot += static_cast<double>(qi[c]) * kj[c];
              for (int64_t c = 0; c < d.dv; ++c) dp += static_cast<double>(doi[c]) * vj[c];
              const double p = std::exp(dot * scale - l);
              const double ds = p * (dp - delta) * scale;
              double* dkj = &dk_acc[(j - cu[s]) * d.dqk];
              double* dvj = &dv_acc[(j - cu[s]) * d.dv];
              for (int64_t c = 0; c < d.dqk; ++c) {
                dqi[c] += ds * kj[c];
                dkj[c] += ds * qi[c];
              }
              for (int64_t c = 0; c < d.dv; ++c) dvj[c] += p * doi[c];
            }
            T* dq_out = dq.data<T>() + (i * d.h + head) * d.dqk;
            for (int64_t c = 0; c < d.dqk; ++c) dq_out[c] = static_cast<T>(dqi[c]);
          }
        }
        for (int64_t j = 0; j < len; ++j) {
          T* dkj = dk.data<T>() + ((cu[s] + j) * d.kv + g) * d.dqk;
          T* dvj = dv.data<T>() + ((cu[s] + j) * d.kv + g) * d.dv;
          for (int64_t c = 0; c < d.dqk; ++c) dkj[c] = static_cast<T>(dk_acc[j * d.dqk + c]);
          for (int64_t c = 0; c < d.dv; ++c) dvj[c] = static_cast<T>(dv_acc[j * d.dv + c]);
        }
      }
    }
  });
}

}  // namespace mt::ops
