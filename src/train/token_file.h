// Pre-tokenised documents on disk (docs/data_format.md). Little-endian:
//
//   offset  size              field
//   0       8                 magic "MTTOKENS"
//   8       4   u32           version = 1
//   12      4   u32           flags: bit 0 = a per-token loss mask follows the tokens (SFT)
//   16      8   u64           num_docs
//   24      8   u64           num_tokens
//   32      8 * (docs + 1)    u64 doc_offsets: document d is tokens [off[d], off[d+1])
//   ...     4 * num_tokens    u32 tokens
//   ...     num_tokens        u8 loss mask (flag bit 0 only): 1 = the token is a target that counts
//
// The reader checks the size against the header before reading anything, so a truncated file
// fails with the sizes in the message; offsets must start at 0, never decrease and end at
// num_tokens; every token must be below the model's vocab_size.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/mapped_file.h"

namespace mt {

// A token file's contents, not owned: a TokenDocuments' or a mapped file's.
struct TokenView {
  const uint64_t* doc_offsets = nullptr;  // (num_docs + 1)
  int64_t num_docs = 0;
  const uint32_t* tokens = nullptr;
  int64_t num_tokens = 0;
  const uint8_t* loss_mask = nullptr;  // null: every token counts
  bool is_doc_start(int64_t i) const;  // token i begins a document (binary search)
};

struct TokenDocuments {
  std::vector<uint64_t> doc_offsets;  // (docs + 1)
  std::vector<uint32_t> tokens;
  std::vector<uint8_t> loss_mask;  // empty, or one per token
  int64_t num_docs() const { return static_cast<int64_t>(doc_offsets.size()) - 1; }
  TokenView view() const;
};

// A token file mapped read-only and checked once (in one sequential pass); pages are read from
// disk when touched and can be dropped by the kernel again, so every rank of a node can open a
// file larger than its memory. Throws DataError naming the file and the problem.
class MappedTokenFile {
 public:
  MappedTokenFile(const std::string& path, int64_t vocab_size);
  ~MappedTokenFile();
  MappedTokenFile(const MappedTokenFile&) = delete;
  MappedTokenFile& operator=(const MappedTokenFile&) = delete;
  const TokenView& view() const { return view_; }

 private:
  MappedFile file_;
  TokenView view_;
};

// The file's contents copied into memory (tests, small files). Throws DataError.
TokenDocuments read_token_file(const std::string& path, int64_t vocab_size);
// Writes atomically (temporary file + rename).
void write_token_file(const std::string& path, const TokenDocuments& docs);

}  // namespace mt
