// The cost model of allreduce_algorithm.h: names, the constants' table, predictions, the choice.
#include <algorithm>
#include <array>
#include <cstring>

#include "comm/algorithms/allreduce_algorithm.h"
#include "shoal/error.h"

namespace shoal::comm::algorithms {
namespace {

// Within a node (Gloo's TCP over loopback), measured on this project's 2-vCPU build host: alpha
// is one 4 KiB point-to-point exchange through c10d Gloo between two ranks of one process (82 us:
// a send, a receive and the wake-ups of both ends), beta what a 16 MiB two-rank ring allreduce
// takes per byte beyond that (about 1 ns, of which gamma below is the reduction).
constexpr double kIntraAlphaS = 80e-6;
constexpr double kIntraBetaSPerByte = 0.75e-9;
// Between nodes: the figures the scaling analysis assumes for a 100 Gbit/s cluster network
// (10 us per message and 12.5 GB/s on the wire, on top of the software cost within a node).
constexpr double kInterAlphaS = kIntraAlphaS + 10e-6;
constexpr double kInterBetaSPerByte = kIntraBetaSPerByte + 1.0 / 12.5e9;
// Reducing (at::add_ of float32, one thread): about 4 GB/s of the bytes reduced on the build
// host, read twice and written once.
constexpr double kGammaSPerByte = 0.25e-9;

constexpr std::array<AllreduceAlgorithm, 6> kAllAlgorithms{
    AllreduceAlgorithm::kNative, AllreduceAlgorithm::kRing, AllreduceAlgorithm::kTree,
    AllreduceAlgorithm::kRecursiveDoubling, AllreduceAlgorithm::kRabenseifner,
    AllreduceAlgorithm::kAuto};

// The order choose_allreduce_algorithm() prefers on a tie: the ring first (it is what native
// runs, so a tie changes nothing).
constexpr std::array<AllreduceAlgorithm, 4> kSchedules{
    AllreduceAlgorithm::kRing, AllreduceAlgorithm::kTree, AllreduceAlgorithm::kRecursiveDoubling,
    AllreduceAlgorithm::kRabenseifner};

int ceil_log2(int n) {
  int steps = 0;
  while ((1 << steps) < n) ++steps;
  return steps;
}

int floor_pow2(int n) {
  int p = 1;
  while (p * 2 <= n) p *= 2;
  return p;
}

// The costs of a whole schedule: steps on each kind of link, and bytes reduced.
struct Tally {
  const Topology& topology;
  const CostModel& model;
  double seconds = 0;

  // One step in which `senders` ranks (every rank unless said) each send `bytes`; `intra` when
  // no pair crosses a node.
  void step(double bytes, bool intra, int senders = 0) {
    const LinkCost& link = intra ? model.intra_node : model.inter_node;
    seconds += (link.alpha_s + bytes * link.beta_s_per_byte) * queueing(senders);
  }
  // How many times longer a step takes when a node's senders outnumber its cores.
  double queueing(int senders) const {
    const int cores = topology.cores_per_node;
    const int per_node = std::min(topology.ranks_per_node, senders > 0 ? senders : topology.size);
    return cores > 0 && per_node > cores ? static_cast<double>(per_node) / cores : 1.0;
  }
  void reduce(double bytes) { seconds += bytes * model.gamma_s_per_byte; }

  bool one_node() const { return topology.ranks_per_node >= topology.size; }
  // Pairs r, r + distance with r a multiple of 2 * distance (the recursive schedules' and the
  // tree's) stay within a node when the nodes are whole multiples of such aligned blocks.
  bool aligned_intra(int distance) const {
    return one_node() || topology.ranks_per_node % (2 * distance) == 0;
  }
};

double ring_seconds(double bytes, Tally& t) {
  const int n = t.topology.size;
  const double block = bytes / n;
  for (int s = 0; s < 2 * (n - 1); ++s) t.step(block, t.one_node());
  t.reduce(block * (n - 1));
  return t.seconds;
}

// Step k of the reduce has the ranks that are odd multiples of 2^k send: about n / 2^(k+1).
double tree_seconds(double bytes, Tally& t) {
  const int steps = ceil_log2(t.topology.size);
  for (int k = 0; k < steps; ++k) {
    const int senders = std::max(1, t.topology.size >> (k + 1));
    t.step(bytes, t.aligned_intra(1 << k), senders);  // reduce
    t.reduce(bytes);
    t.step(bytes, t.aligned_intra(1 << k), senders);  // broadcast
  }
  return t.seconds;
}

// The folding of a non-power-of-two n: one exchange of the whole tensor in (then reduced) and
// one out, between ranks 2i and 2i + 1. After it the schedule's partners are no longer aligned
// blocks of real ranks; their steps are then counted as crossing nodes (when there are several).
bool fold(double bytes, Tally& t) {
  const int extra = t.topology.size - floor_pow2(t.topology.size);
  if (extra == 0) return false;
  t.step(bytes, t.aligned_intra(1), extra);
  t.reduce(bytes);
  t.step(bytes, t.aligned_intra(1), extra);
  return true;
}

double recursive_doubling_seconds(double bytes, Tally& t) {
  const bool folded = fold(bytes, t);
  for (int mask = 1; mask < floor_pow2(t.topology.size); mask <<= 1) {
    t.step(bytes, folded ? t.one_node() : t.aligned_intra(mask));
    t.reduce(bytes);
  }
  return t.seconds;
}

double rabenseifner_seconds(double bytes, Tally& t) {
  const bool folded = fold(bytes, t);
  const int p = floor_pow2(t.topology.size);
  double part = bytes;
  for (int mask = p / 2; mask >= 1; mask >>= 1) {
    part /= 2;
    const bool intra = folded ? t.one_node() : t.aligned_intra(mask);
    t.step(part, intra);  // reduce-scatter
    t.reduce(part);
    t.step(part, intra);  // allgather
  }
  return t.seconds;
}

}  // namespace

const char* to_string(AllreduceAlgorithm algorithm) {
  switch (algorithm) {
    case AllreduceAlgorithm::kNative: return "native";
    case AllreduceAlgorithm::kRing: return "ring";
    case AllreduceAlgorithm::kTree: return "tree";
    case AllreduceAlgorithm::kRecursiveDoubling: return "recursive_doubling";
    case AllreduceAlgorithm::kRabenseifner: return "rabenseifner";
    case AllreduceAlgorithm::kAuto: return "auto";
  }
  return "?";
}

std::optional<AllreduceAlgorithm> allreduce_algorithm_from_name(const std::string& name) {
  for (AllreduceAlgorithm a : kAllAlgorithms) {
    if (name == to_string(a)) return a;
  }
  return std::nullopt;
}

CostModel CostModel::defaults() {
  CostModel model;
  model.intra_node = {kIntraAlphaS, kIntraBetaSPerByte};
  model.inter_node = {kInterAlphaS, kInterBetaSPerByte};
  model.gamma_s_per_byte = kGammaSPerByte;
  return model;
}

double predicted_seconds(AllreduceAlgorithm algorithm, int64_t bytes, const Topology& topology,
                         const CostModel& model) {
  Tally tally{topology, model};
  const auto b = static_cast<double>(bytes);
  if (topology.size <= 1) return 0;
  switch (algorithm) {
    case AllreduceAlgorithm::kRing: return ring_seconds(b, tally);
    case AllreduceAlgorithm::kTree: return tree_seconds(b, tally);
    case AllreduceAlgorithm::kRecursiveDoubling: return recursive_doubling_seconds(b, tally);
    case AllreduceAlgorithm::kRabenseifner: return rabenseifner_seconds(b, tally);
    case AllreduceAlgorithm::kNative:
    case AllreduceAlgorithm::kAuto: break;
  }
  SHOAL_THROW(InvalidArgument, "predicted_seconds: '", to_string(algorithm),
              "' is not a schedule the model knows");
}

AllreduceAlgorithm choose_allreduce_algorithm(int64_t bytes, const Topology& topology,
                                              const CostModel& model) {
  AllreduceAlgorithm best = kSchedules[0];
  double best_seconds = predicted_seconds(best, bytes, topology, model);
  for (AllreduceAlgorithm a : kSchedules) {
    const double seconds = predicted_seconds(a, bytes, topology, model);
    if (seconds < best_seconds) {
      best = a;
      best_seconds = seconds;
    }
  }
  return best;
}

}  // namespace shoal::comm::algorithms
