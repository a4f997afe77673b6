#include "shoal/data/tensor_file.h"

#include <ATen/ATen.h>

#include "shoal/checkpoint/serialization.h"
#include "shoal/error.h"

namespace shoal::data {
namespace {

constexpr const char* kLayout =
    "expected torch.save({'train_x': X, 'train_y': y, 'test_x': Xt, 'test_y': yt}) with float "
    "inputs [N, ...] and integer class targets [N]";

at::Tensor take(const c10::impl::GenericDict& dict, const std::string& path, const char* key) {
  for (const auto& entry : dict) {
    if (entry.key().isString() && entry.key().toStringRef() == key) {
      SHOAL_CHECK_T(DataError, entry.value().isTensor(), path, ": '", key, "' is a ",
                    entry.value().tagKind(), ", not a tensor; ", kLayout);
      return entry.value().toTensor();
    }
  }
  SHOAL_THROW(DataError, path, ": no key '", key, "'; ", kLayout);
}

at::Tensor inputs(at::Tensor x, const std::string& path, const char* key) {
  SHOAL_CHECK_T(DataError, at::isFloatingType(x.scalar_type()), path, ": '", key, "' has dtype ",
                x.scalar_type(), ", not floating point; save it as X.float() (scaled and "
                "normalised as the model expects)");
  SHOAL_CHECK_T(DataError, x.dim() >= 2, path, ": '", key, "' has shape ", x.sizes(),
                "; inputs are [N, ...] with one sample per row");
  return x.to(at::kFloat).contiguous();
}

at::Tensor values(at::Tensor y, const std::string& path, const char* key) {
  SHOAL_CHECK_T(DataError, at::isFloatingType(y.scalar_type()), path, ": '", key, "' has dtype ",
                y.scalar_type(), ", not floating point; a regression loss takes float targets "
                "(save them as y.float()), or pass --loss cross_entropy for class indices");
  SHOAL_CHECK_T(DataError, y.dim() >= 1, path, ": '", key, "' is a scalar; targets are [N, ...]");
  return y.to(at::kFloat).contiguous();
}

at::Tensor as_saved(at::Tensor t, const std::string& path, const char* key) {
  SHOAL_CHECK_T(DataError, t.dim() >= 1, path, ": '", key, "' is a scalar; one sample per row");
  return t.contiguous();
}

/// Token ids [N, T] in [lowest, vocab) (vocab 0: no bound), as int64.
at::Tensor tokens(at::Tensor t, const std::string& path, const char* key, int64_t lowest,
                  int64_t vocab) {
  const bool integral = at::isIntegralType(t.scalar_type(), /*includeBool=*/false);
  SHOAL_CHECK_T(DataError, integral && t.dim() == 2, path, ": '", key, "' is ", t.scalar_type(),
                " ", t.sizes(), "; a language model takes blocks of token ids [N, T] (integers)");
  t = t.to(at::kLong).contiguous();
  if (t.numel() == 0) return t;
  const int64_t low = t.min().item<int64_t>();
  const int64_t high = t.max().item<int64_t>();
  SHOAL_CHECK_T(DataError, low >= lowest, path, ": '", key, "' holds the token id ", low,
                "; token ids start at 0", lowest < 0 ? " (-1 in targets: ignored)" : "");
  SHOAL_CHECK_T(DataError, vocab <= 0 || high < vocab, path, ": '", key, "' holds the token id ",
                high, ", but the vocabulary has ", vocab, " tokens; raise --vocab-size");
  return t;
}

at::Tensor targets(at::Tensor y, const std::string& path, const char* key,
                   const TensorFileOptions& options) {
  using Targets = TensorFileOptions::Targets;
  if (options.targets == Targets::kValues) return values(std::move(y), path, key);
  if (options.targets == Targets::kAsSaved) return as_saved(std::move(y), path, key);
  if (options.targets == Targets::kTokens) {
    return tokens(std::move(y), path, key, -1, options.num_classes);
  }
  const int64_t classes = options.num_classes;
  SHOAL_CHECK_T(DataError, at::isIntegralType(y.scalar_type(), /*includeBool=*/false), path,
                ": '", key, "' has dtype ", y.scalar_type(),
                ", not an integer type; class targets are indices, save them as y.long() (or "
                "pass a regression --loss: mse, l1, smooth_l1, bce_with_logits)");
  SHOAL_CHECK_T(DataError, y.dim() == 1, path, ": '", key, "' has shape ", y.sizes(),
                "; class targets are [N]");
  y = y.to(at::kLong).contiguous();
  if (y.numel() > 0) {
    const int64_t low = y.min().item<int64_t>();
    const int64_t high = y.max().item<int64_t>();
    SHOAL_CHECK_T(DataError, low >= 0, path, ": '", key, "' holds the label ", low,
                  "; class indices start at 0");
    SHOAL_CHECK_T(DataError, classes <= 0 || high < classes, path, ": '", key,
                  "' holds the label ", high, ", but the model has ", classes,
                  " classes (labels 0-", classes - 1, ")");
  }
  return y;
}

}  // namespace

TensorFileData read_tensor_file(const std::string& path, int64_t num_classes) {
  TensorFileOptions options;
  options.num_classes = num_classes;
  return read_tensor_file(path, options);
}

TensorFileData read_tensor_file(const std::string& path, const TensorFileOptions& options) {
  using Targets = TensorFileOptions::Targets;
  const auto input = [&](const c10::impl::GenericDict& dict, const char* key) {
    if (options.targets == Targets::kTokens) {
      return tokens(take(dict, path, key), path, key, 0, options.num_classes);
    }
    return options.targets == Targets::kAsSaved ? as_saved(take(dict, path, key), path, key)
                                                : inputs(take(dict, path, key), path, key);
  };
  c10::IValue object;
  try {
    object = checkpoint::load(path);
  } catch (const CheckpointError& e) {
    SHOAL_THROW(DataError, e.what());
  }
  SHOAL_CHECK_T(DataError, object.isGenericDict(), path, ": holds a ", object.tagKind(),
                ", not a dict; ", kLayout);
  const c10::impl::GenericDict dict = object.toGenericDict();
  TensorFileData data;
  data.train_x = input(dict, "train_x");
  data.train_y = targets(take(dict, path, "train_y"), path, "train_y", options);
  data.test_x = input(dict, "test_x");
  data.test_y = targets(take(dict, path, "test_y"), path, "test_y", options);
  SHOAL_CHECK_T(DataError, data.train_x.size(0) == data.train_y.size(0), path, ": train_x holds ",
                data.train_x.size(0), " samples but train_y ", data.train_y.size(0),
                " targets; they must be the same count");
  SHOAL_CHECK_T(DataError, data.test_x.size(0) == data.test_y.size(0), path, ": test_x holds ",
                data.test_x.size(0), " samples but test_y ", data.test_y.size(0),
                " targets; they must be the same count");
  SHOAL_CHECK_T(DataError, data.train_x.size(0) > 0, path, ": train_x holds no samples");
  SHOAL_CHECK_T(DataError, data.train_x.sizes().slice(1) == data.test_x.sizes().slice(1), path,
                ": train_x samples are ", data.train_x.sizes().slice(1), " but test_x samples ",
                data.test_x.sizes().slice(1), "; both splits must have one sample shape");
  return data;
}

}  // namespace shoal::data
