#include "core/tensor.h"

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

namespace mt {

namespace {

// One allocator per device (DESIGN.md §3). The CPU one is plain aligned malloc with byte
// accounting; CUDA's caching allocator arrives with the CUDA backend.
struct DeviceAllocator {
  std::atomic<int64_t> current{0};
  std::atomic<int64_t> peak{0};
  void* allocate(size_t bytes) {
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
    MT_CHECK(p != nullptr, "out of host memory allocating {} bytes", bytes);
    int64_t now = current += static_cast<int64_t>(bytes);
    int64_t prev = peak.load();
    while (now > prev && !peak.compare_exchange_weak(prev, now)) {
    }
    return p;
  }
  void release(void* p, size_t bytes) {
    std::free(p);
    current -= static_cast<int64_t>(bytes);
  }
};

DeviceAllocator& allocator_for(Device d) {
  MT_CHECK(d == Device::kCPU, "the CUDA backend is not built yet (tensor on cuda)");
  static DeviceAllocator cpu;
  return cpu;
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
  return {a.current.load(), a.peak.load()};
}
void reset_peak_memory(Device d) {
  auto& a = allocator_for(d);
  a.peak = a.current.load();
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
    case DType::kI64: t.fill_(-123456789.0); break;
    case DType::kU8:
    case DType::kE8M0:
    case DType::kE4M3: std::memset(t.raw(), 0xFF, t.nbytes()); break;  // NaN in e4m3/e8m0
    default: t.fill_(std::numeric_limits<double>::quiet_NaN());
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
const void* Tensor::raw() const { return const_cast<Tensor*>(this)->raw(); }

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
  std::memcpy(t.raw(), raw(), nbytes());
  return t;
}

void Tensor::copy_from(const Tensor& src) {
  MT_CHECK(src.numel() == numel() && src.dtype() == dtype_, "copy of {} {} into {} {}",
           dtype_name(src.dtype()), shape_str(src.shape()), dtype_name(dtype_), shape_str(shape_));
  std::memcpy(raw(), src.raw(), nbytes());
}

void Tensor::zero_() { std::memset(raw(), 0, nbytes()); }

double Tensor::item(int64_t i) const {
  MT_CHECK(i >= 0 && i < numel(), "item {} of {}", i, shape_str(shape_));
  const void* p = raw();
  switch (dtype_) {
    case DType::kF32: return static_cast<const float*>(p)[i];
    case DType::kF64: return static_cast<const double*>(p)[i];
    case DType::kBF16: return from_bf16(static_cast<const bf16*>(p)[i]);
    case DType::kE4M3: return from_e4m3(static_cast<const uint8_t*>(p)[i]);
    case DType::kE8M0: return from_e8m0(static_cast<const uint8_t*>(p)[i]);
    case DType::kI32: return static_cast<const int32_t*>(p)[i];
    case DType::kI64: return static_cast<double>(static_cast<const int64_t*>(p)[i]);
    case DType::kU8: return static_cast<const uint8_t*>(p)[i];
  }
  return 0;
}

void Tensor::set_item(int64_t i, double v) {
  void* p = raw();
  switch (dtype_) {
    case DType::kF32: static_cast<float*>(p)[i] = static_cast<float>(v); break;
    case DType::kF64: static_cast<double*>(p)[i] = v; break;
    case DType::kBF16: static_cast<bf16*>(p)[i] = to_bf16(static_cast<float>(v)); break;
    case DType::kE4M3: static_cast<uint8_t*>(p)[i] = to_e4m3(static_cast<float>(v)); break;
    case DType::kE8M0: MT_CHECK(false, "set_item on e8m0: scales are computed, not cast");
    case DType::kI32: static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v); break;
    case DType::kI64: static_cast<int64_t*>(p)[i] = static_cast<int64_t>(v); break;
    case DType::kU8: static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(v); break;
  }
}

void Tensor::fill_(double value) {
  const int64_t n = numel();
  for (int64_t i = 0; i < n; ++i) set_item(i, value);
}

Tensor Tensor::to(DType dtype) const {
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

double relative_error(const Tensor& a, const Tensor& b) {
  MT_CHECK(a.numel() == b.numel(), "relative_error of {} vs {}", shape_str(a.shape()),
           shape_str(b.shape()));
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

bool all_finite(const Tensor& t) {
  for (int64_t i = 0; i < t.numel(); ++i)
    if (!std::isfinite(t.item(i))) return false;
  return true;
}

}  // namespace mt
