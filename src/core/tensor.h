// Tensor: a shape, a dtype, a device and a shared, reference-counted storage. Always contiguous
// (row-major); a view is an element offset into the same storage, which is how a unit's named
// parameters live inside one flat buffer.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

namespace mt {

enum class Device : uint8_t { kCPU, kCUDA };

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& s);
int64_t shape_numel(const Shape& s);
// s with its last two dimensions swapped (a matrix's, or a batch of matrices', transpose).
Shape transposed_shape(Shape s);

// Bytes held by live tensors on one device, and the high-water mark since the last reset. On the
// GPU also the caching allocator's trips to the driver since the process began: cudaMalloc calls
// (none in a steady training step), and flushes, each a cudaMalloc that failed and returned the
// cache's free blocks to the driver (cudaFree synchronises the device) before trying again: a
// step near the memory limit whose allocations do not fit the cached sizes.
struct MemoryStats {
  int64_t current_bytes = 0;
  int64_t peak_bytes = 0;
  int64_t device_mallocs = 0;
  int64_t cache_flushes = 0;
};
MemoryStats memory_stats(Device d);
void reset_peak_memory(Device d);
// Raises the high-water mark to `bytes` if it is lower: what a CUDA graph replay uses (its
// tensors were allocated once, at capture) still counts.
void note_peak_memory(Device d, int64_t bytes);

// While one is alive on a thread, that thread's GPU tensors come from (and go back to) the graph
// pool: blocks that a captured CUDA graph reuses on every replay. They are never handed to a
// tensor outside such a scope, nor returned to the driver, so a replay cannot overwrite anything
// else. A scope's tensors must die with it: graph_pool_live_bytes() says whether they did.
class GraphPoolScope {
 public:
  GraphPoolScope();
  ~GraphPoolScope();
  GraphPoolScope(const GraphPoolScope&) = delete;
  GraphPoolScope& operator=(const GraphPoolScope&) = delete;

 private:
  bool outer_;
};
int64_t graph_pool_live_bytes();
// Counts the times the allocator gave the graph pool's free blocks back to the driver (when the
// GPU ran out of memory outside a capture): a graph captured under an older count addresses
// freed memory and must be captured again (cuda::CapturedWork does).
int64_t graph_pool_generation();

class Storage;

class Tensor {
 public:
  Tensor() = default;
  static Tensor empty(const Shape& shape, DType dtype, Device device = Device::kCPU);
  static Tensor zeros(const Shape& shape, DType dtype, Device device = Device::kCPU);
  // Filled with a value that no correct kernel leaves behind (NaN for floats, a large
  // negative for ints): tests poison outputs with it before running the op.
  static Tensor poisoned(const Shape& shape, DType dtype, Device device = Device::kCPU);

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int64_t dim(int i) const;
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t numel() const { return shape_numel(shape_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  size_t nbytes() const { return numel() * dtype_size(dtype_); }

  void* raw();
  const void* raw() const;
  template <class T>
  T* data() {
    check_type(dtype_of<T>());
    return static_cast<T*>(raw());
  }
  template <class T>
  const T* data() const {
    check_type(dtype_of<T>());
    return static_cast<const T*>(raw());
  }

  // A view of numel(shape) elements starting `offset` elements into this tensor.
  Tensor view(int64_t offset, const Shape& shape) const;
  Tensor reshape(const Shape& shape) const { return view(0, shape); }
  // Rows [begin, end) of the first dimension.
  Tensor slice_rows(int64_t begin, int64_t end) const;

  Tensor clone() const;
  Tensor to(DType dtype) const;    // conversion through double; bf16/e4m3 round to nearest even
  Tensor to(Device device) const;  // a copy on `device` (host <-> GPU through cudaMemcpy)
  // Same numel and dtype; either side may be on the CPU or the GPU.
  void copy_from(const Tensor& src);
  void zero_();
  void fill_(double value);
  // Element i as double (any numeric dtype; a GPU tensor is read through the host), for tests
  // and logs, not for loops.
  double item(int64_t i) const;
  void set_item(int64_t i, double v);
  // True when both share storage and this tensor's elements lie inside `other`.
  bool same_storage(const Tensor& other) const { return storage_ == other.storage_; }

 private:
  void check_type(DType t) const;
  std::shared_ptr<Storage> storage_;
  int64_t offset_ = 0;  // in elements
  Shape shape_;
  DType dtype_ = DType::kF32;
  Device device_ = Device::kCPU;
};

// Shape checks with messages that name the tensor.
void expect_shape(const Tensor& t, const Shape& s, const char* name);
void expect_dtype(const Tensor& t, DType d, const char* name);
// Maximum of |a-b| / max(|b|) style metrics used by tests: ||a-b|| / ||b||.
double relative_error(const Tensor& a, const Tensor& b);
bool all_finite(const Tensor& t);

}  // namespace mt
