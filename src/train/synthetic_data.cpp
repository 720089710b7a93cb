#include "train/synthetic_data.h"

#include <cmath>
#include <numeric>

#include "core/error.h"

namespace mt {

namespace {
// RNG streams: grammar construction and rows never share counters.
constexpr uint64_t kGrammarStream = 0xC0FFEEull << 32;
constexpr uint64_t kRowStreamBase = 1ull << 40;
}  // namespace

SyntheticLanguages::SyntheticLanguages(const SyntheticSpec& spec)
    : spec_(spec), words_((spec.vocab - spec.languages) / 2) {
  MT_CHECK(words_ >= spec.branching, "vocab {} too small for {} languages", spec.vocab,
           spec.languages);
  const int64_t pool = spec.vocab - spec.languages;
  word_set_.resize(spec.languages);
  next_.resize(spec.languages);
  uint64_t draw = 0;
  const CounterRng rng{spec.seed, kGrammarStream};
  for (int64_t l = 0; l < spec.languages; ++l) {
    // Partial Fisher-Yates over the non-marker tokens.
    std::vector<int32_t> perm(pool);
    std::iota(perm.begin(), perm.end(), static_cast<int32_t>(spec.languages));
    for (int64_t i = 0; i < words_; ++i)
      std::swap(perm[i], perm[i + rng.below(draw++, static_cast<uint32_t>(pool - i))]);
    word_set_[l].assign(perm.begin(), perm.begin() + words_);
    next_[l].resize(spec.vocab);
    for (int32_t w : word_set_[l]) {
      std::vector<int32_t> choice = word_set_[l];
      std::vector<Successor>& succ = next_[l][w];
      double total = 0;
      for (int64_t b = 0; b < spec.branching; ++b) {
        std::swap(choice[b], choice[b + rng.below(draw++, static_cast<uint32_t>(words_ - b))]);
        const double weight = std::exp(1.5 * rng.normal(draw++));
        succ.push_back({choice[b], weight});
        total += weight;
      }
      for (Successor& s : succ) s.prob /= total;
    }
  }
}

SyntheticRow SyntheticLanguages::make_row(int64_t row, int64_t length) const {
  const CounterRng rng{spec_.seed, kRowStreamBase + static_cast<uint64_t>(row)};
  uint64_t draw = 0;
  SyntheticRow r;
  const int64_t total = length + 1;
  r.tokens.reserve(total);
  while (static_cast<int64_t>(r.tokens.size()) < total) {
    const int64_t lang = rng.below(draw++, static_cast<uint32_t>(spec_.languages));
    const int64_t doc_len =
        spec_.min_doc_len +
        rng.below(draw++, static_cast<uint32_t>(spec_.max_doc_len - spec_.min_doc_len + 1));
    r.tokens.push_back(static_cast<int32_t>(lang));
    r.doc_start.push_back(1);
    r.true_nll.push_back(0.0);
    int32_t prev = -1;
    for (int64_t i = 1; i < doc_len && static_cast<int64_t>(r.tokens.size()) < total; ++i) {
      int32_t tok;
      double p;
      if (prev < 0) {
        tok = word_set_[lang][rng.below(draw++, static_cast<uint32_t>(words_))];
        p = 1.0 / static_cast<double>(words_);
      } else {
        const auto& succ = next_[lang][prev];
        double u = rng.uniform(draw++);
        size_t j = 0;
        while (j + 1 < succ.size() && u >= succ[j].prob) u -= succ[j++].prob;
        tok = succ[j].token;
        p = succ[j].prob;
      }
      r.tokens.push_back(tok);
      r.doc_start.push_back(0);
      r.true_nll.push_back(-std::log(p));
      prev = tok;
    }
  }
  return r;
}

}  // namespace mt
