// ProcessGroupShm: symmetric memory (empty_symmetric) and the collectives that work in place
// across the ranks' slots of it.
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
#include "shoal/error.h"
#include "shoal/log.h"

namespace shoal::comm::shm {

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

}  // namespace shoal::comm::shm
