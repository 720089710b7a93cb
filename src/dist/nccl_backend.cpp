#include "dist/nccl_backend.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>

#include "core/cuda/check.h"
#include "core/error.h"
#include "core/log.h"
#include "dist/peer_window.h"

namespace mt::dist {

namespace {

#define MT_NCCL_CHECK(expr)                                                                    \
  do {                                                                                         \
    const ncclResult_t mt_nccl_ = (expr);                                                      \
    if (mt_nccl_ != ncclSuccess)                                                               \
      throw ::mt::Error(                                                                       \
          ::mt::ExitCode::kInternal,                                                           \
          fmt::format("NCCL error {} in {} at {}:{}: {}", ncclGetErrorString(mt_nccl_), #expr, \
                      __FILE__, __LINE__, ncclGetLastError(nullptr)));                         \
  } while (0)

// The dtype table (core/dtype.h) holds NCCL's type numbers without NCCL's header.
static_assert(
    dtype_info(DType::kF32).nccl == ncclFloat32 && dtype_info(DType::kF64).nccl == ncclFloat64 &&
    dtype_info(DType::kBF16).nccl == ncclBfloat16 &&
    dtype_info(DType::kE4M3).nccl == ncclFloat8e4m3 && dtype_info(DType::kE8M0).nccl == ncclUint8 &&
    dtype_info(DType::kI32).nccl == ncclInt32 && dtype_info(DType::kI64).nccl == ncclInt64 &&
    dtype_info(DType::kU8).nccl == ncclUint8 && dtype_info(DType::kF16).nccl == ncclFloat16);

ncclDataType_t nccl_type(DType t) {
  MT_CHECK(dtype_info(t).nccl >= 0, "NCCL cannot move {} tensors", dtype_name(t));
  return static_cast<ncclDataType_t>(dtype_info(t).nccl);
}

// The GPU tensor a collective reads or writes: t itself when it is on the GPU, else a device
// copy (inputs) or device scratch (outputs) that finish_on_host copies back.
Tensor device_operand(const Tensor& t, bool copy_in) {
  if (t.device() == Device::kCUDA) return t;
  return copy_in ? t.to(Device::kCUDA) : Tensor::empty(t.shape(), t.dtype(), Device::kCUDA);
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, int device, double timeout_s)
      : comm_(comm), device_(device), timeout_s_(timeout_s) {
    MT_NCCL_CHECK(ncclCommUserRank(comm_, &rank_));
    MT_NCCL_CHECK(ncclCommCount(comm_, &size_));
    MT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    MT_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
    watchdog_ = std::thread([this] { watch(); });
  }

  ~NcclCommunicator() override {
    bool failed = false;
    {
      const std::lock_guard lock(mutex_);
      stop_ = true;
      failed = !failure_.empty();
    }
    wake_.notify_all();
    if (failed) {          // aborted: nothing of NCCL's is safe to call, and the watchdog ends the
      watchdog_.detach();  // process if it outlives the grace period (it no longer reads `this`)
      (void)window_.release();
      return;
    }
    watchdog_.join();
    cudaDeviceSynchronize();
    window_.reset();  // its window and device communicator belong to comm_
    ncclCommDestroy(comm_);
    cudaStreamDestroy(stream_);
    cudaEventDestroy(ready_);
    for (const Pending& p : pending_) cudaEventDestroy(p.done);
    for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void all_gather(const Tensor& send, Tensor& recv) override {
    const Tensor s = device_operand(send, true);
    Tensor r = device_operand(recv, false);
    wait_for(start_all_gather(s, r));
    finish_on_host("all_gather", r, recv);
  }

  std::unique_ptr<PendingCollective> all_gather_async(const Tensor& send, Tensor& recv) override {
    if (send.device() != Device::kCUDA || recv.device() != Device::kCUDA)
      return Communicator::all_gather_async(send, recv);  // host tensors: staged, at once
    return std::make_unique<BackgroundCollective>(start_all_gather(send, recv), send);
  }

  void reduce_scatter(const Tensor& send, Tensor& recv) override {
    const Tensor s = device_operand(send, true);
    Tensor r = device_operand(recv, false);
    wait_for(start_reduce_scatter(s, r));
    finish_on_host("reduce_scatter", r, recv);
  }

  std::unique_ptr<PendingCollective> reduce_scatter_async(const Tensor& send,
                                                          Tensor& recv) override {
    if (send.device() != Device::kCUDA || recv.device() != Device::kCUDA)
      return Communicator::reduce_scatter_async(send, recv);  // host tensors: staged, at once
    return std::make_unique<BackgroundCollective>(start_reduce_scatter(send, recv), send);
  }

  void all_reduce(Tensor& t) override {
    Tensor d = device_operand(t, true);
    wait_for(launch("all_reduce", [&](cudaStream_t stream) {
      MT_NCCL_CHECK(ncclAllReduce(d.raw(), d.raw(), static_cast<size_t>(t.numel()),
                                  nccl_type(t.dtype()), ncclSum, comm_, stream));
    }));
    finish_on_host("all_reduce", d, t);
  }

  void all_to_all(const Tensor& send, const std::vector<int64_t>& send_rows, Tensor& recv,
                  const std::vector<int64_t>& recv_rows) override {
    MT_CHECK(static_cast<int>(send_rows.size()) == size_ &&
                 static_cast<int>(recv_rows.size()) == size_ && send.dtype() == recv.dtype(),
             "all_to_all needs one row count per peer ({} peers)", size_);
    const int64_t sent = std::accumulate(send_rows.begin(), send_rows.end(), int64_t{0});
    const int64_t received = std::accumulate(recv_rows.begin(), recv_rows.end(), int64_t{0});
    const int64_t width = sent > 0       ? send.numel() / sent
                          : received > 0 ? recv.numel() / received
                                         : 0;
    MT_CHECK(send.numel() == sent * width && recv.numel() == received * width,
             "all_to_all of {} rows ({} elements) into {} rows ({} elements)", sent, send.numel(),
             received, recv.numel());
    const Tensor s = device_operand(send, true);
    Tensor r = device_operand(recv, false);
    const size_t row_bytes = static_cast<size_t>(width) * dtype_size(send.dtype());
    const ncclDataType_t type = nccl_type(send.dtype());
    wait_for(launch("all_to_all", [&](cudaStream_t stream) {
      const char* s_at = static_cast<const char*>(s.raw());
      char* r_at = static_cast<char*>(r.raw());
      MT_NCCL_CHECK(ncclGroupStart());
      for (int p = 0; p < size_; ++p) {
        if (send_rows[p] > 0)
          MT_NCCL_CHECK(
              ncclSend(s_at, static_cast<size_t>(send_rows[p] * width), type, p, comm_, stream));
        if (recv_rows[p] > 0)
          MT_NCCL_CHECK(
              ncclRecv(r_at, static_cast<size_t>(recv_rows[p] * width), type, p, comm_, stream));
        s_at += send_rows[p] * row_bytes;
        r_at += recv_rows[p] * row_bytes;
      }
      MT_NCCL_CHECK(ncclGroupEnd());
    }));
    finish_on_host("all_to_all", r, recv);
  }

  size_t reserve_peer_window(size_t bytes, int ctas, std::string* why) override {
    begin("reserve_peer_window");
    if (window_ && window_->bytes() >= bytes) return window_->bytes();
    window_.reset();
    window_ = PeerWindow::create(comm_, bytes, ctas, why);
    return window_ ? window_->bytes() : 0;
  }

  const PeerWindow* peer_window() const override { return window_.get(); }

  void barrier() override {
    Tensor token = Tensor::zeros({1}, DType::kF32, Device::kCUDA);
    all_reduce(token);
    MT_CUDA_CHECK(cudaStreamSynchronize(cuda::stream()));
    begin("barrier");  // surfaces a failure the watchdog found meanwhile
  }

  void watch_queued(const char* what) override {
    begin(what);
    hand_to_watchdog(what, cuda::stream());
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    begin("split");
    ncclComm_t sub = nullptr;
    MT_NCCL_CHECK(ncclCommSplit(comm_, color, key, &sub, nullptr));
    MT_CHECK(sub != nullptr, "ncclCommSplit gave no communicator for color {}", color);
    return std::make_unique<NcclCommunicator>(sub, device_, timeout_s_);
  }

 private:
  // A background collective's handle: the compute stream waits for `done` (once), and the input
  // stays alive until then.
  class BackgroundCollective final : public PendingCollective {
   public:
    BackgroundCollective(cudaEvent_t done, Tensor input) : done_(done), input_(std::move(input)) {}
    ~BackgroundCollective() override {
      if (!waited_) cudaStreamWaitEvent(cuda::stream(), done_);  // never leave it unordered
      cudaEventDestroy(done_);
    }
    void wait() override {
      if (waited_) return;
      MT_CUDA_CHECK(cudaStreamWaitEvent(cuda::stream(), done_));
      waited_ = true;
    }

   private:
    cudaEvent_t done_;
    Tensor input_;
    bool waited_ = false;
  };

  // Device tensors; returns the event of the gather's end.
  cudaEvent_t start_all_gather(const Tensor& send, Tensor& recv) {
    MT_CHECK(recv.numel() == send.numel() * size_ && recv.dtype() == send.dtype(),
             "all_gather of {} {} into {} {}", dtype_name(send.dtype()), shape_str(send.shape()),
             dtype_name(recv.dtype()), shape_str(recv.shape()));
    return launch("all_gather", [&](cudaStream_t stream) {
      MT_NCCL_CHECK(ncclAllGather(send.raw(), recv.raw(), static_cast<size_t>(send.numel()),
                                  nccl_type(send.dtype()), comm_, stream));
    });
  }

  cudaEvent_t start_reduce_scatter(const Tensor& send, Tensor& recv) {
    MT_CHECK(send.numel() == recv.numel() * size_ && recv.dtype() == send.dtype(),
             "reduce_scatter of {} {} into {} {}", dtype_name(send.dtype()),
             shape_str(send.shape()), dtype_name(recv.dtype()), shape_str(recv.shape()));
    return launch("reduce_scatter", [&](cudaStream_t stream) {
      MT_NCCL_CHECK(ncclReduceScatter(send.raw(), recv.raw(), static_cast<size_t>(recv.numel()),
                                      nccl_type(send.dtype()), ncclSum, comm_, stream));
    });
  }

  // Every collective of this communicator runs on its stream, in issue order (NCCL orders a
  // communicator's work on one stream): it first waits for what the compute stream has queued
  // (which wrote its inputs). Returns the event of its end.
  cudaEvent_t launch(const char* what, const std::function<void(cudaStream_t)>& issue) {
    begin(what);
    // One event serves every collective: a wait takes the event's state when it is queued.
    MT_CUDA_CHECK(cudaEventRecord(ready_, cuda::stream()));
    MT_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready_));
    issue(stream_);
    end(what);
    cudaEvent_t done = nullptr;
    MT_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    MT_CUDA_CHECK(cudaEventRecord(done, stream_));
    return done;
  }

  // The compute stream continues after the collective (the host does not wait).
  static void wait_for(cudaEvent_t done) {
    const cudaError_t err = cudaStreamWaitEvent(cuda::stream(), done);
    cudaEventDestroy(done);
    MT_CUDA_CHECK(err);
  }

  struct Pending {
    cudaEvent_t done;
    const char* what;
    std::chrono::steady_clock::time_point issued;
  };

  // A host result: copied back once the collective is done (a host wait), then the
  // communicator's health checked, so that an abort by the watchdog during that wait (a dead
  // peer) stops the rank here instead of passing the aborted collective's buffer on as a result.
  void finish_on_host(const char* what, const Tensor& device_result, Tensor& out) {
    if (out.device() != Device::kCPU) return;
    out.copy_from(device_result.to(Device::kCPU));
    begin(what);
  }

  // Throws when the watchdog has aborted the communicator.
  void begin(const char* what) {
    const std::lock_guard lock(mutex_);
    if (!failure_.empty())
      throw Error(ExitCode::kInternal,
                  fmt::format("NCCL {} on rank {} of {}: the communicator was aborted: {}", what,
                              rank_, size_, failure_));
  }

  // Hands the collective's completion event (on the communicator's stream) to the watchdog.
  // Not while a CUDA graph is being captured: the event would only be captured (the watchdog
  // could never see it complete); each replay is watched instead (watch_queued).
  void end(const char* what) {
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    MT_CUDA_CHECK(cudaStreamIsCapturing(stream_, &capturing));
    if (capturing == cudaStreamCaptureStatusNone) hand_to_watchdog(what, stream_);
  }

  // The watchdog's entry: an event recorded now on `stream`.
  void hand_to_watchdog(const char* what, cudaStream_t stream) {
    const std::lock_guard lock(mutex_);
    cudaEvent_t e = nullptr;
    if (free_events_.empty()) {
      MT_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    } else {
      e = free_events_.back();
      free_events_.pop_back();
    }
    MT_CUDA_CHECK(cudaEventRecord(e, stream));
    pending_.push_back({e, what, std::chrono::steady_clock::now()});
  }

  void watch() {
    cudaSetDevice(device_);
    std::unique_lock lock(mutex_);
    while (!stop_) {
      wake_.wait_for(lock, std::chrono::milliseconds(100));
      if (stop_) return;
      while (!pending_.empty() && cudaEventQuery(pending_.front().done) == cudaSuccess) {
        free_events_.push_back(pending_.front().done);
        pending_.pop_front();
      }
      std::string cause;
      ncclResult_t async = ncclSuccess;
      if (ncclCommGetAsyncError(comm_, &async) == ncclSuccess && async != ncclSuccess &&
          async != ncclInProgress) {
        cause = fmt::format("NCCL reported {} ({})", ncclGetErrorString(async),
                            ncclGetLastError(comm_));
      } else if (!pending_.empty()) {
        const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                                            pending_.front().issued)
                                  .count();
        if (waited > timeout_s_)
          cause = fmt::format(
              "{} did not finish within {:.0f} s (a peer died, hangs, or is in another "
              "collective; MOETRAIN_TIMEOUT_S sets the limit)",
              pending_.front().what, timeout_s_);
      }
      if (cause.empty()) continue;
      failure_ = cause;
      // ncclCommAbort makes the stuck kernels return, so that this rank's next collective throws
      // with the cause and the process ends through its error path. A recent NCCL may also wait
      // in it for the peers (to free shared resources: NVIDIA/nccl#863), which never comes when
      // a peer is dead: so it runs on a thread of its own, and a process still alive after a
      // grace period (stuck in a wait the abort did not release, or in its exit) is ended here,
      // with the cause, rather than left hanging. Metrics lines are flushed per step and
      // checkpoints written atomically: nothing written is lost.
      std::thread([comm = comm_, device = device_] {
        cudaSetDevice(device);
        ncclCommAbort(comm);
      }).detach();
      const std::string message = fmt::format("NCCL rank {} of {}: {}", rank_, size_, cause);
      lock.unlock();  // from here on nothing of `this` is touched: it may be destroyed meanwhile
      std::this_thread::sleep_for(kAbortGrace);
      log::error("{}; the process did not end within {} s of the abort: exiting", message,
                 kAbortGrace.count());
      std::fflush(nullptr);
      std::_Exit(static_cast<int>(ExitCode::kInternal));
    }
  }

  // How long the process has, after the watchdog's abort, to end through its error path before
  // the watchdog ends it.
  static constexpr std::chrono::seconds kAbortGrace{15};

  ncclComm_t comm_;
  std::unique_ptr<PeerWindow> window_;  // the exchange's device path, once reserved
  cudaStream_t stream_ = nullptr;       // this communicator's collectives
  cudaEvent_t ready_ = nullptr;         // the compute stream's point a collective starts after
  int device_;
  int rank_ = 0, size_ = 1;
  double timeout_s_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Pending> pending_;
  std::vector<cudaEvent_t> free_events_;
  std::string failure_;  // set, with the communicator aborted, by the watchdog
  bool stop_ = false;
  std::thread watchdog_;
};

}  // namespace

std::unique_ptr<Communicator> connect_nccl_world(const Rendezvous& r, Communicator& bootstrap) {
  MT_CHECK(bootstrap.size() == r.world && bootstrap.rank() == r.rank,
           "bootstrap communicator is rank {} of {}, the rendezvous says {} of {}",
           bootstrap.rank(), bootstrap.size(), r.rank, r.world);
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess) gpus = 0;
  if (r.local_rank >= gpus)
    throw ConfigError(fmt::format(
        "LOCAL_RANK = {} but this host shows {} GPU(s): one process per GPU (valid: 0 to {})",
        r.local_rank, gpus, gpus - 1));
  MT_CUDA_CHECK(cudaSetDevice(r.local_rank));
  ncclUniqueId id{};
  if (r.rank == 0) MT_NCCL_CHECK(ncclGetUniqueId(&id));
  const int64_t id_bytes = sizeof(id);
  Tensor mine = Tensor::zeros({id_bytes}, DType::kU8);
  std::memcpy(mine.raw(), &id, sizeof(id));
  Tensor all = Tensor::empty({id_bytes * r.world}, DType::kU8);
  bootstrap.all_gather(mine, all);
  std::memcpy(&id, all.raw(), sizeof(id));  // rank 0's
  ncclComm_t comm = nullptr;
  MT_NCCL_CHECK(ncclCommInitRank(&comm, r.world, id, r.rank));
  return std::make_unique<NcclCommunicator>(comm, r.local_rank, r.timeout_s);
}

}  // namespace mt::dist
