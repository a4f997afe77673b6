#include "compat/ddp_semantics.h"

#include <torch/version.h>

namespace shoal::compat {

bool ddp_no_sync_use_counts() { return TORCH_VERSION_MAJOR >= 2; }

}  // namespace shoal::compat
