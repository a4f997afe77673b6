// What one communication operation is, for its error and time-out messages.
//
// Every collective and point-to-point call gets a label: a few numbers (rank, sequence number,
// element count, dtype, device type, reduce op, root or peer, tag) and nothing else. The text a message needs
// ("[rank 1/4] allreduce #12 (4.0 MB float32, sum)") is built from them only when a message is
// written, so that an operation that succeeds, nearly all of them, allocates no strings at all.
//
// Thread safety: a label is an immutable value; copy it freely.
#pragma once

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>

#include "shoal/comm/types.h"

namespace shoal::comm {

struct OpLabel {
  /// Which side of a point-to-point operation `peer` is.
  enum class PeerRole : int8_t { kNone, kDestination, kSource };

  const char* name = "";  ///< "allreduce", "broadcast", ... (a string literal)
  uint64_t sequence = 0;  ///< per-group sequence number, equal on every rank
  int rank = 0;           ///< this rank in its group
  int size = 1;           ///< the group's size
  int64_t numel = -1;     ///< elements of the operation's tensor; -1: no tensor
  at::ScalarType dtype = at::ScalarType::Undefined;
  /// The tensor's device type; described only when it is not the CPU ("4.0 MB float32 on cuda").
  c10::DeviceType device = c10::DeviceType::CPU;
  int reduce_op = -1;     ///< a ReduceOp, or -1
  int root = -1;          ///< a collective's root, or -1
  int peer = -1;          ///< a send's destination or a receive's source, or -1
  PeerRole peer_role = PeerRole::kNone;
  int tag = -1;           ///< a point-to-point tag, or -1
  /// Free text instead of the tensor details, for the rare operations without a tensor that
  /// still need detail ("3 ranks"); empty otherwise (no allocation).
  std::string detail;

  /// "allreduce #12 (4.0 MB float32, sum)", "send #3 (4.0 kB float32 to rank 2, tag 0)".
  std::string description() const;
  /// "[rank 1/4] " + description().
  std::string prefix() const;
};

/// "[rank 1/4]".
std::string rank_prefix(int rank, int size);

/// "4.0 MB float32" for a tensor of `numel` elements of `dtype`.
std::string describe_elements(int64_t numel, at::ScalarType dtype);

/// PyTorch's Python name of a dtype ("float32"), which users know, rather than c10's ("Float").
const char* dtype_name(at::ScalarType type);

}  // namespace shoal::comm
