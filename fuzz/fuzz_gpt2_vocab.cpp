// libFuzzer target: GPT-2's vocabulary reader (a tiktoken BPE file or an encoder.json; load()
// picks the format from the first non-space byte) on arbitrary bytes. A vocabulary that loads
// then encodes a fixed text and the input's own text (when it is UTF-8), so that the
// pre-tokenizer and both merge loops run on hostile ranks, and the ids must decode back to the
// text exactly. Every input must end in a vocabulary or a DataError.
//
// Few mutated files load (every byte must stay a token, every rank dense), so each input also
// becomes a vocabulary that does: its lines as tokens, the 256 bytes placed among them at a rank
// its first byte picks, written as a tiktoken file. Its merges run in whatever order the input
// ranks them, parts after the tokens they make included.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

#include "data/gpt2_bpe.h"
#include "shoal/error.h"

namespace {

using shoal::data::detail::Gpt2Encoder;
using shoal::data::detail::Gpt2Vocabulary;
using shoal::data::detail::Utf8Checker;

// Words, numbers, contractions, runs of spaces and punctuation, and a letter run past the merge
// loop's scanned length (128 bytes), which takes the heap merge.
const std::string kText =
    "Hello, world! It's 2019 and they're   here.\n\tthe the  the?? \xC3\xA9t\xC3\xA9 \xE4\xB8\xAD "
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";

bool is_utf8(const std::string& text) {
  try {
    Utf8Checker checker;
    checker.check(reinterpret_cast<const unsigned char*>(text.data()), text.size(), "fuzz");
    checker.finish("fuzz");
    return true;
  } catch (const shoal::DataError&) {
    return false;
  }
}

/// tiktoken's merge as it defines it, on byte strings: the adjacent pair whose concatenation has
/// the lowest rank, leftmost among equals, until none is a token.
std::vector<uint16_t> reference_merge(const Gpt2Vocabulary& vocabulary, const std::string& piece) {
  if (vocabulary.rank(piece) >= 0) return {static_cast<uint16_t>(vocabulary.rank(piece))};
  std::vector<std::string> parts;
  for (const char c : piece) parts.emplace_back(1, c);
  for (;;) {
    int32_t best = -1;
    size_t at = 0;
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      const int32_t rank = vocabulary.rank(parts[i] + parts[i + 1]);
      if (rank >= 0 && (best < 0 || rank < best)) {
        best = rank;
        at = i;
      }
    }
    if (best < 0) break;
    parts[at] += parts[at + 1];
    parts.erase(parts.begin() + static_cast<std::ptrdiff_t>(at) + 1);
  }
  std::vector<uint16_t> ids;
  for (const auto& part : parts) ids.push_back(static_cast<uint16_t>(vocabulary.rank(part)));
  return ids;
}

/// A space and the input's lowercase letters (up to 600) are one pre-token piece, long enough
/// for the heap merge: its ids must be the reference merge's.
void check_merge(const Gpt2Vocabulary& vocabulary, std::string_view input) {
  std::string piece = " ";
  for (const char c : input) {
    if (c >= 'a' && c <= 'z' && piece.size() < 601) piece.push_back(c);
  }
  std::vector<uint16_t> ids;
  Gpt2Encoder encoder(vocabulary, [&](const uint16_t* got, size_t count) { ids.insert(ids.end(), got, got + count); });
  encoder.feed(piece.data(), piece.size(), "fuzz");
  encoder.finish("fuzz");
  if (ids != reference_merge(vocabulary, piece)) {
    std::fprintf(stderr, "the %zu-byte piece merges unlike tiktoken's definition\n", piece.size());
    std::abort();
  }
}

/// Encodes `text` fed in two parts (a character may be cut between them) and checks the ids
/// are in the vocabulary and decode to the text.
void round_trip(const Gpt2Vocabulary& vocabulary, const std::string& text) {
  std::string decoded;
  Gpt2Encoder encoder(vocabulary, [&](const uint16_t* ids, size_t count) {
    for (size_t i = 0; i < count; ++i) {
      if (ids[i] >= vocabulary.size() - 1) {
        std::fprintf(stderr, "id %u is not a rank of the vocabulary (size %lld)\n", ids[i],
                     static_cast<long long>(vocabulary.size()));
        std::abort();
      }
      decoded.append(vocabulary.bytes(ids[i]));
    }
  });
  const size_t half = text.size() / 2;
  encoder.feed(text.data(), half, "fuzz");
  encoder.feed(text.data() + half, text.size() - half, "fuzz");
  encoder.finish("fuzz");
  if (decoded != text) {
    std::fprintf(stderr, "%zu bytes of text decode to %zu other bytes\n", text.size(), decoded.size());
    std::abort();
  }
}

std::string base64(std::string_view bytes) {
  static const char kDigits[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  for (size_t i = 0; i < bytes.size(); i += 3) {
    uint32_t bits = static_cast<uint32_t>(static_cast<uint8_t>(bytes[i])) << 16;
    if (i + 1 < bytes.size()) bits |= static_cast<uint32_t>(static_cast<uint8_t>(bytes[i + 1])) << 8;
    if (i + 2 < bytes.size()) bits |= static_cast<uint8_t>(bytes[i + 2]);
    for (size_t k = 0; k < 4; ++k) out.push_back(i + k <= bytes.size() ? kDigits[(bits >> (18 - 6 * k)) & 0x3F] : '=');
  }
  return out;
}

/// A tiktoken file that loads: the input's distinct lines of 2 to 256 bytes as tokens, with the
/// 256 single bytes inserted among them at a position the first byte picks.
std::string vocabulary_of_lines(std::string_view input) {
  std::vector<std::string_view> tokens;
  std::unordered_set<std::string_view> seen;
  for (size_t start = 0; start < input.size() && tokens.size() < 4096;) {
    const size_t end = std::min(input.find('\n', start), input.size());
    const std::string_view line = input.substr(start, end - start);
    start = end + 1;
    if (line.size() >= 2 && line.size() <= 256 && seen.insert(line).second) tokens.push_back(line);
  }
  static const std::string kBytes = [] {
    std::string bytes;
    for (int byte = 0; byte < 256; ++byte) bytes.push_back(static_cast<char>(byte));
    return bytes;
  }();
  const size_t at = input.empty() ? 0 : static_cast<uint8_t>(input[0]) * tokens.size() / 256;
  for (int byte = 0; byte < 256; ++byte) {
    tokens.insert(tokens.begin() + static_cast<std::ptrdiff_t>(at) + byte, std::string_view(&kBytes[byte], 1));
  }
  std::string file;
  for (size_t rank = 0; rank < tokens.size(); ++rank) file += base64(tokens[rank]) + " " + std::to_string(rank) + "\n";
  return file;
}

/// Loads `file` (from a memfd named `fd`) and encodes with what loads.
void load_and_encode(int fd, const std::string& path, std::string_view file, std::string_view input) {
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, file.data(), file.size(), 0) != static_cast<ssize_t>(file.size())) {
    return;
  }
  try {
    const Gpt2Vocabulary vocabulary = Gpt2Vocabulary::load(path);
    round_trip(vocabulary, kText);
    // The input's first 4 KiB as text: what the mutator writes reaches the merge loop.
    const std::string slice(input.substr(0, 4096));
    if (is_utf8(slice)) round_trip(vocabulary, slice);
    check_merge(vocabulary, input);
  } catch (const shoal::DataError&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const int fd = ::memfd_create("vocabulary", 0);
  static const std::string path = "/proc/self/fd/" + std::to_string(fd);
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  load_and_encode(fd, path, input, input);
  load_and_encode(fd, path, vocabulary_of_lines(input), input);
  return 0;
}
