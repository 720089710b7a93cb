#include "train/evaluate.h"

#include <algorithm>

#include "core/error.h"
#include "model/context_parallel.h"
#include "ops/attention.h"
#include "train/data_loader.h"
#include "train/packing.h"

namespace mt {

namespace {
// Micro-batch b's documents (file indices), in placement order.
using Bins = std::vector<std::vector<int64_t>>;

int64_t doc_length(const TokenView& v, int64_t d) {
  return static_cast<int64_t>(v.doc_offsets[d + 1] - v.doc_offsets[d]);
}

// Every document with a target (two tokens or more), packed into micro-batches of `capacity`
// tokens.
Bins pack_documents(const TokenView& v, int64_t capacity, const std::string& name) {
  std::vector<int64_t> docs, lengths;
  for (int64_t d = 0; d < v.num_docs; ++d) {
    const int64_t len = doc_length(v, d);
    if (len < 2) continue;
    if (len > capacity)
      throw DataError(fmt::format(
          "data: document {} of '{}' has {} tokens; evaluation takes documents whole, up to "
          "train.batch_rows x train.seq_len + 1 = {} tokens (raise either to evaluate it)",
          d, name, len, capacity));
    docs.push_back(d);
    lengths.push_back(len);
  }
  Bins bins = first_fit_decreasing(lengths, capacity);
  for (auto& bin : bins)
    for (int64_t& i : bin) i = docs[i];
  return bins;
}

PackedRow bin_row(const TokenView& v, const std::vector<int64_t>& bin, int64_t capacity) {
  PackedRow row;
  for (const int64_t d : bin)
    for (uint64_t i = v.doc_offsets[d]; i < v.doc_offsets[d + 1]; ++i) {
      row.tokens.push_back(static_cast<int32_t>(v.tokens[i]));
      row.segment_start.push_back(i == v.doc_offsets[d]);
      row.counts.push_back(!v.loss_mask || v.loss_mask[i]);
    }
  pad_row(row, capacity);
  return row;
}
}  // namespace

EvalResult evaluate_tokens(Qwen3Moe& model, const TokenView& docs, int64_t rows, int64_t seq_len,
                           dist::Communicator* world, const TokenLossSink* per_token,
                           const std::string& name) {
  const int64_t ranks = world ? world->size() : 1, rank = world ? world->rank() : 0;
  // Context parallelism: the cp ranks of a group share a micro-batch, each its chunks of it.
  const int64_t cp = model.mesh() ? model.mesh()->cp_size() : 1, groups = ranks / cp;
  const int64_t n = rows * seq_len;  // inputs per micro-batch
  const Bins bins = pack_documents(docs, n + 1, name);
  const int64_t batches = (static_cast<int64_t>(bins.size()) + groups - 1) / groups;
  static const std::vector<int64_t> kNone;
  std::vector<std::pair<int64_t, double>>
      token_losses;  // rank 0, with per_token: sorted at the end
  double loss_sum = 0;
  int64_t tokens = 0;
  const ModelConfig& c = model.config();
  // Each gathered token loss's place in the groups' micro-batches laid end to end (rank 0).
  std::vector<int64_t> place;
  if (per_token && rank == 0)
    for (int64_t r = 0; r < ranks; ++r) {
      const Tensor mine = cp > 1 ? ops::context_parallel_rows({n, cp, r % cp}) : Tensor();
      for (int64_t j = 0; j < n / cp; ++j)
        place.push_back((r / cp) * n + (cp > 1 ? mine.data<int32_t>()[j] : j));
    }
  for (int64_t b = 0; b < batches; ++b) {
    auto bin_of = [&](int64_t g) -> const std::vector<int64_t>& {
      const int64_t i = b * groups + g;
      return i < static_cast<int64_t>(bins.size()) ? bins[i] : kNone;
    };
    Batch batch = pack_rows({bin_row(docs, bin_of(rank / cp), n + 1)}, n);
    if (cp > 1) batch = context_shard(batch, n, cp, rank % cp);
    tokens += batch.masked_tokens();
    if (c.device != Device::kCPU) batch = batch.to(c.device);
    if (!per_token) {
      loss_sum += model.forward(batch).ce_sum;
      continue;
    }
    Tensor losses = Tensor::empty({batch.size()}, c.stat_dtype(), c.device);
    loss_sum += model.forward(batch, &losses).ce_sum;
    // Every rank's micro-batch of this round, rank-major, on rank 0.
    const Tensor mine = losses.to(Device::kCPU).to(DType::kF64);
    Tensor all = mine;
    if (world && ranks > 1) {
      all = Tensor::empty({mine.numel() * ranks}, DType::kF64);
      world->all_gather(mine, all);
    }
    if (rank != 0) continue;
    std::vector<double> batch_losses(groups * n);
    for (int64_t i = 0; i < all.numel(); ++i) batch_losses[place[i]] = all.data<double>()[i];
    for (int64_t g = 0; g < groups; ++g) {
      int64_t at = 0;  // the document's first token in the micro-batch
      for (const int64_t d : bin_of(g)) {
        const int64_t first = static_cast<int64_t>(docs.doc_offsets[d]), len = doc_length(docs, d);
        for (int64_t i = 1; i < len; ++i)  // target i of the document is input at + i - 1's
          if (!docs.loss_mask || docs.loss_mask[first + i])
            token_losses.emplace_back(first + i, batch_losses[g * n + at + i - 1]);
        at += len;
      }
    }
  }
  std::sort(token_losses.begin(), token_losses.end());
  for (const auto& [target, loss] : token_losses) (*per_token)(target, loss);
  Tensor sums = Tensor::empty({2}, DType::kF64);
  sums.data<double>()[0] = loss_sum;
  sums.data<double>()[1] = static_cast<double>(tokens);
  if (world && world->size() > 1) world->all_reduce(sums);
  return {sums.data<double>()[0], static_cast<int64_t>(sums.data<double>()[1])};
}

}  // namespace mt
