// `shoal data tokenize` writes token files (nanoGPT's train.bin / val.bin format) from text;
// `shoal data inspect` checks one and says what it holds: tokens, largest id, blocks.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "commands.h"
#include "shoal/data/token_block_dataset.h"
#include "shoal/data/token_file.h"
#include "shoal/data/tokenize.h"

namespace shoal::cli {
namespace {

int tokenize(const data::TokenizeOptions& options) {
  const data::TokenizeSummary summary = data::tokenize_text(options);
  std::printf("%s: %lld tokens (uint16, %s encoding, vocabulary %lld)\n", options.output.c_str(),
              static_cast<long long>(summary.train_tokens), options.encoding.c_str(),
              static_cast<long long>(summary.vocab_size));
  if (!options.val_output.empty()) {
    std::printf("%s: %lld tokens\n", options.val_output.c_str(), static_cast<long long>(summary.val_tokens));
  }
  return 0;
}

struct InspectOptions {
  std::string file;
  std::string dtype = "uint16";
  int64_t vocab_size = 0;
  int64_t block_size = 0;
};

int inspect(const InspectOptions& options) {
  data::TokenFileOptions file_options;
  file_options.dtype = data::parse_token_dtype(options.dtype);
  file_options.vocab_size = options.vocab_size;
  file_options.sequential = true;  // one pass over the whole file
  const data::TokenFile tokens(options.file, file_options);
  const int64_t largest = tokens.check_vocab();
  std::printf("%s: %lld tokens (%s), largest id %lld\n", options.file.c_str(),
              static_cast<long long>(tokens.size()), options.dtype.c_str(), static_cast<long long>(largest));
  if (options.block_size > 0) {
    std::printf("blocks of %lld (+1 target): %lld\n", static_cast<long long>(options.block_size),
                static_cast<long long>(data::TokenBlockDataset::block_count(tokens.size(), options.block_size)));
  }
  return 0;
}

}  // namespace

void add_data_command(CLI::App& root, std::vector<Command>& commands) {
  auto* app = root.add_subcommand("data", "Prepare and check datasets (token files for language models)");
  app->require_subcommand(1);

  auto tokenize_options = std::make_shared<data::TokenizeOptions>();
  auto* tokenize_app = app->add_subcommand(
      "tokenize", "Write text as a flat file of uint16 token ids (nanoGPT's train.bin/val.bin)");
  tokenize_app->add_option("--input", tokenize_options->inputs,
                           "text file(s), read in order as one text (repeat the flag for several)")
      ->required();
  tokenize_app->add_option("--output", tokenize_options->output, "the training token file to write")
      ->required();
  auto* val_output = tokenize_app->add_option(
      "--val-output", tokenize_options->val_output,
      "also write a validation token file from the end of the text (see --val-fraction)");
  tokenize_app->add_option("--val-fraction", tokenize_options->val_fraction,
                           "the share of the text, taken from its end, in --val-output (default 0.1)")
      ->check(CLI::Range(0.0, 1.0))
      ->needs(val_output);
  tokenize_app->add_option("--encoding", tokenize_options->encoding,
                           "byte: one token per byte, vocabulary 256 (default). gpt2: GPT-2's BPE "
                           "(tiktoken's ids; UTF-8 text) with --vocab; train on it with --vocab-size 50257")
      ->check(CLI::IsMember({"byte", "gpt2"}));
  tokenize_app->add_option("--vocab", tokenize_options->vocab,
                           "GPT-2's vocabulary for --encoding gpt2: tiktoken's gpt2.tiktoken (from "
                           "openai-whisper; scripts/setup.sh puts it in ~/.cache/shoal) or GPT-2's "
                           "encoder.json (Hugging Face's vocab.json)");
  commands.push_back({tokenize_app, [tokenize_options] { return tokenize(*tokenize_options); }});

  auto inspect_options = std::make_shared<InspectOptions>();
  auto* inspect_app = app->add_subcommand(
      "inspect", "Check a token file whole (size, dtype, ids below --vocab-size) and count its tokens");
  inspect_app->add_option("FILE", inspect_options->file, "the token file")->required();
  inspect_app->add_option("--dtype", inspect_options->dtype, "uint16 (default) or uint32")
      ->check(CLI::IsMember({"uint16", "uint32"}));
  inspect_app->add_option("--vocab-size", inspect_options->vocab_size,
                          "refuse ids at or above this (default 0: no bound)")
      ->check(CLI::NonNegativeNumber);
  inspect_app->add_option("--block-size", inspect_options->block_size,
                          "also count the non-overlapping blocks of this many tokens a model trains on")
      ->check(CLI::NonNegativeNumber);
  commands.push_back({inspect_app, [inspect_options] { return inspect(*inspect_options); }});
}

}  // namespace shoal::cli
