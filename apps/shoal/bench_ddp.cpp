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
// --model gpt races the built-in GPT (its sizes given as to `shoal train --model gpt`) on random
// token blocks; a sample is then a block of --block-size tokens.
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

#include "bench_harness.h"
#include "bench_util.h"
#include "commands.h"
#include "compat/thread_parallelism.h"
#include "shoal/models/registry.h"
#include "shoal/comm/init.h"
#include "shoal/error.h"
#include "shoal/log.h"
#include "shoal/launcher/launch.h"
#include "shoal/memory/cpu_allocator.h"
#include "shoal/parallel/comm_hooks.h"
#include "shoal/train/ddp_strategy.h"
#include "shoal/parallel/distributed_data_parallel.h"
#include "shoal/train/clip_grad.h"

namespace shoal::cli {
namespace {

using Clock = std::chrono::steady_clock;

struct DdpBenchArgs : StepBenchArgs, WorkerArgs {
  DdpBenchArgs() {  // bench ddp's defaults
    steps = 0;  // per model: see choose_steps()
    warmup = 3;
  }
  std::vector<std::string> backends{"shm"};
  int batch = 64;  // per model where not given: see choose_steps()
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
  models::GptConfig gpt;     // --model gpt's sizes
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

// What every rank of a run trains: the registry's model (the one `shoal train` trains, so that
// bench and trainer measure one thing) on one batch: random images with class labels, or for the
// GPT random token blocks with random next-token targets.
struct Workload {
  std::shared_ptr<models::Model> model;
  at::Tensor x, y;
  /// The model's loss on the batch: its own (the GPT's), or cross-entropy of its output.
  at::Tensor loss() const {
    return model->owns_loss() ? model->forward_loss(x, y)
                              : torch::cross_entropy_loss(model->forward(x), y);
  }
};

Workload make_workload(const DdpBenchArgs& args) {
  torch::manual_seed(0);
  Workload work;
  if (args.model == "gpt") {
    models::ModelOptions options;
    options.gpt = args.gpt;
    work.model = models::create(args.model, 0, options);
    const auto vocab = args.gpt.vocab_size;
    work.x = torch::randint(0, vocab, {args.batch, args.gpt.block_size}, torch::kLong);
    work.y = torch::randint(0, vocab, {args.batch, args.gpt.block_size}, torch::kLong);
  } else {
    work.model = models::create(args.model, 0);
    work.x = torch::randn({args.batch, 1, 28, 28});
    work.y = torch::randint(0, 10, {args.batch}, torch::kLong);
  }
  return work;
}

// single: one process alone; lockstep: `single` on every rank, meeting the others at a barrier
// after each backward, with no data (shm: the cheapest meeting there is), timed and started as
// the DDP ranks are.
void time_without_ddp(const DdpBenchArgs& args, const Workload& work,
                      torch::optim::Optimizer& optimizer, Values& result) {
  auto forward_loss = [&] { return work.loss(); };
  PhaseTimer warm, timed;
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
}

DistributedDataParallelOptions ddp_options(const DdpBenchArgs& args) {
  DistributedDataParallelOptions options;
  options.gradient_as_bucket_view = args.bucket_view;
  options.bucket_reduction = parallel::parse_bucket_reduction(args.bucket_reductions.at(0));
  if (std::strtod(args.bucket_cap_mb.c_str(), nullptr) > 0 || args.bucket_cap_mb == "auto") {
    options.bucket_cap_mb = parallel::parse_bucket_cap_mb(args.bucket_cap_mb);
  }
  if (args.first_bucket_cap_mb > 0) options.first_bucket_cap_mb = args.first_bucket_cap_mb;
  return options;
}

// What DDP's statistics say of the timed steps, from before them to after them.
void record_ddp_stats(const DdpBenchArgs& args, const parallel::ReducerStats& before, const parallel::ReducerStats& after,
                      double power_sgd_bytes, Values& result) {
  result["bucket_cap_mb"] = before.bucket_cap_mb;
  result["first_bucket_cap_mb"] = before.first_bucket_cap_mb;
  result["inline_reduction"] = before.inline_reduction ? 1 : 0;
  // Which buckets (their sizes in order), as one number: the sweep drops caps that give the
  // same buckets as another.
  double layout = 0;
  for (int64_t bytes : before.bucket_bytes) layout = std::fmod(layout * 1000003.0 + bytes, 1e15);
  result["layout"] = layout;
  // What this rank passed to its collectives per timed step (the hooks send what they reduce).
  const std::string& hook = args.comm_hooks.at(0);
  const double bucket_bytes = (after.reduced_bytes - before.reduced_bytes) / args.steps;
  double sent = hook == "fp16" || hook == "bf16" ? bucket_bytes / 2 : bucket_bytes;
  if (hook == "powersgd") sent = power_sgd_bytes / args.steps;
  result["sent_bytes"] = sent;
  result["wait_ms"] = 1e3 * (after.wait_seconds - before.wait_seconds) / args.steps;
  // Bytes DDP copied between gradients and buckets per timed step (0 once the gradients live
  // in the buckets).
  result["copied_mb"] = (after.copied_bytes - before.copied_bytes) / args.steps / 1048576.0;
  result["hidden_fraction"] = (after.hidden_bytes - before.hidden_bytes) /
                              std::max(after.reduced_bytes - before.reduced_bytes, 1.0);
}

// How many times the comm-only measurements below repeat their work: their time is the mean.
constexpr int kCommRepeats = 5;

// The same bucket reductions as the timed steps' on their own (comm_ms), launched back to back as
// backward launches them, on buckets where DDP keeps them (the group's symmetric memory where it
// has some: shm); and the memory floor of any allreduce of these gradients (floor_ms): every rank
// reads each byte of its buckets once and writes it once (each byte of every rank's gradients
// must be read, each of every rank's results written, and the ranks share the work at best
// evenly), all ranks at once, as `bench allreduce`'s floor_inplace. Zeros stay zeros.
void time_comm_alone(comm::ProcessGroup& group, const parallel::ReducerStats& after, Values& result) {
  std::vector<torch::Tensor> buckets;
  for (int64_t bytes : after.bucket_bytes) {
    buckets.push_back(group.empty_symmetric(bytes / 4, torch::kFloat).zero_());
  }
  group.barrier()->wait();
  const auto comm_start = Clock::now();
  comm::AllreduceOptions comm_options;
  comm_options.async_op = !after.inline_reduction;  // as DDP reduces them (bucket_reduction)
  for (int r = 0; r < kCommRepeats; ++r) {
    std::vector<std::shared_ptr<comm::Work>> works;
    for (auto& b : buckets) works.push_back(group.allreduce(b, comm_options));
    for (auto& w : works) w->wait();
  }
  result["comm_ms"] = 1e3 * seconds_since(comm_start) / kCommRepeats;
  result["buckets"] = static_cast<double>(buckets.size());
  group.barrier()->wait();
  const auto floor_start = Clock::now();
  for (int r = 0; r < kCommRepeats; ++r) {
    for (auto& b : buckets) b.mul_(0.5);
  }
  result["floor_ms"] = 1e3 * seconds_since(floor_start) / kCommRepeats;
  group.barrier()->wait();
}

// Gradients that do not live in the buckets are copied into their bucket when ready and back into
// .grad after the reduction, as PyTorch's DDP does with plain gradients: that work, alone, per
// step, in proportion to the bytes DDP copied in the timed steps (`copied` per step).
double time_copies(models::Model& model, double copied) {
  if (copied <= 0) return 0;
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> grads;
  int64_t total = 0;
  double total_bytes = 0;
  for (const auto& p : train::unique_parameters(model.parameters())) {
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
  return 1e3 * seconds_since(copy_start) / kCommRepeats *
         std::min(1.0, copied / std::max(2.0 * total_bytes, 1.0));
}

// shoal_ddp: Shoal's DDP over the first --backend with the run's options and hook.
void time_ddp(const DdpBenchArgs& args, const Workload& work, torch::optim::Optimizer& optimizer,
              Values& result) {
  auto store = comm::make_file_store(args.store, args.world);
  auto group = comm::new_process_group(args.backends.at(0), store, args.rank, args.world);
  DistributedDataParallel<models::Model> ddp(work.model, group, ddp_options(args));
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
  auto forward_loss = [&] {
    ddp.prepare_for_forward();
    at::Tensor loss = work.loss();
    ddp.prepare_for_backward(loss);
    return loss;
  };
  PhaseTimer warm, timed;
  // auto: the tuning steps come first and are not timed (the report gives their number).
  int tuning_steps = 0;
  while (args.bucket_cap_mb == "auto" && ddp.stats().bucket_cap_tuning) {
    SHOAL_CHECK(++tuning_steps <= 10000, "bench ddp: bucket_cap_mb=auto never decided");
    warm.step(forward_loss, optimizer);
  }
  result["tuning_steps"] = tuning_steps;
  for (int i = 0; i < args.warmup; ++i) warm.step(forward_loss, optimizer);
  group->barrier()->wait();
  const auto before = ddp.stats();
  const double power_sgd_before = power_sgd ? power_sgd->bytes_sent : 0;
  const auto start = Clock::now();
  for (int i = 0; i < args.steps; ++i) timed.step(forward_loss, optimizer);
  group->barrier()->wait();
  result["seconds"] = seconds_since(start);
  timed.record(result, args.steps);
  // Memory of training, before the comm-only measurements allocate their own buckets.
  result["peak_rss_mb"] = peak_rss_mb();
  const auto after = ddp.stats();
  record_ddp_stats(args, before, after, power_sgd ? power_sgd->bytes_sent - power_sgd_before : 0,
                   result);
  record_memory(forward_loss, optimizer, result);
  time_comm_alone(*group, after, result);
  result["copy_ms"] = time_copies(*work.model, result["copied_mb"] * 1048576.0);
}

int run_worker(const DdpBenchArgs& args) {
  // Every Shoal mode, the DDP-less ones too, with the allocator settings Shoal's DDP and Trainer
  // use, so that the comparison measures DDP alone (SHOAL_TUNE_MALLOC=0 measures without them).
  memory::tune_cpu_allocator();
  compat::set_compute_threads(1);  // LibTorch's and OpenBLAS's pools: idle BLAS threads spin
  const Workload work = make_workload(args);
  // A tied weight (the GPT's embedding and head) is listed twice: stepped once, as the trainer does.
  const std::vector<at::Tensor> parameters = train::unique_parameters(work.model->parameters());
  torch::optim::SGD optimizer(parameters, torch::optim::SGDOptions(0.01).momentum(0.9));
  Values result;
  double grad_bytes = 0;
  for (const auto& p : parameters) grad_bytes += p.numel() * p.element_size();
  result["grad_mb"] = grad_bytes / 1048576.0;
  if (args.worker == "single" || args.worker == "lockstep") {
    time_without_ddp(args, work, optimizer, result);
  } else {
    time_ddp(args, work, optimizer, result);
  }
  if (result.count("peak_rss_mb") == 0) result["peak_rss_mb"] = peak_rss_mb();
  write_values(args.result, result, "bench ddp");
  return 0;
}

// One line of the report: a mode with its options, and its samples over the rounds.
struct DdpMode : BenchMode {
  std::string backend;  // empty for single and independent
  bool bucket_view = false;
  std::string hook = "allreduce";  // shoal_ddp's communication hook
  TorchPeer peer;       // pytorch_ddp: which PyTorch runs it
  std::string cap;      // shoal_ddp's bucket_cap_mb when not --bucket-cap-mb's: MiB or auto
  std::string first_cap;  // and first_bucket_cap_mb when not --first-bucket-cap-mb's
  std::string reduction;  // shoal_ddp's bucket_reduction when not --bucket-reduction's first

  DdpMode(std::string mode_name, std::string mode_backend, bool view = false) {
    name = std::move(mode_name);
    backend = std::move(mode_backend);
    bucket_view = view;
  }
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
  bool is_shoal() const { return name == "shoal_ddp"; }
};

// --model gpt's sizes, as `shoal train --model gpt` takes them.
std::vector<std::string> gpt_flags(const DdpBenchArgs& args) {
  if (args.model != "gpt") return {};
  const models::GptConfig& gpt = args.gpt;
  return {"--n-layer",    std::to_string(gpt.n_layer),    "--n-head",
          std::to_string(gpt.n_head),                     "--n-embd",
          std::to_string(gpt.n_embd),                     "--block-size",
          std::to_string(gpt.block_size),                 "--vocab-size",
          std::to_string(gpt.vocab_size)};
}

// The command line of one rank of a Shoal mode's run: this program as `worker`.
std::vector<std::string> worker_command(const DdpBenchArgs& args, const DdpMode& mode,
                                        const std::string& worker) {
  std::vector<std::string> command{
      launcher::self_executable(), "bench", "ddp", "--model", args.model, "--backend",
      mode.backend.empty() ? "shm" : mode.backend, "--steps", std::to_string(args.steps),
      "--warmup", std::to_string(args.warmup), "--batch", std::to_string(args.batch), "--world",
      std::to_string(args.world), "--bucket-cap-mb",
      mode.cap.empty() ? args.bucket_cap_mb : mode.cap, "--first-bucket-cap-mb",
      mode.first_cap.empty() ? std::to_string(args.first_bucket_cap_mb) : mode.first_cap,
      "--comm-hook", mode.hook, "--bucket-reduction",
      mode.reduction.empty() ? args.bucket_reductions.at(0) : mode.reduction, "--powersgd-rank",
      std::to_string(args.powersgd_rank), "--worker", worker};
  for (auto& word : gpt_flags(args)) command.push_back(word);
  if (mode.bucket_view) command.push_back("--gradient-as-bucket-view");
  return command;
}

// How the processes of one round of `mode` are run.
RunProcessesOptions run_options(const DdpMode& mode) {
  RunProcessesOptions options;
  options.benchmark = "bench ddp";
  options.run = "the " + mode.label() + " run";
  return options;
}

// One run of pytorch_ddp: the peer script's ranks, their numbers added to mode's samples.
void run_pytorch_mode(const DdpBenchArgs& args, const TempDir& dir, DdpMode& mode) {
  const std::string result = dir.file("pytorch");
  std::vector<std::string> command = mode.peer.python;
  command.insert(command.end(), {args.torch_script, "--model", args.model, "--steps",
                                 std::to_string(args.steps), "--warmup",
                                 std::to_string(args.warmup), "--batch",
                                 std::to_string(args.batch), "--world",
                                 std::to_string(args.world), "--result", result});
  for (auto& word : gpt_flags(args)) command.push_back(word);
  if (mode.bucket_view) command.push_back("--gradient-as-bucket-view");
  SHOAL_CHECK(run_processes({{command}}, run_options(mode)) == 0,
              "bench ddp: the PyTorch DDP run failed (", args.torch_script, ")");
  const Values values = read_json_numbers(result);
  for (const std::string field : {"samples_per_s", "peak_rss_mb", "pss_mb", "live_mb"}) {
    auto it = values.find(field);
    SHOAL_CHECK(it != values.end(), "bench ddp: ", args.torch_script, " wrote no ", field);
    mode.add(field, it->second);
  }
}

// What rank 0 of a Shoal mode reports besides the rates: its phases, and DDP's figures.
void add_rank0_samples(Values& r, DdpMode& mode) {
  for (const std::string field : {"forward_ms", "backward_ms", "optimizer_ms", "grad_mb"}) {
    mode.add(field, r[field]);
  }
  if (!mode.is_shoal()) return;
  for (const std::string field :
       {"wait_ms", "comm_ms", "floor_ms", "copy_ms", "copied_mb", "buckets", "sent_bytes",
        "bucket_cap_mb", "tuning_steps", "first_bucket_cap_mb", "layout", "inline_reduction"}) {
    mode.add(field, r[field]);
  }
  mode.add("overlap", std::clamp(1.0 - r["wait_ms"] / std::max(r["comm_ms"], 1e-9), 0.0, 1.0));
  mode.add("hidden_bytes_fraction", r["hidden_fraction"]);
}

// One run of a Shoal mode (single, independent, lockstep, shoal_ddp): its ranks, re-executing
// this program, and their numbers added to mode's samples.
void run_shoal_mode(const DdpBenchArgs& args, const TempDir& dir, int round, DdpMode& mode) {
  const int processes = mode.name == "single" ? 1 : args.world;
  const std::string worker = mode.is_shoal() ? "shoal" : mode.name == "lockstep" ? "lockstep" : "single";
  const std::string store =
      dir.file("store_" + std::to_string(round) + "_" + mode.name + "_" + mode.backend +
               (mode.bucket_view ? "_view" : "") + "_" + mode.hook + "_" +
               (mode.cap.empty() ? "default" : mode.cap) + "_" +
               (mode.first_cap.empty() ? "default" : mode.first_cap) + "_" +
               (mode.reduction.empty() ? "default" : mode.reduction));
  std::vector<ChildProcess> ranks;
  for (int rank = 0; rank < processes; ++rank) {
    auto command = worker_command(args, mode, worker);
    command.insert(command.end(), {"--rank", std::to_string(rank), "--store", store, "--result",
                                   dir.file("rank" + std::to_string(rank))});
    ranks.push_back({command});
  }
  SHOAL_CHECK(run_processes(ranks, run_options(mode)) == 0, "bench ddp: the ", mode.label(),
              " run failed");
  Values largest;  // over the ranks
  for (int rank = 0; rank < processes; ++rank) {
    auto r = read_values(dir.file("rank" + std::to_string(rank)));
    for (const std::string field : {"seconds", "peak_rss_mb", "pss_mb", "live_mb"}) {
      largest[field] = std::max(largest[field], r[field]);
    }
    if (rank == 0) add_rank0_samples(r, mode);
  }
  mode.add("samples_per_s", processes * args.batch * args.steps / largest["seconds"]);
  for (const std::string field : {"peak_rss_mb", "pss_mb", "live_mb"}) mode.add(field, largest[field]);
}

// --steps 0: about a second a run on this kind of machine, so that every model's runs are read at
// the same precision (a step of the MLP takes 7 ms, of the CNN and the transformer 50 ms; 20 steps
// of the MLP, 0.15 s, were at the mercy of one scheduling hiccup); more warm-up steps with more
// steps. --model gpt without --batch: 8 blocks per rank (a step of the default GPT about as long
// as the CNN's).
void choose_steps(DdpBenchArgs& args, bool batch_given) {
  if (args.model == "gpt" && !batch_given) args.batch = 8;
  if (args.steps != 0) return;
  args.steps = args.model == "mlp" ? 140 : 20;
  args.warmup = std::max(args.warmup, args.steps / 7);
}

void check_ddp_args(const DdpBenchArgs& args) {
  check_bench_model("bench ddp", args.model, {"gpt"});
  if (args.model == "gpt") args.gpt.validate();
  SHOAL_CHECK_T(InvalidArgument, args.ceiling == "interleaved" || args.ceiling == "once",
                "bench ddp: --ceiling takes interleaved or once, not '", args.ceiling, "'");
  SHOAL_CHECK_T(InvalidArgument, args.steps > 0 && args.rounds > 0 && args.batch > 0 && args.world >= 2,
                "bench ddp: --steps, --rounds and --batch must be positive and --world at least 2");
  for (const auto& backend : args.backends) {
    SHOAL_CHECK_T(InvalidArgument, comm::is_backend_available(backend), "bench ddp: backend '",
                  backend, "' is not built in (available: gloo, shm, and mpi where built)");
  }
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
}

// bucket_cap_mb=auto against each of its candidates fixed, in the same rounds. Auto's candidates:
// each cap with the usual first bucket, and with a first bucket of the same size. After the first
// round, those that gave the same buckets as an earlier one are dropped (drop_same_buckets).
void add_sweep_modes(const std::string& backend, std::vector<DdpMode>& modes) {
  for (const bool same_first : {false, true}) {
    for (double cap : DistributedDataParallelOptions().bucket_cap_candidates_mb) {
      std::ostringstream text;
      text << cap;
      DdpMode mode{"shoal_ddp", backend};
      mode.cap = text.str();
      mode.first_cap = same_first ? text.str() : "";
      modes.push_back(mode);
    }
  }
  DdpMode automatic{"shoal_ddp", backend};
  automatic.cap = "auto";
  modes.push_back(automatic);
}

// The contenders, in their order: single, independent (the ceiling), lockstep (the ceiling's
// processes meeting once a step, after backward, with no data: no synchronous data parallelism
// can do better here, since each step waits for the slower rank and the ranks run the same phases
// at the same time on the vCPUs' shared units), Shoal's DDP on each backend (plain and with bucket
// views; on the first backend each other hook, each other bucket reduction plain and with views,
// and the sweep), and each PyTorch peer's DDP (plain and with views).
std::vector<DdpMode> ddp_contenders(const DdpBenchArgs& args, const std::vector<TorchPeer>& peers) {
  std::vector<DdpMode> modes{{"single", ""}, {"independent", ""}, {"lockstep", "shm"}};
  for (const auto& backend : args.backends) {
    modes.push_back({"shoal_ddp", backend, false});
    modes.push_back({"shoal_ddp", backend, true});
    if (backend != args.backends.front()) continue;
    for (const auto& hook : args.comm_hooks) {
      if (hook == "allreduce") continue;
      modes.push_back({"shoal_ddp", backend, false});
      modes.back().hook = hook;
    }
    for (size_t r = 1; r < args.bucket_reductions.size(); ++r) {
      for (const bool view : {false, true}) {
        modes.push_back({"shoal_ddp", backend, view});
        modes.back().reduction = args.bucket_reductions[r];
      }
    }
    if (args.bucket_sweep) add_sweep_modes(backend, modes);
  }
  for (const auto& peer : peers) {
    for (const bool view : {false, true}) {
      modes.push_back({"pytorch_ddp", "gloo", view});
      modes.back().peer = peer;
    }
  }
  return modes;
}

// Fixed caps that gave the buckets of an earlier fixed cap measure the same thing twice.
void drop_same_buckets(std::vector<DdpMode>& modes) {
  std::vector<double> seen;
  std::vector<DdpMode> kept;
  for (auto& m : modes) {
    if (m.is_shoal() && !m.cap.empty() && m.cap != "auto") {
      const double layout = m.last("layout");
      if (std::find(seen.begin(), seen.end(), layout) != seen.end()) continue;
      seen.push_back(layout);
    }
    kept.push_back(std::move(m));
  }
  modes = std::move(kept);
}

// Each round runs `single`, then lockstep and the other contenders, each beside a run of the
// ceiling (`independent`). The ceiling (`independent`) is what the machine allows at this moment, and this machine's
// moment swings by 15 % within minutes: with --ceiling interleaved it runs before the first
// contender and after every contender, and each contender's of_ceil for a round is its rate over
// the mean of the ceiling runs just before and just after it (the median over rounds is reported,
// with the spread of the ceiling's own runs); with --ceiling once, once a round.
void run_ddp_rounds(const DdpBenchArgs& args, std::vector<DdpMode>& modes) {
  const TempDir dir("ddp");
  for (int round = 0; round < args.rounds; ++round) {
    auto run = [&](BenchMode& contender) {
      auto& mode = static_cast<DdpMode&>(contender);
      if (mode.name == "pytorch_ddp") {
        run_pytorch_mode(args, dir, mode);
      } else {
        run_shoal_mode(args, dir, round, mode);
      }
    };
    run(modes[0]);
    std::vector<BenchMode*> contenders;
    for (size_t i = 2; i < modes.size(); ++i) contenders.push_back(&modes[i]);
    BesideReference fields;
    fields.reference_rate = "ceiling";
    fields.between = args.ceiling == "interleaved";
    run_beside_reference(contenders, modes[1], round, run, fields);
    if (round == 0 && args.bucket_sweep) drop_same_buckets(modes);
  }
}

// What the report derives for one mode from its samples and the other modes'.
struct DdpFigures {
  double rate = NAN;
  double efficiency = NAN;  // samples/s over world x single's
  double of_ceiling = NAN, of_ceiling_min = NAN, of_ceiling_max = NAN;
  double of_lockstep = NAN;  // of_ceil over lockstep's, per round
  double vs_pytorch = NAN;   // against the first PyTorch peer
  std::string vs_pytorch_by_version;  // JSON: {"1.13.1": 1.31, "2.15.0": 1.12}
  // Where no core is spare: of_ceil with the mode's allreduces and copies (timed alone) added to
  // the ceiling's step; with the allreduces alone added to lockstep's; with the memory floor of
  // any allreduce of these gradients added to the ceiling's.
  double comm_added = NAN, lockstep_comm = NAN, floor_added = NAN;
  double ceiling_over = NAN;  // pytorch_ddp: the ceiling over it
  double extra_mb = NAN, extra_pss = NAN, extra_live = NAN;
};

// The report of a finished run: one JSON line or table row per mode, then notes.
class DdpReport {
 public:
  DdpReport(const DdpBenchArgs& args, const std::vector<DdpMode>& modes,
            const std::vector<TorchPeer>& peers)
      : args_(args), modes_(modes), peers_(peers), single_(modes[0]), independent_(modes[1]),
        lockstep_(modes[2]) {
    // The ceiling's and lockstep's step times (median rates).
    ceiling_step_ms_ = 1e3 * args.world * args.batch / independent_.get("samples_per_s");
    lockstep_step_ms_ = ceiling_step_ms_ / lockstep_.get("of_ceiling");
  }

  void print() const;

 private:
  DdpFigures figures(const DdpMode& mode) const;
  void add_comm_figures(const DdpMode& mode, DdpFigures& f) const;
  double vs_pytorch(const DdpMode& mode, const std::string& version) const;
  ReportLine json_line(const DdpMode& mode, const DdpFigures& f) const;
  std::string table_row(const DdpMode& mode, const DdpFigures& f) const;
  std::vector<std::string> comm_cost_lines(const DdpMode& mode, const DdpFigures& f) const;
  void print_header() const;
  void print_sweep() const;
  void print_ceilings() const;
  void print_legend() const;

  const DdpBenchArgs& args_;
  const std::vector<DdpMode>& modes_;
  const std::vector<TorchPeer>& peers_;
  const DdpMode& single_;
  const DdpMode& independent_;
  const DdpMode& lockstep_;
  double ceiling_step_ms_ = NAN;
  double lockstep_step_ms_ = NAN;
};

// vs_pt: a Shoal mode's samples/s over a PyTorch peer's with the same bucket views (the first
// --torch peer unless `version` names one): the median over the rounds of the two's ratio in
// each round (run within seconds of each other, so a minute of noise moves both), or the ratio
// of the medians where the two ran different rounds.
double DdpReport::vs_pytorch(const DdpMode& mode, const std::string& version) const {
  for (const auto& m : modes_) {
    if (m.name != "pytorch_ddp" || m.bucket_view != mode.bucket_view ||
        (!version.empty() && m.peer.version != version)) {
      continue;
    }
    const auto& a = mode.all("samples_per_s");
    const auto& b = m.all("samples_per_s");
    if (a.size() != b.size()) return mode.get("samples_per_s") / m.get("samples_per_s");
    return median_ratio(a, b);
  }
  return NAN;
}

// Where no core is spare (a rank per core, each busy with its own step), what of_ceil would be if
// the mode's bucket allreduces, timed alone in the same run (comm_ms), and the copies DDP made
// between gradients and buckets (copy_ms: plain gradients reduced overlapped or under a comm hook,
// in and out; where the optimizer's zero_grad() drops the gradients, autograd's new ones in) added
// their own time to the ceiling's step; and if the allreduces alone added to lockstep's step
// instead (the waiting any synchronous scheme has, then the exchange this one needs; the copies
// are this DDP's choice, not the exchange's). Estimates, not bounds: where the vCPUs share
// floating-point units, a rank that communicates (or waits) lets its sibling compute faster, and
// runs beat them. The floor: the memory work alone of any allreduce of these gradients, added to
// the ceiling's step, which no DDP goes under where no core is spare.
void DdpReport::add_comm_figures(const DdpMode& mode, DdpFigures& f) const {
  // of_ceil of a step `ms` longer than a step of `step_ms`.
  auto adding = [&](double step_ms, double ms) { return ceiling_step_ms_ / (step_ms + ms); };
  f.comm_added = adding(ceiling_step_ms_, mode.get("comm_ms") + mode.get("copy_ms"));
  f.lockstep_comm = adding(lockstep_step_ms_, mode.get("comm_ms"));
  f.floor_added = adding(ceiling_step_ms_, mode.get("floor_ms"));
}

DdpFigures DdpReport::figures(const DdpMode& mode) const {
  DdpFigures f;
  f.rate = mode.get("samples_per_s");
  const bool parallel = mode.name != "single";
  if (parallel) f.efficiency = f.rate / (args_.world * single_.get("samples_per_s"));
  const bool against_ceiling = mode.is_shoal() || mode.name == "pytorch_ddp" || mode.name == "lockstep";
  const auto& ratios = mode.all("of_ceiling");
  if (against_ceiling) f.of_ceiling = mode.get("of_ceiling");
  if (against_ceiling && !ratios.empty()) {
    f.of_ceiling_min = *std::min_element(ratios.begin(), ratios.end());
    f.of_ceiling_max = *std::max_element(ratios.begin(), ratios.end());
  }
  f.vs_pytorch_by_version = "{";
  for (const auto& peer : peers_) {
    const double v = mode.is_shoal() ? vs_pytorch(mode, peer.version) : NAN;
    f.vs_pytorch_by_version += (f.vs_pytorch_by_version.size() > 1 ? ", \"" : "\"") +
                               peer.version + "\": " + json_number(v);
  }
  f.vs_pytorch_by_version += "}";
  if (mode.is_shoal()) {
    f.of_lockstep = median_ratio(mode.all("of_ceiling"), lockstep_.all("of_ceiling"));
    f.vs_pytorch = vs_pytorch(mode, "");
    add_comm_figures(mode, f);
  }
  // How far above a PyTorch peer the no-communication ceiling is (its of_ceil inverted, per
  // round against the ceiling runs beside it): no DDP can beat that peer by more, here and now.
  if (mode.name == "pytorch_ddp") f.ceiling_over = 1.0 / f.of_ceiling;
  f.extra_mb = mode.get("peak_rss_mb") - single_.get("peak_rss_mb");
  // Against `independent`: the same number of processes sharing the same library pages.
  if (parallel) f.extra_pss = mode.get("pss_mb") - independent_.get("pss_mb");
  // Live memory of the largest rank against one process training alone.
  f.extra_live = mode.get("live_mb") - single_.get("live_mb");
  return f;
}

ReportLine DdpReport::json_line(const DdpMode& m, const DdpFigures& f) const {
  ReportLine line;
  line.add("mode", m.name).add("model", args_.model)
      .add_or_null("backend", !m.backend.empty(), m.backend)
      .add("world_size", m.name == "single" ? 1 : args_.world).add("batch_per_rank", args_.batch)
      .add_bool("gradient_as_bucket_view", m.bucket_view).add("samples_per_s", f.rate)
      .add("peak_rss_mb", m.get("peak_rss_mb")).add("extra_rss_mb", f.extra_mb)
      .add("pss_mb", m.get("pss_mb")).add("extra_pss_mb", f.extra_pss)
      .add("live_mb", m.get("live_mb")).add("extra_live_mb", f.extra_live)
      .add("grad_mb", single_.get("grad_mb")).add("efficiency", f.efficiency)
      .add("of_ceiling", f.of_ceiling).add("of_ceiling_min", f.of_ceiling_min)
      .add("of_ceiling_max", f.of_ceiling_max).add("of_lockstep", f.of_lockstep)
      .add("ceiling_runs", static_cast<int64_t>(independent_.all("samples_per_s").size()))
      .add("vs_pytorch", f.vs_pytorch).add_json("vs_pytorch_by_version", f.vs_pytorch_by_version)
      .add_or_null("torch", !m.peer.version.empty(), m.peer.version)
      .add("forward_ms", m.get("forward_ms")).add("backward_ms", m.get("backward_ms"))
      .add("optimizer_ms", m.get("optimizer_ms")).add("wait_ms", m.get("wait_ms"))
      .add("overlap", m.get("overlap")).add("hidden_bytes_fraction", m.get("hidden_bytes_fraction"))
      .add("buckets", m.get("buckets")).add_or_null("comm_hook", m.is_shoal(), m.hook)
      .add("sent_bytes_per_step", m.get("sent_bytes")).add("bucket_cap_mb", m.get("bucket_cap_mb"))
      .add_or_null("bucket_cap", m.is_shoal(), m.cap.empty() ? args_.bucket_cap_mb : m.cap)
      .add("comm_ms", m.get("comm_ms")).add("copy_ms", m.get("copy_ms"))
      .add("copied_mb_per_step", m.get("copied_mb")).add("floor_ms", m.get("floor_ms"))
      .add("floor_of_ceiling", f.floor_added).add("comm_added_of_ceiling", f.comm_added)
      .add("lockstep_comm_of_ceiling", f.lockstep_comm).add("ceiling_over_this", f.ceiling_over)
      .add_or_null("bucket_reduction", m.is_shoal(),
                   m.reduction.empty() ? args_.bucket_reductions.at(0) : m.reduction)
      .add("inline_reduction", m.get("inline_reduction")).add("rounds", args_.rounds);
  return line;
}

std::string DdpReport::table_row(const DdpMode& mode, const DdpFigures& f) const {
  return text_format(
      "%-32s %10.1f %8.1f %8s %7s %7s %7s %7s %7s %7s %7s %7s %7s %9s\n", mode.label().c_str(),
      f.rate, mode.get("peak_rss_mb"), cell(f.extra_mb, "%+.1f").c_str(),
      cell(f.extra_live, "%+.1f").c_str(), cell(f.efficiency, "%.2f").c_str(),
      cell(f.of_ceiling, "%.2f").c_str(), cell(f.vs_pytorch, "%.2f").c_str(),
      cell(mode.get("forward_ms"), "%.2f").c_str(), cell(mode.get("backward_ms"), "%.2f").c_str(),
      cell(mode.get("optimizer_ms"), "%.2f").c_str(), cell(mode.get("wait_ms"), "%.2f").c_str(),
      cell(mode.get("hidden_bytes_fraction"), "%.2f").c_str(),
      cell(mode.get("sent_bytes") / 1024, "%.1f").c_str());
}

// A Shoal mode's communication costs as of_ceil (add_comm_figures), for the notes.
std::vector<std::string> DdpReport::comm_cost_lines(const DdpMode& mode, const DdpFigures& f) const {
  if (!mode.is_shoal() || !std::isfinite(f.comm_added)) return {};
  std::string copies;
  if (mode.get("copied_mb") > 0) {
    copies = text_format(" + its copies between gradients and buckets (%.1f MB a step) %.2f ms",
                         mode.get("copied_mb"), mode.get("copy_ms"));
  } else if (!mode.bucket_view) {
    copies = " (plain gradients in the buckets: none copied)";
  }
  std::vector<std::string> lines{text_format(
      "  %s: its bucket allreduces alone %.2f ms a step%s, the ceiling's step %.2f ms: of_ceil "
      "%.3f if added; the allreduces added to lockstep's step (%.2f ms): of_ceil %.3f\n",
      mode.label().c_str(), mode.get("comm_ms"), copies.c_str(), ceiling_step_ms_, f.comm_added,
      lockstep_step_ms_, f.lockstep_comm)};
  if (std::isfinite(f.floor_added)) {
    lines.push_back(text_format(
        "  %s: the memory work alone of any allreduce of its gradients (each rank reading and "
        "writing every byte of its buckets once, both at once, timed here) %.2f ms a step: "
        "of_ceil %.3f if added (no allreduce moves less)\n",
        mode.label().c_str(), mode.get("floor_ms"), f.floor_added));
  }
  return lines;
}

void DdpReport::print_header() const {
  std::string sizes;
  if (args_.model == "gpt") {
    const models::GptConfig& g = args_.gpt;
    sizes = text_format(" (%lld layers, %lld heads, n_embd %lld, blocks of %lld tokens, vocab %lld)",
                        static_cast<long long>(g.n_layer), static_cast<long long>(g.n_head),
                        static_cast<long long>(g.n_embd), static_cast<long long>(g.block_size),
                        static_cast<long long>(g.vocab_size));
  }
  std::printf("bench ddp: model %s%s, %d ranks x batch %d, %d steps, median of %d rounds\n",
              args_.model.c_str(), sizes.c_str(), args_.world, args_.batch, args_.steps,
              args_.rounds);
  std::printf("%-32s %10s %8s %8s %7s %7s %7s %7s %7s %7s %7s %7s %7s %9s\n", "mode", "samples/s",
              "peak MB", "+MB", "+live", "effic.", "of_ceil", "vs_pt", "fwd ms", "bwd ms", "opt ms",
              "wait ms", "hidden", "sent_kb");
}

// auto against the best fixed cap of the sweep (first backend). Both through their of_ceil, each
// taken against the ceiling runs beside it, so that the machine's drift between the two runs
// cancels: best = the highest median of_ceil; auto_of_best = the median over the rounds of auto's
// of_ceil / best's.
void DdpReport::print_sweep() const {
  const DdpMode* best = nullptr;
  const DdpMode* automatic = nullptr;
  for (const auto& m : modes_) {
    if (!m.is_shoal() || m.cap.empty() || m.backend != args_.backends.front()) continue;
    if (m.cap == "auto") {
      automatic = &m;
    } else if (!best || m.get("of_ceiling") > best->get("of_ceiling")) {
      best = &m;
    }
  }
  if (!best || !automatic) return;
  std::string chosen;
  const auto& caps = automatic->all("bucket_cap_mb");
  const auto& firsts = automatic->all("first_bucket_cap_mb");
  for (size_t k = 0; k < caps.size(); ++k) {
    std::ostringstream text;
    text << (args_.json ? "\"" : "") << firsts[k] << "/" << caps[k] << (args_.json ? "\"" : "");
    chosen += (chosen.empty() ? "" : ",") + text.str();
  }
  const double ratio = median_ratio(automatic->all("of_ceiling"), best->all("of_ceiling"));
  if (args_.json) {
    ReportLine()
        .add_bool("bucket_sweep", true).add("model", args_.model)
        .add("best_fixed_cap_mb", best->cap)
        .add("best_fixed_first_cap_mb", best->first_cap.empty() ? "default" : best->first_cap)
        .add("best_fixed_samples_per_s", best->get("samples_per_s"))
        .add("auto_samples_per_s", automatic->get("samples_per_s")).add("auto_of_best", ratio)
        .add_json("auto_chose_mb", "[" + chosen + "]")
        .add("auto_tuning_steps", automatic->get("tuning_steps"))
        .print();
    return;
  }
  std::printf("bucket sweep: best fixed bucket_cap_mb %s%s (%.1f samples/s); auto %.1f samples/s; "
              "auto / best = %.3f (of_ceil over of_ceil, median of the rounds); auto chose %s MiB "
              "(first/other bucket cap, one per round) in %.0f untimed tuning steps\n",
              best->cap.c_str(),
              best->first_cap.empty() ? "" : (" (first " + best->first_cap + ")").c_str(),
              best->get("samples_per_s"), automatic->get("samples_per_s"), ratio, chosen.c_str(),
              automatic->get("tuning_steps"));
}

// The ceiling's runs and lockstep's of_ceil, with their spread over the rounds.
void DdpReport::print_ceilings() const {
  const auto& ceilings = independent_.all("samples_per_s");
  const double ceiling = median(ceilings);
  const auto [low, high] = std::minmax_element(ceilings.begin(), ceilings.end());
  std::printf("ceiling (independent, %zu runs %s): median %.1f samples/s, range %.1f-%.1f "
              "(%+.1f%% / %+.1f%% of the median)\n",
              ceilings.size(),
              args_.ceiling == "interleaved" ? "interleaved with the contenders" : "once a round",
              ceiling, *low, *high, 100 * (*low / ceiling - 1), 100 * (*high / ceiling - 1));
  const auto& locked = lockstep_.all("of_ceiling");
  const auto [locked_low, locked_high] = std::minmax_element(locked.begin(), locked.end());
  std::printf("lockstep (the ceiling's processes meeting at a barrier after every backward, no "
              "data: the most any synchronous data parallelism reaches here): of_ceil %.2f "
              "(rounds %.2f-%.2f)\n",
              lockstep_.get("of_ceiling"), *locked_low, *locked_high);
}

void DdpReport::print_legend() const {
  std::printf("efficiency = samples/s / (%d x single); of_ceil = samples/s / independent (%d "
              "processes without communication; per round, against the ceiling runs beside "
              "it, median of the rounds); vs_pt = Shoal / PyTorch DDP (the first --torch peer) with the same "
              "gradient_as_bucket_view (per round, median of the rounds); +MB = peak RSS - single's (shared memory counted in full by every "
              "rank); +live = live memory - single's (heap in use at the end of forward and of "
              "backward, the larger, plus the rank's share of shared memory; JSON also has PSS); "
              "MB = MiB; sent_kb = KiB rank 0 passed to its collectives per step; gradients: %.1f "
              "MB\n",
              args_.world, args_.world, single_.get("grad_mb"));
}

void DdpReport::print() const {
  if (!args_.json) print_header();
  std::vector<std::string> comm_costs;      // one line or two per shoal_ddp mode
  std::vector<std::string> peer_ceilings;   // one line per pytorch_ddp mode
  std::vector<std::string> lockstep_shares;  // one line per shoal_ddp mode
  for (const auto& mode : modes_) {
    const DdpFigures f = figures(mode);
    if (std::isfinite(f.of_lockstep)) {
      lockstep_shares.push_back(
          text_format("  %s: %.2f of lockstep's rate\n", mode.label().c_str(), f.of_lockstep));
    }
    for (auto& line : comm_cost_lines(mode, f)) comm_costs.push_back(line);
    if (std::isfinite(f.ceiling_over)) {
      peer_ceilings.push_back(text_format(
          "  %s: the ceiling is %.2fx it, so Shoal's DDP at 1.5x it would need of_ceil >= %.2f\n",
          mode.label().c_str(), f.ceiling_over, 1.5 / f.ceiling_over));
    }
    if (args_.json) {
      json_line(mode, f).print();
    } else {
      std::fputs(table_row(mode, f).c_str(), stdout);
    }
  }
  if (args_.bucket_sweep) print_sweep();
  if (args_.json) return;
  print_ceilings();
  for (const std::string& line : lockstep_shares) std::fputs(line.c_str(), stdout);
  const int cores = launcher::available_cores();
  if (!comm_costs.empty() && args_.world >= cores) {  // no core spare
    std::printf("communication's own time (%d ranks on %d cores, none spare; what of_ceil would "
                "be if it added to the ceiling's step: an estimate, not a bound, since a rank "
                "that communicates lets a vCPU sharing its core compute faster):\n",
                args_.world, cores);
    for (const std::string& line : comm_costs) std::fputs(line.c_str(), stdout);
  }
  if (!peer_ceilings.empty()) {
    std::printf("the ceiling over each PyTorch peer (the most any DDP can beat it by here):\n");
    for (const std::string& line : peer_ceilings) std::fputs(line.c_str(), stdout);
  }
  print_legend();
}

int run_ddp_bench(const DdpBenchArgs& args) {
  check_ddp_args(args);
  std::vector<TorchPeer> peers;
  for (const auto& name : args.torch_peers) {
    TorchPeer peer = find_torch_peer(name, "bench ddp");
    if (peer.available()) peers.push_back(peer);
  }
  std::vector<DdpMode> modes = ddp_contenders(args, peers);
  run_ddp_rounds(args, modes);
  DdpReport(args, modes, peers).print();
  return 0;
}

}  // namespace

void add_bench_ddp_command(CLI::App& bench, std::vector<Command>& commands) {
  auto args = std::make_shared<DdpBenchArgs>();
  auto* app = bench.add_subcommand(
      "ddp", "DDP throughput: one process vs Shoal DDP vs PyTorch's Python DDP, side by side");
  add_step_options(*app, *args);
  app->get_option("--model")->description("a built-in model: cnn, mlp, transformer or gpt");
  app->get_option("--steps")->description(
      "timed steps per run; 0: about a second a run here (140 for mlp, 20 for cnn, transformer "
      "and gpt, with at least a seventh as many warm-up steps)");
  app->add_option("--backend", args->backends,
                  "process group backends for Shoal's DDP, each measured (e.g. shm,gloo)")
      ->delimiter(',')
      ->capture_default_str();
  auto* batch = app->add_option("--batch-size,--batch", args->batch,
                                "batch per rank (--model gpt: 8 blocks unless given)")
                    ->capture_default_str();
  app->add_option("--nproc-per-node,--world", args->world, "ranks of the DDP runs")->capture_default_str();
  add_gpt_size_options(*app, args->gpt);  // as shoal train --model gpt
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
  commands.push_back({app, [args, batch] {
                        if (!args->worker.empty()) return run_worker(*args);
                        choose_steps(*args, batch->count() > 0);
                        return run_ddp_bench(*args);
                      }});
}

}  // namespace shoal::cli
