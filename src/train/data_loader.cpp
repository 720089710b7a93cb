#include "train/data_loader.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"
#include "core/parse.h"
#include "core/rng.h"
#include "train/document_stream.h"
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
  b.padding = Tensor::zeros({n}, DType::kU8);
  std::vector<int32_t> cu;
  for (size_t r = 0; r < rows.size(); ++r) {
    const PackedRow& row = rows[r];
    MT_CHECK(static_cast<int64_t>(row.tokens.size()) == seq_len + 1 &&
                 row.segment_start.size() == row.tokens.size() &&
                 row.counts.size() == row.tokens.size(),
             "row of {} tokens, expected {}", row.tokens.size(), seq_len + 1);
    const int64_t pad = row.padding_from.value_or(seq_len + 1);
    auto starts = [&](int64_t i) { return i == 0 || i == pad || row.segment_start[i]; };
    int64_t start = 0;
    for (int64_t i = 0; i < seq_len; ++i) {
      const int64_t at = static_cast<int64_t>(r) * seq_len + i;
      if (starts(i)) {
        start = i;
        cu.push_back(static_cast<int32_t>(at));
      }
      b.tokens.data<int32_t>()[at] = row.tokens[i];
      b.targets.data<int32_t>()[at] = row.tokens[i + 1];
      b.loss_mask.data<uint8_t>()[at] = i + 1 < pad && row.counts[i + 1] && !starts(i + 1);
      b.positions.data<int32_t>()[at] = static_cast<int32_t>(i - start);
      if (i >= pad) {
        b.padding.data<uint8_t>()[at] = 1;
        ++b.padding_tokens;
      }
    }
  }
  cu.push_back(static_cast<int32_t>(n));
  b.cu_seqlens = Tensor::empty({static_cast<int64_t>(cu.size())}, DType::kI32);
  std::copy(cu.begin(), cu.end(), b.cu_seqlens.data<int32_t>());
  b.max_seqlen = ops::max_document_length(b.cu_seqlens);
  b.long_documents = ops::count_long_documents(b.cu_seqlens, b.max_seqlen);
  return b;
}

void pad_row(PackedRow& row, int64_t row_tokens) {
  const auto used = static_cast<int64_t>(row.tokens.size());
  MT_CHECK(used <= row_tokens, "a row of {} tokens holds documents of {}", row_tokens, used);
  if (used < row_tokens) row.padding_from = used;
  row.tokens.resize(row_tokens, 0);
  row.segment_start.resize(row_tokens, 0);
  row.counts.resize(row_tokens, 0);
}

std::string format_data_state(const DataState& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i > 0) out.push_back(',');
    out.append(std::to_string(s[i]));
  }
  return out;
}

std::optional<DataState> parse_data_state(const std::string& text) {
  DataState s;
  size_t at = 0;
  while (true) {
    const size_t end = std::min(text.find(',', at), text.size());
    const std::optional<int64_t> v = parse_int64(std::string_view(text).substr(at, end - at));
    if (!v || *v < 0) return std::nullopt;
    s.push_back(*v);
    if (end == text.size()) return s;
    at = end + 1;
  }
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

int64_t single_position(const DataState& s, const char* what) {
  if (s.size() != 1)
    throw CheckpointError(fmt::format(
        "checkpoint: the data position has {} fields; {} takes one (data.source or data.packing "
        "changed since the checkpoint?)",
        s.size(), what));
  return s[0];
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
  DataState state() const override { return {next_row_}; }
  void set_state(const DataState& s) override {
    next_row_ = single_position(s, "the synthetic languages");
  }
  std::string packing_report(int64_t) override { return ""; }

  // Floor and unigram entropy over the first kStatRows rows of the stream.
  DataStats stats(int64_t seq_len) override {
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
    return {std::move(s.tokens), std::move(s.doc_start), std::vector<uint8_t>(seq_len + 1, 1), {}};
  }
  SyntheticLanguages lang_;
  int64_t next_row_ = 0;
};

// What token-file loaders share: the document stream and the unigram statistics.
class TokenFilesLoader : public DataLoader {
 public:
  explicit TokenFilesLoader(const Config& c)
      : docs_(c.data.files(), c.model.vocab_size,
              c.data.shuffle ? DocumentOrder::kShuffled : DocumentOrder::kFileOrder, c.data.seed) {
    if (c.data.source != DataSourceKind::kSft) return;
    for (int f = 0; f < docs_.num_files(); ++f)
      if (!docs_.view(f).loss_mask)
        throw DataError(fmt::format(
            "data: data.source = \"sft\" needs a loss mask, and '{}' has none (flags bit 0)",
            docs_.path(f)));
  }

  // The unigram entropy of the counted targets among each file's first 2^24 tokens (a count per
  // token id: a pass over them, no tree).
  DataStats stats(int64_t) override {
    constexpr int64_t kStatTokens = int64_t{1} << 24;
    std::vector<int64_t> counts;
    for (int f = 0; f < docs_.num_files(); ++f) {
      const TokenView& v = docs_.view(f);
      const int64_t n = std::min(v.num_tokens, kStatTokens);
      const uint32_t top = *std::max_element(v.tokens, v.tokens + n);
      if (counts.size() <= top) counts.resize(top + 1, 0);
      for (int64_t i = 0; i < n; ++i)
        if ((!v.loss_mask || v.loss_mask[i]) && !v.is_doc_start(i)) ++counts[v.tokens[i]];
    }
    return {std::numeric_limits<double>::quiet_NaN(), entropy_of_counts(counts)};
  }

 protected:
  DocumentStream docs_;
};

// Documents laid end to end, epoch after epoch; a document that does not fit a row continues at
// the start of the next one (as a new attention segment, positions from 0). Rows overlap by one
// token (the last target of a row is the next row's first input). The state: the stream's
// position before the document holding the next row's first token, and that token's offset in
// it.
class StreamLoader : public TokenFilesLoader {
 public:
  explicit StreamLoader(const Config& c) : TokenFilesLoader(c) { set_cursor(docs_.taken(), 0); }

  Batch next(int64_t rows, int64_t seq_len) override {
    std::vector<PackedRow> packed;
    for (int64_t r = 0; r < rows; ++r) {
      PackedRow row;
      for (int64_t i = 0; i <= seq_len; ++i) {
        if (off_ == doc_.length) advance();
        row.tokens.push_back(static_cast<int32_t>(docs_.token(doc_, off_)));
        row.segment_start.push_back(off_ == 0);
        row.counts.push_back(doc_.loss_mask ? doc_.loss_mask[off_] : 1);
        if (i < seq_len) ++off_;
      }
      packed.push_back(std::move(row));
    }
    return pack_rows(packed, seq_len);
  }
  void skip(int64_t rows, int64_t seq_len) override { skip_tokens(rows * seq_len); }
  DataState state() const override {
    DataState s = before_;
    s.push_back(off_);
    return s;
  }
  void set_state(const DataState& s) override {
    if (s.size() == 1 && docs_.num_files() == 1) return set_token_position(s[0]);
    if (s.size() != static_cast<size_t>(docs_.num_files()) + 1)
      throw CheckpointError(fmt::format(
          "checkpoint: the data position has {} fields; stream packing over {} files takes {} "
          "(data.mix or data.packing changed since the checkpoint?)",
          s.size(), docs_.num_files(), docs_.num_files() + 1));
    set_cursor(DataState(s.begin(), s.end() - 1), s.back());
  }
  std::string packing_report(int64_t) override { return ""; }

 private:
  // The next non-empty document.
  void advance() {
    do {
      before_ = docs_.taken();
      doc_ = docs_.next();
    } while (doc_.length == 0);
    off_ = 0;
  }
  void set_cursor(const DataState& before, int64_t off) {
    docs_.set_taken(before);
    advance();
    if (off >= doc_.length)
      throw CheckpointError(fmt::format(
          "checkpoint: the data position's offset {} is past its document ({} tokens of '{}'; "
          "the data changed since the checkpoint?)",
          off, doc_.length, docs_.path(doc_.file)));
    off_ = off;
  }
  // A checkpoint from before blends: the index of the next row's first token in one file's
  // endless stream.
  void set_token_position(int64_t p) {
    if (p < 0) throw CheckpointError(fmt::format("checkpoint: data position {} is negative", p));
    const TokenView& v = docs_.view(0);
    const int64_t epoch = p / v.num_tokens;
    int64_t left = p % v.num_tokens;
    set_cursor({epoch * v.num_docs}, 0);
    skip_tokens(left);
  }
  void skip_tokens(int64_t left) {
    while (left >= doc_.length - off_) {
      left -= doc_.length - off_;
      advance();
    }
    off_ += left;
  }

  DataState before_;  // the stream's state before doc_
  Document doc_;
  int64_t off_ = 0;
};

// Whole documents per row: windows of up to data.pack_window documents (a window also ends
// before a document that starts an epoch of its file, so an epoch is its documents' rows) are
// packed by first-fit decreasing into rows of seq_len + 1 tokens, each row's documents in
// placement order and its tail padding. With data.shuffle the window's rows go out in an order
// drawn from the seed and the window (as TRL's and torchtune's samplers shuffle packed rows):
// first-fit decreasing opens the rows of the longest documents first, and emitting them so would
// give each window's first steps its longest documents (the costliest attention, a length-sorted
// curriculum); without it, in the order they were opened. Documents longer than a row follow
// data.overlong; empty ones are passed over. The state: the stream's position at the window's
// start and the rows of the window already emitted.
class WholeLoader : public TokenFilesLoader {
 public:
  explicit WholeLoader(const Config& c)
      : TokenFilesLoader(c),
        window_(c.data.pack_window),
        overlong_(c.data.overlong),
        row_order_(c.data.shuffle ? DocumentOrder::kShuffled : DocumentOrder::kFileOrder),
        seed_(c.data.seed) {
    window_start_ = docs_.taken();
  }

  Batch next(int64_t rows, int64_t seq_len) override {
    std::vector<PackedRow> packed;
    for (int64_t r = 0; r < rows; ++r) {
      ensure_row(seq_len);
      packed.push_back(make_row(rows_[row_in_window_++], seq_len));
    }
    return pack_rows(packed, seq_len);
  }
  void skip(int64_t rows, int64_t seq_len) override {
    for (int64_t r = 0; r < rows; ++r) {
      ensure_row(seq_len);
      ++row_in_window_;
    }
  }
  DataState state() const override {
    DataState s = window_start_;
    s.push_back(row_in_window_);
    return s;
  }
  void set_state(const DataState& s) override {
    if (s.size() != static_cast<size_t>(docs_.num_files()) + 1)
      throw CheckpointError(fmt::format(
          "checkpoint: the data position has {} fields; whole packing over {} files takes {} "
          "(a checkpoint of stream packing, or data.mix changed since it?)",
          s.size(), docs_.num_files(), docs_.num_files() + 1));
    docs_.set_taken(DataState(s.begin(), s.end() - 1));  // checks the fields
    window_start_ = DataState(s.begin(), s.end() - 1);
    row_in_window_ = s.back();
    rows_.clear();
    capacity_ = -1;
  }

  // Every document is measured (documents longer than a row, per file), then the first epoch
  // (as many documents as the files hold; at most 2^20) is packed as training will pack it.
  std::string packing_report(int64_t seq_len) override {
    const int64_t capacity = seq_len + 1;
    std::string out;
    int64_t usable = 0;
    for (int f = 0; f < docs_.num_files(); ++f) {
      const TokenView& v = docs_.view(f);
      int64_t longer = 0, longest = 0, first = -1;
      for (int64_t d = 0; d < v.num_docs; ++d) {
        const auto len = static_cast<int64_t>(v.doc_offsets[d + 1] - v.doc_offsets[d]);
        usable += len > 0 && (len <= capacity || overlong_ != Overlong::kDrop);
        if (len <= capacity) continue;
        if (first < 0) first = d;
        ++longer;
        longest = std::max(longest, len);
      }
      if (longer > 0 && overlong_ == Overlong::kError)
        throw DataError(fmt::format(
            "data: document {} of '{}' has {} tokens, longer than a row of train.seq_len + 1 = "
            "{} ({} such documents, the longest {}); raise train.seq_len, or set data.overlong "
            "= \"truncate\" or \"drop\"",
            first, docs_.path(f), v.doc_offsets[first + 1] - v.doc_offsets[first], capacity, longer,
            longest));
      if (longer > 0)
        out += fmt::format(
            "{} of {} documents of '{}' are longer than a row of {} tokens (the "
            "longest {}): {}; ",
            longer, v.num_docs, docs_.path(f), capacity, longest,
            overlong_ == Overlong::kTruncate ? "truncated" : "dropped");
    }
    if (usable == 0)
      throw DataError(fmt::format(
          "data: no document of {} can fill a row (all are empty{})", docs_.path(0),
          overlong_ == Overlong::kDrop ? " or longer than a row, and data.overlong = \"drop\""
                                       : ""));
    // The first epoch, packed from a copy of the position.
    const DataState saved = state();
    set_state(DataState(docs_.num_files() + 1, 0));
    const int64_t docs = std::min<int64_t>(docs_.total_documents(), int64_t{1} << 20);
    int64_t real = 0, rows = 0;
    do {
      ensure_row(seq_len);  // the next window with rows
      for (; row_in_window_ < static_cast<int64_t>(rows_.size()); ++row_in_window_, ++rows)
        for (const Piece& p : rows_[row_in_window_]) real += p.length;
    } while (docs_taken_since_start() < docs);
    set_state(saved);
    return out + fmt::format(
                     "whole packing fills {:.1f}% of the row tokens over the first {} "
                     "documents ({} rows of {} tokens)",
                     100.0 * static_cast<double>(real) / static_cast<double>(rows * capacity), docs,
                     rows, capacity);
  }

 private:
  struct Piece {
    Document doc;
    int64_t length;  // after truncation
  };

  int64_t docs_taken_since_start() const {
    int64_t n = 0;
    for (const int64_t t : docs_.taken()) n += t;
    return n;
  }
  // rows_[row_in_window_] exists: the window packed, or the next windows until one has rows.
  void ensure_row(int64_t seq_len) {
    if (capacity_ != seq_len + 1) {  // first use, or after set_state
      capacity_ = seq_len + 1;
      pack_window();
    }
    while (row_in_window_ >= static_cast<int64_t>(rows_.size())) {
      const int64_t past = row_in_window_ - static_cast<int64_t>(rows_.size());
      window_start_ = docs_.taken();  // the end of the window just emitted
      row_in_window_ = past;
      pack_window();
    }
  }
  void pack_window() {
    docs_.set_taken(window_start_);
    std::vector<Piece> pieces;
    for (int64_t taken = 0; taken < window_; ++taken) {
      const DataState before = docs_.taken();
      const Document d = docs_.next();
      if (taken > 0 && d.starts_epoch) {
        docs_.set_taken(before);
        break;
      }
      if (d.length == 0) continue;
      if (d.length > capacity_) {
        if (overlong_ == Overlong::kDrop) continue;
        if (overlong_ == Overlong::kError)
          throw DataError(fmt::format(
              "data: document {} of '{}' has {} tokens, longer than a row of train.seq_len + 1 "
              "= {}; raise train.seq_len, or set data.overlong = \"truncate\" or \"drop\"",
              d.index, docs_.path(d.file), d.length, capacity_));
      }
      pieces.push_back({d, std::min(d.length, capacity_)});
    }
    std::vector<int64_t> lengths;
    for (const Piece& p : pieces) lengths.push_back(p.length);
    rows_.clear();
    for (const std::vector<int64_t>& bin : first_fit_decreasing(lengths, capacity_)) {
      rows_.emplace_back();
      for (const int64_t i : bin) rows_.back().push_back(pieces[i]);
    }
    if (row_order_ == DocumentOrder::kShuffled) shuffle_rows();
  }
  // Fisher-Yates with random numbers of (seed, the documents taken before the window): windows
  // start at increasing counts, so each has its own order, the same on every rank and at resume.
  void shuffle_rows() {
    int64_t before = 0;
    for (const int64_t t : window_start_) before += t;
    const CounterRng rng{seed_, (uint64_t{0x524F5753} << 32) + static_cast<uint64_t>(before)};
    for (auto i = static_cast<int64_t>(rows_.size()) - 1; i > 0; --i)
      std::swap(rows_[i], rows_[rng.below(static_cast<uint64_t>(i), static_cast<uint32_t>(i + 1))]);
  }
  PackedRow make_row(const std::vector<Piece>& pieces, int64_t seq_len) const {
    PackedRow row;
    for (const Piece& p : pieces)
      for (int64_t i = 0; i < p.length; ++i) {
        row.tokens.push_back(static_cast<int32_t>(docs_.token(p.doc, i)));
        row.segment_start.push_back(i == 0);
        row.counts.push_back(p.doc.loss_mask ? p.doc.loss_mask[i] : 1);
      }
    pad_row(row, seq_len + 1);
    return row;
  }

  int64_t window_;
  Overlong overlong_;
  DocumentOrder row_order_;  // kFileOrder: as first-fit decreasing opened them
  uint64_t seed_;
  DataState window_start_;
  int64_t row_in_window_ = 0;
  int64_t capacity_ = -1;                 // seq_len + 1 of the packed window; -1: not packed
  std::vector<std::vector<Piece>> rows_;  // the window's rows
};

}  // namespace

std::unique_ptr<DataLoader> make_data_loader(const Config& c) {
  switch (c.data.source) {
    case DataSourceKind::kSynthetic:
      return std::make_unique<SyntheticLoader>(SyntheticSpec{c.model.vocab_size, c.data.languages,
                                                             c.data.branching, c.data.min_doc_len,
                                                             c.data.max_doc_len, c.data.seed});
    case DataSourceKind::kTokens:
    case DataSourceKind::kSft:
      if (c.data.resolved_packing() == Packing::kWhole) return std::make_unique<WholeLoader>(c);
      return std::make_unique<StreamLoader>(c);
  }
  MT_CHECK(false, "unknown data source");
}

}  // namespace mt
