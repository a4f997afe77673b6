#include "checkpoint_testing.h"

#include <sys/stat.h>

#include <cstdio>
#include <cstdlib>

#include "testing/multi_rank.h"
#include "testing/python.h"

namespace shoal::testing {

torch::nn::Sequential make_net() {
  return torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::BatchNorm1d(8), torch::nn::ReLU(),
                               torch::nn::Linear(8, 3));
}

::testing::AssertionResult run_oracle(const std::string& args) {
  const char* source = std::getenv("SHOAL_SOURCE_DIR");
  const std::string script =
      std::string(source ? source : ".") + "/tests/checkpoint/torch_oracle.py";
  return oracle_succeeded(run_command("OMP_NUM_THREADS=1 /usr/bin/python3 " + script + " " + args));
}

std::string compare_state_dicts(const checkpoint::StateDict& a, const checkpoint::StateDict& b) {
  if (a.keys() != b.keys()) return "keys differ";
  for (const auto& item : a) {
    const at::Tensor& x = item.value();
    const at::Tensor& y = b[item.key()];
    if (x.scalar_type() != y.scalar_type()) return item.key() + ": dtype differs";
    if (x.sizes() != y.sizes()) return item.key() + ": shape differs";
    const at::Tensor xc = x.contiguous().cpu();
    const at::Tensor yc = y.contiguous().cpu();
    if (std::memcmp(xc.data_ptr(), yc.data_ptr(), xc.nbytes()) != 0) return item.key() + ": values differ";
  }
  return "";
}

std::string temp_dir(const std::string& stem) {
  const std::string path = temp_path(stem);
  ::mkdir(path.c_str(), 0755);
  return path;
}

}  // namespace shoal::testing
