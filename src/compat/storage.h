// Freeing and re-allocating a tensor's memory while its views stay valid, as PyTorch's FSDP does
// with `storage.resize_(0)`: the views keep their sizes, strides and autograd identity (saved
// tensors of backward still name them), only the bytes come and go.
//
// Thread safety: no concurrent use of the tensor, or of any view of it, while its storage changes.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>

namespace shoal::compat {

/// Gives back the memory of `tensor`'s storage (size 0). Its views must not be read until
/// allocate_storage() gives them memory again.
void free_storage(const at::Tensor& tensor);

/// Gives `tensor`'s storage `nbytes` fresh, uninitialised bytes from its allocator (a no-op
/// when it already has them).
void allocate_storage(const at::Tensor& tensor, size_t nbytes);

/// Bytes `tensor`'s storage holds now (0 once freed).
size_t storage_bytes(const at::Tensor& tensor);

}  // namespace shoal::compat
