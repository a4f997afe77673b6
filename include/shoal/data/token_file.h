// TokenFile: a flat binary file of token ids, memory-mapped read-only: nanoGPT's train.bin and
// val.bin (numpy uint16 written with tofile(), or uint32 for vocabularies past 65,536), and what
// `shoal data tokenize` writes. The file may be far larger than memory: only the pages being read
// are resident, and read() hands them back to the page cache once copied, so the process's
// resident size stays at the size of the reads in flight and the kernel reclaims the rest.
//
//   TokenFile tokens("train.bin", {TokenDtype::kUInt16, /*vocab_size=*/50304});
//   at::Tensor ids = tokens.read(/*offset=*/4096, /*count=*/1025);  // [1025] int64
//
// Validation: at open, a regular file, not empty, its size a multiple of the token width. The
// vocabulary bound (ids < vocab_size) is checked lazily on every read, over exactly the tokens
// read (the copy looks at each token anyway), so opening a file of billions of tokens costs no
// scan; check_vocab() scans the whole file when an up-front check is wanted (`shoal data inspect`).
//
// Thread safety: all const member functions may be called concurrently (the DataLoader's workers).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace shoal::data {

/// The width of one token on disk, little-endian.
enum class TokenDtype { kUInt16, kUInt32 };

/// "uint16" / "uint32" to a TokenDtype; throws InvalidArgument naming the value otherwise.
TokenDtype parse_token_dtype(const std::string& name);
/// The name parse_token_dtype reads as `dtype`: "uint16" or "uint32".
const char* token_dtype_name(TokenDtype dtype);
/// Bytes per token: 2 or 4.
int64_t token_width(TokenDtype dtype);

struct TokenFileOptions {
  TokenDtype dtype = TokenDtype::kUInt16;
  /// Token ids must be below this; 0 checks nothing.
  int64_t vocab_size = 0;
  /// The reads will walk the file in order (a validation pass, an unshuffled epoch): the kernel
  /// reads ahead (MADV_SEQUENTIAL). Otherwise reads are taken as random (MADV_RANDOM), so that a
  /// shuffled epoch does not read ahead pages it will not touch before they are evicted.
  bool sequential = false;
};

class TokenFile {
 public:
  /// Opens and maps `path`; throws DataError naming the file when it is missing, not a regular
  /// file, empty, or its size is not a multiple of the token width.
  explicit TokenFile(std::string path, TokenFileOptions options = {});
  ~TokenFile();
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;

  /// Number of tokens in the file.
  int64_t size() const { return size_; }
  const std::string& path() const { return path_; }
  const TokenFileOptions& options() const { return options_; }

  /// Tokens [offset, offset + count) as a [count] int64 tensor. Throws InvalidArgument for a
  /// range outside the file and DataError naming the file and offset for an id >= vocab_size.
  at::Tensor read(int64_t offset, int64_t count) const;
  /// The same into `out` (count int64 values).
  void read_into(int64_t offset, int64_t count, int64_t* out) const;
  /// Asks the kernel to start reading tokens [offset, offset + count) now (MADV_WILLNEED), so
  /// that the reads of a batch's blocks are in flight together rather than one fault at a time.
  void prefetch(int64_t offset, int64_t count) const;
  /// Scans the whole file; throws DataError at the first id >= vocab_size. Returns the largest id.
  int64_t check_vocab() const;

 private:
  /// Drops this process's mapping of the pages of [offset, offset + count) (the page cache keeps
  /// them while memory allows), so that resident memory does not grow with the tokens read.
  void release(int64_t offset, int64_t count) const;
  [[noreturn]] void throw_out_of_vocab(int64_t offset, int64_t count) const;

  std::string path_;
  TokenFileOptions options_;
  int64_t size_ = 0;        // tokens
  int64_t width_ = 2;       // bytes per token
  const unsigned char* data_ = nullptr;
  size_t mapped_bytes_ = 0;
};

}  // namespace shoal::data
