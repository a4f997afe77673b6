#include "checkpoint/pickler.h"

#include <cstring>

#include "checkpoint/pickle_opcodes.h"
#include "checkpoint/storage_types.h"
#include "shoal/error.h"

namespace shoal::checkpoint::detail {
namespace {

// Python's pickler batches APPENDS/SETITEMS by this many items; torch.load does not care, but
// staying with the reference layout keeps files familiar to pickletools readers.
constexpr size_t kBatchSize = 1000;

bool is_state_dict(const c10::IValue& value) {
  const auto dict = value.toGenericDict();
  return dict.keyType()->kind() == c10::TypeKind::StringType &&
         dict.valueType()->kind() == c10::TypeKind::TensorType;
}

}  // namespace

template <typename T>
void PickleWriter::raw_le(T value) {
  // Pickle integers are little-endian; Shoal supports little-endian hosts only (as the storages
  // torch.save writes are in host order and Shoal records "byteorder" = "little").
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));
  out_.append(bytes, sizeof(T));
}

std::string Pickler::dump(const c10::IValue& value) {
  out_.clear();
  tensors_.clear();
  op(op::kProto);
  op(2);
  push(value);
  op(op::kStop);
  return out_;
}

void PickleWriter::push_int(int64_t value) {
  if (value >= 0 && value < 256) {
    op(op::kBinInt1);
    op(static_cast<uint8_t>(value));
  } else if (value >= 0 && value < 65536) {
    op(op::kBinInt2);
    raw_le(static_cast<uint16_t>(value));
  } else if (value >= INT32_MIN && value <= INT32_MAX) {
    op(op::kBinInt);
    raw_le(static_cast<int32_t>(value));
  } else {
    op(op::kLong1);
    op(8);
    raw_le(value);
  }
}

void PickleWriter::push_double(double value) {
  uint64_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  op(op::kBinFloat);
  for (int shift = 56; shift >= 0; shift -= 8) op(static_cast<uint8_t>(bits >> shift));
}

void PickleWriter::push_string(const std::string& value) {
  op(op::kBinUnicode);
  raw_le(static_cast<uint32_t>(value.size()));
  out_ += value;
}

void PickleWriter::push_global(const char* module, const char* name) {
  op(op::kGlobal);
  out_ += module;
  out_ += '\n';
  out_ += name;
  out_ += '\n';
}

void PickleWriter::push_int_tuple(c10::IntArrayRef values) {
  op(op::kMark);
  for (int64_t v : values) push_int(v);
  op(op::kTuple);
}

void Pickler::push_tensor(const at::Tensor& tensor) {
  SHOAL_CHECK_T(CheckpointError, !tensor.is_sparse() && !tensor.is_quantized(),
                "only dense tensors can be saved; got a ", tensor.layout(), " tensor");
  // Each tensor gets its own storage holding exactly its elements, so files stay small even when
  // a tensor is a view of a larger one.
  at::Tensor dense = tensor.detach().to(at::kCPU).contiguous();
  if (dense.storage_offset() != 0 ||
      dense.storage().nbytes() != static_cast<size_t>(dense.numel()) * dense.element_size()) {
    dense = dense.clone();
  }
  const std::string key = std::to_string(tensors_.size());
  tensors_.push_back(dense);

  push_global("torch._utils", "_rebuild_tensor_v2");
  op(op::kMark);
  op(op::kMark);  // persistent id: ('storage', storage type, key, location, numel)
  push_string("storage");
  push_global("torch", storage_type_name(dense.scalar_type()).c_str());
  push_string(key);
  push_string("cpu");
  push_int(dense.numel());
  op(op::kTuple);
  op(op::kBinPersId);
  push_int(0);  // storage offset
  push_int_tuple(dense.sizes());
  push_int_tuple(dense.strides());
  op(op::kNewFalse);  // requires_grad
  push_global("collections", "OrderedDict");  // backward hooks: none
  op(op::kEmptyTuple);
  op(op::kReduce);
  op(op::kTuple);
  op(op::kReduce);
}

void Pickler::push(const c10::IValue& value) {
  if (value.isNone()) {
    op(op::kNone);
  } else if (value.isBool()) {
    op(value.toBool() ? op::kNewTrue : op::kNewFalse);
  } else if (value.isInt()) {
    push_int(value.toInt());
  } else if (value.isDouble()) {
    push_double(value.toDouble());
  } else if (value.isString()) {
    push_string(value.toStringRef());
  } else if (value.isTensor()) {
    push_tensor(value.toTensor());
  } else if (value.isTuple()) {
    const auto& elements = value.toTupleRef().elements();
    if (elements.empty()) {
      op(op::kEmptyTuple);
      return;
    }
    op(op::kMark);
    for (const auto& element : elements) push(element);
    op(op::kTuple);
  } else if (value.isList()) {
    op(op::kEmptyList);
    const auto list = value.toListRef();
    for (size_t begin = 0; begin < list.size(); begin += kBatchSize) {
      op(op::kMark);
      for (size_t i = begin; i < std::min(list.size(), begin + kBatchSize); ++i) push(list[i]);
      op(op::kAppends);
    }
  } else if (value.isGenericDict()) {
    if (is_state_dict(value)) {
      push_global("collections", "OrderedDict");
      op(op::kEmptyTuple);
      op(op::kReduce);
    } else {
      op(op::kEmptyDict);
    }
    const auto dict = value.toGenericDict();
    size_t in_batch = 0;
    for (const auto& entry : dict) {
      if (in_batch == 0) op(op::kMark);
      push(entry.key());
      push(entry.value());
      if (++in_batch == kBatchSize) {
        op(op::kSetItems);
        in_batch = 0;
      }
    }
    if (in_batch > 0) op(op::kSetItems);
  } else {
    SHOAL_THROW(CheckpointError, "a ", value.tagKind(),
                " cannot be saved in a checkpoint: only tensors, containers and plain values");
  }
}

}  // namespace shoal::checkpoint::detail
