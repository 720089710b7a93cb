#include "core/tensor.h"

#include <atomic>
#include <cmath>
#include <compare>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/block_pool.h"
#include "core/cuda/check.h"
#include "core/log.h"
#include "core/profile.h"

namespace mt {

namespace {

// This thread's GPU allocations go to the graph pool (see GraphPoolScope).
thread_local bool in_graph_pool = false;

// One allocator per device kind (DESIGN.md §3), counting the bytes of live tensors. The CPU one
// is aligned malloc. The CUDA one caches device memory in BlockPools (core/block_pool.h: best-fit
// blocks cut from cudaMalloc'd segments, split and merged), one per (pool, GPU, stream), so a
// training step's allocations stop reaching cudaMalloc (and its implicit syncs) after step 1,
// whatever sizes its phases ask for; the GPU is the calling thread's current one (a process
// drives one GPU, or one per thread in the NCCL tests). A block is reused only on the stream it
// was allocated on (the thread's cuda::stream() then), in that stream's order; a tensor that
// another stream also uses must stay alive until its own stream has waited for that use
// (core/lane.h).
struct DeviceAllocator {
  explicit DeviceAllocator(Device d) : device(d) {}
  const Device device;
  std::atomic<int64_t> current{0};
  std::atomic<int64_t> peak{0};
  std::atomic<int64_t> graph_live{0};        // bytes of live graph-pool tensors
  std::atomic<int64_t> graph_generation{0};  // see graph_pool_generation()
  std::atomic<int64_t> device_mallocs{0};    // MemoryStats
  std::atomic<int64_t> cache_flushes{0};
  std::mutex mu;
  struct Key {
    bool graph;
    int gpu;
    uintptr_t stream;  // the stream it was allocated on
    auto operator<=>(const Key&) const = default;
  };
  std::map<Key, std::unique_ptr<BlockPool>> pools;  // CUDA
  struct Owner {
    BlockPool* pool;
    bool graph;
  };
  std::unordered_map<void*, Owner> owner_of;  // CUDA: every live block's pool

  void* allocate(size_t bytes) {
    void* p = nullptr;
    if (device == Device::kCPU) {
      p = std::aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
      MT_CHECK(p != nullptr, "out of host memory allocating {} bytes", bytes);
    } else {
      p = allocate_cuda(bytes);
      if (in_graph_pool) graph_live += static_cast<int64_t>(bytes);
    }
    raise_peak(current += static_cast<int64_t>(bytes));
    return p;
  }

  void raise_peak(int64_t bytes) {
    int64_t prev = peak.load();
    while (bytes > prev && !peak.compare_exchange_weak(prev, bytes)) {
    }
  }

  void release(void* p, size_t bytes) {
    current -= static_cast<int64_t>(bytes);
    if (device == Device::kCPU) {
      std::free(p);
      return;
    }
    std::lock_guard<std::mutex> lock(mu);
    const auto it = owner_of.find(p);
    const Owner owner = it->second;
    owner_of.erase(it);
    if (owner.graph) graph_live -= static_cast<int64_t>(bytes);
    owner.pool->release(p);
  }

#if MOETRAIN_HAS_CUDA
  // Returns this GPU's wholly free segments of one kind of pool to the driver; true when there
  // were any. mu held.
  bool free_cached(int gpu, bool graph) {
    bool any = false;
    for (auto& [key, pool] : pools)
      if (key.gpu == gpu && key.graph == graph) any |= pool->release_free_segments() > 0;
    return any;
  }

  static bool capturing() {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    const cudaError_t err = cudaStreamIsCapturing(cuda::stream(), &status);
    return err != cudaSuccess || status != cudaStreamCaptureStatusNone;
  }

  void log_graph_pool_release(size_t size) const {
    log::warn(
        "GPU memory: {:.2f} GiB fitted only after the CUDA graphs' pool gave its free blocks back; "
        "the captured passes will be captured again (slower while batch shapes keep changing)",
        size / (1024.0 * 1024 * 1024));
  }

  // What an allocation the GPU cannot hold says: where the memory is, and the settings that need
  // less. Called with mu held.
  std::string out_of_memory_message(size_t size, int gpu) const {
    size_t free_bytes = 0, total_bytes = 0;
    (void)cudaMemGetInfo(&free_bytes, &total_bytes);
    (void)cudaGetLastError();
    size_t graph_cached = 0;
    for (const auto& [key, pool] : pools)
      if (key.gpu == gpu && key.graph) graph_cached += pool->reserved_bytes();
    constexpr double kGiB = 1024.0 * 1024 * 1024;
    return fmt::format(
        "out of GPU memory: {:.2f} GiB more asked of GPU {}, which has {:.2f} of {:.2f} GiB free; "
        "tensors hold {:.2f} GiB (peak so far {:.2f}) and the CUDA graphs' pool keeps {:.2f} GiB "
        "more. Settings that need less: model.checkpoint = \"selective\" or \"full\", fewer "
        "model.n_layers, a smaller train.batch_rows or train.seq_len, model.loss_chunk_tokens "
        "> 0, hardware.cuda_graphs = false, parallel.reshard_after_forward = true, or more ranks "
        "(parallel.world, parallel.ep)",
        size / kGiB, gpu, free_bytes / kGiB, total_bytes / kGiB, current.load() / kGiB,
        peak.load() / kGiB, graph_cached / kGiB);
  }

  BlockPool& pool_for(const Key& key) {
    std::unique_ptr<BlockPool>& pool = pools[key];
    if (!pool)
      pool =
          std::make_unique<BlockPool>(BlockPool::Backend{[this](size_t bytes) -> void* {
                                                           ++device_mallocs;
                                                           void* p = nullptr;
                                                           if (cudaMalloc(&p, bytes) == cudaSuccess)
                                                             return p;
                                                           (void)cudaGetLastError();
                                                           return nullptr;
                                                         },
                                                         [](void* p) { cudaFree(p); }});
    return *pool;
  }
#endif

  void* allocate_cuda(size_t size) {
#if MOETRAIN_HAS_CUDA
    int gpu = 0;
    MT_CUDA_CHECK(cudaGetDevice(&gpu));
    const Key key{in_graph_pool, gpu, reinterpret_cast<uintptr_t>(cuda::stream())};
    std::lock_guard<std::mutex> lock(mu);
    BlockPool& pool = pool_for(key);
    void* p = pool.allocate(size);
    if (p == nullptr) {
      // Out of memory: give this GPU's wholly free ordinary segments back to the driver and try
      // again; then, outside a capture (which cannot free), the graph pool's too, which makes
      // every captured graph stale (graph_pool_generation).
      if (free_cached(gpu, false)) ++cache_flushes;
      p = pool.allocate(size);
      if (p == nullptr && !capturing()) {
        if (free_cached(gpu, true)) ++graph_generation;
        p = pool.allocate(size);
        if (p != nullptr) log_graph_pool_release(size);
      }
      if (p == nullptr) throw Error(ExitCode::kOutOfMemory, out_of_memory_message(size, gpu));
    }
    owner_of[p] = {&pool, key.graph};
    return p;
#else
    (void)size;
    MT_CHECK(false, "a GPU tensor in a build without CUDA");
#endif
  }
};

DeviceAllocator& allocator_for(Device d) {
  static DeviceAllocator cpu(Device::kCPU);
  static DeviceAllocator* cuda = new DeviceAllocator(Device::kCUDA);  // outlives static tensors
  return d == Device::kCPU ? cpu : *cuda;
}

#if MOETRAIN_HAS_CUDA
cudaMemcpyKind copy_kind(Device dst, Device src) {
  if (dst == Device::kCUDA)
    return src == Device::kCUDA ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice;
  return src == Device::kCUDA ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost;
}
#endif

// memcpy that understands devices, in order on the thread's stream; a copy that touches host
// memory is finished when it returns, a device-to-device one is only queued (what reads it next
// runs on the same stream), so that a CUDA graph can capture it.
void copy_bytes(void* dst, Device dst_dev, const void* src, Device src_dev, size_t bytes) {
  if (bytes == 0) return;
  if (dst_dev == Device::kCPU && src_dev == Device::kCPU) {
    std::memcpy(dst, src, bytes);
    return;
  }
#if MOETRAIN_HAS_CUDA
  const bool host = dst_dev == Device::kCPU || src_dev == Device::kCPU;
  if (host) {
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    MT_CUDA_CHECK(cudaStreamIsCapturing(cuda::stream(), &capturing));
    if (capturing != cudaStreamCaptureStatusNone) {
      const char* phase = profile::current_phase();
      throw HostSyncInCapture(fmt::format(
          "a host sync inside a CUDA graph capture: a copy of {} bytes {} the host{} (a graphed "
          "pass must not wait for the host; hardware.cuda_graphs = false runs it eagerly)",
          bytes, dst_dev == Device::kCPU ? "from the GPU to" : "to the GPU from",
          phase ? fmt::format(", in phase '{}'", phase) : std::string()));
    }
  }
  MT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, copy_kind(dst_dev, src_dev), cuda::stream()));
  if (host) MT_CUDA_CHECK(cudaStreamSynchronize(cuda::stream()));
#else
  MT_CHECK(false, "a GPU tensor in a build without CUDA");
#endif
}

}  // namespace

class Storage {
 public:
  Storage(size_t bytes, Device d) : bytes_(bytes), device_(d) {
    ptr_ = allocator_for(d).allocate(bytes);
  }
  ~Storage() { allocator_for(device_).release(ptr_, bytes_); }
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* ptr() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_;
  size_t bytes_;
  Device device_;
};

MemoryStats memory_stats(Device d) {
  auto& a = allocator_for(d);
  return {a.current.load(), a.peak.load(), a.device_mallocs.load(), a.cache_flushes.load()};
}
GraphPoolScope::GraphPoolScope() : outer_(in_graph_pool) {
  in_graph_pool = true;
}
GraphPoolScope::~GraphPoolScope() {
  in_graph_pool = outer_;
}
int64_t graph_pool_live_bytes() {
  return allocator_for(Device::kCUDA).graph_live.load();
}
int64_t graph_pool_generation() {
  return allocator_for(Device::kCUDA).graph_generation.load();
}

void reset_peak_memory(Device d) {
  auto& a = allocator_for(d);
  a.peak = a.current.load();
}

void note_peak_memory(Device d, int64_t bytes) {
  allocator_for(d).raise_peak(bytes);
}

std::string shape_str(const Shape& s) {
  std::string out = "(";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + ")";
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

Shape transposed_shape(Shape s) {
  MT_CHECK(s.size() >= 2, "transposing {} needs two dimensions or more", shape_str(s));
  std::swap(s[s.size() - 1], s[s.size() - 2]);
  return s;
}

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  for (int64_t d : shape) MT_CHECK(d >= 0, "negative dimension in {}", shape_str(shape));
  Tensor t;
  t.shape_ = shape;
  t.dtype_ = dtype;
  t.device_ = device;
  t.storage_ = std::make_shared<Storage>(shape_numel(shape) * dtype_size(dtype), device);
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  t.zero_();
  return t;
}

Tensor Tensor::poisoned(const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  switch (dtype) {
    case DType::kI32:
    case DType::kI64:
      t.fill_(-123456789.0);
      break;
    case DType::kU8:
    case DType::kE8M0:
    case DType::kE4M3: {  // 0xFF: NaN in e4m3/e8m0
      Tensor host = empty(shape, dtype);
      std::memset(host.raw(), 0xFF, host.nbytes());
      t.copy_from(host);
      break;
    }
    default:
      t.fill_(std::numeric_limits<double>::quiet_NaN());
  }
  return t;
}

int64_t Tensor::dim(int i) const {
  if (i < 0) i += ndim();
  MT_CHECK(i >= 0 && i < ndim(), "dim {} of a tensor of shape {}", i, shape_str(shape_));
  return shape_[i];
}

void* Tensor::raw() {
  MT_CHECK(defined(), "access to an undefined tensor");
  return static_cast<char*>(storage_->ptr()) + offset_ * dtype_size(dtype_);
}
const void* Tensor::raw() const {
  return const_cast<Tensor*>(this)->raw();
}

void Tensor::check_type(DType t) const {
  MT_CHECK(t == dtype_, "tensor of dtype {} accessed as {}", dtype_name(dtype_), dtype_name(t));
}

Tensor Tensor::view(int64_t offset, const Shape& shape) const {
  MT_CHECK(defined(), "view of an undefined tensor");
  MT_CHECK(offset >= 0 && offset + shape_numel(shape) <= numel(),
           "view of {} elements at {} outside a tensor of shape {}", shape_numel(shape), offset,
           shape_str(shape_));
  Tensor t = *this;
  t.offset_ = offset_ + offset;
  t.shape_ = shape;
  return t;
}

Tensor Tensor::slice_rows(int64_t begin, int64_t end) const {
  MT_CHECK(ndim() >= 1 && begin >= 0 && begin <= end && end <= shape_[0],
           "rows [{}, {}) of shape {}", begin, end, shape_str(shape_));
  Shape s = shape_;
  s[0] = end - begin;
  return view(begin * (numel() / std::max<int64_t>(shape_[0], 1)), s);
}

Tensor Tensor::clone() const {
  Tensor t = empty(shape_, dtype_, device_);
  t.copy_from(*this);
  return t;
}

Tensor Tensor::to(Device device) const {
  Tensor t = empty(shape_, dtype_, device);
  t.copy_from(*this);
  return t;
}

void Tensor::copy_from(const Tensor& src) {
  MT_CHECK(src.numel() == numel() && src.dtype() == dtype_, "copy of {} {} into {} {}",
           dtype_name(src.dtype()), shape_str(src.shape()), dtype_name(dtype_), shape_str(shape_));
  copy_bytes(raw(), device_, src.raw(), src.device(), nbytes());
}

void Tensor::zero_() {
  if (device_ == Device::kCPU) {
    std::memset(raw(), 0, nbytes());
    return;
  }
#if MOETRAIN_HAS_CUDA
  MT_CUDA_CHECK(cudaMemsetAsync(raw(), 0, nbytes(), cuda::stream()));
#endif
}

double Tensor::item(int64_t i) const {
  MT_CHECK(i >= 0 && i < numel(), "item {} of {}", i, shape_str(shape_));
  if (device_ != Device::kCPU) return view(i, {1}).to(Device::kCPU).item(0);
  const void* p = raw();
  switch (dtype_) {
    case DType::kF32:
      return static_cast<const float*>(p)[i];
    case DType::kF64:
      return static_cast<const double*>(p)[i];
    case DType::kBF16:
      return from_bf16(static_cast<const bf16*>(p)[i]);
    case DType::kF16:
      return from_f16(static_cast<const f16*>(p)[i]);
    case DType::kE4M3:
      return from_e4m3(static_cast<const uint8_t*>(p)[i]);
    case DType::kE8M0:
      return from_e8m0(static_cast<const uint8_t*>(p)[i]);
    case DType::kI32:
      return static_cast<const int32_t*>(p)[i];
    case DType::kI64:
      return static_cast<double>(static_cast<const int64_t*>(p)[i]);
    case DType::kU8:
      return static_cast<const uint8_t*>(p)[i];
  }
  return 0;
}

void Tensor::set_item(int64_t i, double v) {
  if (device_ != Device::kCPU) {
    Tensor one = empty({1}, dtype_);
    one.set_item(0, v);
    Tensor dst = view(i, {1});
    dst.copy_from(one);
    return;
  }
  void* p = raw();
  switch (dtype_) {
    case DType::kF32:
      static_cast<float*>(p)[i] = static_cast<float>(v);
      break;
    case DType::kF64:
      static_cast<double*>(p)[i] = v;
      break;
    case DType::kBF16:
      static_cast<bf16*>(p)[i] = to_bf16(v);
      break;
    case DType::kF16:
      static_cast<f16*>(p)[i] = to_f16(v);
      break;
    case DType::kE4M3:
      static_cast<uint8_t*>(p)[i] = to_e4m3(static_cast<float>(v));
      break;
    case DType::kE8M0:
      MT_CHECK(false, "set_item on e8m0: scales are computed, not cast");
    case DType::kI32:
      static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v);
      break;
    case DType::kI64:
      static_cast<int64_t*>(p)[i] = static_cast<int64_t>(v);
      break;
    case DType::kU8:
      static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(v);
      break;
  }
}

void Tensor::fill_(double value) {
  if (device_ != Device::kCPU) {
    Tensor host = empty(shape_, dtype_);
    host.fill_(value);
    copy_from(host);
    return;
  }
  const int64_t n = numel();
  for (int64_t i = 0; i < n; ++i) set_item(i, value);
}

Tensor Tensor::to(DType dtype) const {
  if (device_ != Device::kCPU) return to(Device::kCPU).to(dtype).to(device_);
  Tensor t = empty(shape_, dtype, device_);
  const int64_t n = numel();
  for (int64_t i = 0; i < n; ++i) t.set_item(i, item(i));
  return t;
}

void expect_shape(const Tensor& t, const Shape& s, const char* name) {
  MT_CHECK(t.defined() && t.shape() == s, "{} has shape {}, expected {}", name,
           t.defined() ? shape_str(t.shape()) : "undefined", shape_str(s));
}

void expect_dtype(const Tensor& t, DType d, const char* name) {
  MT_CHECK(t.dtype() == d, "{} has dtype {}, expected {}", name, dtype_name(t.dtype()),
           dtype_name(d));
}

double relative_error(const Tensor& a_in, const Tensor& b_in) {
  MT_CHECK(a_in.numel() == b_in.numel(), "relative_error of {} vs {}", shape_str(a_in.shape()),
           shape_str(b_in.shape()));
  const Tensor a = a_in.device() == Device::kCPU ? a_in : a_in.to(Device::kCPU);
  const Tensor b = b_in.device() == Device::kCPU ? b_in : b_in.to(Device::kCPU);
  double num = 0, den = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double x = a.item(i), y = b.item(i);
    if (!std::isfinite(x) || !std::isfinite(y)) return std::numeric_limits<double>::infinity();
    num += (x - y) * (x - y);
    den += y * y;
  }
  if (den == 0) return num == 0 ? 0.0 : std::numeric_limits<double>::infinity();
  return std::sqrt(num / den);
}

bool all_finite(const Tensor& t_in) {
  const Tensor t = t_in.device() == Device::kCPU ? t_in : t_in.to(Device::kCPU);
  const auto finite = [&](auto tag) {  // a tight loop: checkpoints check every tensor
    using T = decltype(tag);
    const T* p = static_cast<const T*>(t.raw());
    bool ok = true;
    for (int64_t i = 0; i < t.numel(); ++i) ok &= std::isfinite(p[i]);
    return ok;
  };
  switch (t.dtype()) {
    case DType::kF32:
      return finite(float{});
    case DType::kF64:
      return finite(double{});
    default:
      for (int64_t i = 0; i < t.numel(); ++i)
        if (!std::isfinite(t.item(i))) return false;
      return true;
  }
}

}  // namespace mt
