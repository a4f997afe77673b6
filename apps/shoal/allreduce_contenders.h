// The contenders of `shoal bench allreduce`: one per allreduce implementation in the race.
//
// Every rank of the bench holds the same list and calls warm_up()/measure() in the same order;
// a contender whose work runs elsewhere (PyTorch's co-process) does it on rank 0 only, while the
// other ranks wait in the next Shoal contender's barrier.
//
// Thread safety: not thread-safe; the bench's one thread drives them.
#pragma once

#include <sys/types.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>

#include "shoal/comm/process_group.h"

namespace shoal::cli {

/// The collective a race times (`shoal bench allreduce --collective`), with PyTorch's names:
/// allreduce, reduce_scatter_tensor and all_gather_into_tensor. A size is the full tensor's: the
/// reduce-scatter's input and the all-gather's output; each rank's piece is 1/n of it.
enum class Collective { kAllreduce, kReduceScatter, kAllGather };

/// "allreduce", "reduce_scatter", "all_gather"; InvalidArgument for anything else.
Collective collective_from_name(const std::string& name);
std::string collective_name(Collective collective);

/// One allreduce implementation in the race.
class Contender {
 public:
  virtual ~Contender() = default;
  /// "gloo", "shm", "mpi", "torch_gloo"...
  virtual std::string name() const = 0;
  /// Runs `iterations` untimed float32 allreduces of `bytes`, checking the result once.
  virtual void warm_up(int64_t bytes, int iterations) = 0;
  /// Seconds per allreduce of `bytes`, timed over `iterations` after a barrier: the slowest
  /// rank's time (valid on rank 0).
  virtual double measure(int64_t bytes, int iterations) = 0;
};

/// A Shoal process group (any backend), on ordinary tensors or (`symmetric`) on tensors from
/// its empty_symmetric(), named "<backend>_symmetric".
class ShoalContender : public Contender {
 public:
  /// `collective`: what warm_up() and measure() run (allreduce by default); `bytes` is then the
  /// full tensor's size, rounded down to whole floats per rank.
  explicit ShoalContender(std::shared_ptr<comm::ProcessGroup> pg, bool symmetric = false,
                          Collective collective = Collective::kAllreduce);
  std::string name() const override;
  void warm_up(int64_t bytes, int iterations) override;
  double measure(int64_t bytes, int iterations) override;
  /// true: each collective is issued as DDP issues its buckets (a Work returned at once, then
  /// waited for); false (the default): a blocking call (async_op = false), as MPI_Allreduce and
  /// torch.distributed's default.
  void set_async_op(bool async_op) { async_op_ = async_op; }
  /// all_gather only: the input is this rank's own block of the output (torch's in-place
  /// all_gather_into_tensor, as FSDP's stages 1-2 gather; MPI_IN_PLACE for OpenMPI), and with
  /// `symmetric` the output is in symmetric memory. Named "<backend>_in_place".
  void set_in_place(bool in_place) { in_place_ = in_place; }
  /// Turns the group's collective check off (ProcessGroup::set_check_collectives), named
  /// "<backend>_checked": with the per-collective check (SHOAL_DEBUG=detail's), what it costs
  /// next to the unchecked group in the same run.
  void set_checked(bool checked);
  /// Replaces the name (when not empty): "gloo_ring" for the gloo group running the ring.
  void set_label(std::string label) { label_ = std::move(label); }

 protected:
  /// One blocking float32 sum allreduce and one barrier: what warm_up() and measure() time.
  virtual void allreduce(at::Tensor& tensor);
  /// One blocking float32 sum reduce-scatter: `input` has size() times `output`'s elements.
  virtual void reduce_scatter(at::Tensor& output, const at::Tensor& input);
  /// One blocking all-gather: `output` has size() times `input`'s elements, rank 0's first.
  virtual void all_gather(at::Tensor& output, const at::Tensor& input);
  virtual void barrier();
  const comm::ProcessGroup& group() const { return *pg_; }
  bool in_place() const { return in_place_; }

 private:
  at::Tensor& buffer(int64_t bytes);
  void run_once();  ///< the collective once, on the buffers of the last buffer()
  std::shared_ptr<comm::ProcessGroup> pg_;
  bool symmetric_;
  Collective collective_;
  bool async_op_ = false;
  bool in_place_ = false;
  bool checked_ = false;
  std::string label_;
  at::Tensor tensor_;  ///< the full tensor: allreduce's, reduce-scatter's input, all-gather's output
  at::Tensor piece_;   ///< reduce-scatter's output, all-gather's input
};

/// OpenMPI itself: MPI_Allreduce in place (MPI_Reduce_scatter_block, MPI_Allgather for the other
/// collectives; with set_in_place, MPI_Allgather with MPI_IN_PLACE, "openmpi_in_place") on
/// MPI_COMM_WORLD, blocking, with nothing of Shoal's around it (no worker thread, no checks); the
/// same timing loop as ShoalContender. `keep_alive` is the Shoal mpi group whose creation
/// initialised MPI. Only where Shoal is built with MPI.
class OpenMpiContender : public ShoalContender {
 public:
  explicit OpenMpiContender(std::shared_ptr<comm::ProcessGroup> keep_alive,
                            Collective collective = Collective::kAllreduce);
  std::string name() const override { return in_place() ? "openmpi_in_place" : "openmpi"; }

 protected:
  void allreduce(at::Tensor& tensor) override;
  void reduce_scatter(at::Tensor& output, const at::Tensor& input) override;
  void all_gather(at::Tensor& output, const at::Tensor& input) override;
  void barrier() override;
};

/// No communication at all: every rank at once does only the memory work an allreduce of its
/// tensor cannot avoid, timed like the others (the reference for what this machine allows).
/// kStaged: the shm backend's path for ordinary tensors without its waits (per chunk, the
/// backend's (shm::staged_chunk_bytes): copy
/// the half the peer reduces to a staging buffer, sum the own half with a staged one into the
/// tensor and a second staging buffer, copy a staged half back). kSingleCopy: the least any
/// allreduce of two ranks' private tensors moves (OpenMPI's single-copy way without its waits and
/// system calls: per chunk, copy the half the peer reduces, as the peer's kernel copies it
/// out, sum the own half with a copied one into the tensor, copy a reduced half back; nothing is
/// written twice). kInplace: one in-place pass over the tensor (read and write every byte once:
/// the least an in-place allreduce moves, were the peers' tensors in shared memory). Named
/// "floor_staged" / "floor_single_copy" / "floor_inplace"; `group` only times (barrier, slowest
/// rank).
class MemoryFloorContender : public ShoalContender {
 public:
  enum class Floor { kInplace, kStaged, kSingleCopy };
  MemoryFloorContender(std::shared_ptr<comm::ProcessGroup> group, Floor floor);
  std::string name() const override;
  void warm_up(int64_t bytes, int iterations) override;

  /// The floor a contender name stands for (into `floor` unless null); false when it names none.
  static bool parse(const std::string& name, Floor* floor = nullptr);

 protected:
  void allreduce(at::Tensor& tensor) override;

 private:
  Floor floor_;
  int64_t chunk_;     // the shm backend's chunk, in floats
  at::Tensor stage_;  // three halves of a chunk
};

/// No communication at all, for --collective all_gather: every rank at once writes its whole
/// output once from a buffer of its own holding what the all-gather would give (block i is
/// i + 1, so warm_up()'s check holds): the least any all-gather moves, one write of every output
/// byte (shm's symmetric way and OpenMPI's single-copy path also read it from the peers' memory).
/// Named "floor_copy"; with set_in_place ("floor_copy_in_place") only the peers' blocks are
/// written, the least an in-place all-gather moves. `group` only times.
class AllGatherFloorContender : public ShoalContender {
 public:
  explicit AllGatherFloorContender(std::shared_ptr<comm::ProcessGroup> group);
  std::string name() const override { return in_place() ? "floor_copy_in_place" : "floor_copy"; }

 protected:
  void all_gather(at::Tensor& output, const at::Tensor& input) override;

 private:
  at::Tensor source_;  // the output's values, the size of the last output
};

/// PyTorch's torch.distributed gloo in processes of its own (bench/allreduce_torch.py --serve),
/// which rank 0 starts and drives over pipes; killed and reaped on destruction.
class TorchContender : public Contender {
 public:
  /// Why 120 s: importing torch and meeting its peers can take a minute on a loaded machine.
  static constexpr int kReplyTimeoutMs = 120'000;

  /// `python`: the command that runs the script (a TorchPeer's); `name`: "torch_gloo" (Debian's
  /// PyTorch) or "torch2_gloo" (PyTorch 2.x from PyPI).
  TorchContender(int rank, int world_size, const std::string& script,
                 std::vector<std::string> python, std::string name);
  ~TorchContender() override;
  TorchContender(const TorchContender&) = delete;
  TorchContender& operator=(const TorchContender&) = delete;

  std::string name() const override { return name_; }
  void warm_up(int64_t bytes, int iterations) override;
  double measure(int64_t bytes, int iterations) override;

 private:
  double request(int64_t bytes, int iterations, int warmup);
  std::string name_;
  std::string read_line();

  int rank_;
  pid_t pid_ = -1;
  int in_ = -1;
  int out_ = -1;
  std::string pending_;
};

/// "4 KiB", "64 MiB", "100 B".
std::string format_bytes(int64_t bytes);

}  // namespace shoal::cli
