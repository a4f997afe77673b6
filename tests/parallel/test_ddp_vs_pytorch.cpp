// Shoal's DistributedDataParallel against PyTorch's own (Debian's python3-torch, gloo, 2 processes):
// the same model, initial weights and data order give the same parameters after 50 SGD steps.
// Exits 77 (skipped) when /usr/bin/python3 has no torch with gloo.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <fstream>

#include "shoal/comm/init.h"
#include "shoal/parallel/distributed_data_parallel.h"
#include "test_models.h"
#include "testing/multi_rank.h"

namespace shoal::parallel {
namespace {

constexpr int kWorld = 2;
constexpr int kSteps = 50;
constexpr int64_t kBatchPerRank = 4;

void write_floats(const std::string& path, const std::vector<torch::Tensor>& tensors) {
  std::ofstream out(path, std::ios::binary);
  for (const auto& t : tensors) {
    auto flat = t.detach().to(torch::kFloat).contiguous().flatten();
    out.write(static_cast<const char*>(flat.data_ptr()), flat.numel() * sizeof(float));
  }
  ASSERT_TRUE(out.good()) << path;
}

torch::Tensor read_floats(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return {};
  const auto bytes = static_cast<int64_t>(in.tellg());
  in.seekg(0);
  auto t = torch::empty({bytes / static_cast<int64_t>(sizeof(float))}, torch::kFloat);
  in.read(static_cast<char*>(t.data_ptr()), bytes);
  return t;
}

torch::Tensor flatten_all(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> flat;
  for (const auto& t : tensors) flat.push_back(t.detach().flatten());
  return torch::cat(flat);
}

template <typename Holder>
void compare_with_pytorch(const std::string& model_name) {
  const std::string dir = shoal::testing::temp_path("ddp_vs_pytorch_" + model_name);
  ASSERT_EQ(std::system(("mkdir -p " + dir).c_str()), 0);
  const std::string init = dir + "/init.f32", data = dir + "/data.f32";
  const std::string torch_out = dir + "/pytorch.f32", shoal_out = dir + "/shoal.f32";

  torch::manual_seed(42);
  Holder initial;
  write_floats(init, initial->parameters());
  std::vector<torch::Tensor> batches;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = shoal::testing::make_batch(model_name, step, kBatchPerRank * kWorld);
    batches.push_back(x);
    batches.push_back(y);
  }
  write_floats(data, batches);

  const char* source = std::getenv("SHOAL_SOURCE_DIR");
  const std::string script = std::string(source ? source : "..") + "/tests/parallel/ddp_oracle.py";
  const std::string command = "timeout 120 /usr/bin/python3 " + script + " " + model_name + " " +
                              init + " " + data + " " + torch_out + " " + std::to_string(kSteps) +
                              " " + std::to_string(kBatchPerRank) + " " + std::to_string(kWorld);
  ASSERT_EQ(std::system(command.c_str()), 0) << command;

  auto results = shoal::testing::run_processes(kWorld, [&](int rank, const std::string& store_path) {
    torch::set_num_threads(1);
    auto store = comm::make_file_store(store_path, kWorld);
    auto group = comm::new_process_group("gloo", store, rank, kWorld);
    torch::manual_seed(1000 + rank);  // a different model everywhere until DDP broadcasts
    Holder model;
    if (rank == 0) {
      torch::NoGradGuard no_grad;
      auto flat = read_floats(init);
      int64_t offset = 0;
      for (auto& p : model->parameters()) {
        p.copy_(flat.narrow(0, offset, p.numel()).view(p.sizes()));
        offset += p.numel();
      }
    }
    DistributedDataParallelOptions options;
    options.first_bucket_cap_mb = 0.001;  // several buckets, unlike PyTorch's single one here
    options.bucket_cap_mb = 0.01;
    DistributedDataParallel ddp(model, group, options);
    torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = shoal::testing::make_batch(model_name, step, kBatchPerRank * kWorld);
      optimizer.zero_grad();
      torch::nll_loss(ddp.forward(x.narrow(0, rank * kBatchPerRank, kBatchPerRank)),
                      y.narrow(0, rank * kBatchPerRank, kBatchPerRank))
          .backward();
      optimizer.step();
    }
    if (rank == 0) write_floats(shoal_out, model->parameters());
  });
  for (const auto& r : results) ASSERT_TRUE(r.ok()) << "rank " << r.rank << ": " << r.error;

  auto expected = read_floats(torch_out);
  auto actual = read_floats(shoal_out);
  ASSERT_TRUE(expected.defined() && actual.defined());
  ASSERT_EQ(expected.numel(), actual.numel());
  ASSERT_EQ(expected.numel(), flatten_all(initial->parameters()).numel());
  EXPECT_FALSE(torch::equal(expected, flatten_all(initial->parameters()))) << "nothing trained";
  const double relative =
      (actual - expected).abs().max().item<double>() / expected.abs().max().item<double>();
  std::printf("%s: max relative difference from PyTorch DDP after %d steps: %.3g\n",
              model_name.c_str(), kSteps, relative);
  EXPECT_LE(relative, 1e-5) << model_name;
  std::system(("rm -rf " + dir).c_str());
}

class VsPyTorch : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (std::system("/usr/bin/python3 -c 'import torch.distributed as d, numpy; "
                    "assert d.is_gloo_available()' >/dev/null 2>&1") != 0) {
      shoal::testing::skip_program("/usr/bin/python3 has no torch with gloo (python3-torch)");
    }
  }
};

TEST_F(VsPyTorch, CnnMatchesPyTorchDdp) { compare_with_pytorch<shoal::testing::SmallCnn>("cnn"); }
TEST_F(VsPyTorch, MlpMatchesPyTorchDdp) { compare_with_pytorch<shoal::testing::SmallMlp>("mlp"); }

}  // namespace
}  // namespace shoal::parallel
