// The expert-parallel exchange's layouts: which ranks a token's choices go to, how many, where
// each row lands in a peer's region of a fixed-capacity exchange (moe/exchange/expert_exchange.h,
// moe::scatter_rows) and the regions laid out whole for the all-to-all path.
#pragma once
#include "core/tensor.h"

namespace mt::ops {

// The choices of expert parallelism (experts [p*L, (p+1)*L) on rank p of `peers`), i32:
// peer_choices: (N, k) experts -> (N, peers): entry p is p when any of the token's choices is on
// rank p, else -1 (a permutation over the peers then sends each token once per rank).
void peer_choices(const Tensor& expert_index, int64_t peers, int64_t experts_per_peer, Tensor& out);
// peer_counts: (N, k) experts -> i64 (peers, L + 1): for each rank, the choices of each of its
// experts, then the number of tokens with a choice there (what peer_choices sends it).
void peer_counts(const Tensor& expert_index, int64_t peers, int64_t experts_per_peer, Tensor& out);
// local_choices: (R, k) experts -> (R, k) experts of rank `rank` numbered from 0, -1 for the
// other ranks' experts. With received_counts (i64 (peers, L + 1), ops::peer_counts' layout as
// each peer sent it): the rows are peers' regions of R / peers rows, and rows of region p past
// its received_counts[p, L] tokens (never written) get -1 throughout.
void local_choices(const Tensor& expert_index, int64_t rank, int64_t experts_per_peer, Tensor& out,
                   const Tensor* received_counts = nullptr);

// Fixed-capacity exchanges (moe::scatter_rows) place rows by slot:
// peer_slots: out i32 (N, peers) from to_peer (N, peers), peer_choices' output: entry p of row t
// is -1 where to_peer's is, else p * region_rows + the number of rows before t with an entry for
// p (the token's place in peer p's region, the tokens in order). One scan per peer.
void peer_slots(const Tensor& to_peer, int64_t region_rows, Tensor& out);
// region_slots: out i32 (peers * capacity, peers): row j = p * capacity + s (the s-th token
// received from peer p) goes back to peer p at slot s, when s is below received_counts[p, L]
// (ops::peer_counts' layout); every other entry -1.
void region_slots(const Tensor& received_counts, int64_t capacity, Tensor& out);
// place_rows: out (peers * capacity, W) gets row t of x (N, W) at row p * capacity + slot[t, p]
// for every slot[t, p] >= 0 (slot i32 (N, peers)); its other rows are left as they are. Any
// dtype (the rows' bytes). A slot at or past `capacity` is an error on the CPU and writes nothing
// on the GPU. What a fixed-capacity exchange sends each peer, its region whole.
void place_rows(const Tensor& x, const Tensor& slot, int64_t capacity, Tensor& out);

}  // namespace mt::ops
