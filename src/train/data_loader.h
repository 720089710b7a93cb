// Data loaders turn a source (the synthetic languages, token files, SFT samples) into packed
// micro-batches of fixed size: `rows` rows of `seq_len` inputs, each row seq_len + 1 tokens (the
// inputs and their next-token targets). Token files are packed as data.packing says
// (train/packing.h): whole documents per row, or a stream cut at row boundaries. A loader's
// state is a few integers, saved in checkpoints so that resume continues the same rows.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "model/batch.h"
#include "train/config.h"

namespace mt {

// One packed row before it becomes tensors: seq_len + 1 tokens (inputs are [0, L), targets
// [1, L]).
struct PackedRow {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> segment_start;  // 1 where a document starts: attention and positions reset
  std::vector<uint8_t> counts;         // 1 where the token counts as a target (SFT mask)
  // Tokens from here on are padding (whole packing's row tail): their own attention segment,
  // never a counted target, and outside the routing statistics. nullopt: no padding.
  std::optional<int64_t> padding_from;
};

// A row's tail after its documents' tokens: padding up to `row_tokens` tokens (padding_from set
// where the documents end, when they leave an input to pad).
void pad_row(PackedRow& row, int64_t row_tokens);

// Rows -> batch: targets that start a new document are masked (no prediction across documents);
// every row starts a new attention segment, and so does its padding.
Batch pack_rows(const std::vector<PackedRow>& rows, int64_t seq_len);

struct DataStats {
  double loss_floor = 0;       // nats/token; NaN when the source has no known floor
  double unigram_entropy = 0;  // nats/token of the counted targets
};

// The loader's position: a few integers (which ones depends on the source and the packing).
using DataState = std::vector<int64_t>;

class DataLoader {
 public:
  virtual ~DataLoader() = default;
  virtual Batch next(int64_t rows, int64_t seq_len) = 0;
  // Advances past rows another rank consumes.
  virtual void skip(int64_t rows, int64_t seq_len) = 0;
  virtual DataState state() const = 0;
  // A state of this loader's, or (checkpoints from before whole packing and blends) the single
  // integer a one-file stream's or the synthetic source's position was. CheckpointError when it
  // cannot be this loader's.
  virtual void set_state(const DataState& s) = 0;
  virtual DataStats stats(int64_t seq_len) = 0;
  // What the packing does with the data, for the log at start (empty: nothing to say): whole
  // packing's documents longer than a row and its efficiency over the first epoch.
  virtual std::string packing_report(int64_t seq_len) = 0;
};

std::unique_ptr<DataLoader> make_data_loader(const Config& c);

// The state as the checkpoint's "data_position" holds it ("3,0,17") and back. parse: nullopt
// unless every field is a decimal integer >= 0.
std::string format_data_state(const DataState& s);
std::optional<DataState> parse_data_state(const std::string& text);

}  // namespace mt
