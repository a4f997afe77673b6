// CPU autocast (torch.autocast("cpu", dtype=...)) as a scope, over LibTorch's autocast switches,
// whose names changed between versions (set_cpu_enabled in 1.x; set_autocast_enabled(kCPU, ...)
// from 2.4 on).
//
// Thread safety: autocast is thread-local state; a guard belongs to the thread that made it.
#pragma once

#include <c10/core/ScalarType.h>

#include <optional>

namespace shoal::compat {

/// While alive, CPU operators run under autocast to `dtype` (nothing when it is empty), as inside
/// Python's `with torch.autocast("cpu", dtype=dtype):`; the previous state comes back after.
class CpuAutocastGuard {
 public:
  explicit CpuAutocastGuard(std::optional<c10::ScalarType> dtype);
  ~CpuAutocastGuard();
  CpuAutocastGuard(const CpuAutocastGuard&) = delete;
  CpuAutocastGuard& operator=(const CpuAutocastGuard&) = delete;

 private:
  bool active_ = false;
  bool previous_enabled_ = false;
  c10::ScalarType previous_dtype_ = c10::ScalarType::BFloat16;
};

/// While alive, CUDA operators run under autocast to `dtype` (nothing when it is empty), as
/// inside Python's `with torch.autocast("cuda", dtype=dtype):` (float16 on CUDA: the fp16 recipe
/// with a GradScaler).
class CudaAutocastGuard {
 public:
  explicit CudaAutocastGuard(std::optional<c10::ScalarType> dtype);
  ~CudaAutocastGuard();
  CudaAutocastGuard(const CudaAutocastGuard&) = delete;
  CudaAutocastGuard& operator=(const CudaAutocastGuard&) = delete;

 private:
  bool active_ = false;
  bool previous_enabled_ = false;
  c10::ScalarType previous_dtype_ = c10::ScalarType::Half;
};

/// Whether this LibTorch's CPU autocast runs in `dtype`: bfloat16 always; float16 from
/// LibTorch 2.4 on (1.13's CPU autocast knows bfloat16 only, and its CPU kernels lack float16).
bool cpu_autocast_supports(c10::ScalarType dtype);

}  // namespace shoal::compat
