// ProcessGroupShm: send and recv, through one channel per ordered pair of ranks.
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
#include "comm/shm/waiting.h"
#include "comm/timeouts.h"
#include "shoal/error.h"
#include "shoal/log.h"

namespace shoal::comm::shm {

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
