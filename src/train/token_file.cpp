#include "train/token_file.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "core/atomic_file.h"
#include "core/error.h"

namespace mt {

namespace {
constexpr char kMagic[8] = {'M', 'T', 'T', 'O', 'K', 'E', 'N', 'S'};
constexpr uint32_t kVersion = 1;
constexpr uint32_t kFlagLossMask = 1;
constexpr size_t kHeaderBytes = 32;

template <class T>
T read_le(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));  // the supported hosts are little-endian (x86-64, aarch64)
  return v;
}
}  // namespace

bool TokenView::is_doc_start(int64_t i) const {
  return std::binary_search(doc_offsets, doc_offsets + num_docs, static_cast<uint64_t>(i));
}

TokenView TokenDocuments::view() const {
  return {doc_offsets.data(), num_docs(), tokens.data(), static_cast<int64_t>(tokens.size()),
          loss_mask.empty() ? nullptr : loss_mask.data()};
}

MappedTokenFile::MappedTokenFile(const std::string& path, int64_t vocab_size) {
  std::string why;
  if (!file_.open(path, &why))
    throw DataError(fmt::format("data: cannot open token file '{}': {}", path, why));
  const uint64_t size = file_.size();
  if (size < kHeaderBytes)
    throw DataError(fmt::format("data: '{}' is truncated: {} bytes, the header alone is {}", path,
                                size, kHeaderBytes));
  const char* header = reinterpret_cast<const char*>(file_.data());
  if (std::memcmp(header, kMagic, 8) != 0)
    throw DataError(
        fmt::format("data: '{}' is not a moetrain token file (magic is not MTTOKENS)", path));
  const uint32_t version = read_le<uint32_t>(header + 8);
  const uint32_t flags = read_le<uint32_t>(header + 12);
  const uint64_t docs = read_le<uint64_t>(header + 16);
  const uint64_t ntok = read_le<uint64_t>(header + 24);
  if (version != kVersion)
    throw DataError(fmt::format("data: '{}' has format version {}, this build reads {}", path,
                                version, kVersion));
  if (flags & ~kFlagLossMask)
    throw DataError(fmt::format("data: '{}' has unknown flags 0x{:x}", path, flags));
  const bool has_mask = flags & kFlagLossMask;
  // Guard the arithmetic: absurd counts would overflow the expected size.
  if (docs > size || ntok > size)
    throw DataError(
        fmt::format("data: '{}' is corrupt or truncated: header claims {} documents "
                    "and {} tokens in a {}-byte file",
                    path, docs, ntok, size));
  const uint64_t expected = kHeaderBytes + 8 * (docs + 1) + 4 * ntok + (has_mask ? ntok : 0);
  if (size != expected)
    throw DataError(
        fmt::format("data: '{}' is {}: header says {} documents and {} tokens "
                    "({} bytes), the file has {} bytes",
                    path, size < expected ? "truncated" : "corrupt (trailing bytes)", docs, ntok,
                    expected, size));
  // The offsets are 8-byte aligned (after the 32-byte header of a page-aligned mapping), the
  // tokens 4-byte aligned after them.
  const char* base = header + kHeaderBytes;
  view_.doc_offsets = reinterpret_cast<const uint64_t*>(base);
  view_.num_docs = static_cast<int64_t>(docs);
  view_.tokens = reinterpret_cast<const uint32_t*>(base + 8 * (docs + 1));
  view_.num_tokens = static_cast<int64_t>(ntok);
  view_.loss_mask =
      has_mask ? reinterpret_cast<const uint8_t*>(base + 8 * (docs + 1) + 4 * ntok) : nullptr;
  const TokenView& d = view_;
  if (d.doc_offsets[0] != 0 || d.doc_offsets[docs] != ntok)
    throw DataError(
        fmt::format("data: '{}' is corrupt: document offsets run from {} to {}, "
                    "expected 0 to {}",
                    path, d.doc_offsets[0], d.doc_offsets[docs], ntok));
  for (uint64_t i = 0; i < docs; ++i)
    if (d.doc_offsets[i + 1] < d.doc_offsets[i])
      throw DataError(fmt::format("data: '{}' is corrupt: document offset {} decreases ({} -> {})",
                                  path, i, d.doc_offsets[i], d.doc_offsets[i + 1]));
  for (uint64_t i = 0; i < ntok; ++i)
    if (d.tokens[i] >= static_cast<uint64_t>(vocab_size))
      throw DataError(fmt::format("data: '{}': token {} at position {} is >= model.vocab_size {}",
                                  path, d.tokens[i], i, vocab_size));
  if (ntok < 2)
    throw DataError(fmt::format("data: '{}' holds {} tokens; needs at least 2", path, ntok));
  // A target is a document's token after its first: a file of one-token documents has none
  // (it once trained at loss 0).
  bool any_target = false;
  for (uint64_t doc = 0; doc < docs && !any_target; ++doc)
    any_target = d.doc_offsets[doc + 1] - d.doc_offsets[doc] >= 2;
  if (!any_target)
    throw DataError(fmt::format(
        "data: '{}': none of its {} documents has two tokens, so none has a target to predict",
        path, docs));
  if (has_mask) {
    uint64_t counted = 0;
    for (uint64_t doc = 0; doc < docs; ++doc)
      for (uint64_t i = d.doc_offsets[doc]; i < d.doc_offsets[doc + 1]; ++i) {
        if (d.loss_mask[i] > 1)
          throw DataError(fmt::format(
              "data: '{}': document {} has loss mask value {} at token {} (valid: 0 or 1)", path,
              doc, d.loss_mask[i], i - d.doc_offsets[doc]));
        // A token counts when it is a target: not a document's first.
        counted += d.loss_mask[i] && i > d.doc_offsets[doc];
      }
    if (counted == 0)
      throw DataError(
          fmt::format("data: '{}': its loss mask counts no target token (every mask is 0 past each "
                      "document's first token): there is nothing to learn from",
                      path));
  }
}

MappedTokenFile::~MappedTokenFile() = default;

TokenDocuments read_token_file(const std::string& path, int64_t vocab_size) {
  const MappedTokenFile file(path, vocab_size);
  const TokenView& v = file.view();
  TokenDocuments d;
  d.doc_offsets.assign(v.doc_offsets, v.doc_offsets + v.num_docs + 1);
  d.tokens.assign(v.tokens, v.tokens + v.num_tokens);
  if (v.loss_mask) d.loss_mask.assign(v.loss_mask, v.loss_mask + v.num_tokens);
  return d;
}

void write_token_file(const std::string& path, const TokenDocuments& d) {
  MT_CHECK(!d.doc_offsets.empty() && d.doc_offsets.back() == d.tokens.size(),
           "document offsets must end at the token count");
  MT_CHECK(d.loss_mask.empty() || d.loss_mask.size() == d.tokens.size(),
           "loss mask needs one entry per token");
  std::string bytes(kMagic, 8);
  auto put = [&](const void* p, size_t n) { bytes.append(static_cast<const char*>(p), n); };
  const uint32_t version = kVersion, flags = d.loss_mask.empty() ? 0 : kFlagLossMask;
  const uint64_t docs = d.doc_offsets.size() - 1, ntok = d.tokens.size();
  put(&version, 4);
  put(&flags, 4);
  put(&docs, 8);
  put(&ntok, 8);
  put(d.doc_offsets.data(), 8 * d.doc_offsets.size());
  put(d.tokens.data(), 4 * d.tokens.size());
  put(d.loss_mask.data(), d.loss_mask.size());
  write_file_atomically(path, bytes);
}

}  // namespace mt
