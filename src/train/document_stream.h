// The documents of one or more token files in an endless, deterministic order. Each file is read
// epoch after epoch, each epoch in its own order (a Fisher-Yates permutation drawn from the seed,
// the file and the epoch; the file's order without shuffling). Several files are blended in
// proportion to their weights as Megatron blends datasets: document i of the stream comes from
// the file furthest behind its share (largest weight_f * (i + 1) - taken_f, ties to the earlier
// file), so any prefix of the stream holds each file's share to within one document. The whole
// state is how many documents have been taken from each file.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "train/config.h"
#include "train/token_file.h"

namespace mt {

enum class DocumentOrder { kShuffled, kFileOrder };

struct Document {
  const uint32_t* tokens = nullptr;
  const uint8_t* loss_mask = nullptr;  // null: every token counts
  int64_t length = 0;
  int file = 0;               // index into the stream's files
  int64_t index = 0;          // the document's index in its file
  bool starts_epoch = false;  // the first of an epoch of its file
};

class DocumentStream {
 public:
  // Opens and checks every file (DataError naming the file); weights > 0. The weights are
  // normalised here.
  DocumentStream(const std::vector<DataFile>& files, int64_t vocab_size, DocumentOrder order,
                 uint64_t seed);
  ~DocumentStream();
  DocumentStream(const DocumentStream&) = delete;
  DocumentStream& operator=(const DocumentStream&) = delete;

  Document next();
  // The state: documents taken from each file so far (one entry per file).
  const std::vector<int64_t>& taken() const { return taken_; }
  void set_taken(const std::vector<int64_t>& taken);

  int num_files() const { return static_cast<int>(files_.size()); }
  const std::string& path(int f) const;
  const TokenView& view(int f) const;
  double weight(int f) const;  // normalised
  int64_t total_documents() const;
  // The token read from document d at i, checked again (the file was checked when opened; one
  // changed in place since is a DataError naming it, not an out-of-range embedding row).
  uint32_t token(const Document& d, int64_t i) const;

 private:
  struct File;
  int next_file() const;
  Document document(int f, int64_t k);  // the k-th document of file f's endless stream
  std::vector<std::unique_ptr<File>> files_;
  std::vector<int64_t> taken_;
  DocumentOrder order_;
  uint64_t seed_;
  int64_t vocab_size_;
};

}  // namespace mt
