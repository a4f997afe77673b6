// A rank for the launcher's end-to-end test: meets the others through env:// (the TCP store at
// MASTER_ADDR:MASTER_PORT, as `shoal run` sets them), allreduces, and checks the sum.
// Exits 0 and prints "rank R/N sum ok" when the result is right, 1 otherwise.
// SHOAL_TEST_FAIL_ATTEMPT=N: rank 1 exits 3 in torchrun's restart attempt N (restart tests).
#include <cstdio>
#include <cstdlib>
#include <string>

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
    std::printf("rank %d/%d sum ok\n", pg->rank(), n);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "allreduce_worker: %s\n", e.what());
    return 1;
  }
}
