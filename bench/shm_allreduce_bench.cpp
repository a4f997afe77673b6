// Allreduce bus bandwidth of the shm and gloo backends across forked processes on this host,
// beside one-thread memcpy bandwidth, measured interleaved (A B A B) in one run.
//
//   shm_allreduce_bench [--ranks 2] [--rounds 3] [--backends shm,gloo] [--min 4096]
//                       [--max 67108864] [--json]
//
// Bus bandwidth = bytes * 2(n-1)/n / time (nccl-tests' definition: the traffic a bandwidth-optimal
// algorithm moves per rank). Times are rank 0's, per operation, averaged over a loop of
// back-to-back allreduce(t)->wait() of about 0.15 s; each round measures every size and backend
// once; the table shows the median over rounds. OpenMPI is measured by mpi_allreduce_bench (run by
// bench/compare_allreduce.sh, interleaved with this program).
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "shoal/comm/init.h"
#include "shoal/error.h"

namespace {

using Clock = std::chrono::steady_clock;
using shoal::comm::Milliseconds;

struct Args {
  int ranks = 2;
  int rounds = 3;
  std::vector<std::string> backends{"shm", "gloo"};
  size_t min_bytes = 4096;
  size_t max_bytes = 64 << 20;
  bool json = false;
};

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// One-thread memcpy bandwidth (bytes copied per second) of a `bytes` buffer, best of a few.
double memcpy_bandwidth(size_t bytes) {
  std::vector<char> a(bytes, 1), b(bytes, 2);
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const int iters = std::max<int>(1, static_cast<int>((256u << 20) / bytes));
    const auto t = Clock::now();
    for (int i = 0; i < iters; ++i) {
      std::memcpy(i % 2 ? a.data() : b.data(), i % 2 ? b.data() : a.data(), bytes);
    }
    best = std::max(best, static_cast<double>(bytes) * iters / seconds_since(t));
  }
  return best;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

void run_rank(int rank, const Args& args, const std::string& store_path, int out_fd) {
  const Milliseconds timeout(120'000);
  auto store = shoal::comm::make_file_store(store_path, args.ranks, timeout);
  std::map<std::string, std::shared_ptr<shoal::comm::ProcessGroup>> groups;
  for (const auto& b : args.backends) {
    groups[b] = shoal::comm::new_process_group(b, shoal::comm::make_prefix_store(b, store), rank,
                                               args.ranks, timeout);
  }
  auto control = groups.begin()->second;
  std::ostringstream out;
  for (int round = 0; round < args.rounds; ++round) {
    if (rank == 0) {
      out << "{\"round\":" << round << ",\"op\":\"memcpy\",\"bytes\":" << args.max_bytes
          << ",\"bandwidth\":" << memcpy_bandwidth(args.max_bytes) << "}\n";
    }
    for (size_t bytes = args.min_bytes; bytes <= args.max_bytes; bytes *= 4) {
      auto t = at::zeros({static_cast<int64_t>(bytes / 4)});
      for (const auto& b : args.backends) {
        auto& pg = groups[b];
        for (int i = 0; i < 3; ++i) pg->allreduce(t)->wait();  // warm-up
        // Rank 0 sizes the loop to ~0.15 s and tells the others.
        auto iters = at::zeros({1}, at::kLong);
        const auto calibrate = Clock::now();
        pg->allreduce(t)->wait();
        if (rank == 0) {
          iters.fill_(std::clamp<int64_t>(static_cast<int64_t>(0.15 / seconds_since(calibrate)),
                                          3, 20000));
        }
        control->broadcast(iters, {0})->wait();
        const int64_t n = iters.item<int64_t>();
        pg->barrier()->wait();
        const auto s = Clock::now();
        for (int64_t i = 0; i < n; ++i) pg->allreduce(t)->wait();
        const double per_op = seconds_since(s) / n;
        if (rank == 0) {
          const double bus = bytes * 2.0 * (args.ranks - 1) / args.ranks / per_op;
          out << "{\"round\":" << round << ",\"op\":\"allreduce\",\"backend\":\"" << b
              << "\",\"ranks\":" << args.ranks << ",\"bytes\":" << bytes
              << ",\"seconds\":" << per_op << ",\"busbw\":" << bus << "}\n";
        }
      }
    }
  }
  if (rank == 0) {
    const std::string text = out.str();
    if (write(out_fd, text.data(), text.size()) < 0) std::perror("write");
  }
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--ranks") args.ranks = std::stoi(next());
    else if (a == "--rounds") args.rounds = std::stoi(next());
    else if (a == "--min") args.min_bytes = std::stoull(next());
    else if (a == "--max") args.max_bytes = std::stoull(next());
    else if (a == "--json") args.json = true;
    else if (a == "--backends") {
      args.backends.clear();
      std::stringstream list(next());
      for (std::string b; std::getline(list, b, ',');) args.backends.push_back(b);
    } else {
      std::fprintf(stderr, "usage: %s [--ranks N] [--rounds R] [--backends shm,gloo] [--min B] "
                   "[--max B] [--json]\n", argv[0]);
      return 2;
    }
  }
  char path[] = "/tmp/shoal-bench-store-XXXXXX";
  const int fd = mkstemp(path);
  close(fd);
  unlink(path);
  int pipe_fds[2];
  if (pipe(pipe_fds) != 0) return 1;
  std::vector<pid_t> children;
  for (int r = 0; r < args.ranks; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      close(pipe_fds[0]);
      try {
        run_rank(r, args, path, pipe_fds[1]);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", r, e.what());
        _exit(1);
      }
      _exit(0);
    }
    children.push_back(pid);
  }
  close(pipe_fds[1]);
  std::string text;
  char buf[4096];
  for (ssize_t got; (got = read(pipe_fds[0], buf, sizeof buf)) > 0;) text.append(buf, got);
  int failed = 0;
  for (pid_t pid : children) {
    int status = 0;
    waitpid(pid, &status, 0);
    failed |= !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  unlink(path);
  if (args.json) {
    std::fputs(text.c_str(), stdout);
    return failed;
  }
  // Table of medians over rounds.
  std::map<std::pair<std::string, size_t>, std::vector<double>> secs;
  std::vector<double> memcpy_bw;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    auto field = [&](const std::string& key) {
      const auto at = line.find("\"" + key + "\":");
      if (at == std::string::npos) return std::string();
      auto start = at + key.size() + 3;
      if (line[start] == '"') ++start;
      return line.substr(start, line.find_first_of(",}\"", start) - start);
    };
    if (field("op") == "memcpy") {
      memcpy_bw.push_back(std::stod(field("bandwidth")));
    } else {
      secs[{field("backend"), std::stoull(field("bytes"))}].push_back(std::stod(field("seconds")));
    }
  }
  const double mc = median(memcpy_bw);
  std::printf("memcpy (1 thread, %zu MiB): %.2f GB/s\n", args.max_bytes >> 20, mc / 1e9);
  std::printf("%10s", "bytes");
  for (const auto& b : args.backends) std::printf(" %12s %10s", (b + " us").c_str(), "busbw GB/s");
  std::printf("\n");
  for (size_t bytes = args.min_bytes; bytes <= args.max_bytes; bytes *= 4) {
    std::printf("%10zu", bytes);
    for (const auto& b : args.backends) {
      const double s = median(secs[{b, bytes}]);
      std::printf(" %12.1f %10.2f", s * 1e6, bytes * 2.0 * (args.ranks - 1) / args.ranks / s / 1e9);
    }
    std::printf("\n");
  }
  return failed;
}
