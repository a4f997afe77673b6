// `shoal bench ddp`: training throughput of one process without DDP, Shoal's DDP and PyTorch's
// Python DDP on the same model, batch and thread count, measured side by side.
//
// Each round runs, in this order, a fresh process for every mode: single, shoal_ddp,
// shoal_ddp with gradient_as_bucket_view, pytorch_ddp; the report gives each mode's median over
// the rounds (this machine is shared and noisy: interleaving spreads the noise over every mode).
// Ranks are this program re-executed with hidden --worker options; every process uses one thread.
// Also reported: peak RSS of each mode (largest rank), and how much communication backward hid:
// `overlap` = 1 - time waiting for buckets at the end of backward / time the same bucket
// reductions take on their own (includes waiting for a slower peer, so a loaded machine drives it
// to 0), and `hidden_bytes_fraction` = share of the bucket bytes whose reduction had already
// completed when backward ended (insensitive to peer skew).
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "commands.h"
#include "shoal/models/registry.h"
#include "shoal/comm/init.h"
#include "shoal/error.h"
#include "shoal/parallel/distributed_data_parallel.h"

#ifndef SHOAL_SOURCE_DIR
#define SHOAL_SOURCE_DIR "."
#endif

namespace shoal::cli {
namespace {

using Clock = std::chrono::steady_clock;

// How long one mode of one round may take before its processes are killed: far above a normal
// run (seconds), so only a hang hits it.
constexpr std::chrono::seconds kModeDeadline{600};

struct BenchArgs {
  std::string model = "cnn";
  std::string backend = "shm";
  int steps = 20;
  int warmup = 3;
  int rounds = 3;
  int batch = 64;
  int world = 2;
  bool json = false;
  std::string torch_script = std::string(SHOAL_SOURCE_DIR) + "/bench/ddp_torch.py";
  // Hidden: what a re-executed worker is.
  std::string worker;
  int rank = 0;
  std::string store;
  std::string result;
  bool bucket_view = false;
};

double peak_rss_mb() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss / 1024.0;  // Linux reports kilobytes
}

void write_result(const std::string& path, const std::map<std::string, double>& values) {
  std::ofstream out(path);
  for (const auto& [key, value] : values) out << key << " " << value << "\n";
  SHOAL_CHECK(out.good(), "bench ddp: cannot write ", path);
}

std::map<std::string, double> read_result(const std::string& path) {
  std::map<std::string, double> values;
  std::ifstream in(path);
  std::string key;
  double value;
  while (in >> key >> value) values[key] = value;
  return values;
}

void run_worker_with(const BenchArgs& args) {
  torch::set_num_threads(1);
  torch::manual_seed(0);
  // The registry's models (the ones `shoal train` trains), so bench and trainer measure one thing.
  std::shared_ptr<models::Model> model = models::create(args.model, 0);
  auto x = torch::randn({args.batch, 1, 28, 28});
  auto y = torch::randint(0, 10, {args.batch}, torch::kLong);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  std::map<std::string, double> result;

  if (args.worker == "single") {
    auto step = [&] {
      optimizer.zero_grad();
      torch::cross_entropy_loss(model->forward(x), y).backward();
      optimizer.step();
    };
    for (int i = 0; i < args.warmup; ++i) step();
    const auto start = Clock::now();
    for (int i = 0; i < args.steps; ++i) step();
    result["seconds"] = std::chrono::duration<double>(Clock::now() - start).count();
  } else {
    auto store = comm::make_file_store(args.store, args.world);
    auto group = comm::new_process_group(args.backend, store, args.rank, args.world);
    DistributedDataParallelOptions options;
    options.gradient_as_bucket_view = args.bucket_view;
    DistributedDataParallel<models::Model> ddp(model, group, options);
    auto step = [&] {
      optimizer.zero_grad();
      torch::cross_entropy_loss(ddp.forward(x), y).backward();
      optimizer.step();
    };
    for (int i = 0; i < args.warmup; ++i) step();
    group->barrier()->wait();
    const auto before = ddp.stats();
    const auto start = Clock::now();
    for (int i = 0; i < args.steps; ++i) step();
    group->barrier()->wait();
    result["seconds"] = std::chrono::duration<double>(Clock::now() - start).count();
    const auto after = ddp.stats();
    result["wait_per_step"] = (after.wait_seconds - before.wait_seconds) / args.steps;
    result["hidden_fraction"] = (after.hidden_bytes - before.hidden_bytes) /
                                std::max(after.reduced_bytes - before.reduced_bytes, 1.0);
    // The same bucket reductions on their own, launched back to back as backward launches them.
    std::vector<torch::Tensor> buckets;
    for (int64_t bytes : after.bucket_bytes) buckets.push_back(torch::zeros({bytes / 4}));
    constexpr int kCommRepeats = 5;
    group->barrier()->wait();
    const auto comm_start = Clock::now();
    for (int r = 0; r < kCommRepeats; ++r) {
      std::vector<std::shared_ptr<comm::Work>> works;
      for (auto& b : buckets) works.push_back(group->allreduce(b));
      for (auto& w : works) w->wait();
    }
    result["comm_per_step"] =
        std::chrono::duration<double>(Clock::now() - comm_start).count() / kCommRepeats;
    result["buckets"] = static_cast<double>(buckets.size());
  }
  result["peak_rss_mb"] = peak_rss_mb();
  write_result(args.result, result);
}

int run_worker(const BenchArgs& args) {
  run_worker_with(args);
  return 0;
}

std::string self_exe() {
  char path[4096];
  const ssize_t n = readlink("/proc/self/exe", path, sizeof path - 1);
  SHOAL_CHECK(n > 0, "bench ddp: cannot find this program's path (/proc/self/exe)");
  path[n] = '\0';
  return path;
}

// Starts every command line, waits for all (killing them all past the deadline); true if all
// exited 0.
bool run_all(const std::vector<std::vector<std::string>>& commands) {
  std::vector<pid_t> pids;
  for (const auto& command : commands) {
    const pid_t pid = fork();
    SHOAL_CHECK(pid >= 0, "bench ddp: fork failed");
    if (pid == 0) {
      std::vector<char*> argv;
      for (const auto& a : command) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      std::perror(argv[0]);
      _exit(127);
    }
    pids.push_back(pid);
  }
  const auto deadline = Clock::now() + kModeDeadline;
  bool ok = true;
  size_t remaining = pids.size();
  std::vector<bool> done(pids.size(), false);
  while (remaining > 0) {
    for (size_t i = 0; i < pids.size(); ++i) {
      if (done[i]) continue;
      int status = 0;
      if (waitpid(pids[i], &status, WNOHANG) == pids[i]) {
        done[i] = true;
        --remaining;
        ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
      }
    }
    if (remaining > 0 && Clock::now() > deadline) {
      for (size_t i = 0; i < pids.size(); ++i) {
        if (!done[i]) kill(pids[i], SIGKILL);
        if (!done[i]) waitpid(pids[i], nullptr, 0);
      }
      return false;
    }
    if (remaining > 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return ok;
}

double median(std::vector<double> v) {
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

struct ModeSamples {
  std::vector<double> samples_per_s, peak_rss_mb, overlap, hidden;
};

std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  std::ostringstream out;
  out << v;
  return out.str();
}

int run_bench(const BenchArgs& args) {
  SHOAL_CHECK_T(InvalidArgument, args.model == "cnn" || args.model == "mlp",
                "bench ddp: --model must be cnn or mlp, not '", args.model, "'");
  SHOAL_CHECK_T(InvalidArgument, comm::is_backend_available(args.backend), "bench ddp: backend '",
                args.backend, "' is not built in");
  const std::string exe = self_exe();
  const std::string dir = "/tmp/shoal_bench_ddp_" + std::to_string(getpid());
  SHOAL_CHECK(std::system(("mkdir -p " + dir).c_str()) == 0, "bench ddp: cannot create ", dir);
  const bool have_torch =
      std::system("/usr/bin/python3 -c 'import torch.distributed as d; assert d.is_gloo_available()'"
                  " >/dev/null 2>&1") == 0;
  if (!have_torch) std::fprintf(stderr, "bench ddp: /usr/bin/python3 has no torch; pytorch_ddp skipped\n");

  auto common = [&](const std::string& worker) {
    return std::vector<std::string>{exe, "bench", "ddp", "--model", args.model, "--backend",
                                    args.backend, "--steps", std::to_string(args.steps),
                                    "--warmup", std::to_string(args.warmup), "--batch",
                                    std::to_string(args.batch), "--world",
                                    std::to_string(args.world), "--worker", worker};
  };
  std::map<std::string, ModeSamples> samples;
  for (int round = 0; round < args.rounds; ++round) {
    {  // single
      const std::string result = dir + "/single";
      auto command = common("single");
      command.insert(command.end(), {"--result", result});
      SHOAL_CHECK(run_all({command}), "bench ddp: the single-process run failed");
      auto r = read_result(result);
      samples["single"].samples_per_s.push_back(args.batch * args.steps / r["seconds"]);
      samples["single"].peak_rss_mb.push_back(r["peak_rss_mb"]);
    }
    for (bool view : {false, true}) {
      const std::string key = view ? "shoal_ddp_view" : "shoal_ddp";
      const std::string store = dir + "/store_" + std::to_string(round) + (view ? "v" : "");
      std::vector<std::vector<std::string>> commands;
      for (int rank = 0; rank < args.world; ++rank) {
        auto command = common("shoal");
        command.insert(command.end(), {"--rank", std::to_string(rank), "--store", store, "--result",
                                       dir + "/shoal" + std::to_string(rank)});
        if (view) command.push_back("--gradient-as-bucket-view");
        commands.push_back(command);
      }
      SHOAL_CHECK(run_all(commands), "bench ddp: the Shoal DDP run failed");
      double seconds = 0, rss = 0, overlap = 0, hidden = 0;
      for (int rank = 0; rank < args.world; ++rank) {
        auto r = read_result(dir + "/shoal" + std::to_string(rank));
        seconds = std::max(seconds, r["seconds"]);
        rss = std::max(rss, r["peak_rss_mb"]);
        if (rank == 0) {
          overlap = std::clamp(1.0 - r["wait_per_step"] / std::max(r["comm_per_step"], 1e-9), 0.0, 1.0);
          hidden = r["hidden_fraction"];
        }
      }
      samples[key].samples_per_s.push_back(args.world * args.batch * args.steps / seconds);
      samples[key].peak_rss_mb.push_back(rss);
      samples[key].overlap.push_back(overlap);
      samples[key].hidden.push_back(hidden);
    }
    if (have_torch) {
      const std::string result = dir + "/pytorch";
      std::vector<std::string> command{"/usr/bin/python3", args.torch_script, "--model", args.model,
                                       "--steps", std::to_string(args.steps), "--warmup",
                                       std::to_string(args.warmup), "--batch",
                                       std::to_string(args.batch), "--world",
                                       std::to_string(args.world), "--result", result};
      SHOAL_CHECK(run_all({command}), "bench ddp: the PyTorch DDP run failed (", args.torch_script, ")");
      std::ifstream in(result);
      std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      auto field = [&](const std::string& name) {
        auto at = text.find("\"" + name + "\":");
        return at == std::string::npos ? std::nan("") : std::stod(text.substr(at + name.size() + 3));
      };
      samples["pytorch_ddp"].samples_per_s.push_back(field("samples_per_s"));
      samples["pytorch_ddp"].peak_rss_mb.push_back(field("peak_rss_mb"));
    }
  }
  std::system(("rm -rf " + dir).c_str());

  const double single = median(samples["single"].samples_per_s);
  const double pytorch = have_torch ? median(samples["pytorch_ddp"].samples_per_s) : std::nan("");
  if (!args.json) {
    std::printf("bench ddp: model %s, backend %s, %d ranks x batch %d, %d steps, median of %d rounds\n",
                args.model.c_str(), args.backend.c_str(), args.world, args.batch, args.steps,
                args.rounds);
    std::printf("%-16s %12s %10s %11s %11s %8s %8s\n", "mode", "samples/s", "peak MB",
                "efficiency", "vs_pytorch", "overlap", "hidden");
  }
  for (const std::string mode : {"single", "shoal_ddp", "shoal_ddp_view", "pytorch_ddp"}) {
    if (samples.count(mode) == 0) continue;
    const auto& s = samples[mode];
    const double rate = median(s.samples_per_s);
    const bool ddp = mode != "single";
    const double efficiency = ddp ? rate / (args.world * single) : std::nan("");
    const double vs = (mode == "shoal_ddp" || mode == "shoal_ddp_view") ? rate / pytorch : std::nan("");
    const double overlap = s.overlap.empty() ? std::nan("") : median(s.overlap);
    const double hidden = s.hidden.empty() ? std::nan("") : median(s.hidden);
    const std::string json_mode = mode == "shoal_ddp_view" ? "shoal_ddp" : mode;
    if (args.json) {
      std::printf(
          "{\"mode\": \"%s\", \"model\": \"%s\", \"backend\": \"%s\", \"world_size\": %d, "
          "\"batch_per_rank\": %d, \"gradient_as_bucket_view\": %s, \"samples_per_s\": %s, "
          "\"peak_rss_mb\": %s, \"efficiency\": %s, \"vs_pytorch\": %s, \"overlap\": %s, "
          "\"hidden_bytes_fraction\": %s, \"rounds\": %d}\n",
          json_mode.c_str(), args.model.c_str(), mode == "pytorch_ddp" ? "gloo" : args.backend.c_str(),
          ddp ? args.world : 1, args.batch, mode == "shoal_ddp_view" ? "true" : "false",
          json_number(rate).c_str(), json_number(median(s.peak_rss_mb)).c_str(),
          json_number(efficiency).c_str(), json_number(vs).c_str(), json_number(overlap).c_str(),
          json_number(hidden).c_str(), args.rounds);
    } else {
      std::printf("%-16s %12.1f %10.1f %11s %11s %8s %8s\n", mode.c_str(), rate,
                  median(s.peak_rss_mb), json_number(efficiency).c_str(), json_number(vs).c_str(),
                  json_number(overlap).c_str(), json_number(hidden).c_str());
    }
  }
  return 0;
}

}  // namespace

void add_bench_ddp_command(CLI::App& bench, std::vector<Command>& commands) {
  auto args = std::make_shared<BenchArgs>();
  auto* app = bench.add_subcommand(
      "ddp", "DDP throughput: one process vs Shoal DDP vs PyTorch's Python DDP, side by side");
  app->add_option("--model", args->model, "cnn or mlp")->capture_default_str();
  app->add_option("--backend", args->backend, "process group backend for Shoal's DDP (gloo, shm)")
      ->capture_default_str();
  app->add_option("--steps", args->steps, "timed steps per run")->capture_default_str();
  app->add_option("--warmup", args->warmup, "untimed steps first")->capture_default_str();
  app->add_option("--rounds", args->rounds, "interleaved rounds (medians are reported)")
      ->capture_default_str();
  app->add_option("--batch", args->batch, "batch per rank")->capture_default_str();
  app->add_option("--world", args->world, "ranks of the DDP runs")->capture_default_str();
  app->add_flag("--json", args->json, "one JSON object per line");
  app->add_option("--torch-script", args->torch_script, "PyTorch peer script")->capture_default_str();
  // Hidden options of re-executed workers.
  app->add_option("--worker", args->worker)->group("");
  app->add_option("--rank", args->rank)->group("");
  app->add_option("--store", args->store)->group("");
  app->add_option("--result", args->result)->group("");
  app->add_flag("--gradient-as-bucket-view", args->bucket_view)->group("");
  commands.push_back({app, [args] { return args->worker.empty() ? run_bench(*args) : run_worker(*args); }});
}

}  // namespace shoal::cli
