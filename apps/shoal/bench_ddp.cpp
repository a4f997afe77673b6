// `shoal bench ddp`: training throughput of one process without DDP, Shoal's DDP and PyTorch's
// Python DDP on the same model, batch and thread count, measured side by side.
//
// Each round runs, in this order (the contenders after `independent` reversed in odd rounds), fresh
// processes for every mode: `single` (one process, no DDP),
// `independent` (world-size copies of `single` at once, no communication: what the machine allows
// any data-parallel scheme, since the ranks share its caches and memory bandwidth), `lockstep` (the
// same processes meeting at an shm barrier after every backward, with no data: what the machine
// allows any synchronous data-parallel scheme, whose every step waits for the slower rank and runs
// the ranks' phases at the same time on shared floating-point units), `shoal_ddp` for
// every backend asked for, without and with gradient_as_bucket_view, and `pytorch_ddp` (gloo)
// without and with gradient_as_bucket_view. The report gives each mode's median over the rounds
// (this machine is shared and noisy: interleaving spreads the noise over every mode).
// Ranks are this program re-executed with hidden --worker options; every process uses one thread.
// Also reported: peak RSS of each mode (largest rank) and its difference to `single`, the median
// time of a step's phases on rank 0, and how much communication backward hid:
// `overlap` = 1 - time waiting for buckets at the end of backward (inline reduction: in the
// hooks that reduce them) / time the same bucket reductions take on their own (includes waiting
// for a slower peer, so a loaded machine drives it to 0), and `hidden_bytes_fraction` = share of
// the bucket bytes whose asynchronous reduction had already completed when backward ended
// (insensitive to peer skew; 0 inline, where every bucket is waited for where it fills).
// --comm-hook allreduce,fp16,powersgd adds, in the same rounds, a shoal_ddp mode (first backend,
// without bucket view) per hook other than the default allreduce; every shoal_ddp mode reports
// the bytes rank 0 passed to its collectives per step (`sent_kb`): the buckets for allreduce, half
// of them for fp16/bf16, PowerSGD's P, Q and uncompressed tensors (rank --powersgd-rank,
// compressing from the first timed step: start_powerSGD_iter = max(2, warmup)).
// --bucket-reduction auto,overlapped,inline: the first is the default shoal_ddp modes'
// bucket_reduction; each other adds a plain and a bucket-view mode in the same rounds.
#include <sys/resource.h>
#include <unistd.h>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench_util.h"
#include "commands.h"
#include "shoal/models/registry.h"
#include "shoal/comm/init.h"
#include "shoal/error.h"
#include "shoal/log.h"
#include "shoal/launcher/launch.h"
#include "shoal/memory/cpu_allocator.h"
#include "shoal/parallel/comm_hooks.h"
#include "shoal/train/ddp_strategy.h"
#include "shoal/parallel/distributed_data_parallel.h"

namespace shoal::cli {
namespace {

using Clock = std::chrono::steady_clock;


struct DdpBenchArgs : StepBenchArgs, WorkerArgs {
  DdpBenchArgs() {  // bench ddp's defaults
    steps = 0;  // per model: see choose_steps()
    warmup = 3;
  }
  std::vector<std::string> backends{"shm"};
  int batch = 64;
  int world = 2;
  std::string ceiling = "interleaved";  // or once
  std::string bucket_cap_mb = "0";  // 0: DDP's default; MiB, or auto
  bool bucket_sweep = false;        // --bucket-sweep: every auto candidate, and auto
  double first_bucket_cap_mb = 0;  // 0: DDP's default
  std::string torch_script = bench_script("ddp_torch.py");
  std::vector<std::string> torch_peers{"debian"};  // the PyTorch peers measured (--torch)
  std::vector<std::string> comm_hooks{"allreduce"};  // a worker: its one hook
  std::vector<std::string> bucket_reductions{"auto"};  // a worker: its one bucket_reduction
  int64_t powersgd_rank = 2;
  bool bucket_view = false;  // hidden: a worker's gradient_as_bucket_view
};

double peak_rss_mb() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss / 1024.0;  // Linux reports kilobytes
}

// Proportional set size now (shared pages counted once across the processes that map them, where
// RSS counts them in full in each): the whole process's, and that of the POSIX shared memory it
// maps (the shm group's buffers and symmetric gradient buckets), which is outside the C library's
// heap. One pass over /proc/self/smaps.
struct Pss {
  double total_mb = 0;
  double shared_memory_mb = 0;
};

Pss read_pss() {
  std::ifstream in("/proc/self/smaps");
  std::string line;
  bool shm = false;
  Pss pss;
  while (std::getline(in, line)) {
    if (line.compare(0, 4, "Pss:") == 0) {
      const double mb = std::stod(line.substr(4)) / 1024.0;
      pss.total_mb += mb;
      if (shm) pss.shared_memory_mb += mb;
    } else if (!line.empty() && std::isxdigit(static_cast<unsigned char>(line[0])) &&
               line.find('-') < line.find(' ')) {  // a mapping's header: "start-end perms ... path"
      shm = line.find(" /dev/shm/") != std::string::npos;
    }
  }
  return pss;
}

// Times the phases of training steps: zero_grad + forward + loss, backward, optimizer step; and
// with `sample_memory` (steps run after the timed ones), the largest heap in use at the end of
// forward (activations held for backward) and of backward (gradients): live memory, steady from
// run to run where peak RSS also counts whatever freed memory the allocator happens to keep.
struct PhaseTimer {
  double forward = 0, backward = 0, optimizer = 0;
  bool sample_memory = false;
  long long peak_heap_bytes = 0;
  std::function<void()> after_backward;  // lockstep: the barrier, timed with backward

  template <class Forward, class Optimizer>
  void step(Forward&& forward_loss, Optimizer& opt) {
    const auto t0 = Clock::now();
    opt.zero_grad();
    auto loss = forward_loss();
    const auto t1 = Clock::now();
    if (sample_memory) peak_heap_bytes = std::max(peak_heap_bytes, memory::heap_bytes_in_use());
    loss.backward();
    if (sample_memory) peak_heap_bytes = std::max(peak_heap_bytes, memory::heap_bytes_in_use());
    if (after_backward) after_backward();
    const auto t2 = Clock::now();
    opt.step();
    const auto t3 = Clock::now();
    forward += std::chrono::duration<double>(t1 - t0).count();
    backward += std::chrono::duration<double>(t2 - t1).count();
    optimizer += std::chrono::duration<double>(t3 - t2).count();
  }
  void record(Values& result, int steps) const {
    result["forward_ms"] = 1e3 * forward / steps;
    result["backward_ms"] = 1e3 * backward / steps;
    result["optimizer_ms"] = 1e3 * optimizer / steps;
  }
};

// Memory after the timed steps: PSS now, and live memory (two more steps sampling the heap, plus
// this rank's share of shared memory).
template <class Forward, class Optimizer>
void record_memory(Forward&& forward_loss, Optimizer& opt, Values& result) {
  const Pss pss = read_pss();
  result["pss_mb"] = pss.total_mb;
  PhaseTimer sampler;
  sampler.sample_memory = true;
  for (int i = 0; i < 2; ++i) sampler.step(forward_loss, opt);
  result["live_mb"] = sampler.peak_heap_bytes / 1048576.0 + pss.shared_memory_mb;
}

void run_worker_with(const DdpBenchArgs& args) {
  // Every Shoal mode, the DDP-less ones too, with the allocator settings Shoal's DDP and Trainer
  // use, so that the comparison measures DDP alone (SHOAL_TUNE_MALLOC=0 measures without them).
  memory::tune_cpu_allocator();
  torch::set_num_threads(1);
  torch::manual_seed(0);
  // The registry's models (the ones `shoal train` trains), so bench and trainer measure one thing.
  std::shared_ptr<models::Model> model = models::create(args.model, 0);
  auto x = torch::randn({args.batch, 1, 28, 28});
  auto y = torch::randint(0, 10, {args.batch}, torch::kLong);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  Values result;
  double grad_bytes = 0;
  for (const auto& p : model->parameters()) grad_bytes += p.numel() * p.element_size();
  result["grad_mb"] = grad_bytes / 1048576.0;

  if (args.worker == "single" || args.worker == "lockstep") {
    auto forward_loss = [&] { return torch::cross_entropy_loss(model->forward(x), y); };
    PhaseTimer warm, timed;
    // lockstep: `single` on every rank, meeting the others at a barrier after each backward, with
    // no data (shm: the cheapest meeting there is), timed and started as the DDP ranks are.
    std::shared_ptr<comm::ProcessGroup> group;
    if (args.worker == "lockstep") {
      group = comm::new_process_group("shm", comm::make_file_store(args.store, args.world),
                                      args.rank, args.world);
      warm.after_backward = timed.after_backward = [&group] { group->barrier()->wait(); };
    }
    for (int i = 0; i < args.warmup; ++i) warm.step(forward_loss, optimizer);
    if (group) group->barrier()->wait();
    const auto start = Clock::now();
    for (int i = 0; i < args.steps; ++i) timed.step(forward_loss, optimizer);
    if (group) group->barrier()->wait();
    result["seconds"] = seconds_since(start);
    timed.record(result, args.steps);
    record_memory(forward_loss, optimizer, result);
  } else {
    auto store = comm::make_file_store(args.store, args.world);
    auto group = comm::new_process_group(args.backends.at(0), store, args.rank, args.world);
    DistributedDataParallelOptions options;
    options.gradient_as_bucket_view = args.bucket_view;
    options.bucket_reduction = parallel::parse_bucket_reduction(args.bucket_reductions.at(0));
    const bool auto_cap = args.bucket_cap_mb == "auto";
    if (std::strtod(args.bucket_cap_mb.c_str(), nullptr) > 0 || auto_cap) {
      options.bucket_cap_mb = parallel::parse_bucket_cap_mb(args.bucket_cap_mb);
    }
    if (args.first_bucket_cap_mb > 0) options.first_bucket_cap_mb = args.first_bucket_cap_mb;
    DistributedDataParallel<models::Model> ddp(model, group, options);
    const std::string hook = args.comm_hooks.at(0);
    std::shared_ptr<parallel::PowerSGDState> power_sgd;
    if (hook == "powersgd") {
      power_sgd = std::make_shared<parallel::PowerSGDState>();
      power_sgd->matrix_approximation_rank = args.powersgd_rank;
      power_sgd->start_powerSGD_iter = std::max(2, args.warmup);  // every timed step compressed
    }
    if (auto comm_hook = train::make_comm_hook(train::parse_comm_hook(hook), group, power_sgd)) {
      ddp.register_comm_hook(comm_hook);
    }
    auto forward_loss = [&] { return torch::cross_entropy_loss(ddp.forward(x), y); };
    PhaseTimer warm, timed;
    // auto: the tuning steps come first and are not timed (the report gives their number).
    int tuning_steps = 0;
    while (auto_cap && ddp.stats().bucket_cap_tuning) {
      SHOAL_CHECK(++tuning_steps <= 10000, "bench ddp: bucket_cap_mb=auto never decided");
      warm.step(forward_loss, optimizer);
    }
    result["tuning_steps"] = tuning_steps;
    for (int i = 0; i < args.warmup; ++i) warm.step(forward_loss, optimizer);
    group->barrier()->wait();
    const auto before = ddp.stats();
    result["bucket_cap_mb"] = before.bucket_cap_mb;
    result["first_bucket_cap_mb"] = before.first_bucket_cap_mb;
    result["inline_reduction"] = before.inline_reduction ? 1 : 0;
    // Which buckets (their sizes in order), as one number: the sweep drops caps that give the
    // same buckets as another.
    double layout = 0;
    for (int64_t bytes : before.bucket_bytes) layout = std::fmod(layout * 1000003.0 + bytes, 1e15);
    result["layout"] = layout;
    const double power_sgd_before = power_sgd ? power_sgd->bytes_sent : 0;
    const auto start = Clock::now();
    for (int i = 0; i < args.steps; ++i) timed.step(forward_loss, optimizer);
    group->barrier()->wait();
    result["seconds"] = seconds_since(start);
    timed.record(result, args.steps);
    // Memory of training, before the comm-only measurement below allocates its own buckets.
    result["peak_rss_mb"] = peak_rss_mb();
    const auto after = ddp.stats();
    // What this rank passed to its collectives per timed step (the hooks send what they reduce).
    const double bucket_bytes = (after.reduced_bytes - before.reduced_bytes) / args.steps;
    double sent = hook == "fp16" || hook == "bf16" ? bucket_bytes / 2 : bucket_bytes;
    if (power_sgd) sent = (power_sgd->bytes_sent - power_sgd_before) / args.steps;
    result["sent_bytes"] = sent;
    record_memory(forward_loss, optimizer, result);
    result["wait_ms"] = 1e3 * (after.wait_seconds - before.wait_seconds) / args.steps;
    // Bytes DDP copied between gradients and buckets per timed step (0 once the gradients live
    // in the buckets).
    const double copied = (after.copied_bytes - before.copied_bytes) / args.steps;
    result["copied_mb"] = copied / 1048576.0;
    result["hidden_fraction"] = (after.hidden_bytes - before.hidden_bytes) /
                                std::max(after.reduced_bytes - before.reduced_bytes, 1.0);
    // The same bucket reductions on their own, launched back to back as backward launches them,
    // on buckets where DDP keeps them (the group's symmetric memory where it has some: shm).
    std::vector<torch::Tensor> buckets;
    for (int64_t bytes : after.bucket_bytes) {
      buckets.push_back(group->empty_symmetric(bytes / 4, torch::kFloat).zero_());
    }
    constexpr int kCommRepeats = 5;
    group->barrier()->wait();
    const auto comm_start = Clock::now();
    comm::AllreduceOptions comm_options;
    comm_options.async_op = !after.inline_reduction;  // as DDP reduces them (bucket_reduction)
    for (int r = 0; r < kCommRepeats; ++r) {
      std::vector<std::shared_ptr<comm::Work>> works;
      for (auto& b : buckets) works.push_back(group->allreduce(b, comm_options));
      for (auto& w : works) w->wait();
    }
    result["comm_ms"] = 1e3 * seconds_since(comm_start) / kCommRepeats;
    result["buckets"] = static_cast<double>(buckets.size());
    // The memory floor of any allreduce of these gradients: every rank reads each byte of its
    // buckets once and writes it once (each byte of every rank's gradients must be read, each of
    // every rank's results written, and the ranks share the work at best evenly), all ranks at
    // once, as `bench allreduce`'s floor_inplace. Zeros stay zeros.
    group->barrier()->wait();
    const auto floor_start = Clock::now();
    for (int r = 0; r < kCommRepeats; ++r) {
      for (auto& b : buckets) b.mul_(0.5);
    }
    result["floor_ms"] = 1e3 * seconds_since(floor_start) / kCommRepeats;
    group->barrier()->wait();
    // Gradients that do not live in the buckets are copied into their bucket when ready and back
    // into .grad after the reduction, as PyTorch's DDP does with plain gradients: that work,
    // alone, per step (copy_ms), in proportion to the bytes DDP copied in the timed steps.
    double copy_ms = 0;
    if (copied > 0) {
      torch::NoGradGuard no_grad;
      std::vector<torch::Tensor> grads;
      int64_t total = 0;
      double total_bytes = 0;
      for (const auto& p : model->parameters()) {
        if (!p.grad().defined()) continue;
        grads.push_back(p.grad());
        total += p.numel();
        total_bytes += static_cast<double>(p.grad().nbytes());
      }
      auto flat = torch::zeros({total});
      const auto copy_start = Clock::now();
      for (int r = 0; r < kCommRepeats; ++r) {
        int64_t offset = 0;
        for (auto& g : grads) {
          flat.narrow(0, offset, g.numel()).copy_(g.reshape({-1}));
          offset += g.numel();
        }
        offset = 0;
        for (auto& g : grads) {
          g.copy_(flat.narrow(0, offset, g.numel()).view_as(g));
          offset += g.numel();
        }
      }
      copy_ms = 1e3 * seconds_since(copy_start) / kCommRepeats *
                std::min(1.0, copied / std::max(2.0 * total_bytes, 1.0));
    }
    result["copy_ms"] = copy_ms;
  }
  if (result.count("peak_rss_mb") == 0) result["peak_rss_mb"] = peak_rss_mb();
  write_values(args.result, result, "bench ddp");
}

int run_worker(const DdpBenchArgs& args) {
  run_worker_with(args);
  return 0;
}

// One line of the report: a mode with its options, and its samples over the rounds.
struct DdpMode {
  std::string name;     // single, independent, shoal_ddp, pytorch_ddp
  std::string backend;  // empty for single and independent
  bool bucket_view = false;
  std::string hook = "allreduce";  // shoal_ddp's communication hook
  TorchPeer peer;       // pytorch_ddp: which PyTorch runs it
  std::string cap;      // shoal_ddp's bucket_cap_mb when not --bucket-cap-mb's: MiB or auto
  std::string first_cap;  // and first_bucket_cap_mb when not --first-bucket-cap-mb's
  std::string reduction;  // shoal_ddp's bucket_reduction when not --bucket-reduction's first
  std::map<std::string, std::vector<double>> samples;  // field -> one value per round

  std::string label() const {
    std::string text = name;
    if (!peer.version.empty()) text += " " + peer.version;
    if (!backend.empty()) text += " (" + backend + ")";
    if (bucket_view) text += " view";
    if (hook != "allreduce") text += " " + hook;
    if (!first_cap.empty()) text += " first=" + first_cap;
    if (!cap.empty()) text += " cap=" + cap;
    if (!reduction.empty()) text += " " + reduction;
    return text;
  }
  double get(const std::string& field) const {
    auto it = samples.find(field);
    return it == samples.end() ? std::nan("") : median(it->second);
  }
};

// How the processes of one round of `mode` are run.
RunProcessesOptions run_options(const DdpMode& mode) {
  RunProcessesOptions options;
  options.benchmark = "bench ddp";
  options.run = "the " + mode.label() + " run";
  return options;
}

// Runs one round of `mode`, adding its values to mode.samples.
void run_mode(const DdpBenchArgs& args, const std::string& exe, const std::string& dir, int round,
              DdpMode& mode) {
  auto common = [&](const std::string& worker, const std::string& backend) {
    std::vector<std::string> command{exe, "bench", "ddp", "--model", args.model, "--backend",
                                     backend.empty() ? "shm" : backend, "--steps",
                                     std::to_string(args.steps), "--warmup",
                                     std::to_string(args.warmup), "--batch",
                                     std::to_string(args.batch), "--world",
                                     std::to_string(args.world), "--bucket-cap-mb",
                                     mode.cap.empty() ? args.bucket_cap_mb : mode.cap,
                                     "--first-bucket-cap-mb",
                                     mode.first_cap.empty()
                                         ? std::to_string(args.first_bucket_cap_mb)
                                         : mode.first_cap,
                                     "--comm-hook",
                                     mode.hook, "--bucket-reduction",
                                     mode.reduction.empty() ? args.bucket_reductions.at(0)
                                                            : mode.reduction,
                                     "--powersgd-rank",
                                     std::to_string(args.powersgd_rank), "--worker", worker};
    if (mode.bucket_view) command.push_back("--gradient-as-bucket-view");
    return command;
  };
  auto& s = mode.samples;
  if (mode.name == "pytorch_ddp") {
    const std::string result = dir + "/pytorch";
    std::vector<std::string> command = mode.peer.python;
    command.insert(command.end(), {args.torch_script, "--model", args.model, "--steps",
                                   std::to_string(args.steps), "--warmup",
                                   std::to_string(args.warmup), "--batch",
                                   std::to_string(args.batch), "--world",
                                   std::to_string(args.world), "--result", result});
    if (mode.bucket_view) command.push_back("--gradient-as-bucket-view");
    SHOAL_CHECK(run_processes({{command}}, run_options(mode)) == 0,
                "bench ddp: the PyTorch DDP run failed (", args.torch_script, ")");
    const Values values = read_json_numbers(result);
    for (const std::string field : {"samples_per_s", "peak_rss_mb", "pss_mb", "live_mb"}) {
      auto it = values.find(field);
      SHOAL_CHECK(it != values.end(), "bench ddp: ", args.torch_script, " wrote no ", field);
      s[field].push_back(it->second);
    }
    return;
  }
  const bool ddp = mode.name == "shoal_ddp";
  const int processes = mode.name == "single" ? 1 : args.world;
  const std::string store = dir + "/store_" + std::to_string(round) + "_" + mode.name + "_" +
                            mode.backend + (mode.bucket_view ? "_view" : "") + "_" + mode.hook +
                            "_" + (mode.cap.empty() ? "default" : mode.cap) + "_" +
                            (mode.first_cap.empty() ? "default" : mode.first_cap) + "_" +
                            (mode.reduction.empty() ? "default" : mode.reduction);
  std::vector<ChildProcess> ranks;
  for (int rank = 0; rank < processes; ++rank) {
    auto command = common(ddp ? "shoal" : mode.name == "lockstep" ? "lockstep" : "single",
                          mode.backend);
    command.insert(command.end(), {"--rank", std::to_string(rank), "--store", store, "--result",
                                   dir + "/rank" + std::to_string(rank)});
    ranks.push_back({command});
  }
  SHOAL_CHECK(run_processes(ranks, run_options(mode)) == 0, "bench ddp: the ", mode.label(),
              " run failed");
  double seconds = 0, rss = 0, pss = 0, live = 0;
  for (int rank = 0; rank < processes; ++rank) {
    auto r = read_values(dir + "/rank" + std::to_string(rank));
    seconds = std::max(seconds, r["seconds"]);
    rss = std::max(rss, r["peak_rss_mb"]);
    pss = std::max(pss, r["pss_mb"]);
    live = std::max(live, r["live_mb"]);
    if (rank != 0) continue;
    for (const std::string field : {"forward_ms", "backward_ms", "optimizer_ms", "grad_mb"}) {
      s[field].push_back(r[field]);
    }
    if (ddp) {
      s["wait_ms"].push_back(r["wait_ms"]);
      s["comm_ms"].push_back(r["comm_ms"]);
      s["floor_ms"].push_back(r["floor_ms"]);
      s["copy_ms"].push_back(r["copy_ms"]);
      s["copied_mb"].push_back(r["copied_mb"]);
      s["overlap"].push_back(std::clamp(1.0 - r["wait_ms"] / std::max(r["comm_ms"], 1e-9), 0.0, 1.0));
      s["hidden_bytes_fraction"].push_back(r["hidden_fraction"]);
      s["buckets"].push_back(r["buckets"]);
      s["sent_bytes"].push_back(r["sent_bytes"]);
      s["bucket_cap_mb"].push_back(r["bucket_cap_mb"]);
      s["tuning_steps"].push_back(r["tuning_steps"]);
      s["first_bucket_cap_mb"].push_back(r["first_bucket_cap_mb"]);
      s["layout"].push_back(r["layout"]);
      s["inline_reduction"].push_back(r["inline_reduction"]);
    }
  }
  s["samples_per_s"].push_back(processes * args.batch * args.steps / seconds);
  s["peak_rss_mb"].push_back(rss);
  s["pss_mb"].push_back(pss);
  s["live_mb"].push_back(live);
}

// --steps 0: about a second a run on this kind of machine, so that every model's runs are read at
// the same precision (a step of the MLP takes 7 ms, of the CNN and the transformer 50 ms; 20 steps
// of the MLP, 0.15 s, were at the mercy of one scheduling hiccup); more warm-up steps with more steps.
void choose_steps(DdpBenchArgs& args) {
  if (args.steps != 0) return;
  args.steps = args.model == "mlp" ? 140 : 20;
  args.warmup = std::max(args.warmup, args.steps / 7);
}

int run_ddp_bench(const DdpBenchArgs& args) {
  check_bench_model("bench ddp", args.model);
  SHOAL_CHECK_T(InvalidArgument, args.ceiling == "interleaved" || args.ceiling == "once",
                "bench ddp: --ceiling takes interleaved or once, not '", args.ceiling, "'");
  SHOAL_CHECK_T(InvalidArgument, args.steps > 0 && args.rounds > 0 && args.batch > 0 && args.world >= 2,
                "bench ddp: --steps, --rounds and --batch must be positive and --world at least 2");
  for (const auto& backend : args.backends) {
    SHOAL_CHECK_T(InvalidArgument, comm::is_backend_available(backend), "bench ddp: backend '",
                  backend, "' is not built in (available: gloo, shm, and mpi where built)");
  }
  const std::string exe = launcher::self_executable();
  const std::string dir = "/tmp/shoal_bench_ddp_" + std::to_string(getpid());
  SHOAL_CHECK(std::system(("mkdir -p " + dir).c_str()) == 0, "bench ddp: cannot create ", dir);
  std::vector<TorchPeer> peers;
  for (const auto& name : args.torch_peers) {
    TorchPeer peer = find_torch_peer(name, "bench ddp");
    if (peer.available()) peers.push_back(peer);
  }

  // `lockstep`: the ceiling's processes meeting once a step (after backward) with no data: no
  // synchronous data parallelism can do better here, since each step waits for the slower rank
  // and the ranks run the same phases at the same time on the vCPUs' shared units.
  std::vector<DdpMode> modes{{"single", ""}, {"independent", ""}, {"lockstep", "shm"}};
  for (const auto& hook : args.comm_hooks) {
    SHOAL_CHECK_T(InvalidArgument,
                  hook == "allreduce" || hook == "fp16" || hook == "bf16" || hook == "powersgd",
                  "bench ddp: --comm-hook takes allreduce, fp16, bf16 and powersgd, not '", hook,
                  "'");
  }
  SHOAL_CHECK_T(InvalidArgument, args.powersgd_rank >= 1, "bench ddp: --powersgd-rank must be >= 1");
  SHOAL_CHECK_T(InvalidArgument, !args.bucket_reductions.empty(),
                "bench ddp: --bucket-reduction needs at least one of auto, overlapped, inline");
  for (const auto& reduction : args.bucket_reductions) parallel::parse_bucket_reduction(reduction);
  for (const auto& backend : args.backends) {
    modes.push_back({"shoal_ddp", backend, false});
    modes.push_back({"shoal_ddp", backend, true});
    if (backend != args.backends.front()) continue;
    for (const auto& hook : args.comm_hooks) {
      if (hook != "allreduce") modes.push_back({"shoal_ddp", backend, false, hook});
    }
    // The other bucket reductions, plain and with bucket views, in the same rounds.
    for (size_t r = 1; r < args.bucket_reductions.size(); ++r) {
      for (const bool view : {false, true}) {
        DdpMode mode{"shoal_ddp", backend, view};
        mode.reduction = args.bucket_reductions[r];
        modes.push_back(mode);
      }
    }
    if (args.bucket_sweep) {
      // bucket_cap_mb=auto against each of its candidates fixed, in the same rounds.
      // Auto's candidates: each cap with the usual first bucket, and with a first bucket of the
      // same size. After the first round, those that gave the same buckets as an earlier one
      // are dropped.
      for (const bool same_first : {false, true}) {
        for (double cap : DistributedDataParallelOptions().bucket_cap_candidates_mb) {
          std::ostringstream text;
          text << cap;
          modes.push_back({"shoal_ddp", backend, false, "allreduce", {}, text.str(),
                           same_first ? text.str() : ""});
        }
      }
      modes.push_back({"shoal_ddp", backend, false, "allreduce", {}, "auto"});
    }
  }
  for (const auto& peer : peers) {
    modes.push_back({"pytorch_ddp", "gloo", false, "allreduce", peer});
    modes.push_back({"pytorch_ddp", "gloo", true, "allreduce", peer});
  }
  // The ceiling (`independent`) is what the machine allows at this moment, and this machine's
  // moment swings by 15 % within minutes: with --ceiling interleaved it runs before the first
  // contender and after every contender, and each contender's of_ceil for a round is its rate
  // over the mean of the ceiling runs just before and just after it (the median over rounds is
  // reported, with the spread of the ceiling's own runs).
  auto ceiling_now = [&](int round) {
    run_mode(args, exe, dir, round, modes[1]);  // `independent` (the sweep may shrink `modes`)
    return modes[1].samples["samples_per_s"].back();
  };
  for (int round = 0; round < args.rounds; ++round) {
    run_mode(args, exe, dir, round, modes[0]);
    double before = ceiling_now(round);
    // The contenders in order in even rounds and in reverse in odd ones: no mode always runs
    // right after the same one (and a minute of the machine's noise, at the same place of every
    // round, does not always fall on the same mode).
    std::vector<size_t> order;
    for (size_t i = 2; i < modes.size(); ++i) order.push_back(i);
    if (round % 2 == 1) std::reverse(order.begin(), order.end());
    for (size_t i : order) {
      run_mode(args, exe, dir, round, modes[i]);
      const double after = args.ceiling == "interleaved" ? ceiling_now(round) : before;
      const double ceiling = (before + after) / 2;
      modes[i].samples["ceiling"].push_back(ceiling);
      modes[i].samples["of_ceiling"].push_back(modes[i].samples["samples_per_s"].back() / ceiling);
      before = after;
    }
    if (round == 0 && args.bucket_sweep) {
      // Fixed caps that gave the buckets of an earlier fixed cap measure the same thing twice.
      std::vector<double> seen;
      std::vector<DdpMode> kept;
      for (auto& m : modes) {
        if (m.name == "shoal_ddp" && !m.cap.empty() && m.cap != "auto") {
          const double layout = m.samples["layout"].back();
          if (std::find(seen.begin(), seen.end(), layout) != seen.end()) continue;
          seen.push_back(layout);
        }
        kept.push_back(std::move(m));
      }
      modes = std::move(kept);
    }
  }
  std::system(("rm -rf " + dir).c_str());

  const DdpMode& single = modes[0];
  const DdpMode& independent = modes[1];
  const DdpMode& lockstep = modes[2];
  // Two modes' values in the same rounds: the median over the rounds of their ratio.
  auto median_ratio = [](const std::vector<double>& a, const std::vector<double>& b) {
    std::vector<double> ratios;
    for (size_t r = 0; r < a.size() && r < b.size(); ++r) ratios.push_back(a[r] / b[r]);
    return ratios.empty() ? std::nan("") : median(ratios);
  };
  // of_lockstep: a mode's of_ceil over lockstep's in the same round, median of the rounds.
  auto of_lockstep = [&](const DdpMode& mode) {
    return median_ratio(mode.samples.at("of_ceiling"), lockstep.samples.at("of_ceiling"));
  };
  // vs_pt: a Shoal mode's samples/s over a PyTorch peer's with the same bucket views (the first
  // --torch peer unless `version` names one): the median over the rounds of the two's ratio in
  // each round (run within seconds of each other, so a minute of noise moves both), or the ratio
  // of the medians where the two ran different rounds.
  auto vs_pytorch = [&](const DdpMode& mode, const std::string& version) {
    for (const auto& m : modes) {
      if (m.name != "pytorch_ddp" || m.bucket_view != mode.bucket_view ||
          (!version.empty() && m.peer.version != version)) {
        continue;
      }
      const auto& a = mode.samples.at("samples_per_s");
      const auto& b = m.samples.at("samples_per_s");
      if (a.size() != b.size()) return mode.get("samples_per_s") / m.get("samples_per_s");
      return median_ratio(a, b);
    }
    return std::nan("");
  };
  if (!args.json) {
    std::printf("bench ddp: model %s, %d ranks x batch %d, %d steps, median of %d rounds\n",
                args.model.c_str(), args.world, args.batch, args.steps, args.rounds);
    std::printf("%-32s %10s %8s %8s %7s %7s %7s %7s %7s %7s %7s %7s %7s %9s\n", "mode",
                "samples/s", "peak MB", "+MB", "+live", "effic.", "of_ceil", "vs_pt", "fwd ms",
                "bwd ms", "opt ms", "wait ms", "hidden", "sent_kb");
  }
  std::vector<std::string> comm_costs;  // one line per shoal_ddp mode, under the table
  std::vector<std::string> peer_ceilings;  // one line per pytorch_ddp mode
  std::vector<std::string> lockstep_shares;  // one line per shoal_ddp mode
  const int cores = launcher::available_cores();
  const bool no_spare_core = args.world >= cores;
  // The ceiling's and lockstep's step times (median rates), and of_ceil of a step `ms` longer
  // than a step of `step_ms`.
  const double ceiling_step_ms = 1e3 * args.world * args.batch / independent.get("samples_per_s");
  const double lockstep_step_ms = ceiling_step_ms / lockstep.get("of_ceiling");
  auto of_ceiling_adding = [&](double step_ms, double ms) {
    return ceiling_step_ms / (step_ms + ms);
  };
  for (const auto& mode : modes) {
    const double rate = mode.get("samples_per_s");
    const bool parallel = mode.name != "single";
    const double efficiency = parallel ? rate / (args.world * single.get("samples_per_s")) : std::nan("");
    const bool against_ceiling =
        mode.name == "shoal_ddp" || mode.name == "pytorch_ddp" || mode.name == "lockstep";
    const double of_ceiling = against_ceiling ? mode.get("of_ceiling") : std::nan("");
    const double of_lock = mode.name == "shoal_ddp" ? of_lockstep(mode) : std::nan("");
    if (std::isfinite(of_lock)) {
      char line[160];
      std::snprintf(line, sizeof line, "  %s: %.2f of lockstep's rate\n", mode.label().c_str(),
                    of_lock);
      lockstep_shares.push_back(line);
    }
    const auto ratios = mode.samples.find("of_ceiling");
    const bool has_ratios = against_ceiling && ratios != mode.samples.end() && !ratios->second.empty();
    const double of_ceiling_min =
        has_ratios ? *std::min_element(ratios->second.begin(), ratios->second.end()) : std::nan("");
    const double of_ceiling_max =
        has_ratios ? *std::max_element(ratios->second.begin(), ratios->second.end()) : std::nan("");
    const double vs = mode.name == "shoal_ddp" ? vs_pytorch(mode, "") : std::nan("");
    // Where no core is spare (a rank per core, each busy with its own step), what of_ceil would be
    // if the mode's bucket allreduces, timed alone in the same run (comm_ms), and the copies DDP
    // made between gradients and buckets (copy_ms: plain gradients reduced overlapped or under a
    // comm hook, in and out; where the optimizer's zero_grad() drops the gradients, autograd's new
    // ones in) added their own time to the ceiling's step; and if the allreduces alone added to
    // lockstep's step instead (the waiting any synchronous scheme has, then the exchange this one
    // needs; the copies are this DDP's choice, not the exchange's). Estimates, not bounds: where
    // the vCPUs share floating-point units, a rank that communicates (or waits) lets its sibling
    // compute faster, and runs beat them.
    const bool is_shoal = mode.name == "shoal_ddp";
    const double comm_added =
        is_shoal ? of_ceiling_adding(ceiling_step_ms, mode.get("comm_ms") + mode.get("copy_ms"))
                 : std::nan("");
    const double lockstep_comm =
        is_shoal ? of_ceiling_adding(lockstep_step_ms, mode.get("comm_ms")) : std::nan("");
    // The floor no DDP goes under where no core is spare: the memory work alone of any allreduce
    // of these gradients, added to the ceiling's step.
    const double floor_added =
        is_shoal ? of_ceiling_adding(ceiling_step_ms, mode.get("floor_ms")) : std::nan("");
    if (is_shoal && std::isfinite(comm_added)) {
      char line[400];
      char copies[128] = "";
      if (mode.get("copied_mb") > 0) {
        std::snprintf(copies, sizeof copies,
                      " + its copies between gradients and buckets (%.1f MB a step) %.2f ms",
                      mode.get("copied_mb"), mode.get("copy_ms"));
      } else if (!mode.bucket_view) {
        std::snprintf(copies, sizeof copies, " (plain gradients in the buckets: none copied)");
      }
      std::snprintf(line, sizeof line,
                    "  %s: its bucket allreduces alone %.2f ms a step%s, the ceiling's step %.2f "
                    "ms: of_ceil %.3f if added; the allreduces added to lockstep's step (%.2f "
                    "ms): of_ceil %.3f\n",
                    mode.label().c_str(), mode.get("comm_ms"), copies, ceiling_step_ms,
                    comm_added, lockstep_step_ms, lockstep_comm);
      comm_costs.push_back(line);
      if (std::isfinite(floor_added)) {
        std::snprintf(line, sizeof line,
                      "  %s: the memory work alone of any allreduce of its gradients (each rank "
                      "reading and writing every byte of its buckets once, both at once, timed "
                      "here) %.2f ms a step: of_ceil %.3f if added (no allreduce moves less)\n",
                      mode.label().c_str(), mode.get("floor_ms"), floor_added);
        comm_costs.push_back(line);
      }
    }
    // How far above a PyTorch peer the no-communication ceiling is (its of_ceil inverted, per
    // round against the ceiling runs beside it): no DDP can beat that peer by more, here and now.
    const double ceiling_over = mode.name == "pytorch_ddp" ? 1.0 / of_ceiling : std::nan("");
    if (std::isfinite(ceiling_over)) {
      char line[256];
      std::snprintf(line, sizeof line,
                    "  %s: the ceiling is %.2fx it, so Shoal's DDP at 1.5x it would need of_ceil "
                    ">= %.2f\n",
                    mode.label().c_str(), ceiling_over, 1.5 / ceiling_over);
      peer_ceilings.push_back(line);
    }
    // Against every PyTorch peer: {"1.13.1": 1.31, "2.15.0": 1.12}.
    std::string vs_each = "{";
    for (const auto& peer : peers) {
      const double v = mode.name == "shoal_ddp" ? vs_pytorch(mode, peer.version) : std::nan("");
      vs_each += (vs_each.size() > 1 ? ", \"" : "\"") + peer.version + "\": " + json_number(v);
    }
    vs_each += "}";
    const double sent = mode.get("sent_bytes");
    const double extra_mb = mode.get("peak_rss_mb") - single.get("peak_rss_mb");
    // Against `independent`: the same number of processes sharing the same library pages.
    const double extra_pss =
        parallel ? mode.get("pss_mb") - independent.get("pss_mb") : std::nan("");
    // Live memory of the largest rank against one process training alone.
    const double extra_live = mode.get("live_mb") - single.get("live_mb");
    if (args.json) {
      std::printf(
          "{\"mode\": \"%s\", \"model\": \"%s\", \"backend\": %s, \"world_size\": %d, "
          "\"batch_per_rank\": %d, \"gradient_as_bucket_view\": %s, \"samples_per_s\": %s, "
          "\"peak_rss_mb\": %s, \"extra_rss_mb\": %s, \"pss_mb\": %s, \"extra_pss_mb\": %s, "
          "\"live_mb\": %s, \"extra_live_mb\": %s, \"grad_mb\": %s, \"efficiency\": %s, "
          "\"of_ceiling\": %s, \"of_ceiling_min\": %s, \"of_ceiling_max\": %s, \"of_lockstep\": %s, "
          "\"ceiling_runs\": %zu, \"vs_pytorch\": %s, \"vs_pytorch_by_version\": %s, \"torch\": %s, "
          "\"forward_ms\": %s, \"backward_ms\": %s, "
          "\"optimizer_ms\": %s, \"wait_ms\": %s, \"overlap\": %s, \"hidden_bytes_fraction\": %s, "
          "\"buckets\": %s, \"comm_hook\": %s, \"sent_bytes_per_step\": %s, "
          "\"bucket_cap_mb\": %s, \"bucket_cap\": %s, \"comm_ms\": %s, \"copy_ms\": %s, "
          "\"copied_mb_per_step\": %s, \"floor_ms\": %s, \"floor_of_ceiling\": %s, "
          "\"comm_added_of_ceiling\": %s, \"lockstep_comm_of_ceiling\": %s, "
          "\"ceiling_over_this\": %s, \"bucket_reduction\": %s, "
          "\"inline_reduction\": %s, \"rounds\": %d}\n",
          mode.name.c_str(), args.model.c_str(),
          mode.backend.empty() ? "null" : ("\"" + mode.backend + "\"").c_str(),
          mode.name == "single" ? 1 : args.world, args.batch, mode.bucket_view ? "true" : "false",
          json_number(rate).c_str(), json_number(mode.get("peak_rss_mb")).c_str(),
          json_number(extra_mb).c_str(), json_number(mode.get("pss_mb")).c_str(),
          json_number(extra_pss).c_str(), json_number(mode.get("live_mb")).c_str(),
          json_number(extra_live).c_str(), json_number(single.get("grad_mb")).c_str(),
          json_number(efficiency).c_str(), json_number(of_ceiling).c_str(),
          json_number(of_ceiling_min).c_str(), json_number(of_ceiling_max).c_str(),
          json_number(of_lock).c_str(),
          independent.samples.count("samples_per_s") ? independent.samples.at("samples_per_s").size() : 0,
          json_number(vs).c_str(), vs_each.c_str(),
          mode.peer.version.empty() ? "null" : ("\"" + mode.peer.version + "\"").c_str(),
          json_number(mode.get("forward_ms")).c_str(),
          json_number(mode.get("backward_ms")).c_str(), json_number(mode.get("optimizer_ms")).c_str(),
          json_number(mode.get("wait_ms")).c_str(), json_number(mode.get("overlap")).c_str(),
          json_number(mode.get("hidden_bytes_fraction")).c_str(),
          json_number(mode.get("buckets")).c_str(),
          mode.name == "shoal_ddp" ? ("\"" + mode.hook + "\"").c_str() : "null",
          json_number(sent).c_str(), json_number(mode.get("bucket_cap_mb")).c_str(),
          mode.name == "shoal_ddp"
              ? ("\"" + (mode.cap.empty() ? args.bucket_cap_mb : mode.cap) + "\"").c_str()
              : "null",
          json_number(mode.get("comm_ms")).c_str(), json_number(mode.get("copy_ms")).c_str(),
          json_number(mode.get("copied_mb")).c_str(), json_number(mode.get("floor_ms")).c_str(),
          json_number(floor_added).c_str(), json_number(comm_added).c_str(),
          json_number(lockstep_comm).c_str(), json_number(ceiling_over).c_str(),
          mode.name == "shoal_ddp"
              ? ("\"" + (mode.reduction.empty() ? args.bucket_reductions.at(0) : mode.reduction) +
                 "\"").c_str()
              : "null",
          json_number(mode.get("inline_reduction")).c_str(),
          args.rounds);
    } else {
      auto cell = [](double v, const char* format) {
        if (!std::isfinite(v)) return std::string("-");
        char text[32];
        std::snprintf(text, sizeof text, format, v);
        return std::string(text);
      };
      std::printf("%-32s %10.1f %8.1f %8s %7s %7s %7s %7s %7s %7s %7s %7s %7s %9s\n",
                  mode.label().c_str(), rate, mode.get("peak_rss_mb"),
                  cell(extra_mb, "%+.1f").c_str(), cell(extra_live, "%+.1f").c_str(),
                  cell(efficiency, "%.2f").c_str(), cell(of_ceiling, "%.2f").c_str(),
                  cell(vs, "%.2f").c_str(), cell(mode.get("forward_ms"), "%.2f").c_str(),
                  cell(mode.get("backward_ms"), "%.2f").c_str(),
                  cell(mode.get("optimizer_ms"), "%.2f").c_str(),
                  cell(mode.get("wait_ms"), "%.2f").c_str(),
                  cell(mode.get("hidden_bytes_fraction"), "%.2f").c_str(),
                  cell(sent / 1024, "%.1f").c_str());
    }
  }
  if (args.bucket_sweep) {
    // auto against the best fixed cap of the sweep (first backend). Both through their of_ceil,
    // each taken against the ceiling runs beside it, so that the machine's drift between the two
    // runs cancels: best = the highest median of_ceil; auto_of_best = the median over the rounds
    // of auto's of_ceil / best's.
    const DdpMode* best = nullptr;
    const DdpMode* automatic = nullptr;
    for (const auto& m : modes) {
      if (m.name != "shoal_ddp" || m.cap.empty() || m.backend != args.backends.front()) continue;
      if (m.cap == "auto") {
        automatic = &m;
      } else if (!best || m.get("of_ceiling") > best->get("of_ceiling")) {
        best = &m;
      }
    }
    if (best && automatic) {
      std::string chosen;
      const auto& caps = automatic->samples.at("bucket_cap_mb");
      const auto& firsts = automatic->samples.at("first_bucket_cap_mb");
      for (size_t k = 0; k < caps.size(); ++k) {
        std::ostringstream text;
        text << (args.json ? "\"" : "") << firsts[k] << "/" << caps[k] << (args.json ? "\"" : "");
        chosen += (chosen.empty() ? "" : ",") + text.str();
      }
      const double ratio =
          median_ratio(automatic->samples.at("of_ceiling"), best->samples.at("of_ceiling"));
      if (args.json) {
        std::printf("{\"bucket_sweep\": true, \"model\": \"%s\", \"best_fixed_cap_mb\": \"%s\", "
                    "\"best_fixed_first_cap_mb\": \"%s\", "
                    "\"best_fixed_samples_per_s\": %s, \"auto_samples_per_s\": %s, "
                    "\"auto_of_best\": %s, \"auto_chose_mb\": [%s], \"auto_tuning_steps\": %s}\n",
                    args.model.c_str(), best->cap.c_str(),
                    best->first_cap.empty() ? "default" : best->first_cap.c_str(),
                    json_number(best->get("samples_per_s")).c_str(),
                    json_number(automatic->get("samples_per_s")).c_str(),
                    json_number(ratio).c_str(), chosen.c_str(),
                    json_number(automatic->get("tuning_steps")).c_str());
      } else {
        std::printf("bucket sweep: best fixed bucket_cap_mb %s%s (%.1f samples/s); auto %.1f "
                    "samples/s; auto / best = %.3f (of_ceil over of_ceil, median of the rounds); "
                    "auto chose %s MiB (first/other bucket cap, one per round) in %.0f untimed "
                    "tuning steps\n",
                    best->cap.c_str(),
                    best->first_cap.empty() ? "" : (" (first " + best->first_cap + ")").c_str(),
                    best->get("samples_per_s"),
                    automatic->get("samples_per_s"), ratio, chosen.c_str(),
                    automatic->get("tuning_steps"));
      }
    }
  }
  if (!args.json) {
    const auto& ceilings = independent.samples.at("samples_per_s");
    const double ceiling = median(ceilings);
    const auto [low, high] = std::minmax_element(ceilings.begin(), ceilings.end());
    std::printf("ceiling (independent, %zu runs %s): median %.1f samples/s, range %.1f-%.1f "
                "(%+.1f%% / %+.1f%% of the median)\n",
                ceilings.size(),
                args.ceiling == "interleaved" ? "interleaved with the contenders" : "once a round",
                ceiling, *low, *high, 100 * (*low / ceiling - 1), 100 * (*high / ceiling - 1));
    const auto& locked = lockstep.samples.at("of_ceiling");
    const auto [locked_low, locked_high] = std::minmax_element(locked.begin(), locked.end());
    std::printf("lockstep (the ceiling's processes meeting at a barrier after every backward, no "
                "data: the most any synchronous data parallelism reaches here): of_ceil %.2f "
                "(rounds %.2f-%.2f)\n",
                lockstep.get("of_ceiling"), *locked_low, *locked_high);
    for (const std::string& line : lockstep_shares) std::fputs(line.c_str(), stdout);
    if (!comm_costs.empty() && no_spare_core) {
      std::printf("communication's own time (%d ranks on %d cores, none spare; what of_ceil would "
                  "be if it added to the ceiling's step: an estimate, not a bound, since a rank "
                  "that communicates lets a vCPU sharing its core compute faster):\n",
                  args.world, cores);
      for (const std::string& line : comm_costs) std::fputs(line.c_str(), stdout);
    }
    if (!peer_ceilings.empty()) {
      std::printf("the ceiling over each PyTorch peer (the most any DDP can beat it by here):\n");
      for (const std::string& line : peer_ceilings) std::fputs(line.c_str(), stdout);
    }
    std::printf("efficiency = samples/s / (%d x single); of_ceil = samples/s / independent (%d "
                "processes without communication; per round, against the ceiling runs beside "
                "it, median of the rounds); vs_pt = Shoal / PyTorch DDP (the first --torch peer) with the same "
                "gradient_as_bucket_view (per round, median of the rounds); +MB = peak RSS - single's (shared memory counted in full by every "
                "rank); +live = live memory - single's (heap in use at the end of forward and of "
                "backward, the larger, plus the rank's share of shared memory; JSON also has PSS); "
                "MB = MiB; sent_kb = KiB rank 0 passed to its collectives per step; gradients: %.1f "
                "MB\n",
                args.world, args.world, single.get("grad_mb"));
  }
  return 0;
}

}  // namespace

void add_bench_ddp_command(CLI::App& bench, std::vector<Command>& commands) {
  auto args = std::make_shared<DdpBenchArgs>();
  auto* app = bench.add_subcommand(
      "ddp", "DDP throughput: one process vs Shoal DDP vs PyTorch's Python DDP, side by side");
  add_step_options(*app, *args);
  app->get_option("--steps")->description(
      "timed steps per run; 0: about a second a run here (140 for mlp, 20 for cnn and transformer, "
      "with at least a seventh as many warm-up steps)");
  app->add_option("--backend", args->backends,
                  "process group backends for Shoal's DDP, each measured (e.g. shm,gloo)")
      ->delimiter(',')
      ->capture_default_str();
  app->add_option("--batch-size,--batch", args->batch, "batch per rank")->capture_default_str();
  app->add_option("--nproc-per-node,--world", args->world, "ranks of the DDP runs")->capture_default_str();
  app->add_option("--bucket-cap-mb", args->bucket_cap_mb,
                  "DDP bucket_cap_mb: MiB, auto, or 0 for DDP's default")
      ->check([](const std::string& value) {
        return value == "0" ? std::string() : bucket_cap_mb_error(value);  // 0: DDP's default
      })
      ->capture_default_str();
  app->add_flag("--bucket-sweep", args->bucket_sweep,
                "also run Shoal's DDP (first backend) with each candidate of bucket_cap_mb=auto "
                "fixed, and with auto, in the same rounds; reports auto against the best");
  app->add_option("--first-bucket-cap-mb", args->first_bucket_cap_mb,
                  "DDP first_bucket_cap_mb (0: DDP's default)")
      ->capture_default_str();
  app->add_option("--torch-script", args->torch_script, "PyTorch peer script")->capture_default_str();
  app->add_option("--ceiling", args->ceiling,
                  "interleaved: the no-communication ceiling runs before the first contender and "
                  "after every one (of_ceil against the runs beside it); once: once a round")
      ->capture_default_str();
  add_torch_option(*app, args->torch_peers);
  app->add_option("--comm-hook", args->comm_hooks,
                  "communication hooks of Shoal's DDP, each measured (allreduce, fp16, bf16, "
                  "powersgd; allreduce is the default DDP modes)")
      ->delimiter(',')
      ->capture_default_str();
  app->add_option("--bucket-reduction", args->bucket_reductions,
                  "DDP bucket_reduction, each measured (auto, overlapped, inline; the first is "
                  "the default DDP modes', the others add a plain and a bucket-view mode)")
      ->delimiter(',')
      ->capture_default_str();
  app->add_option("--powersgd-rank", args->powersgd_rank,
                  "with --comm-hook powersgd: PowerSGD's matrix_approximation_rank")
      ->capture_default_str();
  add_worker_options(*app, *args);
  app->add_flag("--gradient-as-bucket-view", args->bucket_view)->group("");
  commands.push_back({app, [args] {
                        if (!args->worker.empty()) return run_worker(*args);
                        choose_steps(*args);
                        return run_ddp_bench(*args);
                      }});
}

}  // namespace shoal::cli
