#include "allreduce_contenders.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "comm/shm/process_group_shm.h"
#include "comm/shm/reduce_kernels.h"
#include "shoal/error.h"
#include "shoal/launcher/launch.h"

#if SHOAL_HAVE_MPI
// The C API only: OpenMPI's header would otherwise pull in its C++ bindings (a library Shoal
// does not link).
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#endif

namespace shoal::cli {

using Clock = std::chrono::steady_clock;
using comm::Milliseconds;

std::string format_bytes(int64_t bytes) {
  char text[32];
  if (bytes >= (int64_t{1} << 20) && bytes % (int64_t{1} << 20) == 0) {
    std::snprintf(text, sizeof(text), "%lld MiB", static_cast<long long>(bytes >> 20));
  } else if (bytes >= 1024 && bytes % 1024 == 0) {
    std::snprintf(text, sizeof(text), "%lld KiB", static_cast<long long>(bytes >> 10));
  } else {
    std::snprintf(text, sizeof(text), "%lld B", static_cast<long long>(bytes));
  }
  return text;
}

// ---- ShoalContender ----------------------------------------------------------------------------

Collective collective_from_name(const std::string& name) {
  if (name == "allreduce") return Collective::kAllreduce;
  if (name == "reduce_scatter") return Collective::kReduceScatter;
  if (name == "all_gather") return Collective::kAllGather;
  SHOAL_THROW(InvalidArgument, "--collective '", name,
              "' is not one of allreduce, reduce_scatter, all_gather");
}

std::string collective_name(Collective collective) {
  switch (collective) {
    case Collective::kReduceScatter:
      return "reduce_scatter";
    case Collective::kAllGather:
      return "all_gather";
    default:
      return "allreduce";
  }
}

ShoalContender::ShoalContender(std::shared_ptr<comm::ProcessGroup> pg, bool symmetric,
                               Collective collective)
    : pg_(std::move(pg)), symmetric_(symmetric), collective_(collective) {}

std::string ShoalContender::name() const {
  if (!label_.empty()) return label_;
  return pg_->backend_name() + (in_place_ ? "_in_place" : symmetric_ ? "_symmetric" : "") +
         (checked_ ? "_checked" : "");
}

void ShoalContender::set_checked(bool checked) {
  checked_ = checked;
  if (checked) pg_->set_check_collectives(true);
}

at::Tensor& ShoalContender::buffer(int64_t bytes) {
  // Sizes change on every rank at the same call, so empty_symmetric (a collective) lines up.
  if (collective_ != Collective::kAllreduce) {
    // Whole floats per rank: the full tensor is n pieces.
    const int64_t per_rank = bytes / 4 / pg_->size();
    if (piece_.numel() != per_rank) {
      tensor_ = at::Tensor();
      piece_ = at::Tensor();
      // shm_symmetric: the input in symmetric memory, as FSDP's are (its flat gradients for the
      // reduce-scatter; stage 3's shards for the all-gather). In place: the output (symmetric
      // for shm_in_place) with the input its own block, as stages 1-2 gather.
      const bool full_symmetric =
          symmetric_ && (collective_ == Collective::kReduceScatter || in_place_);
      const bool piece_symmetric = symmetric_ && collective_ == Collective::kAllGather && !in_place_;
      tensor_ = full_symmetric ? pg_->empty_symmetric(per_rank * pg_->size(), torch::kFloat).zero_()
                               : torch::zeros({per_rank * pg_->size()}, torch::kFloat);
      piece_ = in_place_        ? tensor_.narrow(0, pg_->rank() * per_rank, per_rank)
               : piece_symmetric ? pg_->empty_symmetric(per_rank, torch::kFloat).zero_()
                                 : torch::zeros({per_rank}, torch::kFloat);
      SHOAL_CHECK(!symmetric_ || pg_->is_symmetric(full_symmetric ? tensor_ : piece_),
                  pg_->rank_prefix(), " ", name(), ": no symmetric memory for ",
                  format_bytes(bytes),
                  "; make /dev/shm larger (df -h /dev/shm) or leave shm_symmetric out of --backend");
    }
    return tensor_;
  }
  if (tensor_.numel() != bytes / 4) {
    tensor_ = at::Tensor();  // the old one's memory first
    tensor_ = symmetric_ ? pg_->empty_symmetric(bytes / 4, torch::kFloat).zero_()
                         : torch::zeros({bytes / 4}, torch::kFloat);
    SHOAL_CHECK(!symmetric_ || pg_->is_symmetric(tensor_), pg_->rank_prefix(), " ", name(),
                ": no symmetric memory for ", format_bytes(bytes),
                "; make /dev/shm larger (df -h /dev/shm) or leave shm_symmetric out of --backend");
  }
  return tensor_;
}

void ShoalContender::allreduce(at::Tensor& tensor) {
  comm::AllreduceOptions options;
  options.async_op = async_op_;
  pg_->allreduce(tensor, options)->wait();
}

void ShoalContender::reduce_scatter(at::Tensor& output, const at::Tensor& input) {
  comm::ReduceScatterOptions options;
  options.async_op = async_op_;
  pg_->reduce_scatter_tensor(output, input, options)->wait();
}

void ShoalContender::all_gather(at::Tensor& output, const at::Tensor& input) {
  comm::AllgatherOptions options;
  options.async_op = async_op_;
  pg_->all_gather_into_tensor(output, input, options)->wait();
}

void ShoalContender::run_once() {
  switch (collective_) {
    case Collective::kReduceScatter:
      reduce_scatter(piece_, tensor_);
      return;
    case Collective::kAllGather:
      all_gather(tensor_, piece_);
      return;
    default:
      allreduce(tensor_);
  }
}

void ShoalContender::barrier() { pg_->barrier()->wait(); }

void ShoalContender::warm_up(int64_t bytes, int iterations) {
  if (collective_ != Collective::kAllreduce) {
    buffer(bytes);
    const int n = pg_->size();
    const int r = pg_->rank();
    tensor_.fill_(r + 1);
    piece_.fill_(r + 1);
    run_once();
    // reduce-scatter: every block summed; all-gather: block i is rank i's (i + 1).
    const bool right =
        collective_ == Collective::kReduceScatter
            ? piece_.eq(n * (n + 1) / 2).all().item<bool>()
            : tensor_.view({n, -1}).eq(torch::arange(1, n + 1, torch::kFloat).view({n, 1})).all()
                  .item<bool>();
    SHOAL_CHECK(right, "[rank ", r, "/", n, "] backend ", name(), " returned a wrong ",
                collective_name(collective_), " result for ", format_bytes(bytes),
                "; its timings would mean nothing");
    tensor_.zero_();
    piece_.zero_();
    for (int i = 0; i < iterations; ++i) run_once();
    return;
  }
  at::Tensor& tensor = buffer(bytes);
  // Rank r adds r + 1: every element must come back as n(n+1)/2 (exact in float32).
  tensor.fill_(pg_->rank() + 1);
  allreduce(tensor);
  const int n = pg_->size();
  SHOAL_CHECK(tensor.eq(n * (n + 1) / 2).all().item<bool>(), "[rank ", pg_->rank(), "/", n,
              "] backend ", name(), " returned a wrong allreduce result for ",
              format_bytes(bytes), "; its timings would mean nothing");
  tensor.zero_();  // zeros stay zeros: no overflow, no denormals while timing
  for (int i = 0; i < iterations; ++i) allreduce(tensor);
}

double ShoalContender::measure(int64_t bytes, int iterations) {
  buffer(bytes);
  barrier();
  const auto start = Clock::now();
  for (int i = 0; i < iterations; ++i) run_once();
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count() / iterations;
  // The slowest rank's time, through the group whatever the contender times.
  at::Tensor slowest = torch::full({1}, seconds, torch::kDouble);
  comm::AllreduceOptions max;
  max.op = comm::ReduceOp::kMax;
  pg_->allreduce(slowest, max)->wait();
  return slowest.item<double>();
}

// ---- OpenMpiContender --------------------------------------------------------------------------

OpenMpiContender::OpenMpiContender(std::shared_ptr<comm::ProcessGroup> keep_alive,
                                   Collective collective)
    : ShoalContender(std::move(keep_alive), false, collective) {
  SHOAL_CHECK_T(InvalidArgument, SHOAL_HAVE_MPI, "the openmpi contender needs Shoal built with MPI");
}

void OpenMpiContender::allreduce(at::Tensor& tensor) {
#if SHOAL_HAVE_MPI
  const int rc = MPI_Allreduce(MPI_IN_PLACE, tensor.data_ptr(), static_cast<int>(tensor.numel()),
                               MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  SHOAL_CHECK(rc == MPI_SUCCESS, "[rank ", group().rank(), "/", group().size(), "] openmpi: "
              "MPI_Allreduce of ", tensor.numel(), " elements failed with MPI error ", rc,
              "; rerun with --backend mpi for Shoal's checks and time-outs");
#endif
}

void OpenMpiContender::reduce_scatter(at::Tensor& output, const at::Tensor& input) {
#if SHOAL_HAVE_MPI
  const int rc = MPI_Reduce_scatter_block(input.data_ptr(), output.data_ptr(),
                                          static_cast<int>(output.numel()), MPI_FLOAT, MPI_SUM,
                                          MPI_COMM_WORLD);
  SHOAL_CHECK(rc == MPI_SUCCESS, "[rank ", group().rank(), "/", group().size(), "] openmpi: "
              "MPI_Reduce_scatter_block of ", output.numel(), " elements a rank failed with MPI "
              "error ", rc, "; rerun with --backend mpi for Shoal's checks and time-outs");
#endif
}

void OpenMpiContender::all_gather(at::Tensor& output, const at::Tensor& input) {
#if SHOAL_HAVE_MPI
  const int count = static_cast<int>(input.numel());
  // In place: the input already lies in this rank's block of the output (MPI's own way to say so).
  const int rc = in_place() ? MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, output.data_ptr(),
                                            count, MPI_FLOAT, MPI_COMM_WORLD)
                            : MPI_Allgather(input.data_ptr(), count, MPI_FLOAT, output.data_ptr(),
                                            count, MPI_FLOAT, MPI_COMM_WORLD);
  SHOAL_CHECK(rc == MPI_SUCCESS, "[rank ", group().rank(), "/", group().size(), "] openmpi: "
              "MPI_Allgather of ", count, " elements a rank failed with MPI error ", rc,
              "; rerun with --backend mpi for Shoal's checks and time-outs");
#endif
}

void OpenMpiContender::barrier() {
#if SHOAL_HAVE_MPI
  MPI_Barrier(MPI_COMM_WORLD);
#endif
}

// ---- MemoryFloorContender ----------------------------------------------------------------------

MemoryFloorContender::MemoryFloorContender(std::shared_ptr<comm::ProcessGroup> group, Floor floor)
    : ShoalContender(std::move(group)),
      floor_(floor),
      chunk_(static_cast<int64_t>(comm::shm::staged_chunk_bytes(this->group().size())) / 4) {}

std::string MemoryFloorContender::name() const {
  switch (floor_) {
    case Floor::kStaged: return "floor_staged";
    case Floor::kSingleCopy: return "floor_single_copy";
    case Floor::kInplace: break;
  }
  return "floor_inplace";
}

bool MemoryFloorContender::parse(const std::string& name, Floor* floor) {
  Floor found;
  if (name == "floor_staged") found = Floor::kStaged;
  else if (name == "floor_single_copy") found = Floor::kSingleCopy;
  else if (name == "floor_inplace") found = Floor::kInplace;
  else return false;
  if (floor != nullptr) *floor = found;
  return true;
}

void MemoryFloorContender::warm_up(int64_t bytes, int iterations) {
  at::Tensor probe = torch::zeros({bytes / 4}, torch::kFloat);
  for (int i = 0; i < iterations; ++i) allreduce(probe);
}

void MemoryFloorContender::allreduce(at::Tensor& tensor) {
  if (floor_ == Floor::kInplace) {
    tensor.mul_(0.5f);  // zeros stay zeros
    return;
  }
  if (!stage_.defined()) stage_ = torch::zeros({3, (chunk_ + 1) / 2}, torch::kFloat);
  const int64_t total = tensor.numel();
  for (int64_t start = 0; start < total; start += chunk_) {
    const int64_t m = std::min(chunk_, total - start);
    const int64_t own = m / 2, other = m - own;
    at::Tensor mine = tensor.narrow(0, start, own);
    at::Tensor theirs = tensor.narrow(0, start + own, other);
    at::Tensor published = stage_[0].narrow(0, 0, other);
    published.copy_(theirs);  // for the peer to sum
    // The own half with the peer's, by the shm backend's own kernel; staged, it writes the sum
    // a second time in the same pass, for the peer to read back.
    const void* sources[2] = {mine.data_ptr(), stage_[2].data_ptr()};
    comm::shm::ReduceArgs args;
    args.dst = mine.data_ptr();
    args.dst2 = floor_ == Floor::kStaged ? stage_[1].data_ptr() : nullptr;
    args.src = sources;
    args.num_src = 2;
    args.count = static_cast<size_t>(own);
    comm::shm::reduce_sources(args);
    theirs.copy_(stage_[2].narrow(0, 0, other));  // the peer's reduced half
  }
}

// ---- AllGatherFloorContender -------------------------------------------------------------------

AllGatherFloorContender::AllGatherFloorContender(std::shared_ptr<comm::ProcessGroup> group)
    : ShoalContender(std::move(group), false, Collective::kAllGather) {}

void AllGatherFloorContender::all_gather(at::Tensor& output, const at::Tensor& input) {
  if (source_.numel() != output.numel()) {
    const int n = group().size();
    source_ = torch::arange(1, n + 1, torch::kFloat).repeat_interleave(output.numel() / n);
  }
  if (!in_place()) {
    output.copy_(source_);
    return;
  }
  const int64_t block = input.numel();
  for (int s = 0; s < group().size(); ++s) {
    if (s != group().rank()) output.narrow(0, s * block, block).copy_(source_.narrow(0, s * block, block));
  }
}

// ---- TorchContender ----------------------------------------------------------------------------

TorchContender::TorchContender(int rank, int world_size, const std::string& script,
                               std::vector<std::string> python, std::string name)
    : name_(std::move(name)), rank_(rank) {
  if (rank_ != 0) return;
  const std::string port = std::to_string(launcher::pick_free_port());
  const std::string nproc = std::to_string(world_size);
  std::vector<std::string> argv = std::move(python);
  std::string shown;  // the command, for the message when it does not start
  for (const auto& word : argv) shown += word + " ";
  argv.insert(argv.end(), {script, "--serve", "--nproc", nproc, "--port", port});
  int to_child[2], from_child[2];
  SHOAL_CHECK(::pipe2(to_child, O_CLOEXEC) == 0 && ::pipe2(from_child, O_CLOEXEC) == 0,
              "pipe: ", std::strerror(errno));
  std::vector<char*> args;
  for (auto& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  pid_ = ::fork();
  SHOAL_CHECK(pid_ >= 0, "fork: ", std::strerror(errno));
  if (pid_ == 0) {
    ::dup2(to_child[0], 0);
    ::dup2(from_child[1], 1);
    ::signal(SIGPIPE, SIG_DFL);
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  ::close(to_child[0]);
  ::close(from_child[1]);
  in_ = to_child[1];
  out_ = from_child[0];
  const std::string hello = read_line();
  SHOAL_CHECK(hello == "ready", "bench/allreduce_torch.py did not start (said '", hello,
              "'); run it alone to see why: ", shown, script, " --nproc ", nproc);
}

TorchContender::~TorchContender() {
  if (pid_ <= 0) return;
  ::close(in_);  // end of input: the script stops its ranks and exits
  ::close(out_);
  for (int i = 0; i < 500; ++i) {  // up to 5 s, then kill: no zombie either way
    if (::waitpid(pid_, nullptr, WNOHANG) == pid_) return;
    ::usleep(10'000);
  }
  ::kill(pid_, SIGKILL);
  ::waitpid(pid_, nullptr, 0);
}

void TorchContender::warm_up(int64_t bytes, int iterations) { request(bytes, 0, iterations); }

double TorchContender::measure(int64_t bytes, int iterations) {
  return request(bytes, iterations, 0);
}

double TorchContender::request(int64_t bytes, int iterations, int warmup) {
  if (rank_ != 0) return 0;
  const std::string command = std::to_string(bytes) + " " + std::to_string(iterations) + " " +
                              std::to_string(warmup) + "\n";
  SHOAL_CHECK(::write(in_, command.data(), command.size()) == static_cast<ssize_t>(command.size()),
              "the PyTorch co-process (bench/allreduce_torch.py) has gone away");
  const std::string reply = read_line();
  const char* key = "\"latency_us\": ";
  const auto at = reply.find(key);
  SHOAL_CHECK(at != std::string::npos, "unexpected reply from bench/allreduce_torch.py: '", reply,
              "'");
  return std::strtod(reply.c_str() + at + std::strlen(key), nullptr) * 1e-6;
}

std::string TorchContender::read_line() {
  const auto until = Clock::now() + Milliseconds(kReplyTimeoutMs);
  while (true) {
    const auto newline = pending_.find('\n');
    if (newline != std::string::npos) {
      std::string line = pending_.substr(0, newline);
      pending_.erase(0, newline + 1);
      return line;
    }
    const auto left = std::chrono::duration_cast<Milliseconds>(until - Clock::now()).count();
    SHOAL_CHECK_T(TimeoutError, left > 0, "bench/allreduce_torch.py did not answer within ",
                  kReplyTimeoutMs, " ms");
    pollfd pfd{out_, POLLIN, 0};
    if (::poll(&pfd, 1, static_cast<int>(left)) <= 0) continue;
    char buffer[4096];
    const ssize_t n = ::read(out_, buffer, sizeof(buffer));
    SHOAL_CHECK(n > 0, "bench/allreduce_torch.py exited early (its stderr above says why)");
    pending_.append(buffer, static_cast<size_t>(n));
  }
}

}  // namespace shoal::cli
