// Unpickler: a restricted reader for the data.pkl of torch.save files.
//
// It understands the pickle opcodes torch.save emits and builds c10::IValues: dicts (also
// collections.OrderedDict) as generic dicts in file order, lists, tuples, ints, floats, strings,
// bools, None, and tensors rebuilt from the archive's storages. Globals are checked against an
// allow-list as soon as they are named (tensor rebuild functions, storage classes, OrderedDict);
// anything else is refused. Nothing from the file is ever executed or imported.
//
// Hostile files: containers may nest at most kMaxNesting deep and may not contain themselves (a
// cycle); both are checked without recursion, so neither a self-referencing list nor a million
// nested ones can exhaust the stack, here or in whoever walks the result afterwards. When loading
// fails, every list and dict built so far is emptied so that no cycle outlives the error.
//
// Thread safety: one object per thread.
#pragma once

#include <ATen/core/ivalue.h>

#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace shoal::checkpoint::detail {

class Unpickler {
 public:
  /// Returns the storage `key` ("data/<key>" in the archive) as a 1-D tensor of `numel` elements of
  /// `dtype`. Called once per key.
  using StorageLoader =
      std::function<at::Tensor(const std::string& key, c10::ScalarType dtype, int64_t numel)>;

  /// Deepest nesting of containers accepted. torch.save'd state dicts nest about 5 deep (an
  /// optimizer's state: dict -> dict -> dict -> tensor); Python's own unpickler stops near 1000.
  static constexpr size_t kMaxNesting = 100;
  /// Most values the pickle's stack may hold at once. Picklers batch APPENDS/SETITEMS by 1000, so
  /// a state dict's stack stays small whatever its size; the cap bounds the memory a small hostile
  /// file can claim by pushing containers (~200 bytes each) without ever closing them.
  static constexpr size_t kMaxStack = size_t{1} << 18;

  /// `where` names the pickle in error messages ("run/ckpt.pt: data.pkl").
  Unpickler(std::string_view data, StorageLoader load_storage, std::string where);

  /// Reads the pickle; throws CheckpointError saying what is wrong and where.
  c10::IValue load();

 private:
  struct Global;
  [[noreturn]] void fail(const std::string& what) const;
  const char* take(size_t n);
  template <typename T>
  T take_le();
  std::string take_line();
  c10::IValue pop();
  std::vector<c10::IValue> pop_to_mark();
  c10::IValue& top();
  void push_global(const std::string& module, const std::string& name);
  void reduce();
  void build();
  void persistent_load();
  c10::IValue call(const std::string& function, std::vector<c10::IValue> args);
  c10::IValue rebuild_tensor(const std::vector<c10::IValue>& args, size_t required);
  static const Global* as_global(const c10::IValue& value);
  c10::IValue load_unchecked();
  c10::IValue track(c10::IValue container);
  size_t nesting(const c10::IValue& value) const;
  void contains(const c10::IValue& container, const c10::IValue& item);
  void check_acyclic(const c10::IValue& root) const;
  void empty_containers();

  std::string_view data_;
  size_t pos_ = 0;
  StorageLoader load_storage_;
  std::string where_;
  std::vector<c10::IValue> stack_;  // see kMaxStack
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, c10::IValue> memo_;
  std::unordered_map<std::string, at::Tensor> storages_;
  // Every list, dict and tuple built, and how deep each nests as far as known when it was filled.
  std::vector<c10::IValue> containers_;
  std::unordered_map<const void*, size_t> nesting_;
};

}  // namespace shoal::checkpoint::detail
