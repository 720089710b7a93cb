// The router's plain reference: softmax, top-k and renormalisation per token, in double.
#include "ops/cpu/route.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "ops/dispatch.h"
#include "ops/elementwise.h"

namespace mt::ops::cpu {

void router_forward(const Tensor& logits, const Tensor& bias, const RouterOptions& opt,
                    Routing& out) {
  const int64_t n = logits.dim(0), e = logits.dim(1), k = opt.top_k;
  out.scores = Tensor::empty({n, e}, logits.dtype());
  out.expert_index = Tensor::empty({n, k}, DType::kI32);
  out.expert_weight = Tensor::empty({n, k}, logits.dtype());
  out.tokens_per_expert = Tensor::zeros({e}, DType::kI64);
  dispatch_float(logits.dtype(), [&](auto tag) {
    using T = decltype(tag);
    std::vector<double> biased(e);
    std::vector<int32_t> order(e);
    for (int64_t t = 0; t < n; ++t) {
      const T* l = logits.data<T>() + t * e;
      T* s = out.scores.data<T>() + t * e;
      const double m = *std::max_element(l, l + e);
      double sum = 0;
      for (int64_t c = 0; c < e; ++c) sum += std::exp(static_cast<double>(l[c]) - m);
      for (int64_t c = 0; c < e; ++c) s[c] = static_cast<T>(std::exp(l[c] - m) / sum);
      int32_t* idx = out.expert_index.data<int32_t>() + t * k;
      if (opt.mode != RoutingMode::kLearned) {
        for (int64_t j = 0; j < k; ++j) idx[j] = fixed_choice(opt.mode, t, j, k, e);
      } else {
        for (int64_t c = 0; c < e; ++c)
          biased[c] = s[c] + (bias.defined() ? bias.data<T>()[c] : T(0));
        std::iota(order.begin(), order.end(), 0);
        // Ties go to the lower expert index so the choice is a pure function of the scores.
        std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
          return biased[a] > biased[b] || (biased[a] == biased[b] && a < b);
        });
        for (int64_t j = 0; j < k; ++j) idx[j] = order[j];
      }
      T* w = out.expert_weight.data<T>() + t * k;
      double wsum = 0;
      for (int64_t j = 0; j < k; ++j) wsum += s[idx[j]];
      for (int64_t j = 0; j < k; ++j) {
        w[j] = opt.norm_topk_prob ? static_cast<T>(s[idx[j]] / wsum) : s[idx[j]];
        out.tokens_per_expert.data<int64_t>()[idx[j]] += 1;
      }
    }
  });
}
namespace {
// Rows of r that count: none is padding.
bool counts_row(const Tensor& padding, int64_t t) {
  return !padding.defined() || padding.data<uint8_t>()[t] == 0;
}
// N of the statistics: every real token made top_k choices.
double aux_tokens(const AuxStats& s) {
  const Tensor counts = s.tokens_per_expert.to(Device::kCPU);
  int64_t choices = 0;
  for (int64_t c = 0; c < counts.numel(); ++c) choices += counts.data<int64_t>()[c];
  return static_cast<double>(choices) / static_cast<double>(s.top_k);
}
}  // namespace

AuxStats router_aux_stats(const Routing& r, const Tensor& padding) {
  const int64_t n = r.scores.dim(0), e = r.scores.dim(1), k = r.expert_index.dim(1);
  AuxStats s{Tensor::zeros({e}, DType::kI64), Tensor::zeros({e}, r.scores.dtype()), k};
  for (int64_t t = 0; t < n; ++t)
    if (counts_row(padding, t))
      for (int64_t j = 0; j < k; ++j)
        s.tokens_per_expert.data<int64_t>()[r.expert_index.data<int32_t>()[t * k + j]] += 1;
  dispatch_float(r.scores.dtype(), [&](auto tag) {
    using T = decltype(tag);
    for (int64_t c = 0; c < e; ++c) {
      double sum = 0;
      for (int64_t t = 0; t < n; ++t)
        if (counts_row(padding, t)) sum += r.scores.data<T>()[t * e + c];
      s.score_sum.data<T>()[c] = static_cast<T>(sum);
    }
  });
  return s;
}

void add_aux_stats(const AuxStats& layer, AuxStats& pooled) {
  for (int64_t c = 0; c < layer.score_sum.numel(); ++c)
    pooled.tokens_per_expert.data<int64_t>()[c] += layer.tokens_per_expert.data<int64_t>()[c];
  add_(pooled.score_sum, layer.score_sum);
}

Tensor router_aux_loss(const AuxStats& s) {
  const int64_t e = s.score_sum.numel();
  const double n = aux_tokens(s);
  double aux = 0;
  for (int64_t c = 0; c < e && n > 0; ++c)
    aux +=
        static_cast<double>(s.tokens_per_expert.data<int64_t>()[c]) / n * (s.score_sum.item(c) / n);
  Tensor out = Tensor::empty({1}, DType::kF64);
  out.data<double>()[0] = aux * static_cast<double>(e);
  return out;
}

void router_backward(const Routing& r, const RouterOptions& opt, const AuxStats& stats,
                     const Tensor& padding, const Tensor& dweight, double aux_grad,
                     Tensor& dlogits) {
  const int64_t n = r.scores.dim(0), e = r.scores.dim(1), k = opt.top_k;
  const double total = aux_tokens(stats);
  dispatch_float(r.scores.dtype(), [&](auto tag) {
    using T = decltype(tag);
    std::vector<double> dscore(e);
    const int64_t* count = stats.tokens_per_expert.data<int64_t>();
    for (int64_t t = 0; t < n; ++t) {
      const T* s = r.scores.data<T>() + t * e;
      const int32_t* idx = r.expert_index.data<int32_t>() + t * k;
      const T* dw = dweight.data<T>() + t * k;
      // Aux loss: d/ds[t,c] of E * sum_c count_c/N * score_sum_c/N (N, counts: whole batch).
      const bool aux = total > 0 && counts_row(padding, t);
      for (int64_t c = 0; c < e; ++c)
        dscore[c] = aux ? aux_grad * e * static_cast<double>(count[c]) / (total * total) : 0.0;
      if (opt.norm_topk_prob) {
        // w_j = s_j / S: ds_j = (dw_j - sum_i dw_i w_i) / S.
        double sum = 0, dot = 0;
        for (int64_t j = 0; j < k; ++j) sum += s[idx[j]];
        for (int64_t j = 0; j < k; ++j) dot += static_cast<double>(dw[j]) * s[idx[j]] / sum;
        for (int64_t j = 0; j < k; ++j) dscore[idx[j]] += (dw[j] - dot) / sum;
      } else {
        for (int64_t j = 0; j < k; ++j) dscore[idx[j]] += dw[j];
      }
      // Softmax backward: dl = s * (ds - sum(ds * s)).
      double inner = 0;
      for (int64_t c = 0; c < e; ++c) inner += dscore[c] * s[c];
      T* dl = dlogits.data<T>() + t * e;
      for (int64_t c = 0; c < e; ++c) dl[c] = static_cast<T>(s[c] * (dscore[c] - inner));
    }
  });
}

}  // namespace mt::ops::cpu
