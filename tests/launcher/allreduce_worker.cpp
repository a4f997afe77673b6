// A rank for the launcher's end-to-end test: meets the others through env:// (the TCP store at
// MASTER_ADDR:MASTER_PORT, as `shoal run` sets them), allreduces, and checks the sum.
// Exits 0 and prints "rank R/N sum ok" when the result is right, 1 otherwise.
// SHOAL_TEST_FAIL_ATTEMPT=N: rank 1 exits 3 in torchrun's restart attempt N (restart tests).
// SHOAL_TEST_SIGUSR1_DIR=DIR: after the allreduce, each rank creates DIR/ready.<rank>; then rank
// 0 starts a second allreduce, which rank 1 joins only once DIR/go exists (the SIGUSR1 test asks
// both for their recent operations meanwhile).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "shoal/comm/init.h"
#include "shoal/error.h"

int main() {
  try {
    shoal::comm::InitOptions options;
    options.backend = "gloo";
    auto pg = shoal::comm::init_process_group(options);
    const char* fail_attempt = std::getenv("SHOAL_TEST_FAIL_ATTEMPT");
    const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
    if (fail_attempt != nullptr && attempt != nullptr && std::string(fail_attempt) == attempt &&
        pg->rank() == 1) {
      std::fprintf(stderr, "rank 1: failing attempt %s on purpose\n", attempt);
      return 3;
    }
    const int n = pg->size();
    // Rank r contributes r + 1 + i: the sum is n(n+1)/2 + n*i in every element i.
    at::Tensor tensor = torch::arange(1000, torch::kFloat) + (pg->rank() + 1);
    pg->allreduce(tensor)->wait();
    const at::Tensor expected = torch::arange(1000, torch::kFloat) * n + n * (n + 1) / 2;
    if (!torch::equal(tensor, expected)) {
      std::fprintf(stderr, "rank %d/%d: wrong allreduce result\n", pg->rank(), n);
      return 1;
    }
    if (const char* dir = std::getenv("SHOAL_TEST_SIGUSR1_DIR")) {
      const std::string base = std::string(dir) + "/";
      std::ofstream(base + "ready." + std::to_string(pg->rank())).flush();
      if (pg->rank() == 1) {
        // A handshake with the test, bounded: the test creates the file once it saw the dumps.
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
        while (!std::filesystem::exists(base + "go") && std::chrono::steady_clock::now() < until) {
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
      }
      pg->allreduce(tensor)->wait();
    }
    std::printf("rank %d/%d sum ok\n", pg->rank(), n);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "allreduce_worker: %s\n", e.what());
    return 1;
  }
}
