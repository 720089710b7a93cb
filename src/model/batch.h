// One micro-batch as the model consumes it: N packed tokens (rows of the data loader laid end
// to end), documents delimited by cu_seqlens. Positions restart at every document.
// Under context parallelism (model/context_parallel.h) a rank holds n = N / cp of the rows'
// tokens: the token tensors are its own (n), the documents the whole rows' (N).
#pragma once
#include "core/tensor.h"
#include "ops/attention.h"

namespace mt {

// Which of the rows' tokens a context-parallel rank holds (context_shard).
struct ContextShard {
  // The rows' length (train.seq_len), the ranks sharing them (cp = 1: this rank holds them whole)
  // and this rank's place among them.
  ops::ContextChunks chunks{0, 1, 0};
  // i32 (n): each of this rank's tokens' position in the rows laid end to end, increasing (row b's
  // chunks rank and 2 cp - 1 - rank: ops::context_parallel_rows), on the host.
  Tensor rows;
  int64_t cp() const { return chunks.cp; }
};

struct Batch {
  Tensor tokens;      // i32 (N) input ids
  Tensor targets;     // i32 (N) next-token ids
  Tensor loss_mask;   // u8  (N) 1 where the target counts
  Tensor positions;   // i32 (N) position within the document
  Tensor cu_seqlens;  // i32 (S + 1) document boundaries, 0 ... N (the whole rows')
  // u8 (N) 1 where the token is padding (a packed row's tail: no document, its own attention
  // segment, no counted target, outside the routing statistics), else 0. Undefined: none.
  Tensor padding;
  int64_t max_seqlen = 0;       // the longest document (known on the host, never read back)
  int64_t long_documents = -1;  // ops::count_long_documents of the boundaries; -1: not counted
  int64_t padding_tokens = 0;   // how many of `padding` are 1 (on the host)
  ContextShard context;         // cp = 1: the rows whole
  int64_t size() const { return tokens.numel(); }  // this rank's tokens
  int64_t masked_tokens() const;                   // reads the mask on the host
  ops::Documents documents() const { return {cu_seqlens, max_seqlen, long_documents}; }
  Batch to(Device device) const;
};

}  // namespace mt
