#include "train/evaluate.h"

#include <algorithm>

#include "train/data_loader.h"

namespace mt {

EvalResult evaluate_tokens(Qwen3Moe& model, const TokenView& docs, int64_t rows, int64_t seq_len,
                           dist::Communicator* world, const TokenLossSink* per_token) {
  const int64_t n = docs.num_tokens;
  const int64_t ranks = world ? world->size() : 1, rank = world ? world->rank() : 0;
  const int64_t total_rows = n > 1 ? (n - 1 + seq_len - 1) / seq_len : 0;
  const int64_t per_batch = rows * ranks;
  const int64_t batches = (total_rows + per_batch - 1) / per_batch;
  double loss_sum = 0;
  int64_t tokens = 0;
  const ModelConfig& c = model.config();
  for (int64_t b = 0; b < batches; ++b) {
    std::vector<PackedRow> packed;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t row = b * per_batch + rank * rows + r;
      PackedRow p;
      for (int64_t i = 0; i <= seq_len; ++i) {
        const int64_t at = row * seq_len + i;
        const bool real = row < total_rows && at < n;
        p.tokens.push_back(real ? static_cast<int32_t>(docs.tokens[at]) : 0);
        p.segment_start.push_back(real ? docs.is_doc_start(at) : 1);
        p.counts.push_back(real && (!docs.loss_mask || docs.loss_mask[at]) ? 1 : 0);
      }
      packed.push_back(std::move(p));
    }
    Batch batch = pack_rows(packed, seq_len);
    tokens += batch.masked_tokens();
    if (c.device != Device::kCPU) batch = batch.to(c.device);
    if (!per_token) {
      loss_sum += model.forward(batch).ce_sum;
      continue;
    }
    Tensor losses = Tensor::empty({batch.size()}, c.stat_dtype(), c.device);
    loss_sum += model.forward(batch, &losses).ce_sum;
    // Every rank's rows of this batch, in row order (rank-major), on rank 0.
    const Tensor mine = losses.to(Device::kCPU).to(DType::kF64);
    Tensor all = mine;
    if (world && ranks > 1) {
      all = Tensor::empty({mine.numel() * ranks}, DType::kF64);
      world->all_gather(mine, all);
    }
    if (rank != 0) continue;
    for (int64_t r = 0; r < per_batch; ++r) {
      const int64_t row = b * per_batch + r;
      for (int64_t i = 0; i < seq_len; ++i) {
        const int64_t target = row * seq_len + i + 1;
        if (row >= total_rows || target >= n || docs.is_doc_start(target)) continue;
        if (docs.loss_mask && !docs.loss_mask[target]) continue;
        (*per_token)(target, all.data<double>()[r * seq_len + i]);
      }
    }
  }
  Tensor sums = Tensor::empty({2}, DType::kF64);
  sums.data<double>()[0] = loss_sum;
  sums.data<double>()[1] = static_cast<double>(tokens);
  if (world && world->size() > 1) world->all_reduce(sums);
  return {sums.data<double>()[0], static_cast<int64_t>(sums.data<double>()[1])};
}

}  // namespace mt
