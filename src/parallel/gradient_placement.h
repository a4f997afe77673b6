// Where the Reducer keeps each parameter's gradient relative to its bucket: one of three layouts,
// chosen by Reducer::choose_placement() (at construction, and again when what it depends on
// changes: a comm hook registered before the first backward, static_graph's first iteration
// learnt).
//
//   ViewPlacement  (gradient_as_bucket_view): .grad is the bucket view itself, so the bucket is
//                  the gradient and nothing is copied out.
//   CopyPlacement  plain gradients, copied into the bucket when they arrive and copied back out
//                  once it is reduced (overlapped reduction, unused parameters to find,
//                  debug_detail: where a .grad must change exactly when PyTorch's does).
//   SlotPlacement  plain gradients that are tensors of their own over their bucket slot's memory
//                  (Reducer::slot_gradient): from the second step autograd accumulates straight
//                  into the slot and nothing is copied in or out. Only with inline reduction (a
//                  bucket's .grads are its average once the hook that fills it returns), no
//                  unused parameters to find and no debug_detail.
//
// Thread safety: as the Reducer (driven by its thread only).
#pragma once

#include <ATen/core/Tensor.h>

#include "parallel/reducer.h"

namespace shoal::parallel {

/// Whether `grad` has `view`'s dtype, device, shape and strides.
bool laid_out_like(const at::Tensor& grad, const at::Tensor& view);
/// Whether `grad` already is `view`'s memory, laid out like it (the bucket view itself, or a slot
/// gradient): nothing to copy in or out.
bool occupies(const at::Tensor& grad, const at::Tensor& view);
/// Whether `grad` can be replaced by another tensor of the same values without anyone seeing it:
/// only the parameter refers to it and to its memory, and it is laid out like `view`.
bool replaceable(const at::Tensor& grad, const at::Tensor& view);

class Reducer::Placement {
 public:
  explicit Placement(Reducer& reducer) : r_(reducer) {}
  virtual ~Placement() = default;
  Placement(const Placement&) = delete;
  Placement& operator=(const Placement&) = delete;

  /// When buckets are built: parameter `index`'s existing .grad `grad` (defined) brought into
  /// slot `slot` of `bucket`, the new buckets' layout. Returns whether its bytes were copied.
  virtual bool adopt(const Bucket& bucket, size_t slot, size_t index, at::Tensor& grad) = 0;
  /// A gradient arrives for parameter `index` (before anything else looks at it).
  virtual void before_arrival(size_t /*index*/, const at::Tensor& /*grad*/) {}
  /// Parameter `index`'s gradient `grad` was computed in its slot (`view`'s memory).
  virtual void computed_in_slot(size_t index, const at::Tensor& grad, const at::Tensor& view) = 0;
  /// Parameter `index`'s gradient was copied into its slot `view`.
  virtual void copied_in(size_t /*index*/, const at::Tensor& /*view*/) {}
  /// Whether a bucket's .grads are written as soon as it is reduced inline, while it is in cache,
  /// rather than all at the end of backward (copy_out with early = true).
  virtual bool copies_out_on_launch() const { return false; }
  /// The .grads of bucket `bucket_index` from its reduced contents, except those of parameters
  /// `used_everywhere` (when given) marks unused on every rank; `early` (during backward) may
  /// leave some to the end of backward. Returns whether every .grad of the bucket holds the
  /// result.
  virtual bool copy_out(size_t /*bucket_index*/, const int* /*used_everywhere*/, bool /*early*/) {
    return true;
  }
  /// At the end of backward, every bucket reduced: the results into the .grads.
  virtual void deliver(const int* used_everywhere) = 0;

 protected:
  Reducer& r_;
};

class Reducer::ViewPlacement final : public Reducer::Placement {
 public:
  using Placement::Placement;
  bool adopt(const Bucket& bucket, size_t slot, size_t index, at::Tensor& grad) override;
  void computed_in_slot(size_t index, const at::Tensor& grad, const at::Tensor& view) override;
  void copied_in(size_t index, const at::Tensor& view) override;
  void deliver(const int* used_everywhere) override;
};

class Reducer::CopyPlacement : public Reducer::Placement {
 public:
  using Placement::Placement;
  bool adopt(const Bucket& bucket, size_t slot, size_t index, at::Tensor& grad) override;
  void computed_in_slot(size_t index, const at::Tensor& grad, const at::Tensor& view) override;
  bool copy_out(size_t bucket_index, const int* used_everywhere, bool early) override;
  void deliver(const int* used_everywhere) override;

 protected:
  /// One .grad of copy_out (not already the slot's memory); false: left to the end of backward.
  virtual bool write_grad(const Bucket& bucket, size_t slot, size_t index, at::Tensor& grad,
                          bool early);
};

class Reducer::SlotPlacement final : public Reducer::CopyPlacement {
 public:
  using CopyPlacement::CopyPlacement;
  bool adopt(const Bucket& bucket, size_t slot, size_t index, at::Tensor& grad) override;
  void before_arrival(size_t index, const at::Tensor& grad) override;
  void computed_in_slot(size_t index, const at::Tensor& grad, const at::Tensor& view) override;
  bool copies_out_on_launch() const override;

 protected:
  bool write_grad(const Bucket& bucket, size_t slot, size_t index, at::Tensor& grad,
                  bool early) override;
};

}  // namespace shoal::parallel
