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
// Shared containers (a DAG, not a cycle) are legal, but whoever prints, converts or re-saves the
// result writes each one out every time it is referenced: 40 levels of lists holding the previous
// level twice are a 1 KB pickle and 2^40 values written out. So the unpickler counts the values
// the result holds with every shared container counted each time it is referenced, as it grows
// and once more exactly at the end, and refuses it beyond Limits::max_values. Likewise a tensor
// whose view covers more elements than its storage holds (stride 0) is refused unless allowed:
// its bytes would be bounded by the view, not by the file. The bytes of dict keys hashed while
// loading are bounded in proportion to the pickle (a large key reused by many dicts).
//
// A container costs memory out of proportion to its opcodes: EMPTY_DICT is one byte and builds a
// few hundred bytes of dict and bookkeeping, so a 4 KB deflated file of 4 million empty dicts
// held 1.5 GB while holding fewer values than max_values. So every container built is charged an
// estimate of its memory (kContainerBytes, and kItemBytes per item it holds), once however often
// it is referenced, and every memo entry kMemoBytes; the pickle is refused beyond
// Limits::max_container_bytes.
//
// Thread safety: one object per thread.
#pragma once

#include <ATen/core/ivalue.h>

#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace shoal::checkpoint::detail {

/// What a pickle may expand to (see above).
struct UnpicklerLimits {
  /// Most values a result may hold, shared containers counted once per reference. A state dict
  /// holds about two per tensor and an optimizer's state a few per parameter, so 2^22 (4,194,304)
  /// leaves room for models with a million tensors while bounding what printing or re-saving a
  /// hostile file writes to a few hundred MB.
  uint64_t max_values = uint64_t{1} << 22;
  /// Most bytes the containers built may take, by the estimates kContainerBytes and kItemBytes.
  /// 256 MiB: an optimizer state of 100,000 parameters (a dict of three tensors each) is charged
  /// about 60 MiB; what a container costs past this is memory no state dict needs.
  uint64_t max_container_bytes = uint64_t{256} << 20;
  /// Accept tensors whose view has more elements than their storage (expand()ed, stride 0).
  bool allow_expanded_views = false;
  /// Accept the objects of a TorchScript archive's data.pkl (torch.jit.save): classes of the
  /// `__torch__` namespace built with NEWOBJ, each read as a dict and its state dropped (only its
  /// tensors and containers are of interest), and torch.jit._pickle's typed-list rebuilders.
  bool script_objects = false;
  /// Accept the classes of a DCP checkpoint's `.metadata` (torch.distributed.checkpoint: Metadata,
  /// its storage and chunk records, _StorageInfo, StorageMeta) as plain data: each object is read
  /// as a dict whose "__class__" holds its qualified name, filled by BUILD from its state (a dict
  /// of fields merged in, any other state kept under "__state__"). A dtype global (torch.float32)
  /// reads as its name, torch.serialization._get_layout(name) as the name,
  /// _MEM_FORMAT_ENCODING(n) as n and pathlib.PosixPath(parts) as the joined path. An object used
  /// as a dict key (MetadataIndex) cannot be hashed as a key: the entry is stored under the key
  /// kObjectKeyPrefix + a serial number, its value the tuple (key object, value).
  bool dcp_metadata = false;
};

class Unpickler {
 public:
  using Limits = UnpicklerLimits;

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
  /// Bytes of dict keys a pickle may make the loader hash: 64 per byte of pickle, at least 64 MiB.
  /// A key costs at least 2-5 bytes of opcodes per insertion (a memo reference and SETITEM) and
  /// state dict keys are a few dozen bytes, so a genuine file stays far below; see charge_key().
  static constexpr uint64_t kKeyBytesPerPickleByte = 64;
  static constexpr uint64_t kMinKeyBytes = uint64_t{64} << 20;
  /// What one container costs while loading, measured (RSS of a million empty dicts in a list,
  /// LibTorch 1.13): the dict or list object and its allocation, the loader's record of its shape
  /// (containers_, shapes_) and the final walk's mark (check_acyclic).
  static constexpr uint64_t kContainerBytes = 512;
  /// What one item costs in its container: an IValue slot in a list (16 bytes, doubled by the
  /// vector's growth) or a dict entry's key or value in the ordered hash map.
  static constexpr uint64_t kItemBytes = 48;
  /// What one memo entry costs (a node of memo_): a pickle may memoize every object it builds,
  /// under as many ids as it likes, for 5 bytes of LONG_BINPUT each.
  static constexpr uint64_t kMemoBytes = 64;
  /// See Limits::dcp_metadata: the key of a dict entry whose Python key was an object.
  static constexpr const char* kObjectKeyPrefix = "\x01object ";
  /// See Limits::dcp_metadata: the key naming an object's class.
  static constexpr const char* kClassKey = "__class__";

  /// `where` names the pickle in error messages ("run/ckpt.pt: data.pkl").
  Unpickler(std::string_view data, StorageLoader load_storage, std::string where, Limits limits = {});

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
  bool allowed_global(const std::string& name) const;
  bool is_callable(const std::string& name) const;
  void reduce();
  void new_object();
  void build();
  void build_object(const c10::IValue& object, const c10::IValue& state);
  c10::IValue call_dcp(const std::string& function, const std::vector<c10::IValue>& args);
  bool is_object(const c10::IValue& value) const;
  void rekey(c10::IValue& key, c10::IValue& value);
  void set_item(const c10::IValue& dict, c10::IValue key, c10::IValue value);
  void persistent_load();
  c10::IValue call(const std::string& function, std::vector<c10::IValue> args);
  c10::IValue rebuild_tensor(const std::vector<c10::IValue>& args, size_t required);
  static const Global* as_global(const c10::IValue& value);
  c10::IValue load_unchecked();
  c10::IValue track(c10::IValue container);
  size_t nesting(const c10::IValue& value) const;
  uint64_t values(const c10::IValue& value) const;
  void check_values(uint64_t count) const;
  void charge_memory(uint64_t bytes);
  void memoize(uint64_t id);
  void contains(const c10::IValue& container, const c10::IValue& item);
  void charge_key(const c10::IValue& key);
  std::unordered_set<const void*> check_acyclic(const c10::IValue& root) const;
  void release_unreachable(const std::unordered_set<const void*>& reached);
  void empty_containers();

  std::string_view data_;
  size_t pos_ = 0;
  StorageLoader load_storage_;
  std::string where_;
  std::vector<c10::IValue> stack_;  // see kMaxStack
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, c10::IValue> memo_;
  std::unordered_map<std::string, at::Tensor> storages_;
  Limits limits_;
  uint64_t key_bytes_ = 0;  // see kKeyBytesPerPickleByte
  uint64_t container_bytes_ = 0;  // see kContainerBytes
  uint64_t object_keys_ = 0;  // see kObjectKeyPrefix
  // Every list, dict and tuple built, and how deep each nests and how many values it holds
  // (itself included, shared containers counted per reference) as far as known when it was filled.
  struct Shape {
    size_t depth = 1;
    uint64_t values = 1;
  };
  std::vector<c10::IValue> containers_;
  std::unordered_map<const void*, Shape> shapes_;
};

}  // namespace shoal::checkpoint::detail
