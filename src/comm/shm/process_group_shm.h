// ProcessGroupShm: collectives between the ranks of one host through a shared-memory segment.
//
// Layout of the segment (created by rank 0, name exchanged through the store, unlinked as soon as
// every rank has mapped it):
//   header | one control block per rank | per rank: two data buffers of chunk_bytes |
//   per ordered pair (src, dst): a point-to-point channel with two buffers
// Each rank owns its control block's `posted` counter, the number of rounds it has completed.
// A collective is a sequence of rounds; in round k a rank writes into its buffer k % 2, then
// publishes posted = k + 1 (release), and reads a peer's round-k data once the peer's counter is
// at least k + 1 (acquire). Counters only grow, so round k's flag is never mistaken for another
// round's. A rank finishes reading the round-k data of its peers before it posts round k + 1, so
// a rank may overwrite buffer k % 2 in round k + 2 once every peer has posted round k + 1.
//
// Allreduce: up to ShmOptions::direct_bytes, every rank copies its tensor into its buffer and
// every rank reduces all buffers (one round, the least latency). Above, per chunk: each rank
// copies the shares of the other ranks into its buffer, reduces its own share from its tensor and
// the peers' buffers straight into its tensor and its second buffer, and then copies the other
// shares from the peers' second buffers (reduce-scatter + allgather, two rounds per chunk).
// An allreduce of a tensor from empty_symmetric() reduces in place across the ranks' slots.
//
// Allgather: per chunk, each rank copies its input into its buffer and every rank copies all
// buffers out. Above 64 KiB in all, into blocks of one empty_symmetric() tensor
// (all_gather_into_tensor) or from an input in one (FSDP's shards), each rank copies the peers'
// blocks straight from their slots instead (two rounds in all). As for the allreduce, every rank
// must pass the same kind of tensor; the first round checks. Reduce-scatter: per round, each
// rank publishes one piece per peer (a chunk shared among the n-1 peers) and reduces its own
// block from its input and the peers' pieces. From an input in one empty_symmetric() tensor (FSDP's
// flat gradients at stage 1), above 64 KiB, each rank reduces its block straight from every rank's
// slot instead: two rounds in all and no copy (the same sums in the same order).
//
// Operations run in issue order on a per-group worker thread (small ones inline on the caller's
// thread when nothing is queued); sends and receives on threads of their own, so that a ring of
// blocking sends cannot deadlock. Every wait spins briefly, then yields, then sleeps, and has a
// deadline; a dead peer (its pid is gone) or a rank that aborted the group fails it at once.
//
// The implementation lies in files by concern, as Gloo's transport does: segment_layout.h (the
// shared structures), shared_segment.* (the mapping), waiting.* (the waits, failure, rounds),
// op_queue.* (the operation queue), staged_algorithms.cpp and symmetric_algorithms.cpp (the two
// families of collectives), point_to_point.cpp (send, recv), process_group_shm.cpp (construction
// and plumbing).
//
// Thread safety: as ProcessGroup.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "comm/shm/shared_segment.h"
#include "shoal/comm/process_group.h"
#include "shoal/comm/store.h"

namespace shoal::comm::shm {

class OpQueue;
struct SegmentHeader;
struct RankControl;
struct Channel;

struct ShmOptions {
  /// Bytes per rank per round of a large operation (0: chosen by the cache and the group size).
  /// A quarter of one core's L2 (sysconf), within 256 KiB .. 1 MiB: a round's working set (the
  /// chunk of the tensor, the parts published for the peers, the parts read back) stays in L2,
  /// while each round still moves enough to pay for its rendezvous; 1 MiB where the L2 size is
  /// unknown. Measured on a 2-vCPU machine with 2 MiB of L2: 512 KiB chunks made 1-4 MiB
  /// allreduces 4-6 % faster than 1 MiB ones, 16 MiB alike, 64 MiB 2 % slower
  /// (docs/PERFORMANCE.md). More ranks get smaller chunks (down to 256 KiB), keeping the segment
  /// near 32 MiB. SHOAL_SHM_CHUNK_BYTES overrides it (benchmarks, tests).
  size_t chunk_bytes = 0;
  /// Largest allreduce done in one round by every rank reducing every buffer. Up to this size the
  /// saved second round is worth more than the (n-1)/n of redundant reduction work.
  size_t direct_bytes = 32 << 10;
  /// Largest collective run on the calling thread when nothing is queued before it (no hand-off
  /// to the worker thread); larger ones, and any queued behind another, run on the worker.
  /// SHOAL_SHM_INLINE_BYTES overrides it (benchmarks).
  size_t inline_bytes = 32 << 10;
  /// All-gathers and reduce-scatters larger than this in all (the full tensor) take the symmetric
  /// way when their tensors are symmetric; smaller ones are staged (fewer rounds).
  /// SHOAL_SHM_SYMMETRIC_MIN_BYTES overrides it (benchmarks; checked like the other sizes).
  size_t symmetric_min_bytes = 64 << 10;
  /// The most a wait spins before it yields (the budget adapts below it). A running peer reaches the same point within a few
  /// microseconds (a 4 KiB allreduce takes ~2 us), so 20 us of spinning catches the common case
  /// at cache-line latency; past that the peer is probably descheduled (cores shared with compute
  /// or other jobs) and spinning longer would only keep it off its core. SHOAL_SHM_SPIN_US
  /// overrides it (benchmarks).
  std::chrono::microseconds spin_time{20};
};

/// The chunk a group of `ranks` ranks stages large operations in, given ShmOptions::chunk_bytes
/// (`requested`; 0: sized to the L2, see there), with SHOAL_SHM_CHUNK_BYTES and the per-rank
/// minimum applied: what the group uses (and what `bench allreduce`'s floors stage in).
size_t staged_chunk_bytes(int ranks, size_t requested = 0);

class ProcessGroupShm : public ProcessGroup {
 public:
  /// Meets the other ranks through `store` (keys under `scope`) and maps the segment.
  ProcessGroupShm(std::shared_ptr<Store> store, std::string scope, int rank, int size,
                  Milliseconds timeout, ShmOptions options = {});
  ~ProcessGroupShm() override;

  std::string backend_name() const override { return "shm"; }
  void abort(const std::string& reason) override;
  bool is_symmetric(const at::Tensor& tensor) const override;
  /// Collectives this group has run on the calling thread (small ones, and those called with
  /// async_op = false, when nothing was queued before them) rather than on its worker thread.
  uint64_t collectives_run_inline() const { return run_inline_.load(std::memory_order_relaxed); }

 protected:
  at::Tensor run_empty_symmetric(int64_t numel, at::ScalarType dtype,
                                 const OpContext& ctx) override;
  std::shared_ptr<Work> run_allreduce(at::Tensor& tensor, ReduceOp op,
                                      const OpContext& ctx) override;
  std::shared_ptr<Work> run_broadcast(at::Tensor& tensor, int root, const OpContext& ctx) override;
  std::shared_ptr<Work> run_reduce(at::Tensor& tensor, int root, ReduceOp op,
                                   const OpContext& ctx) override;
  std::shared_ptr<Work> run_allgather(std::vector<at::Tensor>& outputs, const at::Tensor& input,
                                      const OpContext& ctx) override;
  std::shared_ptr<Work> run_reduce_scatter(at::Tensor& output, std::vector<at::Tensor>& inputs,
                                           ReduceOp op, const OpContext& ctx) override;
  std::shared_ptr<Work> run_gather(std::vector<at::Tensor>& outputs, const at::Tensor& input,
                                   int root, const OpContext& ctx) override;
  std::shared_ptr<Work> run_scatter(at::Tensor& output, std::vector<at::Tensor>& inputs, int root,
                                    const OpContext& ctx) override;
  std::shared_ptr<Work> run_send(const at::Tensor& tensor, int dst, int tag,
                                 const OpContext& ctx) override;
  std::shared_ptr<Work> run_recv(at::Tensor& tensor, int src, int tag,
                                 const OpContext& ctx) override;
  std::shared_ptr<Work> run_barrier(const OpContext& ctx) override;
  std::shared_ptr<ProcessGroup> run_new_group(const std::vector<int>& ranks, int group_rank,
                                              uint64_t group_id) override;

 private:
  using Clock = std::chrono::steady_clock;
  enum class Lane { kCollective, kSend, kRecv };

  // What the executing operation is, for waits and their error messages.
  struct Running {
    const OpContext* ctx;
    Clock::time_point start;
    Clock::time_point deadline;
  };

  std::shared_ptr<Work> submit(const OpContext& ctx, Lane lane, size_t bytes,
                               std::function<void(const Running&)> body);
  void execute(const OpContext& ctx, const std::function<void(const Running&)>& body);

  // Rounds (see the header comment).
  uint8_t* my_buffer(uint64_t round) const;
  const uint8_t* peer_buffer(int peer, uint64_t round) const;
  uint8_t* begin_write(const Running& op);  // waits until buffer round_ % 2 is free
  void post();
  void wait_posted(int peer, uint64_t value, const Running& op);
  void wait_all_posted(uint64_t value, const Running& op);

  template <class Ready>
  void wait_until(int peer, const Running& op, Ready ready);
  [[noreturn]] void fail_waiting(int peer, const Running& op, const char* why);
  void check_not_aborted(const OpContext& ctx);

  void allreduce_direct(at::Tensor& tensor, ReduceOp op, int root, const Running& r);
  void allreduce_chunked(at::Tensor& tensor, ReduceOp op, int root, const Running& r);
  void do_reduce(at::Tensor& tensor, ReduceOp op, int root, const Running& r);

  // Symmetric memory (empty_symmetric): allreduce in place across the ranks' slots.
  struct SymmetricRegion;
  void allreduce_symmetric(at::Tensor& tensor, ReduceOp op, const SymmetricRegion& region,
                           size_t offset, const Running& r);
  // An allreduce's tensor kind (0: ordinary; else which symmetric tensor), published with its
  // first round (call after begin_write, before post); then, once that round `round` is posted
  // by all, fail (and abort the group) unless every peer published the same.
  void publish_tensor_kind(uint64_t ref);
  void check_same_tensor_kind(uint64_t ref, uint64_t round, const Running& r);
  // Round A of the symmetric ways: every rank publishes where its tensor lies in symmetric memory
  // (ref), waits for the others, and fails clearly unless all name the same place.
  void meet_on_symmetric(uint64_t ref, const Running& r);
  // The live region `tensor` lies in (its byte offset in this rank's slot), or null.
  std::shared_ptr<SymmetricRegion> find_symmetric(const at::Tensor& tensor, size_t* offset) const;
  // The region holding `blocks` back to back (the views of all_gather_into_tensor's output), or
  // null; *offset: block 0's byte offset in this rank's slot.
  std::shared_ptr<SymmetricRegion> find_symmetric_blocks(const std::vector<at::Tensor>& blocks,
                                                         size_t* offset) const;
  // Allgather into blocks of a symmetric region: each rank copies the others' blocks from their
  // slots (two rounds, one copy of (n-1)/n of the output).
  void allgather_symmetric(const std::vector<at::Tensor>& outputs, const at::Tensor& input,
                           const SymmetricRegion& region, size_t offset, const Running& r);
  // Allgather from an input in a symmetric region: each rank copies the peers' inputs from their
  // slots into its outputs (two rounds, one copy of the output).
  void allgather_from_symmetric(const std::vector<at::Tensor>& outputs, const at::Tensor& input,
                                const SymmetricRegion& region, size_t offset, const Running& r);

  // Reduce-scatter from inputs in a symmetric region (back to back, block 0 at `offset`): each
  // rank reduces its block from every rank's slot into its output (two rounds, no staging copy).
  void reduce_scatter_symmetric(const at::Tensor& output, const std::vector<at::Tensor>& inputs,
                                ReduceOp op, const SymmetricRegion& region, size_t offset,
                                const Running& r);

  // Reduces sources_[0 .. size()) (`count` elements of `dtype` each, in rank order) into `dst`,
  // and into `dst2` too when given; kAvg divides by the group's size.
  void reduce_into(void* dst, size_t count, at::ScalarType dtype, ReduceOp op,
                   void* dst2 = nullptr);

  Channel& channel(int src, int dst) const;

  std::shared_ptr<Store> store_;
  std::string scope_;
  ShmOptions options_;
  SharedSegment segment_;
  SegmentHeader* header_ = nullptr;
  RankControl* controls_ = nullptr;
  uint8_t* slots_ = nullptr;
  uint8_t* channels_ = nullptr;
  size_t channel_buffer_bytes_ = 0;
  size_t channel_stride_ = 0;

  uint64_t round_ = 0;             // rounds this rank has posted (collective lane only)
  uint64_t peers_posted_min_ = 0;  // every peer is known to have posted at least this many
  std::vector<uint64_t> sent_pieces_;      // per destination (send lane only)
  std::vector<uint64_t> received_pieces_;  // per source (recv lane only)
  std::vector<const void*> sources_;       // scratch for reductions (collective lane only)

  int64_t max_spin_ns_ = 0;
  std::atomic<int64_t> spin_budget_ns_{0};  // adaptive, shared by the lanes (a hint only)

  std::atomic<bool> aborted_{false};
  std::mutex abort_mutex_;
  std::string abort_reason_;

  mutable std::mutex symmetric_mutex_;
  std::vector<std::weak_ptr<SymmetricRegion>> symmetric_;  // allocated by this group, maybe freed
  uint64_t symmetric_allocations_ = 0;                       // calling thread only
  std::atomic<bool> warned_no_symmetric_{false};

  std::shared_ptr<OpQueue> collectives_;  // shared with the Works that may run its tasks
  std::atomic<uint64_t> run_inline_{0};
  std::unique_ptr<OpQueue> sends_;
  std::unique_ptr<OpQueue> recvs_;
};

/// The Store-scoped constructor used by init_process_group and new_process_group.
std::shared_ptr<ProcessGroup> make_shm_group(std::shared_ptr<Store> store, int rank, int size,
                                             Milliseconds timeout);

}  // namespace shoal::comm::shm
