// SlotLender: gradients computed where their buckets are.
//
// With zero_grad(set_to_none) (LibTorch 2.x's default) every backward gives each parameter a new
// gradient, the output of some op, which DDP would copy into the parameter's bucket slot before
// reducing it. Instead, a CPU allocator put in front of LibTorch's counts the allocations of the
// gradients' sizes that the training thread makes while a synchronised backward runs: the k-th
// allocation of n bytes that became parameter p's gradient in one step is placed in p's slot in
// the next, when the slot is free (the parameter had no .grad and no earlier gradient is still
// alive there). The gradient then arrives already in the bucket, and nothing is copied.
//
// A guess can be wrong (the graph changed: another tensor of the same size was allocated first):
// that tensor then occupies the slot, and lent() says so, so the Reducer keeps the parameter's
// gradient where it is and moves it through the slot only for the reduction (putting the other
// tensor's bytes back after it).
//
// The allocator is in place only while a lender lives (see create()), not for the whole process.
//
// Thread safety: create() and destruction from any thread; arm(), disarm(), learn() and the allocations counted run on the thread that armed
// it (the training thread, which runs a CPU backward); lent() flags are cleared by whichever thread
// frees a lent tensor.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

namespace c10 {
struct DataPtr;
struct Allocator;
}  // namespace c10

namespace shoal::parallel {

class SlotLender : public std::enable_shared_from_this<SlotLender> {
 public:
  /// Gradients smaller than this are copied: the bookkeeping would cost more than the copy.
  static constexpr size_t kMinBytes = 64 << 10;

  /// A lender for `parameters` parameters, with the counting allocator in front of LibTorch's CPU
  /// allocator for as long as it (or another lender) lives. Null when the allocator cannot be put
  /// there (LibTorch keeps one of higher priority, or another replaced LibTorch's), or
  /// SHOAL_DDP_GRADIENTS_IN_BUCKETS=0 turns lending off (benchmarks compare both).
  static std::shared_ptr<SlotLender> create(size_t parameters);
  /// Takes the counting allocator out when it is the last lender.
  ~SlotLender();
  SlotLender(const SlotLender&) = delete;
  SlotLender& operator=(const SlotLender&) = delete;

  /// Parameter `index`'s gradient may be computed at `address` (`bytes`, laid out as the
  /// parameter's gradient), memory that `owner` keeps alive. Replaces the slot it had; tensors
  /// lent the old one keep it (and its memory) until they die.
  void set_slot(size_t index, void* address, size_t bytes, c10::Storage owner);

  /// From now on this thread's allocations of the gradients' sizes are counted, and placed in
  /// the slot of the parameter they became the gradient of in the last step, when `free[index]`.
  void arm(const std::vector<char>& free);
  /// Stops counting (and lending) on this thread.
  void disarm();
  /// Where a gradient's memory lies.
  enum class Where { kElsewhere, kOwnSlot, kOtherSlot };
  /// Parameter `index` has got `grad` this backward: learns which allocation it came from, and
  /// says whether that was its own slot or another parameter's (a wrong guess).
  Where learn(size_t index, const at::Tensor& grad);
  /// Whether parameter `index`'s current slot is lent to a tensor that is still alive.
  bool lent(size_t index) const;

  /// While alive, this thread's allocations are neither counted nor lent (DDP's own, during
  /// backward: they must not shift the counts or take a slot).
  class Uncounted {
   public:
    Uncounted();
    ~Uncounted();
    Uncounted(const Uncounted&) = delete;
    Uncounted& operator=(const Uncounted&) = delete;

   private:
    SlotLender* saved_;
  };

  /// The allocator's path while this lender is armed on the calling thread.
  c10::DataPtr allocate(size_t bytes, c10::Allocator& base);

  /// The slot shared with the tensors lent it: cleared when the last of them dies.
  struct Slot {
    void* address = nullptr;
    size_t bytes = 0;
    c10::Storage owner;
    std::atomic<bool> lent{false};
  };

 private:
  struct SizeClass {
    uint32_t count = 0;           // allocations of this size since arm()
    std::vector<int64_t> owner;   // per allocation index: the parameter it became (-1: none)
  };
  explicit SlotLender(size_t parameters);

  std::vector<std::shared_ptr<Slot>> slots_;
  std::unordered_map<size_t, SizeClass> classes_;
  std::vector<std::pair<size_t, uint32_t>> learnt_;  // per parameter: (bytes, index) or (0, 0)
  std::vector<char> free_;
};

}  // namespace shoal::parallel
