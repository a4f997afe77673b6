#include "compat/thread_parallelism.h"

#include <dlfcn.h>

namespace shoal::compat {

void run_intra_op_serially_on_this_thread() {
  using SetNumThreads = void (*)(int);
  // Resolved once: libgomp is loaded with LibTorch when the build uses OpenMP.
  static const auto set_num_threads =
      reinterpret_cast<SetNumThreads>(::dlsym(RTLD_DEFAULT, "omp_set_num_threads"));
  if (set_num_threads != nullptr) set_num_threads(1);
}

}  // namespace shoal::compat
