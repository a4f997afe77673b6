// ProcessGroupShm: construction (the segment mapped, the ranks met) and the operation plumbing
// (the queues). The rounds and waits are in waiting.cpp, the collectives in staged_algorithms.cpp
// and symmetric_algorithms.cpp, sends and receives in point_to_point.cpp.
#include "comm/shm/process_group_shm.h"

#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <new>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include "comm/peer_directory.h"
#include "comm/shm/op_queue.h"
#include "comm/shm/reduce_kernels.h"
#include "comm/shm/segment_layout.h"
#include "comm/timeouts.h"
#include "shoal/env.h"
#include "shoal/error.h"
#include "shoal/log.h"

namespace shoal::comm::shm {

namespace {

size_t env_bytes(env::Var var, size_t fallback) {
  const std::optional<int64_t> bytes = env::integer(var);
  return bytes ? static_cast<size_t>(*bytes) : fallback;
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
  const std::vector<std::string> hosts = gather_records(*store_, scope_ + "/host", rank, size, host);
  for (int r = 0; r < size; ++r) {
    const std::string& theirs = hosts[r];
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

}  // namespace shoal::comm::shm
