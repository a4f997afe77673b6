#include "parallel/slot_lender.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <torch/version.h>

#include <cstdlib>
#include <cstring>
#include <mutex>

namespace shoal::parallel {
namespace {

// LibTorch 2.3 made allocate() non-const and added copy_data().
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
#define SHOAL_ALLOCATE_CONST
#define SHOAL_HAS_COPY_DATA 1
#else
#define SHOAL_ALLOCATE_CONST const
#define SHOAL_HAS_COPY_DATA 0
#endif

// A counted allocation alive: its memory is either a slot (lent) or the base allocator's.
struct Record {
  std::shared_ptr<SlotLender::Slot> slot;  // lent: the slot, its flag cleared when this dies
  c10::DataPtr base;                       // not lent: the base allocator's block
  size_t bytes = 0;
  uint32_t index = 0;  // the allocation's index among its size's since arm()
  Record() = default;
  Record(Record&&) = default;
  Record& operator=(Record&&) = default;
  ~Record() {
    if (slot) slot->lent.store(false, std::memory_order_release);
  }
};

std::mutex registry_mutex;
std::unordered_map<void*, Record>& registry() {
  static auto* map = new std::unordered_map<void*, Record>();  // outlives static destruction
  return *map;
}

c10::Allocator* base_allocator = nullptr;
thread_local SlotLender* armed = nullptr;
thread_local std::shared_ptr<SlotLender> armed_keep;

void delete_counted(void* ptr) {
  Record dead;  // frees the base block or clears the slot's flag, outside the lock
  bool counted = false;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    auto it = registry().find(ptr);
    if (it != registry().end()) {
      dead = std::move(it->second);
      registry().erase(it);
      counted = true;
    }
  }
  // Else a block of the base allocator handed out raw (raw_allocate): its own deleter frees it.
  if (!counted) base_allocator->raw_deleter()(ptr);
}

class CountingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) SHOAL_ALLOCATE_CONST override {
    SlotLender* lender = armed;
    if (lender == nullptr || n < SlotLender::kMinBytes) return base_allocator->allocate(n);
    return lender->allocate(n, *base_allocator);
  }
  c10::DeleterFnPtr raw_deleter() const override {
    // raw_allocate() hands out the base's simple blocks (and counted ones, also simple): both
    // are freed through delete_counted, which tells them apart.
    return base_allocator->raw_deleter() != nullptr ? &delete_counted : nullptr;
  }
#if SHOAL_HAS_COPY_DATA
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
#endif
};

// The counting allocator stands in front of LibTorch's CPU allocator only while some lender is
// alive: every CPU allocation of the process pays its check while it is there, and a process
// that is not training with DDP (any more) gets LibTorch's allocator untouched. Lenders share it
// (one per rank thread when ranks are threads), so the last one to go takes it out. Memory it
// handed out stays valid after: its deleter and the base allocator outlive it.
std::mutex hook_mutex;
int hook_users = 0;

CountingAllocator& counting_allocator() {
  static auto* counting = new CountingAllocator();  // storages keep pointers to it: never freed
  return *counting;
}

bool acquire_hook() {
  std::lock_guard<std::mutex> lock(hook_mutex);
  CountingAllocator* counting = &counting_allocator();
  if (c10::Allocator* current = c10::GetCPUAllocator(); current != counting) {
    // Another allocator took LibTorch's place since ours last stood there: leave it alone.
    if (base_allocator != nullptr && current != base_allocator) return false;
    base_allocator = current;
    c10::SetCPUAllocator(counting, /*priority=*/1);
    if (c10::GetCPUAllocator() != counting) return false;  // one of higher priority is there
  }
  ++hook_users;
  return true;
}

void release_hook() {
  std::lock_guard<std::mutex> lock(hook_mutex);
  if (--hook_users > 0) return;
  if (c10::GetCPUAllocator() == &counting_allocator()) {
    c10::SetCPUAllocator(base_allocator, /*priority=*/1);
  }
}

}  // namespace

std::shared_ptr<SlotLender> SlotLender::create(size_t parameters) {
  if (!acquire_hook()) return nullptr;
  return std::shared_ptr<SlotLender>(new SlotLender(parameters));
}

SlotLender::SlotLender(size_t parameters)
    : slots_(parameters), learnt_(parameters, {0, 0}), free_(parameters, 0) {}

SlotLender::~SlotLender() { release_hook(); }

void SlotLender::set_slot(size_t index, void* address, size_t bytes, c10::Storage owner) {
  auto slot = std::make_shared<Slot>();
  slot->address = address;
  slot->bytes = bytes;
  slot->owner = std::move(owner);
  slots_[index] = std::move(slot);
  classes_.try_emplace(bytes);
}

void SlotLender::arm(const std::vector<char>& free) {
  free_.assign(free.begin(), free.end());  // the same size every step: no allocation
  for (auto& [bytes, size_class] : classes_) size_class.count = 0;
  armed = this;
  armed_keep = shared_from_this();
}

SlotLender::Uncounted::Uncounted() : saved_(armed) { armed = nullptr; }
SlotLender::Uncounted::~Uncounted() { armed = saved_; }

void SlotLender::disarm() {
  if (armed != this) return;
  armed = nullptr;
  armed_keep.reset();  // may destroy this lender: the last statement
}

c10::DataPtr SlotLender::allocate(size_t bytes, c10::Allocator& base) {
  auto size_class = classes_.find(bytes);
  if (size_class == classes_.end()) return base.allocate(bytes);
  SizeClass& c = size_class->second;
  const uint32_t index = c.count++;
  const int64_t param = index < c.owner.size() ? c.owner[index] : -1;
  Record record;
  record.bytes = bytes;
  record.index = index;
  void* address = nullptr;
  if (param >= 0 && free_[param]) {
    const auto& slot = slots_[param];
    bool expected = false;
    if (slot && slot->bytes == bytes &&
        slot->lent.compare_exchange_strong(expected, true, std::memory_order_acq_rel)) {
      free_[param] = 0;
      record.slot = slot;
      address = slot->address;
    }
  }
  if (address == nullptr) {
    record.base = base.allocate(bytes);
    address = record.base.get();
  }
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    registry().insert_or_assign(address, std::move(record));
  }
  return c10::DataPtr(address, address, &delete_counted, c10::Device(c10::kCPU));
}

SlotLender::Where SlotLender::learn(size_t index, const at::Tensor& grad) {
  if (!grad.has_storage()) return Where::kElsewhere;
  const c10::DataPtr& data = grad.storage().data_ptr();
  if (data.get_deleter() != &delete_counted) return Where::kElsewhere;
  size_t bytes = 0;
  uint32_t at = 0;
  Where where = Where::kElsewhere;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    auto it = registry().find(data.get());
    if (it == registry().end()) return Where::kElsewhere;
    bytes = it->second.bytes;
    at = it->second.index;
    if (it->second.slot != nullptr) {
      where = it->second.slot == slots_[index] ? Where::kOwnSlot : Where::kOtherSlot;
    }
  }
  auto size_class = classes_.find(bytes);
  if (size_class == classes_.end()) return where;
  auto& [old_bytes, old_at] = learnt_[index];
  if (old_bytes != 0) {
    auto old = classes_.find(old_bytes);
    if (old != classes_.end() && old_at < old->second.owner.size() &&
        old->second.owner[old_at] == static_cast<int64_t>(index)) {
      old->second.owner[old_at] = -1;
    }
  }
  auto& owner = size_class->second.owner;
  if (owner.size() <= at) owner.resize(at + 1, -1);
  owner[at] = static_cast<int64_t>(index);
  learnt_[index] = {bytes, at};
  return where;
}

bool SlotLender::lent(size_t index) const {
  const auto& slot = slots_[index];
  return slot && slot->lent.load(std::memory_order_acquire);
}

}  // namespace shoal::parallel
