#include "shoal/checkpoint/state_dict.h"

#include <set>
#include <sstream>

#include "shoal/error.h"
#include "shoal/log.h"

namespace shoal::checkpoint {
namespace {

std::string shape_string(c10::IntArrayRef sizes) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < sizes.size(); ++i) out << (i ? ", " : "") << sizes[i];
  out << "]";
  return out.str();
}

std::string quoted_list(const std::vector<std::string>& keys) {
  std::string out;
  for (size_t i = 0; i < keys.size(); ++i) out += (i ? ", \"" : "\"") + keys[i] + "\"";
  return out;
}

enum class DtypeKind { kBool, kInteger, kFloating, kComplex, kOther };

DtypeKind kind_of(c10::ScalarType type) {
  if (type == c10::ScalarType::Bool) return DtypeKind::kBool;
  if (c10::isComplexType(type)) return DtypeKind::kComplex;
  if (c10::isFloatingType(type)) return DtypeKind::kFloating;
  if (c10::isIntegralType(type, /*includeBool=*/false)) return DtypeKind::kInteger;
  return DtypeKind::kOther;
}

}  // namespace

std::string dtype_name(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Float: return "float32";
    case c10::ScalarType::Double: return "float64";
    case c10::ScalarType::Half: return "float16";
    case c10::ScalarType::BFloat16: return "bfloat16";
    case c10::ScalarType::Long: return "int64";
    case c10::ScalarType::Int: return "int32";
    case c10::ScalarType::Short: return "int16";
    case c10::ScalarType::Char: return "int8";
    case c10::ScalarType::Byte: return "uint8";
    case c10::ScalarType::Bool: return "bool";
    case c10::ScalarType::ComplexFloat: return "complex64";
    case c10::ScalarType::ComplexDouble: return "complex128";
    default: return c10::toString(type);
  }
}

bool check_dtype_change(c10::ScalarType from, c10::ScalarType to, const std::string& name) {
  if (from == to) return false;
  SHOAL_CHECK_T(CheckpointError, kind_of(from) == kind_of(to) && kind_of(from) != DtypeKind::kOther,
                "dtype mismatch for ", name, ": the checkpoint holds ", dtype_name(from),
                ", the model ", dtype_name(to), "; Shoal does not convert ",
                kind_of(from) == DtypeKind::kComplex ? "complex values to real ones (the imaginary "
                                                       "parts would be dropped)"
                                                     : "between bool, integer, floating-point and "
                                                       "complex tensors",
                " when loading: convert it where it was saved (e.g. t.to(torch.", dtype_name(to),
                ") in Python) if that is what you mean");
  return true;
}

bool all_keys_have_prefix(const StateDict& state, const std::string& prefix) {
  if (state.is_empty() || prefix.empty()) return false;
  for (const auto& item : state) {
    if (item.key().compare(0, prefix.size(), prefix) != 0) return false;
  }
  return true;
}

StateDict strip_prefix(const StateDict& state, const std::string& prefix) {
  StateDict out;
  for (const auto& item : state) {
    const bool has = !prefix.empty() && item.key().compare(0, prefix.size(), prefix) == 0;
    const std::string key = has ? item.key().substr(prefix.size()) : item.key();
    SHOAL_CHECK_T(CheckpointError, !out.contains(key), "removing the prefix '", prefix,
                  "' makes two keys equal: '", key, "'");
    out.insert(key, item.value());
  }
  return out;
}

StateDict add_prefix(const StateDict& state, const std::string& prefix) {
  StateDict out;
  for (const auto& item : state) out.insert(prefix + item.key(), item.value());
  return out;
}

StateDict state_dict(const torch::nn::Module& module) {
  StateDict out;
  // Pre-order over modules, each module's own parameters then its own buffers: Python's order.
  for (const auto& sub : module.named_modules("", /*include_self=*/true)) {
    const std::string prefix = sub.key().empty() ? "" : sub.key() + ".";
    for (const auto& p : sub.value()->named_parameters(/*recurse=*/false)) {
      if (p.value().defined()) out.insert(prefix + p.key(), p.value().detach());
    }
    for (const auto& b : sub.value()->named_buffers(/*recurse=*/false)) {
      if (b.value().defined()) out.insert(prefix + b.key(), b.value().detach());
    }
  }
  if (all_keys_have_prefix(out, kWrapperPrefix)) out = strip_prefix(out, kWrapperPrefix);
  return out;
}

LoadStateDictResult load_state_dict(torch::nn::Module& module, const StateDict& given, bool strict) {
  StateDict target = state_dict(module);
  const StateDict& state =
      all_keys_have_prefix(given, kWrapperPrefix) && !all_keys_have_prefix(target, kWrapperPrefix)
          ? strip_prefix(given, kWrapperPrefix)
          : given;

  LoadStateDictResult result;
  std::vector<std::string> mismatches;
  for (const auto& item : target) {
    const at::Tensor* source = state.find(item.key());
    if (source == nullptr) {
      result.missing_keys.push_back(item.key());
    } else if (source->sizes() != item.value().sizes()) {
      mismatches.push_back("size mismatch for " + item.key() + ": copying a param with shape " +
                           shape_string(source->sizes()) +
                           " from checkpoint, the shape in current model is " +
                           shape_string(item.value().sizes()));
    } else if (check_dtype_change(source->scalar_type(), item.value().scalar_type(), item.key())) {
      result.cast_keys.push_back(item.key());
    }
  }
  for (const auto& item : state) {
    if (!target.contains(item.key())) result.unexpected_keys.push_back(item.key());
  }

  std::vector<std::string> errors;
  if (strict && !result.missing_keys.empty()) {
    errors.push_back("Missing key(s) in state_dict: " + quoted_list(result.missing_keys) + ".");
  }
  if (strict && !result.unexpected_keys.empty()) {
    errors.push_back("Unexpected key(s) in state_dict: " + quoted_list(result.unexpected_keys) + ".");
  }
  for (auto& m : mismatches) errors.push_back(std::move(m) + ".");
  if (!errors.empty()) {
    std::string message = "Error(s) in loading state_dict for " + module.name() + ":";
    for (const auto& e : errors) message += " " + e;
    SHOAL_THROW(CheckpointError, message);
  }

  if (!result.cast_keys.empty()) {
    // PyTorch's load_state_dict copies with copy_, which casts without a word; a float64 or
    // float16 checkpoint of a float32 model is common and fine, but it should not go unnoticed.
    std::string casts;
    for (const auto& key : result.cast_keys) {
      casts += (casts.empty() ? "" : ", ") + key + " " + dtype_name(state.find(key)->scalar_type()) + " -> " +
               dtype_name(target[key].scalar_type());
      if (casts.size() > 400) {
        casts += ", ...";
        break;
      }
    }
    log::warn("shoal: load_state_dict casts ", result.cast_keys.size(),
              " tensor(s) to the model's dtype (as PyTorch's copy_ does): ", casts);
  }
  torch::NoGradGuard no_grad;
  for (const auto& item : target) {
    if (const at::Tensor* source = state.find(item.key())) {
      // target's tensors share memory with the module's, so copy_ writes into the module.
      at::Tensor destination = item.value();
      destination.copy_(*source);
    }
  }
  return result;
}

}  // namespace shoal::checkpoint
