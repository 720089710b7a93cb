// Evaluation: forward passes only over every token of a token file, once (no wrap-around): the
// rows of seq_len + 1 tokens step by seq_len as training packs them (each target in exactly one
// row; a document's first token is never a target), the last row padded with uncounted tokens.
// Ranks take consecutive blocks of batch_rows rows per batch; every rank runs the same number of
// batches (missing rows are all uncounted), and the sums are all-reduced.
#pragma once
#include <cstdint>
#include <functional>

#include "dist/communicator.h"
#include "model/qwen3_moe.h"
#include "train/token_file.h"

namespace mt {

struct EvalResult {
  double loss_sum = 0;  // nats over the counted targets of the whole file
  int64_t tokens = 0;   // counted targets
  double mean() const { return tokens > 0 ? loss_sum / static_cast<double>(tokens) : 0.0; }
};

// Each counted target's loss, on rank 0, in file order: `target` indexes the file's tokens.
using TokenLossSink = std::function<void(int64_t target, double loss)>;

// Collective over world (null: one rank). With `per_token` (given on every rank, called on rank
// 0) every batch's token losses are gathered to rank 0.
EvalResult evaluate_tokens(Qwen3Moe& model, const TokenView& docs, int64_t rows, int64_t seq_len,
                           dist::Communicator* world, const TokenLossSink* per_token = nullptr);

}  // namespace mt
