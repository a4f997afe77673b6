#include "checkpoint/unpickler.h"

#include <torch/custom_class.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <unordered_set>

#include "checkpoint/pickle_opcodes.h"
#include "checkpoint/storage_types.h"
#include "shoal/error.h"

namespace shoal::checkpoint::detail {

// A reference to an allowed Python global (a class or function), kept on the stack as a capsule so
// that it can sit inside tuples (persistent ids name storage classes this way).
struct Unpickler::Global : torch::CustomClassHolder {
  explicit Global(std::string n) : name(std::move(n)) {}
  std::string name;  // "torch._utils._rebuild_tensor_v2"
};

namespace {

// Functions a pickle may call through REDUCE, and classes it may name. Everything else is refused.
const std::set<std::string> kCallable = {
    "collections.OrderedDict",
    "torch._utils._rebuild_tensor",
    "torch._utils._rebuild_tensor_v2",
    "torch._utils._rebuild_parameter",
    "torch._utils._rebuild_parameter_with_state",
    "torch._tensor._rebuild_from_type_v2",
    "torch.Size",
    "_codecs.encode",
};
const std::set<std::string> kTypes = {"torch.Tensor", "torch.nn.parameter.Parameter"};
// What TorchScript's pickler adds (see Limits::script_objects): each returns its first argument.
const std::set<std::string> kScriptCallable = {
    "torch.jit._pickle.build_intlist",    "torch.jit._pickle.build_floatlist",
    "torch.jit._pickle.build_doublelist", "torch.jit._pickle.build_boollist",
    "torch.jit._pickle.build_tensorlist", "torch.jit._pickle.build_complexlist",
    "torch.jit._pickle.restore_type_tag",
};

// What a DCP checkpoint's .metadata adds (see Limits::dcp_metadata): its dataclasses, built with
// NEWOBJ and BUILD, and the functions that rebuild their layout, memory-format and path fields.
const std::set<std::string> kDcpClasses = {
    "torch.distributed.checkpoint.metadata.Metadata",
    "torch.distributed.checkpoint.metadata.StorageMeta",
    "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
    "torch.distributed.checkpoint.metadata.TensorProperties",
    "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
    "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
    "torch.distributed.checkpoint.metadata.MetadataIndex",
    "torch.distributed.checkpoint.filesystem._StorageInfo",
};
const std::set<std::string> kDcpCallable = {
    "torch.serialization._get_layout",
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
    "pathlib.PosixPath",
};

bool is_script_class(const std::string& name) { return name.rfind("__torch__.", 0) == 0; }

c10::IValue new_dict() {
  return c10::impl::GenericDict(c10::AnyType::get(), c10::AnyType::get());
}

c10::IValue new_list() { return c10::impl::GenericList(c10::AnyType::get()); }

bool is_container(const c10::IValue& v) { return v.isList() || v.isGenericDict() || v.isTuple(); }

uint64_t saturating_add(uint64_t a, uint64_t b) {
  uint64_t sum = 0;
  return __builtin_add_overflow(a, b, &sum) ? UINT64_MAX : sum;
}

/// The values a container holds (dict keys and values), copied out (reference counts only).
std::vector<c10::IValue> children(const c10::IValue& v) {
  if (v.isList()) return v.toListRef().vec();
  if (v.isTuple()) return v.toTupleRef().elements().vec();
  std::vector<c10::IValue> out;
  if (v.isGenericDict()) {
    for (const auto& item : v.toGenericDict()) {
      out.push_back(item.key());
      out.push_back(item.value());
    }
  }
  return out;
}

std::vector<int64_t> int_tuple(const c10::IValue& value, const char* what) {
  SHOAL_CHECK_T(CheckpointError, value.isTuple() || value.isList(), what, " is not a tuple");
  std::vector<int64_t> out;
  const auto elements = value.isTuple() ? value.toTupleRef().elements().vec() : value.toListRef().vec();
  for (const auto& e : elements) {
    SHOAL_CHECK_T(CheckpointError, e.isInt(), what, " holds a non-integer");
    out.push_back(e.toInt());
  }
  return out;
}

}  // namespace

Unpickler::Unpickler(std::string_view data, StorageLoader load_storage, std::string where, Limits limits)
    : data_(data), load_storage_(std::move(load_storage)), where_(std::move(where)), limits_(limits) {}

void Unpickler::fail(const std::string& what) const {
  SHOAL_THROW(CheckpointError, where_, ": ", what, " (at byte ", pos_, " of ", data_.size(), ")");
}

const char* Unpickler::take(size_t n) {
  if (n > data_.size() - pos_) fail("the pickle ends early: the file is truncated or corrupt");
  const char* p = data_.data() + pos_;
  pos_ += n;
  return p;
}

template <typename T>
T Unpickler::take_le() {
  T value;
  std::memcpy(&value, take(sizeof(T)), sizeof(T));
  return value;
}

std::string Unpickler::take_line() {
  const size_t end = data_.find('\n', pos_);
  if (end == std::string_view::npos) fail("the pickle ends inside a name: it is truncated or corrupt");
  std::string line(data_.substr(pos_, end - pos_));
  pos_ = end + 1;
  return line;
}

c10::IValue Unpickler::pop() {
  if (stack_.empty() || (!marks_.empty() && stack_.size() <= marks_.back())) {
    fail("the pickle is corrupt (stack underflow)");
  }
  c10::IValue v = std::move(stack_.back());
  stack_.pop_back();
  return v;
}

c10::IValue& Unpickler::top() {
  if (stack_.empty()) fail("the pickle is corrupt (stack underflow)");
  return stack_.back();
}

std::vector<c10::IValue> Unpickler::pop_to_mark() {
  if (marks_.empty() || marks_.back() > stack_.size()) fail("the pickle is corrupt (no MARK)");
  const size_t mark = marks_.back();
  marks_.pop_back();
  std::vector<c10::IValue> items(std::make_move_iterator(stack_.begin() + mark),
                                 std::make_move_iterator(stack_.end()));
  stack_.resize(mark);
  return items;
}

const Unpickler::Global* Unpickler::as_global(const c10::IValue& value) {
  if (!value.isCapsule()) return nullptr;
  auto capsule = value.toCapsule();
  return dynamic_cast<const Global*>(capsule.get());
}

bool Unpickler::is_callable(const std::string& name) const {
  return kCallable.count(name) > 0 || (limits_.script_objects && kScriptCallable.count(name) > 0) ||
         (limits_.dcp_metadata && kDcpCallable.count(name) > 0);
}

bool Unpickler::allowed_global(const std::string& name) const {
  return is_callable(name) || kTypes.count(name) > 0 || storage_dtype(name).has_value() ||
         (limits_.script_objects && is_script_class(name)) ||
         (limits_.dcp_metadata && (kDcpClasses.count(name) > 0 || torch_dtype(name).has_value()));
}

void Unpickler::push_global(const std::string& module, const std::string& name) {
  const std::string full = module + "." + name;
  if (!allowed_global(full)) {
    fail("refers to '" + full +
         "', which Shoal does not load: only tensors, containers and plain values are accepted");
  }
  if (limits_.dcp_metadata && torch_dtype(full).has_value()) {
    stack_.emplace_back(full);  // a value, never called: see Limits::dcp_metadata
    return;
  }
  stack_.push_back(c10::IValue::make_capsule(c10::make_intrusive<Global>(full)));
}

c10::IValue Unpickler::load() {
  try {
    c10::IValue result = load_unchecked();
    release_unreachable(check_acyclic(result));
    return result;
  } catch (...) {
    empty_containers();
    throw;
  }
}

c10::IValue Unpickler::track(c10::IValue container) {
  const std::vector<c10::IValue> items = children(container);
  charge_memory(kContainerBytes + kItemBytes * items.size());
  containers_.push_back(container);
  Shape shape;
  for (const auto& child : items) {
    shape.depth = std::max(shape.depth, nesting(child) + 1);
    shape.values = saturating_add(shape.values, values(child));
  }
  if (shape.depth > kMaxNesting) {
    fail("containers nested more than " + std::to_string(kMaxNesting) + " deep: not a state dict");
  }
  check_values(shape.values);
  shapes_[container.internalToPointer()] = shape;
  return container;
}

size_t Unpickler::nesting(const c10::IValue& value) const {
  if (!is_container(value)) return 0;
  auto it = shapes_.find(value.internalToPointer());
  return it == shapes_.end() ? 1 : it->second.depth;
}

uint64_t Unpickler::values(const c10::IValue& value) const {
  if (!is_container(value)) return 1;
  auto it = shapes_.find(value.internalToPointer());
  return it == shapes_.end() ? 1 : it->second.values;
}

void Unpickler::check_values(uint64_t count) const {
  if (count <= limits_.max_values) return;
  fail("holds more than " + std::to_string(limits_.max_values) +
       " values once the containers it shares are counted each time they are referenced (as "
       "printing or re-saving it would write them out): a small file that expands without bound, "
       "not a state dict; if it is a genuine checkpoint, raise the limit (LoadOptions::max_values, "
       "shoal ckpt --max-values)");
}

void Unpickler::charge_memory(uint64_t bytes) {
  container_bytes_ = saturating_add(container_bytes_, bytes);
  if (container_bytes_ <= limits_.max_container_bytes) return;
  fail("its " + std::to_string(containers_.size()) + " containers, their items and " +
       std::to_string(memo_.size()) + " memo entries would take more than " +
       std::to_string(limits_.max_container_bytes) + " bytes of memory (many small dicts, lists or "
       "tuples: a small file that expands in memory, not a state dict); if it is a genuine "
       "checkpoint, raise the limit (LoadOptions::max_container_bytes, shoal ckpt "
       "--max-container-bytes)");
}

void Unpickler::memoize(uint64_t id) {
  auto [it, inserted] = memo_.insert_or_assign(id, top());
  (void)it;
  if (inserted) charge_memory(kMemoBytes);
}

void Unpickler::charge_key(const c10::IValue& key) {
  // Inserting a key hashes it (and compares it on a collision): a string's bytes, a tuple's
  // elements. A 16 MB string used as the key of 100,000 one-entry dicts is 1 MB of opcodes and
  // 1.6 TB of hashing, so the bytes hashed are counted against a budget in proportion to the
  // pickle. A tuple key may hold plain values only, so that its cost is known without a walk.
  uint64_t cost = 1;
  if (key.isString()) {
    cost += key.toStringRef().size();
  } else if (key.isTuple()) {
    for (const auto& element : key.toTupleRef().elements()) {
      if (is_container(element)) fail("a dict key that is a tuple holding containers: not a state dict");
      cost += element.isString() ? element.toStringRef().size() + 1 : 1;
    }
  } else if (key.isList() || key.isGenericDict()) {
    fail("a dict key that is a list or a dict (unhashable in Python): not a state dict");
  }
  key_bytes_ = saturating_add(key_bytes_, cost);
  const uint64_t budget = std::max<uint64_t>(kMinKeyBytes, kKeyBytesPerPickleByte * data_.size());
  if (key_bytes_ > budget) {
    fail("its dict keys add up to more than " + std::to_string(budget) +
         " bytes to hash (a large key reused by many dicts): not a state dict");
  }
}

void Unpickler::contains(const c10::IValue& container, const c10::IValue& item) {
  charge_memory(kItemBytes);
  if (!is_container(item)) {
    Shape& shape = shapes_[container.internalToPointer()];
    shape.values = saturating_add(shape.values, 1);
    check_values(shape.values);
    return;
  }
  if (item.internalToPointer() == container.internalToPointer()) fail("a container that contains itself");
  const size_t item_depth = nesting(item);
  const uint64_t item_values = values(item);
  Shape& shape = shapes_[container.internalToPointer()];
  shape.depth = std::max(shape.depth, item_depth + 1);
  if (shape.depth > kMaxNesting) {
    fail("containers nested more than " + std::to_string(kMaxNesting) + " deep: not a state dict");
  }
  shape.values = saturating_add(shape.values, item_values);
  check_values(shape.values);
}

std::unordered_set<const void*> Unpickler::check_acyclic(const c10::IValue& root) const {
  // Depth-first, with an explicit stack: a container met again while it is still on the path is a
  // cycle; one met again after it was finished is merely shared (torch.save memoizes those).
  // Nesting and the values held are checked here too, since a container filled after it was
  // placed in another (through the memo) makes the figures recorded while loading underestimates.
  // Each container is walked once; a shared one adds its finished count at every reference.
  struct Frame {
    const void* id;
    std::vector<c10::IValue> items;
    size_t next = 0;
    uint64_t values = 1;
  };
  struct Mark {
    bool on_path = true;
    uint64_t values = 0;
  };
  std::unordered_map<const void*, Mark> marks;
  std::vector<Frame> path;
  uint64_t root_values = 1;
  auto add = [&](uint64_t count) {
    uint64_t& total = path.empty() ? root_values : path.back().values;
    total = saturating_add(total, count);
    check_values(total);
  };
  auto enter = [&](const c10::IValue& v) {
    if (!is_container(v)) {
      if (!path.empty()) add(1);
      return;
    }
    const void* id = v.internalToPointer();
    auto [it, inserted] = marks.emplace(id, Mark{});
    if (!inserted) {
      if (it->second.on_path) fail("a container that contains itself (a cycle): not a state dict");
      add(it->second.values);
      return;
    }
    if (path.size() >= kMaxNesting) {
      fail("containers nested more than " + std::to_string(kMaxNesting) + " deep: not a state dict");
    }
    path.push_back(Frame{id, children(v)});
  };
  enter(root);
  while (!path.empty()) {
    Frame& frame = path.back();
    if (frame.next == frame.items.size()) {
      const uint64_t count = frame.values;
      marks[frame.id] = Mark{false, count};
      path.pop_back();
      if (!path.empty()) add(count);
      continue;
    }
    const c10::IValue child = frame.items[frame.next++];
    enter(child);
  }
  std::unordered_set<const void*> reached;
  for (const auto& [id, mark] : marks) reached.insert(id);
  return reached;
}

void Unpickler::release_unreachable(const std::unordered_set<const void*>& reached) {
  // What the pickle built but left out of its result (left on the stack at STOP, or only in the
  // memo) may hold a cycle that nothing walks: emptying it breaks the cycle, and touches nothing
  // the caller gets.
  for (auto& c : containers_) {
    if (reached.count(c.internalToPointer()) > 0) continue;
    if (c.isList()) c.toList().clear();
    if (c.isGenericDict()) c.toGenericDict().clear();
  }
  stack_.clear();
  memo_.clear();
  containers_.clear();
  shapes_.clear();
}

void Unpickler::empty_containers() {
  // Emptying every list and dict breaks every cycle (a tuple cannot close one by itself) and
  // leaves each container to be destroyed on its own, without a recursion as deep as the nesting.
  release_unreachable({});
}

c10::IValue Unpickler::load_unchecked() {
  try {
    while (true) {
      if (stack_.size() > kMaxStack) {
        fail("the pickle's stack grows beyond " + std::to_string(kMaxStack) + " values: not a state dict");
      }
      const uint8_t opcode = static_cast<uint8_t>(*take(1));
      switch (opcode) {
        case op::kProto:
          if (static_cast<uint8_t>(*take(1)) > 5) fail("pickle protocol newer than 5");
          break;
        case op::kFrame:
          take(8);
          break;
        case op::kStop: {
          c10::IValue result = pop();
          return result;
        }
        case op::kMark:
          marks_.push_back(stack_.size());
          break;
        case op::kPop:
          pop();
          break;
        case op::kPopMark:
          pop_to_mark();
          break;
        case op::kDup:
          stack_.push_back(top());
          break;
        case op::kNone:
          stack_.emplace_back();
          break;
        case op::kNewTrue:
          stack_.emplace_back(true);
          break;
        case op::kNewFalse:
          stack_.emplace_back(false);
          break;
        case op::kBinInt:
          stack_.emplace_back(static_cast<int64_t>(take_le<int32_t>()));
          break;
        case op::kBinInt1:
          stack_.emplace_back(static_cast<int64_t>(take_le<uint8_t>()));
          break;
        case op::kBinInt2:
          stack_.emplace_back(static_cast<int64_t>(take_le<uint16_t>()));
          break;
        case op::kLong1:
        case op::kLong4: {
          const size_t n = opcode == op::kLong1 ? take_le<uint8_t>() : take_le<uint32_t>();
          if (n > 8) fail("an integer wider than 64 bits");
          const char* bytes = take(n);
          uint64_t bits = 0;
          for (size_t i = 0; i < n; ++i) bits |= static_cast<uint64_t>(static_cast<uint8_t>(bytes[i])) << (8 * i);
          if (n > 0 && n < 8 && (static_cast<uint8_t>(bytes[n - 1]) & 0x80)) {
            bits |= ~uint64_t{0} << (8 * n);  // sign-extend two's complement
          }
          stack_.emplace_back(static_cast<int64_t>(bits));
          break;
        }
        case op::kBinFloat: {
          const char* bytes = take(8);
          uint64_t bits = 0;
          for (int i = 0; i < 8; ++i) bits = (bits << 8) | static_cast<uint8_t>(bytes[i]);
          double value;
          std::memcpy(&value, &bits, sizeof(value));
          stack_.emplace_back(value);
          break;
        }
        case op::kBinUnicode:
        case op::kBinString:
        case op::kBinBytes: {
          const size_t n = take_le<uint32_t>();
          stack_.emplace_back(std::string(take(n), n));
          break;
        }
        case op::kShortBinUnicode:
        case op::kShortBinString:
        case op::kShortBinBytes: {
          const size_t n = take_le<uint8_t>();
          stack_.emplace_back(std::string(take(n), n));
          break;
        }
        case op::kBinUnicode8:
        case op::kBinBytes8: {
          const uint64_t n = take_le<uint64_t>();
          if (n > data_.size()) fail("a string longer than the pickle");
          stack_.emplace_back(std::string(take(n), n));
          break;
        }
        case op::kEmptyDict:
          stack_.push_back(track(new_dict()));
          break;
        case op::kEmptyList:
          stack_.push_back(track(new_list()));
          break;
        case op::kEmptyTuple:
          stack_.emplace_back(track(c10::ivalue::Tuple::create({})));
          break;
        case op::kTuple:
          stack_.emplace_back(track(c10::ivalue::Tuple::create(pop_to_mark())));
          break;
        case op::kTuple1:
        case op::kTuple2:
        case op::kTuple3: {
          const size_t n = opcode - op::kTuple1 + 1;
          std::vector<c10::IValue> items(n);
          for (size_t i = n; i-- > 0;) items[i] = pop();
          stack_.emplace_back(track(c10::ivalue::Tuple::create(std::move(items))));
          break;
        }
        case op::kList: {
          auto list = new_list();
          for (auto& item : pop_to_mark()) list.toList().push_back(std::move(item));
          stack_.push_back(track(std::move(list)));
          break;
        }
        case op::kDict: {
          auto items = pop_to_mark();
          if (items.size() % 2 != 0) fail("a dict with an odd number of items");
          auto dict = new_dict();
          for (size_t i = 0; i < items.size(); i += 2) {
            rekey(items[i], items[i + 1]);
            charge_key(items[i]);
            dict.toGenericDict().insert_or_assign(items[i], items[i + 1]);
          }
          stack_.push_back(track(std::move(dict)));
          break;
        }
        case op::kAppend: {
          c10::IValue item = pop();
          if (!top().isList()) fail("APPEND to something that is not a list");
          contains(top(), item);
          top().toList().push_back(std::move(item));
          break;
        }
        case op::kAppends: {
          auto items = pop_to_mark();
          if (!top().isList()) fail("APPENDS to something that is not a list");
          auto list = top().toList();
          for (auto& item : items) {
            contains(top(), item);
            list.push_back(std::move(item));
          }
          break;
        }
        case op::kSetItem: {
          c10::IValue value = pop();
          c10::IValue key = pop();
          if (!top().isGenericDict()) fail("SETITEM on something that is not a dict");
          set_item(top(), std::move(key), std::move(value));
          break;
        }
        case op::kSetItems: {
          auto items = pop_to_mark();
          if (items.size() % 2 != 0) fail("SETITEMS with an odd number of items");
          if (!top().isGenericDict()) fail("SETITEMS on something that is not a dict");
          for (size_t i = 0; i < items.size(); i += 2) set_item(top(), items[i], items[i + 1]);
          break;
        }
        case op::kBinPut:
          memoize(take_le<uint8_t>());
          break;
        case op::kLongBinPut:
          memoize(take_le<uint32_t>());
          break;
        case op::kMemoize:
          memoize(memo_.size());
          break;
        case op::kBinGet:
        case op::kLongBinGet: {
          const uint64_t id = opcode == op::kBinGet ? take_le<uint8_t>() : take_le<uint32_t>();
          auto it = memo_.find(id);
          if (it == memo_.end()) fail("the pickle refers to memo entry " + std::to_string(id) + ", which it never stored");
          stack_.push_back(it->second);
          break;
        }
        case op::kGlobal: {
          std::string module = take_line();
          std::string name = take_line();
          push_global(module, name);
          break;
        }
        case op::kStackGlobal: {
          c10::IValue name = pop();
          c10::IValue module = pop();
          if (!name.isString() || !module.isString()) fail("STACK_GLOBAL without two names");
          push_global(module.toStringRef(), name.toStringRef());
          break;
        }
        case op::kReduce:
          reduce();
          break;
        case op::kNewObj:
          new_object();
          break;
        case op::kBuild:
          build();
          break;
        case op::kBinPersId:
          persistent_load();
          break;
        default: {
          char hex[8];
          std::snprintf(hex, sizeof(hex), "0x%02x", opcode);
          pos_ -= 1;
          fail(std::string("pickle opcode ") + hex +
               " is not one torch.save writes for tensors, containers and plain values; Shoal does not load it");
        }
      }
    }
  } catch (const CheckpointError&) {
    throw;
  } catch (const std::exception& e) {
    fail(std::string("the pickle is corrupt: ") + e.what());
  }
}

void Unpickler::reduce() {
  c10::IValue args = pop();
  c10::IValue callable = pop();
  const Global* global = as_global(callable);
  if (global == nullptr || !is_callable(global->name)) {
    fail("REDUCE calls something that is not an allowed function");
  }
  if (!args.isTuple()) fail("REDUCE with arguments that are not a tuple");
  stack_.push_back(call(global->name, args.toTupleRef().elements().vec()));
}

void Unpickler::set_item(const c10::IValue& dict, c10::IValue key, c10::IValue value) {
  rekey(key, value);
  contains(dict, key);
  contains(dict, value);
  charge_key(key);
  dict.toGenericDict().insert_or_assign(std::move(key), std::move(value));
}

void Unpickler::rekey(c10::IValue& key, c10::IValue& value) {
  if (!is_object(key)) return;
  value = track(c10::ivalue::Tuple::create({key, value}));
  key = std::string(kObjectKeyPrefix) + std::to_string(object_keys_++);
}

bool Unpickler::is_object(const c10::IValue& value) const {
  if (!limits_.dcp_metadata || !value.isGenericDict()) return false;
  const auto dict = value.toGenericDict();
  return dict.find(c10::IValue(std::string(kClassKey))) != dict.end();
}

void Unpickler::new_object() {
  c10::IValue args = pop();
  c10::IValue cls = pop();
  const Global* global = as_global(cls);
  if (limits_.dcp_metadata && global != nullptr && kDcpClasses.count(global->name) > 0) {
    if (!args.isTuple() || !args.toTupleRef().elements().empty()) {
      fail("NEWOBJ of '" + global->name + "' with arguments (DCP's dataclasses are built from their state)");
    }
    c10::IValue object = track(new_dict());
    set_item(object, std::string(kClassKey), global->name);
    stack_.push_back(std::move(object));
    return;
  }
  if (!limits_.script_objects || global == nullptr || !is_script_class(global->name)) {
    fail("NEWOBJ of something that is not a TorchScript class");
  }
  if (!args.isTuple()) fail("NEWOBJ with arguments that are not a tuple");
  stack_.push_back(track(new_dict()));
}

c10::IValue Unpickler::call(const std::string& function, std::vector<c10::IValue> args) {
  if (kScriptCallable.count(function) > 0) {
    if (args.empty()) fail("'" + function + "' without arguments");
    return args[0];
  }
  if (function == "collections.OrderedDict") {
    if (!args.empty()) fail("OrderedDict built from arguments is not supported");
    return track(new_dict());
  }
  if (kDcpCallable.count(function) > 0) return call_dcp(function, args);
  if (function == "torch._utils._rebuild_tensor_v2") return rebuild_tensor(args, 6);
  if (function == "torch._utils._rebuild_tensor") return rebuild_tensor(args, 4);
  if (function == "torch._utils._rebuild_parameter" ||
      function == "torch._utils._rebuild_parameter_with_state") {
    if (args.empty() || !args[0].isTensor()) fail("_rebuild_parameter without a tensor");
    return args[0];  // Shoal's tensors carry no Parameter type; requires_grad is the model's
  }
  if (function == "torch._tensor._rebuild_from_type_v2") {
    // (func, new_type, args, state): a tensor re-typed after rebuilding; only plain types.
    if (args.size() != 4) fail("_rebuild_from_type_v2 with " + std::to_string(args.size()) + " arguments");
    const Global* func = as_global(args[0]);
    const Global* type = as_global(args[1]);
    if (func == nullptr || type == nullptr || kCallable.count(func->name) == 0 || kTypes.count(type->name) == 0) {
      fail("_rebuild_from_type_v2 of something that is not a plain tensor");
    }
    if (!args[2].isTuple()) fail("_rebuild_from_type_v2 with arguments that are not a tuple");
    return call(func->name, args[2].toTupleRef().elements().vec());
  }
  if (function == "torch.Size") {
    if (args.size() != 1) fail("torch.Size with " + std::to_string(args.size()) + " arguments");
    int_tuple(args[0], "torch.Size");  // checks it holds integers
    if (args[0].isTuple()) return args[0];
    return c10::ivalue::Tuple::create(args[0].toListRef().vec());
  }
  if (function == "_codecs.encode") {
    // Protocol 2 writes Python bytes as _codecs.encode(str, 'latin1'): undo the latin-1 decoding.
    if (args.size() != 2 || !args[0].isString()) fail("_codecs.encode with unexpected arguments");
    const std::string& text = args[0].toStringRef();
    std::string bytes;
    for (size_t i = 0; i < text.size(); ++i) {
      const auto c = static_cast<uint8_t>(text[i]);
      if (c < 0x80) {
        bytes += static_cast<char>(c);
      } else if ((c & 0xE0) == 0xC0 && i + 1 < text.size()) {
        bytes += static_cast<char>(((c & 0x1F) << 6) | (static_cast<uint8_t>(text[++i]) & 0x3F));
      } else {
        fail("_codecs.encode of text that is not latin-1");
      }
    }
    return bytes;
  }
  fail("'" + function + "' is not callable here");
}

c10::IValue Unpickler::call_dcp(const std::string& function, const std::vector<c10::IValue>& args) {
  if (function == "pathlib.PosixPath") {
    std::string path;
    for (const auto& part : args) {
      if (!part.isString()) fail("pathlib.PosixPath of something that is not a string");
      path += (path.empty() ? "" : "/") + part.toStringRef();
    }
    return path;
  }
  const bool layout = function == "torch.serialization._get_layout";
  if (args.size() != 1 || (layout ? !args[0].isString() : !args[0].isInt())) {
    fail("'" + function + "' with unexpected arguments");
  }
  return args[0];  // the layout's name ("torch.strided"), the memory format's number
}

c10::IValue Unpickler::rebuild_tensor(const std::vector<c10::IValue>& args, size_t required) {
  if (args.size() < required) fail("a tensor rebuilt from too few arguments");
  if (!args[0].isTensor()) fail("a tensor rebuilt from something that is not a storage");
  if (!args[1].isInt()) fail("a tensor with a non-integer storage offset");
  const at::Tensor& storage = args[0].toTensor();
  const int64_t offset = args[1].toInt();
  const auto size = int_tuple(args[2], "a tensor's size");
  const auto stride = int_tuple(args[3], "a tensor's stride");
  if (size.size() != stride.size()) fail("a tensor whose size and stride differ in length");
  // Check the view stays inside its storage before making it: a corrupt file must not read
  // outside the buffer.
  int64_t last = offset;
  bool empty = false;
  for (size_t i = 0; i < size.size(); ++i) {
    if (size[i] < 0 || stride[i] < 0) fail("a tensor with a negative size or stride");
    if (size[i] == 0) empty = true;
    int64_t extent = 0;
    if (size[i] > 0 && (__builtin_mul_overflow(size[i] - 1, stride[i], &extent) ||
                        __builtin_add_overflow(last, extent, &last))) {
      fail("a tensor whose size and stride overflow");
    }
  }
  if (offset < 0 || (!empty && last >= storage.numel())) {
    fail("a tensor reaches past the end of its storage (" + std::to_string(storage.numel()) + " elements)");
  }
  // A view may read its storage's elements more than once (stride 0): whoever copies it out
  // (ckpt convert, a model's parameters) then writes as many bytes as the view claims, not as the
  // file holds. Bound a tensor's elements by its storage's unless asked otherwise.
  int64_t numel = 1;
  for (int64_t s : size) {
    if (__builtin_mul_overflow(numel, s, &numel)) fail("a tensor whose size overflows");
  }
  if (!limits_.allow_expanded_views && numel > storage.numel()) {
    std::string shape;
    for (size_t i = 0; i < size.size(); ++i) {
      shape += (i ? ", " : "") + std::to_string(size[i]) + " (stride " + std::to_string(stride[i]) + ")";
    }
    fail("a tensor of " + std::to_string(numel) + " elements [" + shape + "] views a storage of only " +
         std::to_string(storage.numel()) +
         ": its elements repeat (an expand()ed view), so copying it out would write far more than the "
         "file holds; save it with .contiguous() or .clone(), or accept such views explicitly "
         "(LoadOptions::allow_expanded_views, shoal ckpt --allow-expanded-views)");
  }
  return storage.as_strided(size, stride, offset);
}

void Unpickler::build() {
  c10::IValue state = pop();
  c10::IValue& target = top();
  if (is_object(target)) {
    build_object(target, state);
    return;
  }
  // OrderedDict state dicts carry `_metadata` (module versions), and tensors may carry Python
  // attributes: neither matters to Shoal, so the state is dropped.
  if (target.isGenericDict() || target.isTensor()) return;
  fail("BUILD on something other than a dict or tensor");
}

void Unpickler::build_object(const c10::IValue& object, const c10::IValue& state) {
  if (!state.isGenericDict()) {
    set_item(object, std::string("__state__"), state);  // TensorProperties: its __getstate__ tuple
    return;
  }
  if (state.internalToPointer() == object.internalToPointer()) fail("an object built from itself");
  for (const auto& field : state.toGenericDict()) {
    if (field.key().isString() && field.key().toStringRef() == kClassKey) {
      fail(std::string("an object whose state sets '") + kClassKey + "'");
    }
    set_item(object, field.key(), field.value());
  }
}

void Unpickler::persistent_load() {
  c10::IValue pid = pop();
  if (!pid.isTuple()) fail("a persistent id that is not a tuple");
  const auto& items = pid.toTupleRef().elements();
  if (items.size() < 5 || !items[0].isString() || items[0].toStringRef() != "storage") {
    fail("a persistent id that is not a tensor storage");
  }
  const Global* type = as_global(items[1]);
  if (type == nullptr) fail("a storage without a storage class");
  const auto dtype = storage_dtype(type->name);
  if (!dtype) fail("'" + type->name + "' is not a storage class");
  if (!items[2].isString() || !items[4].isInt()) fail("a storage with a malformed key or size");
  const std::string& key = items[2].toStringRef();
  const int64_t numel = items[4].toInt();
  if (numel < 0) fail("a storage with a negative size");
  auto it = storages_.find(key);
  if (it == storages_.end()) {
    it = storages_.emplace(key, load_storage_(key, *dtype, numel)).first;
  } else if (it->second.scalar_type() != *dtype) {
    // Two tensors viewing one storage as different dtypes (2.x untyped storages): not supported.
    fail("storage " + key + " is used with two dtypes");
  }
  stack_.push_back(it->second);
}

}  // namespace shoal::checkpoint::detail
