// GPT-2's byte-level BPE, as tiktoken encodes with GPT-2's vocabulary: the text (UTF-8) is cut
// into pieces by GPT-2's pre-tokenizer regex, and each piece's bytes are merged pairwise, the
// adjacent pair whose concatenation has the lowest rank first (the leftmost among equals), until
// no adjacent pair is a token. A piece that is a token whole is that token, as in tiktoken.
//
// The regex runs in PCRE2 (UTF and UCP, JIT where the build has it) with `\s` written out as
// Unicode's White_Space set, which is what tiktoken's Rust regex means by `\s` (PCRE2's own `\s`
// also takes U+180E). Letters and digits are PCRE2's Unicode tables (Unicode 14 in Debian's
// 10.42); a character assigned later is neither there, so a text with one may split differently.
//
// Thread safety: Gpt2Vocabulary is immutable after load() and may be shared; one Gpt2Encoder per
// thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace shoal::data::detail {

class Gpt2Vocabulary {
 public:
  /// Reads a tiktoken vocabulary (`base64(token bytes) rank` per line, as whisper's
  /// gpt2.tiktoken), or GPT-2's encoder.json (Hugging Face's vocab.json: a JSON object of
  /// bytes_to_unicode token: id; the ids are the ranks). Throws DataError naming the file and line
  /// (or key) for anything else: a line too long, bad base64, a repeated token or rank, ranks
  /// that are not 0..n-1, a byte with no token, more ranks than uint16 ids hold beside the
  /// end-of-text token.
  static Gpt2Vocabulary load(const std::string& path);
  class Builder;

  Gpt2Vocabulary() = default;
  // ranks_ holds views into tokens_: a copy's views would point into the original.
  Gpt2Vocabulary(const Gpt2Vocabulary&) = delete;
  Gpt2Vocabulary& operator=(const Gpt2Vocabulary&) = delete;
  Gpt2Vocabulary(Gpt2Vocabulary&&) = default;
  Gpt2Vocabulary& operator=(Gpt2Vocabulary&&) = default;

  /// Ranks in the file, plus the end-of-text token (`<|endoftext|>`, id = ranks).
  int64_t size() const { return static_cast<int64_t>(tokens_.size()) + 1; }
  /// The rank of `bytes`, -1 when they are no token.
  int32_t rank(std::string_view bytes) const;
  /// The rank of the two tokens' concatenation, -1 when it is no token.
  int32_t pair_rank(int32_t left, int32_t right) const;
  /// The bytes of token `id` ("<|endoftext|>" for the end-of-text token).
  std::string_view bytes(int64_t id) const;

 private:
  void index();

  std::vector<std::string> tokens_;                    // by rank
  std::unordered_map<std::string_view, int32_t> ranks_;  // views into tokens_
  std::unordered_map<uint64_t, int32_t> pairs_;          // (left << 32 | right) -> rank
};

/// Streams text to GPT-2 token ids: feed() the text in pieces of any size (a character may be
/// split between two), then finish(). Memory is a read's worth plus one pre-token piece, which is
/// bounded (a longer run without a break is refused).
class Gpt2Encoder {
 public:
  /// Receives each piece's ids, in order.
  using Sink = std::function<void(const uint16_t* ids, size_t count)>;

  Gpt2Encoder(const Gpt2Vocabulary& vocabulary, Sink sink);
  ~Gpt2Encoder();
  Gpt2Encoder(const Gpt2Encoder&) = delete;
  Gpt2Encoder& operator=(const Gpt2Encoder&) = delete;

  /// Encodes what the text so far decides. `source` names the text in errors; the bytes must be
  /// valid UTF-8 once joined (Utf8Checker's job).
  void feed(const char* bytes, size_t count, const std::string& source);
  /// Encodes the rest.
  void finish(const std::string& source);

 private:
  void encode_pieces(bool at_end, const std::string& source);
  void encode_piece(std::string_view piece);
  void merge(std::string_view piece, std::vector<uint16_t>& ids) const;

  const Gpt2Vocabulary& vocabulary_;
  Sink sink_;
  struct Regex;
  std::unique_ptr<Regex> regex_;
  std::string pending_;  // text not yet cut into pieces
  std::unordered_map<std::string, std::vector<uint16_t>> cache_;  // piece -> ids
  std::vector<uint16_t> ids_;
};

/// Checks a stream of bytes is UTF-8 (RFC 3629: no overlong forms, surrogates or code points
/// past U+10FFFF), across reads.
class Utf8Checker {
 public:
  /// Throws DataError naming `source` and the byte offset of the first invalid sequence.
  void check(const unsigned char* bytes, size_t count, const std::string& source);
  /// Throws when the stream ended inside a character.
  void finish(const std::string& source) const;

 private:
  int64_t offset_ = 0;       // bytes checked so far
  int needed_ = 0;           // continuation bytes the current character still needs
  int64_t char_start_ = 0;   // offset of the current character's first byte
  unsigned char lower_ = 0x80, upper_ = 0xBF;  // range of the next continuation byte
};

}  // namespace shoal::data::detail
