// Every CUDA op against the CPU reference (ctest label `gpu`): fresh random inputs each run (the
// seed is printed), outputs poisoned with NaN first, ||gpu - cpu|| / ||cpu|| under 1e-5 for f32
// storage and 1e-2 for bf16 (inputs rounded to bf16 for both sides).
#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <tuple>

#include "core/cuda/device.h"
#include "core/cuda/graph.h"
#include "model/config.h"
#include "moe/moe_layer.h"
#include "ops/activation.h"
#include "ops/attention.h"
#include "ops/cuda/grouped_gemm.h"
#include "ops/elementwise.h"
#include "ops/embedding.h"
#include "ops/gemm.h"
#include "ops/grouped_gemm.h"
#include "ops/loss.h"
#include "ops/norm.h"
#include "ops/optim.h"
#include "ops/permute.h"
#include "ops/rope.h"
#include "ops/route.h"
#include "testing.h"

namespace mt {
namespace {

// A fresh seed per case, or with MOETRAIN_TEST_SEED set that seed for every case (to replay a
// printed one: MOETRAIN_TEST_SEED=S test_cuda_ops --gtest_filter=THE_CASE).
uint64_t fresh_seed() {
  if (const char* fixed = std::getenv("MOETRAIN_TEST_SEED")) return std::stoull(fixed);
  static const uint64_t base = std::random_device{}();
  static uint64_t n = 0;
  return base + 1000 * n++;
}

struct GpuCase : ::testing::TestWithParam<DType> {
  void SetUp() override {
    if (cuda::device_count() == 0) GTEST_FAIL() << "no GPU: run this test on the GPU machine";
    seed = fresh_seed();
    RecordProperty("seed", std::to_string(seed));
    std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  }
  // A random f32 tensor whose values are representable in the storage dtype under test.
  Tensor input(const Shape& s, double scale = 1.0) {
    return testing::randn(s, seed + counter++, scale, DType::kF32).to(GetParam()).to(DType::kF32);
  }
  Tensor gpu(const Tensor& cpu_f32) const { return cpu_f32.to(GetParam()).to(Device::kCUDA); }
  Tensor gpu_out(const Shape& s, DType d) const { return Tensor::poisoned(s, d, Device::kCUDA); }
  Tensor gpu_out(const Shape& s) const { return gpu_out(s, GetParam()); }
  double tol() const { return GetParam() == DType::kF32 ? 1e-5 : 1e-2; }
  void expect_close(const Tensor& got, const Tensor& ref, const char* what) const {
    const Tensor host = got.to(Device::kCPU).to(DType::kF32);
    ASSERT_TRUE(all_finite(host)) << what << ": unwritten (NaN) or non-finite output";
    const double err = relative_error(host, ref);
    EXPECT_LT(err, tol()) << what << " (" << dtype_name(GetParam()) << ", seed " << seed << ")";
  }
  void check_rmsnorm(int64_t n, int64_t d);
  void check_swiglu(int64_t m, int64_t f);
  void check_cross_entropy(int64_t n, int64_t v);
  void check_rope(int64_t hd);
  uint64_t seed = 0;
  uint64_t counter = 0;
};

// Shapes: the model's hidden rows, QK-norm's many short rows, and an odd width that takes the
// kernels' element-at-a-time path instead of 16-byte packs.
TEST_P(GpuCase, RMSNormForwardBackward) {
  for (const auto& [n, d] : {std::pair<int64_t, int64_t>{4096, 2048}, {20000, 128}, {1001, 100}})
    check_rmsnorm(n, d);
}

void GpuCase::check_rmsnorm(int64_t n, int64_t d) {
  SCOPED_TRACE(::testing::Message() << "rmsnorm " << n << " x " << d);
  const Tensor x = input({n, d}), w = input({d}, 0.5), dy = input({n, d});
  Tensor y = Tensor::empty({n, d}, DType::kF32), rstd = Tensor::empty({n}, DType::kF32);
  ops::rmsnorm_forward(x, w, 1e-6, y, rstd);
  Tensor dx = Tensor::empty({n, d}, DType::kF32), dw = input({d});
  const Tensor dw0 = dw.clone();
  ops::rmsnorm_backward(x, w, rstd, dy, dx, dw);

  Tensor gy = gpu_out({n, d}), grstd = gpu_out({n}, DType::kF32);
  const Tensor gx = gpu(x), gw = gpu(w), gdy = gpu(dy);
  ops::rmsnorm_forward(gx, gw, 1e-6, gy, grstd);
  expect_close(gy, y, "rmsnorm y");
  expect_close(grstd, rstd, "rmsnorm rstd");
  Tensor gdx = gpu_out({n, d}), gdw = gpu(dw0);
  ops::rmsnorm_backward(gx, gw, grstd, gdy, gdx, gdw);
  expect_close(gdx, dx, "rmsnorm dx");
  expect_close(gdw, dw, "rmsnorm dw (accumulated)");
}

TEST_P(GpuCase, RopeForwardBackward) {
  for (const int64_t hd : {128, 20}) check_rope(hd);  // 20: pairs not a whole 16-byte pack
}

void GpuCase::check_rope(int64_t hd) {
  SCOPED_TRACE(::testing::Message() << "rope head dim " << hd);
  const int64_t n = 2048, h = 8;
  const Tensor x = input({n, h, hd});
  Tensor pos = Tensor::empty({n}, DType::kI32);
  for (int64_t i = 0; i < n; ++i) pos.set_item(i, (i * 7919) % 40960);  // up to 40k positions
  Tensor y = Tensor::empty(x.shape(), DType::kF32), back = Tensor::empty(x.shape(), DType::kF32);
  ops::rope_forward(x, pos, 1e6, y);
  ops::rope_backward(x, pos, 1e6, back);
  const Tensor gpos = pos.to(Device::kCUDA), gx = gpu(x);
  Tensor gy = gpu_out(x.shape()), gback = gpu_out(x.shape());
  ops::rope_forward(gx, gpos, 1e6, gy);
  ops::rope_backward(gx, gpos, 1e6, gback);
  expect_close(gy, y, "rope forward");
  expect_close(gback, back, "rope backward");
}

TEST_P(GpuCase, SwiGLUForwardBackward) {
  check_swiglu(8192, 768);
  check_swiglu(999, 13);  // the element-at-a-time path
}

void GpuCase::check_swiglu(int64_t m, int64_t f) {
  SCOPED_TRACE(::testing::Message() << "swiglu " << m << " x " << f);
  const Tensor h = input({m, 2 * f}, 2.0), da = input({m, f});
  Tensor a = Tensor::empty({m, f}, DType::kF32), dh = Tensor::empty({m, 2 * f}, DType::kF32);
  ops::swiglu_forward(h, a);
  ops::swiglu_backward(h, da, dh);
  const Tensor gh = gpu(h);
  Tensor ga = gpu_out({m, f}), gdh = gpu_out({m, 2 * f});
  ops::swiglu_forward(gh, ga);
  ops::swiglu_backward(gh, gpu(da), gdh);
  expect_close(ga, a, "swiglu forward");
  expect_close(gdh, dh, "swiglu backward");
  // Padding rows (negative marks, every third one here) are skipped: they keep the poison,
  // the other rows the same values as without marks.
  Tensor marks = Tensor::empty({m}, DType::kI32);
  for (int64_t r = 0; r < m; ++r) marks.set_item(r, r % 3 == 1 ? -1 : static_cast<double>(r));
  const Tensor gmarks = marks.to(Device::kCUDA);
  Tensor pa = gpu_out({m, f}), pdh = gpu_out({m, 2 * f});
  ops::swiglu_forward(gh, pa, {&gmarks});
  ops::swiglu_backward(gh, gpu(da), pdh, {&gmarks});
  const Tensor pa_h = pa.to(DType::kF32).to(Device::kCPU),
               ga_h = ga.to(DType::kF32).to(Device::kCPU);
  const Tensor pdh_h = pdh.to(DType::kF32).to(Device::kCPU);
  const Tensor gdh_h = gdh.to(DType::kF32).to(Device::kCPU);
  int64_t wrong = 0;
  for (int64_t r = 0; r < m; ++r) {
    const bool padding = r % 3 == 1;
    for (int64_t c = 0; c < 2 * f; ++c) {
      const double got = pdh_h.item(r * 2 * f + c), want = gdh_h.item(r * 2 * f + c);
      wrong += padding ? !std::isnan(got) : got != want;
      if (c < f) {
        const double got_a = pa_h.item(r * f + c), want_a = ga_h.item(r * f + c);
        wrong += padding ? !std::isnan(got_a) : got_a != want_a;
      }
    }
  }
  EXPECT_EQ(wrong, 0) << "swiglu with padding marks";

  // Routing weights per row (f32 on both sides): the outputs scaled, and each row's weight
  // gradient, a sum over the row.
  const Tensor weight = testing::randn({m}, seed + counter++, 1.0, DType::kF32);
  Tensor wa = Tensor::empty({m, f}, DType::kF32), wdh = Tensor::empty({m, 2 * f}, DType::kF32);
  Tensor wdw = Tensor::empty({m}, DType::kF32);
  ops::swiglu_forward(h, wa, {nullptr, &weight});
  ops::swiglu_backward(h, da, wdh, {nullptr, &weight}, &wdw);
  const Tensor gweight = weight.to(Device::kCUDA);
  Tensor gwa = gpu_out({m, f}), gwdh = gpu_out({m, 2 * f}), gwdw = gpu_out({m}, DType::kF32);
  ops::swiglu_forward(gh, gwa, {nullptr, &gweight});
  ops::swiglu_backward(gh, gpu(da), gwdh, {nullptr, &gweight}, &gwdw);
  expect_close(gwa, wa, "weighted swiglu forward");
  expect_close(gwdh, wdh, "weighted swiglu backward");
  const Tensor gwdw_h = gwdw.to(Device::kCPU);
  ASSERT_TRUE(all_finite(gwdw_h)) << "row-weight gradient: unwritten (NaN) or non-finite";
  EXPECT_LT(relative_error(gwdw_h, wdw), 1e-4) << "row-weight gradient, seed " << seed;
}

TEST_P(GpuCase, CrossEntropyForwardBackward) {
  for (const int64_t v : {32000, 1001}) check_cross_entropy(1024, v);
}

void GpuCase::check_cross_entropy(int64_t n, int64_t v) {
  SCOPED_TRACE(::testing::Message() << "cross-entropy vocabulary " << v);
  const Tensor logits = input({n, v}, 3.0);
  Tensor targets = Tensor::empty({n}, DType::kI32), mask = Tensor::empty({n}, DType::kU8);
  const CounterRng rng{seed, 7};
  for (int64_t i = 0; i < n; ++i) {
    targets.set_item(i, rng.below(2 * i, v));
    mask.set_item(i, rng.below(2 * i + 1, 4) != 0);
  }
  Tensor lse = Tensor::empty({n}, DType::kF32), dl = Tensor::empty({n, v}, DType::kF32);
  const double loss = ops::cross_entropy_forward(logits, targets, mask, lse);
  ops::cross_entropy_backward(logits, targets, mask, lse, 1.0 / n, dl);
  const Tensor gl = gpu(logits), gt = targets.to(Device::kCUDA), gm = mask.to(Device::kCUDA);
  Tensor glse = gpu_out({n}, DType::kF32), gdl = gpu_out({n, v});
  const double gloss = ops::cross_entropy_forward(gl, gt, gm, glse);
  ops::cross_entropy_backward(gl, gt, gm, glse, 1.0 / n, gdl);
  EXPECT_NEAR(gloss, loss, 1e-5 * std::abs(loss));
  expect_close(glse, lse, "cross-entropy lse");
  expect_close(gdl, dl, "cross-entropy dlogits");
  // Per-token losses (f32 out) against the CPU's, poisoned first.
  Tensor sum = Tensor::zeros({1}, DType::kF64), each = Tensor::empty({n}, DType::kF32);
  ops::cross_entropy_forward(logits, targets, mask, lse, sum, &each);
  Tensor gsum = Tensor::zeros({1}, DType::kF64, Device::kCUDA),
         geach = Tensor::poisoned({n}, DType::kF32, Device::kCUDA);
  ops::cross_entropy_forward(gl, gt, gm, glse, gsum, &geach);
  expect_close(geach, each, "cross-entropy per-token loss");
  EXPECT_NEAR(gsum.item(0), sum.item(0), 1e-5 * std::abs(sum.item(0)));
}

// Pooled router statistics on the GPU: the CPU's sums exactly (integer counts; one f32 add per
// element, in the same order), into poisoned-free zeroed accumulators.
TEST(GpuRouterAux, PooledStatisticsMatchTheCpu) {
  const int64_t e = 128;
  std::vector<ops::AuxStats> layers;
  for (int l = 0; l < 3; ++l) {
    ops::AuxStats s{Tensor::empty({e}, DType::kI64), Tensor::empty({e}, DType::kF32), 8};
    const CounterRng rng{static_cast<uint64_t>(l), 11};
    for (int64_t c = 0; c < e; ++c) {
      s.tokens_per_expert.data<int64_t>()[c] = rng.below(2 * c, 5000);
      s.score_sum.set_item(c, 100 * rng.uniform(2 * c + 1));
    }
    layers.push_back(s);
  }
  ops::AuxStats cpu = ops::zero_aux_stats(layers[0]);
  ops::AuxStats gpu_layer0{layers[0].tokens_per_expert.to(Device::kCUDA),
                           layers[0].score_sum.to(Device::kCUDA), 8};
  ops::AuxStats gpu = ops::zero_aux_stats(gpu_layer0);
  for (const ops::AuxStats& s : layers) {
    ops::add_aux_stats(s, cpu);
    ops::add_aux_stats({s.tokens_per_expert.to(Device::kCUDA), s.score_sum.to(Device::kCUDA), 8},
                       gpu);
  }
  const Tensor counts = gpu.tokens_per_expert.to(Device::kCPU),
               sums = gpu.score_sum.to(Device::kCPU);
  EXPECT_EQ(std::memcmp(counts.raw(), cpu.tokens_per_expert.raw(), counts.nbytes()), 0);
  EXPECT_EQ(std::memcmp(sums.raw(), cpu.score_sum.raw(), sums.nbytes()), 0);
  // The loss reads its token count (sum of counts / top_k) on the device.
  const double closs = ops::router_aux_loss(cpu).item(0),
               gloss = ops::router_aux_loss(gpu).to(Device::kCPU).item(0);
  EXPECT_GT(closs, 0.0);
  EXPECT_NEAR(gloss, closs, 1e-6 * closs);
  EXPECT_GT(sums.item(0), 0.0);
}

TEST_P(GpuCase, AdamWStep) {
  if (GetParam() != DType::kF32) GTEST_SKIP() << "master weights and moments are f32 only";
  const int64_t n = 1 << 20;
  Tensor p = input({n}), g = input({n}, 0.1), m = input({n}, 0.01), v = input({n}, 0.01);
  for (int64_t i = 0; i < n; ++i) v.set_item(i, std::abs(v.item(i)));
  Tensor gp = p.to(Device::kCUDA), gm = m.to(Device::kCUDA), gv = v.to(Device::kCUDA);
  const ops::AdamWHyper hyper{1e-3, 0.9, 0.95, 1e-8, 0.1, 7, 0.5};  // clipped by half
  ops::adamw_step(p, g, m, v, hyper);
  Tensor compute = Tensor::poisoned({n}, DType::kBF16, Device::kCUDA);
  ops::adamw_step(gp, g.to(Device::kCUDA), gm, gv, hyper, &compute);
  // Every operation rounded on its own in the reference's order: bit-identical to the CPU.
  for (auto [gpu_t, cpu_t, what] :
       {std::tuple{&gp, &p, "adamw params"}, std::tuple{&gm, &m, "adamw exp_avg"},
        std::tuple{&gv, &v, "adamw exp_avg_sq"}}) {
    const Tensor host = gpu_t->to(Device::kCPU);
    EXPECT_EQ(std::memcmp(host.raw(), cpu_t->raw(), host.nbytes()), 0) << what;
  }
  // The bf16 copy written in the same pass is exactly the cast of the new master weights.
  const Tensor cast = gp.to(Device::kCPU).to(DType::kBF16), got = compute.to(Device::kCPU);
  EXPECT_EQ(std::memcmp(cast.raw(), got.raw(), cast.nbytes()), 0) << "adamw compute copy";
}

TEST_P(GpuCase, GemmEveryTransposeAndAccumulate) {
  const int64_t m = 384, n = 200, k = 264;
  for (auto ta : {ops::Transpose::kNo, ops::Transpose::kYes})
    for (auto tb : {ops::Transpose::kNo, ops::Transpose::kYes}) {
      const Tensor a = ta == ops::Transpose::kNo ? input({m, k}) : input({k, m});
      const Tensor b = tb == ops::Transpose::kNo ? input({k, n}) : input({n, k});
      Tensor c = input({m, n});
      const Tensor c0 = c.clone();
      Tensor gc_acc = gpu(c).to(DType::kF32);  // f32 output accumulating bf16/f32 products
      ops::gemm(a, ta, b, tb, c, ops::Accumulate::kYes);
      ops::gemm(gpu(a), ta, gpu(b), tb, gc_acc, ops::Accumulate::kYes);
      expect_close(gc_acc, c, "gemm accumulate into f32");
      Tensor gc_same = gpu(c0);  // accumulating in the operands' dtype (bf16: residual sums)
      ops::gemm(gpu(a), ta, gpu(b), tb, gc_same, ops::Accumulate::kYes);
      expect_close(gc_same, c, "gemm accumulate in place");
      Tensor ref = Tensor::empty({m, n}, DType::kF32), gc = gpu_out({m, n});
      ops::gemm(a, ta, b, tb, ref, ops::Accumulate::kNo);
      ops::gemm(gpu(a), ta, gpu(b), tb, gc, ops::Accumulate::kNo);
      expect_close(gc, ref, "gemm");
    }
  // The residual read by the epilogue (C) into another buffer (D).
  const Tensor x = input({m, k}), w = input({k, n}), r = input({m, n});
  Tensor ref = Tensor::empty({m, n}, DType::kF32), out = gpu_out({m, n});
  ops::linear_forward_residual(x, w, r, ref);
  ops::linear_forward_residual(gpu(x), gpu(w), gpu(r), out);
  expect_close(out, ref, "linear + residual epilogue");
}

// Expert e's rows of t (a padded layout's rows between segments dropped), on the host.
Tensor real_rows(const Tensor& t, const std::vector<int64_t>& off,
                 const std::vector<int64_t>& seg) {
  const Tensor h = t.to(Device::kCPU);
  const int64_t e = static_cast<int64_t>(off.size()) - 1, width = h.numel() / h.dim(0);
  Tensor out = Tensor::empty({off[e], width}, h.dtype());
  const size_t row_bytes = h.nbytes() / h.dim(0);
  for (int64_t i = 0; i < e; ++i)
    std::memcpy(static_cast<char*>(out.raw()) + off[i] * row_bytes,
                static_cast<const char*>(h.raw()) + seg[i] * row_bytes,
                (off[i + 1] - off[i]) * row_bytes);
  return out;
}

// The grouped GEMMs against the CPU reference, dense and with 128-row segments (the layout
// whose forward and input gradient run on fixed descriptors): uneven experts, empty ones, partial
// tiles in every dimension, outputs poisoned (padding rows are not compared: nothing reads them).
TEST_P(GpuCase, GroupedGemmWithDeviceOffsets) {
  if (GetParam() != DType::kBF16) GTEST_SKIP() << "grouped gemm v1 is bf16";
  const std::vector<int64_t> counts = {300, 0, 129, 1, 0, 517, 128, 64};
  const int64_t e = static_cast<int64_t>(counts.size()), k = 136, n = 200;
  for (const int64_t align : {int64_t{1}, int64_t{128}}) {
    SCOPED_TRACE(fmt::format("segments aligned to {} rows", align));
    std::vector<int64_t> off(e + 1, 0), seg(e + 1, 0);
    for (int64_t i = 0; i < e; ++i) {
      off[i + 1] = off[i] + counts[i];
      seg[i + 1] = seg[i] + (counts[i] + align - 1) / align * align;
    }
    Tensor toff = Tensor::empty({e + 1}, DType::kI64), tseg = Tensor::empty({e + 1}, DType::kI64);
    for (int64_t i = 0; i <= e; ++i) {
      toff.set_item(i, static_cast<double>(off[i]));
      tseg.set_item(i, static_cast<double>(seg[i]));
    }
    const int64_t m = seg[e];
    const ops::ExpertRows rows(toff, tseg, align);
    const Tensor x = input({m, k}), w = input({e, k, n}, 0.1), dy = input({m, n});
    Tensor out = Tensor::empty({m, n}, DType::kF32), dx = Tensor::empty({m, k}, DType::kF32);
    Tensor dw = input({e, k, n}, 0.01);
    const Tensor dw0 = dw.clone();
    Tensor gdw = dw.to(Device::kCUDA);  // f32 accumulation target
    ops::grouped_gemm_forward(x, w, rows, out);
    ops::grouped_gemm_backward_input(dy, w, rows, dx);
    ops::grouped_gemm_backward_weight(x, dy, rows, dw);
    const ops::ExpertRows grows(toff.to(Device::kCUDA), tseg.to(Device::kCUDA), align);
    const Tensor gx = gpu(x), gw = gpu(w), gdy = gpu(dy);
    Tensor gout = gpu_out({m, n}), gdx = gpu_out({m, k});
    ops::grouped_gemm_forward(gx, gw, grows, gout);
    ops::grouped_gemm_backward_input(gdy, gw, grows, gdx);
    ops::grouped_gemm_backward_weight(gx, gdy, grows, gdw);
    expect_close(real_rows(gout, off, seg), real_rows(out, off, seg), "grouped forward");
    expect_close(real_rows(gdx, off, seg), real_rows(dx, off, seg), "grouped dx");
    expect_close(gdw, dw, "grouped dw (accumulated, f32)");
    // Overwriting into a poisoned buffer: experts 1 and 4 have no rows and must come out zero.
    Tensor fresh = Tensor::empty({e, k, n}, DType::kF32);
    ops::grouped_gemm_backward_weight(x, dy, rows, fresh, ops::Accumulate::kNo);
    Tensor gfresh = gpu_out({e, k, n}, DType::kF32);
    ops::grouped_gemm_backward_weight(gx, gdy, grows, gfresh, ops::Accumulate::kNo);
    expect_close(gfresh, fresh, "grouped dw (overwritten, f32)");
    EXPECT_EQ(fresh.to(DType::kF32).item(1 * k * n + 5), 0.0);

    // Version 1 (the fallback without CUTLASS) through its kernel API, on the same data.
    Tensor vout = gpu_out({m, n}), vdx = gpu_out({m, k}), vdw = dw0.to(Device::kCUDA);
    const cuda::kernels::ExpertSegments o{grows.offsets.data<int64_t>(),
                                          grows.segments.data<int64_t>()};
    const int ne = static_cast<int>(e);
    ASSERT_EQ(cuda::kernels::grouped_gemm_rows(gx.raw(), gw.raw(), o, ne, m, k, n, false,
                                               vout.raw(), false, nullptr),
              cudaSuccess);
    ASSERT_EQ(cuda::kernels::grouped_gemm_rows(gdy.raw(), gw.raw(), o, ne, m, n, k, true, vdx.raw(),
                                               false, nullptr),
              cudaSuccess);
    ASSERT_EQ(cuda::kernels::grouped_gemm_weight(gx.raw(), gdy.raw(), o, ne, k, n, vdw.raw(), true,
                                                 true, nullptr),
              cudaSuccess);
    expect_close(real_rows(vout, off, seg), real_rows(out, off, seg), "grouped forward v1");
    expect_close(real_rows(vdx, off, seg), real_rows(dx, off, seg), "grouped dx v1");
    expect_close(vdw, dw, "grouped dw v1");
  }
}

// One routing configuration, GPU against CPU: choices and counts exactly, scores, weights, score
// sums and the router backward to f32 rounding.
struct RoutingCase {
  int64_t n, e, k;
  bool norm_topk, bias;
  ops::RoutingMode mode;
  bool ties;  // logits (and bias) on a coarse grid: equal scores, so the tie order is checked
};

// The GPU ranks the biased scores in fp32, the CPU in fp64 from its own fp32 scores: two keys
// within float rounding of each other (seen: a relative gap of 1.1e-7 among 257 x 1000) may be
// ordered either way, and either choice is right. Rows of logits whose top k + 1 keys on the CPU
// are not apart by more than 1e-5 (relative) are drawn again, so that the choices compared
// exactly are well defined; exact ties stay (the "ties" cases: equal fp32 scores on both sides,
// ordered by expert index).
void separate_near_ties(Tensor& logits, const Tensor& bias, const ops::RouterOptions& opt,
                        uint64_t seed) {
  const int64_t n = logits.dim(0), e = logits.dim(1), k = opt.top_k;
  for (int attempt = 1;; ++attempt) {
    ops::Routing r;
    ops::router_forward(logits, bias, opt, r);
    int64_t redrawn = 0;
    std::vector<double> key(e);
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t c = 0; c < e; ++c)
        key[c] = static_cast<double>(r.scores.data<float>()[t * e + c]) +
                 (bias.defined() ? bias.data<float>()[c] : 0.0);
      std::partial_sort(key.begin(), key.begin() + std::min(k + 1, e), key.end(), std::greater<>());
      bool near = false;
      for (int64_t j = 0; j + 1 < std::min(k + 1, e); ++j)
        near |= key[j] - key[j + 1] <= 1e-5 * std::abs(key[j]);
      if (!near) continue;
      const Tensor row = testing::randn({e}, seed + 1000003 * attempt + t, 2.0, DType::kF32);
      std::copy(row.data<float>(), row.data<float>() + e, logits.data<float>() + t * e);
      ++redrawn;
    }
    if (redrawn == 0) return;
    ASSERT_LT(attempt, 50) << redrawn << " rows still hold near-ties";
  }
}

void check_routing(const RoutingCase& rc, uint64_t seed, ops::Routing& cr, ops::Routing& gr) {
  const std::string what =
      fmt::format("routing n {} e {} top-{}{}{}{}{}", rc.n, rc.e, rc.k,
                  rc.norm_topk ? " renormalised" : "", rc.bias ? " bias" : "",
                  rc.mode == ops::RoutingMode::kLearned ? "" : " fixed", rc.ties ? " ties" : "");
  const ops::RouterOptions opt{static_cast<int>(rc.k), rc.norm_topk, rc.mode};
  Tensor logits = testing::randn({rc.n, rc.e}, seed + 11, 2.0, DType::kF32);
  Tensor bias = rc.bias ? testing::randn({rc.e}, seed + 13, 0.01, DType::kF32) : Tensor();
  if (rc.ties) {
    for (int64_t i = 0; i < logits.numel(); ++i)
      logits.data<float>()[i] = std::round(logits.data<float>()[i] * 2) / 2;
    if (bias.defined()) bias = Tensor::zeros({rc.e}, DType::kF32);
  } else if (rc.mode == ops::RoutingMode::kLearned) {
    ASSERT_NO_FATAL_FAILURE(separate_near_ties(logits, bias, opt, seed));
  }
  ops::router_forward(logits, bias, opt, cr);
  ops::router_forward(logits.to(Device::kCUDA), bias.defined() ? bias.to(Device::kCUDA) : bias, opt,
                      gr);
  const Tensor gidx = gr.expert_index.to(Device::kCPU);
  ASSERT_EQ(std::memcmp(gidx.raw(), cr.expert_index.raw(), cr.expert_index.nbytes()), 0)
      << what << ": top-k choices differ";
  const Tensor gcount = gr.tokens_per_expert.to(Device::kCPU);
  ASSERT_EQ(std::memcmp(gcount.raw(), cr.tokens_per_expert.raw(), gcount.nbytes()), 0) << what;
  EXPECT_LT(relative_error(gr.expert_weight, cr.expert_weight), 1e-5) << what;
  EXPECT_LT(relative_error(gr.scores, cr.scores), 1e-5) << what;
  // Without padding, and with every third token padding (outside the aux statistics).
  Tensor padding = Tensor::zeros({rc.n}, DType::kU8);
  for (int64_t t = 0; t < rc.n; t += 3) padding.data<uint8_t>()[t] = 1;
  for (const Tensor& pad : {Tensor(), padding}) {
    const std::string with = what + (pad.defined() ? " (padding)" : "");
    const Tensor gpad = pad.defined() ? pad.to(Device::kCUDA) : pad;
    const ops::AuxStats cs = ops::router_aux_stats(cr, pad), gs = ops::router_aux_stats(gr, gpad);
    const Tensor gstat_count = gs.tokens_per_expert.to(Device::kCPU);
    ASSERT_EQ(std::memcmp(gstat_count.raw(), cs.tokens_per_expert.raw(), gstat_count.nbytes()), 0)
        << with;
    EXPECT_LT(relative_error(gs.score_sum, cs.score_sum), 1e-5) << with;
    const double closs = ops::router_aux_loss(cs).item(0);
    EXPECT_NEAR(ops::router_aux_loss(gs).to(Device::kCPU).item(0), closs, 1e-5 * closs) << with;
    const Tensor dweight = testing::randn({rc.n, rc.k}, seed + 12, 1.0, DType::kF32);
    Tensor cdl = Tensor::empty({rc.n, rc.e}, DType::kF32),
           gdl = Tensor::poisoned({rc.n, rc.e}, DType::kF32, Device::kCUDA);
    ops::router_backward(cr, opt, cs, pad, dweight, 0.01, cdl);
    ops::router_backward(gr, opt, gs, gpad, dweight.to(Device::kCUDA), 0.01, gdl);
    EXPECT_LT(relative_error(gdl, cdl), 1e-5) << with << ": router backward";
  }
}

TEST_P(GpuCase, RouterPermutationAndCombine) {
  if (GetParam() != DType::kBF16) GTEST_SKIP() << "rows are bf16 in the GPU layer; routing is f32";
  const int64_t n = 4096, e = 128, k = 8, d = 256;
  // Both register layouts of the kernels (up to 128 experts, up to 1024), widths that are not
  // multiples of the warp, bias, no renormalisation, forced balance and exact ties.
  using ops::RoutingMode;
  for (const RoutingCase& rc :
       {RoutingCase{333, 160, 6, false, true, RoutingMode::kLearned, false},
        RoutingCase{257, 1000, 16, true, true, RoutingMode::kLearned, false},
        RoutingCase{300, 40, 4, true, false, RoutingMode::kLearned, true},
        RoutingCase{200, 128, 8, true, false, RoutingMode::kBalanced, false},
        RoutingCase{301, 128, 8, true, true, RoutingMode::kSkewed, false},
        RoutingCase{77, 40, 7, false, false, RoutingMode::kSkewed, false},
        RoutingCase{5, 8, 2, true, false, RoutingMode::kLearned, false}}) {
    ops::Routing cr, gr;
    check_routing(rc, seed, cr, gr);
  }
  ops::Routing cr, gr;
  check_routing({n, e, k, true, false, ops::RoutingMode::kLearned, false}, seed, cr, gr);
  if (HasFatalFailure()) return;

  // The padded layout (the GPU layer's): every expert's rows from a multiple of 128, the same
  // on both sides to the entry, padding rows naming no token.
  {
    ops::ExpertPermutation cpad, gpad;
    ops::make_expert_permutation(cr.expert_index, e, cpad, 128);
    ops::make_expert_permutation(gr.expert_index, e, gpad, 128);
    ASSERT_EQ(gpad.rows(), n * k + e * 127);
    for (auto [a, b] : {std::pair{&cpad.source_token, &gpad.source_token},
                        std::pair{&cpad.row_of_choice, &gpad.row_of_choice},
                        std::pair{&cpad.expert_offsets, &gpad.expert_offsets},
                        std::pair{&cpad.segments, &gpad.segments}}) {
      const Tensor host = b->to(Device::kCPU);
      ASSERT_EQ(std::memcmp(host.raw(), a->raw(), a->nbytes()), 0) << "padded permutation differs";
    }
    for (int64_t i = 0; i < e; ++i)
      EXPECT_EQ(static_cast<int64_t>(cpad.segments.item(i)) % 128, 0) << "expert " << i;
    // Combine reads only the experts' rows: poison in the padding must not reach the output.
    const Tensor y = input({n * k, d});
    Tensor cyp = Tensor::zeros({cpad.rows(), d}, DType::kF32);
    ops::unpermute_rows_backward(y, cpad, cyp);  // y's rows into their padded places
    Tensor poisoned = cyp.clone();
    for (int64_t i = 0; i < cpad.rows(); ++i)
      if (cpad.source_token.data<int32_t>()[i] < 0)
        std::fill(poisoned.data<float>() + i * d, poisoned.data<float>() + (i + 1) * d, NAN);
    Tensor cout_ = Tensor::empty({n, d}, DType::kF32), out = gpu_out({n, d});
    ops::combine_forward(cyp, cpad, cout_);
    ops::combine_forward(gpu(poisoned), gpad, out);
    expect_close(out, cout_, "combine over a padded layout");
  }
  ops::ExpertPermutation cp, gp;
  ops::make_expert_permutation(cr.expert_index, e, cp);
  ops::make_expert_permutation(gr.expert_index, e, gp);
  for (auto [a, b] : {std::pair{&cp.source_token, &gp.source_token},
                      std::pair{&cp.row_of_choice, &gp.row_of_choice},
                      std::pair{&cp.expert_offsets, &gp.expert_offsets}}) {
    const Tensor host = b->to(Device::kCPU);
    ASSERT_EQ(std::memcmp(host.raw(), a->raw(), a->nbytes()), 0) << "permutation differs";
  }
  const Tensor x = input({n, d});
  Tensor cxp = Tensor::empty({n * k, d}, DType::kF32), gxp = gpu_out({n * k, d});
  ops::permute_rows(x, cp, cxp);
  ops::permute_rows(gpu(x), gp, gxp);
  expect_close(gxp, cxp, "permute rows");
  const Tensor dxp = input({n * k, d});
  Tensor cdx = Tensor::empty({n, d}, DType::kF32), gdx = gpu_out({n, d});
  ops::permute_rows_backward(dxp, cp, cdx);
  ops::permute_rows_backward(gpu(dxp), gp, gdx);
  expect_close(gdx, cdx, "permute rows backward");
  const Tensor y = input({n * k, d});
  Tensor cout_ = Tensor::empty({n, d}, DType::kF32), gout = gpu_out({n, d});
  ops::combine_forward(y, cp, cout_);
  ops::combine_forward(gpu(y), gp, gout);
  expect_close(gout, cout_, "combine");
  const Tensor residual = input({n, d});
  Tensor cres = Tensor::empty({n, d}, DType::kF32), gres = gpu_out({n, d});
  const Tensor gresidual = gpu(residual);
  ops::combine_forward(y, cp, cres, &residual);
  ops::combine_forward(gpu(y), gp, gres, &gresidual);
  expect_close(gres, cres, "combine + residual");
  // The routing weights' moves (one f32 per row, the narrow-row kernels): choices into expert
  // rows, and their gradients back, over the padded layout (its padding rows keep the poison).
  ops::ExpertPermutation cpad, gpad;
  ops::make_expert_permutation(cr.expert_index, e, cpad, 128);
  ops::make_expert_permutation(gr.expert_index, e, gpad, 128);
  const Tensor gweight = gr.expert_weight.reshape({n, k, 1});
  Tensor gw_rows = Tensor::poisoned({gpad.rows(), 1}, DType::kF32, Device::kCUDA);
  ops::unpermute_rows_backward(gweight, gpad, gw_rows);
  const Tensor w_rows = gw_rows.to(Device::kCPU), w_host = gr.expert_weight.to(Device::kCPU);
  const Tensor tokens = gpad.source_token.to(Device::kCPU);
  const Tensor choice_rows = gpad.row_of_choice.to(Device::kCPU);
  int64_t wrong = 0;
  for (int64_t r = 0; r < gpad.rows(); ++r)
    if (tokens.data<int32_t>()[r] < 0) wrong += !std::isnan(w_rows.item(r));
  for (int64_t i = 0; i < n * k; ++i)
    wrong += w_rows.item(choice_rows.data<int32_t>()[i]) != w_host.item(i);
  EXPECT_EQ(wrong, 0) << "routing weights into expert rows";
  Tensor back = Tensor::poisoned({n, k, 1}, DType::kF32, Device::kCUDA);
  ops::unpermute_rows(gw_rows, gpad, back);
  EXPECT_EQ(relative_error(back.to(Device::kCPU).reshape({n, k}), w_host), 0.0)
      << "expert rows back to the choices";
}

// Zeroed f32 gradients for a layer's weights, on the host and on the GPU.
std::pair<moe::MoeWeights, moe::MoeWeights> zero_grads(const moe::MoeWeights& w) {
  moe::MoeWeights cpu{Tensor::zeros(w.router.shape(), DType::kF32),
                      Tensor::zeros(w.w_gate_up.shape(), DType::kF32),
                      Tensor::zeros(w.w_down.shape(), DType::kF32)};
  moe::MoeWeights gpu{cpu.router.to(Device::kCUDA), cpu.w_gate_up.to(Device::kCUDA),
                      cpu.w_down.to(Device::kCUDA)};
  return {cpu, gpu};
}

TEST_P(GpuCase, MoeLayerForwardBackwardMatchesCpu) {
  if (GetParam() != DType::kBF16) GTEST_SKIP() << "the GPU layer runs bf16 rows";
  ModelConfig c;
  c.dim = 256;
  c.moe_dim = 128;
  c.n_experts = 16;
  c.top_k = 4;
  c.routing = ops::RoutingMode::kBalanced;  // fixed choices: bf16 vs f32 logits cannot flip a top-k
  const int64_t n = 512, e = c.n_experts, d = c.dim, f = c.moe_dim;
  moe::MoeWeights cw{input({d, e}, 0.1), input({e, d, 2 * f}, 0.06), input({e, f, d}, 0.09)};
  moe::MoeWeights gw{gpu(cw.router), gpu(cw.w_gate_up), gpu(cw.w_down)};
  auto [cg, gg] = zero_grads(cw);
  const Tensor hn = input({n, d}), dout = input({n, d});
  moe::MoeActivations ca, ga;
  moe::moe_fill(cw, c.moe(), {}, Tensor(), hn, ca);
  moe::moe_fill(gw, c.moe(), {}, Tensor(), gpu(hn), ga);
  Tensor cout_ = Tensor::empty({n, d}, DType::kF32), gout = gpu_out({n, d});
  moe::moe_combine(cw, c.moe(), {}, ca, cout_);
  moe::moe_combine(gw, c.moe(), {}, ga, gout);
  const Tensor cdh = moe::moe_backward(cw, cg, c.moe(), {}, hn, ca, dout, 0.01);
  const Tensor gdh = moe::moe_backward(gw, gg, c.moe(), {}, gpu(hn), ga, gpu(dout), 0.01);
  // A chain of bf16 GEMMs and activations: each stage rounds, so 2e-2 end to end.
  const double tol = 2e-2;
  EXPECT_LT(relative_error(gout.to(DType::kF32), cout_), tol) << "layer output";
  EXPECT_LT(relative_error(gdh.to(DType::kF32), cdh), tol) << "d hn";
  EXPECT_LT(relative_error(gg.router, cg.router), tol) << "d router";
  EXPECT_LT(relative_error(gg.w_gate_up, cg.w_gate_up), tol) << "d w_gate_up";
  EXPECT_LT(relative_error(gg.w_down, cg.w_down), tol) << "d w_down";
  EXPECT_NEAR(ga.aux_loss.item(0), ca.aux_loss.item(0), 1e-4 * ca.aux_loss.item(0));
}

// Mixed precision keeps the router in fp32 (ParamSpec::master_weight): with fp32 weights that
// bf16 cannot hold and a bf16 input, the logits and the router's weight gradient (here from the
// load-balancing loss alone, so that no bf16 expert output enters it) are the CPU's fp32 GEMMs
// on the up-cast input to fp32 accuracy, not bf16's; the input gradient is rounded once.
TEST_P(GpuCase, MoeRouterRunsInFp32OnMasterWeights) {
  if (GetParam() != DType::kBF16) GTEST_SKIP() << "mixed precision: bf16 rows, fp32 router";
  ModelConfig c;
  c.dim = 256;
  c.moe_dim = 64;
  c.n_experts = 32;
  c.top_k = 4;
  // Fixed choices (the comparison is of the math) with uneven counts: under balanced counts the
  // load-balancing loss is flat in the logits (its gradient is rounding noise).
  c.routing = ops::RoutingMode::kSkewed;
  const int64_t n = 1024, e = c.n_experts, d = c.dim, f = c.moe_dim;
  const Tensor router = testing::randn({d, e}, seed + 101, 0.1, DType::kF32);  // not bf16 values
  moe::MoeWeights cw{router, input({e, d, 2 * f}, 0.06), input({e, f, d}, 0.09)};
  moe::MoeWeights gw{router.to(Device::kCUDA), gpu(cw.w_gate_up), gpu(cw.w_down)};
  auto [cg, gg] = zero_grads(cw);
  const Tensor hn = input({n, d}), dout = Tensor::zeros({n, d}, DType::kF32);
  moe::MoeActivations ca, ga;
  moe::moe_fill(cw, c.moe(), {}, Tensor(), hn, ca);
  moe::moe_fill(gw, c.moe(), {}, Tensor(), gpu(hn), ga);
  ASSERT_EQ(ga.logits.dtype(), DType::kF32);
  const Tensor glogits = ga.logits.to(Device::kCPU);
  ASSERT_TRUE(all_finite(glogits));
  EXPECT_LT(relative_error(glogits, ca.logits), 1e-5) << "logits, seed " << seed;
  const Tensor cdh = moe::moe_backward(cw, cg, c.moe(), {}, hn, ca, dout, 1.0);
  const Tensor gdh = moe::moe_backward(gw, gg, c.moe(), {}, gpu(hn), ga, gpu(dout), 1.0);
  const Tensor grouter = gg.router.to(Device::kCPU);
  double norm = 0;
  for (int64_t i = 0; i < cg.router.numel(); ++i) norm += std::abs(cg.router.item(i));
  EXPECT_GT(norm, 0.0) << "the load-balancing loss gives the router a gradient";
  EXPECT_LT(relative_error(grouter, cg.router), 1e-5) << "router weight gradient, seed " << seed;
  EXPECT_LT(relative_error(gdh.to(Device::kCPU).to(DType::kF32), cdh), 4e-3) << "d hn (bf16)";
}

TEST_P(GpuCase, AttentionPackedCausalGqa) {
  // Documents of 300, 1, 57 and 700 tokens; 8 query heads over 2 kv heads; Dqk 64, Dv 32.
  const std::vector<int32_t> cu = {0, 300, 301, 358, 1058};
  const int64_t n = 1058, h = 8, kv = 2, dqk = 64, dv = 32;
  Tensor cus = Tensor::empty({5}, DType::kI32);
  for (int i = 0; i < 5; ++i) cus.set_item(i, cu[i]);
  const Tensor q = input({n, h, dqk}), k = input({n, kv, dqk}), v = input({n, kv, dv});
  const Tensor dout = input({n, h, dv});
  const double scale = 1.0 / std::sqrt(static_cast<double>(dqk));
  Tensor out = Tensor::empty({n, h, dv}, DType::kF32), lse = Tensor::empty({n, h}, DType::kF32);
  ops::attention_forward(q, k, v, {cus, 700}, scale, out, lse);
  Tensor dq = Tensor::empty(q.shape(), DType::kF32), dk = Tensor::empty(k.shape(), DType::kF32);
  Tensor dvv = Tensor::empty(v.shape(), DType::kF32);
  ops::attention_backward(q, k, v, out, lse, dout, {cus, 700}, scale, dq, dk, dvv);

  const Tensor gq = gpu(q), gk = gpu(k), gv = gpu(v);
  const ops::Documents gcu{cus.to(Device::kCUDA), 700};
  Tensor gout = gpu_out({n, h, dv}), glse = gpu_out({n, h}, DType::kF32);
  ops::attention_forward(gq, gk, gv, gcu, scale, gout, glse);
  expect_close(gout, out, "attention out");
  expect_close(glse, lse, "attention lse");
  Tensor gdq = gpu_out(q.shape()), gdk = gpu_out(k.shape()), gdv = gpu_out(v.shape());
  // The backward reads the GPU's own forward output, as training does.
  ops::attention_backward(gq, gk, gv, gout, glse, gpu(dout), gcu, scale, gdq, gdk, gdv);
  expect_close(gdq, dq, "attention dq");
  expect_close(gdk, dk, "attention dk");
  expect_close(gdv, dvv, "attention dv");
}

// cuDNN's fused SDPA at Qwen3's head shape against the CPU reference (bf16 inputs, fp32 math):
// five documents (padded to eight empty-tailed ones inside) including a one-token document,
// then a second packing that builds another graph. Deterministic backward repeats bit for bit, and
// gives the same bits run over groups of heads.
TEST(CudnnAttention, MatchesReferenceOnPackedDocuments) {
  if (cuda::device_count() == 0) GTEST_FAIL() << "no GPU: run this test on the GPU machine";
  const ops::AttentionGpu kCudnn{ops::AttentionKernel::kCudnn};
  // A zero workspace budget: as many head groups as there are KV heads.
  const ops::AttentionGpu kCudnnSplit{ops::AttentionKernel::kCudnn,
                                      ops::Determinism::kDeterministic, 0};
  const ops::AttentionGpu kCudnnFast{ops::AttentionKernel::kCudnn, ops::Determinism::kFast};
  if (!ops::cudnn_attention_available()) GTEST_FAIL() << "built without the cuDNN frontend";
  const uint64_t seed = fresh_seed();
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  const int64_t h = 16, kv = 2, d = 128;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  // One long document beside 40 short ones: the backward plans the long one apart.
  std::vector<int32_t> one_long = {0, 700};
  for (int i = 1; i <= 40; ++i) one_long.push_back(700 + 10 * i - (i % 3));
  for (const std::vector<int32_t>& cu : {std::vector<int32_t>{0, 300, 301, 358, 1058, 1100},
                                         std::vector<int32_t>{0, 1024, 1100}, one_long}) {
    const int64_t n = cu.back(), docs = static_cast<int64_t>(cu.size()) - 1;
    Tensor cus = Tensor::empty({docs + 1}, DType::kI32);
    for (int64_t i = 0; i <= docs; ++i) cus.set_item(i, cu[i]);
    const ops::Documents host_docs{cus, ops::max_document_length(cus)};
    const auto bf16_values = [&](const Shape& s, uint64_t stream) {
      return testing::randn(s, seed + stream, 1.0, DType::kF32).to(DType::kBF16).to(DType::kF32);
    };
    const Tensor q = bf16_values({n, h, d}, 1), k = bf16_values({n, kv, d}, 2),
                 v = bf16_values({n, kv, d}, 3), dout = bf16_values({n, h, d}, 4);
    Tensor out = Tensor::empty({n, h, d}, DType::kF32), lse = Tensor::empty({n, h}, DType::kF32);
    ops::attention_forward(q, k, v, host_docs, scale, out, lse);
    Tensor dq = Tensor::empty(q.shape(), DType::kF32), dk = Tensor::empty(k.shape(), DType::kF32),
           dv = Tensor::empty(v.shape(), DType::kF32);
    ops::attention_backward(q, k, v, out, lse, dout, host_docs, scale, dq, dk, dv);

    const auto dev = [](const Tensor& t) { return t.to(DType::kBF16).to(Device::kCUDA); };
    const auto poisoned = [](const Shape& s, DType t) {
      return Tensor::poisoned(s, t, Device::kCUDA);
    };
    const ops::Documents docs_gpu{cus.to(Device::kCUDA), host_docs.max_length};
    const Tensor gq = dev(q), gk = dev(k), gv = dev(v), gdout = dev(dout);
    Tensor gout = poisoned(out.shape(), DType::kBF16), glse = poisoned(lse.shape(), DType::kF32);
    ops::attention_forward(gq, gk, gv, docs_gpu, scale, gout, glse, kCudnn);
    const auto close = [&](const Tensor& got, const Tensor& ref, double tol, const char* what) {
      const Tensor host = got.to(Device::kCPU).to(DType::kF32);
      ASSERT_TRUE(all_finite(host)) << what << ": unwritten (NaN) or non-finite";
      EXPECT_LT(relative_error(host, ref), tol) << what << ", " << docs << " documents";
    };
    close(gout, out, 1e-2, "cudnn out");
    close(glse, lse, 1e-4, "cudnn lse");
    Tensor grad[2][3];
    for (Tensor* g : grad) {
      g[0] = poisoned(q.shape(), DType::kBF16);
      g[1] = poisoned(k.shape(), DType::kBF16);
      g[2] = poisoned(v.shape(), DType::kBF16);
      ops::attention_backward(gq, gk, gv, gout, glse, gdout, docs_gpu, scale, g[0], g[1], g[2],
                              kCudnn);
    }
    close(grad[0][0], dq, 2e-2, "cudnn dq");
    close(grad[0][1], dk, 2e-2, "cudnn dk");
    close(grad[0][2], dv, 2e-2, "cudnn dv");
    // Split by KV-head groups (a zero workspace budget: as many groups as there are KV heads):
    // every head's sums keep their order, so the gradients are the same bit for bit.
    Tensor split[3] = {poisoned(q.shape(), DType::kBF16), poisoned(k.shape(), DType::kBF16),
                       poisoned(v.shape(), DType::kBF16)};
    ops::attention_backward(gq, gk, gv, gout, glse, gdout, docs_gpu, scale, split[0], split[1],
                            split[2], kCudnnSplit);
    for (int i = 0; i < 3; ++i) {
      const Tensor a = grad[0][i].to(Device::kCPU), b = grad[1][i].to(Device::kCPU),
                   c = split[i].to(Device::kCPU);
      EXPECT_EQ(std::memcmp(a.raw(), b.raw(), a.nbytes()), 0) << "deterministic backward " << i;
      EXPECT_EQ(std::memcmp(a.raw(), c.raw(), a.nbytes()), 0) << "backward by head groups " << i;
    }
    Tensor fast[3] = {poisoned(q.shape(), DType::kBF16), poisoned(k.shape(), DType::kBF16),
                      poisoned(v.shape(), DType::kBF16)};
    ops::attention_backward(gq, gk, gv, gout, glse, gdout, docs_gpu, scale, fast[0], fast[1],
                            fast[2], kCudnnFast);
    close(fast[0], dq, 2e-2, "cudnn dq (non-deterministic)");
    close(fast[1], dk, 2e-2, "cudnn dk (non-deterministic)");
    close(fast[2], dv, 2e-2, "cudnn dv (non-deterministic)");
    // The long documents planned apart from the rest (their count known, as the loader gives
    // it): the reference's gradients, deterministic, and the same split by head groups.
    ops::Documents counted = docs_gpu;
    counted.long_count = ops::count_long_documents(cus, host_docs.max_length);
    Tensor apart[3][3];
    for (int r = 0; r < 3; ++r) {
      for (int i = 0; i < 3; ++i)
        apart[r][i] = poisoned(i == 0 ? q.shape() : k.shape(), DType::kBF16);
      ops::attention_backward(gq, gk, gv, gout, glse, gdout, counted, scale, apart[r][0],
                              apart[r][1], apart[r][2], r == 2 ? kCudnnSplit : kCudnn);
    }
    close(apart[0][0], dq, 2e-2, "cudnn dq (long documents apart)");
    close(apart[0][1], dk, 2e-2, "cudnn dk (long documents apart)");
    close(apart[0][2], dv, 2e-2, "cudnn dv (long documents apart)");
    for (int i = 0; i < 3; ++i) {
      const Tensor a = apart[0][i].to(Device::kCPU), b = apart[1][i].to(Device::kCPU),
                   c = apart[2][i].to(Device::kCPU);
      EXPECT_EQ(std::memcmp(a.raw(), b.raw(), a.nbytes()), 0) << "apart, deterministic " << i;
      EXPECT_EQ(std::memcmp(a.raw(), c.raw(), a.nbytes()), 0) << "apart, by head groups " << i;
    }
  }
}

TEST_P(GpuCase, EmbeddingGatherAndDeterministicBackward) {
  const int64_t vocab = 1000, d = 64, n = 4096;
  Tensor ids = Tensor::empty({n}, DType::kI32);
  const CounterRng rng{seed, 3};
  for (int64_t i = 0; i < n; ++i) ids.set_item(i, rng.below(i, 97) * 7);  // repeats, gaps
  const Tensor table = input({vocab, d}), dout = input({n, d});
  Tensor out = Tensor::empty({n, d}, DType::kF32), dtable = input({vocab, d}, 0.1);
  const Tensor dtable0 = dtable.clone();
  ops::embedding_forward(ids, table, out);
  ops::embedding_backward(ids, dout, dtable);
  const Tensor gids = ids.to(Device::kCUDA);
  Tensor gout = gpu_out({n, d}), gdtable = gpu(dtable0);
  ops::embedding_forward(gids, gpu(table), gout);
  ops::embedding_backward(gids, gpu(dout), gdtable);
  expect_close(gout, out, "embedding forward");
  expect_close(gdtable, dtable, "embedding backward (accumulated)");
  Tensor again = gpu(dtable0);
  ops::embedding_backward(gids, gpu(dout), again);
  const Tensor a = again.to(Device::kCPU), b = gdtable.to(Device::kCPU);
  EXPECT_EQ(std::memcmp(a.raw(), b.raw(), a.nbytes()), 0) << "embedding backward not deterministic";
}

INSTANTIATE_TEST_SUITE_P(Storage, GpuCase, ::testing::Values(DType::kF32, DType::kBF16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

TEST(GpuTensor, RoundTripZeroFillAndPeakMemory) {
  if (cuda::device_count() == 0) GTEST_FAIL() << "no GPU";
  const Tensor host = testing::randn({1000, 3}, 5, 1.0, DType::kF32);
  Tensor dev = host.to(Device::kCUDA);
  EXPECT_EQ(relative_error(dev, host), 0.0);
  dev.zero_();
  EXPECT_EQ(dev.to(Device::kCPU).item(2999), 0.0);
  dev.fill_(2.5);
  EXPECT_EQ(dev.item(1234), 2.5);
  reset_peak_memory(Device::kCUDA);
  const int64_t before = memory_stats(Device::kCUDA).current_bytes;
  { Tensor big = Tensor::empty({1 << 20}, DType::kF32, Device::kCUDA); }
  EXPECT_EQ(memory_stats(Device::kCUDA).current_bytes, before);
  EXPECT_GE(memory_stats(Device::kCUDA).peak_bytes, before + (4 << 20));
}

// An allocation the GPU cannot hold: exit code 6 and a message with the sizes and the settings
// that need less; the allocator stays usable.
TEST(GpuTensor, OutOfMemoryNamesTheSizesAndTheSettings) {
  if (cuda::device_count() == 0) GTEST_FAIL() << "no GPU";
  const int64_t too_many = int64_t{1} << 40;  // 4 TiB of f32
  try {
    Tensor huge = Tensor::empty({too_many}, DType::kF32, Device::kCUDA);
    ADD_FAILURE() << "4 TiB were allocated";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ExitCode::kOutOfMemory);
    const std::string m = e.what();
    for (const char* part :
         {"out of GPU memory", "4096.00 GiB more", "model.checkpoint", "hardware.cuda_graphs"})
      EXPECT_NE(m.find(part), std::string::npos) << part << " not in: " << m;
  }
  Tensor small = Tensor::empty({1024}, DType::kF32, Device::kCUDA);
  small.fill_(1.0);
  EXPECT_EQ(small.item(1023), 1.0);
}

// Out of memory outside a capture, the graph pool's free blocks go back to the driver: an
// allocation that fits only without them succeeds, the pool's generation moves on, and captured
// work is captured again instead of replaying into memory it no longer owns.
TEST(GpuTensor, OutOfMemoryReleasesTheGraphPoolAndWorkIsCapturedAgain) {
  if (cuda::device_count() == 0) GTEST_FAIL() << "no GPU";
  Tensor out = Tensor::zeros({1024}, DType::kF32, Device::kCUDA);
  Tensor ones = Tensor::empty({1024}, DType::kF32, Device::kCUDA);
  ones.fill_(1.0);
  auto body = [&] {  // device work only (capturable), through a graph-pool block
    Tensor t = Tensor::empty({1024}, DType::kF32, Device::kCUDA);
    t.copy_from(ones);
    ops::scale_(t, 3.0);
    out.copy_from(t);
  };
  cuda::CapturedWork work;
  EXPECT_FALSE(work.run(body, "the test's work"));  // eager: warms up
  EXPECT_TRUE(work.run(body, "the test's work"));   // captured, replayed
  // Nearly all free memory into the graph pool, then back into its cache.
  const int64_t chunk = int64_t{1} << 30;
  int64_t held = 0;
  {
    const GraphPoolScope pool;
    std::vector<Tensor> blocks;
    for (;;) {
      size_t free_bytes = 0, total_bytes = 0;
      ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);
      if (free_bytes < static_cast<size_t>(2 * chunk)) break;
      blocks.push_back(Tensor::empty({chunk}, DType::kU8, Device::kCUDA));
      held += chunk;
    }
  }
  ASSERT_GT(held, 8 * chunk);
  const int64_t generation = graph_pool_generation();
  {
    Tensor big = Tensor::empty({held}, DType::kU8, Device::kCUDA);  // fits only without them
    EXPECT_TRUE(big.defined());
  }
  EXPECT_EQ(graph_pool_generation(), generation + 1);
  out.zero_();
  EXPECT_FALSE(work.run(body, "the test's work"));  // stale: eager again
  EXPECT_EQ(out.item(1023), 3.0);
  EXPECT_TRUE(work.run(body, "the test's work"));  // captured again
  out.zero_();
  EXPECT_TRUE(work.run(body, "the test's work"));
  EXPECT_EQ(out.to(Device::kCPU).item(5), 3.0);
}

// ops::place_rows on the GPU against the CPU, every byte of the output (both start from the same
// poison, so the places no row names must stay as they were): rows of 16-, 4- and 1-byte units,
// 1 to 8 peers, a third of the slots -1.
TEST(ExpertChoices, PlaceRowsMatchesTheCpu) {
  if (cuda::device_count() == 0) GTEST_FAIL() << "no GPU: run this test on the GPU machine";
  const uint64_t seed = fresh_seed();
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 gen(seed);
  const int64_t n = 777;
  for (const auto& [dtype, width] : std::vector<std::pair<DType, int64_t>>{
           {DType::kBF16, 2048}, {DType::kI32, 8}, {DType::kF32, 3}, {DType::kBF16, 3}})
    for (int peers : {1, 3, 8}) {
      const std::string what = std::string(dtype_name(dtype)) + " x " + std::to_string(width) +
                               ", " + std::to_string(peers) + " peers";
      const int64_t capacity = n + 5;
      Tensor slot = Tensor::empty({n, peers}, DType::kI32);
      std::vector<int32_t> next(peers, 0);
      for (int64_t t = 0; t < n; ++t)
        for (int p = 0; p < peers; ++p)
          slot.data<int32_t>()[t * peers + p] = gen() % 3 == 0 ? -1 : next[p]++;
      Tensor x = Tensor::empty({n, width}, dtype);
      for (size_t i = 0; i < x.nbytes(); ++i) static_cast<uint8_t*>(x.raw())[i] = gen() % 251;
      Tensor want = Tensor::poisoned({peers * capacity, width}, dtype);
      Tensor got = want.to(Device::kCUDA);
      ops::place_rows(x, slot, capacity, want);
      ops::place_rows(x.to(Device::kCUDA), slot.to(Device::kCUDA), capacity, got);
      const Tensor host = got.to(Device::kCPU);
      EXPECT_EQ(std::memcmp(host.raw(), want.raw(), want.nbytes()), 0) << what;
    }
}

// The peer slots' scan over many tiles (4096 tokens each) and tiles partly filled, against the
// host, bit for bit: random peer choices, every token for every peer, none for one peer.
TEST(ExpertChoices, PeerSlotsOverManyTilesMatchTheHost) {
  if (cuda::device_count() == 0) GTEST_FAIL() << "no GPU: run this test on the GPU machine";
  const uint64_t seed = fresh_seed();
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 gen(seed);
  for (const int64_t n : {int64_t{1}, int64_t{4096}, int64_t{4097}, int64_t{50001}})
    for (const int peers : {1, 2, 3, 8})
      for (const std::string fill : {"random", "all", "none_for_the_last"}) {
        const std::string what =
            std::to_string(n) + " tokens, " + std::to_string(peers) + " peers, " + fill;
        Tensor to = Tensor::empty({n, peers}, DType::kI32);
        for (int64_t t = 0; t < n; ++t)
          for (int p = 0; p < peers; ++p) {
            const bool goes = fill == "all" || (fill == "random" ? gen() % 3 != 0 : p + 1 < peers);
            to.data<int32_t>()[t * peers + p] = goes ? p : -1;
          }
        Tensor want = Tensor::empty({n, peers}, DType::kI32);
        Tensor got = Tensor::poisoned({n, peers}, DType::kI32, Device::kCUDA);
        ops::peer_slots(to, n, want);
        ops::peer_slots(to.to(Device::kCUDA), n, got);
        const Tensor host = got.to(Device::kCPU);
        EXPECT_EQ(std::memcmp(host.raw(), want.raw(), want.nbytes()), 0) << what;
        // The last token for peer 0 takes its region's last place when every token goes there.
        if (fill == "all") {
          EXPECT_EQ(host.data<int32_t>()[(n - 1) * peers], n - 1) << what;
        }
      }
}

// The expert-parallel choices on the device against the host reference, bit for bit, outputs
// poisoned first: peer_choices, peer_counts and local_choices over 1, 2, 4 and 8 ranks, then the
// receiving rank's permutation with the other ranks' choices skipped (dense with the exact count
// and more rows than routed, padded to 128) and the row moves and sums over it. Routings:
// random, every token's first choice on one expert, and every choice on rank 0's experts (the
// other ranks route nothing).
TEST(ExpertChoices, MatchTheHostReference) {
  if (cuda::device_count() == 0) GTEST_FAIL() << "no GPU: run this test on the GPU machine";
  const uint64_t seed = fresh_seed();
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 gen(seed);
  const int64_t n = 3000, k = 8, experts = 128, width = 200;
  auto same = [](const Tensor& gpu_t, const Tensor& cpu_t, const std::string& what) {
    const Tensor host = gpu_t.to(Device::kCPU);
    ASSERT_EQ(host.nbytes(), cpu_t.nbytes()) << what;
    EXPECT_EQ(std::memcmp(host.raw(), cpu_t.raw(), cpu_t.nbytes()), 0) << what;
  };
  for (const std::string routing : {"random", "one_expert", "one_rank"}) {
    Tensor index = Tensor::empty({n, k}, DType::kI32);
    for (int64_t t = 0; t < n; ++t) {
      std::vector<int32_t> pool(experts);
      std::iota(pool.begin(), pool.end(), 0);
      std::shuffle(pool.begin(), pool.end(), gen);
      if (routing == "one_expert")
        std::swap(pool[0], pool[std::find(pool.begin(), pool.end(), 5) - pool.begin()]);
      if (routing == "one_rank") std::sort(pool.begin(), pool.end());  // experts 0..k-1
      for (int64_t j = 0; j < k; ++j) index.data<int32_t>()[t * k + j] = pool[j];
    }
    const Tensor gindex = index.to(Device::kCUDA);
    for (const int peers : {1, 2, 4, 8}) {
      const std::string what = routing + ", " + std::to_string(peers) + " ranks";
      const int64_t local = experts / peers;
      Tensor cp = Tensor::empty({n, peers}, DType::kI32);
      Tensor gp = Tensor::poisoned({n, peers}, DType::kI32, Device::kCUDA);
      ops::peer_choices(index, peers, local, cp);
      ops::peer_choices(gindex, peers, local, gp);
      same(gp, cp, what + ": peer choices");
      for (const int64_t region : {int64_t{0}, n}) {
        Tensor cslot = Tensor::empty({n, peers}, DType::kI32);
        Tensor gslot = Tensor::poisoned({n, peers}, DType::kI32, Device::kCUDA);
        ops::peer_slots(cp, region, cslot);
        ops::peer_slots(gp, region, gslot);
        same(gslot, cslot, what + ": peer slots, regions of " + std::to_string(region));
      }
      Tensor cc = Tensor::empty({peers, local + 1}, DType::kI64);
      Tensor gc = Tensor::poisoned({peers, local + 1}, DType::kI64, Device::kCUDA);
      ops::peer_counts(index, peers, local, cc);
      ops::peer_counts(gindex, peers, local, gc);
      same(gc, cc, what + ": peer counts");
      const int rank = peers - 1;
      Tensor cl = Tensor::empty({n, k}, DType::kI32);
      Tensor gl = Tensor::poisoned({n, k}, DType::kI32, Device::kCUDA);
      ops::local_choices(index, rank, local, cl);
      ops::local_choices(gindex, rank, local, gl);
      same(gl, cl, what + ": local choices");
      int64_t routed = 0;
      for (int64_t e = 0; e < local; ++e) routed += cc.data<int64_t>()[rank * (local + 1) + e];
      for (const auto& [align, rows] :
           {std::pair<int64_t, int64_t>{1, routed}, {1, routed + 77}, {128, routed}}) {
        const std::string w =
            what + ", align " + std::to_string(align) + ", " + std::to_string(rows) + " rows";
        ops::ExpertPermutation c, g;
        ops::make_expert_permutation(cl, local, c, align, rows);
        ops::make_expert_permutation(gl, local, g, align, rows);
        same(g.source_token, c.source_token, w + ": source tokens");
        same(g.row_of_choice, c.row_of_choice, w + ": rows of choices");
        same(g.expert_offsets, c.expert_offsets, w + ": offsets");
        if (align > 1) same(g.segments, c.segments, w + ": segments");
        // Moves are copies (bit for bit); the sums run in f32 over the same order.
        const Tensor x = testing::randn({n, width}, seed + 1, 1.0, DType::kF32);
        Tensor cx = Tensor::zeros({c.rows(), width}, DType::kF32);
        Tensor gx = Tensor::zeros({g.rows(), width}, DType::kF32, Device::kCUDA);
        ops::permute_rows(x, c, cx);
        ops::permute_rows(x.to(Device::kCUDA), g, gx);
        same(gx, cx, w + ": permute");
        Tensor cu = Tensor::empty({n, k, width}, DType::kF32);
        Tensor gu = Tensor::poisoned({n, k, width}, DType::kF32, Device::kCUDA);
        ops::unpermute_rows(cx, c, cu);
        ops::unpermute_rows(gx, g, gu);
        same(gu, cu, w + ": unpermute (zeros for the other ranks' choices)");
        Tensor cs = Tensor::empty({n, width}, DType::kF32);
        Tensor gs = Tensor::poisoned({n, width}, DType::kF32, Device::kCUDA);
        ops::combine_forward(cx, c, cs);
        ops::combine_forward(gx, g, gs);
        same(gs, cs, w + ": sum of each token's rows");
        const Tensor wt = testing::randn({n, k, 1}, seed + 2, 1.0, DType::kF32);
        Tensor cw = Tensor::zeros({c.rows(), 1}, DType::kF32);
        Tensor gw = Tensor::zeros({g.rows(), 1}, DType::kF32, Device::kCUDA);
        ops::unpermute_rows_backward(wt, c, cw);
        ops::unpermute_rows_backward(wt.to(Device::kCUDA), g, gw);
        same(gw, cw, w + ": weights into rows");
      }
    }
  }
}

}  // namespace
}  // namespace mt
