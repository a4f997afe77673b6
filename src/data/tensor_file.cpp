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

at::Tensor targets(at::Tensor y, const std::string& path, const char* key, int64_t classes) {
  SHOAL_CHECK_T(DataError, at::isIntegralType(y.scalar_type(), /*includeBool=*/false), path,
                ": '", key, "' has dtype ", y.scalar_type(),
                ", not an integer type; class targets are indices, save them as y.long()");
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
  data.train_x = inputs(take(dict, path, "train_x"), path, "train_x");
  data.train_y = targets(take(dict, path, "train_y"), path, "train_y", num_classes);
  data.test_x = inputs(take(dict, path, "test_x"), path, "test_x");
  data.test_y = targets(take(dict, path, "test_y"), path, "test_y", num_classes);
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
