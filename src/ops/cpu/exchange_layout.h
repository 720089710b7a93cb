// The exchange layouts' CPU reference (exchange_layout.cpp), called by ops/exchange_layout.h's
// front door once it has checked the arguments.
#pragma once
#include "core/tensor.h"

namespace mt::ops::cpu {

void peer_choices(const Tensor& expert_index, int64_t peers, int64_t experts_per_peer, Tensor& out);
void peer_counts(const Tensor& expert_index, int64_t peers, int64_t experts_per_peer, Tensor& out);
void local_choices(const Tensor& expert_index, int64_t rank, int64_t experts_per_peer, Tensor& out,
                   const Tensor* received_counts);
void peer_slots(const Tensor& to_peer, int64_t region_rows, Tensor& out);
void region_slots(const Tensor& received_counts, int64_t capacity, Tensor& out);
void place_rows(const Tensor& x, const Tensor& slot, int64_t capacity, Tensor& out);

}  // namespace mt::ops::cpu
