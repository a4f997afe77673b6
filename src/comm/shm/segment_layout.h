// The shm backend's segment layout: the structures ProcessGroupShm's ranks share (see
// process_group_shm.h for the layout and the round protocol), and the small helpers every part of
// the backend uses. Private to src/comm/shm/.
//
// Thread safety: the structures are shared between processes; their atomics are the protocol.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>

#include <unistd.h>

#include "comm/shm/process_group_shm.h"
#include "comm/shm/shared_segment.h"

namespace shoal::comm::shm {

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

inline const char* const kOpNames[] = {"?",       "allreduce", "broadcast", "reduce", "allgather",
                                       "reduce_scatter", "gather", "scatter", "barrier"};

/// The index of `name` in kOpNames (0: not a collective it names).
inline int op_code(const char* name) {
  for (int i = 1; i < static_cast<int>(sizeof kOpNames / sizeof kOpNames[0]); ++i) {
    if (std::strcmp(kOpNames[i], name) == 0) return i;
  }
  return 0;
}

inline size_t round_up(size_t value, size_t to) { return (value + to - 1) / to * to; }

/// A fresh segment name, "/shoal-<pid>-<random>" (see shared_segment.h for why the pid).
inline std::string unique_segment_name() {
  std::random_device device;
  std::ostringstream name;
  name << "/shoal-" << getpid() << "-" << std::hex << device() << device();
  return name.str();
}

}  // namespace shoal::comm::shm
