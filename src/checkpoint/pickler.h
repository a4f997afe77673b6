// Pickler: writes a c10::IValue as the pickle (protocol 2) that Python's torch.save writes to
// data.pkl, so that torch.load reads Shoal's files with no Shoal code on the Python side.
//
// Mapping: None/bool/int/double/string as themselves; tuples, lists; a Dict<string, Tensor> (a state
// dict) becomes a collections.OrderedDict, as Module.state_dict() returns; any other dict a dict;
// a tensor becomes torch._utils._rebuild_tensor_v2 over its own storage record "data/<i>".
//
// Thread safety: one object per thread.
#pragma once

#include <ATen/core/ivalue.h>

#include <string>
#include <vector>

namespace shoal::checkpoint::detail {

/// The opcodes of plain values, for the picklers of torch.save's data.pkl and of other files
/// Python reads (a DCP checkpoint's .metadata).
class PickleWriter {
 public:
  void op(uint8_t opcode) { out_.push_back(static_cast<char>(opcode)); }
  void push_int(int64_t value);
  void push_double(double value);
  void push_string(const std::string& value);
  void push_global(const char* module, const char* name);
  void push_int_tuple(c10::IntArrayRef values);
  const std::string& bytes() const { return out_; }

 protected:
  template <typename T>
  void raw_le(T value);

  std::string out_;
};

class Pickler : private PickleWriter {
 public:
  /// The pickle of `value`. Throws CheckpointError for values torch.load could not read.
  std::string dump(const c10::IValue& value);
  /// The tensors dump() referred to, as dense CPU tensors; tensors()[i] belongs in "data/<i>".
  const std::vector<at::Tensor>& tensors() const { return tensors_; }

 private:
  void push(const c10::IValue& value);
  void push_tensor(const at::Tensor& tensor);

  std::vector<at::Tensor> tensors_;
};

}  // namespace shoal::checkpoint::detail
