// Stores built on c10d's HashStore, FileStore and TCPStore (private to the library).
//
// The only code outside compat/ sees is shoal::comm::Store; backends built on c10d (Gloo, NCCL) get
// the c10d store back through the adapter in c10d_store.cpp, which also wraps a user's own Store.
//
// Thread safety: as c10d's stores, every method may be called concurrently.
#pragma once

#include <memory>

#include "shoal/comm/store.h"

namespace shoal::compat {

/// A c10d view of any Shoal store (the original c10d store when it was made by a factory here).
/// Returned as an opaque shared pointer holding an intrusive_ptr<c10d::Store>.
struct C10dStoreRef;
std::shared_ptr<C10dStoreRef> to_c10d_store(const std::shared_ptr<comm::Store>& store);

/// Whether this LibTorch's TCPStore client can join the store that a torchrun agent of PyTorch
/// 2.x (`agent_is_2x`) or 1.x serves: only one of its own generation. 2.x servers answer 1.13's
/// requests with a connection reset (the legacy server) or never (the libuv server, the default),
/// as the wire protocol changed (2.x opens with a validation message and renumbered the requests).
bool can_join_torchrun_agent_store(bool agent_is_2x);

}  // namespace shoal::compat
