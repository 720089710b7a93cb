// Data: the token file format (round trip, truncation, corruption), packing into rows, and the
// synthetic languages (determinism, floor below unigram entropy).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "train/data_loader.h"
#include "train/synthetic_data.h"
#include "train/token_file.h"

namespace mt {
namespace {

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / name).string();
}

TokenDocuments three_docs(bool with_mask) {
  TokenDocuments d;
  d.doc_offsets = {0, 3, 5, 9};
  d.tokens = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  if (with_mask) d.loss_mask = {0, 1, 1, 0, 1, 0, 0, 1, 1};
  return d;
}

std::string data_error(const std::string& path, int64_t vocab = 100) {
  try {
    read_token_file(path, vocab);
  } catch (const DataError& e) {
    return e.what();
  }
  return "no error";
}

TEST(TokenFile, RoundTrip) {
  const std::string path = temp_path("mt_roundtrip.tok");
  for (bool mask : {false, true}) {
    write_token_file(path, three_docs(mask));
    const TokenDocuments r = read_token_file(path, 100);
    EXPECT_EQ(r.doc_offsets, three_docs(mask).doc_offsets);
    EXPECT_EQ(r.tokens, three_docs(mask).tokens);
    EXPECT_EQ(r.loss_mask, three_docs(mask).loss_mask);
  }
}

TEST(TokenFile, TruncatedAndCorruptFilesAreNamed) {
  const std::string path = temp_path("mt_bad.tok");
  write_token_file(path, three_docs(true));
  const auto size = std::filesystem::file_size(path);
  std::filesystem::resize_file(path, size - 3);
  EXPECT_NE(data_error(path).find("truncated"), std::string::npos) << data_error(path);
  std::filesystem::resize_file(path, 10);
  EXPECT_NE(data_error(path).find("truncated"), std::string::npos) << data_error(path);

  write_token_file(path, three_docs(false));
  EXPECT_NE(data_error(path, 5).find("token 5 at position 4 is >= model.vocab_size 5"),
            std::string::npos)
      << data_error(path, 5);

  TokenDocuments bad = three_docs(false);
  bad.doc_offsets = {0, 5, 3, 9};
  write_token_file(path, bad);
  EXPECT_NE(data_error(path).find("decreases"), std::string::npos) << data_error(path);

  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.write("XXXX", 4);
  }
  EXPECT_NE(data_error(path).find("magic"), std::string::npos);
  EXPECT_NE(data_error(temp_path("mt_missing.tok")).find("cannot open"), std::string::npos);
}

// Masks are 0 or 1, and a file must count at least one target (issue 17: a mask of 7 was taken
// as 1, and an all-zero mask trained with loss 0 and exited 0).
TEST(TokenFile, MasksMustBeBinaryAndCountATarget) {
  const std::string path = temp_path("mt_mask.tok");
  TokenDocuments seven = three_docs(true);
  seven.loss_mask[6] = 7;  // document 2, its second token
  write_token_file(path, seven);
  const std::string e = data_error(path);
  EXPECT_NE(e.find("document 2 has loss mask value 7 at token 1 (valid: 0 or 1)"),
            std::string::npos)
      << e;
  TokenDocuments none = three_docs(true);
  none.loss_mask = {1, 0, 0, 1, 0, 1, 0, 0, 0};  // only documents' first tokens: no targets
  write_token_file(path, none);
  EXPECT_NE(data_error(path).find("counts no target token"), std::string::npos) << data_error(path);
  try {
    read_token_file(path, 100);
  } catch (const DataError& err) {
    EXPECT_EQ(err.code(), ExitCode::kData);
  }
}

TEST(TokenFile, WrittenByTheScriptReadsBack) {
  // scripts/make_token_file.py is how users make token files; its output must be this format.
  const std::string jsonl = temp_path("mt_docs.jsonl"), out = temp_path("mt_docs.tok");
  std::ofstream(jsonl) << "[1, 2, 3]\n{\"tokens\": [4, 5], \"loss_mask\": [0, 1]}\n[6, 7, 8, 9]\n";
  const std::string cmd = "python3 " + std::string(MOETRAIN_SOURCE_DIR) +
                          "/scripts/make_token_file.py " + jsonl + " " + out + " >/dev/null";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  const TokenDocuments d = read_token_file(out, 100);
  EXPECT_EQ(d.doc_offsets, (std::vector<uint64_t>{0, 3, 5, 9}));
  EXPECT_EQ(d.tokens, (std::vector<uint32_t>{1, 2, 3, 4, 5, 6, 7, 8, 9}));
  EXPECT_EQ(d.loss_mask, (std::vector<uint8_t>{1, 1, 1, 0, 1, 1, 1, 1, 1}));
  std::ofstream(jsonl) << "[1, -2]\n";
  EXPECT_NE(std::system((cmd + " 2>/dev/null").c_str()), 0) << "a negative id must be refused";
}

TEST(Packing, PositionsSegmentsAndMasks) {
  // Row: [A0 A1 A2 | B0 B1 ] + next token C0 (a new document) as the last target.
  PackedRow row{{10, 11, 12, 20, 21, 30}, {1, 0, 0, 1, 0, 1}, {1, 1, 1, 1, 1, 1}};
  const Batch b = pack_rows({row, row}, 5);
  ASSERT_EQ(b.size(), 10);
  const std::vector<int> pos = {0, 1, 2, 0, 1, 0, 1, 2, 0, 1};
  const std::vector<int> mask = {1, 1, 0, 1, 0, 1, 1, 0, 1, 0};  // no target across documents
  for (int i = 0; i < 10; ++i) {
    EXPECT_EQ(b.positions.item(i), pos[i]) << i;
    EXPECT_EQ(b.loss_mask.item(i), mask[i]) << i;
  }
  const std::vector<int> cu = {0, 3, 5, 8, 10};
  ASSERT_EQ(b.cu_seqlens.numel(), 5);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(b.cu_seqlens.item(i), cu[i]);
  EXPECT_EQ(b.targets.item(2), 20);
}

TEST(Loader, TokenFileRowsContinueDocumentsAndWrap) {
  const std::string path = temp_path("mt_loader.tok");
  write_token_file(path, three_docs(true));
  Config c;
  c.model.vocab_size = 100;
  c.data.source = DataSourceKind::kSft;
  c.data.path = path;
  auto loader = make_data_loader(c);
  const Batch b = loader->next(2, 4);
  // Row 0: tokens 1 2 3 4 -> targets 2 3 4 5; row 1 starts mid-document 2 at token 5.
  const std::vector<int> tokens = {1, 2, 3, 4, 5, 6, 7, 8};
  const std::vector<int> targets = {2, 3, 4, 5, 6, 7, 8, 9};
  // Mask: SFT mask of the target, and never across a document start (token 4 and 6 start docs).
  const std::vector<int> mask = {1, 1, 0, 1, 0, 0, 1, 1};
  const std::vector<int> pos = {0, 1, 2, 0, 0, 0, 1, 2};
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(b.tokens.item(i), tokens[i]) << i;
    EXPECT_EQ(b.targets.item(i), targets[i]) << i;
    EXPECT_EQ(b.loss_mask.item(i), mask[i]) << i;
    EXPECT_EQ(b.positions.item(i), pos[i]) << i;
  }
  EXPECT_EQ(loader->position(), 8);
  const Batch wrap = loader->next(1, 4);  // tokens 9 1 2 3: wraps to the first document
  EXPECT_EQ(wrap.tokens.item(0), 9);
  EXPECT_EQ(wrap.tokens.item(1), 1);
  EXPECT_EQ(wrap.positions.item(1), 0);

  write_token_file(path, three_docs(false));
  EXPECT_THROW(make_data_loader(c), DataError);  // sft needs a mask
}

TEST(Synthetic, DeterministicDocumentsWithMarkers) {
  const SyntheticSpec spec{256, 4, 4, 16, 96, 7};
  const SyntheticLanguages a(spec), b(spec);
  const SyntheticRow r1 = a.make_row(5, 128), r2 = b.make_row(5, 128), r3 = a.make_row(6, 128);
  EXPECT_EQ(r1.tokens, r2.tokens);
  EXPECT_NE(r1.tokens, r3.tokens);
  ASSERT_EQ(r1.tokens.size(), 129u);
  EXPECT_TRUE(r1.doc_start[0]);
  for (size_t i = 0; i < r1.tokens.size(); ++i) {
    EXPECT_EQ(r1.doc_start[i] != 0, r1.tokens[i] < 4) << i;  // markers exactly at doc starts
    EXPECT_LT(r1.tokens[i], 256);
  }
}

TEST(Synthetic, FloorFarBelowUnigramEntropy) {
  Config c;
  auto loader = make_data_loader(c);
  const DataStats s = loader->stats(128);
  EXPECT_GT(s.loss_floor, 0.5);
  EXPECT_LT(s.loss_floor, 2.0);
  EXPECT_GT(s.unigram_entropy, 4.0);
  EXPECT_LE(s.unigram_entropy, std::log(256.0));
}

}  // namespace
}  // namespace mt
