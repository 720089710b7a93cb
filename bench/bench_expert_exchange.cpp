// Expert-parallel dispatch + combine over NCCL against the raw NCCL all-to-all of the same bytes,
// on the GPUs of one machine (ranks as threads, one GPU each, ep = all of them): 16384 tokens
// per rank, top-8 of 128 experts with random routing, rows of 2048 bf16. Dispatch + combine is
// what the MoE layer pays: the count exchange (through the host), both row all-to-alls and the
// regrouping gathers. The raw all-to-all moves the same rows with the counts known in advance.
// JSON lines from rank 0.
#include <cuda_runtime_api.h>

#include <cstdio>

#include "bench/bench_util.h"
#include "dist/nccl_backend.h"
#include "moe/expert_exchange.h"
#include "ops/cuda/device.h"
#include "ops/permute.h"

int main() {
  using mt::Device;
  using mt::DType;
  using mt::Tensor;
  const int world = mt::cuda::device_count();
  if (world < 2) {
    std::printf("{\"bench\":\"expert_exchange\",\"error\":\"needs 2 or more GPUs, found %d\"}\n",
                world);
    return 0;
  }
  const int64_t tokens = 16384, top_k = 8, experts = 128, dim = 2048;
  mt::dist::run_in_process(world, [&](mt::dist::Communicator& boot) {
    mt::dist::Rendezvous r;
    r.rank = boot.rank();
    r.world = world;
    r.local_rank = boot.rank();
    const auto ep = mt::dist::connect_nccl_world(r, boot);
    // Random routing: the expert of (token, choice), as the router's output.
    Tensor index = Tensor::empty({tokens, top_k}, DType::kI32);
    const mt::CounterRng rng{7, static_cast<uint64_t>(r.rank)};
    for (int64_t i = 0; i < tokens * top_k; ++i)
      index.data<int32_t>()[i] = static_cast<int32_t>(rng.below(i, experts));
    mt::ops::ExpertPermutation perm;
    mt::ops::make_expert_permutation(index.to(Device::kCUDA), experts, perm);
    const Tensor rows = mt::bench::random_bf16({tokens * top_k, dim}, 3 + r.rank, 1.0);

    const double exchange_ms = mt::bench::median_ms([&] {
      const mt::moe::ExpertExchange exchange(*ep, perm.expert_offsets);
      const Tensor there = exchange.dispatch(rows);
      const Tensor back = exchange.combine(there);
    });
    // The raw all-to-all of the same rows, counts fixed beforehand, there and back.
    const mt::moe::ExpertExchange plan(*ep, perm.expert_offsets);
    const Tensor offsets = perm.expert_offsets.to(Device::kCPU);
    const int64_t local = experts / world;
    std::vector<int64_t> send_rows(world), recv_rows(world);
    for (int p = 0; p < world; ++p)
      send_rows[p] = offsets.data<int64_t>()[(p + 1) * local] - offsets.data<int64_t>()[p * local];
    Tensor counts = Tensor::empty({world}, DType::kI64),
           all = Tensor::empty({world * world}, DType::kI64);
    for (int p = 0; p < world; ++p) counts.data<int64_t>()[p] = send_rows[p];
    boot.all_gather(counts, all);
    int64_t received = 0;
    for (int p = 0; p < world; ++p)
      received += recv_rows[p] = all.data<int64_t>()[p * world + r.rank];
    Tensor there = Tensor::empty({received, dim}, DType::kBF16, Device::kCUDA);
    Tensor back = Tensor::empty({tokens * top_k, dim}, DType::kBF16, Device::kCUDA);
    const double raw_ms = mt::bench::median_ms([&] {
      ep->all_to_all(rows, send_rows, there, recv_rows);
      ep->all_to_all(there, recv_rows, back, send_rows);
    });
    if (r.rank == 0) {
      const double gib = 2.0 * tokens * top_k * dim * 2 / (1 << 30);
      std::printf(
          "{\"bench\":\"expert_exchange\",\"gpus\":%d,\"tokens_per_rank\":%lld,\"top_k\":%lld,"
          "\"experts\":%lld,\"dim\":%lld,\"dispatch_combine_ms\":%.3f,\"raw_all_to_all_ms\":%.3f,"
          "\"ratio\":%.3f,\"gib_moved_per_rank\":%.2f}\n",
          world, static_cast<long long>(tokens), static_cast<long long>(top_k),
          static_cast<long long>(experts), static_cast<long long>(dim), exchange_ms, raw_ms,
          exchange_ms / raw_ms, gib);
      std::fflush(stdout);
    }
  });
}
