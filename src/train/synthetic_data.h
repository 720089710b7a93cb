// The embedded default data: a mixture of stochastic languages, generated from a seed.
//
// Language l (of `languages`) owns marker token l and a word set W_l of (vocab - languages) / 2
// tokens drawn from the non-marker tokens, so languages overlap in vocabulary but not in
// grammar. Each word of W_l has `branching` successors in W_l with fixed random probabilities
// (an order-1 Markov chain per language). A document is the marker followed by a uniform first
// word and a walk of the chain. Knowing the language (from the marker, through attention) is
// worth more than bigram statistics on shared words, so the data has structure beyond unigram
// and bigram counts, and experts have languages to specialise on.
//
// The per-token entropy floor is exact per token: the true model's -log p(target | history),
// averaged over the counted targets.
#pragma once
#include <cstdint>
#include <vector>

#include "core/rng.h"

namespace mt {

struct SyntheticSpec {
  int64_t vocab = 256;
  int64_t languages = 4;
  int64_t branching = 4;
  int64_t min_doc_len = 16;  // tokens, marker included
  int64_t max_doc_len = 96;
  uint64_t seed = 7;
};

// One packed row of length+1 tokens: documents laid end to end, the last one cut.
struct SyntheticRow {
  std::vector<int32_t> tokens;     // (length + 1)
  std::vector<uint8_t> doc_start;  // (length + 1) 1 where a document (its marker) starts
  std::vector<double> true_nll;    // (length + 1) -log p_true(token | history); 0 at markers
};

class SyntheticLanguages {
 public:
  explicit SyntheticLanguages(const SyntheticSpec& spec);
  // Row `row` is a pure function of (seed, row).
  SyntheticRow make_row(int64_t row, int64_t length) const;
  int64_t words_per_language() const { return words_; }

 private:
  struct Successor {
    int32_t token;
    double prob;
  };
  SyntheticSpec spec_;
  int64_t words_;
  std::vector<std::vector<int32_t>> word_set_;  // [language][i]
  // [language][token] -> successors (empty for tokens outside the language)
  std::vector<std::vector<std::vector<Successor>>> next_;
};

}  // namespace mt
