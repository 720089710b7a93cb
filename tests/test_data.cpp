// Data: the token file format (round trip, truncation, corruption), packing into rows, and the
// synthetic languages (determinism, floor below unigram entropy).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>

#include "core/error.h"
#include "core/rng.h"
#include "processes.h"
#include "train/data_loader.h"
#include "train/packing.h"
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
  // Documents of one token each (no mask): no target either (it trained at loss 0, exit 0).
  TokenDocuments singles;
  singles.doc_offsets = {0, 1, 2, 3};
  singles.tokens = {4, 5, 6};
  write_token_file(path, singles);
  EXPECT_NE(data_error(path).find("none of its 3 documents has two tokens"), std::string::npos)
      << data_error(path);
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

// Every script the README runs is executable in the tree (a fresh clone keeps git's mode: the
// worked example once failed there with "Permission denied") and starts with a #! line.
TEST(Readme, EveryScriptItRunsIsExecutable) {
  const std::string root = testing::source_dir();
  std::ifstream readme(root + "/README.md");
  ASSERT_TRUE(readme) << root;
  const std::regex command(R"((^|&&|\|)\s*(scripts/[A-Za-z0-9_.-]+))");
  std::string line;
  int scripts = 0;
  while (std::getline(readme, line)) {
    if (line.rfind("    ", 0) != 0) continue;  // commands are the indented blocks
    for (std::sregex_iterator it(line.begin(), line.end(), command), end; it != end; ++it) {
      const std::string path = root + "/" + (*it)[2].str();
      EXPECT_EQ(access(path.c_str(), X_OK), 0) << (*it)[2] << " is not executable";
      std::ifstream script(path);
      std::string first;
      std::getline(script, first);
      EXPECT_EQ(first.rfind("#!", 0), 0u) << (*it)[2] << " has no #! line";
      ++scripts;
    }
  }
  EXPECT_GE(scripts, 3);  // setup, test, tokenize_data at least
}

// scripts/plot_metrics.py: a picture of two runs' metrics (one resumed, a step written twice, one
// with evaluation and routing arrays); bad input names the file and line, exit 3.
TEST(PlotScript, DrawsRunsAndNamesBadLines) {
  const std::string a = testing::unique_temp_path("run_a.jsonl"),
                    b = testing::unique_temp_path("run_b.jsonl"),
                    png = testing::unique_temp_path("curves.png");
  {
    std::ofstream out(a), other(b);
    for (int step = 1; step <= 6; ++step) {
      const std::string line = fmt::format(
          R"({{"step": {}, "loss": {}, "grad_norm": 1.5, "lr": 0.001, "tokens_per_s": 900,)"
          R"( "mfu": 0.3, "expert_load_max_over_mean": [1.5, {}], "idle_expert_fraction": [0, 0]}})",
          step, 5.0 / step, 1 + 0.1 * step);
      out << line << "\n";
      if (step == 4) out << line << "\n";  // written again after a resume
      other << line.substr(0, line.size() - 1) << R"(, "eval_loss": 2.5})"
            << "\n";
    }
  }
  const std::string script = "python3 " + testing::source_dir() + "/scripts/plot_metrics.py ";
  const testing::Proc ok = testing::run_cmd(script + a + " " + b + " --out " + png);
  ASSERT_EQ(ok.code, 0) << ok.output;
  std::ifstream pic(png, std::ios::binary);
  char magic[8] = {};
  pic.read(magic, 8);
  EXPECT_EQ(std::string(magic + 1, 3), "PNG");
  EXPECT_GT(std::filesystem::file_size(png), 20000u);  // six panels, not an empty canvas
  std::ofstream(b, std::ios::app) << "{not json\n";
  const testing::Proc bad = testing::run_cmd(script + a + " " + b + " --out " + png);
  EXPECT_EQ(bad.code, 3) << bad.output;
  EXPECT_NE(bad.output.find(b + ":7: not JSON"), std::string::npos) << bad.output;
  const testing::Proc missing = testing::run_cmd(script + a + ".none --out " + png);
  EXPECT_EQ(missing.code, 3) << missing.output;
  EXPECT_NE(missing.output.find(a + ".none"), std::string::npos) << missing.output;
  for (const std::string& p : {a, b, png}) std::filesystem::remove(p);
}

TEST(Packing, PositionsSegmentsAndMasks) {
  // Row: [A0 A1 A2 | B0 B1 ] + next token C0 (a new document) as the last target.
  PackedRow row{{10, 11, 12, 20, 21, 30}, {1, 0, 0, 1, 0, 1}, {1, 1, 1, 1, 1, 1}, {}};
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
  c.data.packing = Packing::kStream;  // sft's default is whole
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
  EXPECT_EQ(loader->state(), (DataState{2, 3}));  // two documents taken, at the third's 4th (9)
  const Batch wrap = loader->next(1, 4);          // tokens 9 1 2 3: wraps to the first document
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
    loader->set_state({from});  // a one-file stream's token position (older checkpoints)
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
  EXPECT_THROW(loader->set_state({-1}), CheckpointError);
  EXPECT_THROW(loader->set_state({1, 2, 3}), CheckpointError);
  std::filesystem::remove(path);
}

// First-fit decreasing by hand: lengths 5 4 3 3 2 2 into bins of 7 -> {5, 2}, {4, 3}, {3, 2}.
TEST(Packing, FirstFitDecreasingByHand) {
  const std::vector<int64_t> lengths = {3, 5, 2, 4, 3, 2};
  const auto bins = first_fit_decreasing(lengths, 7);
  const std::vector<std::vector<int64_t>> want = {{1, 2}, {3, 0}, {4, 5}};
  EXPECT_EQ(bins, want);
  EXPECT_TRUE(first_fit_decreasing(std::vector<int64_t>{}, 7).empty());
}

// Over random length distributions: every item in exactly one bin, no bin over capacity, and the
// first-fit rule held when each item was placed (no earlier bin had room), longest first.
TEST(Packing, FirstFitDecreasingInvariants) {
  for (uint64_t seed = 0; seed < 40; ++seed) {
    const CounterRng rng{seed, 77};
    const int64_t capacity = 1 + static_cast<int64_t>(rng.below(0, 300));
    const int64_t n = static_cast<int64_t>(rng.below(1, 400));
    std::vector<int64_t> lengths(n);
    for (int64_t i = 0; i < n; ++i)
      lengths[i] = seed % 4 == 0 ? capacity : static_cast<int64_t>(rng.below(2 + i, capacity + 1));
    const auto bins = first_fit_decreasing(lengths, capacity);
    std::vector<int> seen(n, 0);
    std::vector<std::pair<int64_t, int64_t>> placed;  // (length, bin) in placement order
    for (size_t b = 0; b < bins.size(); ++b) {
      int64_t used = 0;
      for (const int64_t i : bins[b]) {
        ++seen[i];
        used += lengths[i];
        placed.emplace_back(i, static_cast<int64_t>(b));
      }
      EXPECT_LE(used, capacity) << "seed " << seed;
      EXPECT_FALSE(bins[b].empty());
    }
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(seen[i], 1) << "seed " << seed << " item " << i;
    // Replay in decreasing length (ties in input order): each item went to the first bin with room.
    std::sort(placed.begin(), placed.end(), [&](auto a, auto b) {
      return lengths[a.first] != lengths[b.first] ? lengths[a.first] > lengths[b.first]
                                                  : a.first < b.first;
    });
    std::vector<int64_t> free;
    for (const auto& [i, b] : placed) {
      int64_t first = 0;
      while (first < static_cast<int64_t>(free.size()) && free[first] < lengths[i]) ++first;
      ASSERT_EQ(first, b) << "seed " << seed << " item " << i;
      if (first == static_cast<int64_t>(free.size())) free.push_back(capacity);
      free[first] -= lengths[i];
    }
  }
}

// A row with padding: the padding is its own attention segment, never a counted target, and
// marked in Batch::padding; the last document's last target (the first padding token) is masked.
TEST(Packing, PaddingIsItsOwnSegmentAndNeverCounts) {
  PackedRow row{{10, 11, 12, 20, 21, 0, 0}, {1, 0, 0, 1, 0, 0, 0}, {1, 1, 1, 1, 1, 0, 0}, 5};
  const Batch b = pack_rows({row}, 6);
  const std::vector<int> mask = {1, 1, 0, 1, 0, 0};
  const std::vector<int> pad = {0, 0, 0, 0, 0, 1};
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(b.loss_mask.item(i), mask[i]) << i;
    EXPECT_EQ(b.padding.item(i), pad[i]) << i;
  }
  EXPECT_EQ(b.padding_tokens, 1);
  const std::vector<int> cu = {0, 3, 5, 6};
  ASSERT_EQ(b.cu_seqlens.numel(), 4);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(b.cu_seqlens.item(i), cu[i]);
}

// Token files whose documents are identified by their tokens: document d holds d * 1000 + 1,
// d * 1000 + 2, ... (ids below 1000 * docs), with a loss mask that marks every other token.
TokenDocuments numbered_docs(const std::vector<int64_t>& lengths) {
  TokenDocuments d;
  d.doc_offsets = {0};
  for (size_t doc = 0; doc < lengths.size(); ++doc) {
    for (int64_t i = 0; i < lengths[doc]; ++i) {
      d.tokens.push_back(static_cast<uint32_t>(doc * 1000 + i + 1));
      d.loss_mask.push_back(static_cast<uint8_t>(i % 2));
    }
    d.doc_offsets.push_back(d.tokens.size());
  }
  return d;
}

Config token_config(const std::string& path, int64_t vocab) {
  Config c;
  c.model.vocab_size = vocab;
  c.data.source = DataSourceKind::kSft;
  c.data.path = path;
  return c;
}

// The documents of a batch's rows as whole segments: (document, first index, length) per
// segment, padding left out, checked against the file as it goes.
struct Segment {
  int64_t doc, first, length;
};
std::vector<Segment> segments_of(const Batch& b, int64_t rows, int64_t seq_len,
                                 const TokenDocuments& d) {
  std::vector<Segment> out;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < seq_len; ++i) {
      const int64_t at = r * seq_len + i;
      if (b.padding.item(at)) {
        EXPECT_EQ(b.loss_mask.item(at), 0);
        continue;
      }
      const auto token = static_cast<int64_t>(b.tokens.item(at));
      const int64_t doc = (token - 1) / 1000, index = (token - 1) % 1000;
      if (b.positions.item(at) == 0) out.push_back({doc, index, 0});
      EXPECT_FALSE(out.empty());
      Segment& s = out.back();
      EXPECT_EQ(s.doc, doc) << "a segment mixes documents";
      EXPECT_EQ(index, s.first + s.length) << "a segment's tokens are not consecutive";
      ++s.length;
      // The target is the next token of the same document, counted as the file's mask says,
      // or (the document's last input) the next segment's or padding's, never counted.
      const auto target = static_cast<int64_t>(b.targets.item(at));
      const bool inside = (target - 1) / 1000 == doc && (target - 1) % 1000 == index + 1;
      const auto doc_len = static_cast<int64_t>(d.doc_offsets[doc + 1] - d.doc_offsets[doc]);
      if (inside && index + 1 < doc_len)
        EXPECT_EQ(b.loss_mask.item(at), d.loss_mask[d.doc_offsets[doc] + index + 1]);
      else
        EXPECT_EQ(b.loss_mask.item(at), 0);
    }
  return out;
}

// "whole": over many random length distributions (lengths equal to the row, longer ones
// truncated to it), every row's segments are whole documents from their first token (a
// document's last token, a target only, may sit past the row's inputs), and one epoch's rows hold
// every document exactly once; the second epoch too, in another order.
TEST(Loader, WholePackingNeverSplitsADocument) {
  const std::string path = testing::unique_temp_path("whole.tok");
  for (uint64_t seed = 0; seed < 12; ++seed) {
    const CounterRng rng{seed, 5};
    const int64_t seq_len = 8 + static_cast<int64_t>(rng.below(0, 60));
    const int64_t n = 20 + static_cast<int64_t>(rng.below(1, 150));
    std::vector<int64_t> lengths(n);
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t kind = rng.below(2 + i, 10);
      lengths[i] = kind == 0   ? seq_len + 1                                    // exactly a row
                   : kind == 1 ? seq_len + 2 + int64_t(rng.below(400 + i, 20))  // longer
                   : kind == 2 ? 2
                               : 2 + int64_t(rng.below(800 + i, seq_len / 2));
    }
    const TokenDocuments d = numbered_docs(lengths);
    write_token_file(path, d);
    Config c = token_config(path, 1000 * n);
    c.data.pack_window = 1 + static_cast<int64_t>(rng.below(3, 40));
    c.data.seed = seed;
    auto loader = make_data_loader(c);
    const std::string report = loader->packing_report(seq_len);
    EXPECT_NE(report.find("whole packing fills"), std::string::npos) << report;
    for (int epoch = 0; epoch < 2; ++epoch) {
      std::vector<int> seen(n, 0);
      std::vector<int64_t> order;
      int64_t taken = 0;
      while (taken < n) {  // rows until every document of the epoch has appeared
        const Batch b = loader->next(1, seq_len);
        for (const Segment& s : segments_of(b, 1, seq_len, d)) {
          EXPECT_EQ(s.first, 0) << "a segment starts mid-document (seed " << seed << ")";
          const int64_t want = std::min(lengths[s.doc], seq_len + 1);
          // Inputs of the row: the whole document, less its last token when it ends the row.
          EXPECT_TRUE(s.length == want || s.length == want - 1) << "seed " << seed;
          ++seen[s.doc];
          order.push_back(s.doc);
        }
        taken = 0;
        for (int64_t i = 0; i < n; ++i) taken += seen[i] > 0;
      }
      for (int64_t i = 0; i < n; ++i)
        EXPECT_EQ(seen[i], 1) << "document " << i << " epoch " << epoch;
    }
  }
  std::filesystem::remove(path);
}

// Resume and split: a loader set to the state after k rows continues with the rows an unbroken
// one gives; a rank that skips the others' rows sees its own share of the same global batches.
TEST(Loader, WholePackingResumesAndSplitsExactly) {
  const std::string path = testing::unique_temp_path("whole_resume.tok");
  std::vector<int64_t> lengths;
  for (int i = 0; i < 90; ++i) lengths.push_back(2 + (i * 37) % 30);
  const TokenDocuments d = numbered_docs(lengths);
  write_token_file(path, d);
  Config c = token_config(path, 100000);
  c.data.pack_window = 7;
  const int64_t seq_len = 24;
  auto rows_from = [&](const DataState& s, int64_t count) {
    auto loader = make_data_loader(c);
    loader->set_state(s);
    std::vector<int32_t> out;
    const Batch b = loader->next(count, seq_len);
    for (int64_t i = 0; i < b.size(); ++i) out.push_back(static_cast<int32_t>(b.tokens.item(i)));
    return out;
  };
  auto unbroken = make_data_loader(c);
  for (int64_t k = 0; k < 200; k += 13) {
    const DataState s = unbroken->state();
    const Batch b = unbroken->next(13, seq_len);
    const std::vector<int32_t> again = rows_from(s, 13);
    ASSERT_EQ(static_cast<int64_t>(again.size()), b.size());
    for (int64_t i = 0; i < b.size(); ++i) ASSERT_EQ(again[i], b.tokens.item(i)) << "row " << k;
  }
  // Two ranks of 3 rows each against one of 6.
  auto one = make_data_loader(c), r0 = make_data_loader(c), r1 = make_data_loader(c);
  for (int step = 0; step < 20; ++step) {
    const Batch all = one->next(6, seq_len);
    const Batch a = r0->next(3, seq_len);
    r0->skip(3, seq_len);
    r1->skip(3, seq_len);
    const Batch b = r1->next(3, seq_len);
    for (int64_t i = 0; i < a.size(); ++i) {
      ASSERT_EQ(a.tokens.item(i), all.tokens.item(i)) << step;
      ASSERT_EQ(b.tokens.item(i), all.tokens.item(a.size() + i)) << step;
    }
  }
  EXPECT_THROW(make_data_loader(c)->set_state({5}), CheckpointError);  // a stream's position
  std::filesystem::remove(path);
}

// The rows of a window: first-fit decreasing's rows either way; without data.shuffle in the
// order it opened them (the longest document's row first, rows' longest documents never
// increasing), with it in a seeded order of their own (the same for the same seed, another for
// another), so a window's first steps are not its longest documents.
TEST(Loader, WholePackingShufflesAWindowsRows) {
  const std::string path = testing::unique_temp_path("whole_rows.tok");
  std::vector<int64_t> lengths;
  for (int i = 0; i < 60; ++i) lengths.push_back(3 + (i * 29) % 41);  // distinct enough
  const TokenDocuments d = numbered_docs(lengths);
  write_token_file(path, d);
  const int64_t seq_len = 47;
  // The first 1000 rows' documents, a row at a time, over 60-document windows (one per epoch).
  auto rows_of = [&](bool shuffle, uint64_t seed) {
    Config c = token_config(path, 100000);
    c.data.pack_window = 60;
    c.data.shuffle = shuffle;
    c.data.seed = seed;
    auto loader = make_data_loader(c);
    std::vector<std::vector<int64_t>> rows;
    int64_t docs = 0;
    while (docs < 60) {
      rows.emplace_back();
      for (const Segment& s : segments_of(loader->next(1, seq_len), 1, seq_len, d))
        rows.back().push_back(s.doc);
      docs += static_cast<int64_t>(rows.back().size());
    }
    return rows;
  };
  auto longest = [&](const std::vector<int64_t>& row) {
    int64_t m = 0;
    for (const int64_t doc : row) m = std::max(m, lengths[doc]);
    return m;
  };
  const auto in_order = rows_of(false, 1);
  ASSERT_GT(in_order.size(), 8u);
  EXPECT_EQ(longest(in_order[0]), *std::max_element(lengths.begin(), lengths.end()));
  for (size_t r = 1; r < in_order.size(); ++r)
    EXPECT_LE(longest(in_order[r]), longest(in_order[r - 1])) << "row " << r;
  // Shuffled: the same first-epoch documents (each exactly once), rows in another order.
  const auto a = rows_of(true, 1), again = rows_of(true, 1), b = rows_of(true, 2);
  EXPECT_EQ(a, again);
  EXPECT_NE(a, b);
  for (const auto& rows : {a, b}) {
    std::vector<int> seen(lengths.size(), 0);
    bool sorted = true;
    for (size_t r = 0; r < rows.size(); ++r) {
      for (const int64_t doc : rows[r]) ++seen[doc];
      sorted = sorted && (r == 0 || longest(rows[r]) <= longest(rows[r - 1]));
    }
    for (const int n : seen) EXPECT_EQ(n, 1);
    EXPECT_FALSE(sorted) << "the rows went out longest first";
  }
  std::filesystem::remove(path);
}

// Documents longer than a row: "drop" leaves them out of the rows, "error" refuses the data at
// start naming the first one (exit 3), "truncate" keeps their first seq_len + 1 tokens.
TEST(Loader, OverlongDocumentsFollowTheSetting) {
  const std::string path = testing::unique_temp_path("overlong.tok");
  const TokenDocuments d = numbered_docs({5, 40, 6, 9});
  write_token_file(path, d);
  Config c = token_config(path, 10000);
  c.data.shuffle = false;
  c.data.overlong = Overlong::kDrop;
  auto drop = make_data_loader(c);
  EXPECT_NE(drop->packing_report(10).find("1 of 4 documents"), std::string::npos)
      << drop->packing_report(10);
  for (int i = 0; i < 6; ++i)
    for (const Segment& s : segments_of(drop->next(1, 10), 1, 10, d)) EXPECT_NE(s.doc, 1);
  c.data.overlong = Overlong::kError;
  auto refuse = make_data_loader(c);
  try {
    (void)refuse->packing_report(10);
    ADD_FAILURE() << "no error";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("document 1 of '" + path + "' has 40 tokens"),
              std::string::npos)
        << e.what();
  }
  c.data.overlong = Overlong::kTruncate;
  auto cut = make_data_loader(c);
  bool found = false;
  for (int i = 0; i < 4; ++i)
    for (const Segment& s : segments_of(cut->next(1, 10), 1, 10, d))
      if (s.doc == 1) {
        found = true;
        EXPECT_EQ(s.length, 10);  // 11 tokens kept: 10 inputs, the last a target
      }
  EXPECT_TRUE(found);
  std::filesystem::remove(path);
}

// data.mix: each file's share of the documents within one of its weight's (Megatron's blend is
// exact up to one document), whatever the packing; each file keeps its own mask; the state
// resumes the blend; a missing file is named.
TEST(Loader, MixDrawsDocumentsInProportionToTheWeights) {
  const std::string a = testing::unique_temp_path("mix_a.tok"),
                    b = testing::unique_temp_path("mix_b.tok"),
                    e = testing::unique_temp_path("mix_c.tok");
  write_token_file(a, numbered_docs(std::vector<int64_t>(50, 6)));  // ids < 50000
  TokenDocuments many = numbered_docs(std::vector<int64_t>(70, 6));
  for (uint32_t& t : many.tokens) t += 100000;  // file b: ids above 100000
  write_token_file(b, many);
  TokenDocuments few = numbered_docs(std::vector<int64_t>(3, 6));
  for (uint32_t& t : few.tokens) t += 200000;  // file c: three documents, upsampled
  write_token_file(e, few);
  for (const Packing packing : {Packing::kWhole, Packing::kStream}) {
    Config c = token_config("", 300000);
    c.data.mix = {{a, 5}, {b, 3}, {e, 2}};
    c.data.packing = packing;
    auto loader = make_data_loader(c);
    std::array<int64_t, 3> docs{};
    for (int step = 0; step < 60; ++step) {
      const Batch batch = loader->next(4, 15);
      for (int64_t i = 0; i < batch.size(); ++i)
        if (!batch.padding.item(i) &&
            (static_cast<int64_t>(batch.tokens.item(i)) % 100000 - 1) % 1000 == 0)  // a first token
          ++docs[static_cast<size_t>(batch.tokens.item(i)) / 100000];
    }
    const double total = static_cast<double>(docs[0] + docs[1] + docs[2]);
    const double weight[3] = {0.5, 0.3, 0.2};
    for (int f = 0; f < 3; ++f)
      EXPECT_NEAR(docs[f] / total, weight[f], 0.02) << "file " << f << " " << packing_name(packing);
    const DataState s = loader->state();
    EXPECT_EQ(s.size(), 4u);
    auto again = make_data_loader(c);
    again->set_state(s);
    const Batch x = loader->next(2, 15), y = again->next(2, 15);
    for (int64_t i = 0; i < x.size(); ++i) ASSERT_EQ(x.tokens.item(i), y.tokens.item(i));
  }
  Config missing = token_config("", 300000);
  missing.data.mix = {{a, 1}, {a + ".missing", 1}};
  try {
    make_data_loader(missing);
    ADD_FAILURE() << "no error";
  } catch (const DataError& err) {
    EXPECT_NE(std::string(err.what()).find(a + ".missing"), std::string::npos) << err.what();
  }
  for (const std::string& p : {a, b, e}) std::filesystem::remove(p);
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
