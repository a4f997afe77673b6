// Oracle: Shoal's loss scaler against PyTorch 2.x's torch.amp.GradScaler("cpu") (the PyPI
// wheel of scripts/setup_torch_pypi.sh; Debian's 1.13 has no CPU GradScaler, so the test is
// skipped without it). The trainer trains 20 steps with a scaler on a float32 model, with inputs
// holding an inf pixel in some steps (their gradients overflow: the steps are skipped and the
// scale backs off) and a growth_interval short enough to grow the scale within the run, under
// single and ddp (2 ranks as threads; an inf on rank 1 skips rank 0's step too), with clipping
// and accumulation; train_features_oracle.py does the same in Python. Asserted: the scale after
// every step and the skipped steps exactly, the 20 losses to 1e-5 and the final parameters to 1e-6
// relative. Where LibTorch's CPU autocast has float16 (>= 2.4), --precision fp16 too: the 20
// losses within 1e-2 relative of PyTorch's fp16 autocast with its GradScaler.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>

#include "compat/autocast.h"
#include "shoal/comm/init.h"
#include "shoal/comm/store.h"
#include "shoal/data/synthetic_dataset.h"
#include "shoal/models/registry.h"
#include "shoal/train/ddp_strategy.h"
#include "shoal/train/trainer.h"
#include "testing/multi_rank.h"
#include "testing/python.h"
#include "features_oracle.h"

namespace shoal::train {
namespace test_grad_scaler_pytorch {

constexpr int kSteps = 20;
constexpr uint64_t kSeed = 3;
constexpr uint64_t kDataSeed = 11;
constexpr int64_t kBatch = 8;

struct Case {
  std::string name;
  std::string strategy;  // single or ddp
  int64_t accumulate = 1;
  double clip = 0;
  std::string precision = "fp32";
  double init_scale = 1024;
  int64_t growth_interval = 3;
  std::vector<int64_t> inf_samples;  // samples given an inf pixel
  std::string settings;              // the rest, as train_features_oracle.py reads them
  std::string device = "cpu";        // "cuda": --device cuda on both sides (a GPU machine)
};

/// Whether the CUDA cases run: this LibTorch has CUDA and sees a GPU (scripts/gpu_check.sh).
bool with_cuda() { return torch::cuda::is_available(); }

// Samples 5, 77 and 130 fall in three different steps (of either rank under ddp).
const std::vector<Case>& cases() {
  static const std::vector<Case> all = [] {
    std::vector<Case> list;
    list.push_back({"scaler_single", "single", 1, 0, "fp32", 1024, 3, {5, 77, 130}, "lr=0.05 momentum=0.9"});
    list.push_back({"scaler_ddp", "ddp", 1, 0, "fp32", 1024, 3, {5, 77, 130}, "lr=0.05 momentum=0.9"});
    list.push_back({"scaler_clip_accumulate_ddp", "ddp", 2, 0.3, "fp32", 65536, 4, {5, 77},
                    "lr=0.2 momentum=0.9"});
    if (compat::cpu_autocast_supports(at::kHalf)) {
      list.push_back({"fp16_single", "single", 1, 0, "fp16", 65536, 2000, {}, "lr=0.05 momentum=0.9"});
      list.push_back({"fp16_ddp", "ddp", 1, 0, "fp16", 65536, 2000, {}, "lr=0.05 momentum=0.9"});
    }
    if (with_cuda()) {
      // On the GPU (--device cuda): the scaler on a float32 model, then the fp16 recipe under
      // CUDA autocast with overflowing steps skipped. One process: this test's DDP ranks are
      // threads, and two ranks on one GPU in one process deadlock in backward (autograd runs
      // every CUDA backward of a device on one engine thread, and a rank's reduction waits there
      // for the other's); 2-process DDP on a GPU is test_cli_train_cuda's.
      list.push_back({"cuda_scaler_single", "single", 1, 0, "fp32", 1024, 3, {5, 77, 130},
                      "lr=0.05 momentum=0.9", "cuda"});
      list.push_back({"cuda_fp16_single", "single", 1, 0, "fp16", 65536, 3, {5, 77, 130},
                      "lr=0.05 momentum=0.9", "cuda"});
    }
    return list;
  }();
  return all;
}

int ranks_of(const Case& c) { return c.strategy == "ddp" ? 2 : 1; }
int64_t size_of(const Case& c) { return kSteps * kBatch * c.accumulate * ranks_of(c); }

struct Run {
  std::vector<float> parameters;
  std::vector<double> losses;
  std::vector<double> scales;  // after each step's update()
  std::vector<int> skipped;    // 1: the step was skipped
};

/// Records each step's loss and the scale after it.
struct ScaleRecorder : Callback {
  Run* run;
  explicit ScaleRecorder(Run* r) : run(r) {}
  void on_train_batch_end(Trainer& trainer, const StepInfo& step) override {
    const double before = run->scales.empty() ? trainer.state().grad_scaler->options().init_scale()
                                              : run->scales.back();
    run->losses.push_back(step.loss);
    run->scales.push_back(trainer.state().grad_scaler->get_scale());
    // A skipped step is the only one after which the scale shrinks.
    run->skipped.push_back(run->scales.back() < before ? 1 : 0);
  }
};

Run run_shoal(const Case& c) {
  torch::set_num_threads(1);
  data::SyntheticOptions data_options;
  data_options.size = size_of(c);
  data_options.seed = kDataSeed;
  const data::SyntheticDataset data(data_options);
  at::Tensor images = data.images().clone();
  for (int64_t k : c.inf_samples) images[k][0][0][0] = std::numeric_limits<float>::infinity();
  const TensorData train{images, data.targets()};
  TrainOptions options;
  options.model = "mlp";
  options.seed = kSeed;
  options.epochs = 1;
  options.batch_size = kBatch;
  options.threads = 1;
  options.progress = ProgressMode::kNone;
  options.log_interval = 0;
  options.lr = c.settings.find("lr=0.2") != std::string::npos ? 0.2 : 0.05;
  options.momentum = 0.9;
  options.accumulate = c.accumulate;
  options.clip_grad_norm = c.clip;
  options.precision = ::shoal::train::parse_precision(c.precision);
  options.device = c.device;
  options.grad_scaler = GradScalerOptions().init_scale(c.init_scale).growth_interval(c.growth_interval);
  const int world = ranks_of(c);
  std::vector<std::shared_ptr<models::Model>> models;
  for (int r = 0; r < world; ++r) models.push_back(models::create("mlp", kSeed));
  Run out;
  const auto train_rank = [&](int rank, std::unique_ptr<Strategy> strategy) {
    Run mine;
    Trainer trainer(options, models[rank], std::move(strategy));
    trainer.add_callback(std::make_shared<ScaleRecorder>(&mine));
    trainer.fit(train, TensorData{});
    if (rank != 0) return;
    for (const auto& p : models[0]->parameters()) {
      const at::Tensor flat = p.detach().to(at::kCPU, at::kFloat).contiguous().view(-1);
      out.parameters.insert(out.parameters.end(), flat.data_ptr<float>(),
                            flat.data_ptr<float>() + flat.numel());
    }
    out.losses = mine.losses;
    out.scales = mine.scales;
    out.skipped = mine.skipped;
  };
  if (world == 1) {
    train_rank(0, nullptr);
    return out;
  }
  auto store = comm::make_hash_store(std::chrono::milliseconds(60'000));
  shoal::testing::run_threads(world, [&](int rank) {
    auto group = comm::new_process_group("shm", store, rank, world, std::chrono::milliseconds(60'000));
    train_rank(rank, std::make_unique<DdpStrategy>(group));
  });
  return out;
}

std::string joined(const std::vector<int64_t>& values) {
  std::string out;
  for (int64_t v : values) out += (out.empty() ? "" : ",") + std::to_string(v);
  return out;
}

/// Runs train_features_oracle.py under PyTorch 2.x's Python once for every case.
const std::map<std::string, shoal::testing::FeaturesOracleRun>& oracle() {
  static const std::map<std::string, shoal::testing::FeaturesOracleRun> results = [] {
    // A python whose own torch is 2.x (a GPU machine's), else the PyPI wheel's torch (as
    // tests/launcher/test_torchrun.sh finds it).
    const std::string python = shoal::testing::torch2_python();
    if (python.empty()) {
      shoal::testing::skip_program(shoal::testing::Dependency::kOptional,
                                   "PyTorch 2.x not installed (scripts/setup_torch_pypi.sh), or "
                                   "SHOAL_SOURCE_DIR is not set (run through ctest)");
    }
    std::vector<std::pair<std::string, std::string>> lines;
    for (const Case& c : cases()) {
      std::ostringstream line;
      line << "strategy=" << c.strategy << " ranks=" << ranks_of(c) << " size=" << size_of(c)
           << " batch=" << kBatch << " seed=" << kSeed << " data_seed=" << kDataSeed
           << " accumulate=" << c.accumulate << " clip=" << c.clip << " precision=" << c.precision
           << " device=" << c.device << " scaler=1 init_scale=" << c.init_scale
           << " growth_interval=" << c.growth_interval << " " << c.settings;
      if (!c.inf_samples.empty()) line << " inf_samples=" << joined(c.inf_samples);
      lines.emplace_back(c.name, line.str());
    }
    return shoal::testing::run_features_oracle(python, lines, shoal::testing::Dependency::kOptional,
                                               "PyTorch 2.x's torch does not import");
  }();
  return results;
}

void expect_matches(const Case& c) {
  const auto& all = oracle();
  ASSERT_TRUE(all.count(c.name)) << c.name;
  const auto& theirs = all.at(c.name);
  const Run ours = run_shoal(c);
  ASSERT_EQ(theirs.scales.size(), static_cast<size_t>(kSteps)) << c.name;
  ASSERT_EQ(ours.scales.size(), static_cast<size_t>(kSteps)) << c.name;
  EXPECT_EQ(ours.scales, theirs.scales) << c.name << ": the scale after each step";
  EXPECT_EQ(ours.skipped, theirs.skipped) << c.name << ": the skipped steps";
  const double loss_tolerance = c.precision == "fp16" ? 1e-2 : 1e-5;
  for (int s = 0; s < kSteps; ++s) {
    if (std::isnan(theirs.losses[s])) {
      EXPECT_TRUE(std::isnan(ours.losses[s])) << c.name << ": step " << s + 1;
      continue;
    }
    EXPECT_NEAR(ours.losses[s], theirs.losses[s], loss_tolerance * std::abs(theirs.losses[s]))
        << c.name << ": loss of step " << s + 1;
  }
  if (c.precision == "fp16") return;  // float16 rounding: the losses are the comparison
  ASSERT_EQ(ours.parameters.size(), theirs.parameters.size()) << c.name;
  double diff = 0, scale = 0;
  for (size_t i = 0; i < ours.parameters.size(); ++i) {
    diff = std::max(diff, static_cast<double>(std::abs(ours.parameters[i] - theirs.parameters[i])));
    scale = std::max(scale, static_cast<double>(std::abs(theirs.parameters[i])));
  }
  // On the GPU both sides run cuBLAS; the bound allows its reduction order to differ.
  EXPECT_LE(diff / scale, c.device == "cpu" ? 1e-6 : 1e-5) << c.name << ": parameters after " << kSteps << " steps";
  std::printf("%s: %d skipped, final scale %g, parameters within %.2e relative\n", c.name.c_str(),
              static_cast<int>(std::count(ours.skipped.begin(), ours.skipped.end(), 1)),
              ours.scales.back(), diff / scale);
}

const Case& find_case(const std::string& name) {
  for (const Case& c : cases()) {
    if (c.name == name) return c;
  }
  throw std::runtime_error("no case " + name);
}

TEST(GradScalerPyTorch, Single) { expect_matches(find_case("scaler_single")); }
TEST(GradScalerPyTorch, Ddp) { expect_matches(find_case("scaler_ddp")); }
TEST(GradScalerPyTorch, ClipAccumulateDdp) { expect_matches(find_case("scaler_clip_accumulate_ddp")); }
TEST(GradScalerPyTorch, OnTheGpu) {
  if (!with_cuda()) {
    // No GPU: --device cuda is refused in one line, not trained on the CPU.
    TrainOptions options;
    options.device = "cuda";
    options.validate();
    EXPECT_THROW(resolve_device(options.device), InvalidArgument);
    std::printf("no CUDA GPU here: the CUDA cases run on one (scripts/gpu_check.sh)\n");
    return;
  }
  expect_matches(find_case("cuda_scaler_single"));
  expect_matches(find_case("cuda_fp16_single"));
}

TEST(GradScalerPyTorch, Fp16AutocastWhereTheCpuHasIt) {
  if (!compat::cpu_autocast_supports(at::kHalf)) {
    // LibTorch 1.13: no CPU float16 autocast, so --precision fp16 is refused, not run in fp32.
    TrainOptions options;
    options.precision = ::shoal::train::Precision::kFp16;
    EXPECT_THROW(options.validate(), InvalidArgument);
    return;
  }
  expect_matches(find_case("fp16_single"));
  expect_matches(find_case("fp16_ddp"));
}

}  // namespace test_grad_scaler_pytorch
}  // namespace shoal::train
