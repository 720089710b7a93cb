// Reference attention on the GPU for packed causal documents with GQA: one warp per
// (token, head), online softmax in fp32, keys visited in order. It is the correctness fallback
// and the GPU-side reference for the cuDNN SDPA path; O(S^2) per document, not a fast kernel.
// Backward: dq per (query, head) warp; dk and dv per (key, kv head) warp looping over the
// queries and heads that read it, so every output has one writer (deterministic, no atomics).
#include "ops/cuda/attention.h"
#include "ops/cuda/common.cuh"

namespace mt::cuda {

namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kMaxDim = 256;  // head dims up to 256: at most 8 values per lane

struct AttnGeometry {
  int64_t n;
  int heads, kv_heads, dqk, dv;
  float scale;
};

// The document of token i: the segment [begin, end) of cu_seqlens holding it (binary search).
__device__ void doc_of(const int32_t* cu, int docs, int64_t i, int64_t* begin, int64_t* end) {
  int lo = 0, hi = docs;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (cu[mid] <= i)
      lo = mid;
    else
      hi = mid;
  }
  *begin = cu[lo];
  *end = cu[lo + 1];
}

// The (query token, head) a warp owns, its kv head and its document's token range.
struct QueryItem {
  int64_t item, token, doc_begin, doc_end;
  int head, kv_head;
};

__device__ bool query_item(const int32_t* cu, int docs, const AttnGeometry& g, QueryItem* q) {
  q->item = blockIdx.x * int64_t{kWarpsPerBlock} + threadIdx.x / 32;
  if (q->item >= g.n * g.heads) return false;
  q->token = q->item / g.heads;
  q->head = static_cast<int>(q->item % g.heads);
  q->kv_head = q->head / (g.heads / g.kv_heads);
  doc_of(cu, docs, q->token, &q->doc_begin, &q->doc_end);
  return true;
}

template <class T>
__device__ float warp_dot(const T* a, const T* b, int d) {
  float s = 0.f;
  for (int c = threadIdx.x % 32; c < d; c += 32) s += to_float(a[c]) * to_float(b[c]);
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return s;
}

template <class T>
__global__ void attention_forward_kernel(const T* q, const T* k, const T* v, const int32_t* cu,
                                         int docs, AttnGeometry g, T* out, float* lse) {
  QueryItem w;
  if (!query_item(cu, docs, g, &w)) return;
  const int64_t i = w.token, item = w.item;
  const int kvh = w.kv_head, lane = threadIdx.x % 32;
  const T* qi = q + item * g.dqk;
  float m = -INFINITY, sum = 0.f, acc[kMaxDim / 32] = {};
  for (int64_t j = w.doc_begin; j <= i; ++j) {
    const float s = warp_dot(qi, k + (j * g.kv_heads + kvh) * g.dqk, g.dqk) * g.scale;
    const float m_new = fmaxf(m, s);
    const float correction = expf(m - m_new), p = expf(s - m_new);
    sum = sum * correction + p;
    const T* vj = v + (j * g.kv_heads + kvh) * g.dv;
    for (int c = lane, r = 0; c < g.dv; c += 32, ++r)
      acc[r] = acc[r] * correction + p * to_float(vj[c]);
    m = m_new;
  }
  T* oi = out + item * g.dv;
  for (int c = lane, r = 0; c < g.dv; c += 32, ++r) oi[c] = from_float<T>(acc[r] / sum);
  if (lane == 0) lse[item] = m + logf(sum);
}

// delta[i, h] = dout_i . out_i (the softmax backward's row term).
template <class T>
__global__ void attention_delta_kernel(const T* out, const T* dout, AttnGeometry g, float* delta) {
  const int64_t item = blockIdx.x * int64_t{kWarpsPerBlock} + threadIdx.x / 32;
  if (item >= g.n * g.heads) return;
  const float d = warp_dot(out + item * g.dv, dout + item * g.dv, g.dv);
  if (threadIdx.x % 32 == 0) delta[item] = d;
}

template <class T>
__global__ void attention_dq_kernel(const T* q, const T* k, const T* v, const T* dout,
                                    const float* lse, const float* delta, const int32_t* cu,
                                    int docs, AttnGeometry g, T* dq) {
  QueryItem w;
  if (!query_item(cu, docs, g, &w)) return;
  const int64_t i = w.token, item = w.item;
  const int kvh = w.kv_head, lane = threadIdx.x % 32;
  const T* qi = q + item * g.dqk;
  const T* doi = dout + item * g.dv;
  float acc[kMaxDim / 32] = {};
  for (int64_t j = w.doc_begin; j <= i; ++j) {
    const T* kj = k + (j * g.kv_heads + kvh) * g.dqk;
    const float p = expf(warp_dot(qi, kj, g.dqk) * g.scale - lse[item]);
    const float dp = warp_dot(doi, v + (j * g.kv_heads + kvh) * g.dv, g.dv);
    const float ds = p * (dp - delta[item]) * g.scale;
    for (int c = lane, r = 0; c < g.dqk; c += 32, ++r) acc[r] += ds * to_float(kj[c]);
  }
  for (int c = lane, r = 0; c < g.dqk; c += 32, ++r) dq[item * g.dqk + c] = from_float<T>(acc[r]);
}

template <class T>
__global__ void attention_dkv_kernel(const T* q, const T* k, const T* v, const T* dout,
                                     const float* lse, const float* delta, const int32_t* cu,
                                     int docs, AttnGeometry g, T* dk, T* dv) {
  const int64_t item = blockIdx.x * int64_t{kWarpsPerBlock} + threadIdx.x / 32;
  if (item >= g.n * g.kv_heads) return;
  const int64_t j = item / g.kv_heads;
  const int kvh = static_cast<int>(item % g.kv_heads), group = g.heads / g.kv_heads;
  const int lane = threadIdx.x % 32;
  int64_t begin, end;
  doc_of(cu, docs, j, &begin, &end);
  const T* kj = k + item * g.dqk;
  const T* vj = v + item * g.dv;
  float dk_acc[kMaxDim / 32] = {}, dv_acc[kMaxDim / 32] = {};
  for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
    for (int64_t i = j; i < end; ++i) {
      const int64_t row = i * g.heads + h;
      const T* qi = q + row * g.dqk;
      const T* doi = dout + row * g.dv;
      const float p = expf(warp_dot(qi, kj, g.dqk) * g.scale - lse[row]);
      const float ds = p * (warp_dot(doi, vj, g.dv) - delta[row]) * g.scale;
      for (int c = lane, r = 0; c < g.dqk; c += 32, ++r) dk_acc[r] += ds * to_float(qi[c]);
      for (int c = lane, r = 0; c < g.dv; c += 32, ++r) dv_acc[r] += p * to_float(doi[c]);
    }
  }
  for (int c = lane, r = 0; c < g.dqk; c += 32, ++r)
    dk[item * g.dqk + c] = from_float<T>(dk_acc[r]);
  for (int c = lane, r = 0; c < g.dv; c += 32, ++r) dv[item * g.dv + c] = from_float<T>(dv_acc[r]);
}

// cuDNN's description of the packed documents: element offsets of each document in q, k, v, out
// and lse, and its length. Documents past the real ones are empty and start at the end.
__global__ void ragged_layout_kernel(const int32_t* cu, int docs, int padded_docs,
                                     kernels::RaggedStrides st, kernels::RaggedLayout out) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b > padded_docs) return;
  const int32_t start = cu[b < docs ? b : docs];
  out.q[b] = start * st.q;
  out.k[b] = start * st.k;
  out.v[b] = start * st.v;
  out.o[b] = start * st.o;
  out.stats[b] = start * st.stats;
  if (b < padded_docs) out.seq_len[b] = b < docs ? cu[b + 1] - start : 0;
}

__global__ void chunk_layout_kernel(const int32_t* cu, int docs, int padded_docs,
                                    kernels::ContextGeometry g, int slot_begin, int slots,
                                    kernels::RaggedStrides st, kernels::RaggedLayout out) {
  const int entries = g.rows * slots * padded_docs;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i > entries) return;
  if (i == entries) {  // the ends: the rank's queries, the rows' keys
    const int32_t queries = g.rows * 2 * g.chunk, keys = g.rows * g.row_tokens;
    out.q[i] = queries * st.q;
    out.o[i] = queries * st.o;
    out.stats[i] = queries * st.stats;
    out.k[i] = keys * st.k;
    out.v[i] = keys * st.v;
    return;
  }
  const int c = i / padded_docs, d = i % padded_docs;
  const int row = c / slots, slot = slot_begin + c % slots;
  const int which = slot == 0 ? g.rank : 2 * g.cp - 1 - g.rank;
  const int32_t first = row * g.row_tokens + which * g.chunk;  // the chunk in the rows
  const int32_t local = row * 2 * g.chunk + slot * g.chunk;    // and in the rank's queries
  const int32_t start = cu[d < docs ? d : docs], end = cu[d < docs ? d + 1 : docs];
  const int32_t q0 = min(max(start, first), first + g.chunk);
  const int32_t q1 = min(max(end, first), first + g.chunk);
  const int32_t at = local + q0 - first;
  out.q[i] = at * st.q;
  out.o[i] = at * st.o;
  out.stats[i] = at * st.stats;
  out.k[i] = (q1 > q0 ? start : q0) * st.k;
  out.v[i] = (q1 > q0 ? start : q0) * st.v;
  out.seq_len[i] = q1 - q0;
  out.seq_len_kv[i] = q1 > q0 ? q1 - start : 0;
}

// Entry `at` of a layout of `count` documents: its offsets, and its length below `count` (the
// offsets have count + 1 entries, the lengths count).
__device__ void write_layout_entry(const kernels::RaggedLayout& out, int at, int count,
                                   int32_t start, int32_t len, const kernels::RaggedStrides& st) {
  out.q[at] = start * st.q;
  out.k[at] = start * st.k;
  out.v[at] = start * st.v;
  out.o[at] = start * st.o;
  out.stats[at] = start * st.stats;
  if (at < count) out.seq_len[at] = len;
}

// One block: each thread takes a run of documents, a block scan of its long ones gives every
// document its place in its class, then the classes' tails are padded with empty documents at
// the end of the tokens (and each offset array's last entry).
constexpr int kSplitThreads = 1024;
__global__ void __launch_bounds__(kSplitThreads)
    ragged_layout_split_kernel(const int32_t* cu, int docs, int threshold, int longer_docs,
                               int rest_docs, kernels::RaggedStrides st,
                               kernels::RaggedLayout longer, kernels::RaggedLayout rest) {
  __shared__ int warp_totals[kSplitThreads / 32];
  const int t = threadIdx.x, lane = t % 32, warp = t / 32;
  const int per = (docs + kSplitThreads - 1) / kSplitThreads;
  const int first = min(docs, t * per), last = min(docs, first + per);
  int mine = 0;
  for (int d = first; d < last; ++d) mine += cu[d + 1] - cu[d] > threshold;
  int scan = mine;  // inclusive within the warp
  for (int o = 1; o < 32; o *= 2) {
    const int x = __shfl_up_sync(0xffffffffu, scan, o);
    if (lane >= o) scan += x;
  }
  if (lane == 31) warp_totals[warp] = scan;
  __syncthreads();
  if (warp == 0) {
    int w = warp_totals[lane];
    for (int o = 1; o < 32; o *= 2) {
      const int x = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += x;
    }
    warp_totals[lane] = w;  // inclusive over the warps
  }
  __syncthreads();
  const int total = warp_totals[kSplitThreads / 32 - 1];
  int long_at = scan - mine + (warp > 0 ? warp_totals[warp - 1] : 0);
  int rest_at = first - long_at;
  for (int d = first; d < last; ++d) {
    const int32_t start = cu[d], len = cu[d + 1] - start;
    if (len > threshold) {
      if (long_at < longer_docs) write_layout_entry(longer, long_at, longer_docs, start, len, st);
      ++long_at;
    } else if (rest_at < rest_docs) {
      write_layout_entry(rest, rest_at++, rest_docs, start, len, st);
    }
  }
  const int32_t end = cu[docs];
  for (int i = min(total, longer_docs) + t; i <= longer_docs; i += kSplitThreads)
    write_layout_entry(longer, i, longer_docs, end, 0, st);
  for (int i = min(docs - total, rest_docs) + t; i <= rest_docs; i += kSplitThreads)
    write_layout_entry(rest, i, rest_docs, end, 0, st);
}

int blocks_for(int64_t items) {
  return static_cast<int>((items + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

}  // namespace

namespace kernels {

cudaError_t attention_forward(DType s, const void* q, const void* k, const void* v,
                              const int32_t* cu_seqlens, int docs, int64_t n, int heads,
                              int kv_heads, int dqk, int dv, float scale, void* out, float* lse,
                              cudaStream_t stream) {
  if (dqk > kMaxDim || dv > kMaxDim || heads % kv_heads != 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  const AttnGeometry g{n, heads, kv_heads, dqk, dv, scale};
  dispatch_storage(s, [&](auto tag) {
    using T = decltype(tag);
    attention_forward_kernel<T><<<blocks_for(n * heads), 32 * kWarpsPerBlock, 0, stream>>>(
        static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), cu_seqlens,
        docs, g, static_cast<T*>(out), lse);
  });
  return cudaGetLastError();
}

cudaError_t attention_backward(DType s, const void* q, const void* k, const void* v,
                               const void* out, const float* lse, const void* dout,
                               const int32_t* cu_seqlens, int docs, int64_t n, int heads,
                               int kv_heads, int dqk, int dv, float scale, float* delta, void* dq,
                               void* dk, void* dvv, cudaStream_t stream) {
  if (dqk > kMaxDim || dv > kMaxDim || heads % kv_heads != 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  const AttnGeometry g{n, heads, kv_heads, dqk, dv, scale};
  const int threads = 32 * kWarpsPerBlock;
  dispatch_storage(s, [&](auto tag) {
    using T = decltype(tag);
    const T *tq = static_cast<const T*>(q), *tk = static_cast<const T*>(k),
            *tv = static_cast<const T*>(v), *tdo = static_cast<const T*>(dout);
    attention_delta_kernel<T>
        <<<blocks_for(n * heads), threads, 0, stream>>>(static_cast<const T*>(out), tdo, g, delta);
    attention_dq_kernel<T><<<blocks_for(n * heads), threads, 0, stream>>>(
        tq, tk, tv, tdo, lse, delta, cu_seqlens, docs, g, static_cast<T*>(dq));
    attention_dkv_kernel<T><<<blocks_for(n * kv_heads), threads, 0, stream>>>(
        tq, tk, tv, tdo, lse, delta, cu_seqlens, docs, g, static_cast<T*>(dk),
        static_cast<T*>(dvv));
  });
  return cudaGetLastError();
}

cudaError_t attention_chunk_layout(const int32_t* cu_seqlens, int docs, int padded_docs,
                                   ContextGeometry g, int slot_begin, int slots,
                                   RaggedStrides strides, RaggedLayout out, cudaStream_t stream) {
  if (docs < 0 || padded_docs < docs || slots < 1 || slot_begin < 0 || slot_begin + slots > 2)
    return cudaErrorInvalidValue;
  const int entries = g.rows * slots * padded_docs, threads = 256;
  chunk_layout_kernel<<<(entries + threads) / threads, threads, 0, stream>>>(
      cu_seqlens, docs, padded_docs, g, slot_begin, slots, strides, out);
  return cudaGetLastError();
}

cudaError_t attention_ragged_layout(const int32_t* cu_seqlens, int docs, int padded_docs,
                                    RaggedStrides strides, RaggedLayout out, cudaStream_t stream) {
  if (padded_docs < docs) return cudaErrorInvalidValue;
  const int threads = 256;
  ragged_layout_kernel<<<(padded_docs + threads) / threads, threads, 0, stream>>>(
      cu_seqlens, docs, padded_docs, strides, out);
  return cudaGetLastError();
}

cudaError_t attention_ragged_layout_split(const int32_t* cu_seqlens, int docs, int threshold,
                                          int longer_docs, int rest_docs, RaggedStrides strides,
                                          RaggedLayout longer, RaggedLayout rest,
                                          cudaStream_t stream) {
  if (docs < 0 || longer_docs < 0 || rest_docs < 0) return cudaErrorInvalidValue;
  ragged_layout_split_kernel<<<1, kSplitThreads, 0, stream>>>(
      cu_seqlens, docs, threshold, longer_docs, rest_docs, strides, longer, rest);
  return cudaGetLastError();
}

}  // namespace kernels
}  // namespace mt::cuda
