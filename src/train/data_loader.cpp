#include "train/data_loader.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"
#include "core/rng.h"
#include "train/synthetic_data.h"
#include "train/token_file.h"

namespace mt {

Batch pack_rows(const std::vector<PackedRow>& rows, int64_t seq_len) {
  const int64_t n = static_cast<int64_t>(rows.size()) * seq_len;
  Batch b;
  b.tokens = Tensor::empty({n}, DType::kI32);
  b.targets = Tensor::empty({n}, DType::kI32);
  b.loss_mask = Tensor::empty({n}, DType::kU8);
  b.positions = Tensor::empty({n}, DType::kI32);
  std::vector<int32_t> cu;
  for (size_t r = 0; r < rows.size(); ++r) {
    const PackedRow& row = rows[r];
    MT_CHECK(static_cast<int64_t>(row.tokens.size()) == seq_len + 1,
             "row of {} tokens, expected {}", row.tokens.size(), seq_len + 1);
    int64_t start = 0;
    for (int64_t i = 0; i < seq_len; ++i) {
      const int64_t at = static_cast<int64_t>(r) * seq_len + i;
      if (i == 0 || row.segment_start[i]) {
        start = i;
        cu.push_back(static_cast<int32_t>(at));
      }
      b.tokens.data<int32_t>()[at] = row.tokens[i];
      b.targets.data<int32_t>()[at] = row.tokens[i + 1];
      b.loss_mask.data<uint8_t>()[at] = row.counts[i + 1] && !row.segment_start[i + 1];
      b.positions.data<int32_t>()[at] = static_cast<int32_t>(i - start);
    }
  }
  cu.push_back(static_cast<int32_t>(n));
  b.cu_seqlens = Tensor::empty({static_cast<int64_t>(cu.size())}, DType::kI32);
  std::copy(cu.begin(), cu.end(), b.cu_seqlens.data<int32_t>());
  b.max_seqlen = ops::max_document_length(b.cu_seqlens);
  return b;
}

namespace {

// The entropy (nats) of the distribution counts[id] / sum: a count per token id, zeros skipped.
double entropy_of_counts(const std::vector<int64_t>& counts) {
  int64_t total = 0;
  for (const int64_t c : counts) total += c;
  double h = 0;
  for (const int64_t c : counts)
    if (c > 0) {
      const double p = static_cast<double>(c) / static_cast<double>(total);
      h -= p * std::log(p);
    }
  return h;
}

class SyntheticLoader : public DataLoader {
 public:
  SyntheticLoader(const SyntheticSpec& spec) : lang_(spec) {}

  Batch next(int64_t rows, int64_t seq_len) override {
    std::vector<PackedRow> packed;
    for (int64_t r = 0; r < rows; ++r) packed.push_back(row(next_row_++, seq_len));
    return pack_rows(packed, seq_len);
  }
  void skip(int64_t rows, int64_t) override { next_row_ += rows; }
  int64_t position() const override { return next_row_; }
  void set_position(int64_t p) override { next_row_ = p; }

  // Floor and unigram entropy over the first kStatRows rows of the stream.
  DataStats stats(int64_t seq_len) const override {
    constexpr int64_t kStatRows = 256;
    std::vector<int64_t> counts;
    double nll = 0;
    int64_t n = 0;
    for (int64_t r = 0; r < kStatRows; ++r) {
      const SyntheticRow s = lang_.make_row(r, seq_len);
      for (int64_t i = 1; i <= seq_len; ++i) {
        if (s.doc_start[i]) continue;  // masked: a target across documents
        nll += s.true_nll[i];
        if (static_cast<size_t>(s.tokens[i]) >= counts.size()) counts.resize(s.tokens[i] + 1, 0);
        counts[s.tokens[i]] += 1;
        ++n;
      }
    }
    return {nll / n, entropy_of_counts(counts)};
  }

 private:
  PackedRow row(int64_t index, int64_t seq_len) const {
    SyntheticRow s = lang_.make_row(index, seq_len);
    return {std::move(s.tokens), std::move(s.doc_start), std::vector<uint8_t>(seq_len + 1, 1)};
  }
  SyntheticLanguages lang_;
  int64_t next_row_ = 0;
};

// Documents streamed end to end, epoch after epoch, each epoch in its own order (a permutation
// of the documents drawn from the seed and the epoch; the file's order without shuffling); a
// document that does not fit a row continues at the start of the next one (as a new attention
// segment). The position is the index of the next row's first token in that endless stream, so
// it also says the epoch (position / tokens in the file).
class TokenFileLoader : public DataLoader {
 public:
  TokenFileLoader(std::unique_ptr<MappedTokenFile> file, bool shuffle, uint64_t seed)
      : file_(std::move(file)), shuffle_(shuffle), seed_(seed) {}

  Batch next(int64_t rows, int64_t seq_len) override {
    const TokenView& v = file_->view();
    std::vector<PackedRow> packed;
    for (int64_t r = 0; r < rows; ++r) {
      PackedRow row;
      for (int64_t i = 0; i <= seq_len; ++i) {
        const Place p = locate(pos_ + i);
        row.tokens.push_back(static_cast<int32_t>(v.tokens[p.token]));
        row.segment_start.push_back(p.doc_start);
        row.counts.push_back(v.loss_mask ? v.loss_mask[p.token] : 1);
      }
      pos_ += seq_len;
      packed.push_back(std::move(row));
    }
    return pack_rows(packed, seq_len);
  }
  void skip(int64_t rows, int64_t seq_len) override { pos_ += rows * seq_len; }
  int64_t position() const override { return pos_; }
  void set_position(int64_t p) override {
    if (p < 0) throw CheckpointError(fmt::format("checkpoint data position {} is negative", p));
    pos_ = p;
  }
  // The unigram entropy of the counted targets among the file's first 2^24 tokens (a count per
  // token id: a pass over them, no tree).
  DataStats stats(int64_t) const override {
    constexpr int64_t kStatTokens = int64_t{1} << 24;
    const TokenView& v = file_->view();
    const int64_t n = std::min(v.num_tokens, kStatTokens);
    std::vector<int64_t> counts(*std::max_element(v.tokens, v.tokens + n) + 1, 0);
    for (int64_t i = 0; i < n; ++i)
      if ((!v.loss_mask || v.loss_mask[i]) && !v.is_doc_start(i)) ++counts[v.tokens[i]];
    return {std::numeric_limits<double>::quiet_NaN(), entropy_of_counts(counts)};
  }

 private:
  struct Place {
    int64_t token;  // index into the file's tokens
    uint8_t doc_start;
  };
  // Token `at` of the stream.
  Place locate(int64_t at) {
    const TokenView& v = file_->view();
    const int64_t epoch = at / v.num_tokens, r = at % v.num_tokens;
    if (!shuffle_) return {r, static_cast<uint8_t>(v.is_doc_start(r))};
    if (epoch != epoch_) order_epoch(epoch);
    // The last document of the order that starts at or before r (empty documents start where
    // the next one does and are passed over).
    const auto k = std::upper_bound(starts_.begin(), starts_.end(), static_cast<uint64_t>(r)) -
                   starts_.begin() - 1;
    const uint64_t doc = order_[k];
    return {static_cast<int64_t>(v.doc_offsets[doc] + (r - starts_[k])),
            static_cast<uint8_t>(static_cast<uint64_t>(r) == starts_[k])};
  }
  // Fisher-Yates over the documents with random numbers of (seed, epoch): the same order on
  // every rank and at every resume.
  void order_epoch(int64_t epoch) {
    const TokenView& v = file_->view();
    const CounterRng rng{seed_, 0x5348554646ull + static_cast<uint64_t>(epoch)};  // "SHUFF"
    order_.resize(v.num_docs);
    for (int64_t d = 0; d < v.num_docs; ++d) order_[d] = d;
    for (int64_t i = v.num_docs - 1; i > 0; --i) {
      const Philox4x32 b = rng.block(static_cast<uint64_t>(i));
      const uint64_t x = (static_cast<uint64_t>(b.v[0]) << 32) | b.v[1];
      const auto j = static_cast<int64_t>(x % static_cast<uint64_t>(i + 1));  // bias < 2^-30
      std::swap(order_[i], order_[j]);
    }
    starts_.resize(v.num_docs);
    uint64_t at = 0;
    for (int64_t k = 0; k < v.num_docs; ++k) {
      starts_[k] = at;
      at += v.doc_offsets[order_[k] + 1] - v.doc_offsets[order_[k]];
    }
    epoch_ = epoch;
  }

  std::unique_ptr<MappedTokenFile> file_;
  bool shuffle_;
  uint64_t seed_;
  int64_t pos_ = 0;
  int64_t epoch_ = -1;            // the epoch order_ and starts_ are for
  std::vector<uint64_t> order_;   // documents in this epoch's order
  std::vector<uint64_t> starts_;  // where each of them starts in the epoch's stream
};

}  // namespace

std::unique_ptr<DataLoader> make_data_loader(const Config& c) {
  switch (c.data.source) {
    case DataSourceKind::kSynthetic:
      return std::make_unique<SyntheticLoader>(SyntheticSpec{c.model.vocab_size, c.data.languages,
                                                             c.data.branching, c.data.min_doc_len,
                                                             c.data.max_doc_len, c.data.seed});
    case DataSourceKind::kTokens:
    case DataSourceKind::kSft: {
      auto file = std::make_unique<MappedTokenFile>(c.data.path, c.model.vocab_size);
      if (c.data.source == DataSourceKind::kSft && !file->view().loss_mask)
        throw DataError(fmt::format(
            "data: data.source = \"sft\" needs a loss mask, and '{}' has none (flags bit 0)",
            c.data.path));
      return std::make_unique<TokenFileLoader>(std::move(file), c.data.shuffle, c.data.seed);
    }
  }
  MT_CHECK(false, "unknown data source");
}

}  // namespace mt
