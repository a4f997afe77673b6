// GlooGroup: c10d's ProcessGroupGloo behind the C10dGroup interface (LibTorch 1.13 and 2.x).
//
// The Gloo backend (src/comm/gloo/) builds on this and nothing else from c10d.
//
// Thread safety: as C10dGroup.
#pragma once

#include <memory>
#include <string>

#include "compat/c10d_group.h"
#include "shoal/comm/store.h"

namespace shoal::compat {

/// Sets SIGPIPE to "ignore" when the process has left it at its default (terminate), so that a
/// write to a socket whose peer is gone fails with EPIPE instead of killing the process; a handler
/// or disposition the program chose stays. Returns whether it changed the disposition.
bool ignore_sigpipe_unless_handled();

class GlooGroup : public C10dGroup {
 public:
  /// `hostname` is the address the other ranks reach this one at ("127.0.0.1" on one host);
  /// `interface`, when not empty, names the network interface instead (GLOO_SOCKET_IFNAME).
  GlooGroup(std::shared_ptr<comm::Store> store, int rank, int size, comm::Milliseconds timeout,
            const std::string& hostname, const std::string& interface = "");

  /// Whether Gloo reduces this dtype natively (else the backend converts).
  static bool supports_dtype(at::ScalarType type);
};

}  // namespace shoal::compat
