// The in-process backend: ranks are threads sharing a Group. A collective is two barriers: every
// rank posts a pointer to its buffers, then (after the first barrier) reads what the others
// posted into its own output, then (after the second) may reuse its buffers. Sums run in rank
// order, so results are deterministic and identical on every rank.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include "core/error.h"
#include "dist/communicator.h"
#include "ops/dispatch.h"

namespace mt::dist {

namespace {

struct Group {
  explicit Group(int n, double timeout) : size(n), timeout_s(timeout), slots(n) {}
  const int size;
  const double timeout_s;
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  int64_t generation = 0;
  std::shared_ptr<std::atomic<bool>> world_failed;  // one flag for the world and its subgroups
  struct Slot {
    const void* send = nullptr;
    const std::vector<int64_t>* rows = nullptr;
    int color = 0, key = 0;
  };
  std::vector<Slot> slots;
  // For split: the subgroups created by this generation's split, by color.
  std::map<int, std::shared_ptr<Group>> children;
};

class InProcessComm : public Communicator {
 public:
  InProcessComm(std::shared_ptr<Group> g, int rank) : g_(std::move(g)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return g_->size; }

  void barrier() override { sync("barrier"); }

  void all_gather(const Tensor& send, Tensor& recv) override {
    MT_CHECK(recv.numel() == send.numel() * size() && recv.dtype() == send.dtype(),
             "all_gather of {} into {}", shape_str(send.shape()), shape_str(recv.shape()));
    post(send.raw());
    sync("all_gather");
    const size_t bytes = send.nbytes();
    for (int p = 0; p < size(); ++p)
      std::memcpy(static_cast<char*>(recv.raw()) + p * bytes, g_->slots[p].send, bytes);
    sync("all_gather");
  }

  void reduce_scatter(const Tensor& send, Tensor& recv) override {
    MT_CHECK(send.numel() == recv.numel() * size() && recv.dtype() == send.dtype(),
             "reduce_scatter of {} into {}", shape_str(send.shape()), shape_str(recv.shape()));
    post(send.raw());
    sync("reduce_scatter");
    const int64_t n = recv.numel();
    ops::dispatch_float(recv.dtype(), [&](auto tag) {
      using T = decltype(tag);
      T* out = recv.data<T>();
      for (int64_t i = 0; i < n; ++i) out[i] = T(0);
      for (int p = 0; p < size(); ++p) {
        const T* in = static_cast<const T*>(g_->slots[p].send) + rank_ * n;
        for (int64_t i = 0; i < n; ++i) out[i] += in[i];
      }
    });
    sync("reduce_scatter");
  }

  void all_reduce(Tensor& t) override {
    Tensor mine = t.clone();  // others read our input while we overwrite t
    post(mine.raw());
    sync("all_reduce");
    const int64_t n = t.numel();
    auto sum = [&](auto tag) {
      using T = decltype(tag);
      T* out = t.data<T>();
      for (int64_t i = 0; i < n; ++i) out[i] = T(0);
      for (int p = 0; p < size(); ++p) {
        const T* in = static_cast<const T*>(g_->slots[p].send);
        for (int64_t i = 0; i < n; ++i) out[i] += in[i];
      }
    };
    if (t.dtype() == DType::kI64)
      sum(int64_t{});
    else if (t.dtype() == DType::kI32)
      sum(int32_t{});
    else
      ops::dispatch_float(t.dtype(), sum);
    sync("all_reduce");
  }

  void all_to_all(const Tensor& send, const std::vector<int64_t>& send_rows, Tensor& recv,
                  const std::vector<int64_t>& recv_rows) override {
    MT_CHECK(static_cast<int>(send_rows.size()) == size() &&
                 static_cast<int>(recv_rows.size()) == size(),
             "all_to_all needs {} counts per side", size());
    int64_t s_total = 0, r_total = 0;
    for (int p = 0; p < size(); ++p) {
      s_total += send_rows[p];
      r_total += recv_rows[p];
    }
    const int64_t rows = send.ndim() ? send.dim(0) : 0;
    MT_CHECK(rows == s_total && (recv.ndim() ? recv.dim(0) : 0) == r_total,
             "all_to_all rows: send {} vs counts {}, recv {} vs counts {}", rows, s_total,
             recv.ndim() ? recv.dim(0) : 0, r_total);
    const size_t row_bytes = rows ? send.nbytes() / rows : (r_total ? recv.nbytes() / r_total : 0);
    post(send.defined() && send.numel() ? send.raw() : nullptr, &send_rows);
    sync("all_to_all");
    size_t out = 0;
    for (int p = 0; p < size(); ++p) {
      const std::vector<int64_t>& theirs = *g_->slots[p].rows;
      MT_CHECK(theirs[rank_] == recv_rows[p],
               "all_to_all: rank {} sends {} rows to rank {}, which expects {}", p, theirs[rank_],
               rank_, recv_rows[p]);
      int64_t before = 0;
      for (int q = 0; q < rank_; ++q) before += theirs[q];
      if (recv_rows[p])
        std::memcpy(static_cast<char*>(recv.raw()) + out,
                    static_cast<const char*>(g_->slots[p].send) + before * row_bytes,
                    recv_rows[p] * row_bytes);
      out += recv_rows[p] * row_bytes;
    }
    sync("all_to_all");
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    {
      std::lock_guard<std::mutex> lock(g_->mu);
      g_->slots[rank_].color = color;
      g_->slots[rank_].key = key;
    }
    sync("split");
    // Every rank computes the same membership; the lowest old rank of each color creates it.
    std::vector<std::pair<std::pair<int, int>, int>> members;  // ((key, old rank), old rank)
    for (int p = 0; p < size(); ++p)
      if (g_->slots[p].color == color) members.push_back({{g_->slots[p].key, p}, p});
    std::sort(members.begin(), members.end());
    int new_rank = 0;
    for (size_t i = 0; i < members.size(); ++i)
      if (members[i].second == rank_) new_rank = static_cast<int>(i);
    {
      std::lock_guard<std::mutex> lock(g_->mu);
      auto& child = g_->children[color];
      if (!child) {
        child = std::make_shared<Group>(static_cast<int>(members.size()), g_->timeout_s);
        child->world_failed = g_->world_failed;
      }
    }
    sync("split");
    std::shared_ptr<Group> child;
    {
      std::lock_guard<std::mutex> lock(g_->mu);
      child = g_->children.at(color);
    }
    sync("split");
    if (rank_ == 0) {
      std::lock_guard<std::mutex> lock(g_->mu);
      g_->children.clear();
    }
    return std::make_unique<InProcessComm>(child, new_rank);
  }

 private:
  void post(const void* send, const std::vector<int64_t>* rows = nullptr) {
    std::lock_guard<std::mutex> lock(g_->mu);
    g_->slots[rank_].send = send;
    g_->slots[rank_].rows = rows;
  }

  // A generation barrier with a timeout; fails fast when any rank of the world has failed.
  void sync(const char* what) {
    std::unique_lock<std::mutex> lock(g_->mu);
    const int64_t gen = g_->generation;
    if (++g_->arrived == g_->size) {
      g_->arrived = 0;
      ++g_->generation;
      g_->cv.notify_all();
      return;
    }
    using Clock = std::chrono::steady_clock;
    const Clock::time_point deadline =
        Clock::now() +
        std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(g_->timeout_s));
    while (g_->generation == gen) {
      if (*g_->world_failed)
        throw Error(ExitCode::kInternal,
                    fmt::format("rank {} in {}: another rank failed; giving up", rank_, what));
      const Clock::time_point poll = Clock::now() + std::chrono::milliseconds(50);
      if (g_->cv.wait_until(lock, std::min(deadline, poll)) == std::cv_status::timeout &&
          Clock::now() >= deadline)
        throw Error(ExitCode::kInternal,
                    fmt::format("rank {} timed out after {:.0f} s in {} ({} of {} ranks arrived)",
                                rank_, g_->timeout_s, what, g_->arrived, g_->size));
    }
  }

  std::shared_ptr<Group> g_;
  int rank_;
};

}  // namespace

void run_in_process(int world_size, const std::function<void(Communicator&)>& fn,
                    double timeout_s) {
  MT_CHECK(world_size >= 1, "world size {} must be >= 1", world_size);
  auto world = std::make_shared<Group>(world_size, timeout_s);
  world->world_failed = std::make_shared<std::atomic<bool>>(false);
  std::vector<std::exception_ptr> errors(world_size);
  std::vector<std::thread> threads;
  for (int r = 0; r < world_size; ++r)
    threads.emplace_back([&, r] {
      try {
        InProcessComm comm(world, r);
        fn(comm);
      } catch (...) {
        errors[r] = std::current_exception();
        *world->world_failed = true;
      }
    });
  for (auto& t : threads) t.join();
  // The first failure is the cause; the others are its echo ("another rank failed").
  std::exception_ptr first;
  for (auto& e : errors) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const Error& err) {
      if (std::string(err.what()).find("another rank failed") == std::string::npos) {
        first = e;
        break;
      }
      if (!first) first = e;
    } catch (...) {
      first = e;
      break;
    }
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace mt::dist
