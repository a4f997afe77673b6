// libFuzzer target: GPT-2's vocabulary reader (a tiktoken BPE file or an encoder.json; load()
// picks the format from the first non-space byte) on arbitrary bytes. A vocabulary that loads
// then encodes a fixed text and the input's own text (when it is UTF-8), so that the
// pre-tokenizer and both merge loops run on hostile ranks, and the ids must decode back to the
// text exactly. Every input must end in a vocabulary or a DataError.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

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

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const int fd = ::memfd_create("vocabulary", 0);
  static const std::string path = "/proc/self/fd/" + std::to_string(fd);
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, data, size, 0) != static_cast<ssize_t>(size)) return 0;
  try {
    const Gpt2Vocabulary vocabulary = Gpt2Vocabulary::load(path);
    round_trip(vocabulary, kText);
    // The input's first 4 KiB as text: what the mutator writes reaches the merge loop.
    const std::string slice(reinterpret_cast<const char*>(data), std::min<size_t>(size, 4096));
    if (is_utf8(slice)) round_trip(vocabulary, slice);
  } catch (const shoal::DataError&) {
  }
  return 0;
}
