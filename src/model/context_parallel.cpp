#include "model/context_parallel.h"

#include "core/error.h"
#include "ops/attention.h"

namespace mt {

namespace {

// The token tensors of a batch, picked at `rows` (host, any 1-byte or 4-byte dtype).
Tensor pick(const Tensor& whole, const Tensor& rows) {
  if (!whole.defined()) return whole;
  const int64_t n = rows.numel(), width = dtype_size(whole.dtype());
  Tensor out = Tensor::empty({n}, whole.dtype());
  const auto* src = static_cast<const uint8_t*>(whole.raw());
  auto* dst = static_cast<uint8_t*>(out.raw());
  for (int64_t i = 0; i < n; ++i)
    std::copy_n(src + rows.data<int32_t>()[i] * width, width, dst + i * width);
  return out;
}

// Calls fn(rank_offset, row_offset, count) for every chunk: the chunk's first token in the
// group's all-gather (rank-major: rank q's n tokens, row by row its two chunks) and in the rows
// (row order), both in tokens.
template <class Fn>
void for_each_chunk(const ContextShard& s, int64_t n, Fn&& fn) {
  const int64_t chunk = s.chunks.chunk(), rows = n / (2 * chunk);
  for (int64_t q = 0; q < s.chunks.cp; ++q) {
    const ops::ContextChunks of_q{s.chunks.row_tokens, s.chunks.cp, q};
    for (int64_t b = 0; b < rows; ++b)
      for (int64_t slot = 0; slot < 2; ++slot)
        fn(q * n + (2 * b + slot) * chunk, of_q.chunk_start(b, slot), chunk);
  }
}

// Copies every chunk of `from` (cp n tokens of any width) into `to`: from the group's rank-major
// layout into row order, or back.
enum class ChunkOrder : uint8_t { kToRows, kToRanks };
void copy_chunks(const ContextShard& s, int64_t n, const Tensor& from, Tensor& to,
                 ChunkOrder order) {
  const int64_t width = from.numel() / (n * s.cp());
  for_each_chunk(s, n, [&](int64_t at_rank, int64_t at_row, int64_t count) {
    const bool to_rows = order == ChunkOrder::kToRows;
    to.view((to_rows ? at_row : at_rank) * width, {count * width})
        .copy_from(from.view((to_rows ? at_rank : at_row) * width, {count * width}));
  });
}

int64_t check_local(const ContextShard& s, const Tensor& local, const char* what) {
  MT_CHECK(s.cp() > 1 && s.rows.defined(), "{}: the batch is not a context-parallel shard", what);
  const int64_t n = s.rows.numel();
  MT_CHECK(local.ndim() >= 1 && local.dim(0) == n, "{}: {} rows for a shard of {} tokens", what,
           local.ndim() >= 1 ? local.dim(0) : 0, n);
  return n;
}

Shape whole_shape(const Tensor& local, int64_t cp) {
  Shape s = local.shape();
  s[0] *= cp;
  return s;
}

}  // namespace

Batch context_shard(const Batch& whole, int64_t row_tokens, int64_t cp, int64_t rank) {
  MT_CHECK(whole.context.cp() == 1, "context_shard: the batch is a shard already");
  MT_CHECK(whole.tokens.device() == Device::kCPU, "context_shard: the batch must be on the host");
  MT_CHECK(row_tokens > 0 && whole.size() % row_tokens == 0,
           "context_shard: {} tokens are not whole rows of {}", whole.size(), row_tokens);
  ContextShard s{{row_tokens, cp, rank}, {}};
  s.rows = ops::context_parallel_rows(s.chunks, whole.size() / row_tokens);  // names the sizes
  Batch out = whole;
  out.tokens = pick(whole.tokens, s.rows);
  out.targets = pick(whole.targets, s.rows);
  out.loss_mask = pick(whole.loss_mask, s.rows);
  out.positions = pick(whole.positions, s.rows);
  out.padding = pick(whole.padding, s.rows);
  out.padding_tokens = 0;
  if (out.padding.defined())
    for (int64_t i = 0; i < out.padding.numel(); ++i)
      out.padding_tokens += out.padding.data<uint8_t>()[i] != 0;
  out.context = std::move(s);
  return out;
}

ContextRowsGather::ContextRowsGather(dist::Communicator& cp, const ContextShard& shard,
                                     const Tensor& local)
    : shard_(&shard), n_(check_local(shard, local, "gather_context_rows")) {
  MT_CHECK(cp.size() == shard.cp(), "gather_context_rows: a CP group of {} for a shard of {}",
           cp.size(), shard.cp());
  gathered_ = Tensor::empty(whole_shape(local, shard.cp()), local.dtype(), local.device());
  pending_ = cp.all_gather_async(local, gathered_);
}

Tensor ContextRowsGather::rows() {
  MT_CHECK(pending_ != nullptr, "ContextRowsGather::rows() called twice");
  pending_->wait();
  pending_.reset();
  Tensor whole = Tensor::empty(gathered_.shape(), gathered_.dtype(), gathered_.device());
  copy_chunks(*shard_, n_, gathered_, whole, ChunkOrder::kToRows);
  gathered_ = Tensor();
  return whole;
}

Tensor gather_context_rows(dist::Communicator& cp, const ContextShard& shard, const Tensor& local) {
  return ContextRowsGather(cp, shard, local).rows();
}

ContextRowsReduce::ContextRowsReduce(dist::Communicator& cp, const ContextShard& shard,
                                     const Tensor& whole, Tensor& local) {
  const int64_t n = check_local(shard, local, "reduce_scatter_context_rows");
  MT_CHECK(cp.size() == shard.cp() && whole.shape() == whole_shape(local, shard.cp()),
           "reduce_scatter_context_rows: {} over a CP group of {} for a shard {} of {}",
           shape_str(whole.shape()), cp.size(), shape_str(local.shape()), shard.cp());
  staged_ = Tensor::empty(whole.shape(), whole.dtype(), whole.device());
  copy_chunks(shard, n, whole, staged_, ChunkOrder::kToRanks);
  pending_ = cp.reduce_scatter_async(staged_, local);
}

void ContextRowsReduce::wait() {
  MT_CHECK(pending_ != nullptr, "ContextRowsReduce::wait() called twice");
  pending_->wait();
  pending_.reset();
  staged_ = Tensor();
}

void reduce_scatter_context_rows(dist::Communicator& cp, const ContextShard& shard,
                                 const Tensor& whole, Tensor& local) {
  ContextRowsReduce(cp, shard, whole, local).wait();
}

}  // namespace mt
