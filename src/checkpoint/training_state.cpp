#include "shoal/checkpoint/training_state.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "shoal/checkpoint/serialization.h"
#include "shoal/error.h"

namespace shoal::checkpoint {
namespace {

// Shoal's version, saved in every checkpoint so that later versions can tell old layouts apart.
constexpr const char* kVersion = "0.1.0";

using c10::impl::GenericDict;

GenericDict string_dict() { return GenericDict(c10::StringType::get(), c10::AnyType::get()); }

/// The value under `key` in a dict with string keys, or None.
c10::IValue lookup(const GenericDict& dict, const char* key) {
  auto it = dict.find(c10::IValue(std::string(key)));
  return it == dict.end() ? c10::IValue() : it->value();
}

int64_t as_int(const c10::IValue& value, const std::string& what, const std::string& where) {
  if (value.isInt()) return value.toInt();
  if (value.isDouble()) return static_cast<int64_t>(value.toDouble());
  if (value.isTensor() && value.toTensor().numel() == 1) {
    return static_cast<int64_t>(value.toTensor().item<double>());
  }
  SHOAL_THROW(CheckpointError, where, ": '", what, "' is not an integer");
}

/// The shortest text that reads back as `value` (std::to_string would print 1e-7 as "0.000000").
std::string shortest_text(double value) {
  char text[32];
  for (int digits = 6; digits <= 17; ++digits) {
    std::snprintf(text, sizeof(text), "%.*g", digits, value);
    if (std::strtod(text, nullptr) == value) break;
  }
  return text;
}

std::string to_config_string(const c10::IValue& value) {
  if (value.isString()) return value.toStringRef();
  if (value.isInt()) return std::to_string(value.toInt());
  if (value.isDouble()) return shortest_text(value.toDouble());
  if (value.isBool()) return value.toBool() ? "true" : "false";
  if (value.isNone()) return "";
  std::ostringstream out;
  out << value;
  return out.str();
}

c10::IValue optimizer_to_ivalue(const OptimizerState& optimizer) {
  GenericDict state(c10::IntType::get(), c10::AnyType::get());
  for (const auto& [index, buffers] : optimizer.state) {
    GenericDict entry = string_dict();
    for (const auto& [name, tensor] : buffers) entry.insert(name, tensor);
    state.insert(index, entry);
  }
  c10::impl::GenericList groups(c10::AnyType::get());
  for (const auto& group : optimizer.param_groups) {
    GenericDict entry = string_dict();
    for (const auto& [name, value] : group.options) entry.insert(name, value);
    c10::impl::GenericList params(c10::AnyType::get());
    for (int64_t p : group.params) params.push_back(p);
    entry.insert("params", params);
    groups.push_back(entry);
  }
  GenericDict out = string_dict();
  out.insert("state", state);
  out.insert("param_groups", groups);
  return out;
}

OptimizerState optimizer_from_ivalue(const c10::IValue& value, const std::string& where) {
  SHOAL_CHECK_T(CheckpointError, value.isGenericDict(), where,
                ": the optimizer state is not a dict like optimizer.state_dict()");
  const auto dict = value.toGenericDict();
  OptimizerState out;
  const c10::IValue state = lookup(dict, "state");
  const c10::IValue groups = lookup(dict, "param_groups");
  SHOAL_CHECK_T(CheckpointError, state.isGenericDict() && groups.isList(), where,
                ": the optimizer state lacks 'state' or 'param_groups'");
  for (const auto& entry : state.toGenericDict()) {
    SHOAL_CHECK_T(CheckpointError, entry.key().isInt() && entry.value().isGenericDict(), where,
                  ": optimizer 'state' must map parameter indices to dicts");
    auto& buffers = out.state[entry.key().toInt()];
    for (const auto& item : entry.value().toGenericDict()) {
      SHOAL_CHECK_T(CheckpointError, item.key().isString(), where,
                    ": optimizer state names must be strings");
      const std::string& name = item.key().toStringRef();
      const c10::IValue& v = item.value();
      if (v.isTensor()) {
        buffers[name] = v.toTensor();
      } else if (v.isInt() || v.isDouble()) {
        // Older PyTorch saved Adam's step as a Python number; keep it as a 0-dim tensor.
        buffers[name] = at::scalar_tensor(v.isInt() ? static_cast<double>(v.toInt()) : v.toDouble(),
                                          at::kFloat);
      }
    }
  }
  for (const auto& g : groups.toListRef()) {
    SHOAL_CHECK_T(CheckpointError, g.isGenericDict(), where, ": a param group is not a dict");
    ParamGroupState group;
    for (const auto& item : g.toGenericDict()) {
      SHOAL_CHECK_T(CheckpointError, item.key().isString(), where,
                    ": param group option names must be strings");
      if (item.key().toStringRef() == "params") {
        SHOAL_CHECK_T(CheckpointError, item.value().isList(), where,
                      ": a param group's 'params' is not a list");
        for (const auto& p : item.value().toListRef()) {
          group.params.push_back(as_int(p, "params", where));
        }
      } else {
        group.options[item.key().toStringRef()] = item.value();
      }
    }
    out.param_groups.push_back(std::move(group));
  }
  return out;
}

}  // namespace

const char* version() { return kVersion; }

std::optional<double> config_number(const TrainingState& state, const std::string& key,
                                    const std::string& where) {
  const auto found = state.config.find(key);
  if (found == state.config.end()) return std::nullopt;
  const c10::IValue& value = found->second;
  double number = NAN;
  if (value.isInt()) {
    number = static_cast<double>(value.toInt());
  } else if (value.isDouble()) {
    number = value.toDouble();
  } else if (value.isString()) {
    const std::string& text = value.toStringRef();
    char* end = nullptr;
    number = std::strtod(text.c_str(), &end);
    if (end == text.c_str() || *end != '\0') number = NAN;
  }
  SHOAL_CHECK_T(CheckpointError, std::isfinite(number), where, " has config ", key, " = ",
                to_config_string(value), ", which is not a number");
  return number;
}

std::optional<int64_t> config_integer(const TrainingState& state, const std::string& key,
                                      const std::string& where) {
  const auto found = state.config.find(key);
  if (found == state.config.end()) return std::nullopt;
  const c10::IValue& value = found->second;
  if (value.isInt()) return value.toInt();
  if (value.isString()) {
    const std::string& text = value.toStringRef();
    char* end = nullptr;
    errno = 0;
    // Seeds were saved as unsigned text: above 2^63 they wrap, as they do in the int64 saved now.
    const bool negative = !text.empty() && text[0] == '-';
    const int64_t parsed = negative ? std::strtoll(text.c_str(), &end, 10)
                                    : static_cast<int64_t>(std::strtoull(text.c_str(), &end, 10));
    if (end != text.c_str() && *end == '\0' && errno == 0) return parsed;
  }
  const std::optional<double> number = config_number(state, key, where);
  SHOAL_CHECK_T(CheckpointError, *number == std::floor(*number) && std::fabs(*number) < 9.2e18,
                where, " has config ", key, " = ", to_config_string(value),
                ", which is not an integer");
  return static_cast<int64_t>(*number);
}

std::string config_text(const TrainingState& state, const std::string& key,
                        const std::string& fallback) {
  const auto found = state.config.find(key);
  return found == state.config.end() ? fallback : to_config_string(found->second);
}

c10::IValue to_ivalue(const TrainingState& state) {
  GenericDict out = string_dict();
  out.insert("model", state_dict_to_ivalue(state.model));
  if (!state.optimizer.empty()) out.insert("optimizer", optimizer_to_ivalue(state.optimizer));
  out.insert("epoch", state.epoch);
  out.insert("step", state.step);
  if (state.rng_state.defined()) out.insert("rng_state", state.rng_state);
  GenericDict sampler = string_dict();
  sampler.insert("epoch", state.sampler.epoch);
  sampler.insert("samples_seen", state.sampler.samples_seen);
  sampler.insert("seed", state.sampler.seed);
  out.insert("sampler", sampler);
  GenericDict config = string_dict();
  for (const auto& [key, value] : state.config) config.insert(key, value);  // int, float, str
  out.insert("config", config);
  out.insert("world_size", state.world_size);
  out.insert("shoal_version", state.shoal_version.empty() ? std::string(kVersion) : state.shoal_version);
  return out;
}

TrainingState training_state_from_ivalue(const c10::IValue& object, const std::string& where) {
  TrainingState out;
  SHOAL_CHECK_T(CheckpointError, object.isGenericDict(), where,
                ": holds a ", object.tagKind(), ", not a checkpoint dict or a state dict");
  const auto dict = object.toGenericDict();
  if (auto meta = lookup(dict, "shoal_sharded"); meta.isGenericDict()) {
    const auto rank = lookup(meta.toGenericDict(), "rank");
    const auto world = lookup(meta.toGenericDict(), "world_size");
    SHOAL_THROW(CheckpointError, where, ": is one rank's file (rank ", rank.isInt() ? rank.toInt() : -1,
                " of ", world.isInt() ? world.toInt() : -1,
                ") of a sharded checkpoint, a piece of the model: pass its folder instead (shoal "
                "ckpt convert FOLDER OUT.pt writes the whole checkpoint)");
  }
  c10::IValue model;
  for (const char* key : {"model", "model_state_dict", "state_dict"}) {
    model = lookup(dict, key);
    if (!model.isNone()) break;
  }
  if (model.isNone()) {
    // A bare state dict (torch.save(model.state_dict(), f)).
    out.model = state_dict_from_ivalue(object, where);
    return out;
  }
  out.model = state_dict_from_ivalue(model, where);
  for (const char* key : {"optimizer", "optimizer_state_dict"}) {
    const c10::IValue optimizer = lookup(dict, key);
    if (!optimizer.isNone()) {
      out.optimizer = optimizer_from_ivalue(optimizer, where);
      break;
    }
  }
  if (auto v = lookup(dict, "epoch"); !v.isNone()) out.epoch = as_int(v, "epoch", where);
  if (auto v = lookup(dict, "step"); !v.isNone()) out.step = as_int(v, "step", where);
  if (auto v = lookup(dict, "world_size"); !v.isNone()) out.world_size = as_int(v, "world_size", where);
  if (auto v = lookup(dict, "rng_state"); v.isTensor()) out.rng_state = v.toTensor().cpu();
  if (auto v = lookup(dict, "sampler"); v.isGenericDict()) {
    const auto sampler = v.toGenericDict();
    if (auto e = lookup(sampler, "epoch"); !e.isNone()) out.sampler.epoch = as_int(e, "sampler.epoch", where);
    if (auto s = lookup(sampler, "samples_seen"); !s.isNone()) {
      out.sampler.samples_seen = as_int(s, "sampler.samples_seen", where);
    }
    if (auto s = lookup(sampler, "seed"); !s.isNone()) out.sampler.seed = as_int(s, "sampler.seed", where);
  }
  if (auto v = lookup(dict, "config"); v.isGenericDict()) {
    // Kept as they are: numbers (this version), strings (older ones; config_number reads both).
    for (const auto& item : v.toGenericDict()) {
      const c10::IValue& value = item.value();
      const bool plain = value.isString() || value.isInt() || value.isDouble() || value.isBool();
      out.config[to_config_string(item.key())] = plain ? value : c10::IValue(to_config_string(value));
    }
  }
  if (auto v = lookup(dict, "shoal_version"); v.isString()) out.shoal_version = v.toStringRef();
  return out;
}

}  // namespace shoal::checkpoint
