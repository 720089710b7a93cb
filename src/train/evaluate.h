// Evaluation: forward passes only over every document of a token file, once, each document whole
// (never cut: a document's per-token losses are the model's on that document alone, as
// transformers computes them). The documents are packed by first-fit decreasing into micro-batches
// of batch_rows x seq_len inputs, each one packed sequence (the row split is a training matter), so
// any document of up to batch_rows x seq_len + 1 tokens is evaluated whole; a longer one is a
// DataError naming it. Data-parallel ranks take consecutive micro-batches (the cp ranks of a
// context-parallel group one micro-batch, each its chunks); every rank runs the same number of
// them (missing ones are all padding), and the sums are all-reduced.
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

// Each counted target's loss, on rank 0, in file order (held until the end: the packing evaluates
// documents out of order): `target` indexes the file's tokens.
using TokenLossSink = std::function<void(int64_t target, double loss)>;

// Collective over world (null: one rank). With `per_token` (given on every rank, called on rank
// 0) every batch's token losses are gathered to rank 0. `name` names the file in errors.
EvalResult evaluate_tokens(Qwen3Moe& model, const TokenView& docs, int64_t rows, int64_t seq_len,
                           dist::Communicator* world, const TokenLossSink* per_token = nullptr,
                           const std::string& name = "the evaluation data");

}  // namespace mt
