// The grouped expert GEMMs (ops/grouped_gemm.h): the CPU reference (hand-checked cases, fp64
// finite-difference gradients of L = sum(out * G) with a fixed random G) and, in the Gpu* cases
// (ctest label `gpu`), the CUDA kernels against it (tests/gpu_case.h).
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

#include "op_testing.h"
#include "ops/cuda/expert_tiles.h"
#include "ops/cuda/tile_walk.h"
#include "ops/gemm.h"
#include "ops/grouped_gemm.h"
#if MOETRAIN_HAS_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda/device.h"
#include "core/cuda/graph.h"
#include "gpu_case.h"
#include "ops/cuda/grouped_gemm.h"
#endif

namespace mt {
namespace {

// The fixed-layout kernels' table of runs (ops/cuda/expert_tiles.h, built on the device by the
// same functions): over padded layouts with empty experts, experts of one row tile or an odd
// count of them, an end inside a row tile and capacity past the last expert, every row tile of
// every expert appears once per column tile, in runs of at most `waves` row tiles of one expert
// (shorter only as an expert's last), the runs in the experts' order, and every entry past them
// is empty; the table's bound holds them all.
// The banded walk (ops/cuda/tile_walk.h): a permutation of the entries that takes each band's
// runs (the last band shorter) column by column, and the row-major order for bands of one run.
TEST(ExpertTiles, BandedWalkTakesEachEntryOnceBandByBand) {
  using cuda::kernels::banded_entry;
  for (const int64_t runs : {1, 2, 5, 16, 17, 64})
    for (const int64_t columns : {1, 3, 1187})
      for (const int64_t band : {1, 2, 16, 64}) {
        SCOPED_TRACE(fmt::format("runs {}, columns {}, band {}", runs, columns, band));
        std::vector<int> taken(static_cast<size_t>(runs * columns), 0);
        int64_t last_band = 0, last_column = -1, last_run = -1;
        for (int64_t i = 0; i < runs * columns; ++i) {
          const int64_t e = banded_entry(i, runs, columns, band);
          ASSERT_GE(e, 0);
          ASSERT_LT(e, runs * columns);
          ++taken[static_cast<size_t>(e)];
          const int64_t run = e / columns, column = e % columns,
                        b = run / std::max<int64_t>(band, 1);
          if (band <= 1) {
            ASSERT_EQ(e, i);
            continue;
          }
          ASSERT_GE(b, last_band) << "entry " << i << " goes back a band";
          if (b == last_band && column == last_column) {
            ASSERT_EQ(run, last_run + 1) << "entry " << i;
          } else if (b == last_band) {
            ASSERT_EQ(column, last_column + 1) << "entry " << i;
          }
          last_band = b;
          last_column = column;
          last_run = run;
        }
        for (size_t k = 0; k < taken.size(); ++k) ASSERT_EQ(taken[k], 1) << "entry " << k;
        EXPECT_EQ(banded_entry(runs * columns + 3, runs, columns, band), runs * columns + 3);
      }
}

TEST(ExpertTiles, RunsCoverEveryRowTileOnceWithinItsExpert) {
  using namespace cuda::kernels;
  std::mt19937_64 rng(7);
  const int64_t sizes[] = {0, 1, 127, 128, 129, 300, 1000};
  for (int trial = 0; trial < 200; ++trial) {
    const int experts = 1 + static_cast<int>(rng() % 9);
    std::vector<int64_t> seg(experts + 1, 0);
    for (int e = 0; e < experts; ++e) {
      const int64_t rows = sizes[rng() % std::size(sizes)];
      // Each start on a multiple of 128; the last expert's end wherever its rows end.
      seg[e + 1] = e + 1 < experts ? seg[e] + (rows + 127) / 128 * 128 : seg[e] + rows;
    }
    const int64_t capacity = seg[experts] + static_cast<int64_t>(rng() % 300);
    for (const int waves : {1, 2, 3}) {
      for (const int columns : {1, 3}) {
        SCOPED_TRACE(fmt::format("trial {}, {} experts, waves {}, columns {}", trial, experts,
                                 waves, columns));
        std::vector<int64_t> first_run(experts + 1);
        count_expert_runs(seg.data(), experts, waves, first_run.data());
        const int64_t count = expert_run_entries(capacity, experts, waves, columns);
        ASSERT_LE(first_run[experts] * columns, count) << "the table's bound";
        // covered[e][tile][column]
        std::vector<std::vector<std::vector<int>>> covered(experts);
        for (int e = 0; e < experts; ++e)
          covered[e].assign(static_cast<size_t>(expert_row_tiles(seg.data(), e)),
                            std::vector<int>(columns, 0));
        int last_expert = 0;
        bool ended = false;
        for (int64_t i = 0; i < count; ++i) {
          const ExpertRun r =
              expert_run_entry(seg.data(), first_run.data(), experts, waves, columns, i);
          if (r.row_tile < 0) {
            ended = true;
            continue;
          }
          ASSERT_FALSE(ended) << "entry " << i << " follows an empty one";
          ASSERT_GE(r.expert, last_expert) << "entry " << i;
          last_expert = r.expert;
          ASSERT_EQ(r.column, i % columns);
          ASSERT_GE(r.row_tiles, 1);
          ASSERT_LE(r.row_tiles, waves);
          const int64_t first = r.row_tile - seg[r.expert] / 128;
          const int64_t tiles = expert_row_tiles(seg.data(), r.expert);
          ASSERT_GE(first, 0) << "entry " << i << " starts before its expert";
          ASSERT_LE(first + r.row_tiles, tiles) << "entry " << i << " runs past its expert";
          ASSERT_TRUE(r.row_tiles == waves || first + r.row_tiles == tiles)
              << "entry " << i << ": a short run not at its expert's end";
          for (int t = 0; t < r.row_tiles; ++t) ++covered[r.expert][first + t][r.column];
        }
        for (int e = 0; e < experts; ++e)
          for (size_t t = 0; t < covered[e].size(); ++t)
            for (int c = 0; c < columns; ++c)
              ASSERT_EQ(covered[e][t][c], 1)
                  << "expert " << e << ", row tile " << t << ", column " << c;
      }
    }
  }
}

// The grouped GEMMs over a padded layout give the dense layout's products on every expert's rows
// (and the same weight gradients); padding rows are not read.
TEST(GroupedGemm, PaddedSegmentsGiveTheDenseProducts) {
  const std::vector<int64_t> counts = {2, 0, 5}, off = {0, 2, 2, 7}, seg = {0, 4, 4, 12};
  Tensor x = randn({7, 4}, 1), w = randn({3, 4, 5}, 2), g = randn({7, 5}, 3);
  Tensor toff = Tensor::empty({4}, DType::kI64), tseg = Tensor::empty({4}, DType::kI64);
  for (int e = 0; e < 4; ++e) {
    toff.set_item(e, static_cast<double>(off[e]));
    tseg.set_item(e, static_cast<double>(seg[e]));
  }
  const ops::ExpertRows padded(toff, tseg, 4);
  // The padded copies: expert e's rows at seg[e], NaN in the padding (must not be read).
  auto pad = [&](const Tensor& dense) {
    const int64_t width = dense.dim(1);
    Tensor p = Tensor::empty({12, width}, DType::kF64);
    for (int64_t i = 0; i < p.numel(); ++i) p.set_item(i, std::nan(""));
    for (int e = 0; e < 3; ++e)
      for (int64_t r = 0; r < counts[e]; ++r)
        for (int64_t c = 0; c < width; ++c)
          p.set_item((seg[e] + r) * width + c, dense.item((off[e] + r) * width + c));
    return p;
  };
  const Tensor xpad = pad(x), gpad = pad(g);
  Tensor out = Tensor::empty({7, 5}, DType::kF64), pout = Tensor::empty({12, 5}, DType::kF64);
  Tensor dx = Tensor::empty({7, 4}, DType::kF64), pdx = Tensor::empty({12, 4}, DType::kF64);
  Tensor dw = Tensor::poisoned(w.shape(), DType::kF64),
         pdw = Tensor::poisoned(w.shape(), DType::kF64);
  ops::grouped_gemm_forward(x, w, toff, out);
  ops::grouped_gemm_forward(xpad, w, padded, pout);
  ops::grouped_gemm_backward_input(g, w, toff, dx);
  ops::grouped_gemm_backward_input(gpad, w, padded, pdx);
  ops::grouped_gemm_backward_weight(x, g, toff, dw, ops::Accumulate::kNo);
  ops::grouped_gemm_backward_weight(xpad, gpad, padded, pdw, ops::Accumulate::kNo);
  for (int e = 0; e < 3; ++e)
    for (int64_t r = 0; r < counts[e]; ++r) {
      for (int c = 0; c < 5; ++c)
        EXPECT_EQ(pout.item((seg[e] + r) * 5 + c), out.item((off[e] + r) * 5 + c));
      for (int c = 0; c < 4; ++c)
        EXPECT_EQ(pdx.item((seg[e] + r) * 4 + c), dx.item((off[e] + r) * 4 + c));
    }
  for (int64_t i = 0; i < dw.numel(); ++i) EXPECT_EQ(pdw.item(i), dw.item(i)) << i;
  // A layout whose expert overruns its segment is refused, naming the expert.
  Tensor bad = tseg.clone();
  bad.set_item(1, 1.0);
  const std::string e =
      error_of([&] { ops::grouped_gemm_forward(xpad, w, ops::ExpertRows(toff, bad, 1), pout); });
  EXPECT_NE(e.find("expert 0"), std::string::npos) << e;
}

TEST(GroupedGemm, PerExpertProductsAndGradients) {
  Tensor x = randn({7, 4}, 1), w = randn({3, 4, 5}, 2), g = randn({7, 5}, 3);
  Tensor off = Tensor::empty({4}, DType::kI64);
  for (int e = 0; e < 4; ++e) off.set_item(e, std::vector<int>{0, 2, 2, 7}[e]);  // expert 1 empty
  Tensor out = Tensor::poisoned({7, 5}, DType::kF64);
  ops::grouped_gemm_forward(x, w, off, out);
  for (int r = 0; r < 7; ++r) {
    const int e = r < 2 ? 0 : 2;
    for (int n = 0; n < 5; ++n) {
      double ref = 0;
      for (int k = 0; k < 4; ++k) ref += x.item(r * 4 + k) * w.item((e * 4 + k) * 5 + n);
      EXPECT_NEAR(out.item(r * 5 + n), ref, 1e-13);
    }
  }
  auto loss = [&] {
    ops::grouped_gemm_forward(x, w, off, out);
    return dot(out, g);
  };
  Tensor dx = like(x), dw = Tensor::zeros(w.shape(), DType::kF64);
  ops::grouped_gemm_backward_input(g, w, off, dx);
  ops::grouped_gemm_backward_weight(x, g, off, dw);
  EXPECT_LT(gradcheck(loss, x, dx), kGradTol);
  EXPECT_LT(gradcheck(loss, w, dw, 60), kGradTol);
  for (int i = 20; i < 40; ++i) EXPECT_EQ(dw.item(i), 0.0);  // the empty expert
  // Overwriting into a poisoned buffer gives the same, the empty expert zero.
  Tensor fresh = Tensor::poisoned(w.shape(), DType::kF64);
  ops::grouped_gemm_backward_weight(x, g, off, fresh, ops::Accumulate::kNo);
  for (int64_t i = 0; i < dw.numel(); ++i) EXPECT_EQ(fresh.item(i), dw.item(i)) << i;
}

#if MOETRAIN_HAS_CUDA

struct GpuGroupedGemm : GpuCase {};

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
// Both sides of each product's configuration choice by k (the forward's inner size, the weight
// gradient's rows: kCutlassShortK, kCutlassFewWeightRows).
TEST_P(GpuGroupedGemm, GroupedGemmWithDeviceOffsets) {
  if (GetParam() != DType::kBF16) GTEST_SKIP() << "grouped gemm v1 is bf16";
  const std::vector<int64_t> counts = {300, 0, 129, 1, 0, 517, 128, 64};
  static_assert(cuda::kernels::kCutlassShortK < 1160 &&
                cuda::kernels::kCutlassFewWeightRows < 1160);
  const int64_t e = static_cast<int64_t>(counts.size()), n = 200;
  for (const int64_t k : {int64_t{136}, int64_t{1160}})
    for (const int64_t align : {int64_t{1}, int64_t{128}}) {
      SCOPED_TRACE(fmt::format("k {}, segments aligned to {} rows", k, align));
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
      ASSERT_EQ(cuda::kernels::grouped_gemm_rows(gdy.raw(), gw.raw(), o, ne, m, n, k, true,
                                                 vdx.raw(), false, nullptr),
                cudaSuccess);
      ASSERT_EQ(cuda::kernels::grouped_gemm_weight(gx.raw(), gdy.raw(), o, ne, k, n, vdw.raw(),
                                                   true, true, nullptr),
                cudaSuccess);
      expect_close(real_rows(vout, off, seg), real_rows(out, off, seg), "grouped forward v1");
      expect_close(real_rows(vdx, off, seg), real_rows(dx, off, seg), "grouped dx v1");
      expect_close(vdw, dw, "grouped dw v1");
    }
}

MOETRAIN_GPU_CASES(GpuGroupedGemm);

#endif  // MOETRAIN_HAS_CUDA

}  // namespace
}  // namespace mt
