// Data: the token file format (round trip, truncation, corruption), packing into rows, and the
// synthetic languages (determinism, floor below unigram entropy).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "processes.h"
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

// scripts/tokenize_data.py against transformers (tests/fixtures/tokenizer, made by
// scripts/make_tokenizer_fixture.py with transformers' tokenizer and apply_chat_template): the ids
// of every line and, for chat lines, the assistant mask transformers returns for a template with
// {% generation %} marks, found both from the marks and, for the unmarked template, by rendering
// prefixes. A template that rewrites earlier turns is refused by line unless --per-turn, which then
// gives transformers' document per assistant turn.
namespace {
struct ScriptRun {
  int code;
  std::string output;
};
ScriptRun tokenize(const std::string& template_dir, const std::string& input,
                   const std::string& out, const std::string& flags = "") {
  const std::string dir = std::string(MOETRAIN_SOURCE_DIR) + "/tests/fixtures/tokenizer/";
  const testing::Proc p = testing::run_cmd(
      "python3 " + std::string(MOETRAIN_SOURCE_DIR) + "/scripts/tokenize_data.py --tokenizer " +
      dir + template_dir + " --input " + input + " --output " + out + " " + flags);
  return {p.code, p.output};
}
}  // namespace

TEST(TokenizeScript, IdsAndAssistantMasksAreTransformers) {
  const std::string dir = std::string(MOETRAIN_SOURCE_DIR) + "/tests/fixtures/tokenizer/";
  std::ifstream in(dir + "expected.json");
  const nlohmann::json expected = nlohmann::json::parse(in).at("samples");
  const std::string out = testing::unique_temp_path("tokenized.tok");
  for (const char* tmpl : {"chatml", "marked"}) {
    const ScriptRun r = tokenize(tmpl, dir + "samples.jsonl", out);
    ASSERT_EQ(r.code, 0) << tmpl << ": " << r.output;
    const TokenDocuments d = read_token_file(out, 400);
    ASSERT_EQ(d.num_docs(), static_cast<int64_t>(expected.size())) << tmpl;
    ASSERT_EQ(d.loss_mask.size(), d.tokens.size()) << "a file with chat lines has a mask";
    int64_t counted = 0;
    for (size_t k = 0; k < expected.size(); ++k) {
      const auto& e = expected[k];
      const std::vector<uint32_t> ids(d.tokens.begin() + d.doc_offsets[k],
                                      d.tokens.begin() + d.doc_offsets[k + 1]);
      const std::vector<uint8_t> mask(d.loss_mask.begin() + d.doc_offsets[k],
                                      d.loss_mask.begin() + d.doc_offsets[k + 1]);
      EXPECT_EQ(ids, e.at("ids").get<std::vector<uint32_t>>()) << tmpl << " line " << e["line"];
      if (e.contains("assistant_mask")) {
        EXPECT_EQ(mask, e.at("assistant_mask").get<std::vector<uint8_t>>())
            << tmpl << " line " << e["line"];
        counted += std::count(mask.begin(), mask.end(), 1);
      } else {
        EXPECT_EQ(std::count(mask.begin(), mask.end(), 0), 0) << "text lines count every token";
      }
    }
    EXPECT_GT(counted, 20) << tmpl;
  }
  // The rewriting template: refused by line, no file; with --per-turn, transformers' documents.
  std::filesystem::remove(out);
  const ScriptRun refused = tokenize("reasoning", dir + "samples.jsonl", out);
  EXPECT_EQ(refused.code, 3) << refused.output;
  EXPECT_NE(refused.output.find("samples.jsonl:5: message 1"), std::string::npos) << refused.output;
  EXPECT_FALSE(std::filesystem::exists(out));
  const ScriptRun per_turn = tokenize("reasoning", dir + "samples.jsonl", out, "--per-turn");
  ASSERT_EQ(per_turn.code, 0) << per_turn.output;
  const TokenDocuments d = read_token_file(out, 400);
  std::vector<std::pair<std::vector<uint32_t>, std::vector<uint8_t>>> want;
  for (const auto& e : expected) {
    if (!e.contains("per_turn")) {
      const auto ids = e.at("ids").get<std::vector<uint32_t>>();
      want.push_back({ids, std::vector<uint8_t>(ids.size(), 1)});
      continue;
    }
    for (const auto& t : e.at("per_turn"))
      want.push_back(
          {t.at("ids").get<std::vector<uint32_t>>(), t.at("mask").get<std::vector<uint8_t>>()});
  }
  ASSERT_EQ(d.num_docs(), static_cast<int64_t>(want.size()));
  for (size_t k = 0; k < want.size(); ++k) {
    EXPECT_EQ(std::vector<uint32_t>(d.tokens.begin() + d.doc_offsets[k],
                                    d.tokens.begin() + d.doc_offsets[k + 1]),
              want[k].first)
        << "document " << k;
    EXPECT_EQ(std::vector<uint8_t>(d.loss_mask.begin() + d.doc_offsets[k],
                                   d.loss_mask.begin() + d.doc_offsets[k + 1]),
              want[k].second)
        << "document " << k;
  }
  std::filesystem::remove(out);
}

TEST(TokenizeScript, BadLinesAreExit3NamingTheLine) {
  const std::string in = testing::unique_temp_path("bad_lines.jsonl"),
                    out = testing::unique_temp_path("bad_lines.tok");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"messages": [{"role": "user", "content": "hi"}]})",
       ":2: the conversation has no assistant turn"},
      {"{not json", ":2: not JSON"},
      {R"({"text": "a", "messages": []})", ":2: expected an object with \"text\" or \"messages\""},
      {R"({"text": ""})", ":2: \"text\" must be a non-empty string"},
  };
  for (const auto& [line, words] : cases) {
    std::ofstream(in) << R"({"text": "fine"})"
                      << "\n"
                      << line << "\n";
    const ScriptRun r = tokenize("chatml", in, out);
    EXPECT_EQ(r.code, 3) << line << ": " << r.output;
    EXPECT_NE(r.output.find(words), std::string::npos) << r.output;
    EXPECT_FALSE(std::filesystem::exists(out)) << line;
  }
  std::filesystem::remove(in);
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
  c.data.shuffle = false;
  auto loader = make_data_loader(c);
  // Counted targets: tokens 2, 3, 5, 8, 9 (mask 1, not a document's first), once each.
  EXPECT_NEAR(loader->stats(4).unigram_entropy, std::log(5.0), 1e-12);
  EXPECT_TRUE(std::isnan(loader->stats(4).loss_floor));
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

// Shuffled epochs: each epoch's stream is every document once, whole and in order inside, in an
// order that depends on the seed and the epoch; the same seed gives the same stream, and a
// loader set to any position continues it exactly (resume); empty documents are passed over.
TEST(Loader, ShuffledEpochsVisitEveryDocumentOnceInTheirOwnOrder) {
  TokenDocuments d;
  d.doc_offsets = {0};
  uint32_t next = 1;
  for (int doc = 0; doc < 40; ++doc) {
    const int len = doc % 7 == 3 ? 0 : 1 + (doc * 5) % 6;  // some empty documents
    for (int i = 0; i < len; ++i) d.tokens.push_back(next++);
    d.doc_offsets.push_back(d.tokens.size());
  }
  const int64_t n = static_cast<int64_t>(d.tokens.size());
  const std::string path = temp_path("mt_shuffle.tok");
  write_token_file(path, d);
  Config c;
  c.model.vocab_size = 1000;
  c.data.source = DataSourceKind::kTokens;
  c.data.path = path;
  // The stream: the first token of every row (rows of 1 token step by 1).
  auto stream = [&](uint64_t seed, int64_t from, int64_t count) {
    Config cs = c;
    cs.data.seed = seed;
    auto loader = make_data_loader(cs);
    loader->set_position(from);
    std::vector<int> out;
    for (int64_t i = 0; i < count; ++i)
      out.push_back(static_cast<int>(loader->next(1, 1).tokens.item(0)));
    return out;
  };
  const std::vector<int> all = stream(7, 0, 3 * n);
  auto epoch = [&](int e) {
    return std::vector<int>(all.begin() + e * n, all.begin() + (e + 1) * n);
  };
  for (int e = 0; e < 3; ++e) {
    std::vector<int> sorted = epoch(e);
    std::sort(sorted.begin(), sorted.end());
    std::vector<int> want(n);
    for (int64_t i = 0; i < n; ++i) want[i] = static_cast<int>(i + 1);
    EXPECT_EQ(sorted, want) << "epoch " << e << " holds every token once";
    // Documents stay whole: inside a document the tokens are consecutive ids.
    const std::vector<int> s = epoch(e);
    int64_t breaks = 0;
    for (int64_t i = 1; i < n; ++i) breaks += s[i] != s[i - 1] + 1;
    EXPECT_LT(breaks, 40) << "epoch " << e;
  }
  EXPECT_NE(epoch(0), epoch(1));
  EXPECT_NE(epoch(1), epoch(2));
  std::vector<int> file_order(n);
  for (int64_t i = 0; i < n; ++i) file_order[i] = static_cast<int>(i + 1);
  EXPECT_NE(epoch(0), file_order);
  EXPECT_EQ(stream(7, 0, n), epoch(0));  // the same seed: the same stream
  EXPECT_NE(stream(8, 0, n), epoch(0));  // another seed: another order
  for (const int64_t at : {int64_t{5}, n - 1, n + 3, 2 * n + 1}) {  // resume anywhere
    EXPECT_EQ(stream(7, at, 6), std::vector<int>(all.begin() + at, all.begin() + at + 6)) << at;
  }
  c.data.shuffle = false;
  EXPECT_EQ(stream(7, 0, n), file_order);
  auto loader = make_data_loader(c);
  EXPECT_THROW(loader->set_position(-1), CheckpointError);
  std::filesystem::remove(path);
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
