#include "checkpoint/storage_types.h"

#include <utility>

#include "shoal/error.h"

namespace shoal::checkpoint::detail {
namespace {

const std::pair<c10::ScalarType, const char*> kStorageNames[] = {
    {c10::ScalarType::Float, "FloatStorage"},
    {c10::ScalarType::Double, "DoubleStorage"},
    {c10::ScalarType::Half, "HalfStorage"},
    {c10::ScalarType::BFloat16, "BFloat16Storage"},
    {c10::ScalarType::Long, "LongStorage"},
    {c10::ScalarType::Int, "IntStorage"},
    {c10::ScalarType::Short, "ShortStorage"},
    {c10::ScalarType::Char, "CharStorage"},
    {c10::ScalarType::Byte, "ByteStorage"},
    {c10::ScalarType::Bool, "BoolStorage"},
    {c10::ScalarType::ComplexFloat, "ComplexFloatStorage"},
    {c10::ScalarType::ComplexDouble, "ComplexDoubleStorage"},
};

}  // namespace

std::string storage_type_name(c10::ScalarType dtype) {
  for (const auto& [type, name] : kStorageNames) {
    if (type == dtype) return name;
  }
  SHOAL_THROW(CheckpointError, "tensors of dtype ", c10::toString(dtype),
              " cannot be saved in torch.save's format; convert them to a standard dtype first");
}

std::optional<c10::ScalarType> storage_dtype(const std::string& qualified_name) {
  if (qualified_name == "torch.storage.UntypedStorage" || qualified_name == "torch.UntypedStorage" ||
      qualified_name == "torch.storage._UntypedStorage") {
    return c10::ScalarType::Byte;
  }
  const std::string prefix = "torch.";
  if (qualified_name.compare(0, prefix.size(), prefix) != 0) return std::nullopt;
  const std::string name = qualified_name.substr(prefix.size());
  for (const auto& [type, storage] : kStorageNames) {
    if (name == storage) return type;
  }
  return std::nullopt;
}

}  // namespace shoal::checkpoint::detail
