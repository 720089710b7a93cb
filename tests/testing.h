// Test helpers: seeded random tensors and finite-difference gradient checks in fp64.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>

#include "core/error.h"
#include "core/rng.h"
#include "core/tensor.h"

namespace mt::testing {

inline Tensor randn(const Shape& shape, uint64_t seed, double scale = 1.0,
                    DType dtype = DType::kF64) {
  Tensor t = Tensor::empty(shape, dtype);
  const CounterRng rng{seed, 99};
  for (int64_t i = 0; i < t.numel(); ++i) t.set_item(i, scale * rng.normal(i));
  return t;
}

// The message of the mt::Error that f throws, or "no error".
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

inline double dot(const Tensor& a, const Tensor& b) {
  double s = 0;
  for (int64_t i = 0; i < a.numel(); ++i) s += a.item(i) * b.item(i);
  return s;
}

// Central differences of loss() with respect to every element of x (at most max_elems of them,
// spread evenly), compared with `analytic` by ||a - n|| / ||n||.
inline double gradcheck(const std::function<double()>& loss, Tensor x, const Tensor& analytic,
                        int64_t max_elems = 48, double eps = 1e-6) {
  const int64_t n = x.numel();
  const int64_t stride = std::max<int64_t>(1, n / max_elems);
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; i += stride) {
    const double orig = x.item(i);
    x.set_item(i, orig + eps);
    const double up = loss();
    x.set_item(i, orig - eps);
    const double down = loss();
    x.set_item(i, orig);
    const double g = (up - down) / (2 * eps);
    const double a = analytic.item(i);
    if (!std::isfinite(a)) return INFINITY;
    num += (a - g) * (a - g);
    den += g * g;
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

constexpr double kGradTol = 1e-6;  // fp64 central differences with eps 1e-6

}  // namespace mt::testing
