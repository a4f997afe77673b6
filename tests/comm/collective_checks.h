// Checks of every collective, shared by the thread, forked-process and mpirun test programs.
//
// Each check runs one kind of collective on `pg` with tensors of `numel` elements and compares the
// result with values computed here independently (in float64 from every rank's known input). A
// wrong result throws std::runtime_error naming the rank, the check and the values, so that a
// failure reaches the test from a thread, a forked child or an mpirun rank alike. Every rank of the
// group must call the same checks in the same order.
//
// Thread safety: each check uses only its own group.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "shoal/comm/process_group.h"

namespace shoal::comm::testing {

using CheckFn = void (*)(ProcessGroup& pg, int64_t numel);

struct NamedCheck {
  const char* name;
  CheckFn fn;
};

void check_allreduce_ops(ProcessGroup& pg, int64_t numel);
void check_allreduce_dtypes(ProcessGroup& pg, int64_t numel);
void check_broadcast(ProcessGroup& pg, int64_t numel);
void check_reduce(ProcessGroup& pg, int64_t numel);
void check_allgather(ProcessGroup& pg, int64_t numel);
void check_gather(ProcessGroup& pg, int64_t numel);
void check_scatter(ProcessGroup& pg, int64_t numel);
void check_reduce_scatter(ProcessGroup& pg, int64_t numel);
void check_send_recv(ProcessGroup& pg, int64_t numel);
void check_barrier(ProcessGroup& pg, int64_t numel);
/// check_barrier with `barrier` in place of pg.barrier()->wait(): a test passes one that does not
/// wait to see the check fail.
void check_barrier_with(ProcessGroup& pg, int64_t numel, const std::function<void()>& barrier);
void check_sub_group(ProcessGroup& pg, int64_t numel);
/// async_op = false (allreduce, broadcast, all_gather_into_tensor, reduce_scatter_tensor): each
/// call returns with its Work completed and its result in place, also behind an asynchronous
/// collective still in flight.
void check_blocking_calls(ProcessGroup& pg, int64_t numel);

/// Every check above, in a fixed order.
const std::vector<NamedCheck>& all_checks();

/// The element counts every backend is tested with: 0, 1, an odd count and about a million.
const std::vector<int64_t>& element_counts();

}  // namespace shoal::comm::testing
