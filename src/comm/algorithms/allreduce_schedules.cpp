// The allreduce schedules of allreduce_algorithm.h over a PeerLink.
#include <ATen/ATen.h>

#include <vector>

#include "comm/algorithms/allreduce_algorithm.h"
#include "shoal/error.h"

namespace shoal::comm::algorithms {
namespace {

// Elements [begin, begin + count) of a 1-D tensor; an undefined tensor when empty, so that no
// message of zero bytes is sent (both ends know the counts and skip it alike).
at::Tensor span_of(const at::Tensor& tensor, int64_t begin, int64_t count) {
  return count > 0 ? tensor.narrow(0, begin, count) : at::Tensor();
}

// Block k of n nearly equal blocks of `numel` elements: its first element (the first
// numel % n blocks have one element more).
int64_t block_begin(int64_t numel, int n, int k) {
  const int64_t base = numel / n;
  const int64_t extra = numel % n;
  return k * base + std::min<int64_t>(k, extra);
}

int64_t block_size(int64_t numel, int n, int k) {
  return block_begin(numel, n, k + 1) - block_begin(numel, n, k);
}

// Receives into `scratch` (resized as needed) from `src` while sending `send` to `dst`, then
// reduces what came into `into`.
void exchange_and_combine(PeerLink& link, const at::Tensor& send, int dst, const at::Tensor& into,
                          int src, at::Tensor& scratch, ReduceOp op) {
  at::Tensor incoming;
  if (into.defined()) incoming = scratch.narrow(0, 0, into.numel());
  link.exchange(send, dst, incoming, src);
  if (into.defined()) combine_into(into, incoming, op);
}

// Ring: at reduce-scatter step s rank r sends block r-s to r+1 and adds block r-s-1 from r-1
// into its own; after n-1 steps it holds block r+1 reduced, which n-1 more steps pass around.
void ring(at::Tensor& x, ReduceOp op, PeerLink& link) {
  const int n = link.size();
  const int r = link.rank();
  const int next = (r + 1) % n;
  const int previous = (r + n - 1) % n;
  const int64_t numel = x.numel();
  auto block = [&](int k) {
    k = ((k % n) + n) % n;
    return span_of(x, block_begin(numel, n, k), block_size(numel, n, k));
  };
  at::Tensor scratch = at::empty({block_size(numel, n, 0)}, x.options());
  for (int s = 0; s < n - 1; ++s) {
    exchange_and_combine(link, block(r - s), next, block(r - s - 1), previous, scratch, op);
  }
  for (int s = 0; s < n - 1; ++s) link.exchange(block(r + 1 - s), next, block(r - s), previous);
}

// The ranks of a power of two that the recursive schedules run on: with n = p + rem (p the
// largest power of two not above n), each of the first rem even ranks hands its tensor to the
// odd rank above it and sits out; the others are renumbered 0..p-1 (MPICH's folding).
struct Folded {
  int p = 1;
  int rem = 0;
  int new_rank = -1;  // -1: sitting out
  int real(int folded) const { return folded < rem ? 2 * folded + 1 : folded + rem; }
};

Folded fold(int n, int r) {
  Folded f;
  while (f.p * 2 <= n) f.p *= 2;
  f.rem = n - f.p;
  if (r < 2 * f.rem) {
    f.new_rank = r % 2 == 1 ? r / 2 : -1;
  } else {
    f.new_rank = r - f.rem;
  }
  return f;
}

void fold_in(at::Tensor& x, ReduceOp op, PeerLink& link, const Folded& f) {
  const int r = link.rank();
  if (r >= 2 * f.rem) return;
  if (f.new_rank < 0) {
    link.exchange(x, r + 1, at::Tensor(), -1);
  } else {
    at::Tensor scratch = at::empty_like(x);
    exchange_and_combine(link, at::Tensor(), -1, x, r - 1, scratch, op);
  }
}

void fold_out(at::Tensor& x, PeerLink& link, const Folded& f) {
  const int r = link.rank();
  if (r >= 2 * f.rem) return;
  if (f.new_rank < 0) {
    link.exchange(at::Tensor(), -1, x, r + 1);
  } else {
    link.exchange(x, r - 1, at::Tensor(), -1);
  }
}

// Every step exchanges the whole tensor with the partner whose rank differs in one bit; both
// add the same two operands (in either order: the reductions are commutative).
void recursive_doubling(at::Tensor& x, ReduceOp op, PeerLink& link) {
  const Folded f = fold(link.size(), link.rank());
  fold_in(x, op, link, f);
  if (f.new_rank >= 0) {
    at::Tensor scratch = at::empty_like(x);
    for (int mask = 1; mask < f.p; mask <<= 1) {
      const int partner = f.real(f.new_rank ^ mask);
      exchange_and_combine(link, x, partner, x, partner, scratch, op);
    }
  }
  fold_out(x, link, f);
}

struct Range {
  int64_t begin = 0;
  int64_t end = 0;
};

// Recursive halving: at the step of bit `mask` (highest first) the two partners share a range;
// the lower keeps its first half, the upper its second, each sending the other half and
// reducing the half it keeps. Then recursive doubling in reverse order gathers the halves back.
void rabenseifner(at::Tensor& x, ReduceOp op, PeerLink& link) {
  const Folded f = fold(link.size(), link.rank());
  fold_in(x, op, link, f);
  if (f.new_rank >= 0) {
    std::vector<Range> kept;  // the range kept at each step, highest bit first
    Range range{0, x.numel()};
    at::Tensor scratch = at::empty({(x.numel() + 1) / 2}, x.options());
    for (int mask = f.p / 2; mask >= 1; mask >>= 1) {
      const int partner = f.real(f.new_rank ^ mask);
      const int64_t mid = range.begin + (range.end - range.begin) / 2;
      const bool lower = (f.new_rank & mask) == 0;
      const Range keep = lower ? Range{range.begin, mid} : Range{mid, range.end};
      const Range give = lower ? Range{mid, range.end} : Range{range.begin, mid};
      exchange_and_combine(link, span_of(x, give.begin, give.end - give.begin), partner,
                           span_of(x, keep.begin, keep.end - keep.begin), partner, scratch, op);
      kept.push_back(range);
      range = keep;
    }
    for (int mask = 1; mask < f.p; mask <<= 1) {
      const int partner = f.real(f.new_rank ^ mask);
      const Range parent = kept.back();
      kept.pop_back();
      const bool lower = (f.new_rank & mask) == 0;
      const Range theirs = lower ? Range{range.end, parent.end} : Range{parent.begin, range.begin};
      link.exchange(span_of(x, range.begin, range.end - range.begin), partner,
                    span_of(x, theirs.begin, theirs.end - theirs.begin), partner);
      range = parent;
    }
  }
  fold_out(x, link, f);
}

// Binomial tree on rank 0: a rank whose lowest set bit is m receives from r + m/2, r + m/4, ...
// 1 (those below n), reducing each, then sends to r - m; the broadcast runs the same edges back.
void tree(at::Tensor& x, ReduceOp op, PeerLink& link) {
  const int n = link.size();
  const int r = link.rank();
  int top = 1;  // one past the children's distances: r's lowest set bit, or past n for rank 0
  while (top < n && (r & top) == 0) top <<= 1;
  at::Tensor scratch = at::empty_like(x);
  for (int m = 1; m < top; m <<= 1) {
    if (r + m < n) exchange_and_combine(link, at::Tensor(), -1, x, r + m, scratch, op);
  }
  if (r != 0) {
    link.exchange(x, r - top, at::Tensor(), -1);
    link.exchange(at::Tensor(), -1, x, r - top);
  }
  for (int m = top >> 1; m >= 1; m >>= 1) {
    if (r + m < n) link.exchange(x, r + m, at::Tensor(), -1);
  }
}

}  // namespace

void combine_into(const at::Tensor& into, const at::Tensor& other, ReduceOp op) {
  at::Tensor target = into;
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: target.add_(other); break;
    case ReduceOp::kProduct: target.mul_(other); break;
    case ReduceOp::kMin: at::minimum_out(target, target, other); break;
    case ReduceOp::kMax: at::maximum_out(target, target, other); break;
  }
}

void allreduce_with(AllreduceAlgorithm algorithm, at::Tensor& tensor, ReduceOp op, PeerLink& link) {
  SHOAL_CHECK_T(InvalidArgument, tensor.dim() == 1 && tensor.is_contiguous(),
                "allreduce_with: the tensor must be 1-D and contiguous");
  if (link.size() == 1 || tensor.numel() == 0) return;
  switch (algorithm) {
    case AllreduceAlgorithm::kRing: return ring(tensor, op, link);
    case AllreduceAlgorithm::kTree: return tree(tensor, op, link);
    case AllreduceAlgorithm::kRecursiveDoubling: return recursive_doubling(tensor, op, link);
    case AllreduceAlgorithm::kRabenseifner: return rabenseifner(tensor, op, link);
    case AllreduceAlgorithm::kNative:
    case AllreduceAlgorithm::kAuto: break;
  }
  SHOAL_THROW(InvalidArgument, "allreduce_with: '", to_string(algorithm),
              "' is not a schedule; resolve native and auto first");
}

}  // namespace shoal::comm::algorithms
