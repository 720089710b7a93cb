// Data loaders turn a source (the synthetic languages, a token file, SFT samples) into packed
// micro-batches of fixed size: `rows` rows of `seq_len` tokens laid end to end. A loader's whole
// state is one integer position, saved in checkpoints so that resume continues the same stream.
#pragma once
#include <cstdint>
#include <memory>
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
};

// Rows -> batch: targets that start a new document are masked (no prediction across documents);
// every row starts a new attention segment.
Batch pack_rows(const std::vector<PackedRow>& rows, int64_t seq_len);

struct DataStats {
  double loss_floor = 0;       // nats/token; NaN when the source has no known floor
  double unigram_entropy = 0;  // nats/token of the counted targets
};

class DataLoader {
 public:
  virtual ~DataLoader() = default;
  virtual Batch next(int64_t rows, int64_t seq_len) = 0;
  // Advances past rows another rank consumes.
  virtual void skip(int64_t rows, int64_t seq_len) = 0;
  virtual int64_t position() const = 0;
  virtual void set_position(int64_t p) = 0;
  virtual DataStats stats(int64_t seq_len) const = 0;
};

std::unique_ptr<DataLoader> make_data_loader(const Config& c);

}  // namespace mt
