// comm_latency: allreduce latency of one backend with and without the collective checks
// (ProcessGroup::check_collectives), measured side by side: rounds of A B A B, medians.
//
//   comm_latency --backend gloo --np 2 [--bytes 4096] [--iters 2000] [--json]   (forks the ranks)
//   mpirun -np 2 comm_latency --backend mpi [--bytes 4096] [--json]
//
// A measuring tool, not a test: it prints, on rank 0, the median latency of each variant and
// their ratio.
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>

#include "shoal/comm/init.h"
#include "testing/multi_rank.h"

namespace {

using shoal::comm::Milliseconds;
using shoal::comm::ProcessGroup;

struct Settings {
  std::string backend = "gloo";
  int np = 2;
  int64_t bytes = 4096;
  int iters = 2000;
  int rounds = 7;
  bool json = false;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Mean microseconds per allreduce over `iters` iterations.
double time_allreduce(ProcessGroup& pg, at::Tensor& t, int iters) {
  pg.barrier()->wait();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) pg.allreduce(t)->wait();
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
             .count() /
         iters;
}

void measure(ProcessGroup& pg, const Settings& s) {
  auto t = torch::ones({s.bytes / 4});
  pg.set_check_collectives(false);
  time_allreduce(pg, t, s.iters / 10);  // warm-up
  std::vector<double> checked, unchecked;
  for (int round = 0; round < s.rounds; ++round) {
    pg.set_check_collectives(false);
    unchecked.push_back(time_allreduce(pg, t, s.iters));
    pg.set_check_collectives(true);
    checked.push_back(time_allreduce(pg, t, s.iters));
  }
  if (pg.rank() != 0) return;
  const double a = median(unchecked), b = median(checked);
  if (s.json) {
    std::printf("{\"bench\":\"allreduce_latency\",\"backend\":\"%s\",\"ranks\":%d,\"bytes\":%lld,"
                "\"unchecked_us\":%.2f,\"checked_us\":%.2f,\"ratio\":%.3f}\n",
                pg.backend_name().c_str(), pg.size(), static_cast<long long>(s.bytes), a, b,
                b / a);
  } else {
    std::printf("%s, %d ranks, %lld B allreduce: %.1f us without checks, %.1f us with "
                "(x%.2f), medians of %d rounds of %d\n",
                pg.backend_name().c_str(), pg.size(), static_cast<long long>(s.bytes), a, b,
                b / a, s.rounds, s.iters);
  }
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  CLI::App app{"allreduce latency with and without collective checks"};
  app.add_option("--backend", s.backend, "gloo (forks --np ranks) or mpi (run under mpirun)");
  app.add_option("--np", s.np, "ranks to fork (gloo)");
  app.add_option("--bytes", s.bytes, "tensor size in bytes");
  app.add_option("--iters", s.iters, "allreduces per timed run");
  app.add_option("--rounds", s.rounds, "A B rounds");
  app.add_flag("--json", s.json, "one JSON object per line");
  CLI11_PARSE(app, argc, argv);
  torch::set_num_threads(1);
  if (s.backend == "mpi") {
    shoal::comm::InitOptions options;
    options.backend = "mpi";
    auto pg = shoal::comm::init_process_group(options);
    measure(*pg, s);
    return 0;
  }
  auto results = shoal::testing::run_processes(
      s.np,
      [&](int rank, const std::string& path) {
        torch::set_num_threads(1);
        auto store = shoal::comm::make_file_store(path, s.np);
        auto pg = shoal::comm::new_process_group(s.backend, store, rank, s.np);
        measure(*pg, s);
      },
      Milliseconds(600'000));
  for (const auto& r : results) {
    if (!r.ok()) std::fprintf(stderr, "rank %d failed: %s\n", r.rank, r.error.c_str());
  }
  return 0;
}
