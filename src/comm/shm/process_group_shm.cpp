#include "comm/shm/process_group_shm.h"

#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <new>
#include <random>
#include <sstream>
#include <optional>
#include <thread>

#include "comm/peer_directory.h"
#include "comm/shm/op_queue.h"
#include "comm/shm/reduce_kernels.h"
#include "comm/timeouts.h"
#include "shoal/env.h"
#include "shoal/error.h"
#include "shoal/log.h"

namespace shoal::comm::shm {

// ---- the segment's shared structures -----------------------------------------------------------

constexpr uint64_t kMagic = 0x6d68735f6c616f73ULL;  // "shoal_shm"
constexpr size_t kReasonBytes = 384;

struct SegmentHeader {
  std::atomic<uint64_t> magic;
  uint64_t size;
  uint64_t chunk_bytes;
  std::atomic<int32_t> attached;    // ranks that have mapped the segment
  std::atomic<int32_t> abort_rank;  // 1 + the first rank that aborted the group, 0: none
};

struct alignas(64) RankControl {
  std::atomic<uint64_t> posted;  // rounds posted; the only hot word, alone on its cache line
  char pad0[56];
  std::atomic<int32_t> pid;
  std::atomic<int32_t> op_code;        // index in kOpNames of the collective being run
  std::atomic<uint64_t> op_sequence;   // and its sequence number (diagnostics only)
  // Which symmetric tensor the allreduce whose first round is k runs on, in symmetric_ref[k % 2]:
  // (region id << 40 | byte offset) + 1, or 0 for an ordinary tensor. Set before that first post,
  // so that ranks that disagree about the path find out before any of them touches another's
  // memory; two of them because a rank may start its next operation before a slow peer has read
  // this one's (it cannot get two rounds ahead).
  std::atomic<uint64_t> symmetric_ref[2];
  char pad1[32];
  char abort_reason[kReasonBytes];     // written before abort_rank names this rank
};

struct PieceInfo {
  int64_t tag;
  uint64_t message_bytes;
};

struct Channel {
  alignas(64) std::atomic<uint64_t> sent;      // pieces published by the sender
  alignas(64) std::atomic<uint64_t> consumed;  // pieces consumed by the receiver
  alignas(64) PieceInfo info[2];
};
constexpr size_t kChannelHeaderBytes = 256;
static_assert(sizeof(Channel) <= kChannelHeaderBytes, "channel header grew");
static_assert(sizeof(RankControl) == 128 + kReasonBytes, "rank control block changed size");

// The memory of one empty_symmetric() call: one slot per rank, each rank's tensor is its slot.
struct ProcessGroupShm::SymmetricRegion {
  SharedSegment segment;
  uint64_t id = 0;
  size_t slot_bytes = 0;
  uint8_t* slot(int r) const { return static_cast<uint8_t*>(segment.data()) + r * slot_bytes; }
};

namespace {

using Clock = std::chrono::steady_clock;

const char* const kOpNames[] = {"?",       "allreduce", "broadcast", "reduce", "allgather",
                                "reduce_scatter", "gather", "scatter", "barrier"};

int op_code(const char* name) {
  for (int i = 1; i < static_cast<int>(sizeof kOpNames / sizeof kOpNames[0]); ++i) {
    if (std::strcmp(kOpNames[i], name) == 0) return i;
  }
  return 0;
}

// Waiting: spin (ShmOptions::spin_time), then yield, then sleep.
// Then sched_yield for 2 ms: hands the core to a peer queued on it while still reacting within a
// scheduler tick; then sleep 100 us per check, which costs nothing on long waits (a slow rank
// computing its backward pass) and adds at most 100 us to them.
constexpr auto kYieldTime = std::chrono::milliseconds(2);
constexpr auto kSleepTime = std::chrono::microseconds(100);
// How often a slow wait looks at peers' pids, the abort flag and the deadline: /proc reads cost
// ~10 us, so every 5 ms is cheap and still reports a dead peer at once on a human scale.
constexpr auto kCheckInterval = std::chrono::milliseconds(5);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}


size_t round_up(size_t value, size_t to) { return (value + to - 1) / to * to; }


size_t env_bytes(env::Var var, size_t fallback) {
  const std::optional<int64_t> bytes = env::integer(var);
  return bytes ? static_cast<size_t>(*bytes) : fallback;
}

std::string unique_segment_name() {
  std::random_device device;
  std::ostringstream name;
  name << "/shoal-" << getpid() << "-" << std::hex << device() << device();
  return name.str();
}

}  // namespace

// ---- construction ------------------------------------------------------------------------------

// A staged round's working set is about three chunks (the tensor's chunk, the parts published
// for the peers, the parts read back): a quarter of one core's L2 keeps it there. At most 1 MiB,
// less with many ranks (the segment stays near 32 MiB), at least 256 KiB (each round costs a
// rendezvous). Measured in docs/PERFORMANCE.md ("The staged chunk sized to the L2").
namespace {

size_t default_chunk_bytes(int ranks) {
  const long l2 = ::sysconf(_SC_LEVEL2_CACHE_SIZE);  // 0 or -1 where the C library cannot tell
  const size_t by_cache = l2 > 0 ? static_cast<size_t>(l2) / 4 : size_t{1} << 20;
  const size_t by_segment = (size_t{32} << 20) / (2 * static_cast<size_t>(std::max(ranks, 1)));
  return round_up(std::clamp<size_t>(std::min(by_cache, by_segment), 256u << 10, 1u << 20), 4096);
}

}  // namespace

size_t staged_chunk_bytes(int ranks, size_t requested) {
  const size_t chosen = requested > 0 ? requested : default_chunk_bytes(ranks);
  const size_t chunk = round_up(env_bytes(env::Var::kShmChunkBytes, chosen), 4096);
  // scatter and reduce_scatter put one cache-line-aligned piece per rank in a buffer.
  return std::max(chunk, round_up(64 * static_cast<size_t>(std::max(ranks, 1)), 4096));
}

ProcessGroupShm::ProcessGroupShm(std::shared_ptr<Store> store, std::string scope, int rank,
                                 int size, Milliseconds timeout, ShmOptions options)
    : ProcessGroup(rank, size, timeout),
      store_(std::move(store)),
      scope_(std::move(scope)),
      options_(options),
      sent_pieces_(size, 0),
      received_pieces_(size, 0),
      sources_(size, nullptr) {
  SHOAL_CHECK_T(InvalidArgument, size <= kMaxSources, rank_prefix(), " shm: ", size,
                " ranks on one host is more than the ", kMaxSources, " the shm backend supports");
  options_.chunk_bytes = staged_chunk_bytes(size, options_.chunk_bytes);
  if (const std::optional<int64_t> spin = env::integer(env::Var::kShmSpinUs)) {
    options_.spin_time = std::chrono::microseconds(*spin);
  }
  max_spin_ns_ = std::chrono::nanoseconds(options_.spin_time).count();
  spin_budget_ns_.store(max_spin_ns_);
  options_.direct_bytes = std::min(options_.direct_bytes, options_.chunk_bytes);
  options_.inline_bytes = env_bytes(env::Var::kShmInlineBytes, options_.inline_bytes);
  options_.symmetric_min_bytes =
      env_bytes(env::Var::kShmSymmetricMinBytes, options_.symmetric_min_bytes);
  const auto deadline = Clock::now() + timeout;

  // Every rank must be on this host: a rank elsewhere would fail to open the segment, less clearly.
  const std::string host = local_hostname();
  store_->set_string(scope_ + "/host/" + std::to_string(rank), host);
  for (int r = 0; r < size; ++r) {
    const std::string theirs = store_->get_string(scope_ + "/host/" + std::to_string(r));
    SHOAL_CHECK_T(InvalidArgument, theirs == host, rank_prefix(), " shm: rank ", r, " runs on ",
                  theirs, " but this rank on ", host,
                  "; the shm backend needs every rank on one host (use --backend hierarchical or "
                  "gloo across hosts)");
  }

  // Layout (see the header comment); page-aligned regions.
  const size_t header_bytes = 4096;
  const size_t control_bytes = round_up(size * sizeof(RankControl), 4096);
  const size_t slot_bytes = 2 * options_.chunk_bytes;
  // Point-to-point buffers shrink as the pairs multiply: ~4 MiB of channels in all.
  channel_buffer_bytes_ =
      std::clamp<size_t>(round_up((4u << 20) / (size * size), 4096), 4096, 256u << 10);
  channel_stride_ = kChannelHeaderBytes + 2 * channel_buffer_bytes_;
  const size_t channels_bytes = size > 1 ? round_up(size * size * channel_stride_, 4096) : 0;
  const size_t total = header_bytes + control_bytes + size * slot_bytes + channels_bytes;

  const std::string key = scope_ + "/segment";
  if (rank == 0) {
    segment_ = SharedSegment::create(unique_segment_name(), total);
    auto* base = static_cast<uint8_t*>(segment_.data());
    header_ = new (base) SegmentHeader{};
    header_->size = size;
    header_->chunk_bytes = options_.chunk_bytes;
    for (int r = 0; r < size; ++r) new (base + header_bytes + r * sizeof(RankControl)) RankControl{};
    for (int i = 0; i < size * size && size > 1; ++i) {
      new (base + header_bytes + control_bytes + size * slot_bytes + i * channel_stride_) Channel{};
    }
    header_->magic.store(kMagic, std::memory_order_release);
    store_->set_string(key, segment_.name() + " " + std::to_string(total));
  } else {
    std::istringstream in(store_->get_string(key));
    std::string name;
    size_t bytes = 0;
    in >> name >> bytes;
    SHOAL_CHECK(bytes == total, rank_prefix(), " shm: rank 0 laid out ", bytes,
                " bytes but this rank expects ", total,
                "; start every rank with the same Shoal build and SHOAL_SHM_CHUNK_BYTES");
    segment_ = SharedSegment::open(name, total);
    header_ = static_cast<SegmentHeader*>(segment_.data());
    SHOAL_CHECK(header_->magic.load(std::memory_order_acquire) == kMagic &&
                    header_->size == static_cast<uint64_t>(size),
                rank_prefix(), " shm: segment ", name, " is not this group's");
  }
  auto* base = static_cast<uint8_t*>(segment_.data());
  controls_ = reinterpret_cast<RankControl*>(base + header_bytes);
  slots_ = base + header_bytes + control_bytes;
  channels_ = slots_ + size * slot_bytes;

  controls_[rank].pid.store(static_cast<int32_t>(getpid()), std::memory_order_relaxed);
  if (header_->attached.fetch_add(1, std::memory_order_acq_rel) + 1 == size) {
    // The last rank to map it removes the name: from now on a crash cannot leak the segment.
    segment_.unlink();
  }
  // Every rank waits for the others to map it, so the name is gone once construction returns.
  while (header_->attached.load(std::memory_order_acquire) < size) {
    if (Clock::now() > deadline) {
      segment_.unlink();
      SHOAL_THROW(TimeoutError, rank_prefix(), " shm: only ",
                  header_->attached.load(), " of ", size, " ranks mapped segment ",
                  segment_.name(), " within ", timeout.count(),
                  " ms; are all ranks started and alive?");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  segment_.unlink();  // idempotent; the creator's copy of the name is gone too
  collectives_ = std::make_shared<OpQueue>("shm collectives");
}

ProcessGroupShm::~ProcessGroupShm() {
  // Queued operations finish (or fail at their deadline) before the memory goes away, also when
  // a waiting thread still holds the queue.
  collectives_->stop();
  collectives_.reset();
  sends_.reset();
  recvs_.reset();
}

std::shared_ptr<ProcessGroup> make_shm_group(std::shared_ptr<Store> store, int rank, int size,
                                             Milliseconds timeout) {
  return std::make_shared<ProcessGroupShm>(std::move(store), "shm", rank, size, timeout);
}

std::shared_ptr<ProcessGroup> ProcessGroupShm::run_new_group(const std::vector<int>& ranks,
                                                             int group_rank, uint64_t group_id) {
  return std::make_shared<ProcessGroupShm>(store_, scope_ + "/g" + std::to_string(group_id),
                                           group_rank, static_cast<int>(ranks.size()), timeout(),
                                           options_);
}

// ---- failure -----------------------------------------------------------------------------------

void ProcessGroupShm::abort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(abort_mutex_);
    if (aborted_.load()) return;
    abort_reason_ = reason;
    aborted_.store(true);
  }
  if (header_ == nullptr) return;
  auto& mine = controls_[rank()];
  std::strncpy(mine.abort_reason, reason.c_str(), kReasonBytes - 1);
  mine.abort_reason[kReasonBytes - 1] = '\0';
  int32_t none = 0;
  header_->abort_rank.compare_exchange_strong(none, rank() + 1, std::memory_order_acq_rel);
}

void ProcessGroupShm::check_not_aborted(const OpContext& ctx) {
  if (aborted_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(abort_mutex_);
    SHOAL_THROW(PeerError, ctx.prefix(), " cannot run: the group was aborted after an earlier "
                "failure: ", abort_reason_);
  }
  const int32_t culprit = header_->abort_rank.load(std::memory_order_acquire);
  if (culprit != 0) {
    const std::string reason = controls_[culprit - 1].abort_reason;
    abort(reason);
    SHOAL_THROW(PeerError, ctx.prefix(), " cannot run: rank ", culprit - 1,
                " aborted the group: ", reason);
  }
}

void ProcessGroupShm::fail_waiting(int peer, const Running& op, const char* why) {
  const auto waited =
      std::chrono::duration_cast<Milliseconds>(Clock::now() - op.start).count();
  const int pid = controls_[peer].pid.load(std::memory_order_relaxed);
  const std::string who = detail::str_cat("rank ", peer, " (pid ", pid, ")");
  std::string message;
  bool timeout = false;
  if (std::strcmp(why, "exited") == 0) {
    message = detail::str_cat(op.ctx->prefix(), " failed after ", waited, " ms waiting for ", who,
                              ": the process has exited");
  } else if (std::strcmp(why, "stopped") == 0) {
    message = detail::str_cat(op.ctx->prefix(), " failed after ", waited, " ms waiting for ", who,
                              ": the process has been stopped (SIGSTOP, Ctrl-Z or a debugger) for ",
                              stopped_peer_timeout().count(), " ms");
  } else if (std::strcmp(why, "aborted") == 0) {
    const int32_t culprit = header_->abort_rank.load(std::memory_order_acquire);
    std::string reason;
    if (culprit > 0) {
      reason = controls_[culprit - 1].abort_reason;
    } else {
      std::lock_guard<std::mutex> lock(abort_mutex_);
      reason = abort_reason_;
    }
    message = detail::str_cat(op.ctx->prefix(), " failed after ", waited, " ms waiting for ", who,
                              ": ", culprit > 0 ? detail::str_cat("rank ", culprit - 1,
                                                                  " aborted the group: ")
                                                : "the group was aborted: ",
                              reason);
  } else {
    timeout = true;
    const uint64_t their_seq = controls_[peer].op_sequence.load(std::memory_order_relaxed);
    const int their_op = controls_[peer].op_code.load(std::memory_order_relaxed);
    const std::string where =
        their_seq == 0 ? std::string("has not started any collective")
                       : detail::str_cat("was last seen in ", kOpNames[their_op], " #", their_seq);
    message = detail::str_cat(op.ctx->prefix(), " timed out after ", waited, " ms waiting for ",
                              who, ", which ", where, kTimeoutHint);
  }
  abort(message);  // first: the other ranks fail at once, and gather their reports meanwhile
  // Who is behind and where: every rank's last operations (not needed when the peer is dead).
  if (std::strcmp(why, "exited") != 0) message += hang_report();
  if (timeout) SHOAL_THROW(TimeoutError, message);
  SHOAL_THROW(PeerError, message);
}

template <class Ready>
void ProcessGroupShm::wait_until(int peer, const Running& op, Ready ready) {
  if (ready()) return;
  const auto begin = Clock::now();
  // Spin for the adaptive budget (see ShmOptions::spin_time): a wait that ends while spinning
  // doubles it, one that has to yield halves it, so a busy machine stops spinning on its own.
  const auto budget = std::chrono::nanoseconds(spin_budget_ns_.load(std::memory_order_relaxed));
  do {
    for (int i = 0; i < 16; ++i) {
      cpu_relax();
      if (ready()) {
        const int64_t grown = std::min<int64_t>(2 * budget.count() + 1000, max_spin_ns_);
        spin_budget_ns_.store(grown, std::memory_order_relaxed);
        return;
      }
    }
  } while (Clock::now() - begin < budget);
  spin_budget_ns_.store(budget.count() / 2, std::memory_order_relaxed);
  auto next_check = Clock::now();
  // A stopped peer is alive but will not move: it fails the wait after stopped_peer_timeout()
  // rather than the operation's time-out (minutes, for peers that are merely slow).
  std::optional<Clock::time_point> stopped_since;
  auto next_stop_check = Clock::now();
  for (;;) {
    if (ready()) return;
    const auto now = Clock::now();
    if (now >= next_check) {
      next_check = now + kCheckInterval;
      if (now >= next_stop_check) {
        // Reading /proc costs ~10 us: every 100 ms is plenty for a limit of seconds.
        next_stop_check = now + std::chrono::milliseconds(100);
        const int pid = controls_[peer].pid.load(std::memory_order_relaxed);
        if (pid != getpid() && process_is_stopped(pid)) {
          if (!stopped_since) stopped_since = now;
          if (now - *stopped_since >= stopped_peer_timeout()) fail_waiting(peer, op, "stopped");
        } else {
          stopped_since.reset();
        }
      }
      if (aborted_.load(std::memory_order_acquire) ||
          header_->abort_rank.load(std::memory_order_acquire) != 0) {
        fail_waiting(peer, op, "aborted");
      }
      if (const int pid = controls_[peer].pid.load(std::memory_order_relaxed);
          pid != getpid() && process_is_gone(pid)) {
        if (ready()) return;  // it finished its part before exiting
        fail_waiting(peer, op, "exited");
      }
      if (now >= op.deadline) fail_waiting(peer, op, "timeout");
    }
    if (now - begin < kYieldTime) {
      sched_yield();
    } else {
      std::this_thread::sleep_for(kSleepTime);
    }
  }
}

// ---- rounds ------------------------------------------------------------------------------------

uint8_t* ProcessGroupShm::my_buffer(uint64_t round) const {
  return slots_ + (static_cast<size_t>(rank()) * 2 + round % 2) * options_.chunk_bytes;
}

const uint8_t* ProcessGroupShm::peer_buffer(int peer, uint64_t round) const {
  return slots_ + (static_cast<size_t>(peer) * 2 + round % 2) * options_.chunk_bytes;
}

uint8_t* ProcessGroupShm::begin_write(const Running& op) {
  // Buffer round_ % 2 last held round round_ - 2, which every peer has finished reading once it
  // has posted round round_ - 1.
  if (peers_posted_min_ < round_) wait_all_posted(round_, op);
  return my_buffer(round_);
}

void ProcessGroupShm::post() {
  ++round_;
  controls_[rank()].posted.store(round_, std::memory_order_release);
}

void ProcessGroupShm::wait_posted(int peer, uint64_t value, const Running& op) {
  const auto& posted = controls_[peer].posted;
  wait_until(peer, op, [&] { return posted.load(std::memory_order_acquire) >= value; });
}

void ProcessGroupShm::wait_all_posted(uint64_t value, const Running& op) {
  if (peers_posted_min_ >= value) return;
  for (int peer = 0; peer < size(); ++peer) {
    if (peer != rank()) wait_posted(peer, value, op);
  }
  peers_posted_min_ = value;
}

// ---- operation plumbing ------------------------------------------------------------------------

void ProcessGroupShm::execute(const OpContext& ctx,
                              const std::function<void(const Running&)>& body) {
  const auto start = Clock::now();
  Running running{&ctx, start, start + ctx.timeout};
  check_not_aborted(ctx);
  body(running);
}

std::shared_ptr<Work> ProcessGroupShm::submit(const OpContext& ctx, Lane lane, size_t bytes,
                                              std::function<void(const Running&)> body) {
  // The Work's own wait limit is a safety net behind the operation's deadline, which starts when
  // the operation starts (possibly behind others in the queue) and produces the better message.
  auto work = std::make_shared<ShmWork>(ctx.label, ctx.timeout * 2 + Milliseconds(1000),
                                        lane == Lane::kCollective ? collectives_ : nullptr);
  if (lane == Lane::kCollective) {
    const int code = op_code(ctx.name());
    // Small collectives, and any the caller waits for at once (async_op = false), run on the
    // calling thread when nothing is queued before them: no hand-off to the worker, whose
    // wake-up would cost more than the operation (and, with a rank per CPU, takes a CPU from a
    // peer in the same collective).
    if ((bytes <= options_.inline_bytes || !ctx.async_op) && collectives_->idle()) {
      run_inline_.fetch_add(1, std::memory_order_relaxed);
      try {
        controls_[rank()].op_code.store(code, std::memory_order_relaxed);
        controls_[rank()].op_sequence.store(ctx.sequence(), std::memory_order_relaxed);
        execute(ctx, body);
        work->finish();
      } catch (...) {
        work->finish(std::current_exception());
      }
      return work;
    }
    const Work* owner = work.get();
    collectives_->enqueue([this, work, ctx, code, body = std::move(body)] {
      try {
        controls_[rank()].op_code.store(code, std::memory_order_relaxed);
        controls_[rank()].op_sequence.store(ctx.sequence(), std::memory_order_relaxed);
        execute(ctx, body);
        work->finish();
      } catch (...) {
        work->finish(std::current_exception());
      }
    }, owner);
    return work;
  }
  auto task = [this, work, ctx, body = std::move(body)] {
    try {
      execute(ctx, body);
      work->finish();
    } catch (...) {
      work->finish(std::current_exception());
    }
  };
  if (lane == Lane::kSend) {
    if (!sends_) sends_ = std::make_unique<OpQueue>("shm sends");
    sends_->enqueue(std::move(task));
  } else {
    if (!recvs_) recvs_ = std::make_unique<OpQueue>("shm receives");
    recvs_->enqueue(std::move(task));
  }
  return work;
}

// ---- collectives -------------------------------------------------------------------------------

void ProcessGroupShm::reduce_into(void* dst, size_t count, at::ScalarType dtype, ReduceOp op,
                                  void* dst2) {
  ReduceArgs args;
  args.dst = dst;
  args.dst2 = dst2;
  args.src = sources_.data();
  args.num_src = size();
  args.count = count;
  args.dtype = dtype;
  args.op = op;
  args.divisor = size();
  reduce_sources(args);
}

void ProcessGroupShm::allreduce_direct(at::Tensor& tensor, ReduceOp op, int root,
                                       const Running& r) {
  const size_t bytes = tensor.nbytes();
  auto* data = static_cast<uint8_t*>(tensor.data_ptr());
  const uint64_t k = round_;
  std::memcpy(begin_write(r), data, bytes);
  publish_tensor_kind(0);
  post();
  if (root >= 0 && root != rank()) return;
  wait_all_posted(k + 1, r);
  if (root < 0) check_same_tensor_kind(0, k, r);
  for (int s = 0; s < size(); ++s) sources_[s] = s == rank() ? data : peer_buffer(s, k);
  reduce_into(data, tensor.numel(), tensor.scalar_type(), op);
}

void ProcessGroupShm::allreduce_chunked(at::Tensor& tensor, ReduceOp op, int root,
                                        const Running& r) {
  const int n = size();
  const int me = rank();
  const size_t esz = tensor.element_size();
  const size_t total = tensor.numel();
  const size_t chunk = options_.chunk_bytes / esz;
  const size_t align = 64 / esz;  // shares start on cache lines: no false sharing between ranks
  auto* data = static_cast<uint8_t*>(tensor.data_ptr());
  for (size_t start = 0; start < total; start += chunk) {
    const size_t m = std::min(chunk, total - start);
    const size_t share = round_up((m + n - 1) / n, align);
    auto lo = [&](int s) { return std::min(s * share, m); };
    auto hi = [&](int s) { return std::min((s + 1) * share, m); };
    uint8_t* base = data + start * esz;

    // Round A: publish the parts of this chunk that the other ranks reduce.
    const uint64_t ka = round_;
    uint8_t* mine = begin_write(r);
    for (int s = 0; s < n; ++s) {
      if (s != me) std::memcpy(mine + lo(s) * esz, base + lo(s) * esz, (hi(s) - lo(s)) * esz);
    }
    if (start == 0) publish_tensor_kind(0);
    post();
    wait_all_posted(ka + 1, r);
    if (start == 0 && root < 0) check_same_tensor_kind(0, ka, r);

    // Round B: reduce this rank's share from its tensor and the peers' buffers.
    const uint64_t kb = round_;
    uint8_t* reduced = begin_write(r);
    const size_t my_lo = lo(me), my_count = hi(me) - lo(me);
    if (my_count > 0) {
      for (int s = 0; s < n; ++s) {
        sources_[s] = s == me ? base + my_lo * esz : peer_buffer(s, ka) + my_lo * esz;
      }
      if (root < 0) {  // allreduce: into the tensor, and published for the others
        reduce_into(base + my_lo * esz, my_count, tensor.scalar_type(), op, reduced + my_lo * esz);
      } else if (root == me) {
        reduce_into(base + my_lo * esz, my_count, tensor.scalar_type(), op);
      } else {  // reduce: published for the root only; this rank's tensor is left alone
        reduce_into(reduced + my_lo * esz, my_count, tensor.scalar_type(), op);
      }
    }
    post();
    if (root >= 0 && root != me) continue;
    wait_all_posted(kb + 1, r);
    for (int s = 0; s < n; ++s) {
      if (s != me) {
        std::memcpy(base + lo(s) * esz, peer_buffer(s, kb) + lo(s) * esz,
                    (hi(s) - lo(s)) * esz);
      }
    }
  }
}

void ProcessGroupShm::publish_tensor_kind(uint64_t ref) {
  controls_[rank()].symmetric_ref[round_ % 2].store(ref, std::memory_order_relaxed);
}

void ProcessGroupShm::check_same_tensor_kind(uint64_t ref, uint64_t round, const Running& r) {
  for (int s = 0; s < size(); ++s) {
    if (s == rank()) continue;
    const uint64_t theirs = controls_[s].symmetric_ref[round % 2].load(std::memory_order_relaxed);
    if (theirs == ref) continue;
    const char* what = theirs == 0 ? "an ordinary tensor" : "a tensor from empty_symmetric()";
    const char* ours = ref == 0 ? "an ordinary tensor" : "a tensor from empty_symmetric()";
    const std::string message = detail::str_cat(
        r.ctx->prefix(), ": rank ", s, " passed ", what,
        theirs != 0 && ref != 0 ? " (another one, or part of one)" : "", " where this rank passed ",
        ours, "; every rank must pass its own copy of the same symmetric tensor, whole, or "
        "every rank an ordinary one");
    abort(message);
    SHOAL_THROW(PeerError, message);
  }
}

void ProcessGroupShm::meet_on_symmetric(uint64_t ref, const Running& r) {
  const uint64_t k = round_;
  begin_write(r);  // no buffer is written, but symmetric_ref[k % 2] must be free
  publish_tensor_kind(ref);
  post();
  wait_all_posted(k + 1, r);
  check_same_tensor_kind(ref, k, r);
}

void ProcessGroupShm::allreduce_symmetric(at::Tensor& tensor, ReduceOp op,
                                          const SymmetricRegion& region, size_t offset,
                                          const Running& r) {
  const int n = size();
  const int me = rank();
  // Round A: this rank's tensor holds its contribution, at this place in this region.
  const uint64_t ref = (region.id << 40 | offset) + 1;
  meet_on_symmetric(ref, r);
  // Reduce this rank's share of every rank's tensor, and write the result into all of them.
  const size_t esz = tensor.element_size();
  const size_t total = tensor.numel();
  const size_t align = 64 / esz;
  const size_t share = round_up((total + n - 1) / n, align);
  const size_t lo = std::min(me * share, total), hi = std::min((me + 1) * share, total);
  if (hi > lo) {
    const size_t at = offset + lo * esz;
    for (int s = 0; s < n; ++s) sources_[s] = region.slot(s) + at;
    reduce_into(region.slot(me) + at, hi - lo, tensor.scalar_type(), op,
                n == 2 ? region.slot(1 - me) + at : nullptr);
    for (int s = 0; s < n && n > 2; ++s) {
      if (s != me) std::memcpy(region.slot(s) + at, region.slot(me) + at, (hi - lo) * esz);
    }
  }
  // Round B: every share is everywhere; no peer touches this rank's tensor after it.
  const uint64_t kb = round_;
  post();
  wait_all_posted(kb + 1, r);
}

std::shared_ptr<ProcessGroupShm::SymmetricRegion> ProcessGroupShm::find_symmetric(
    const at::Tensor& tensor, size_t* offset) const {
  if (!tensor.is_contiguous() || tensor.nbytes() == 0) return nullptr;
  const auto* begin = static_cast<const uint8_t*>(tensor.data_ptr());
  std::lock_guard<std::mutex> lock(symmetric_mutex_);
  for (const auto& weak : symmetric_) {
    auto region = weak.lock();
    if (!region) continue;
    const uint8_t* mine = region->slot(rank());
    if (begin >= mine && begin + tensor.nbytes() <= mine + region->slot_bytes) {
      *offset = static_cast<size_t>(begin - mine);
      return region;
    }
  }
  return nullptr;
}

bool ProcessGroupShm::is_symmetric(const at::Tensor& tensor) const {
  size_t offset = 0;
  return find_symmetric(tensor, &offset) != nullptr;
}

at::Tensor ProcessGroupShm::run_empty_symmetric(int64_t numel, at::ScalarType dtype,
                                                const OpContext& ctx) {
  const auto options = torch::TensorOptions().dtype(dtype);
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  auto region = std::make_shared<SymmetricRegion>();
  region->id = ++symmetric_allocations_;
  region->slot_bytes = round_up(std::max<size_t>(bytes, 1), 4096);
  const size_t total = region->slot_bytes * size();
  // Rank 0 creates the segment; every rank maps it and says whether it could; all use it only if
  // all could (otherwise all fall back to ordinary tensors, so the ranks stay consistent).
  const std::string key = scope_ + "/symmetric/" + std::to_string(region->id);
  std::string failure;
  if (rank() == 0) {
    try {
      region->segment = SharedSegment::create(unique_segment_name(), total);
      store_->set_string(key, region->segment.name());
    } catch (const Error& e) {
      failure = e.what();
      store_->set_string(key, "");
    }
  } else {
    const std::string name = store_->get_string(key);
    if (name.empty()) {
      failure = "rank 0 could not create it";
    } else {
      try {
        region->segment = SharedSegment::open(name, total);
      } catch (const Error& e) {
        failure = e.what();
      }
    }
  }
  store_->set_string(key + "/ok/" + std::to_string(rank()), failure.empty() ? "1" : "0");
  bool everyone = true;
  for (int r = 0; r < size(); ++r) {
    everyone = store_->get_string(key + "/ok/" + std::to_string(r)) == "1" && everyone;
  }
  region->segment.unlink();  // every rank has mapped it, or none will use it
  if (!everyone) {
    if (!warned_no_symmetric_.exchange(true)) {
      log::warn(ctx.prefix(), ": shared memory for a symmetric tensor of ", bytes,
                " bytes is not available (",
                failure.empty() ? std::string("another rank could not map it") : failure,
                "); using ordinary memory (collectives on it copy through the group's buffers)");
    }
    return torch::empty({numel}, options);
  }
  {
    std::lock_guard<std::mutex> lock(symmetric_mutex_);
    symmetric_.erase(std::remove_if(symmetric_.begin(), symmetric_.end(),
                                    [](const auto& weak) { return weak.expired(); }),
                     symmetric_.end());
    symmetric_.push_back(region);
  }
  // The tensor owns the mapping: the memory lives exactly as long as the tensor (and its views).
  return torch::from_blob(region->slot(rank()), {numel}, [region](void*) mutable { region.reset(); },
                          options);
}

void ProcessGroupShm::do_reduce(at::Tensor& tensor, ReduceOp op, int root, const Running& r) {
  size_t offset = 0;
  if (root < 0) {
    if (auto region = find_symmetric(tensor, &offset)) {
      allreduce_symmetric(tensor, op, *region, offset, r);
      return;
    }
  }
  if (tensor.nbytes() <= options_.direct_bytes) {
    allreduce_direct(tensor, op, root, r);
  } else {
    allreduce_chunked(tensor, op, root, r);
  }
}

std::shared_ptr<Work> ProcessGroupShm::run_allreduce(at::Tensor& tensor, ReduceOp op,
                                                     const OpContext& ctx) {
  return submit(ctx, Lane::kCollective, tensor.nbytes(),
                [this, tensor, op](const Running& r) mutable { do_reduce(tensor, op, -1, r); });
}

std::shared_ptr<Work> ProcessGroupShm::run_reduce(at::Tensor& tensor, int root, ReduceOp op,
                                                  const OpContext& ctx) {
  return submit(ctx, Lane::kCollective, tensor.nbytes(),
                [this, tensor, op, root](const Running& r) mutable {
                  do_reduce(tensor, op, root, r);
                });
}

std::shared_ptr<Work> ProcessGroupShm::run_broadcast(at::Tensor& tensor, int root,
                                                     const OpContext& ctx) {
  return submit(ctx, Lane::kCollective, tensor.nbytes(), [this, tensor, root](const Running& r) {
    auto* data = static_cast<uint8_t*>(tensor.data_ptr());
    const size_t bytes = tensor.nbytes();
    for (size_t off = 0; off < bytes; off += options_.chunk_bytes) {
      const size_t len = std::min(options_.chunk_bytes, bytes - off);
      const uint64_t k = round_;
      if (rank() == root) {
        std::memcpy(begin_write(r), data + off, len);
        post();
      } else {
        post();
        wait_posted(root, k + 1, r);
        std::memcpy(data + off, peer_buffer(root, k), len);
      }
    }
  });
}

std::shared_ptr<ProcessGroupShm::SymmetricRegion> ProcessGroupShm::find_symmetric_blocks(
    const std::vector<at::Tensor>& blocks, size_t* offset) const {
  if (blocks.empty()) return nullptr;
  const size_t bytes = blocks.front().nbytes();
  const auto* first = static_cast<const uint8_t*>(blocks.front().data_ptr());
  for (size_t s = 0; s < blocks.size(); ++s) {
    if (!blocks[s].is_contiguous() || blocks[s].nbytes() != bytes ||
        static_cast<const uint8_t*>(blocks[s].data_ptr()) != first + s * bytes) {
      return nullptr;
    }
  }
  auto region = find_symmetric(blocks.front(), offset);
  if (region && *offset + blocks.size() * bytes > region->slot_bytes) return nullptr;
  return region;
}

void ProcessGroupShm::allgather_symmetric(const std::vector<at::Tensor>& outputs,
                                          const at::Tensor& input, const SymmetricRegion& region,
                                          size_t offset, const Running& r) {
  const int n = size();
  const int me = rank();
  const size_t bytes = input.nbytes();
  uint8_t* mine = region.slot(me) + offset;  // output block 0 in this rank's slot
  // Round A: this rank's block holds its input (already, when the input is that block).
  if (input.data_ptr() != mine + me * bytes) std::memcpy(mine + me * bytes, input.data_ptr(), bytes);
  const uint64_t ref = (region.id << 40 | offset) + 1;
  meet_on_symmetric(ref, r);
  // Each peer's block straight from its slot: one copy, no staging through the group's buffers.
  for (int s = 0; s < n; ++s) {
    if (s != me) std::memcpy(mine + s * bytes, region.slot(s) + offset + s * bytes, bytes);
  }
  // Round B: every rank has read the others' blocks; no peer reads this rank's block after it,
  // so the caller may change it (the next step's shard) as soon as this returns.
  const uint64_t kb = round_;
  post();
  wait_all_posted(kb + 1, r);
}

void ProcessGroupShm::allgather_from_symmetric(const std::vector<at::Tensor>& outputs,
                                               const at::Tensor& input,
                                               const SymmetricRegion& region, size_t offset,
                                               const Running& r) {
  const int n = size();
  const int me = rank();
  const size_t bytes = input.nbytes();
  // Round A: every rank's input is in place in its slot. Tagged apart from a symmetric output.
  const uint64_t ref = ((region.id << 40 | offset) + 1) | (uint64_t{1} << 63);
  const uint64_t ka = round_;
  begin_write(r);  // no buffer is written, but symmetric_ref[ka % 2] must be free
  publish_tensor_kind(ref);
  post();
  if (outputs[me].data_ptr() != input.data_ptr()) {
    std::memcpy(outputs[me].data_ptr(), input.data_ptr(), bytes);  // while the peers arrive
  }
  wait_all_posted(ka + 1, r);
  check_same_tensor_kind(ref, ka, r);
  for (int s = 0; s < n; ++s) {
    if (s != me) std::memcpy(outputs[s].data_ptr(), region.slot(s) + offset, bytes);
  }
  // Round B: no peer reads this rank's input after it; the caller may change it (the optimizer
  // steps FSDP's shard) as soon as the operation completes.
  const uint64_t kb = round_;
  post();
  wait_all_posted(kb + 1, r);
}

std::shared_ptr<Work> ProcessGroupShm::run_allgather(std::vector<at::Tensor>& outputs,
                                                     const at::Tensor& input,
                                                     const OpContext& ctx) {
  size_t offset = 0;
  // The symmetric ways take two rounds whatever the size, the staged one a round per chunk and a
  // copy more; above options_.symmetric_min_bytes in all the copy costs more than the second round. Every
  // rank passes inputs of one size, so all choose alike.
  if (input.nbytes() * size() > options_.symmetric_min_bytes) {
    if (auto region = find_symmetric_blocks(outputs, &offset)) {
      // all_gather_into_tensor into a tensor of empty_symmetric().
      return submit(ctx, Lane::kCollective, input.nbytes() * size(),
                    [this, outputs, input, region, offset](const Running& r) {
                      allgather_symmetric(outputs, input, *region, offset, r);
                    });
    }
    if (auto region = find_symmetric(input, &offset)) {
      // From a tensor of empty_symmetric() (FSDP's shards, whose full buffers come and go).
      return submit(ctx, Lane::kCollective, input.nbytes() * size(),
                    [this, outputs, input, region, offset](const Running& r) {
                      allgather_from_symmetric(outputs, input, *region, offset, r);
                    });
    }
  }
  return submit(ctx, Lane::kCollective, input.nbytes() * size(),
                [this, outputs, input](const Running& r) {
                  const auto* in = static_cast<const uint8_t*>(input.data_ptr());
                  const size_t bytes = input.nbytes();
                  for (size_t off = 0; off < bytes; off += options_.chunk_bytes) {
                    const size_t len = std::min(options_.chunk_bytes, bytes - off);
                    const uint64_t k = round_;
                    std::memcpy(begin_write(r), in + off, len);
                    // Every rank passes ordinary outputs, or every rank symmetric ones.
                    if (off == 0) publish_tensor_kind(0);
                    post();
                    wait_all_posted(k + 1, r);
                    if (off == 0) check_same_tensor_kind(0, k, r);
                    for (int s = 0; s < size(); ++s) {
                      auto* out = static_cast<uint8_t*>(outputs[s].data_ptr()) + off;
                      const uint8_t* from = s == rank() ? in + off : peer_buffer(s, k);
                      // In place (the input is this rank's output block): nothing to copy.
                      if (out != from) std::memcpy(out, from, len);
                    }
                  }
                });
}

std::shared_ptr<Work> ProcessGroupShm::run_gather(std::vector<at::Tensor>& outputs,
                                                  const at::Tensor& input, int root,
                                                  const OpContext& ctx) {
  return submit(ctx, Lane::kCollective, input.nbytes() * size(),
                [this, outputs, input, root](const Running& r) {
                  const auto* in = static_cast<const uint8_t*>(input.data_ptr());
                  const size_t bytes = input.nbytes();
                  for (size_t off = 0; off < bytes; off += options_.chunk_bytes) {
                    const size_t len = std::min(options_.chunk_bytes, bytes - off);
                    const uint64_t k = round_;
                    if (rank() != root) {
                      std::memcpy(begin_write(r), in + off, len);
                      post();
                      continue;
                    }
                    post();
                    wait_all_posted(k + 1, r);
                    for (int s = 0; s < size(); ++s) {
                      auto* out = static_cast<uint8_t*>(outputs[s].data_ptr()) + off;
                      const uint8_t* from = s == rank() ? in + off : peer_buffer(s, k);
                      // In place (the input is this rank's output block): nothing to copy.
                      if (out != from) std::memcpy(out, from, len);
                    }
                  }
                });
}

std::shared_ptr<Work> ProcessGroupShm::run_scatter(at::Tensor& output,
                                                   std::vector<at::Tensor>& inputs, int root,
                                                   const OpContext& ctx) {
  return submit(
      ctx, Lane::kCollective, output.nbytes() * size(),
      [this, output, inputs, root](const Running& r) {
        auto* out = static_cast<uint8_t*>(output.data_ptr());
        const size_t bytes = output.nbytes();
        // Each round carries one piece per rank, cache-line aligned.
        const size_t piece = options_.chunk_bytes / size() / 64 * 64;
        for (size_t off = 0; off < bytes; off += piece) {
          const size_t len = std::min(piece, bytes - off);
          const uint64_t k = round_;
          if (rank() == root) {
            uint8_t* mine = begin_write(r);
            for (int s = 0; s < size(); ++s) {
              const auto* in = static_cast<const uint8_t*>(inputs[s].data_ptr()) + off;
              std::memcpy(s == rank() ? out + off : mine + s * piece, in, len);
            }
            post();
          } else {
            post();
            wait_posted(root, k + 1, r);
            std::memcpy(out + off, peer_buffer(root, k) + rank() * piece, len);
          }
        }
      });
}

void ProcessGroupShm::reduce_scatter_symmetric(const at::Tensor& output,
                                               const std::vector<at::Tensor>& inputs, ReduceOp op,
                                               const SymmetricRegion& region, size_t offset,
                                               const Running& r) {
  const int me = rank();
  const size_t bytes = output.nbytes();
  // Round A: every rank's input is in place in its slot. Tagged apart from a symmetric output of
  // an all-gather and from an allreduce's tensor (bit 62).
  const uint64_t ref = ((region.id << 40 | offset) + 1) | (uint64_t{1} << 62);
  meet_on_symmetric(ref, r);
  // This rank's block of every rank's input, summed in rank order (as the staged path does).
  for (int s = 0; s < size(); ++s) sources_[s] = region.slot(s) + offset + me * bytes;
  reduce_into(output.data_ptr(), output.numel(), output.scalar_type(), op);
  // Round B: no peer reads this rank's input after it; the caller may reuse it.
  const uint64_t kb = round_;
  post();
  wait_all_posted(kb + 1, r);
}

std::shared_ptr<Work> ProcessGroupShm::run_reduce_scatter(at::Tensor& output,
                                                          std::vector<at::Tensor>& inputs,
                                                          ReduceOp op, const OpContext& ctx) {
  size_t offset = 0;
  // Above options_.symmetric_min_bytes in all, the two rounds of the symmetric way cost less than the
  // staging copy. Every rank passes inputs of one size, so all choose alike (and the first round
  // checks that all passed the same kind of tensor).
  if (output.nbytes() * size() > options_.symmetric_min_bytes) {
    if (auto region = find_symmetric_blocks(inputs, &offset)) {
      return submit(ctx, Lane::kCollective, output.nbytes() * size(),
                    [this, output, inputs, op, region, offset](const Running& r) {
                      reduce_scatter_symmetric(output, inputs, op, *region, offset, r);
                    });
    }
  }
  const bool checked_kind = output.nbytes() * size() > options_.symmetric_min_bytes;
  return submit(
      ctx, Lane::kCollective, output.nbytes() * size(),
      [this, output, inputs, op, checked_kind](const Running& r) {
        const size_t esz = output.element_size();
        const size_t total = output.numel();
        const int me = rank();
        // A round's buffer holds one piece per peer (not per rank: a rank keeps its own block),
        // so 2 ranks move a whole chunk per round: half the rounds, each a rendezvous.
        const size_t piece = options_.chunk_bytes / std::max(size() - 1, 1) / 64 * 64 / esz;
        auto place = [](int s, int owner) { return s < owner ? s : s - 1; };  // s != owner
        auto* out = static_cast<uint8_t*>(output.data_ptr());
        for (size_t start = 0; start < total; start += piece) {
          const size_t m = std::min(piece, total - start);
          const uint64_t k = round_;
          uint8_t* mine = begin_write(r);
          for (int s = 0; s < size(); ++s) {
            if (s == me) continue;
            const auto* in = static_cast<const uint8_t*>(inputs[s].data_ptr()) + start * esz;
            std::memcpy(mine + place(s, me) * piece * esz, in, m * esz);
          }
          // Where the others may have taken the symmetric way, all must agree on the kind.
          if (start == 0 && checked_kind) publish_tensor_kind(0);
          post();
          wait_all_posted(k + 1, r);
          if (start == 0 && checked_kind) check_same_tensor_kind(0, k, r);
          for (int s = 0; s < size(); ++s) {
            sources_[s] = s == me
                              ? static_cast<const uint8_t*>(inputs[s].data_ptr()) + start * esz
                              : peer_buffer(s, k) + place(me, s) * piece * esz;
          }
          reduce_into(out + start * esz, m, output.scalar_type(), op);
        }
      });
}

std::shared_ptr<Work> ProcessGroupShm::run_barrier(const OpContext& ctx) {
  return submit(ctx, Lane::kCollective, 0, [this](const Running& r) {
    post();
    wait_all_posted(round_, r);
  });
}

// ---- point to point ----------------------------------------------------------------------------

Channel& ProcessGroupShm::channel(int src, int dst) const {
  return *reinterpret_cast<Channel*>(channels_ + (static_cast<size_t>(src) * size() + dst) *
                                                     channel_stride_);
}

std::shared_ptr<Work> ProcessGroupShm::run_send(const at::Tensor& tensor, int dst, int tag,
                                                const OpContext& ctx) {
  return submit(ctx, Lane::kSend, tensor.nbytes(), [this, tensor, dst, tag](const Running& r) {
    Channel& ch = channel(rank(), dst);
    auto* buffers = reinterpret_cast<uint8_t*>(&ch) + kChannelHeaderBytes;
    const auto* data = static_cast<const uint8_t*>(tensor.data_ptr());
    const size_t bytes = tensor.nbytes();
    for (size_t off = 0; off < bytes; off += channel_buffer_bytes_) {
      const uint64_t p = sent_pieces_[dst];
      // Buffer p % 2 is free once the receiver has consumed piece p - 2.
      if (p >= 2) {
        wait_until(dst, r, [&] { return ch.consumed.load(std::memory_order_acquire) >= p - 1; });
      }
      ch.info[p % 2] = PieceInfo{tag, bytes};
      std::memcpy(buffers + (p % 2) * channel_buffer_bytes_, data + off,
                  std::min(channel_buffer_bytes_, bytes - off));
      ch.sent.store(p + 1, std::memory_order_release);
      sent_pieces_[dst] = p + 1;
    }
  });
}

std::shared_ptr<Work> ProcessGroupShm::run_recv(at::Tensor& tensor, int src, int tag,
                                                const OpContext& ctx) {
  return submit(ctx, Lane::kRecv, tensor.nbytes(), [this, tensor, src, tag](const Running& r) {
    Channel& ch = channel(src, rank());
    const auto* buffers = reinterpret_cast<const uint8_t*>(&ch) + kChannelHeaderBytes;
    auto* data = static_cast<uint8_t*>(tensor.data_ptr());
    const size_t bytes = tensor.nbytes();
    for (size_t off = 0; off < bytes; off += channel_buffer_bytes_) {
      const uint64_t p = received_pieces_[src];
      wait_until(src, r, [&] { return ch.sent.load(std::memory_order_acquire) >= p + 1; });
      const PieceInfo info = ch.info[p % 2];
      if (info.tag != tag || info.message_bytes != bytes) {
        const std::string message = detail::str_cat(
            r.ctx->prefix(), ": rank ", src, " sent ", info.message_bytes, " bytes with tag ",
            info.tag, " but this rank expects ", bytes, " bytes with tag ", tag,
            "; sends and receives between two ranks must match in order, size and tag");
        abort(message);
        SHOAL_THROW(InvalidArgument, message);
      }
      std::memcpy(data + off, buffers + (p % 2) * channel_buffer_bytes_,
                  std::min(channel_buffer_bytes_, bytes - off));
      ch.consumed.store(p + 1, std::memory_order_release);
      received_pieces_[src] = p + 1;
    }
  });
}

}  // namespace shoal::comm::shm
