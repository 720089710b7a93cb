#include <utility>

#include "dist/peer_window.cuh"

namespace mt::dist {

PeerWindow::PeerWindow(std::unique_ptr<State> s) : s_(std::move(s)) {}

PeerWindow::~PeerWindow() {
  if (!s_) return;
  if (s_->dev_created) ncclDevCommDestroy(s_->comm, &s_->dev);
  if (s_->registered) ncclCommWindowDeregister(s_->comm, s_->window);
  if (s_->buffer) ncclMemFree(s_->buffer);
}

std::unique_ptr<PeerWindow> PeerWindow::create(ncclComm_t comm, size_t bytes, int ctas,
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
  std::unique_ptr<PeerWindow> out(new PeerWindow(std::move(s)));
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

size_t PeerWindow::bytes() const {
  return s_->bytes;
}

}  // namespace mt::dist
