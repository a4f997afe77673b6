// Oracle: the training features against Python PyTorch (the same version as the LibTorch under
// test: Debian's 1.13, or the PyPI wheel's 2.x): Adam,
// AdamW, LinearLR warm-up + CosineAnnealingLR, StepLR, MultiStepLR (SequentialLR after a
// warm-up), clip_grad_norm_, gradient accumulation (--accumulate 4, also with a short last
// step) and bf16 CPU autocast, each trained 20 optimizer steps by Shoal's Trainer under single
// and ddp (2 ranks as threads; clipping also under dp and pipeline), from the same initial
// weights, data and sample order as the Python loop in train_features_oracle.py. One Python launch computes every case; each
// feature is its own test, asserting its own cases: parameters equal to 1e-5 relative after 20
// steps (bf16: the 20 losses within 1e-2 relative). Callbacks (on_train_batch_end) report the
// losses and gradient norms compared here.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>

#include "shoal/comm/init.h"
#include "shoal/comm/store.h"
#include "shoal/data/synthetic_dataset.h"
#include "shoal/models/registry.h"
#include "shoal/parallel/distributed_data_parallel.h"
#include "shoal/train/data_parallel_strategy.h"
#include "shoal/train/ddp_strategy.h"
#include "shoal/train/pipeline_strategy.h"
#include "shoal/train/trainer.h"
#include "testing/multi_rank.h"
#include "testing/python.h"
#include "features_oracle.h"

namespace shoal::train {
namespace test_train_features_pytorch {

constexpr int kSteps = 20;
constexpr uint64_t kSeed = 3;
constexpr uint64_t kDataSeed = 11;
constexpr int64_t kBatch = 8;  // per rank and micro-batch

/// One comparison: a strategy and the options that differ from plain SGD.
struct Case {
  std::string name;
  std::string strategy = "single";  // single, ddp, dp, pipeline
  std::string settings;             // "key=value ..." as train_features_oracle.py reads them
};

std::map<std::string, std::string> parse(const std::string& settings) {
  std::map<std::string, std::string> out;
  std::istringstream words(settings);
  for (std::string word; words >> word;) {
    const auto eq = word.find('=');
    out[word.substr(0, eq)] = word.substr(eq + 1);
  }
  return out;
}

std::vector<int64_t> numbers(const std::string& text) {
  std::vector<int64_t> out;
  std::istringstream in(text);
  for (std::string item; std::getline(in, item, ',');) out.push_back(std::stoll(item));
  return out;
}

int ranks_of(const Case& c) { return c.strategy == "ddp" ? 2 : 1; }

// One epoch of kSteps steps: all full, or with short=K the last step K samples per rank short
// (a ragged step, whose micro-batches are not all of kBatch).
int64_t size_of(const Case& c) {
  const auto s = parse(c.settings);
  const int64_t accumulate = s.count("accumulate") ? std::stoll(s.at("accumulate")) : 1;
  const int64_t short_by = s.count("short") ? std::stoll(s.at("short")) : 0;
  return (kSteps * kBatch * accumulate - short_by) * ranks_of(c);
}

TrainOptions options_of(const Case& c) {
  const auto s = parse(c.settings);
  TrainOptions o;
  o.model = "mlp";
  o.seed = kSeed;
  o.epochs = 1;
  o.batch_size = kBatch;
  o.threads = 1;
  o.progress = ProgressMode::kNone;
  o.log_interval = 0;
  o.lr = std::stod(s.at("lr"));
  if (s.count("momentum")) o.momentum = std::stod(s.at("momentum"));
  if (s.count("optimizer")) o.optimizer = ::shoal::train::parse_optimizer(s.at("optimizer"));
  if (s.count("betas")) {
    const auto comma = s.at("betas").find(',');
    o.beta1 = std::stod(s.at("betas").substr(0, comma));
    o.beta2 = std::stod(s.at("betas").substr(comma + 1));
  }
  if (s.count("eps")) o.eps = std::stod(s.at("eps"));
  if (s.count("weight_decay")) o.weight_decay = std::stod(s.at("weight_decay"));
  if (s.count("lr_schedule")) o.lr_schedule = ::shoal::train::parse_lr_schedule(s.at("lr_schedule"));
  if (s.count("warmup_steps")) o.warmup_steps = std::stoll(s.at("warmup_steps"));
  if (s.count("warmup_start_factor")) o.warmup_start_factor = std::stod(s.at("warmup_start_factor"));
  if (s.count("step_size")) o.step_size = std::stoll(s.at("step_size"));
  if (s.count("gamma")) o.gamma = std::stod(s.at("gamma"));
  if (s.count("milestones")) o.milestones = numbers(s.at("milestones"));
  if (s.count("clip")) o.clip_grad_norm = std::stod(s.at("clip"));
  if (s.count("accumulate")) o.accumulate = std::stoll(s.at("accumulate"));
  if (s.count("precision")) o.precision = ::shoal::train::parse_precision(s.at("precision"));
  return o;
}

/// Records every step's loss and gradient norm (the Callback API under test, too).
struct StepRecorder : Callback {
  std::vector<StepInfo> steps;
  void on_train_batch_end(Trainer&, const StepInfo& step) override { steps.push_back(step); }
};

struct ShoalRun {
  std::vector<at::Tensor> parameters;  // rank 0's
  std::vector<StepInfo> steps;         // rank 0's
  uint64_t synchronised_backwards = 0;  // ddp: rank 0's reducer iterations
};

ShoalRun run_shoal(const Case& c) {
  torch::set_num_threads(1);
  data::SyntheticOptions data_options;
  data_options.size = size_of(c);
  data_options.seed = kDataSeed;
  const data::SyntheticDataset data(data_options);
  const TensorData train{data.images(), data.targets()};
  const TrainOptions options = options_of(c);
  const int world = c.strategy == "ddp" || c.strategy == "pipeline" ? 2 : 1;
  // Every rank's model from the seed, made here: the seeding generator is process-wide.
  std::vector<std::shared_ptr<models::Model>> models;
  for (int r = 0; r < world; ++r) models.push_back(models::create("mlp", kSeed));
  ShoalRun out;
  std::mutex mutex;
  const auto train_rank = [&](int rank, std::unique_ptr<Strategy> strategy) {
    auto* ddp = dynamic_cast<DdpStrategy*>(strategy.get());
    Trainer trainer(options, models[rank], std::move(strategy));
    auto recorder = std::make_shared<StepRecorder>();
    trainer.add_callback(recorder);
    trainer.fit(train, TensorData{});
    if (ddp != nullptr && rank == 0) out.synchronised_backwards = ddp->reducer_stats().iterations;
    if (rank != 0) return;
    std::lock_guard<std::mutex> lock(mutex);
    for (const auto& p : models[0]->parameters()) out.parameters.push_back(p.detach().clone());
    out.steps = recorder->steps;
  };
  if (world == 1) {
    train_rank(0, c.strategy == "dp" ? std::make_unique<DataParallelStrategy>(2, "mlp") : nullptr);
    return out;
  }
  auto store = comm::make_hash_store(std::chrono::milliseconds(60'000));
  shoal::testing::run_threads(world, [&](int rank) {
    auto group = comm::new_process_group("shm", store, rank, world, std::chrono::milliseconds(60'000));
    std::unique_ptr<Strategy> strategy;
    if (c.strategy == "ddp") {
      strategy = std::make_unique<DdpStrategy>(group);
    } else {
      PipelineStrategyOptions pipe;
      pipe.stages = 2;
      pipe.pipeline.micro_batches = 2;
      strategy = std::make_unique<PipelineStrategy>(pipe, group);
    }
    train_rank(rank, std::move(strategy));
  });
  // Under pipeline, synchronize() (at the epoch's end) gathered every stage into rank 0's model.
  return out;
}

// The cases: each feature under single and ddp; clipping also under dp and pipeline. Learning
// rates high enough that a wrong update (a missing bias correction, decay applied as L2, a
// schedule off by one step, clipping not applied) moves the weights far beyond 1e-5.
// Adam's eps is 1e-3 here, not its default 1e-8: with 1e-8, the many near-zero gradients of this
// MLP get updates of about +-lr whose sign is float rounding, so that a mere change of BLAS
// threading (OMP_NUM_THREADS unset) moves PyTorch-vs-Shoal to 3e-4 (measured) although the
// update is the same (with one thread, as CTest runs it, the default eps agrees bit for bit);
// with 1e-3 the comparison holds at 1e-5 whatever the rounding.
const std::vector<Case>& cases() {
  static const std::vector<Case> all = [] {
    std::vector<Case> list;
    const std::vector<std::pair<std::string, std::string>> features = {
        {"adam", "optimizer=adam lr=0.001 eps=0.001 weight_decay=0.01"},
        {"adamw", "optimizer=adamw lr=0.002 betas=0.8,0.99 eps=0.001 weight_decay=0.1"},
        {"warmup_cosine", "lr=0.1 momentum=0.9 lr_schedule=cosine warmup_steps=5 warmup_start_factor=0.25"},
        {"step", "lr=0.1 momentum=0.9 lr_schedule=step step_size=6 gamma=0.5"},
        {"multistep", "lr=0.05 momentum=0.9 lr_schedule=multistep milestones=4,9,15 gamma=0.3 warmup_steps=3"},
        {"clip", "lr=0.2 momentum=0.9 clip=0.3"},
        {"accumulate", "lr=0.05 momentum=0.9 accumulate=4"},
        // The last step: 8 + 8 + 3 samples, weighted 8/19, 8/19, 3/19 (not 1/3 each).
        {"accumulate_ragged", "lr=0.05 momentum=0.9 accumulate=4 short=13"},
        {"bf16", "lr=0.05 momentum=0.9 precision=bf16"},
    };
    for (const auto& [feature, settings] : features) {
      list.push_back({feature + "_single", "single", settings});
      list.push_back({feature + "_ddp", "ddp", settings});
    }
    list.push_back({"clip_dp", "dp", "lr=0.2 momentum=0.9 clip=0.3"});
    list.push_back({"clip_pipeline", "pipeline", "lr=0.2 momentum=0.9 clip=0.3"});
    return list;
  }();
  return all;
}

using OracleRun = shoal::testing::FeaturesOracleRun;

/// The PyTorch of the LibTorch under test: Debian's 1.13 for the 1.13 leg, the PyPI wheel's
/// Python for the 2.x leg. Across versions the float32 results differ by more than rounding where
/// training is ill-conditioned: on the ragged case, PyTorch 2.15's own Python ends 3.6e-4 from
/// PyTorch 1.13's (one hidden unit's weights), where Shoal on 2.15 agrees with 2.15.
std::string oracle_python() {
#if TORCH_VERSION_MAJOR >= 2
  const std::string python = shoal::testing::torch2_python();
  if (python.empty()) {
    shoal::testing::skip_program("PyTorch 2.x's Python is not installed (scripts/setup_torch_pypi.sh), "
                                 "or SHOAL_SOURCE_DIR is not set (run through ctest)");
  }
  return python;
#else
  return "/usr/bin/python3";
#endif
}

/// Runs the Python oracle once for every case (its start-up is the slow part).
const std::map<std::string, OracleRun>& oracle() {
  static const std::map<std::string, OracleRun> results = [] {
    std::vector<std::pair<std::string, std::string>> lines;
    for (const Case& c : cases()) {
      std::ostringstream line;
      line << "strategy=" << c.strategy << " ranks=" << ranks_of(c) << " size=" << size_of(c)
           << " batch=" << kBatch << " seed=" << kSeed << " data_seed=" << kDataSeed << " "
           << c.settings;
      lines.emplace_back(c.name, line.str());
    }
    return shoal::testing::run_features_oracle(oracle_python(), lines,
                                               shoal::testing::Dependency::kPythonTorch,
                                               "python3-torch is not installed");
  }();
  return results;
}

const Case& find_case(const std::string& name) {
  for (const Case& c : cases()) {
    if (c.name == name) return c;
  }
  throw std::runtime_error("no case " + name);
}

/// Max |ours - theirs| / max |theirs| over all parameters together.
double parameter_difference(const ShoalRun& ours, const OracleRun& theirs) {
  size_t offset = 0;
  double diff = 0, scale = 0;
  for (const at::Tensor& p : ours.parameters) {
    const auto n = static_cast<size_t>(p.numel());
    if (offset + n > theirs.parameters.size()) return INFINITY;
    const at::Tensor expected =
        torch::from_blob(const_cast<float*>(theirs.parameters.data() + offset), p.sizes(), torch::kFloat);
    diff = std::max(diff, (p - expected).abs().max().item<double>());
    scale = std::max(scale, expected.abs().max().item<double>());
    offset += n;
  }
  if (offset != theirs.parameters.size()) return INFINITY;
  return diff / scale;
}

/// Trains `name` with Shoal and compares it with the oracle: parameters to 1e-5 relative after
/// 20 steps (or, `losses_only`, the 20 losses to `loss_tolerance` relative).
void expect_matches(const std::string& name, bool losses_only = false, double loss_tolerance = 1e-5) {
  const auto& theirs_all = oracle();
  ASSERT_TRUE(theirs_all.count(name)) << name;
  const OracleRun& theirs = theirs_all.at(name);
  const ShoalRun ours = run_shoal(find_case(name));
  ASSERT_EQ(ours.steps.size(), static_cast<size_t>(kSteps)) << name;
  ASSERT_EQ(theirs.losses.size(), static_cast<size_t>(kSteps)) << name;
  double largest_loss_difference = 0;
  for (int s = 0; s < kSteps; ++s) {
    EXPECT_NEAR(ours.steps[s].loss, theirs.losses[s], loss_tolerance * std::abs(theirs.losses[s]))
        << name << ": loss of step " << s + 1;
    largest_loss_difference = std::max(
        largest_loss_difference, std::abs(ours.steps[s].loss - theirs.losses[s]) / std::abs(theirs.losses[s]));
  }
  const double difference = losses_only ? NAN : parameter_difference(ours, theirs);
  // Measured agreement, for the record (the assertions are the limits).
  std::printf("%s: losses within %.3g relative, parameters within %.3g relative of PyTorch's\n",
              name.c_str(), largest_loss_difference, difference);
  if (losses_only) return;
  EXPECT_LE(difference, 1e-5) << name << ": parameters after 20 steps";
}

TEST(TrainFeaturesVsPyTorch, Adam) {
  expect_matches("adam_single");
  expect_matches("adam_ddp");
}

TEST(TrainFeaturesVsPyTorch, AdamW) {
  expect_matches("adamw_single");
  expect_matches("adamw_ddp");
}

TEST(TrainFeaturesVsPyTorch, WarmupThenCosine) {
  expect_matches("warmup_cosine_single");
  expect_matches("warmup_cosine_ddp");
}

TEST(TrainFeaturesVsPyTorch, StepLR) {
  expect_matches("step_single");
  expect_matches("step_ddp");
}

TEST(TrainFeaturesVsPyTorch, WarmupThenMultiStepLR) {
  expect_matches("multistep_single");
  expect_matches("multistep_ddp");
}

TEST(TrainFeaturesVsPyTorch, ClipGradNorm) {
  for (const char* name : {"clip_single", "clip_ddp", "clip_dp", "clip_pipeline"}) {
    expect_matches(name);
    // Clipping did clip (the norm exceeded max_norm in PyTorch's run), so the test can fail.
    const OracleRun& theirs = oracle().at(name);
    int clipped = 0;
    for (double norm : theirs.norms) clipped += norm > 0.3 ? 1 : 0;
    EXPECT_GT(clipped, kSteps / 2) << name << ": max_norm 0.3 should clip most steps";
  }
}

TEST(TrainFeaturesVsPyTorch, GradientNormsReportedAsPyTorch) {
  const ShoalRun ours = run_shoal(find_case("clip_single"));
  const OracleRun& theirs = oracle().at("clip_single");
  for (int s = 0; s < kSteps; ++s) {
    EXPECT_NEAR(ours.steps[s].grad_norm, theirs.norms[s], 1e-5 * theirs.norms[s]) << "step " << s + 1;
  }
}

TEST(TrainFeaturesVsPyTorch, Accumulate4) {
  expect_matches("accumulate_single");
  expect_matches("accumulate_ddp");
  // DDP reduced once per optimizer step: the first 3 of every 4 backward passes ran in no_sync.
  EXPECT_EQ(run_shoal(find_case("accumulate_ddp")).synchronised_backwards, uint64_t{kSteps});
}

// A short last step weighs each micro-batch by its share of the step's samples, as one step on
// all of them would (not 1/N each).
TEST(TrainFeaturesVsPyTorch, Accumulate4WithARaggedLastStep) {
  expect_matches("accumulate_ragged_single");
  expect_matches("accumulate_ragged_ddp");
}

TEST(TrainFeaturesVsPyTorch, Bf16AutocastLossesTrackPyTorch) {
  expect_matches("bf16_single", /*losses_only=*/true, 1e-2);
  expect_matches("bf16_ddp", /*losses_only=*/true, 1e-2);
  // bf16 really ran: its losses differ from fp32's, by more than float rounding.
  const ShoalRun fp32 = run_shoal({"fp32", "single", "lr=0.05 momentum=0.9"});
  const ShoalRun bf16 = run_shoal(find_case("bf16_single"));
  double largest = 0;
  for (int s = 0; s < kSteps; ++s) {
    largest = std::max(largest, std::abs(fp32.steps[s].loss - bf16.steps[s].loss) /
                                    std::abs(fp32.steps[s].loss));
  }
  EXPECT_GT(largest, 1e-4) << "bf16 losses equal fp32's: autocast did not apply";
}

}  // namespace test_train_features_pytorch
}  // namespace shoal::train
