#include "train/document_stream.h"

#include <cmath>
#include <numeric>

#include "core/error.h"
#include "core/rng.h"

namespace mt {

struct DocumentStream::File {
  std::string path;
  double weight = 1;
  std::unique_ptr<MappedTokenFile> tokens;
  int64_t epoch = -1;           // the epoch `order` is for
  std::vector<uint64_t> order;  // documents in that epoch's order
};

DocumentStream::DocumentStream(const std::vector<DataFile>& files, int64_t vocab_size,
                               DocumentOrder order, uint64_t seed)
    : order_(order), seed_(seed), vocab_size_(vocab_size) {
  MT_CHECK(!files.empty(), "a document stream needs at least one file");
  double sum = 0;
  for (const DataFile& f : files) {
    MT_CHECK(std::isfinite(f.weight) && f.weight > 0, "file '{}' has weight {}", f.path, f.weight);
    sum += f.weight;
  }
  for (const DataFile& f : files) {
    auto file = std::make_unique<File>();
    file->path = f.path;
    file->weight = f.weight / sum;
    file->tokens = std::make_unique<MappedTokenFile>(f.path, vocab_size);
    if (file->tokens->view().num_tokens == 0)
      throw DataError(fmt::format("data: '{}' holds no tokens ({} documents, all empty)", f.path,
                                  file->tokens->view().num_docs));
    files_.push_back(std::move(file));
  }
  taken_.assign(files_.size(), 0);
}

DocumentStream::~DocumentStream() = default;

const std::string& DocumentStream::path(int f) const {
  return files_.at(f)->path;
}
const TokenView& DocumentStream::view(int f) const {
  return files_.at(f)->tokens->view();
}
double DocumentStream::weight(int f) const {
  return files_.at(f)->weight;
}
int64_t DocumentStream::total_documents() const {
  int64_t n = 0;
  for (const auto& f : files_) n += f->tokens->view().num_docs;
  return n;
}

void DocumentStream::set_taken(const std::vector<int64_t>& taken) {
  if (taken.size() != files_.size())
    throw CheckpointError(fmt::format(
        "checkpoint: the data position names {} files, and the data has {} (data.path or "
        "data.mix changed since the checkpoint?)",
        taken.size(), files_.size()));
  for (size_t f = 0; f < taken.size(); ++f)
    if (taken[f] < 0)
      throw CheckpointError(
          fmt::format("checkpoint: the data position of '{}' is {}; it must be >= 0",
                      files_[f]->path, taken[f]));
  taken_ = taken;
}

int DocumentStream::next_file() const {
  if (files_.size() == 1) return 0;
  const double i = static_cast<double>(std::accumulate(taken_.begin(), taken_.end(), int64_t{0}));
  int best = 0;
  double best_gap = -INFINITY;
  for (size_t f = 0; f < files_.size(); ++f) {
    const double gap = files_[f]->weight * (i + 1) - static_cast<double>(taken_[f]);
    if (gap > best_gap) {
      best_gap = gap;
      best = static_cast<int>(f);
    }
  }
  return best;
}

Document DocumentStream::document(int f, int64_t k) {
  File& file = *files_[f];
  const TokenView& v = file.tokens->view();
  const int64_t epoch = k / v.num_docs, at = k % v.num_docs;
  int64_t doc = at;
  if (order_ == DocumentOrder::kShuffled) {
    if (epoch != file.epoch) {
      // Fisher-Yates with random numbers of (seed, file, epoch): the same order on every rank
      // and at every resume. File 0's stream ids are those of the single-file loader before
      // blending, so one file's order did not change.
      const CounterRng rng{seed_, 0x5348554646ull + static_cast<uint64_t>(epoch) +
                                      (static_cast<uint64_t>(f) << 40)};  // "SHUFF"
      file.order.resize(v.num_docs);
      std::iota(file.order.begin(), file.order.end(), uint64_t{0});
      for (int64_t i = v.num_docs - 1; i > 0; --i) {
        const Philox4x32 b = rng.block(static_cast<uint64_t>(i));
        const uint64_t x = (static_cast<uint64_t>(b.v[0]) << 32) | b.v[1];
        const auto j = static_cast<int64_t>(x % static_cast<uint64_t>(i + 1));  // bias < 2^-30
        std::swap(file.order[i], file.order[j]);
      }
      file.epoch = epoch;
    }
    doc = static_cast<int64_t>(file.order[at]);
  }
  const uint64_t begin = v.doc_offsets[doc], end = v.doc_offsets[doc + 1];
  if (begin > end || end > static_cast<uint64_t>(v.num_tokens))
    throw DataError(fmt::format(
        "data: '{}' changed while it was read: document {} now runs from token {} to {} of {}",
        file.path, doc, begin, end, v.num_tokens));
  return {v.tokens + begin,
          v.loss_mask ? v.loss_mask + begin : nullptr,
          static_cast<int64_t>(end - begin),
          f,
          doc,
          at == 0};
}

uint32_t DocumentStream::token(const Document& d, int64_t i) const {
  const uint32_t t = d.tokens[i];
  if (t >= static_cast<uint64_t>(vocab_size_))
    throw DataError(fmt::format(
        "data: '{}' changed while it was read: document {} holds token {}, >= model.vocab_size {}",
        files_[d.file]->path, d.index, t, vocab_size_));
  return t;
}

Document DocumentStream::next() {
  const int f = next_file();
  return document(f, taken_[f]++);
}

}  // namespace mt
