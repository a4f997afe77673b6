// `shoal generate`: text from a GPT that `shoal train --model gpt` trained, read from one of its
// checkpoints (the weights, and the sizes its config holds), as nanoGPT's sample.py does. Tokens
// are bytes (the prompt's bytes are its ids, and the ids drawn are written to stdout as bytes), or
// with --vocab GPT-2's BPE, which `shoal data tokenize --encoding gpt2` wrote the model's data in.
#include <ATen/CPUGeneratorImpl.h>

#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "commands.h"
#include "data/gpt2_bpe.h"
#include "shoal/checkpoint/checkpoint_manager.h"
#include "shoal/checkpoint/serialization.h"
#include "shoal/checkpoint/training_state.h"
#include "shoal/error.h"
#include "shoal/models/gpt.h"

namespace shoal::cli {
namespace {

struct GenerateArgs {
  std::string checkpoint;
  std::string prompt;
  std::string vocab;  // GPT-2's vocabulary; "" for byte tokens
  models::GenerateOptions sampling;
  uint64_t seed = 0;
};

/// The checkpoint `path` names: a file, or the newest intact one of a checkpoint folder.
checkpoint::TrainingState load_gpt_checkpoint(const std::string& path) {
  if (!std::filesystem::is_directory(path)) return checkpoint::load_training_state(path);
  std::optional<checkpoint::ResumePoint> point = checkpoint::load_latest_intact(path);
  SHOAL_CHECK_T(CheckpointError, point.has_value(), "--checkpoint ", path,
                ": the folder holds no checkpoint; pass one that shoal train --checkpoint-dir "
                "wrote");
  return std::move(point->state);
}

/// The GPT a checkpoint of `shoal train --model gpt` holds, its weights loaded.
std::shared_ptr<models::Gpt> load_gpt(const std::string& path) {
  const checkpoint::TrainingState state = load_gpt_checkpoint(path);
  const std::string model = checkpoint::config_text(state, "model", "unknown");
  SHOAL_CHECK_T(InvalidArgument, model == "gpt", "--checkpoint ", path,
                " holds a checkpoint of model '", model,
                "'; shoal generate samples from --model gpt");
  const auto size = [&](const char* key) {
    const std::optional<int64_t> value = checkpoint::config_integer(state, key, path);
    SHOAL_CHECK_T(CheckpointError, value.has_value(), "--checkpoint ", path, " has no '", key,
                  "' in its config; save it again with this shoal train");
    return *value;
  };
  models::GptConfig config;
  config.n_layer = size("gpt.n_layer");
  config.n_head = size("gpt.n_head");
  config.n_embd = size("gpt.n_embd");
  config.block_size = size("gpt.block_size");
  config.vocab_size = size("gpt.vocab_size");
  auto gpt = std::make_shared<models::Gpt>(config);
  checkpoint::RestoreOptions restore;
  restore.restore_rng = false;
  checkpoint::restore(state, *gpt, nullptr, restore);
  gpt->eval();
  return gpt;
}

/// The prompt's bytes as token ids [1, T].
at::Tensor prompt_ids(const std::string& prompt, int64_t vocab_size) {
  SHOAL_CHECK_T(InvalidArgument, !prompt.empty(), "--prompt is empty; give at least one character");
  at::Tensor ids = at::empty({1, static_cast<int64_t>(prompt.size())}, at::kLong);
  for (size_t i = 0; i < prompt.size(); ++i) {
    const auto byte = static_cast<int64_t>(static_cast<unsigned char>(prompt[i]));
    SHOAL_CHECK_T(InvalidArgument, byte < vocab_size, "--prompt: byte ", byte, " at position ", i,
                  " is beyond the model's vocabulary of ", vocab_size, " tokens");
    ids[0][static_cast<int64_t>(i)] = byte;
  }
  return ids;
}

/// The prompt's GPT-2 tokens as ids [1, T].
at::Tensor prompt_ids(const std::string& prompt, const data::detail::Gpt2Vocabulary& vocabulary,
                      int64_t vocab_size) {
  SHOAL_CHECK_T(InvalidArgument, !prompt.empty(), "--prompt is empty; give at least one character");
  data::detail::Utf8Checker utf8;
  utf8.check(reinterpret_cast<const unsigned char*>(prompt.data()), prompt.size(), "--prompt");
  utf8.finish("--prompt");
  std::vector<int64_t> ids;
  data::detail::Gpt2Encoder encoder(vocabulary, [&ids](const uint16_t* piece, size_t count) {
    ids.insert(ids.end(), piece, piece + count);
  });
  encoder.feed(prompt.data(), prompt.size(), "--prompt");
  encoder.finish("--prompt");
  for (const int64_t id : ids) {
    SHOAL_CHECK_T(InvalidArgument, id < vocab_size, "--prompt: token ", id, " of --vocab is beyond the "
                  "model's vocabulary of ", vocab_size, " tokens; was the model trained on --encoding gpt2 tokens?");
  }
  return torch::tensor(ids, at::kLong).unsqueeze(0);
}

int run_generate(const GenerateArgs& args) {
  const std::shared_ptr<models::Gpt> gpt = load_gpt(args.checkpoint);
  const int64_t vocab_size = gpt->config().vocab_size;
  std::optional<data::detail::Gpt2Vocabulary> vocabulary;
  if (!args.vocab.empty()) vocabulary = data::detail::Gpt2Vocabulary::load(args.vocab);
  SHOAL_CHECK_T(InvalidArgument, vocabulary || vocab_size <= 256, "--checkpoint ", args.checkpoint,
                ": the model has ", vocab_size, " tokens; without --vocab (GPT-2's, for a model "
                "trained on --encoding gpt2 tokens) shoal generate writes tokens as bytes (at most 256)");
  SHOAL_CHECK_T(InvalidArgument, !vocabulary || vocab_size <= vocabulary->size(), "--checkpoint ",
                args.checkpoint, ": the model has ", vocab_size, " tokens, --vocab ", args.vocab, " only ",
                vocabulary->size());
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(args.seed);
  const at::Tensor prompt = vocabulary ? prompt_ids(args.prompt, *vocabulary, vocab_size)
                                        : prompt_ids(args.prompt, vocab_size);
  const at::Tensor tokens = gpt->generate(prompt, args.sampling, generator);
  std::string text;
  for (int64_t i = 0; i < tokens.size(1); ++i) {
    const int64_t id = tokens[0][i].item<int64_t>();
    if (vocabulary) {
      text += vocabulary->bytes(id);
    } else {
      text.push_back(static_cast<char>(id));
    }
  }
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
  return 0;
}

}  // namespace

void add_generate_command(CLI::App& root, std::vector<Command>& commands) {
  auto args = std::make_shared<GenerateArgs>();
  auto* app = root.add_subcommand(
      "generate",
      "Sample text from a GPT trained by shoal train --model gpt: the prompt, then\n"
      "--max-new-tokens tokens drawn one at a time, written to stdout (byte-level tokens as\n"
      "bytes; with --vocab, GPT-2's tokens as their text)");
  app->add_option("--checkpoint", args->checkpoint,
                  "A checkpoint of shoal train --model gpt, or its --checkpoint-dir (the newest)")
      ->required()
      ->type_name("PATH");
  app->add_option("--prompt", args->prompt,
                  "The text the sample continues (its bytes are the ids; with --vocab, its GPT-2 tokens)")
      ->required();
  app->add_option("--vocab", args->vocab,
                  "GPT-2's vocabulary (gpt2.tiktoken) for a model trained on `shoal data tokenize "
                  "--encoding gpt2` tokens: the prompt is encoded, the tokens decoded with it")
      ->type_name("FILE");
  app->add_option("--max-new-tokens", args->sampling.max_new_tokens, "Tokens to draw")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20))
      ->capture_default_str();
  app->add_option("--temperature", args->sampling.temperature,
                  "Divides the logits before sampling (> 0; lower: more likely tokens)")
      ->capture_default_str();
  app->add_option("--top-k", args->sampling.top_k,
                  "Draw from the K most likely tokens only (1: greedy; 0: all)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 24))
      ->capture_default_str();
  app->add_option("--seed", args->seed, "Seeds the sampling: the same seed, the same text")
      ->capture_default_str();
  commands.push_back({app, [args] { return run_generate(*args); }});
}

}  // namespace shoal::cli
