#include "parallel/gradient_placement.h"

#include <torch/torch.h>

#include <utility>

namespace shoal::parallel {

bool laid_out_like(const at::Tensor& grad, const at::Tensor& view) {
  return grad.scalar_type() == view.scalar_type() && grad.device() == view.device() &&
         grad.sizes() == view.sizes() && grad.strides() == view.strides();
}

bool occupies(const at::Tensor& grad, const at::Tensor& view) {
  return grad.defined() && grad.data_ptr() == view.data_ptr() && laid_out_like(grad, view);
}

bool replaceable(const at::Tensor& grad, const at::Tensor& view) {
  return grad.layout() == at::kStrided && grad.use_count() == 1 &&
         grad.storage().use_count() == 1 && !grad.requires_grad() && laid_out_like(grad, view);
}

bool Reducer::ViewPlacement::adopt(const Bucket& bucket, size_t slot, size_t, at::Tensor& grad) {
  const at::Tensor& view = bucket.views[slot];
  view.copy_(grad);
  grad = view;
  return true;
}

void Reducer::ViewPlacement::computed_in_slot(size_t index, const at::Tensor&,
                                              const at::Tensor& view) {
  r_.params_[index].mutable_grad() = view;
}

void Reducer::ViewPlacement::copied_in(size_t index, const at::Tensor& view) {
  r_.params_[index].mutable_grad() = view;
}

void Reducer::ViewPlacement::deliver(const int* used_everywhere) {
  for (size_t index = 0; index < r_.params_.size(); ++index) {
    if (r_.sparse_[index]) continue;
    if (used_everywhere != nullptr && used_everywhere[index] == 0) continue;  // unused everywhere
    if (r_.result_in_grad_[index]) continue;  // reduced through its slot, written then
    auto [b, slot] = r_.locator_[index];
    auto& view = r_.buckets_[b].views[slot];
    auto& grad = r_.params_[index].mutable_grad();
    if (!occupies(grad, view)) grad = view;
  }
}

bool Reducer::CopyPlacement::adopt(const Bucket&, size_t, size_t, at::Tensor&) { return false; }

void Reducer::CopyPlacement::computed_in_slot(size_t, const at::Tensor&, const at::Tensor&) {
  // Not reached: nothing is lent to copied gradients (Reducer::choose_placement).
}

bool Reducer::CopyPlacement::copy_out(size_t bucket_index, const int* used_everywhere,
                                      bool early) {
  torch::NoGradGuard no_grad;
  const Bucket& bucket = r_.buckets_[bucket_index];
  bool all = true;
  for (size_t slot = 0; slot < bucket.variables.size(); ++slot) {
    const size_t index = bucket.variables[slot];
    // Unused everywhere (find_unused_parameters): left as it is, as in PyTorch.
    if (used_everywhere != nullptr && used_everywhere[index] == 0) continue;
    if (r_.result_in_grad_[index]) continue;  // reduced through its slot, written then
    auto& grad = r_.params_[index].mutable_grad();
    if (occupies(grad, bucket.views[slot])) continue;  // reduced where it is
    if (!write_grad(bucket, slot, index, grad, early)) all = false;
  }
  return all;
}

bool Reducer::CopyPlacement::write_grad(const Bucket& bucket, size_t slot, size_t, at::Tensor& grad,
                                        bool) {
  const at::Tensor& view = bucket.views[slot];
  if (grad.defined()) {
    grad.copy_(view);
  } else {
    grad = view.clone();
  }
  r_.stats_.copied_bytes += static_cast<double>(view.nbytes());
  return true;
}

void Reducer::CopyPlacement::deliver(const int* used_everywhere) {
  // Each bucket's, unless written when it was reduced.
  for (size_t b = 0; b < r_.buckets_.size(); ++b) {
    if (!std::exchange(r_.buckets_[b].copied_out, false)) copy_out(b, used_everywhere, false);
  }
}

bool Reducer::SlotPlacement::adopt(const Bucket& bucket, size_t slot, size_t index,
                                   at::Tensor& grad) {
  const at::Tensor& view = bucket.views[slot];
  if (!replaceable(grad, view)) return false;
  // A slot gradient of the old buckets (or a .grad nothing else sees) moves to the new ones, so
  // the old buckets' memory is freed now.
  view.copy_(grad);
  grad = r_.slot_gradient(bucket, slot, index);
  return true;
}

void Reducer::SlotPlacement::before_arrival(size_t index, const at::Tensor& grad) {
  r_.release_slot(index, grad);
}

void Reducer::SlotPlacement::computed_in_slot(size_t index, const at::Tensor& grad,
                                              const at::Tensor&) {
  // This slot's gradient now: a reference kept across set_to_none moves out before the slot is
  // written again (release_slot).
  r_.handed_[index] = grad.storage().getWeakStorageImpl();
}

bool Reducer::SlotPlacement::copies_out_on_launch() const { return r_.gradient_scale_ == 1.0; }

bool Reducer::SlotPlacement::write_grad(const Bucket& bucket, size_t slot, size_t index,
                                        at::Tensor& grad, bool early) {
  if (!grad.defined() || replaceable(grad, bucket.views[slot])) {
    grad = r_.slot_gradient(bucket, slot, index);
    return true;
  }
  // Seen elsewhere now (a gradient autograd has just stolen is still referenced by the engine):
  // decided when backward ends.
  if (early) return false;
  return CopyPlacement::write_grad(bucket, slot, index, grad, early);
}

}  // namespace shoal::parallel
