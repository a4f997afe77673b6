#include "shoal/models/registry.h"

#include <ATen/CPUGeneratorImpl.h>

#include <functional>
#include <map>

#include "shoal/error.h"
#include "shoal/models/cnn.h"
#include "shoal/models/gpt.h"
#include "shoal/models/mlp.h"
#include "shoal/models/script_model.h"
#include "shoal/models/transformer.h"

namespace shoal::models {
namespace {

using Factory = std::function<std::shared_ptr<Model>(const ModelOptions&)>;

struct Entry {
  Factory make;
  bool needs_input_shape = true;
};

const std::map<std::string, Entry>& factories() {
  static const std::map<std::string, Entry> kFactories = {
      {"cnn", {[](const ModelOptions& o) { return std::make_shared<Cnn>(o.shape); }}},
      {"gpt", {[](const ModelOptions& o) { return std::make_shared<Gpt>(o.gpt); }, false}},
      {"mlp", {[](const ModelOptions& o) { return std::make_shared<Mlp>(o.shape); }}},
      {"transformer",
       {[](const ModelOptions& o) { return std::make_shared<Transformer>(o.shape); }}},
  };
  return kFactories;
}

// Seeds the global CPU generator for the lifetime of the guard and puts its state back after:
// LibTorch's modules initialise their parameters from that generator, and create() should not
// change what the caller's own code draws next.
class SeedGuard {
 public:
  explicit SeedGuard(uint64_t seed) : generator_(at::detail::getDefaultCPUGenerator()) {
    std::lock_guard<std::mutex> lock(generator_.mutex());
    saved_ = generator_.get_state();
    generator_.set_current_seed(seed);
  }
  ~SeedGuard() {
    std::lock_guard<std::mutex> lock(generator_.mutex());
    generator_.set_state(saved_);
  }
  SeedGuard(const SeedGuard&) = delete;
  SeedGuard& operator=(const SeedGuard&) = delete;

 private:
  at::Generator generator_;
  at::Tensor saved_;
};

}  // namespace

std::shared_ptr<Model> create(const std::string& name, uint64_t seed) {
  return create(name, seed, InputShape{});
}

std::shared_ptr<Model> create(const std::string& name, uint64_t seed, const InputShape& shape) {
  ModelOptions options;
  options.shape = shape;
  return create(name, seed, options);
}

bool needs_input_shape(const std::string& name) {
  if (is_script_path(name)) return false;
  const auto it = factories().find(name);
  return it != factories().end() && it->second.needs_input_shape;
}

std::shared_ptr<Model> create(const std::string& name, uint64_t seed, const ModelOptions& options) {
  // A TorchScript file: its weights are the file's (seed and shape do not apply).
  if (is_script_path(name)) return ScriptModel::load(name);
  const auto& known = factories();
  const auto it = known.find(name);
  if (it == known.end()) {
    std::string names;
    for (const auto& entry : known) names += (names.empty() ? "" : ", ") + entry.first;
    SHOAL_THROW(InvalidArgument, "unknown model '", name, "'; known models: ", names,
                ", or a TorchScript file (path/to/model.pt)");
  }
  SeedGuard guard(seed);
  return it->second.make(options);
}

std::vector<std::string> list_models() {
  std::vector<std::string> names;
  for (const auto& entry : factories()) names.push_back(entry.first);
  return names;
}

}  // namespace shoal::models
