#include "compat/thread_parallelism.h"

#include <dlfcn.h>

#include <ATen/Parallel.h>

namespace shoal::compat {

void run_intra_op_serially_on_this_thread() {
  using SetNumThreads = void (*)(int);
  // Resolved once: libgomp is loaded with LibTorch when the build uses OpenMP.
  static const auto set_num_threads =
      reinterpret_cast<SetNumThreads>(::dlsym(RTLD_DEFAULT, "omp_set_num_threads"));
  if (set_num_threads != nullptr) set_num_threads(1);
}

void apply_omp_num_threads(int n) {
  if (n <= 0) return;
  at::set_num_threads(n);  // omp_set_num_threads, and LibTorch's own count
  using SetNumThreads = void (*)(int);
  const auto openblas =
      reinterpret_cast<SetNumThreads>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (openblas != nullptr) openblas(n);
}

void stop_blas_threads() {
  using Shutdown = int (*)();
  const auto shutdown = reinterpret_cast<Shutdown>(::dlsym(RTLD_DEFAULT, "blas_thread_shutdown_"));
  if (shutdown != nullptr) shutdown();
}

}  // namespace shoal::compat
