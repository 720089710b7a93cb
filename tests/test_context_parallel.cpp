// Context parallelism's model pieces (model/context_parallel.h): a batch dealt to the cp ranks of
// a group, and the rows' gather and its transpose over in-process ranks. The attention of a
// context-parallel rank is tested in test_attention.cpp, whole training steps against one rank in
// test_equivalence.cpp (EquivalenceCp).
#include <gtest/gtest.h>

#include <mutex>
#include <vector>

#include "dist/communicator.h"
#include "model/context_parallel.h"
#include "testing.h"
#include "train/data_loader.h"

namespace mt {
namespace {

// Two rows of 12 tokens: documents of 5, 9 (crossing the row's middle) and the rest, then one of
// 8 and 3 padding tokens; every third target not counted.
Batch two_rows() {
  std::vector<PackedRow> rows(2);
  const std::vector<std::vector<int>> docs = {{5, 8}, {8}};
  for (int r = 0; r < 2; ++r) {
    PackedRow& row = rows[r];
    for (const int len : docs[r])
      for (int i = 0; i < len; ++i) {
        row.tokens.push_back(static_cast<int32_t>(7 * r + 3 * i + len) % 31);
        row.segment_start.push_back(i == 0);
        row.counts.push_back(i % 3 != 2);
      }
    pad_row(row, 13);
  }
  return pack_rows(rows, 12);
}

TEST(ContextShard, EachRankHoldsItsChunksOfEveryRowAndTheRowsDocuments) {
  const Batch whole = two_rows();
  ASSERT_GT(whole.padding_tokens, 0);
  for (const int64_t cp : {2, 3}) {
    std::vector<int> holders(whole.size(), 0);
    int64_t padding = 0, masked = 0;
    for (int64_t r = 0; r < cp; ++r) {
      const Batch b = context_shard(whole, 12, cp, r);
      ASSERT_EQ(b.size(), whole.size() / cp);
      EXPECT_EQ(b.context.cp(), cp);
      EXPECT_EQ(b.context.chunks.rank, r);
      EXPECT_EQ(b.context.chunks.row_tokens, 12);
      // The documents are the whole rows'.
      ASSERT_EQ(b.cu_seqlens.numel(), whole.cu_seqlens.numel());
      for (int64_t i = 0; i < b.cu_seqlens.numel(); ++i)
        EXPECT_EQ(b.cu_seqlens.item(i), whole.cu_seqlens.item(i));
      EXPECT_EQ(b.max_seqlen, whole.max_seqlen);
      const int64_t chunk = 12 / (2 * cp);
      for (int64_t j = 0; j < b.size(); ++j) {
        const int64_t at = b.context.rows.data<int32_t>()[j];
        // Row b's chunks r and 2 cp - 1 - r, in that order.
        const int64_t row = j / (2 * chunk), slot = j % (2 * chunk) / chunk;
        EXPECT_EQ(at / 12, row);
        EXPECT_EQ(at % 12 / chunk, slot == 0 ? r : 2 * cp - 1 - r);
        ++holders[at];
        for (const auto& [mine, all] :
             {std::pair{&b.tokens, &whole.tokens}, std::pair{&b.targets, &whole.targets},
              std::pair{&b.loss_mask, &whole.loss_mask}, std::pair{&b.positions, &whole.positions},
              std::pair{&b.padding, &whole.padding}})
          EXPECT_EQ(mine->item(j), all->item(at)) << "token " << j << " of rank " << r;
      }
      padding += b.padding_tokens;
      masked += b.masked_tokens();
    }
    for (int64_t i = 0; i < whole.size(); ++i) EXPECT_EQ(holders[i], 1) << "position " << i;
    EXPECT_EQ(padding, whole.padding_tokens);
    EXPECT_EQ(masked, whole.masked_tokens());
  }
  const std::string e = testing::error_of([&] { context_shard(whole, 12, 4, 0); });
  EXPECT_NE(e.find("train.seq_len must be a multiple of 8"), std::string::npos) << e;
}

// The gather gives every rank the rows in row order; the reduce-scatter gives each rank the
// group's sum at its tokens, for any trailing shape.
TEST(ContextShard, GatherAndReduceScatterOverTheGroup) {
  const Batch whole = two_rows();
  const int64_t n = whole.size();
  for (const int cp : {2, 3}) {
    const Tensor rows_value = testing::randn({n, 2, 3}, 7);
    std::vector<Tensor> partial;
    for (int r = 0; r < cp; ++r) partial.push_back(testing::randn({n, 2, 3}, 100 + r));
    std::mutex mu;
    dist::run_in_process(cp, [&](dist::Communicator& comm) {
      const int r = comm.rank();
      const Batch b = context_shard(whole, 12, cp, r);
      Tensor local = Tensor::empty({b.size(), 2, 3}, DType::kF64);
      for (int64_t j = 0; j < b.size(); ++j)
        for (int64_t e = 0; e < 6; ++e)
          local.set_item(j * 6 + e, rows_value.item(b.context.rows.data<int32_t>()[j] * 6 + e));
      const Tensor gathered = gather_context_rows(comm, b.context, local);
      Tensor summed = Tensor::poisoned({b.size(), 2, 3}, DType::kF64);
      reduce_scatter_context_rows(comm, b.context, partial[r], summed);
      std::lock_guard<std::mutex> lock(mu);
      ASSERT_EQ(gathered.shape(), rows_value.shape());
      for (int64_t i = 0; i < rows_value.numel(); ++i)
        ASSERT_EQ(gathered.item(i), rows_value.item(i)) << "rank " << r << " element " << i;
      for (int64_t j = 0; j < b.size(); ++j)
        for (int64_t e = 0; e < 6; ++e) {
          double want = 0;
          for (int q = 0; q < cp; ++q)
            want += partial[q].item(b.context.rows.data<int32_t>()[j] * 6 + e);
          ASSERT_NEAR(summed.item(j * 6 + e), want, 1e-14) << "rank " << r << " token " << j;
        }
    });
  }
}

}  // namespace
}  // namespace mt
