// ProcessGroupShm: the collectives, staged through the ranks' buffers in the segment (and their
// entry points, which take the symmetric way where the tensors allow).
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

}  // namespace shoal::comm::shm
