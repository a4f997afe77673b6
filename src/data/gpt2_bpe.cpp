#include "data/gpt2_bpe.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <fstream>
#include <queue>
#include <sstream>

#include "data/regular_file.h"
#include "shoal/error.h"

namespace shoal::data::detail {
namespace {

// Bounds on the vocabulary file, which is input like any other: GPT-2's is 0.8 MB of 50,256
// lines of at most ~90 characters.
constexpr uint64_t kMaxVocabularyBytes = uint64_t{16} << 20;
constexpr size_t kMaxLineBytes = 1024;
// uint16 ids: the ranks and the end-of-text token after them stay below 65536.
constexpr int64_t kMaxRanks = 65535;
constexpr const char* kEndOfText = "<|endoftext|>";

// A pre-token piece longer than this (a run of letters, digits, spaces or punctuation with no
// break) is refused: it would be held whole in memory, and GPT-2's text has none near it.
constexpr size_t kMaxPieceBytes = size_t{1} << 20;
// GPT-2's longest token is 128 bytes; indexing a token costs its length squared (every cut),
// so a longer one in a hostile file would cost time without bound.
constexpr size_t kMaxTokenBytes = 256;
// Pieces up to this long have their ids cached; their merge is short and their kinds few.
constexpr size_t kMaxCachedPieceBytes = 64;
constexpr size_t kMaxCacheEntries = size_t{1} << 16;
// Up to this many bytes the merge scans all pairs each round (as tiktoken does); longer pieces
// keep their pairs in a heap, so that a long run costs n log n, not n squared.
constexpr size_t kMaxScannedPieceBytes = 128;

// GPT-2's pre-tokenizer, with `\s` spelled as Unicode's White_Space (see the header).
#define SHOAL_WS "\\t\\n\\x0B\\f\\r\\x20\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}"
constexpr const char* kPattern =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^" SHOAL_WS "\\p{L}\\p{N}]+|[" SHOAL_WS
    "]+(?![^" SHOAL_WS "])|[" SHOAL_WS "]+";
#undef SHOAL_WS

int base64_value(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

/// Standard base64 with its padding; false for anything else.
bool decode_base64(std::string_view text, std::string& out) {
  out.clear();
  if (text.empty() || text.size() % 4 != 0) return false;
  const size_t padding = text.size() - std::min(text.find_last_not_of('='), text.size() - 1) - 1;
  if (padding > 2) return false;
  uint32_t bits = 0;
  for (size_t i = 0; i < text.size() - padding; ++i) {
    const int value = base64_value(text[i]);
    if (value < 0) return false;
    bits = (bits << 6) | static_cast<uint32_t>(value);
    if (i % 4 == 3) {
      out.push_back(static_cast<char>(bits >> 16));
      out.push_back(static_cast<char>(bits >> 8));
      out.push_back(static_cast<char>(bits));
      bits = 0;
    }
  }
  if (padding == 1) {  // 18 bits: two bytes, the last 2 bits zero
    if ((bits & 0x3) != 0) return false;
    out.push_back(static_cast<char>(bits >> 10));
    out.push_back(static_cast<char>(bits >> 2));
  } else if (padding == 2) {  // 12 bits: one byte, the last 4 bits zero
    if ((bits & 0xF) != 0) return false;
    out.push_back(static_cast<char>(bits >> 4));
  }
  return true;
}

/// The rank of a vocabulary line: decimal digits only, below kMaxRanks; -1 otherwise.
int64_t parse_rank(std::string_view text) {
  if (text.empty() || text.size() > 6) return -1;
  int64_t rank = 0;
  for (const char c : text) {
    if (c < '0' || c > '9') return -1;
    rank = rank * 10 + (c - '0');
  }
  return rank < kMaxRanks ? rank : -1;
}

std::string read_vocabulary_file(const std::string& path) {
  const uint64_t size = require_regular_file<DataError>(path);
  SHOAL_CHECK_T(DataError, size <= kMaxVocabularyBytes, "vocabulary ", path, " has ", size,
                " bytes, more than a tiktoken BPE file's ", kMaxVocabularyBytes, "; is it the right file?");
  std::ifstream in(path, std::ios::binary);
  SHOAL_CHECK_T(DataError, in.good(), "vocabulary ", path, ": cannot open");
  std::ostringstream text;
  text << in.rdbuf();
  SHOAL_CHECK_T(DataError, !in.bad(), "vocabulary ", path, ": read failed");
  return text.str();
}

}  // namespace

namespace {

/// One `base64(token) rank` line into `token` and its rank; throws DataError starting `where`.
int64_t parse_line(std::string_view line, const std::string& where, std::string& token) {
  SHOAL_CHECK_T(DataError, line.size() <= kMaxLineBytes, where, "longer than ", kMaxLineBytes,
                " bytes; a tiktoken BPE file has `base64(token) rank` per line");
  const size_t space = line.find(' ');
  SHOAL_CHECK_T(DataError, space != std::string_view::npos && line.find(' ', space + 1) == std::string_view::npos,
                where, "not `base64(token) rank`");
  SHOAL_CHECK_T(DataError, decode_base64(line.substr(0, space), token), where, "the token is not base64");
  const int64_t rank = parse_rank(line.substr(space + 1));
  SHOAL_CHECK_T(DataError, rank >= 0, where, "the rank is not a number below ", kMaxRanks);
  return rank;
}

/// GPT-2's bytes_to_unicode(): the character encoder.json writes for each byte. The printable
/// Latin-1 bytes are themselves; the others are U+0100 onward, in byte order.
std::array<uint32_t, 256> gpt2_byte_characters() {
  std::array<uint32_t, 256> characters{};
  uint32_t next = 256;
  for (uint32_t byte = 0; byte < 256; ++byte) {
    const bool printable = (byte >= '!' && byte <= '~') || (byte >= 0xA1 && byte <= 0xAC) || byte >= 0xAE;
    characters[byte] = printable ? byte : next++;
  }
  return characters;
}

/// An encoder.json key's token bytes (its characters mapped back through bytes_to_unicode), or
/// false when a character is not one of the 256.
bool decode_gpt2_key(const std::string& key, std::string& token) {
  static const std::unordered_map<uint32_t, char> byte_of = [] {
    std::unordered_map<uint32_t, char> map;
    const std::array<uint32_t, 256> characters = gpt2_byte_characters();
    for (int byte = 0; byte < 256; ++byte) map.emplace(characters[byte], static_cast<char>(byte));
    return map;
  }();
  token.clear();
  for (size_t i = 0; i < key.size();) {  // nlohmann's keys are valid UTF-8: 1-byte or 2-byte here
    const auto lead = static_cast<unsigned char>(key[i]);
    uint32_t character = lead;
    size_t length = 1;
    if (lead >= 0xC0 && lead < 0xE0 && i + 1 < key.size()) {
      character = ((lead & 0x1Fu) << 6) | (static_cast<unsigned char>(key[i + 1]) & 0x3Fu);
      length = 2;
    }
    const auto found = byte_of.find(character);
    if (found == byte_of.end() || (lead >= 0x80 && length == 1)) return false;
    token.push_back(found->second);
    i += length;
  }
  return !token.empty();
}

}  // namespace

/// Collects (token, rank) entries, checking ranks and tokens are unique and the ranks dense.
class Gpt2Vocabulary::Builder {
 public:
  explicit Builder(std::string path) : path_(std::move(path)) {}
  /// `label` says where in the file ("line 7", "key \"ab\"").
  void add(const std::string& token, int64_t rank, const std::string& label) {
    const std::string where = ::shoal::detail::str_cat("vocabulary ", path_, " ", label, ": ");
    SHOAL_CHECK_T(DataError, rank >= 0 && rank < kMaxRanks, where, "the rank is not a number below ", kMaxRanks);
    SHOAL_CHECK_T(DataError, !token.empty() && token.size() <= kMaxTokenBytes, where, "a token of ",
                  token.size(), " bytes (a token has 1 to ", kMaxTokenBytes, ")");
    const auto index = static_cast<size_t>(rank);
    if (index >= tokens_.size()) {
      tokens_.resize(index + 1);
      seen_.resize(index + 1);
    }
    SHOAL_CHECK_T(DataError, !seen_[index], where, "rank ", rank, " is given twice");
    const auto [previous, fresh] = first_.emplace(token, label);
    SHOAL_CHECK_T(DataError, fresh, where, "the token of ", previous->second, " again");
    seen_[index] = true;
    tokens_[index] = token;
  }
  Gpt2Vocabulary finish() {
    const auto missing = std::find(seen_.begin(), seen_.end(), false);
    SHOAL_CHECK_T(DataError, missing == seen_.end(), "vocabulary ", path_, ": no token has rank ",
                  missing - seen_.begin(), " (ranks must be 0 to ", seen_.size() - 1, ", each once)");
    Gpt2Vocabulary vocabulary;
    vocabulary.tokens_ = std::move(tokens_);
    vocabulary.index();
    for (int byte = 0; byte < 256; ++byte) {
      SHOAL_CHECK_T(DataError, vocabulary.rank(std::string(1, static_cast<char>(byte))) >= 0, "vocabulary ",
                    path_, ": no token is byte ", byte, " alone, so some text could not be encoded");
    }
    return vocabulary;
  }

 private:
  std::string path_;
  std::vector<std::string> tokens_;
  std::vector<bool> seen_;
  std::unordered_map<std::string, std::string> first_;  // token -> the label where it was first
};

namespace {

/// tiktoken's format: `base64(token) rank` per line.
void read_tiktoken_lines(const std::string& path, const std::string& text, Gpt2Vocabulary::Builder& builder) {
  std::string token;
  int64_t line_number = 0;
  for (size_t start = 0; start < text.size();) {
    const size_t end = std::min(text.find('\n', start), text.size());
    const std::string_view line(text.data() + start, end - start);
    start = end + 1;
    ++line_number;
    if (line.empty()) continue;  // tiktoken skips empty lines
    const std::string label = ::shoal::detail::str_cat("line ", line_number);
    const int64_t rank = parse_line(line, ::shoal::detail::str_cat("vocabulary ", path, " ", label, ": "), token);
    builder.add(token, rank, label);
  }
}

/// GPT-2's encoder.json (Hugging Face's vocab.json): {"token in bytes_to_unicode": id, ...}, the
/// ids being tiktoken's ranks; "<|endoftext|>" is left to follow them.
void read_encoder_json(const std::string& path, const std::string& text, Gpt2Vocabulary::Builder& builder) {
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& error) {
    SHOAL_THROW(DataError, "vocabulary ", path, ": not JSON (", error.what(), ")");
  }
  SHOAL_CHECK_T(DataError, json.is_object(), "vocabulary ", path, ": not a JSON object of token: id");
  std::string token;
  for (const auto& [key, value] : json.items()) {
    const std::string label = "key " + nlohmann::json(key).dump();  // quoted and escaped: one line
    const std::string where = ::shoal::detail::str_cat("vocabulary ", path, " ", label, ": ");
    SHOAL_CHECK_T(DataError, value.is_number_integer(), where, "the id is not an integer");
    if (key == kEndOfText) continue;
    SHOAL_CHECK_T(DataError, decode_gpt2_key(key, token), where, "not GPT-2's byte characters");
    builder.add(token, value.get<int64_t>(), label);
  }
}

}  // namespace

Gpt2Vocabulary Gpt2Vocabulary::load(const std::string& path) {
  const std::string text = read_vocabulary_file(path);
  Builder builder(path);
  const size_t first = text.find_first_not_of(" \t\r\n");
  if (first != std::string::npos && text[first] == '{') {
    read_encoder_json(path, text, builder);
  } else {
    read_tiktoken_lines(path, text, builder);
  }
  return builder.finish();
}

void Gpt2Vocabulary::index() {
  ranks_.reserve(tokens_.size());
  for (size_t rank = 0; rank < tokens_.size(); ++rank) ranks_.emplace(tokens_[rank], static_cast<int32_t>(rank));
  // Every pair of tokens whose concatenation is a token: each split of each token.
  for (size_t rank = 0; rank < tokens_.size(); ++rank) {
    const std::string_view token = tokens_[rank];
    for (size_t cut = 1; cut < token.size(); ++cut) {
      const int32_t left = this->rank(token.substr(0, cut));
      const int32_t right = this->rank(token.substr(cut));
      if (left < 0 || right < 0) continue;
      pairs_.emplace(uint64_t{static_cast<uint32_t>(left)} << 32 | static_cast<uint32_t>(right),
                     static_cast<int32_t>(rank));
    }
  }
}

int32_t Gpt2Vocabulary::rank(std::string_view bytes) const {
  const auto found = ranks_.find(bytes);
  return found == ranks_.end() ? -1 : found->second;
}

int32_t Gpt2Vocabulary::pair_rank(int32_t left, int32_t right) const {
  const auto found = pairs_.find(uint64_t{static_cast<uint32_t>(left)} << 32 | static_cast<uint32_t>(right));
  return found == pairs_.end() ? -1 : found->second;
}

std::string_view Gpt2Vocabulary::bytes(int64_t id) const {
  if (id == static_cast<int64_t>(tokens_.size())) return kEndOfText;
  SHOAL_CHECK_T(InvalidArgument, id >= 0 && id < static_cast<int64_t>(tokens_.size()), "token id ", id,
                " is not below the vocabulary size ", size());
  return tokens_[static_cast<size_t>(id)];
}

// ---- The encoder ---------------------------------------------------------------------------------

struct Gpt2Encoder::Regex {
  pcre2_code* code = nullptr;
  pcre2_match_data* match = nullptr;
  ~Regex() {
    pcre2_match_data_free(match);
    pcre2_code_free(code);
  }
};

Gpt2Encoder::Gpt2Encoder(const Gpt2Vocabulary& vocabulary, Sink sink)
    : vocabulary_(vocabulary), sink_(std::move(sink)), regex_(std::make_unique<Regex>()) {
  int error = 0;
  PCRE2_SIZE error_offset = 0;
  regex_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(kPattern), PCRE2_ZERO_TERMINATED,
                               PCRE2_UTF | PCRE2_UCP, &error, &error_offset, nullptr);
  SHOAL_CHECK(regex_->code != nullptr, "GPT-2's pre-tokenizer regex does not compile in PCRE2 (error ",
              error, " at ", error_offset, ")");
  // JIT is 3-5x faster where PCRE2 has it; without it the interpreter matches the same.
  pcre2_jit_compile(regex_->code, PCRE2_JIT_COMPLETE | PCRE2_JIT_PARTIAL_HARD);
  regex_->match = pcre2_match_data_create_from_pattern(regex_->code, nullptr);
  SHOAL_CHECK(regex_->match != nullptr, "out of memory for PCRE2's match data");
}

Gpt2Encoder::~Gpt2Encoder() = default;

void Gpt2Encoder::feed(const char* bytes, size_t count, const std::string& source) {
  pending_.append(bytes, count);
  encode_pieces(false, source);
}

void Gpt2Encoder::finish(const std::string& source) { encode_pieces(true, source); }

namespace {

/// The length of the text's prefix that ends on a whole character (the text is UTF-8 apart from
/// a character that may be cut at its end).
size_t whole_characters(const std::string& text) {
  for (size_t back = 1; back <= std::min<size_t>(4, text.size()); ++back) {
    const auto byte = static_cast<unsigned char>(text[text.size() - back]);
    if ((byte & 0xC0) == 0x80) continue;  // a continuation byte
    const size_t length = byte < 0x80 ? 1 : byte < 0xE0 ? 2 : byte < 0xF0 ? 3 : 4;
    return length > back ? text.size() - back : text.size();
  }
  return text.size();
}

/// A piece (or the run still waiting to become one) is held whole: refuse one past the limit.
void check_piece_size(size_t bytes, const std::string& source) {
  SHOAL_CHECK_T(DataError, bytes <= kMaxPieceBytes, "input ", source, ": a run of more than ",
                kMaxPieceBytes, " bytes without a break (letters, digits, spaces or punctuation), which "
                "GPT-2's pre-tokenizer would make one piece; is it text?");
}

}  // namespace

// A match that reached the end of the text so far could still grow (or another alternative win)
// with more text: PCRE2_PARTIAL_HARD reports it as partial, and it waits for the next feed().
// Every match before it is final: it never looked at the end.
void Gpt2Encoder::encode_pieces(bool at_end, const std::string& source) {
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(pending_.data());
  const size_t end = at_end ? pending_.size() : whole_characters(pending_);
  const uint32_t options = PCRE2_NO_UTF_CHECK | (at_end ? 0 : PCRE2_PARTIAL_HARD);
  size_t start = 0;
  while (start < end) {
    const int found = pcre2_match(regex_->code, subject, end, start, options, regex_->match, nullptr);
    if (found == PCRE2_ERROR_PARTIAL || found == PCRE2_ERROR_NOMATCH) break;
    SHOAL_CHECK_T(DataError, found > 0, "input ", source, ": GPT-2's pre-tokenizer failed (PCRE2 error ",
                  found, ")");
    const PCRE2_SIZE* range = pcre2_get_ovector_pointer(regex_->match);
    if (range[1] <= start) break;  // the pattern matches no empty string; never loop on one
    check_piece_size(range[1] - range[0], source);
    encode_piece(std::string_view(pending_.data() + range[0], range[1] - range[0]));
    start = range[1];
  }
  pending_.erase(0, at_end ? pending_.size() : start);
  // What waits may end in a cut character (up to 4 bytes) that belongs to the next piece.
  check_piece_size(pending_.size() > 4 ? pending_.size() - 4 : 0, source);
}

void Gpt2Encoder::encode_piece(std::string_view piece) {
  const int32_t whole = vocabulary_.rank(piece);
  if (whole >= 0) {
    const auto id = static_cast<uint16_t>(whole);
    sink_(&id, 1);
    return;
  }
  if (piece.size() > kMaxCachedPieceBytes) {
    merge(piece, ids_);
    sink_(ids_.data(), ids_.size());
    return;
  }
  std::string key(piece);
  auto cached = cache_.find(key);
  if (cached == cache_.end()) {
    if (cache_.size() >= kMaxCacheEntries) cache_.clear();
    merge(piece, ids_);
    cached = cache_.emplace(std::move(key), ids_).first;
  }
  sink_(cached->second.data(), cached->second.size());
}

namespace {

constexpr int32_t kNoRank = INT32_MAX;

/// tiktoken's merge: the lowest-ranked adjacent pair, leftmost among equals, until none is a token.
void merge_by_scan(const Gpt2Vocabulary& vocabulary, std::vector<int32_t>& parts) {
  const auto pair = [&](size_t i) {
    if (i + 1 >= parts.size()) return kNoRank;
    const int32_t rank = vocabulary.pair_rank(parts[i], parts[i + 1]);
    return rank < 0 ? kNoRank : rank;
  };
  std::vector<int32_t> ranks(parts.size());
  for (size_t i = 0; i < parts.size(); ++i) ranks[i] = pair(i);
  while (parts.size() > 1) {
    const auto lowest = std::min_element(ranks.begin(), ranks.end() - 1);
    if (*lowest == kNoRank) break;
    const auto i = static_cast<size_t>(lowest - ranks.begin());
    parts[i] = *lowest;
    parts.erase(parts.begin() + static_cast<std::ptrdiff_t>(i) + 1);
    ranks.erase(ranks.begin() + static_cast<std::ptrdiff_t>(i) + 1);
    ranks[i] = pair(i);
    if (i > 0) ranks[i - 1] = pair(i - 1);
  }
}

/// The same merges in the same order, the pairs in a heap ordered by (rank, position): a pair is
/// taken only while both its parts are still what they were when it was pushed.
void merge_by_heap(const Gpt2Vocabulary& vocabulary, std::vector<int32_t>& parts) {
  struct Pair {
    int32_t rank;
    int32_t left, right;            // part positions
    int32_t left_id, right_id;      // their tokens when pushed
    bool operator>(const Pair& other) const {
      return rank != other.rank ? rank > other.rank : left > other.left;
    }
  };
  const auto n = static_cast<int32_t>(parts.size());
  std::vector<int32_t> next(parts.size()), previous(parts.size());
  for (int32_t i = 0; i < n; ++i) {
    next[i] = i + 1;
    previous[i] = i - 1;
  }
  std::priority_queue<Pair, std::vector<Pair>, std::greater<>> heap;
  const auto push = [&](int32_t left) {
    if (left < 0 || next[left] >= n) return;
    const int32_t right = next[left];
    const int32_t rank = vocabulary.pair_rank(parts[left], parts[right]);
    if (rank >= 0) heap.push({rank, left, right, parts[left], parts[right]});
  };
  std::vector<bool> alive(parts.size(), true);
  for (int32_t i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    const Pair top = heap.top();
    heap.pop();
    if (!alive[top.left] || next[top.left] != top.right || parts[top.left] != top.left_id ||
        parts[top.right] != top.right_id) {
      continue;  // stale: a part changed since
    }
    parts[top.left] = top.rank;
    alive[top.right] = false;
    next[top.left] = next[top.right];
    if (next[top.left] < n) previous[next[top.left]] = top.left;
    push(previous[top.left]);
    push(top.left);
  }
  size_t kept = 0;
  for (int32_t i = 0; i < n; i = next[i]) parts[kept++] = parts[i];
  parts.resize(kept);
}

}  // namespace

void Gpt2Encoder::merge(std::string_view piece, std::vector<uint16_t>& ids) const {
  std::vector<int32_t> parts(piece.size());
  for (size_t i = 0; i < piece.size(); ++i) parts[i] = vocabulary_.rank(piece.substr(i, 1));
  if (piece.size() <= kMaxScannedPieceBytes) {
    merge_by_scan(vocabulary_, parts);
  } else {
    merge_by_heap(vocabulary_, parts);
  }
  ids.assign(parts.begin(), parts.end());
}

// ---- UTF-8 ---------------------------------------------------------------------------------------

void Utf8Checker::check(const unsigned char* bytes, size_t count, const std::string& source) {
  const auto fail = [&](int64_t at) {
    SHOAL_THROW(DataError, "input ", source, ": byte ", at, " is not UTF-8; GPT-2's BPE encodes UTF-8 "
                "text (convert it, e.g. with iconv, or use --encoding byte)");
  };
  for (size_t i = 0; i < count; ++i, ++offset_) {
    const unsigned char byte = bytes[i];
    if (needed_ > 0) {
      if (byte < lower_ || byte > upper_) fail(char_start_);
      lower_ = 0x80;
      upper_ = 0xBF;
      --needed_;
      continue;
    }
    char_start_ = offset_;
    if (byte < 0x80) continue;
    if (byte < 0xC2 || byte > 0xF4) fail(offset_);
    needed_ = byte < 0xE0 ? 1 : byte < 0xF0 ? 2 : 3;
    lower_ = byte == 0xE0 ? 0xA0 : byte == 0xF0 ? 0x90 : 0x80;   // no overlong forms
    upper_ = byte == 0xED ? 0x9F : byte == 0xF4 ? 0x8F : 0xBF;   // no surrogates, nothing past U+10FFFF
  }
}

void Utf8Checker::finish(const std::string& source) const {
  SHOAL_CHECK_T(DataError, needed_ == 0, "input ", source, ": ends inside a UTF-8 character (at byte ",
                char_start_, "); GPT-2's BPE encodes UTF-8 text");
}

}  // namespace shoal::data::detail
