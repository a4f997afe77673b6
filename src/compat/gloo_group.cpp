#include "compat/gloo_group.h"

#include <signal.h>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "compat/c10d_group_impl.h"
#include "compat/c10d_store.h"
#include "compat/c10d_store_ref.h"
#include "shoal/error.h"

namespace shoal::compat {

bool ignore_sigpipe_unless_handled() {
  struct sigaction current {};
  if (sigaction(SIGPIPE, nullptr, &current) != 0) return false;
  const bool left_at_default = !(current.sa_flags & SA_SIGINFO) && current.sa_handler == SIG_DFL;
  if (!left_at_default) return false;
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  return sigaction(SIGPIPE, &ignore, nullptr) == 0;
}

GlooGroup::GlooGroup(std::shared_ptr<comm::Store> store, int rank, int size,
                     comm::Milliseconds timeout, const std::string& hostname,
                     const std::string& interface) {
  // Gloo writes to its sockets with writev, which raises SIGPIPE when a peer has closed its end:
  // without this a dead peer could kill the survivors silently instead of failing their
  // operation with an error that names it (Python ignores SIGPIPE for every PyTorch program).
  ignore_sigpipe_unless_handled();
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(
      interface.empty() ? c10d::ProcessGroupGloo::createDeviceForHostname(hostname)
                        : c10d::ProcessGroupGloo::createDeviceForInterface(interface));
  // Two worker threads let a second bucket's allreduce proceed while the first one finishes
  // (the same default as torch.distributed).
  options->threads = 2;
  auto ref = to_c10d_store(store);
  impl_->pg = c10::make_intrusive<c10d::ProcessGroupGloo>(ref->store, rank, size, options);
}

bool GlooGroup::supports_dtype(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kInt:
    case at::kLong:
    case at::kByte:
    case at::kChar:
      return true;
    default:
      return false;
  }
}

}  // namespace shoal::compat
