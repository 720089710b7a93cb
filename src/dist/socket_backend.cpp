#include "dist/socket_backend.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <thread>

#include "core/error.h"
#include "ops/dispatch.h"

namespace mt::dist {

namespace {

using Clock = std::chrono::steady_clock;
constexpr uint32_t kMagic = 0x4D43544D;  // "MTCM"

enum class Op : uint32_t {
  kHello,
  kBye,
  kBarrier,
  kAllGather,
  kAllReduce,
  kReduceScatter,
  kAllToAll,
  kSplit
};
const char* op_name(Op op) {
  static const char* kNames[] = {"hello",      "bye",        "barrier",
                                 "all_gather", "all_reduce", "reduce_scatter",
                                 "all_to_all", "split"};
  return kNames[static_cast<uint32_t>(op)];
}

struct Header {
  uint32_t magic = kMagic;
  uint32_t op = 0;
  uint32_t group = 0;
  uint32_t status = 0;  // 0 ok, 1 error (payload = message)
  uint64_t seq = 0;
  uint64_t bytes = 0;
};
static_assert(sizeof(Header) == 32, "the wire header is 32 bytes");

[[noreturn]] void sys_fail(const std::string& what) {
  throw Error(ExitCode::kInternal, fmt::format("{}: {}", what, std::strerror(errno)));
}

void write_all(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t w = ::send(fd, c, n, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR) continue;
      sys_fail("send");
    }
    c += w;
    n -= static_cast<size_t>(w);
  }
}

// False on a clean EOF before any byte; throws on error, timeout, or EOF mid-message.
bool read_all(int fd, void* p, size_t n, double timeout_s, const char* waiting_for) {
  char* c = static_cast<char*>(p);
  const size_t total = n;
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(timeout_s));
  while (n > 0) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0)
      throw Error(ExitCode::kInternal,
                  fmt::format("timed out after {:.0f} s waiting for {}", timeout_s, waiting_for));
    pollfd pfd{fd, POLLIN, 0};
    const int ready = ::poll(&pfd, 1, static_cast<int>(std::min<int64_t>(left.count(), 1000)));
    if (ready < 0 && errno != EINTR) sys_fail("poll");
    if (ready <= 0) continue;
    const ssize_t r = ::recv(fd, c, n, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      sys_fail("recv");
    }
    if (r == 0) {
      if (n == total) return false;
      throw Error(ExitCode::kInternal,
                  fmt::format("connection closed while reading {}", waiting_for));
    }
    c += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

void send_msg(int fd, Header h, const std::string& payload) {
  h.bytes = payload.size();
  std::string buf(reinterpret_cast<const char*>(&h), sizeof(h));
  buf += payload;
  write_all(fd, buf.data(), buf.size());
}

bool recv_msg(int fd, Header& h, std::string& payload, double timeout_s, const char* what) {
  if (!read_all(fd, &h, sizeof(h), timeout_s, what)) return false;
  if (h.magic != kMagic)
    throw Error(ExitCode::kInternal, "corrupt message from a peer (bad magic)");
  payload.resize(h.bytes);
  if (h.bytes && !read_all(fd, payload.data(), h.bytes, timeout_s, what))
    throw Error(ExitCode::kInternal, "connection closed mid-message");
  return true;
}

template <class T>
void put(std::string& s, T v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof(T));
}
template <class T>
T get(const std::string& s, size_t at) {
  T v;
  std::memcpy(&v, s.data() + at, sizeof(T));
  return v;
}

// Element-wise sum of equally sized byte blobs of `dtype` (1-byte dtype code first).
std::string sum_parts(const std::vector<std::string>& parts) {
  const DType dt = static_cast<DType>(parts[0][0]);
  const size_t bytes = parts[0].size() - 1;
  std::string out(bytes, '\0');
  auto sum = [&](auto tag) {
    using T = decltype(tag);
    const size_t n = bytes / sizeof(T);
    T* o = reinterpret_cast<T*>(out.data());
    for (const std::string& p : parts) {
      MT_CHECK(p.size() == bytes + 1, "reduce of unequal sizes {} vs {}", p.size() - 1, bytes);
      const T* in = reinterpret_cast<const T*>(p.data() + 1);
      for (size_t i = 0; i < n; ++i) o[i] += in[i];
    }
  };
  if (dt == DType::kI64)
    sum(int64_t{});
  else if (dt == DType::kI32)
    sum(int32_t{});
  else
    ops::dispatch_float(dt, sum);
  return out;
}

// --- the hub (rank 0's thread) -----------------------------------------------------------

class Hub {
 public:
  Hub(int listen_fd, int world, double timeout_s)
      : listen_fd_(listen_fd),
        world_(world),
        timeout_s_(timeout_s),
        fds_(world, -1),
        done_(world, false) {}
  ~Hub() {
    for (int fd : fds_)
      if (fd >= 0) ::close(fd);
    ::close(listen_fd_);
  }

  void run() {
    try {
      accept_all();
      serve();
    } catch (const std::exception& e) {
      fail_all(e.what());
    }
  }

 private:
  struct Pending {
    Op op;
    std::vector<std::string> parts;
    std::vector<bool> arrived;
    int count = 0;
    Clock::time_point first;
  };

  void accept_all() {
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(timeout_s_));
    for (int joined = 0; joined < world_;) {
      pollfd pfd{listen_fd_, POLLIN, 0};
      if (Clock::now() > deadline) {
        std::string missing;
        for (int r = 0; r < world_; ++r)
          if (fds_[r] < 0) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
        throw Error(
            ExitCode::kInternal,
            fmt::format("rendezvous: only {} of {} ranks connected within {:.0f} s; rank(s) "
                        "{} never did (WORLD_SIZE={}: were they started?)",
                        joined, world_, timeout_s_, missing, world_));
      }
      if (::poll(&pfd, 1, 200) <= 0) continue;
      const int fd = ::accept(listen_fd_, nullptr, nullptr);
      if (fd < 0) continue;
      Header h;
      std::string payload;
      if (!recv_msg(fd, h, payload, timeout_s_, "hello") ||
          h.op != static_cast<uint32_t>(Op::kHello)) {
        ::close(fd);
        continue;
      }
      const int rank = get<int32_t>(payload, 0);
      if (rank < 0 || rank >= world_ || fds_[rank] >= 0)
        throw Error(ExitCode::kConfig,
                    fmt::format("rendezvous: a process claims RANK={} (world size {}, taken: {})",
                                rank, world_, rank >= 0 && rank < world_ && fds_[rank] >= 0));
      fds_[rank] = fd;
      ++joined;
    }
    std::vector<int> all(world_);
    for (int r = 0; r < world_; ++r) all[r] = r;
    groups_[0] = all;
    for (int r = 0; r < world_; ++r) send_msg(fds_[r], Header{kMagic, 0, 0, 0, 0, 0}, "");
  }

  void serve() {
    std::vector<pollfd> pfds(world_);
    while (std::count(done_.begin(), done_.end(), true) < world_) {
      for (int r = 0; r < world_; ++r) pfds[r] = pollfd{done_[r] ? -1 : fds_[r], POLLIN, 0};
      const int ready = ::poll(pfds.data(), pfds.size(), 200);
      if (ready < 0 && errno != EINTR) sys_fail("poll");
      for (int r = 0; r < world_ && ready > 0; ++r) {
        if (!(pfds[r].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        Header h;
        std::string payload;
        // A reset (a peer killed with bytes in flight) is the same news as a clean close: name
        // the rank, not the socket's errno.
        bool got = false;
        try {
          got = recv_msg(fds_[r], h, payload, timeout_s_, "a message");
        } catch (const Error&) {
          got = false;
        }
        if (!got) {
          fail_all(fmt::format("rank {} disconnected (the process exited or was killed)", r));
          return;
        }
        if (h.op == static_cast<uint32_t>(Op::kBye)) {
          done_[r] = true;
          continue;
        }
        contribute(r, h, std::move(payload));
      }
      check_timeouts();
    }
  }

  void contribute(int rank, const Header& h, std::string payload) {
    const std::vector<int>& members = groups_.at(h.group);
    const int gr =
        static_cast<int>(std::find(members.begin(), members.end(), rank) - members.begin());
    MT_CHECK(gr < static_cast<int>(members.size()), "rank {} is not in group {}", rank, h.group);
    Pending& p = pending_[{h.group, h.seq}];
    if (p.parts.empty()) {
      p.op = static_cast<Op>(h.op);
      p.parts.resize(members.size());
      p.arrived.assign(members.size(), false);
      p.first = Clock::now();
    }
    if (p.op != static_cast<Op>(h.op))
      throw Error(ExitCode::kInternal,
                  fmt::format("collective mismatch in group {} call {}: rank {} called {}, another "
                              "rank {}",
                              h.group, h.seq, rank, op_name(static_cast<Op>(h.op)), op_name(p.op)));
    p.parts[gr] = std::move(payload);
    p.arrived[gr] = true;
    if (++p.count < static_cast<int>(members.size())) return;
    const std::vector<std::string> replies = complete(p, h.group);
    for (size_t i = 0; i < members.size(); ++i)
      send_msg(fds_[members[i]], Header{kMagic, h.op, h.group, 0, h.seq, 0}, replies[i]);
    pending_.erase({h.group, h.seq});
  }

  std::vector<std::string> complete(const Pending& p, uint32_t group) {
    const size_t n = p.parts.size();
    std::vector<std::string> out(n);
    switch (p.op) {
      case Op::kBarrier:
        break;
      case Op::kAllGather: {
        std::string all;
        for (const auto& part : p.parts) all += part;
        std::fill(out.begin(), out.end(), all);
        break;
      }
      case Op::kAllReduce:
        std::fill(out.begin(), out.end(), sum_parts(p.parts));
        break;
      case Op::kReduceScatter: {
        const std::string sum = sum_parts(p.parts);
        const size_t chunk = sum.size() / n;
        for (size_t i = 0; i < n; ++i) out[i] = sum.substr(i * chunk, chunk);
        break;
      }
      case Op::kAllToAll: {
        // part = u64 row_bytes | u64 rows_to[n] | rows
        for (size_t dst = 0; dst < n; ++dst)
          for (size_t src = 0; src < n; ++src) {
            const std::string& part = p.parts[src];
            const uint64_t row_bytes = get<uint64_t>(part, 0);
            uint64_t before = 0;
            for (size_t q = 0; q < dst; ++q) before += get<uint64_t>(part, 8 + 8 * q);
            const uint64_t rows = get<uint64_t>(part, 8 + 8 * dst);
            out[dst] += part.substr(8 + 8 * n + before * row_bytes, rows * row_bytes);
          }
        break;
      }
      case Op::kSplit: {
        std::map<int32_t, std::vector<std::pair<std::pair<int32_t, int>, int>>> by_color;
        const std::vector<int>& members = groups_.at(group);
        for (size_t i = 0; i < n; ++i)
          by_color[get<int32_t>(p.parts[i], 0)].push_back(
              {{get<int32_t>(p.parts[i], 4), static_cast<int>(i)}, static_cast<int>(i)});
        for (auto& [color, list] : by_color) {
          std::sort(list.begin(), list.end());
          const uint32_t id = next_group_++;
          std::vector<int>& g = groups_[id];
          for (size_t j = 0; j < list.size(); ++j) {
            g.push_back(members[list[j].second]);
            std::string& reply = out[list[j].second];
            put<uint32_t>(reply, id);
            put<int32_t>(reply, static_cast<int32_t>(j));
            put<int32_t>(reply, static_cast<int32_t>(list.size()));
          }
        }
        break;
      }
      default:
        MT_CHECK(false, "unexpected op {}", static_cast<uint32_t>(p.op));
    }
    return out;
  }

  void check_timeouts() {
    for (const auto& [key, p] : pending_) {
      if (std::chrono::duration<double>(Clock::now() - p.first).count() < timeout_s_) continue;
      std::string missing;
      const std::vector<int>& members = groups_.at(key.first);
      for (size_t i = 0; i < members.size(); ++i)
        if (!p.arrived[i]) missing += (missing.empty() ? "" : ", ") + std::to_string(members[i]);
      throw Error(ExitCode::kInternal,
                  fmt::format("{} (group {}, call {}): rank(s) {} did not arrive within {:.0f} s",
                              op_name(p.op), key.first, key.second, missing, timeout_s_));
    }
  }

  void fail_all(const std::string& why) {
    for (int r = 0; r < world_; ++r) {
      if (fds_[r] < 0 || done_[r]) continue;
      try {
        send_msg(fds_[r], Header{kMagic, 0, 0, 1, 0, 0}, why);
      } catch (...) {
      }
    }
  }

  int listen_fd_;
  int world_;
  double timeout_s_;
  std::vector<int> fds_;
  std::vector<bool> done_;
  std::map<uint32_t, std::vector<int>> groups_;
  std::map<std::pair<uint32_t, uint64_t>, Pending> pending_;
  uint32_t next_group_ = 1;
};

// --- the rank's side ----------------------------------------------------------------------

struct Connection {
  int fd = -1;
  int rank = 0;
  double timeout_s = 300;
  std::unique_ptr<std::thread> hub;  // rank 0 only
  ~Connection() {
    if (fd >= 0) {
      try {
        send_msg(fd, Header{kMagic, static_cast<uint32_t>(Op::kBye), 0, 0, 0, 0}, "");
      } catch (...) {
      }
    }
    if (hub) hub->join();
    if (fd >= 0) ::close(fd);
  }
};

class SocketComm : public Communicator {
 public:
  SocketComm(std::shared_ptr<Connection> conn, uint32_t group, int rank, int size)
      : conn_(std::move(conn)), group_(group), rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void barrier() override { call(Op::kBarrier, ""); }

  void all_gather(const Tensor& send, Tensor& recv) override {
    MT_CHECK(recv.nbytes() == send.nbytes() * size_, "all_gather of {} into {}",
             shape_str(send.shape()), shape_str(recv.shape()));
    const std::string r = call(Op::kAllGather, bytes_of(send));
    std::memcpy(recv.raw(), r.data(), r.size());
  }

  void reduce_scatter(const Tensor& send, Tensor& recv) override {
    MT_CHECK(send.numel() == recv.numel() * size_, "reduce_scatter of {} into {}",
             shape_str(send.shape()), shape_str(recv.shape()));
    const std::string r = call(Op::kReduceScatter, typed_bytes_of(send));
    std::memcpy(recv.raw(), r.data(), recv.nbytes());
  }

  void all_reduce(Tensor& t) override {
    const std::string r = call(Op::kAllReduce, typed_bytes_of(t));
    std::memcpy(t.raw(), r.data(), t.nbytes());
  }

  void all_to_all(const Tensor& send, const std::vector<int64_t>& send_rows, Tensor& recv,
                  const std::vector<int64_t>& recv_rows) override {
    MT_CHECK(
        static_cast<int>(send_rows.size()) == size_ && static_cast<int>(recv_rows.size()) == size_,
        "all_to_all needs {} counts per side", size_);
    const int64_t rows = send.ndim() ? send.dim(0) : 0;
    const uint64_t row_bytes = rows ? send.nbytes() / rows : 0;
    std::string payload;
    put<uint64_t>(payload, row_bytes);
    for (int64_t c : send_rows) put<uint64_t>(payload, static_cast<uint64_t>(c));
    if (send.numel()) payload += bytes_of(send);
    const std::string r = call(Op::kAllToAll, payload);
    MT_CHECK(r.size() == recv.nbytes(), "all_to_all received {} bytes, expected {} ({} rows)",
             r.size(), recv.nbytes(), recv.ndim() ? recv.dim(0) : 0);
    if (!r.empty()) std::memcpy(recv.raw(), r.data(), r.size());
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    std::string payload;
    put<int32_t>(payload, color);
    put<int32_t>(payload, key);
    const std::string r = call(Op::kSplit, payload);
    return std::make_unique<SocketComm>(conn_, get<uint32_t>(r, 0), get<int32_t>(r, 4),
                                        get<int32_t>(r, 8));
  }

 private:
  static std::string bytes_of(const Tensor& t) {
    return std::string(static_cast<const char*>(t.raw()), t.nbytes());
  }
  static std::string typed_bytes_of(const Tensor& t) {
    std::string s;
    s.reserve(1 + t.nbytes());
    s.push_back(static_cast<char>(t.dtype()));
    s.append(static_cast<const char*>(t.raw()), t.nbytes());
    return s;
  }

  std::string call(Op op, const std::string& payload) {
    const auto lost = [&](const std::string& how) {
      return Error(ExitCode::kInternal,
                   fmt::format("rank {}: lost the connection to rank 0 (the hub) in {}{}: rank 0 "
                               "exited or was killed",
                               conn_->rank, op_name(op), how));
    };
    Header h;
    std::string reply;
    const std::string what = fmt::format("{} (rank {})", op_name(op), conn_->rank);
    bool got = false;
    try {
      send_msg(conn_->fd, Header{kMagic, static_cast<uint32_t>(op), group_, 0, seq_++, 0}, payload);
      got = recv_msg(conn_->fd, h, reply, conn_->timeout_s, what.c_str());
    } catch (const Error& e) {
      // A timeout keeps its own message; a reset or a broken pipe is the hub gone.
      if (std::string(e.what()).find("timed out") != std::string::npos) throw;
      throw lost(fmt::format(" ({})", e.what()));
    }
    if (!got) throw lost("");
    if (h.status != 0)
      throw Error(ExitCode::kInternal,
                  fmt::format("rank {} in {}: {}", conn_->rank, op_name(op), reply));
    return reply;
  }

  std::shared_ptr<Connection> conn_;
  uint32_t group_;
  int rank_, size_;
  uint64_t seq_ = 0;
};

constexpr double kMaxTimeoutS = 86400;  // one day

// The integer in environment variable `name`, which must lie in [0, max].
int env_int(const char* name, int fallback, bool required, long max) {
  const char* v = std::getenv(name);
  if (!v) {
    if (required)
      throw ConfigError(fmt::format("launch: environment variable {} is not set", name));
    return fallback;
  }
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v, &end, 10);
  if (*v == '\0' || *end != '\0' || errno == ERANGE || x < 0 || x > max)
    throw ConfigError(fmt::format("launch: {}='{}' is not an integer in [0, {}]", name, v, max));
  return static_cast<int>(x);
}

int listen_on(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) sys_fail("socket");
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0)
    throw ConfigError(fmt::format("launch: rank 0 cannot listen on MASTER_PORT={}: {}", port,
                                  std::strerror(errno)));
  if (::listen(fd, 1024) != 0) sys_fail("listen");
  return fd;
}

int connect_to(const Rendezvous& r) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  if (::getaddrinfo(r.master_addr.c_str(), std::to_string(r.master_port).c_str(), &hints, &res) !=
      0)
    throw ConfigError(fmt::format("launch: cannot resolve MASTER_ADDR={}", r.master_addr));
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(r.timeout_s));
  while (true) {  // rank 0 may not be listening yet
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    // Non-blocking, so that a host that drops the SYNs costs at most the deadline (a blocking
    // connect waits for the kernel's own retries, minutes).
    const int flags = ::fcntl(fd, F_GETFL, 0);
    ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
    bool connected = ::connect(fd, res->ai_addr, res->ai_addrlen) == 0;
    if (!connected && errno == EINPROGRESS) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      pollfd pfd{fd, POLLOUT, 0};
      int error = 0;
      socklen_t len = sizeof(error);
      connected = ::poll(&pfd, 1, static_cast<int>(std::clamp<int64_t>(left, 0, 1000))) == 1 &&
                  ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len) == 0 && error == 0;
    }
    if (connected) {
      ::fcntl(fd, F_SETFL, flags);
      ::freeaddrinfo(res);
      const int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      return fd;
    }
    ::close(fd);
    if (Clock::now() > deadline) {
      ::freeaddrinfo(res);
      throw Error(ExitCode::kInternal,
                  fmt::format("rank {}: cannot reach rank 0 at {}:{} within {:.0f} s", r.rank,
                              r.master_addr, r.master_port, r.timeout_s));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

}  // namespace

bool launched_by_env() {
  return std::getenv("WORLD_SIZE") != nullptr;
}

Rendezvous rendezvous_from_env() {
  Rendezvous r;
  r.world = env_int("WORLD_SIZE", 1, true, kMaxWorld);
  r.rank = env_int("RANK", 0, true, kMaxWorld);
  r.local_rank = env_int("LOCAL_RANK", r.rank, false, kMaxWorld);
  r.master_port = env_int("MASTER_PORT", 29500, r.world > 1, 65535);
  if (const char* a = std::getenv("MASTER_ADDR")) r.master_addr = a;
  if (const char* t = std::getenv("MOETRAIN_TIMEOUT_S")) {
    char* end = nullptr;
    r.timeout_s = std::strtod(t, &end);
    // A day at most: the deadline arithmetic stays far from overflow, and no collective waits
    // longer than that on purpose.
    if (*t == '\0' || *end != '\0' || !(r.timeout_s > 0) || r.timeout_s > kMaxTimeoutS)
      throw ConfigError(
          fmt::format("launch: MOETRAIN_TIMEOUT_S='{}' must be a number of seconds in (0, {}]", t,
                      kMaxTimeoutS));
  }
  if (r.world < 1 || r.rank >= r.world)
    throw ConfigError(fmt::format("launch: RANK={} must be below WORLD_SIZE={}", r.rank, r.world));
  return r;
}

std::unique_ptr<Communicator> connect_socket_world(const Rendezvous& r) {
  auto conn = std::make_shared<Connection>();
  conn->rank = r.rank;
  conn->timeout_s = r.timeout_s;
  if (r.rank == 0) {
    const int listen_fd = listen_on(r.master_port);
    conn->hub = std::make_unique<std::thread>([listen_fd, r] {
      Hub hub(listen_fd, r.world, r.timeout_s);
      hub.run();
    });
  }
  conn->fd = connect_to(r);
  std::string hello;
  put<int32_t>(hello, r.rank);
  send_msg(conn->fd, Header{kMagic, static_cast<uint32_t>(Op::kHello), 0, 0, 0, 0}, hello);
  Header h;
  std::string reply;
  // A little longer than the hub waits for the ranks: when some never come, its message naming
  // them arrives here first.
  constexpr double kHubGraceS = 5;
  if (!recv_msg(conn->fd, h, reply, r.timeout_s + kHubGraceS, "the rendezvous") || h.status != 0)
    throw Error(ExitCode::kInternal, fmt::format("rank {}: rendezvous failed: {}", r.rank,
                                                 reply.empty() ? "closed" : reply));
  return std::make_unique<SocketComm>(conn, 0, r.rank, r.world);
}

}  // namespace mt::dist
