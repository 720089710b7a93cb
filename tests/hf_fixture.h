// The Hugging Face fixtures (tests/fixtures/hf_qwen3moe, scripts/make_hf_fixture.py) as tests
// use them on the CPU and the GPU.
#pragma once
#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/tensor.h"
#include "model/batch.h"

namespace mt::testing {

// Under the source tree MOETRAIN_SOURCE_DIR names when set (a GPU bundle runs away from the
// build's tree), else the build's.
inline std::string hf_fixture(const std::string& name) {
  const char* env = std::getenv("MOETRAIN_SOURCE_DIR");
  return std::string(env ? env : MOETRAIN_SOURCE_DIR) + "/tests/fixtures/hf_qwen3moe/" + name;
}

// The reference batch as one document: inputs are the tokens (i64) but the last, targets the
// tokens after them, every target counted.
inline Batch reference_batch(const Tensor& tokens) {
  const int64_t n = tokens.numel() - 1;
  Batch b;
  b.tokens = Tensor::empty({n}, DType::kI32);
  b.targets = Tensor::empty({n}, DType::kI32);
  b.loss_mask = Tensor::empty({n}, DType::kU8);
  b.positions = Tensor::empty({n}, DType::kI32);
  for (int64_t i = 0; i < n; ++i) {
    b.tokens.data<int32_t>()[i] = static_cast<int32_t>(tokens.data<int64_t>()[i]);
    b.targets.data<int32_t>()[i] = static_cast<int32_t>(tokens.data<int64_t>()[i + 1]);
    b.loss_mask.data<uint8_t>()[i] = 1;
    b.positions.data<int32_t>()[i] = static_cast<int32_t>(i);
  }
  b.cu_seqlens = Tensor::empty({2}, DType::kI32);
  b.cu_seqlens.data<int32_t>()[0] = 0;
  b.cu_seqlens.data<int32_t>()[1] = static_cast<int32_t>(n);
  b.max_seqlen = n;
  return b;
}

}  // namespace mt::testing
