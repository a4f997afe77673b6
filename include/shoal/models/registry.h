// Built-in models by name ("cnn", "mlp", "transformer", "gpt"), for the CLI, tests and benchmarks.
//
// Thread safety: list_models() may be called from any thread. create() re-seeds LibTorch's global
// CPU generator while it builds the model (and restores its state afterwards), so it must not run
// concurrently with anything else that draws random numbers from that generator.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "shoal/models/gpt_config.h"
#include "shoal/models/model.h"

namespace shoal::models {

/// A new model `name`, its parameters initialised exactly as LibTorch (and PyTorch) initialise
/// them right after manual_seed(seed). Throws shoal::InvalidArgument for an unknown name; the
/// message lists the known ones.
std::shared_ptr<Model> create(const std::string& name, uint64_t seed = 0);
/// A name that is a path (models::is_script_path: ends in .pt, .pth, .ts, or holds a '/') loads
/// that TorchScript file as a ScriptModel instead (its own weights; seed and shape do not apply).
/// The same for samples of `shape` (e.g. CIFAR-10's 3 x 32 x 32); create(name, seed) builds the
/// Fashion-MNIST shape.
std::shared_ptr<Model> create(const std::string& name, uint64_t seed, const InputShape& shape);

/// What create() builds a model for: the samples of an image classifier, the GPT's sizes.
struct ModelOptions {
  InputShape shape;
  GptConfig gpt;
};

/// The same, with every model's options ("gpt" takes options.gpt, the others options.shape).
std::shared_ptr<Model> create(const std::string& name, uint64_t seed, const ModelOptions& options);

/// True when model `name` is built for the data's sample shape (the image classifiers), so that it
/// is made after the data is read; false for the GPT and TorchScript files (and unknown names).
bool needs_input_shape(const std::string& name);

/// The names create() accepts, sorted.
std::vector<std::string> list_models();

}  // namespace shoal::models
