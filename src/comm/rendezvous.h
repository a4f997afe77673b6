// The rendezvous every process runs once in init_process_group: have `world_size` distinct ranks
// met through the store, started with one world size? Separate from init so that a simulation
// can run it for thousands of ranks without a process group.
//
// Cost: O(1) store requests per rank, at most 7 (about 7·N for the job), each answered by
// the store without polling: a counter claims the rank, the first arriver publishes its world size
// for the others to compare with their own, a counter of arrivals lets the last arriver publish
// one verdict ("ok" or the first error found), and every rank waits for that verdict on the
// store's side. A mistake (two processes claiming one rank, world sizes that disagree) becomes the
// verdict, so that every rank reports it as soon as it is found, not at the time-out. When the
// verdict does not come in time, the first rank to time out lists the ranks that never claimed
// theirs (a few, by number, and how many in all) for the others to report too.
//
// Thread safety: one call per rank; many ranks (threads) may call it at once on one store.
#pragma once

#include <string>

#include "shoal/comm/store.h"

namespace shoal::comm {

/// Meets the other ranks; returns once all `world_size` have arrived and agree. Throws
/// InvalidArgument (a rank claimed twice, world sizes that disagree) or TimeoutError naming the
/// absent ranks after `timeout`; every message starts "[rank R/N]".
void rendezvous(Store& store, int rank, int world_size, Milliseconds timeout);

}  // namespace shoal::comm
