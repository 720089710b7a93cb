#include "fsdp/params.h"

#include <algorithm>

#include "core/rng.h"
#include "ops/dispatch.h"

namespace mt {

namespace {
uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}
}  // namespace

std::vector<const void*> ParamGroup::held_tile_buffers() const {
  std::vector<const void*> out;
  if (!holds_fp8_tiles()) return out;
  for (const ops::WeightCopies& q : copies)
    if (q.fp8_input.defined())
      out.insert(out.end(), {q.fp8_input.data().raw(), q.fp8_input.scales().raw()});
  return out;
}

ParamGroup make_param_group(ParamKind kind, std::vector<ParamSpec> specs, DType dtype) {
  ParamGroup g;
  g.kind = kind;
  int64_t offset = 0;
  for (auto& s : specs) {
    s.offset = offset;
    offset += shape_numel(s.shape);
  }
  g.specs = std::move(specs);
  g.numel = offset;
  g.master_dtype = dtype;
  g.compute_dtype = dtype;
  return g;
}

void allocate_group(ParamGroup& g) {
  g.params = Tensor::zeros({g.numel}, g.master_dtype);
  g.grads = Tensor::zeros({g.numel}, g.master_dtype);
  g.shard = g.params;
  g.grad_shard = g.grads;
}

void place_group(ParamGroup& g, Device device, DType compute_dtype) {
  MT_CHECK(!g.sharded(), "place_group before sharding");
  g.compute_dtype = compute_dtype;
  if (g.params.device() == device) return;
  g.params = g.params.to(device);
  g.grads = Tensor::zeros(g.grads.shape(), g.grads.dtype(), device);
  g.shard = g.params;
  g.grad_shard = g.grads;
}

void init_params(ParamGroup& g, uint64_t seed, double std) {
  for (size_t i = 0; i < g.specs.size(); ++i) {
    Tensor p = g.param(i);
    if (g.specs[i].is_norm_weight) {
      p.fill_(1.0);
      continue;
    }
    const CounterRng rng{seed, fnv1a(g.specs[i].name)};
    const int64_t base = g.specs[i].init_offset;
    // Counter-based: every element's value depends on its index only, so threads change nothing.
    ops::dispatch_float(p.dtype(), [&](auto tag) {
      using T = decltype(tag);
      T* out = p.data<T>();
#pragma omp parallel for schedule(static)
      for (int64_t j = 0; j < p.numel(); ++j) out[j] = T(std * rng.normal(base + j));
    });
  }
}

void write_spec_slice(Tensor& flat, int64_t flat_begin, const ParamSpec& s, const Tensor& value) {
  const int64_t n = shape_numel(s.shape), end = flat_begin + flat.numel();
  const int64_t lo = std::max(flat_begin, s.offset), hi = std::min(end, s.offset + n);
  if (lo >= hi) return;
  Tensor dst = flat.view(lo - flat_begin, {hi - lo});
  dst.copy_from(value.view(lo - s.offset, {hi - lo}).to(flat.dtype()));
}

}  // namespace mt
