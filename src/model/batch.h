// One micro-batch as the model consumes it: N packed tokens (rows of the data loader laid end
// to end), documents delimited by cu_seqlens. Positions restart at every document.
#pragma once
#include "core/tensor.h"
#include "ops/attention.h"

namespace mt {

struct Batch {
  Tensor tokens;      // i32 (N) input ids
  Tensor targets;     // i32 (N) next-token ids
  Tensor loss_mask;   // u8  (N) 1 where the target counts
  Tensor positions;   // i32 (N) position within the document
  Tensor cu_seqlens;  // i32 (S + 1) document boundaries, 0 ... N
  // u8 (N) 1 where the token is padding (a packed row's tail: no document, its own attention
  // segment, no counted target, outside the routing statistics), else 0. Undefined: none.
  Tensor padding;
  int64_t max_seqlen = 0;       // the longest document (known on the host, never read back)
  int64_t long_documents = -1;  // ops::count_long_documents of the boundaries; -1: not counted
  int64_t padding_tokens = 0;   // how many of `padding` are 1 (on the host)
  int64_t size() const { return tokens.numel(); }
  int64_t masked_tokens() const;  // reads the mask on the host
  ops::Documents documents() const { return {cu_seqlens, max_seqlen, long_documents}; }
  Batch to(Device device) const;
};

}  // namespace mt
