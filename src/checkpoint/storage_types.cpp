#include "checkpoint/storage_types.h"

#include <utility>

#include "shoal/error.h"

namespace shoal::checkpoint::detail {
namespace {

struct DtypeNames {
  c10::ScalarType type;
  const char* storage;  // torch.save's storage class
  const char* dtype;    // Python's torch.<dtype>
};

const DtypeNames kStorageNames[] = {
    {c10::ScalarType::Float, "FloatStorage", "float32"},
    {c10::ScalarType::Double, "DoubleStorage", "float64"},
    {c10::ScalarType::Half, "HalfStorage", "float16"},
    {c10::ScalarType::BFloat16, "BFloat16Storage", "bfloat16"},
    {c10::ScalarType::Long, "LongStorage", "int64"},
    {c10::ScalarType::Int, "IntStorage", "int32"},
    {c10::ScalarType::Short, "ShortStorage", "int16"},
    {c10::ScalarType::Char, "CharStorage", "int8"},
    {c10::ScalarType::Byte, "ByteStorage", "uint8"},
    {c10::ScalarType::Bool, "BoolStorage", "bool"},
    {c10::ScalarType::ComplexFloat, "ComplexFloatStorage", "complex64"},
    {c10::ScalarType::ComplexDouble, "ComplexDoubleStorage", "complex128"},
};

}  // namespace

std::string storage_type_name(c10::ScalarType dtype) {
  for (const auto& names : kStorageNames) {
    if (names.type == dtype) return names.storage;
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
  for (const auto& names : kStorageNames) {
    if (name == names.storage) return names.type;
  }
  return std::nullopt;
}

std::optional<c10::ScalarType> torch_dtype(const std::string& qualified_name) {
  for (const auto& names : kStorageNames) {
    if (qualified_name == std::string("torch.") + names.dtype) return names.type;
  }
  return std::nullopt;
}

}  // namespace shoal::checkpoint::detail
