#include "compat/autocast.h"

#include <ATen/autocast_mode.h>
#include <torch/version.h>

namespace shoal::compat {
namespace {

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
bool cpu_enabled() { return at::autocast::is_autocast_enabled(at::kCPU); }
void set_cpu_enabled(bool enabled) { at::autocast::set_autocast_enabled(at::kCPU, enabled); }
c10::ScalarType cpu_dtype() { return at::autocast::get_autocast_dtype(at::kCPU); }
void set_cpu_dtype(c10::ScalarType dtype) { at::autocast::set_autocast_dtype(at::kCPU, dtype); }
bool cuda_enabled() { return at::autocast::is_autocast_enabled(at::kCUDA); }
void set_cuda_enabled(bool enabled) { at::autocast::set_autocast_enabled(at::kCUDA, enabled); }
c10::ScalarType cuda_dtype() { return at::autocast::get_autocast_dtype(at::kCUDA); }
void set_cuda_dtype(c10::ScalarType dtype) { at::autocast::set_autocast_dtype(at::kCUDA, dtype); }
#else
bool cpu_enabled() { return at::autocast::is_cpu_enabled(); }
void set_cpu_enabled(bool enabled) { at::autocast::set_cpu_enabled(enabled); }
c10::ScalarType cpu_dtype() { return at::autocast::get_autocast_cpu_dtype(); }
void set_cpu_dtype(c10::ScalarType dtype) { at::autocast::set_autocast_cpu_dtype(dtype); }
bool cuda_enabled() { return at::autocast::is_enabled(); }
void set_cuda_enabled(bool enabled) { at::autocast::set_enabled(enabled); }
c10::ScalarType cuda_dtype() { return at::autocast::get_autocast_gpu_dtype(); }
void set_cuda_dtype(c10::ScalarType dtype) { at::autocast::set_autocast_gpu_dtype(dtype); }
#endif

}  // namespace

bool cpu_autocast_supports(c10::ScalarType dtype) {
  if (dtype == c10::ScalarType::BFloat16) return true;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  return dtype == c10::ScalarType::Half;
#else
  return false;
#endif
}

CpuAutocastGuard::CpuAutocastGuard(std::optional<c10::ScalarType> dtype) {
  if (!dtype) return;
  active_ = true;
  previous_enabled_ = cpu_enabled();
  previous_dtype_ = cpu_dtype();
  // What torch.autocast.__enter__ does for the CPU.
  set_cpu_enabled(true);
  set_cpu_dtype(*dtype);
  at::autocast::increment_nesting();
}

CpuAutocastGuard::~CpuAutocastGuard() {
  if (!active_) return;
  // torch.autocast.__exit__: the cast cache is dropped when the outermost scope ends.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  set_cpu_enabled(previous_enabled_);
  set_cpu_dtype(previous_dtype_);
}

CudaAutocastGuard::CudaAutocastGuard(std::optional<c10::ScalarType> dtype) {
  if (!dtype) return;
  active_ = true;
  previous_enabled_ = cuda_enabled();
  previous_dtype_ = cuda_dtype();
  set_cuda_enabled(true);
  set_cuda_dtype(*dtype);
  at::autocast::increment_nesting();
}

CudaAutocastGuard::~CudaAutocastGuard() {
  if (!active_) return;
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  set_cuda_enabled(previous_enabled_);
  set_cuda_dtype(previous_dtype_);
}

}  // namespace shoal::compat
