// Reference attention: one (document, head) at a time, double accumulation, probabilities
// recomputed in backward from the saved log-sum-exp.
#include "ops/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "ops/dispatch.h"

namespace mt::ops::cpu {

namespace {
struct AttnDims {
  int64_t n, h, kv, dqk, dv, docs;
};
AttnDims dims_of(const Tensor& q, const Tensor& k, const Tensor& v, const Documents& docs) {
  return {q.dim(0), q.dim(1), k.dim(1), q.dim(2), v.dim(2), docs.cu_seqlens.numel() - 1};
}
}  // namespace

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Documents& docs,
                       double scale, Tensor& out, Tensor& lse) {
  const AttnDims d = dims_of(q, k, v, docs);
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
  const AttnDims d = dims_of(q, k, v, docs);
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

namespace {
// The first token of the document holding row position i.
int64_t document_start(const int32_t* cu, int64_t docs, int64_t i) {
  return *(std::upper_bound(cu, cu + docs + 1, static_cast<int32_t>(i)) - 1);
}
}  // namespace

void attention_forward_rows(const Tensor& q, const int32_t* rows, const Tensor& k, const Tensor& v,
                            const Documents& docs, double scale, Tensor& out, Tensor& lse) {
  const int64_t nq = q.dim(0), h = q.dim(1), kv = k.dim(1), dqk = q.dim(2), dv = v.dim(2);
  const int64_t ndocs = docs.cu_seqlens.numel() - 1, group = h / kv;
  const int32_t* cu = docs.cu_seqlens.data<int32_t>();
  dispatch_float(q.dtype(), [&](auto tag) {
    using T = decltype(tag);
#pragma omp parallel for collapse(2) schedule(dynamic)
    for (int64_t a = 0; a < nq; ++a) {
      for (int64_t head = 0; head < h; ++head) {
        const int64_t i = rows[a], first = document_start(cu, ndocs, i), g = head / group;
        const T* qa = q.data<T>() + (a * h + head) * dqk;
        std::vector<double> p(i - first + 1);
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t j = first; j <= i; ++j) {
          const T* kj = k.data<T>() + (j * kv + g) * dqk;
          double dot = 0;
          for (int64_t c = 0; c < dqk; ++c) dot += static_cast<double>(qa[c]) * kj[c];
          p[j - first] = dot * scale;
          m = std::max(m, dot * scale);
        }
        double sum = 0;
        for (double& x : p) sum += (x = std::exp(x - m));
        std::vector<double> acc(dv, 0.0);
        for (int64_t j = first; j <= i; ++j) {
          const T* vj = v.data<T>() + (j * kv + g) * dv;
          for (int64_t c = 0; c < dv; ++c) acc[c] += p[j - first] / sum * vj[c];
        }
        T* oa = out.data<T>() + (a * h + head) * dv;
        for (int64_t c = 0; c < dv; ++c) oa[c] = static_cast<T>(acc[c]);
        lse.data<T>()[a * h + head] = static_cast<T>(m + std::log(sum));
      }
    }
  });
}

void attention_backward_rows(const Tensor& q, const int32_t* rows, const Tensor& k, const Tensor& v,
                             const Tensor& out, const Tensor& lse, const Tensor& dout,
                             const Documents& docs, double scale, Tensor& dq, Tensor& dk,
                             Tensor& dv) {
  const int64_t nq = q.dim(0), h = q.dim(1), kv = k.dim(1), dqk = q.dim(2), dvw = v.dim(2);
  const int64_t n = k.dim(0), ndocs = docs.cu_seqlens.numel() - 1, group = h / kv;
  const int32_t* cu = docs.cu_seqlens.data<int32_t>();
  dispatch_float(q.dtype(), [&](auto tag) {
    using T = decltype(tag);
    // One thread owns a kv head: the only writer of its dk/dv rows and of its query heads' dq.
#pragma omp parallel for schedule(dynamic)
    for (int64_t g = 0; g < kv; ++g) {
      std::vector<double> dk_acc(n * dqk, 0.0), dv_acc(n * dvw, 0.0);
      for (int64_t head = g * group; head < (g + 1) * group; ++head)
        for (int64_t a = 0; a < nq; ++a) {
          const int64_t i = rows[a], first = document_start(cu, ndocs, i);
          const T* qa = q.data<T>() + (a * h + head) * dqk;
          const T* doa = dout.data<T>() + (a * h + head) * dvw;
          const T* oa = out.data<T>() + (a * h + head) * dvw;
          const double l = lse.data<T>()[a * h + head];
          double delta = 0;  // rowsum(dO * O)
          for (int64_t c = 0; c < dvw; ++c) delta += static_cast<double>(doa[c]) * oa[c];
          std::vector<double> dqa(dqk, 0.0);
          for (int64_t j = first; j <= i; ++j) {
            const T* kj = k.data<T>() + (j * kv + g) * dqk;
            const T* vj = v.data<T>() + (j * kv + g) * dvw;
            double dot = 0, dp = 0;
            for (int64_t c = 0; c < dqk; ++c) dot += static_cast<double>(qa[c]) * kj[c];
            for (int64_t c = 0; c < dvw; ++c) dp += static_cast<double>(doa[c]) * vj[c];
            const double p = std::exp(dot * scale - l);
            const double ds = p * (dp - delta) * scale;
            for (int64_t c = 0; c < dqk; ++c) {
              dqa[c] += ds * kj[c];
              dk_acc[j * dqk + c] += ds * qa[c];
            }
            for (int64_t c = 0; c < dvw; ++c) dv_acc[j * dvw + c] += p * doa[c];
          }
          T* dq_out = dq.data<T>() + (a * h + head) * dqk;
          for (int64_t c = 0; c < dqk; ++c) dq_out[c] = static_cast<T>(dqa[c]);
        }
      for (int64_t j = 0; j < n; ++j) {
        T* dkj = dk.data<T>() + (j * kv + g) * dqk;
        T* dvj = dv.data<T>() + (j * kv + g) * dvw;
        for (int64_t c = 0; c < dqk; ++c) dkj[c] = static_cast<T>(dk_acc[j * dqk + c]);
        for (int64_t c = 0; c < dvw; ++c) dvj[c] = static_cast<T>(dv_acc[j * dvw + c]);
      }
    }
  });
}

}  // namespace mt::ops::cpu
