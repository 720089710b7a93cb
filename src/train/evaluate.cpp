#include "train/evaluate.h"

#include <algorithm>

#include "train/data_loader.h"

namespace mt {

EvalResult evaluate_tokens(Qwen3Moe& model, const TokenDocuments& docs, int64_t rows,
                           int64_t seq_len, dist::Communicator* world) {
  const int64_t n = static_cast<int64_t>(docs.tokens.size());
  const int64_t ranks = world ? world->size() : 1, rank = world ? world->rank() : 0;
  const int64_t total_rows = n > 1 ? (n - 1 + seq_len - 1) / seq_len : 0;
  const int64_t per_batch = rows * ranks;
  const int64_t batches = (total_rows + per_batch - 1) / per_batch;
  std::vector<uint8_t> doc_start(n, 0);
  for (int64_t d = 0; d < docs.num_docs(); ++d)
    if (docs.doc_offsets[d] < static_cast<uint64_t>(n)) doc_start[docs.doc_offsets[d]] = 1;
  double loss_sum = 0;
  int64_t tokens = 0;
  const Device device = model.config().device;
  for (int64_t b = 0; b < batches; ++b) {
    std::vector<PackedRow> packed;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t row = b * per_batch + rank * rows + r;
      PackedRow p;
      for (int64_t i = 0; i <= seq_len; ++i) {
        const int64_t at = row * seq_len + i;
        const bool real = row < total_rows && at < n;
        p.tokens.push_back(real ? static_cast<int32_t>(docs.tokens[at]) : 0);
        p.segment_start.push_back(real ? doc_start[at] : 1);
        p.counts.push_back(real && (docs.loss_mask.empty() || docs.loss_mask[at]) ? 1 : 0);
      }
      packed.push_back(std::move(p));
    }
    Batch batch = pack_rows(packed, seq_len);
    tokens += batch.masked_tokens();
    if (device != Device::kCPU) batch = batch.to(device);
    loss_sum += model.forward(batch).ce_sum;
  }
  Tensor sums = Tensor::empty({2}, DType::kF64);
  sums.data<double>()[0] = loss_sum;
  sums.data<double>()[1] = static_cast<double>(tokens);
  if (world && world->size() > 1) world->all_reduce(sums);
  return {sums.data<double>()[0], static_cast<int64_t>(sums.data<double>()[1])};
}

}  // namespace mt
