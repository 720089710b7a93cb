// Where each element of a moetrain parameter lives in a Hugging Face Qwen3-MoE checkpoint
// (transformers' Qwen3MoeForCausalLM names), the one mapping that import, export and the parity
// tests share. HF linear weights are (out, in), moetrain's (in, out); an expert's gate and up
// projections are one moetrain (D, 2F) matrix, gate columns first. HF holds experts either per
// expert (mlp.experts.N.{gate,up,down}_proj.weight: the published checkpoints, what
// save_pretrained writes and what export writes) or merged (mlp.experts.gate_up_proj [E, 2F, D],
// mlp.experts.down_proj [E, D, F]: transformers 5 in memory).
#pragma once
#include <algorithm>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "fsdp/params.h"
#include "model/config.h"

namespace mt {

class Qwen3Moe;

enum class HfExperts { kPerExpert, kMerged };

struct HfTensor {
  std::string name;
  Shape shape;
};

class HfLayout {
 public:
  // The HF tensors that hold `spec` as this rank holds it (an expert spec: its shape[0] experts
  // from the one its init_offset starts at).
  HfLayout(const ParamSpec& spec, const ModelConfig& c, HfExperts experts);

  const std::vector<HfTensor>& tensors() const { return tensors_; }
  struct Element {
    int32_t tensor;  // into tensors()
    int64_t index;   // flat, row-major in that tensor
  };
  // Element j (row-major) of the moetrain tensor.
  Element source(int64_t j) const;
  // Calls fn(j, source(j)) for every j in [lo, hi), once each, on up to 8 threads (fn must be
  // safe to call concurrently for distinct j), in an order that moves whole cache lines on both
  // sides: a transposed matrix goes by blocks of 32 of its rows, column by column inside a block
  // (32 consecutive HF elements), instead of one strided HF read per element.
  template <class F>
  void for_each_element(int64_t lo, int64_t hi, F&& fn) const;

 private:
  // source() of the element in column `col` of matrix row `r` of expert (or matrix) `x`, with no
  // division: the tiled walk knows all three.
  Element element_at(int64_t x, int64_t r, int64_t col) const {
    switch (map_) {
      case Map::kSame:
      case Map::kTransposed:
        return {0, col * rows_ + r};
      case Map::kGateUp:
      case Map::kDown:
        if (merged_) return {0, ((first_expert_ + x) * cols_ + col) * rows_ + r};
        if (map_ == Map::kDown) return {static_cast<int32_t>(x), col * rows_ + r};
        {
          const int64_t f = cols_ / 2;
          const bool up = col >= f;
          return {static_cast<int32_t>(2 * x + up), (up ? col - f : col) * rows_ + r};
        }
    }
    return {0, 0};
  }

 public:
 private:
  enum class Map { kSame, kTransposed, kGateUp, kDown };
  Map map_ = Map::kSame;
  bool merged_ = false;
  int64_t rows_ = 0, cols_ = 0;  // moetrain's (in, out) of one matrix (an expert's)
  int64_t first_expert_ = 0;
  std::vector<HfTensor> tensors_;
};

template <class F>
void HfLayout::for_each_element(int64_t lo, int64_t hi, F&& fn) const {
  const int64_t width = map_ == Map::kSame ? 0 : cols_;
  auto linear = [&](int64_t a, int64_t b) {
    for (int64_t j = a; j < b; ++j) fn(j, source(j));
  };
  auto run = [&](int64_t a, int64_t b) {
    if (width == 0) return linear(a, b);
    const int64_t first_row = (a + width - 1) / width, end_row = b / width;
    if (first_row >= end_row) return linear(a, b);
    linear(a, first_row * width);
    constexpr int64_t kBlock = 32;
    int64_t x[kBlock], r_in[kBlock];
    for (int64_t r0 = first_row; r0 < end_row; r0 += kBlock) {
      const int64_t rows = std::min(end_row - r0, kBlock);
      for (int64_t i = 0; i < rows; ++i) {  // a row of the walk: matrix row r_in of matrix x
        x[i] = (r0 + i) / rows_;
        r_in[i] = (r0 + i) % rows_;
      }
      for (int64_t col = 0; col < width; ++col)
        for (int64_t i = 0; i < rows; ++i)
          fn((r0 + i) * width + col, element_at(x[i], r_in[i], col));
    }
    linear(end_row * width, b);
  };
  constexpr int64_t kPerThread = int64_t{1} << 20;
  const int64_t threads = std::clamp<int64_t>(
      (hi - lo) / kPerThread, 1, std::min<int64_t>(8, std::thread::hardware_concurrency()));
  if (threads == 1) return run(lo, hi);
  std::vector<std::thread> pool;
  const int64_t step = (hi - lo + threads - 1) / threads;
  for (int64_t a = lo; a < hi; a += step) pool.emplace_back(run, a, std::min(hi, a + step));
  for (std::thread& t : pool) t.join();
}

// Every HF tensor of the whole model (all experts), in the order of the model's units: what an
// export writes and an import must find.
std::vector<HfTensor> hf_tensors(const Qwen3Moe& model, HfExperts experts);

// The spec of a whole expert parameter (every expert, as EP rank 0 would number them) from one
// rank's slice; other specs unchanged.
ParamSpec whole_parameter(const ParamSpec& spec, const ModelConfig& c);

}  // namespace mt
