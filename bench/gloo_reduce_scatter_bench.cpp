// Gloo's reduce_scatter_tensor two ways, interleaved (A B A B) in one run on forked processes:
// A, the allreduce of every block Shoal used to run (SHOAL_GLOO_REDUCE_SCATTER=allreduce), and
// B, the ring of point-to-point sends (the default). Prints, per input size, the median over
// rounds of rank 0's milliseconds per call (a loop of back-to-back reduce_scatter_tensor()->wait()
// of about 0.2 s), and B's speed-up (docs/PERFORMANCE.md).
//
//   gloo_reduce_scatter_bench [--ranks 2] [--rounds 5] [--sizes 1048576,16777216]
#include <sys/wait.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "shoal/comm/init.h"
#include "shoal/comm/store.h"

namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void run_rank(int rank, int ranks, int rounds, const std::vector<int64_t>& sizes,
              const std::string& store_path, int out_fd) {
  const shoal::comm::Milliseconds timeout(60'000);
  auto store = shoal::comm::make_file_store(store_path, ranks, timeout);
  // The variant is read when a group is built: one group of each.
  ::setenv("SHOAL_GLOO_REDUCE_SCATTER", "allreduce", 1);
  auto old_way = shoal::comm::new_process_group("gloo", shoal::comm::make_prefix_store("a", store), rank,
                                                ranks, timeout);
  ::setenv("SHOAL_GLOO_REDUCE_SCATTER", "ring", 1);
  auto ring = shoal::comm::new_process_group("gloo", shoal::comm::make_prefix_store("b", store), rank,
                                             ranks, timeout);
  std::vector<std::vector<double>> ms(sizes.size() * 2);
  for (int round = 0; round < rounds; ++round) {
    for (size_t s = 0; s < sizes.size(); ++s) {
      const int64_t numel = sizes[s] / 4 / ranks * ranks;
      at::Tensor input = at::rand({numel});
      at::Tensor output = at::empty({numel / ranks});
      for (int variant = 0; variant < 2; ++variant) {
        auto& pg = variant == 0 ? old_way : ring;
        pg->barrier()->wait();
        pg->reduce_scatter_tensor(output, input)->wait();  // warm-up
        // Rank 0 decides the count so that every rank runs the same loop.
        at::Tensor count = at::zeros({1}, at::kLong);
        if (rank == 0) {
          const auto t = Clock::now();
          pg->reduce_scatter_tensor(output, input)->wait();
          const double one = std::chrono::duration<double>(Clock::now() - t).count();
          count[0] = std::max<int64_t>(3, static_cast<int64_t>(0.2 / std::max(one, 1e-6)));
        } else {
          pg->reduce_scatter_tensor(output, input)->wait();
        }
        pg->broadcast(count)->wait();
        pg->barrier()->wait();
        const int64_t n = count[0].item<int64_t>();
        const auto t = Clock::now();
        for (int64_t i = 0; i < n; ++i) pg->reduce_scatter_tensor(output, input)->wait();
        ms[s * 2 + variant].push_back(
            std::chrono::duration<double, std::milli>(Clock::now() - t).count() / static_cast<double>(n));
      }
    }
  }
  if (rank == 0) {
    std::ostringstream out;
    for (size_t s = 0; s < sizes.size(); ++s) {
      const double a = median(ms[s * 2]);
      const double b = median(ms[s * 2 + 1]);
      char line[256];
      std::snprintf(line, sizeof(line),
                    "{\"bench\": \"gloo_reduce_scatter\", \"ranks\": %d, \"bytes\": %lld, "
                    "\"allreduce_ms\": %.3f, \"ring_ms\": %.3f, \"speedup\": %.2f, \"rounds\": %d}\n",
                    ranks, static_cast<long long>(sizes[s]), a, b, a / b, rounds);
      out << line;
    }
    const std::string text = out.str();
    if (::write(out_fd, text.data(), text.size()) < 0) std::perror("write");
  }
}

}  // namespace

int main(int argc, char** argv) {
  int ranks = 2;
  int rounds = 5;
  std::vector<int64_t> sizes{int64_t{1} << 20, int64_t{16} << 20};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--ranks") {
      ranks = std::atoi(argv[i + 1]);
    } else if (flag == "--rounds") {
      rounds = std::atoi(argv[i + 1]);
    } else if (flag == "--sizes") {
      sizes.clear();
      std::stringstream list(argv[i + 1]);
      for (std::string item; std::getline(list, item, ',');) sizes.push_back(std::atoll(item.c_str()));
    } else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  const std::string store_path = "/tmp/shoal-gloo-rs-bench." + std::to_string(::getpid());
  int fds[2];
  if (::pipe(fds) != 0) return 1;
  std::vector<pid_t> children;
  for (int rank = 0; rank < ranks; ++rank) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(fds[0]);
      try {
        run_rank(rank, ranks, rounds, sizes, store_path, fds[1]);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
        ::_exit(1);
      }
      ::_exit(0);
    }
    children.push_back(pid);
  }
  ::close(fds[1]);
  std::string text;
  char buffer[4096];
  ssize_t n;
  while ((n = ::read(fds[0], buffer, sizeof(buffer))) > 0) text.append(buffer, static_cast<size_t>(n));
  int failed = 0;
  for (pid_t pid : children) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    failed += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  std::fputs(text.c_str(), stdout);
  return failed == 0 ? 0 : 1;
}
