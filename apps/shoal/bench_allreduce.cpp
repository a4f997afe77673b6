// `shoal bench allreduce`: latency and bus bandwidth of float32 allreduce per backend, for sizes
// from 4 KiB to 64 MiB, next to this machine's one-thread memcpy bandwidth (the physical limit on
// one node), all measured in one run.
//
// Contenders run interleaved (A B, B A, ... for each size: on a noisy machine drift hits every
// contender alike) and each reports the median of its repeats. "torch_gloo" is PyTorch's own
// torch.distributed gloo, run by bench/allreduce_torch.py as a co-process that rank 0 drives.
// "openmpi" is MPI_Allreduce itself (Shoal's "mpi" backend adds a worker thread and the collective
// checks around it). "gloo_checked" and "mpi_checked" are those backends with the
// per-collective check of SHOAL_DEBUG=detail on: its cost, measured next to the unchecked one.
// "shm_symmetric" is the shm backend on tensors from empty_symmetric() (reduced in place across
// the ranks' copies, as DDP's buckets are). "floor_staged", "floor_single_copy" and
// "floor_inplace" communicate nothing: every rank does at once only the memory work of shm's
// staged path, of the single-copy way (the least any allreduce of private tensors moves, which
// bounds what any of them can reach on this machine), or one in-place pass over its tensor.
//
// --collective reduce_scatter | all_gather races reduce_scatter_tensor / all_gather_into_tensor
// instead (what FSDP's stages 2-3 run), "openmpi" being MPI_Reduce_scatter_block / MPI_Allgather;
// a size is then the full tensor's (the reduce-scatter's input, the all-gather's output) and the
// bus bandwidth bytes x (n-1)/n / time. The PyTorch and the three allreduce floor contenders race
// allreduce only and are refused there; "floor_copy" races all_gather only: no communication,
// every rank at once writes its whole output once from a buffer of its own (the least any
// all-gather moves), which bounds what any all-gather can reach on this machine. The "_in_place"
// contenders race all_gather only, with the input already in this rank's block of the output
// (torch's in-place all_gather_into_tensor, as FSDP's stages 1-2 gather): "shm_in_place" (the
// output symmetric), "openmpi_in_place" (MPI_IN_PLACE), "floor_copy_in_place" (only the peers'
// blocks written, the least an in-place all-gather moves).
//
// --algorithm ring,tree,... races the gloo backend's allreduce algorithms (SHOAL_ALLREDUCE_ALGO's
// values, "native" being c10d Gloo's own), one gloo group each, named "gloo_<algorithm>"; they
// race alone unless --backend is given too.
//
// Without a launcher around it (comm::detect_rank_info().launched is false) the bench starts
// its own ranks: through shoal::launcher::launch(), or through mpirun when --backend names mpi.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "allreduce_contenders.h"
#include "bench_harness.h"
#include "bench_util.h"
#include "comm/algorithms/allreduce_algorithm.h"
#include "comm/gloo/process_group_gloo.h"
#include "commands.h"
#include "shoal/comm/init.h"
#include "shoal/env.h"
#include "shoal/error.h"
#include "shoal/launcher/launch.h"

namespace shoal::cli {
namespace {

using Clock = std::chrono::steady_clock;
using comm::Milliseconds;

// Why 300 s: ranks wait in a barrier while rank 0 drives the PyTorch co-process (which imports
// torch first) or measures memcpy; a busy machine can make that take minutes. Still finite.
constexpr Milliseconds kBenchTimeout{300'000};
// Why 64 MiB per repeat: long enough that timer and scheduling noise is small against it, short
// enough that a sweep of 8 sizes x 5 repeats x a few backends takes seconds, not minutes.
constexpr int64_t kBytesPerRepeat = int64_t{64} << 20;
constexpr int kMinIters = 3;
constexpr int kMaxIters = 200;
// Why 64 MiB: well beyond the last-level cache, so memcpy measures memory, not cache.
constexpr int64_t kMemcpyBytes = int64_t{64} << 20;

struct AllreduceBenchArgs {
  std::string backends = "gloo";  // none when only --algorithm is given
  std::string algorithms;         // gloo's allreduce algorithms, each a contender
  std::string collective = "allreduce";  // or reduce_scatter, all_gather
  int nproc = 2;
  std::string min_bytes = "4KiB";
  std::string max_bytes = "64MiB";
  int iters = 0;  // 0: chosen per size (kBytesPerRepeat)
  int repeats = 5;
  int warmup = 2;
  bool json = false;
  std::string torch_script;
  std::string launcher = "auto";  // how ranks are started when none is around: shoal, mpirun
  bool async_op = false;  // Shoal's calls return a Work first (as DDP's buckets), then wait
};

std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> parts;
  std::stringstream in(text);
  for (std::string part; std::getline(in, part, sep);) {
    if (!part.empty()) parts.push_back(part);
  }
  return parts;
}

// "4096", "4K", "4KiB", "64M", "64MiB", "1G": binary multiples.
int64_t parse_bytes(const std::string& text, const char* option) {
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  std::string unit(end);
  for (auto& c : unit) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  int64_t scale = 0;
  if (unit.empty() || unit == "b") scale = 1;
  if (unit == "k" || unit == "kib" || unit == "kb") scale = int64_t{1} << 10;
  if (unit == "m" || unit == "mib" || unit == "mb") scale = int64_t{1} << 20;
  if (unit == "g" || unit == "gib" || unit == "gb") scale = int64_t{1} << 30;
  SHOAL_CHECK_T(InvalidArgument, end != text.c_str() && scale > 0 && value * scale >= 4, option,
                " '", text,
                "' is not a size; write e.g. 4096, 4KiB or 64MiB (at least 4 bytes)");
  return static_cast<int64_t>(value * static_cast<double>(scale)) / 4 * 4;  // whole floats
}

// bench/allreduce_torch.py: --torch-script, $SHOAL_SOURCE_DIR/bench, or next to the build tree.
std::string find_torch_script(const std::string& given) {
  if (!given.empty()) return given;
  std::vector<std::filesystem::path> candidates;
  if (const auto source = env::text(env::Var::kSourceDir)) {
    candidates.push_back(std::filesystem::path(*source) / "bench/allreduce_torch.py");
  }
  // <source>/build/apps/shoal/shoal -> <source>/bench/allreduce_torch.py
  const auto exe = std::filesystem::path(launcher::self_executable());
  candidates.push_back(exe.parent_path().parent_path().parent_path().parent_path() /
                       "bench/allreduce_torch.py");
  for (const auto& candidate : candidates) {
    if (std::filesystem::exists(candidate)) return candidate.string();
  }
  SHOAL_THROW(InvalidArgument, "cannot find bench/allreduce_torch.py for the torch_gloo contender; "
              "give it with --torch-script PATH (or set SHOAL_SOURCE_DIR)");
}

// Seconds per memcpy of kMemcpyBytes on one thread: the median of `samples`.
double measure_memcpy(int samples) {
  std::vector<char> source(kMemcpyBytes, 1);
  std::vector<char> target(kMemcpyBytes, 0);  // both touched: no page faults while timing
  std::memcpy(target.data(), source.data(), kMemcpyBytes);
  std::vector<double> times;
  for (int s = 0; s < samples; ++s) {
    const auto start = Clock::now();
    std::memcpy(target.data(), source.data(), kMemcpyBytes);
    times.push_back(seconds_since(start));
    source[s % kMemcpyBytes] = static_cast<char>(target[(s * 4099) % kMemcpyBytes] + 1);
  }
  return median(times);
}

bool is_torch_contender_name(const std::string& name) {
  return name == "torch_gloo" || name == "torch2_gloo";
}

// ---- one rank of the sweep ---------------------------------------------------------------------

void print_json(const std::string& backend, const std::string& collective, int world_size,
                int64_t bytes, int iters, int repeats, double seconds, double busbw) {
  ReportLine()
      .add("backend", backend).add("collective", collective).add("world_size", world_size)
      .add("bytes", bytes).add("iters", iters).add("repeats", repeats)
      .add("latency_us", seconds * 1e6, 3).add("busbw_gbps", busbw, 4)
      .print();
}

bool ends_with(const std::string& name, const std::string& tail) {
  return name.size() > tail.size() && name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
}

// Only Shoal's process groups and OpenMPI race reduce_scatter and all_gather.
bool ends_with_in_place(const std::string& name) { return ends_with(name, "_in_place"); }

// "gloo_checked", "mpi_checked": the backend with its collective check on.
const std::string kChecked = "_checked";

bool is_checked_contender(const std::string& name) {
  return name == "gloo" + kChecked || name == "mpi" + kChecked;
}

void check_collective_contender(const std::string& name, Collective collective) {
  SHOAL_CHECK_T(InvalidArgument, name != "floor_copy" || collective == Collective::kAllGather,
                "--collective ", collective_name(collective),
                ": the floor_copy contender races all_gather only (floor_staged, "
                "floor_single_copy and floor_inplace are allreduce's floors)");
  SHOAL_CHECK_T(InvalidArgument, !ends_with_in_place(name) || collective == Collective::kAllGather,
                "--collective ", collective_name(collective), ": the ", name,
                " contender races all_gather only (give --collective all_gather, or shm_symmetric "
                "for a symmetric input)");
  SHOAL_CHECK_T(InvalidArgument,
                collective == Collective::kAllreduce ||
                    !(is_torch_contender_name(name) || MemoryFloorContender::parse(name)),
                "--collective ", collective_name(collective), ": the ", name,
                " contender races allreduce only; choose from gloo, shm, shm_symmetric (the input "
                "in symmetric memory, as FSDP's), mpi, openmpi, hierarchical");
}

// The process group backend a contender runs on (its timing's barrier for the floors), after
// checking that it is built in.
// torch_gloo: Debian's PyTorch (1.13); torch2_gloo: PyTorch 2.x from PyPI, side by side.
bool is_torch_contender(const std::string& name) { return is_torch_contender_name(name); }

TorchPeer torch_peer_of(const std::string& contender) {
  TorchPeer peer = find_torch_peer(contender == "torch_gloo" ? "debian" : "pypi", "bench allreduce");
  SHOAL_CHECK_T(InvalidArgument, peer.available(), "bench allreduce: the ", contender,
                " contender needs that PyTorch (see the note above), or leave it out of --backend");
  return peer;
}

// The process group a (non-PyTorch) contender runs on.
std::string contender_backend(const std::string& name) {
  if (is_checked_contender(name)) return name.substr(0, name.size() - kChecked.size());
  if (name == "shm_symmetric" || name == "shm_in_place" || MemoryFloorContender::parse(name) ||
      name == "floor_copy" || name == "floor_copy_in_place") {
    return "shm";
  }
  return name == "openmpi" || name == "openmpi_in_place" ? "mpi" : name;
}

std::string check_contender(const std::string& name) {
  const std::string backend = contender_backend(name);
  SHOAL_CHECK_T(InvalidArgument, comm::is_backend_available(backend), "backend '", name,
                "' is not built into this shoal; choose from gloo, shm, shm_symmetric, mpi, "
                "openmpi, hierarchical, torch_gloo, torch2_gloo, floor_staged, floor_single_copy, "
                "floor_inplace, floor_copy, gloo_checked, mpi_checked, and for all_gather "
                "shm_in_place, openmpi_in_place, floor_copy_in_place");
  return backend;
}

// The contender of race entry `backend` (not a PyTorch one) on process group `pg`.
std::unique_ptr<Contender> shoal_contender(const AllreduceBenchArgs& args, const std::string& backend,
                                           std::shared_ptr<comm::ProcessGroup> pg,
                                           Collective collective) {
  const bool symmetric = backend == "shm_symmetric" || backend == "shm_in_place";
  MemoryFloorContender::Floor floor_kind{};
  std::unique_ptr<ShoalContender> contender;
  if (backend == "openmpi" || backend == "openmpi_in_place") {
    contender = std::make_unique<OpenMpiContender>(pg, collective);
  } else if (backend == "floor_copy" || backend == "floor_copy_in_place") {
    contender = std::make_unique<AllGatherFloorContender>(pg);
  } else if (MemoryFloorContender::parse(backend, &floor_kind)) {
    contender = std::make_unique<MemoryFloorContender>(pg, floor_kind);
  } else {
    contender = std::make_unique<ShoalContender>(pg, symmetric, collective);
    contender->set_async_op(args.async_op);
    contender->set_checked(is_checked_contender(backend));
  }
  contender->set_in_place(ends_with_in_place(backend));
  return contender;
}

// --algorithm's entries, each checked.
std::vector<comm::algorithms::AllreduceAlgorithm> parse_algorithms(const std::string& list,
                                                                   Collective collective) {
  std::vector<comm::algorithms::AllreduceAlgorithm> out;
  for (const std::string& name : split(list, ',')) {
    const auto algorithm = comm::algorithms::allreduce_algorithm_from_name(name);
    SHOAL_CHECK_T(InvalidArgument, algorithm.has_value(), "--algorithm '", name,
                  "' is not an allreduce algorithm; choose from ring, tree, recursive_doubling, "
                  "rabenseifner, auto, native");
    out.push_back(*algorithm);
  }
  SHOAL_CHECK_T(InvalidArgument, out.empty() || collective == Collective::kAllreduce,
                "--algorithm races allreduce only; drop it or --collective ",
                collective_name(collective));
  return out;
}

// A gloo group running `algorithm`, named "gloo_<algorithm>".
std::unique_ptr<Contender> algorithm_contender(const AllreduceBenchArgs& args,
                                               comm::algorithms::AllreduceAlgorithm algorithm,
                                               std::shared_ptr<comm::Store> store,
                                               const comm::RankInfo& info) {
  comm::GlooOptions options;
  options.allreduce_algorithm = algorithm;
  auto pg = std::make_shared<comm::ProcessGroupGloo>(std::move(store), info.rank,
                                                     info.world_size, kBenchTimeout, options);
  auto contender = std::make_unique<ShoalContender>(pg);
  contender->set_async_op(args.async_op);
  contender->set_label(std::string("gloo_") + comm::algorithms::to_string(algorithm));
  return contender;
}

// The run's one store, made on first use; each backend gets its own key space in it.
std::shared_ptr<comm::Store> bench_store(std::shared_ptr<comm::Store>& store,
                                         const comm::RankInfo& info) {
  if (!store) {
    store = comm::make_tcp_store(info.master_addr, info.master_port, info.world_size,
                                 info.rank == 0, kBenchTimeout);
  }
  return store;
}

// The contenders of --backend, in its order, then those of --algorithm, on this rank.
std::vector<std::unique_ptr<Contender>> make_contenders(const AllreduceBenchArgs& args,
                                                        const comm::RankInfo& info,
                                                        Collective collective) {
  std::shared_ptr<comm::Store> store;
  std::vector<std::unique_ptr<Contender>> contenders;
  for (const std::string& backend : split(args.backends, ',')) {
    check_collective_contender(backend, collective);
    if (is_torch_contender(backend)) {
      // Checked once by the parent; here only the command is needed (rank 0 starts the script).
      const TorchPeer peer =
          find_torch_peer(backend == "torch_gloo" ? "debian" : "pypi", "bench allreduce", false);
      contenders.push_back(std::make_unique<TorchContender>(
          info.rank, info.world_size, find_torch_script(args.torch_script), peer.python, backend));
      continue;
    }
    const std::string group_backend = check_contender(backend);
    std::shared_ptr<comm::ProcessGroup> pg;
    if (group_backend == "mpi") {
      comm::InitOptions options;
      options.backend = "mpi";
      options.timeout = kBenchTimeout;
      pg = comm::init_process_group(options);
    } else {
      const std::string prefix = "bench/" + std::to_string(contenders.size()) + "/" + backend;
      pg = comm::new_process_group(group_backend,
                                   comm::make_prefix_store(prefix, bench_store(store, info)),
                                   info.rank, info.world_size, kBenchTimeout);
    }
    contenders.push_back(shoal_contender(args, backend, pg, collective));
  }
  for (const auto algorithm : parse_algorithms(args.algorithms, collective)) {
    const std::string prefix = "bench/" + std::to_string(contenders.size()) + "/algorithm";
    contenders.push_back(algorithm_contender(
        args, algorithm, comm::make_prefix_store(prefix, bench_store(store, info)), info));
  }
  SHOAL_CHECK_T(InvalidArgument, !contenders.empty(),
                "--backend and --algorithm name no contender");
  return contenders;
}

// Rank 0, before the sweep: the one-thread memcpy bandwidth (returned, GB/s) and, as a table, its
// header.
double print_sweep_header(const AllreduceBenchArgs& args,
                          const std::vector<std::unique_ptr<Contender>>& contenders, int n,
                          Collective collective) {
  const int samples = std::max(args.repeats, 5);
  const double seconds = measure_memcpy(samples);
  const double gbps = kMemcpyBytes / seconds / 1e9;
  if (args.json) {
    print_json("memcpy", "memcpy", 1, kMemcpyBytes, 1, samples, seconds, gbps);
    return gbps;
  }
  std::printf("shoal bench allreduce: float32 %s over %d ranks, median of %d repeats, "
              "contenders interleaved\n",
              collective == Collective::kAllreduce ? "sum allreduce"
              : collective == Collective::kReduceScatter
                  ? "sum reduce_scatter_tensor (size: the input)"
                  : "all_gather_into_tensor (size: the output)",
              n, args.repeats);
  std::printf("memcpy (1 thread, %s): %.2f GB/s\n\n", format_bytes(kMemcpyBytes).c_str(), gbps);
  std::printf("%10s %6s", "size", "iters");
  for (auto& c : contenders) {
    std::printf(" | %14s %10s %8s", (c->name() + " us").c_str(), "busbw GB/s", "%memcpy");
  }
  if (contenders.size() > 1) std::printf(" | time / %s", contenders[0]->name().c_str());
  std::printf("\n");
  std::fflush(stdout);
  return gbps;
}

// Rank 0: one size's medians (seconds per collective, by contender), as JSON lines or a row.
void print_size(const AllreduceBenchArgs& args, const std::vector<std::unique_ptr<Contender>>& contenders,
                int n, Collective collective, int64_t bytes, int iters,
                const std::vector<double>& medians, double memcpy_gbps) {
  // NCCL-tests' bus bandwidth: an allreduce moves 2(n-1)/n of the tensor through each rank's
  // link, a reduce-scatter or all-gather (n-1)/n of the full tensor.
  const double bus_factor =
      collective == Collective::kAllreduce ? 2.0 * (n - 1) / n : 1.0 * (n - 1) / n;
  if (!args.json) std::printf("%10s %6d", format_bytes(bytes).c_str(), iters);
  for (size_t i = 0; i < contenders.size(); ++i) {
    const double busbw = bytes * bus_factor / medians[i] / 1e9;
    if (args.json) {
      print_json(contenders[i]->name(), args.collective, n, bytes, iters, args.repeats, medians[i],
                 busbw);
    } else {
      std::printf(" | %14.1f %10.3f %7.1f%%", medians[i] * 1e6, busbw, 100.0 * busbw / memcpy_gbps);
    }
  }
  if (args.json) return;
  if (contenders.size() > 1) {
    std::printf(" |");
    for (size_t i = 1; i < contenders.size(); ++i) {
      std::printf(" %s %.2fx", contenders[i]->name().c_str(), medians[i] / medians[0]);
    }
  }
  std::printf("\n");
  std::fflush(stdout);
}

int run_rank(const AllreduceBenchArgs& args) {
  const comm::RankInfo info = comm::detect_rank_info();
  const int n = info.world_size;
  SHOAL_CHECK_T(InvalidArgument, n >= 2, "allreduce needs at least 2 ranks (world size is ", n,
                "); give --nproc 2 or more");
  const int64_t min_bytes = parse_bytes(args.min_bytes, "--min-bytes");
  const int64_t max_bytes = parse_bytes(args.max_bytes, "--max-bytes");
  SHOAL_CHECK_T(InvalidArgument, min_bytes <= max_bytes, "--min-bytes ", args.min_bytes,
                " is above --max-bytes ", args.max_bytes);
  const Collective collective = collective_from_name(args.collective);
  const auto contenders = make_contenders(args, info, collective);
  const double memcpy_gbps =
      info.rank == 0 ? print_sweep_header(args, contenders, n, collective) : 0;
  for (int64_t bytes = min_bytes; bytes <= max_bytes; bytes *= 4) {
    const int iters = args.iters > 0
                          ? args.iters
                          : static_cast<int>(std::clamp<int64_t>(kBytesPerRepeat / bytes,
                                                                  kMinIters, kMaxIters));
    for (auto& c : contenders) c->warm_up(bytes, args.warmup);
    std::vector<std::vector<double>> times(contenders.size());
    for (int repeat = 0; repeat < args.repeats; ++repeat) {
      // While rank 0 works alone (memcpy, driving PyTorch) the other ranks wait in the next
      // Shoal measurement's barrier.
      for (size_t i : round_order(contenders.size(), repeat)) {
        times[i].push_back(contenders[i]->measure(bytes, iters));
      }
    }
    if (info.rank != 0) continue;
    std::vector<double> medians;
    for (const auto& t : times) medians.push_back(median(t));
    print_size(args, contenders, n, collective, bytes, iters, medians, memcpy_gbps);
  }
  return 0;
}

// ---- starting the ranks ------------------------------------------------------------------------

std::vector<std::string> rank_command(const AllreduceBenchArgs& args) {
  std::vector<std::string> command{launcher::self_executable(), "bench", "allreduce",
                                   "--backend", args.backends.empty() ? "," : args.backends,
                                   "--algorithm", args.algorithms.empty() ? "," : args.algorithms,
                                   "--collective", args.collective,
                                   "--min-bytes", args.min_bytes,
                                   "--max-bytes", args.max_bytes,
                                   "--iters", std::to_string(args.iters),
                                   "--repeats", std::to_string(args.repeats),
                                   "--warmup", std::to_string(args.warmup)};
  if (args.json) command.push_back("--json");
  if (args.async_op) command.push_back("--async-op");
  if (!args.torch_script.empty()) {
    command.push_back("--torch-script");
    command.push_back(args.torch_script);
  }
  return command;
}

int run_under_mpirun(const AllreduceBenchArgs& args) {
  const std::string port = std::to_string(launcher::pick_free_port());
  // --bind-to none: mpirun binds each rank to one CPU by default, and everything the rank starts
  // inherits that: Shoal's worker threads would share one CPU with the rank's main thread, and
  // PyTorch's two ranks (started by rank 0) would share rank 0's CPU. Every contender runs under
  // the scheduling a `shoal run` job gets, so the comparison is fair.
  std::vector<std::string> argv{"mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to",
                                "none", "-np",
                                std::to_string(args.nproc), "-x", "MASTER_ADDR=127.0.0.1", "-x",
                                "MASTER_PORT=" + port, "-x", "OMP_NUM_THREADS=1"};
  for (auto& word : rank_command(args)) argv.push_back(word);
  // mpirun is in our process group: Ctrl-C reaches it, and it stops its ranks itself. Every wait
  // of the ranks is bounded (kBenchTimeout), so mpirun returns; should it not (a wedged mpirun),
  // it is stopped after 30 minutes, far beyond a whole sweep (about a minute): SIGTERM, which
  // mpirun forwards to its ranks, then SIGKILL 10 s later.
  RunProcessesOptions options;
  options.benchmark = "shoal bench allreduce";
  options.run = "mpirun";
  options.deadline = std::chrono::minutes(30);
  options.grace = std::chrono::seconds(10);
  return run_processes({{argv}}, options);
}

int run_allreduce_bench(const AllreduceBenchArgs& args) {
  if (comm::detect_rank_info().launched) return run_rank(args);
  const auto backends = split(args.backends, ',');
  // Mistakes are reported once, here, rather than by every rank.
  SHOAL_CHECK_T(InvalidArgument, args.nproc >= 2, "--nproc-per-node ", args.nproc, " must be at least 2");
  SHOAL_CHECK_T(InvalidArgument,
                parse_bytes(args.min_bytes, "--min-bytes") <= parse_bytes(args.max_bytes, "--max-bytes"),
                "--min-bytes ", args.min_bytes, " is above --max-bytes ", args.max_bytes);
  const Collective collective = collective_from_name(args.collective);
  parse_algorithms(args.algorithms, collective);
  for (const std::string& backend : split(args.backends, ',')) {
    check_collective_contender(backend, collective);
    if (!is_torch_contender(backend)) {
      check_contender(backend);
    } else {
      find_torch_script(args.torch_script);
      torch_peer_of(backend);
    }
  }
  const bool has_mpi = std::any_of(backends.begin(), backends.end(), [](const std::string& name) {
    return contender_backend(name) == "mpi";
  });
  SHOAL_CHECK_T(InvalidArgument, !(has_mpi && args.launcher == "shoal"),
                "--backend mpi needs its ranks started by mpirun; drop --launcher shoal");
  if (args.launcher == "mpirun" || (args.launcher == "auto" && has_mpi)) {
    return run_under_mpirun(args);
  }
  auto options = launcher::LaunchOptions::workers(args.nproc, rank_command(args));
  options.master_port = 0;
  options.prefix_output = false;  // only rank 0 prints
  options.verbose = false;
  options.log_name = "shoal bench allreduce";
  return launcher::launch(options);
}

}  // namespace

void add_bench_allreduce_command(CLI::App& bench, std::vector<Command>& commands) {
  auto args = std::make_shared<AllreduceBenchArgs>();
  auto* app = bench.add_subcommand(
      "allreduce",
      "Latency and bus bandwidth (bytes x 2(n-1)/n / time) of float32 allreduce per backend,\n"
      "next to one-thread memcpy bandwidth. Starts its own ranks unless started by shoal run or\n"
      "mpirun. Several backends (--backend gloo,shm,torch_gloo) run interleaved, medians reported.");
  app->add_option("--backend", args->backends,
                  "comma-separated: gloo, shm, shm_symmetric, mpi, openmpi (MPI_Allreduce itself), "
                  "hierarchical, torch_gloo (PyTorch's gloo), torch2_gloo (PyTorch 2.x's gloo, "
                  "from PyPI), gloo_checked and mpi_checked (with the per-collective check of "
                  "SHOAL_DEBUG=detail), floor_staged, floor_single_copy and floor_inplace (allreduce), "
                  "floor_copy (all_gather) (no communication: the memory work alone); for "
                  "all_gather in place (the input in the output's own block): shm_in_place, "
                  "openmpi_in_place, floor_copy_in_place")
      ->capture_default_str();
  app->add_option("--collective", args->collective,
                  "what is raced: allreduce, reduce_scatter (reduce_scatter_tensor; OpenMPI's\n"
                  "MPI_Reduce_scatter_block) or all_gather (all_gather_into_tensor; MPI_Allgather);\n"
                  "a size is the full tensor's, each rank's piece 1/n of it")
      ->capture_default_str()
      ->check(CLI::IsMember({"allreduce", "reduce_scatter", "all_gather"}));
  app->add_option("--nproc-per-node,--nproc", args->nproc, "ranks to start (when not started by a launcher)")
      ->capture_default_str();
  app->add_option("--min-bytes", args->min_bytes, "smallest message (4096, 4KiB, 1MiB...)")
      ->capture_default_str();
  app->add_option("--max-bytes", args->max_bytes, "largest message; sizes grow x4")
      ->capture_default_str();
  app->add_option("--iters", args->iters,
                  "allreduces per timed repeat (0: about 64 MiB worth, 3..200)")
      ->capture_default_str();
  app->add_option("--repeats", args->repeats, "timed repeats per size; the median is reported")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  app->add_option("--warmup", args->warmup, "untimed allreduces per size and backend first")
      ->capture_default_str()
      ->check(CLI::Range(0, 1000));
  app->add_flag("--json", args->json, "one JSON object per line instead of a table");
  app->add_flag("--async-op", args->async_op,
                "Shoal's backends: issue each collective as DDP issues its buckets (the Work\n"
                "returned at once, then waited for) instead of a blocking call (async_op = false,\n"
                "as MPI_Allreduce and torch.distributed's default)");
  app->add_option("--torch-script", args->torch_script,
                  "path of bench/allreduce_torch.py (for torch_gloo)");
  app->add_option("--launcher", args->launcher,
                  "how to start the ranks when no launcher started this: auto (mpirun when "
                  "--backend has mpi, else shoal's launcher), shoal, mpirun")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "shoal", "mpirun"}));
  app->add_option("--algorithm", args->algorithms,
                  "comma-separated allreduce algorithms of the gloo backend to race, one group\n"
                  "each, named gloo_<algorithm>: ring, tree, recursive_doubling, rabenseifner, auto\n"
                  "(the cost model's choice per size), native (c10d Gloo's own); alone unless\n"
                  "--backend is given too");
  commands.push_back({app, [app, args] {
                        // --algorithm alone races the algorithms only, not gloo's default too.
                        if (!args->algorithms.empty() && app->count("--backend") == 0) {
                          args->backends.clear();
                        }
                        return run_allreduce_bench(*args);
                      }});
}

}  // namespace shoal::cli
