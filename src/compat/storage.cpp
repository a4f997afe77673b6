#include "compat/storage.h"

#include <c10/core/StorageImpl.h>

namespace shoal::compat {

void free_storage(const at::Tensor& tensor) {
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, storage->device()));
  storage->set_nbytes(static_cast<size_t>(0));
}

void allocate_storage(const at::Tensor& tensor, size_t nbytes) {
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  if (storage->nbytes() == nbytes && (nbytes == 0 || storage->data_ptr().get() != nullptr)) return;
  storage->set_data_ptr_noswap(storage->allocator()->allocate(nbytes));
  storage->set_nbytes(nbytes);
}

size_t storage_bytes(const at::Tensor& tensor) {
  return static_cast<size_t>(tensor.storage().nbytes());
}

}  // namespace shoal::compat
