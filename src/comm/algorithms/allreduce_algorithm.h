// Allreduce algorithms over point-to-point messages, and the cost model that picks one per call.
//
// The schedules (ring, recursive doubling, Rabenseifner, binomial tree) need only a PeerLink:
// blocking point-to-point exchanges between the ranks of one group. Every rank of the group calls
// the same function with the same algorithm, element count and dtype; each rank ends with the
// same bits (every element is reduced once and then copied, or reduced pairwise with a
// commutative operation).
//
// The cost model is Hockney's: a message of m bytes costs alpha + m * beta on its link (one
// within a node, another between nodes), and reducing m bytes costs m * gamma; a step of a
// schedule costs what its slowest pair costs. Where a node has fewer cores than ranks sending
// at once in a step, their messages' software costs queue for the cores: the step costs that
// many times more. choose_allreduce_algorithm() returns the
// schedule the model predicts fastest.
//
// Thread safety: the functions are pure or touch only their arguments; a PeerLink is used by one
// thread at a time.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>

#include "shoal/comm/types.h"

namespace shoal::comm::algorithms {

enum class AllreduceAlgorithm {
  kNative,             ///< the transport's own allreduce (c10d Gloo's ring)
  kRing,               ///< reduce-scatter then allgather around a ring: 2(n-1) steps of B/n
  kTree,               ///< binomial tree: reduce onto rank 0, then broadcast from it
  kRecursiveDoubling,  ///< log2(n) exchanges of the whole tensor
  kRabenseifner,       ///< recursive-halving reduce-scatter, recursive-doubling allgather
  kAuto,               ///< one of the four above per call, by the cost model
};

/// "native", "ring", "tree", "recursive_doubling", "rabenseifner", "auto".
const char* to_string(AllreduceAlgorithm algorithm);

/// The algorithm `name` names (as to_string() writes it); std::nullopt for anything else.
std::optional<AllreduceAlgorithm> allreduce_algorithm_from_name(const std::string& name);

/// One kind of link: a message of m bytes takes alpha_s + m * beta_s_per_byte seconds.
struct LinkCost {
  double alpha_s = 0;
  double beta_s_per_byte = 0;
};

struct CostModel {
  LinkCost intra_node;
  LinkCost inter_node;
  double gamma_s_per_byte = 0;  ///< reducing one byte of float32 into another

  /// The table's constants (see allreduce_algorithm.cpp for where they come from).
  static CostModel defaults();
};

/// Where the ranks are: `size` ranks, node by node, `ranks_per_node` on each (the last node may
/// have fewer), on nodes of `cores_per_node` cores (0: as many as ranks).
struct Topology {
  int size = 1;
  int ranks_per_node = 1;
  int cores_per_node = 0;
};

/// Predicted seconds of an allreduce of `bytes` by `algorithm` (not kNative or kAuto).
double predicted_seconds(AllreduceAlgorithm algorithm, int64_t bytes, const Topology& topology,
                         const CostModel& model);

/// The schedule (ring, tree, recursive doubling or Rabenseifner) with the least predicted time;
/// on a tie the earlier one in that order.
AllreduceAlgorithm choose_allreduce_algorithm(int64_t bytes, const Topology& topology,
                                              const CostModel& model);

/// Blocking point-to-point messages between the ranks of one group.
class PeerLink {
 public:
  virtual ~PeerLink() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// Sends `send` to rank `dst` while receiving into `recv` from rank `src`, and returns when both
  /// are done. An undefined tensor means no message that way. Tensors are contiguous.
  virtual void exchange(const at::Tensor& send, int dst, const at::Tensor& recv, int src) = 0;
};

/// Reduces `tensor` (1-D, contiguous, the dtype it is reduced in) in place across `link`'s ranks
/// with `algorithm` (not kNative or kAuto). kAvg is not handled here: reduce with kSum and divide.
void allreduce_with(AllreduceAlgorithm algorithm, at::Tensor& tensor, ReduceOp op, PeerLink& link);

/// `into` = op(`into`, `other`), element-wise; kAvg reduces as kSum.
void combine_into(const at::Tensor& into, const at::Tensor& other, ReduceOp op);

}  // namespace shoal::comm::algorithms
