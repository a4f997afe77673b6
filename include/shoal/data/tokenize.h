// Text to token files (TokenFile's format): `shoal data tokenize`, and the C++ call behind it.
// Byte-level encoding: each byte of the text is one token (vocabulary 256), written as uint16
// little-endian, as nanoGPT's character-level preparation writes train.bin and val.bin.
// GPT-2's encoding: GPT-2's byte-level BPE, the ids tiktoken's "gpt2" encoding gives (text encoded
// as ordinary text: "<|endoftext|>" in it is not the special token), as uint16 as nanoGPT's
// prepare.py writes; each input must be UTF-8 (invalid bytes are refused, naming the file and
// offset, so that the ids decode to the text's exact bytes). The vocabulary is then 50257: the
// file's 50256 ranks and <|endoftext|>.
// The inputs are read in order as one text and streamed, so a text larger than memory tokenizes
// in a buffer's worth of memory; with a validation output, the text's last val_fraction goes there (the
// first floor(n * (1 - val_fraction)) tokens train, the rest validate, as nanoGPT splits; with
// GPT-2's BPE the text is cut at byte floor(n * (1 - val_fraction)), moved on to a character's
// start, and each side encoded on its own, as nanoGPT's shakespeare prepare.py does).
// Each output is written atomically: a failure leaves no partial file, and any previous one as it
// was.
//
// Thread safety: tokenize_text() shares nothing between calls.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shoal::data {

struct TokenizeOptions {
  /// Text files, read in this order as one text.
  std::vector<std::string> inputs;
  /// The training token file.
  std::string output;
  /// The validation token file; "" writes the whole text to `output`.
  std::string val_output;
  /// The share of the text (its end) that goes to `val_output`, in (0, 1).
  double val_fraction = 0.1;
  /// "byte" (vocabulary 256) or "gpt2" (GPT-2's BPE, vocabulary 50257 with `vocab`'s file).
  std::string encoding = "byte";
  /// For "gpt2": GPT-2's vocabulary in tiktoken's format (`base64(token) rank` per line, as
  /// openai-whisper's whisper/assets/gpt2.tiktoken), or GPT-2's encoder.json.
  std::string vocab;
};

struct TokenizeSummary {
  int64_t train_tokens = 0;
  int64_t val_tokens = 0;
  /// Token ids are below this.
  int64_t vocab_size = 0;
};

/// Writes the token files. Throws InvalidArgument for options that cannot work (naming the
/// option) and DataError naming the file for an input that cannot be read or is empty.
TokenizeSummary tokenize_text(const TokenizeOptions& options);

}  // namespace shoal::data
