// What C10dGroup holds (compat-internal: includes c10d headers). The c10d base class of the
// backends is c10d::ProcessGroup in LibTorch 1.13 and c10d::Backend in 2.x.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/version.h>

#include "compat/c10d_group.h"

namespace shoal::compat {

#if TORCH_VERSION_MAJOR >= 2
using C10dBackend = c10d::Backend;
#else
using C10dBackend = c10d::ProcessGroup;
#endif

struct C10dGroup::Impl {
  c10::intrusive_ptr<C10dBackend> pg;
  bool native_avg = false;  // the backend reduces with AVG itself (NCCL)
};

}  // namespace shoal::compat
