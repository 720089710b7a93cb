#include "train/data_loader.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

#include "core/error.h"
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

double entropy_of_counts(const std::map<int32_t, int64_t>& counts) {
  int64_t total = 0;
  for (const auto& [_, c] : counts) total += c;
  double h = 0;
  for (const auto& [_, c] : counts) {
    const double p = static_cast<double>(c) / total;
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
    std::map<int32_t, int64_t> counts;
    double nll = 0;
    int64_t n = 0;
    for (int64_t r = 0; r < kStatRows; ++r) {
      const SyntheticRow s = lang_.make_row(r, seq_len);
      for (int64_t i = 1; i <= seq_len; ++i) {
        if (s.doc_start[i]) continue;  // masked: a target across documents
        nll += s.true_nll[i];
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

// Documents streamed end to end, wrapping around at the end of the file; a document that does
// not fit a row continues at the start of the next one (as a new attention segment).
class TokenFileLoader : public DataLoader {
 public:
  TokenFileLoader(TokenDocuments docs) : docs_(std::move(docs)) {}

  Batch next(int64_t rows, int64_t seq_len) override {
    std::vector<PackedRow> packed;
    for (int64_t r = 0; r < rows; ++r) {
      PackedRow row;
      for (int64_t i = 0; i <= seq_len; ++i) {
        const uint64_t at = static_cast<uint64_t>(pos_ + i) % docs_.tokens.size();
        row.tokens.push_back(static_cast<int32_t>(docs_.tokens[at]));
        row.segment_start.push_back(is_doc_start(at));
        row.counts.push_back(docs_.loss_mask.empty() ? 1 : docs_.loss_mask[at]);
      }
      pos_ = (pos_ + seq_len) % static_cast<int64_t>(docs_.tokens.size());
      packed.push_back(std::move(row));
    }
    return pack_rows(packed, seq_len);
  }
  void skip(int64_t rows, int64_t seq_len) override {
    pos_ = (pos_ + rows * seq_len) % static_cast<int64_t>(docs_.tokens.size());
  }
  int64_t position() const override { return pos_; }
  void set_position(int64_t p) override {
    if (p < 0 || p >= static_cast<int64_t>(docs_.tokens.size()))
      throw CheckpointError(
          fmt::format("checkpoint data position {} is outside the token file's {} tokens", p,
                      docs_.tokens.size()));
    pos_ = p;
  }
  DataStats stats(int64_t) const override {
    std::map<int32_t, int64_t> counts;
    for (size_t i = 0; i < docs_.tokens.size(); ++i)
      if ((docs_.loss_mask.empty() || docs_.loss_mask[i]) && !is_doc_start(i))
        counts[static_cast<int32_t>(docs_.tokens[i])] += 1;
    return {std::numeric_limits<double>::quiet_NaN(),
            counts.empty() ? 0.0 : entropy_of_counts(counts)};
  }

 private:
  uint8_t is_doc_start(uint64_t at) const {
    return std::binary_search(docs_.doc_offsets.begin(), docs_.doc_offsets.end() - 1, at);
  }
  TokenDocuments docs_;
  int64_t pos_ = 0;
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
      TokenDocuments d = read_token_file(c.data.path, c.model.vocab_size);
      if (c.data.source == DataSourceKind::kSft && d.loss_mask.empty())
        throw DataError(fmt::format(
            "data: data.source = \"sft\" needs a loss mask, and '{}' has none (flags bit 0)",
            c.data.path));
      return std::make_unique<TokenFileLoader>(std::move(d));
    }
  }
  MT_CHECK(false, "unknown data source");
}

}  // namespace mt
