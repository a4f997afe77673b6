#include "compat/thread_parallelism.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>

namespace shoal::compat {

void run_intra_op_serially_on_this_thread() {
  using SetNumThreads = void (*)(int);
  // Resolved once: libgomp is loaded with LibTorch when the build uses OpenMP.
  static const auto set_num_threads =
      reinterpret_cast<SetNumThreads>(::dlsym(RTLD_DEFAULT, "omp_set_num_threads"));
  if (set_num_threads != nullptr) set_num_threads(1);
}

void set_compute_threads(int threads) {
  at::set_num_threads(threads);
  using SetThreads = void (*)(int);
  // Found at run time: no link-time dependency on the BLAS LibTorch happens to use.
  static const auto set_blas_threads =
      reinterpret_cast<SetThreads>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (set_blas_threads != nullptr) set_blas_threads(threads);
}

}  // namespace shoal::compat
