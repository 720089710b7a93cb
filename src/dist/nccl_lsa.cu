#include <nccl_device.h>

#include "dist/nccl_lsa.h"

namespace mt::dist {

namespace {

// One CTA per LSA barrier; each warp moves whole rows (rows w, w + warps, ... for warp w of the
// grid), its lanes striding over the row's U units (16 bytes when row_bytes allows, else 4 or 1):
// many rows in flight at once, each store a coalesced warp-wide write over NVLink.
template <class U>
__global__ void lsa_scatter_kernel(ncclDevComm comm, ncclWindow_t window, const U* send, int64_t n,
                                   int64_t units, const int32_t* slot, int64_t capacity) {
  ncclLsaBarrierSession<ncclCoopCta> barrier{ncclCoopCta(), comm, ncclTeamLsa(comm),
                                             comm.lsaBarrier, blockIdx.x};
  barrier.sync(ncclCoopCta(), cuda::memory_order_acq_rel);  // every peer is done with its buffer
  const int ranks = comm.nRanks;
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t{gridDim.x} * (blockDim.x / 32);
  for (int64_t t = blockIdx.x * int64_t{blockDim.x / 32} + threadIdx.x / 32; t < n; t += warps)
    for (int p = 0; p < ranks; ++p) {
      const int32_t s = slot[t * ranks + p];
      if (s < 0) continue;
      const size_t row = static_cast<size_t>(comm.rank) * capacity + s;
      U* dst = static_cast<U*>(ncclGetLsaPointer(window, row * units * sizeof(U), p));
      const U* src = send + t * units;
      for (int64_t c = lane; c < units; c += 32) dst[c] = src[c];
    }
  barrier.sync(ncclCoopCta(), cuda::memory_order_acq_rel);  // every row has landed
}

constexpr int kThreads = 512;

}  // namespace

struct LsaScatter::State {
  ncclComm_t comm = nullptr;
  void* buffer = nullptr;
  size_t bytes = 0;
  int ctas = 0;
  ncclWindow_t window{};
  ncclDevComm dev{};
  bool registered = false, dev_created = false;
};

LsaScatter::LsaScatter(std::unique_ptr<State> s) : s_(std::move(s)) {}

LsaScatter::~LsaScatter() {
  if (!s_) return;
  if (s_->dev_created) ncclDevCommDestroy(s_->comm, &s_->dev);
  if (s_->registered) ncclCommWindowDeregister(s_->comm, s_->window);
  if (s_->buffer) ncclMemFree(s_->buffer);
}

std::unique_ptr<LsaScatter> LsaScatter::create(ncclComm_t comm, size_t bytes, int ctas,
                                               std::string* why) {
  int ranks = 0;
  ncclCommCount(comm, &ranks);
  const ncclTeam_t lsa = ncclTeamLsa(comm);
  if (lsa.nRanks != ranks) {
    *why = "the ranks are not all in one LSA team (one node with peer access)";
    return nullptr;
  }
  auto s = std::make_unique<State>();
  s->comm = comm;
  s->bytes = (bytes + NCCL_WIN_REQUIRED_ALIGNMENT - 1) / NCCL_WIN_REQUIRED_ALIGNMENT *
             NCCL_WIN_REQUIRED_ALIGNMENT;
  s->ctas = ctas;
  std::unique_ptr<LsaScatter> out(new LsaScatter(std::move(s)));
  State& st = *out->s_;
  if (ncclResult_t r = ncclMemAlloc(&st.buffer, st.bytes); r != ncclSuccess) {
    *why = std::string("ncclMemAlloc: ") + ncclGetErrorString(r);
    st.buffer = nullptr;
    return nullptr;
  }
  if (ncclResult_t r =
          ncclCommWindowRegister(comm, st.buffer, st.bytes, &st.window, NCCL_WIN_COLL_SYMMETRIC);
      r != ncclSuccess) {
    *why = std::string("ncclCommWindowRegister: ") + ncclGetErrorString(r);
    return nullptr;
  }
  st.registered = true;
  ncclDevCommRequirements reqs{};
  reqs.lsaBarrierCount = ctas;
  if (ncclResult_t r = ncclDevCommCreate(comm, &reqs, &st.dev); r != ncclSuccess) {
    *why = std::string("ncclDevCommCreate: ") + ncclGetErrorString(r);
    return nullptr;
  }
  st.dev_created = true;
  return out;
}

size_t LsaScatter::bytes() const {
  return s_->bytes;
}

cudaError_t LsaScatter::scatter(const void* send, int64_t n, int64_t row_bytes, const int32_t* slot,
                                int64_t capacity, void* out, cudaStream_t stream) {
  const State& st = *s_;
  const size_t total = static_cast<size_t>(st.dev.nRanks) * capacity * row_bytes;
  if (total > st.bytes) return cudaErrorInvalidValue;
  // Every rank launches, even with no rows: the barriers need all of them.
  if (row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(send) % 16 == 0)
    lsa_scatter_kernel<uint4><<<st.ctas, kThreads, 0, stream>>>(
        st.dev, st.window, static_cast<const uint4*>(send), n, row_bytes / 16, slot, capacity);
  else if (row_bytes % 4 == 0 && reinterpret_cast<uintptr_t>(send) % 4 == 0)
    lsa_scatter_kernel<uint32_t><<<st.ctas, kThreads, 0, stream>>>(
        st.dev, st.window, static_cast<const uint32_t*>(send), n, row_bytes / 4, slot, capacity);
  else
    lsa_scatter_kernel<uint8_t><<<st.ctas, kThreads, 0, stream>>>(
        st.dev, st.window, static_cast<const uint8_t*>(send), n, row_bytes, slot, capacity);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  if (total == 0) return cudaSuccess;
  return cudaMemcpyAsync(out, st.buffer, total, cudaMemcpyDeviceToDevice, stream);
}

}  // namespace mt::dist
