// The built-in trainer: bit-identical runs for a seed, different runs for different seeds, a loss
// that falls on learnable data, evaluation arithmetic, metrics lines and option checks.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>

#include "shoal/data/synthetic_dataset.h"
#include "shoal/error.h"
#include "shoal/models/registry.h"
#include "shoal/trace/tracer.h"
#include "shoal/train/metrics_writer.h"
#include "shoal/train/trainer.h"
#include "testing/multi_rank.h"

namespace shoal::train {
namespace test_trainer {

TensorData synthetic(int64_t size, uint64_t seed) {
  data::SyntheticOptions options;
  options.size = size;
  options.seed = seed;
  data::SyntheticDataset data(options);
  return {data.images(), data.targets()};
}

TrainOptions quick_options(const std::string& model, uint64_t seed) {
  TrainOptions options;
  options.model = model;
  options.seed = seed;
  options.batch_size = 32;
  options.lr = 0.01;
  options.momentum = 0.9;
  options.threads = 1;
  options.progress = ProgressMode::kNone;
  options.log_interval = 0;
  return options;
}

// Trains a fresh model and returns its parameters.
std::vector<torch::Tensor> train_once(const TrainOptions& options, const TensorData& train) {
  auto model = models::create(options.model, options.seed);
  Trainer trainer(options, model);
  trainer.fit(train, TensorData{});
  std::vector<torch::Tensor> params;
  for (const auto& p : model->parameters()) params.push_back(p.detach().clone());
  return params;
}

bool all_equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!torch::equal(a[i], b[i])) return false;
  }
  return true;
}

TEST(Trainer, SameSeedGivesBitIdenticalParameters) {
  torch::set_num_threads(1);
  // The MLP for two epochs (the second shuffle must be deterministic too); the CNN, whose
  // convolutions are 20x costlier per sample, for one epoch on fewer samples.
  for (const auto& [model, samples, epochs] :
       {std::tuple<std::string, int64_t, int64_t>{"mlp", 192, 2}, {"cnn", 64, 1}}) {
    const TensorData train = synthetic(samples, 1);
    TrainOptions options = quick_options(model, 5);
    options.batch_size = 16;
    options.epochs = epochs;
    const auto first = train_once(options, train);
    const auto second = train_once(options, train);
    EXPECT_TRUE(all_equal(first, second)) << model;
    options.seed = 6;
    EXPECT_FALSE(all_equal(first, train_once(options, train))) << model;
    // Training changed the weights at all.
    std::vector<torch::Tensor> initial;
    for (const auto& p : models::create(model, 5)->parameters()) initial.push_back(p.detach());
    EXPECT_FALSE(all_equal(first, initial)) << model;
  }
}

TEST(Trainer, ShuffleDependsOnSeedAndEpoch) {
  const torch::Tensor a = shuffled_indices(100, 3, 0);
  EXPECT_TRUE(torch::equal(a, shuffled_indices(100, 3, 0)));
  EXPECT_FALSE(torch::equal(a, shuffled_indices(100, 3, 1)));
  EXPECT_FALSE(torch::equal(a, shuffled_indices(100, 4, 0)));
  EXPECT_TRUE(torch::equal(std::get<0>(a.sort()), torch::arange(100, torch::kLong)));
}

// A dataset that records the epochs the trainer selects (as ImageFolder seeds its augmentation).
class EpochRecordingDataset : public data::TensorDataset {
 public:
  using data::TensorDataset::TensorDataset;
  void set_epoch(int64_t epoch) const override { epochs.push_back(epoch); }
  mutable std::vector<int64_t> epochs;
};

TEST(Trainer, SelectsEachEpochOfTheTrainingSetBeforeItsLoader) {
  torch::set_num_threads(1);
  const TensorData train = synthetic(64, 3);
  const EpochRecordingDataset dataset(train.inputs, train.targets);
  TrainOptions options = quick_options("mlp", 0);
  options.epochs = 3;
  Trainer trainer(options, models::create("mlp", 0));
  trainer.fit(dataset, nullptr);
  EXPECT_EQ(dataset.epochs, (std::vector<int64_t>{0, 1, 2}));
}

TEST(Trainer, LossFallsOnLearnableData) {
  torch::set_num_threads(1);
  // 784 random features labelled by a linear teacher: three epochs over 1024 samples fit most of
  // the training set (measured: mean loss 2.30 -> 1.79, accuracy 0.1 -> 0.95).
  const TensorData train = synthetic(1024, 11);
  TrainOptions options = quick_options("mlp", 0);
  options.epochs = 3;
  options.batch_size = 32;
  options.lr = 0.01;
  Trainer trainer(options, models::create("mlp", 0));
  const auto forward = trainer.state().model_forward;
  const EvalResult before = evaluate(*trainer.state().model, forward, train, 256);
  const TrainResult result = trainer.fit(train, train);
  ASSERT_EQ(result.epochs.size(), 3u);
  EXPECT_EQ(result.epochs[2].epoch, 3);
  EXPECT_LT(result.epochs[2].train_loss, 0.9 * result.epochs[0].train_loss);
  EXPECT_LT(result.epochs[2].test_loss, 0.9 * before.loss);
  EXPECT_GT(result.epochs[2].test_accuracy, before.accuracy + 0.3);
  EXPECT_EQ(result.final_test_accuracy(), result.epochs[2].test_accuracy);
  EXPECT_EQ(trainer.state().step, 3 * (1024 / 32));
  EXPECT_GT(result.epochs[0].samples_per_s, 0);
}

TEST(Trainer, TrainLimitUsesTheFirstSamplesOnly) {
  torch::set_num_threads(1);
  TensorData train = synthetic(256, 2);
  TrainOptions options = quick_options("mlp", 0);
  options.train_limit = 64;
  const auto limited = train_once(options, train);
  // Samples past the limit cannot matter: replacing them leaves the result unchanged.
  TensorData other = train;
  other.inputs = train.inputs.clone();
  other.inputs.slice(0, 64).fill_(3.0);
  EXPECT_TRUE(all_equal(limited, train_once(options, other)));
}

TEST(Trainer, EvaluateCountsAndAverages) {
  // Logits that pick the right class for the first half of the samples and class (t+1)%10 after.
  const torch::Tensor targets = torch::arange(10, torch::kLong);
  const TensorData data{torch::zeros({10, 1}), targets};
  int64_t offset = 0;
  auto model = models::create("mlp", 0);
  const EvalResult result = evaluate(
      *model,
      [&](const torch::Tensor& x) {
        const int64_t n = x.size(0);
        torch::Tensor picked = targets.slice(0, offset, offset + n).clone();
        for (int64_t i = 0; i < n; ++i) {
          if (offset + i >= 5) picked[i] = (picked[i].item<int64_t>() + 1) % 10;
        }
        offset += n;
        return torch::one_hot(picked, 10).to(torch::kFloat) * 4.0;
      },
      data, /*batch_size=*/3);
  EXPECT_EQ(result.samples, 10);
  EXPECT_DOUBLE_EQ(result.accuracy, 0.5);
  // Every sample has logit 4 on one class and 0 elsewhere: right ones lose log(e^4 + 9) - 4,
  // wrong ones log(e^4 + 9).
  const double right = std::log(std::exp(4.0) + 9.0) - 4.0;
  const double wrong = std::log(std::exp(4.0) + 9.0);
  EXPECT_NEAR(result.loss, (right + wrong) / 2, 1e-5);
  EXPECT_TRUE(model->is_training());  // evaluate puts the training mode back
}

TEST(Loss, NamesParseToTheEnumAndBack) {
  for (const std::string& name : loss_names()) EXPECT_EQ(loss_name(parse_loss(name)), name);
  EXPECT_EQ(parse_loss("mse"), Loss::kMse);
  EXPECT_TRUE(takes_class_targets(Loss::kNll));
  EXPECT_FALSE(takes_class_targets(Loss::kBceWithLogits));
  try {
    parse_loss("hinge");
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("smooth_l1"), std::string::npos) << e.what();
  }
}

TEST(Loss, RegressionTakesOneTargetPerOutputValue) {
  const torch::Tensor output = torch::randn({6, 1});
  const torch::Tensor target = torch::randn({6});
  // [N, 1] against [N] is the per-sample difference, not PyTorch's [N, N] broadcast.
  const double mse = loss_function(Loss::kMse)(output, target).item<double>();
  EXPECT_NEAR(mse, (output.squeeze(1) - target).pow(2).mean().item<double>(), 1e-6);
  const double l1 = loss_function(Loss::kL1)(output, target).item<double>();
  EXPECT_NEAR(l1, (output.squeeze(1) - target).abs().mean().item<double>(), 1e-6);
  EXPECT_THROW(loss_function(Loss::kMse)(torch::randn({6, 2}), target), InvalidArgument);
}

/// forward(x, y): the model computes its own loss (mean squared error of a linear map).
struct OwnLossNet : torch::nn::Module {
  OwnLossNet() { fc = register_module("fc", torch::nn::Linear(4, 1)); }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& y) {
    return torch::mse_loss(fc->forward(x).squeeze(1), y);
  }
  torch::nn::Linear fc{nullptr};
};

TEST(Trainer, TrainsAModelThatComputesItsOwnLoss) {
  torch::manual_seed(0);
  const torch::Tensor x = torch::randn({256, 4});
  const torch::Tensor y = x.matmul(torch::tensor({1.0f, -2.0f, 0.5f, 3.0f}));
  auto net = std::make_shared<OwnLossNet>();
  TrainOptions options = quick_options("own", 0);
  options.epochs = 5;
  Trainer trainer(options, net,
                  [net](const torch::Tensor& inputs, const torch::Tensor& targets) {
                    return net->forward(inputs, targets);
                  },
                  std::make_unique<torch::optim::SGD>(net->parameters(),
                                                      torch::optim::SGDOptions(0.05)));
  const TrainResult result = trainer.fit({x, y}, {x.slice(0, 0, 64), y.slice(0, 0, 64)});
  ASSERT_EQ(result.epochs.size(), 5u);
  EXPECT_LT(result.epochs.back().test_loss, 0.05 * result.epochs.front().train_loss);
  EXPECT_TRUE(std::isnan(result.epochs.back().test_accuracy));  // no classes: no accuracy
}

TEST(Trainer, WritesStepAndEpochMetrics) {
  torch::set_num_threads(1);
  const std::string path = shoal::testing::temp_path("shoal-metrics") + ".jsonl";
  TrainOptions options = quick_options("mlp", 0);
  options.epochs = 2;
  options.batch_size = 16;
  options.log_interval = 2;  // 128 / 16 = 8 steps per epoch: 4 step lines each
  options.metrics_path = path;
  Trainer trainer(options, models::create("mlp", 0));
  const TensorData data = synthetic(128, 3);
  trainer.fit(data, data);
  std::ifstream in(path);
  std::string line;
  int steps = 0, epochs = 0, runs = 0;
  while (std::getline(in, line)) {
    ASSERT_EQ(line.front(), '{');
    ASSERT_EQ(line.back(), '}');
    if (line.find("\"event\":\"run\"") != std::string::npos) {
      // First, once: what `shoal plot` names the run by and scales its x axes with.
      EXPECT_EQ(steps + epochs + runs++, 0) << line;
      for (const char* key : {"\"strategy\":\"single\"", "\"world_size\":1,",
                              "\"samples_per_epoch\":128,", "\"global_batch_size\":16,"}) {
        EXPECT_NE(line.find(key), std::string::npos) << key << " in " << line;
      }
    } else if (line.find("\"event\":\"step\"") != std::string::npos) {
      ++steps;
      for (const char* key : {"\"epoch\":", "\"step\":", "\"loss\":", "\"samples_per_s\":", "\"seconds\":",
                              "\"lr\":0.01,", "\"grad_norm\":", "\"total_samples\":"}) {
        EXPECT_NE(line.find(key), std::string::npos) << key << " in " << line;
      }
      // One process communicates nothing: no communication fields.
      EXPECT_EQ(line.find("comm_"), std::string::npos) << line;
    } else if (line.find("\"event\":\"epoch\"") != std::string::npos) {
      ++epochs;
      EXPECT_NE(line.find("\"epoch\":" + std::to_string(epochs) + ","), std::string::npos) << line;
      for (const char* key : {"\"train_loss\":", "\"test_loss\":", "\"test_accuracy\":",
                              "\"samples_per_s\":", "\"seconds\":"}) {
        EXPECT_NE(line.find(key), std::string::npos) << key << " in " << line;
      }
    } else {
      ADD_FAILURE() << "unexpected line " << line;
    }
  }
  EXPECT_EQ(runs, 1);
  EXPECT_EQ(steps, 8);
  EXPECT_EQ(epochs, 2);
  std::filesystem::remove(path);
}

TEST(Trainer, JsonLineEscapesAndHandlesNonFinite) {
  const std::string line =
      JsonLine().add("a", "x\"y\\z").add("n", int64_t{3}).add("f", 0.5).add("bad", NAN).str();
  EXPECT_EQ(line, R"({"a":"x\"y\\z","n":3,"f":0.5,"bad":null})");
}

TEST(Trainer, RejectsOptionsThatCannotWork) {
  TrainOptions options;
  options.batch_size = 0;
  EXPECT_THROW(options.validate(), InvalidArgument);
  options = {};
  options.lr = 0;
  EXPECT_THROW(options.validate(), InvalidArgument);
  options = {};
  options.momentum = 1.0;
  EXPECT_THROW(options.validate(), InvalidArgument);
  options = {};
  options.epochs = 0;
  EXPECT_THROW(options.validate(), InvalidArgument);
  EXPECT_NO_THROW(TrainOptions{}.validate());
  options = {};
  options.batch_size = 0;
  EXPECT_THROW(Trainer(options, models::create("mlp", 0)), InvalidArgument);
  options = {};
  options.metrics_path = "/nonexistent-dir/metrics.jsonl";
  options.progress = ProgressMode::kNone;
  Trainer trainer(options, models::create("mlp", 0));
  const TensorData data = synthetic(8, 0);
  EXPECT_THROW(trainer.fit(data, data), InvalidArgument);
}

// A strategy that trains on every other sample only and counts its calls: the trainer must go
// through the strategy for the forward pass and the indices.
class EvenSamples : public Strategy {
 public:
  std::string name() const override { return "even"; }
  void prepare(TrainState& state) override {
    ++prepared;
    auto forward = state.model_forward;
    state.forward = [this, forward](const torch::Tensor& x) {
      ++forwards;
      return forward(x);
    };
  }
  torch::Tensor epoch_indices(int64_t size, int64_t epoch, uint64_t seed,
                              int64_t consumed) override {
    return torch::arange(2 * consumed, size, 2, torch::kLong);  // the order 0, 2, 4, ...
  }
  int prepared = 0;
  int forwards = 0;
};

TEST(Trainer, GoesThroughTheStrategy) {
  torch::set_num_threads(1);
  auto strategy = std::make_unique<EvenSamples>();
  EvenSamples* raw = strategy.get();
  TrainOptions options = quick_options("mlp", 0);
  options.batch_size = 10;
  Trainer trainer(options, models::create("mlp", 0), std::move(strategy));
  trainer.fit(synthetic(100, 0), TensorData{});
  EXPECT_EQ(raw->prepared, 1);
  EXPECT_EQ(raw->forwards, 5);  // 50 samples in batches of 10
  EXPECT_EQ(trainer.state().step, 5);
}

}  // namespace test_trainer
}  // namespace shoal::train

namespace shoal::train {
namespace test_trainer {

// Any module, optimizer and loss: a linear regression y = 3x - 2 + noise-free, fitted with Adam
// and MSE through the trainer, ends at the exact coefficients (to 1e-2) and reports no accuracy
// (the targets are not classes).
TEST(Trainer, AcceptsAnyModuleOptimizerAndLoss) {
  torch::set_num_threads(1);
  torch::manual_seed(0);
  auto net = torch::nn::Linear(1, 1);
  const torch::Tensor x = torch::linspace(-1, 1, 256).unsqueeze(1);
  const TensorData data{x, 3 * x - 2};
  TrainOptions options = quick_options("custom", 0);
  options.epochs = 60;
  auto adam = std::make_unique<torch::optim::Adam>(net->parameters(),
                                                   torch::optim::AdamOptions(0.05));
  const auto mse = [](const at::Tensor& out, const at::Tensor& y) { return torch::mse_loss(out, y); };
  Trainer trainer(options, net, std::move(adam), mse);
  const TrainResult result = trainer.fit(data, data);
  ASSERT_EQ(result.epochs.size(), 60u);
  EXPECT_NEAR(net->weight.item<double>(), 3.0, 1e-2);
  EXPECT_NEAR(net->bias.item<double>(), -2.0, 1e-2);
  // The epoch's test loss is the MSE of the final model over the data, computed here directly.
  torch::NoGradGuard no_grad;
  EXPECT_NEAR(result.epochs.back().test_loss, torch::mse_loss(net(x), 3 * x - 2).item<double>(),
              1e-9);
  EXPECT_TRUE(std::isnan(result.epochs.back().test_accuracy));
}

// --accumulate N: one optimizer step over N micro-batches equals one step over the whole batch,
// also when the last micro-batch is short (each micro-batch weighted by its share of the step's
// samples, not by 1/N). No Python: a machine without it still catches a wrong scaling.
TEST(Trainer, AccumulatedMicroBatchesEqualOneFullBatchStep) {
  torch::set_num_threads(1);
  for (const int64_t size : {40, 34}) {  // 4 x 10, and 10 + 10 + 10 + 4
    SCOPED_TRACE("samples " + std::to_string(size));
    const TensorData data = synthetic(size, 5);
    TrainOptions whole = quick_options("mlp", 3);
    whole.lr = 0.5;  // a large step, so that a wrong weighting shows far above rounding
    whole.momentum = 0;
    whole.batch_size = size;
    TrainOptions micro = whole;
    micro.batch_size = 10;
    micro.accumulate = 4;
    const auto initial = models::create("mlp", whole.seed)->parameters();  // train_once's start
    const auto expected = train_once(whole, data);
    const auto got = train_once(micro, data);
    ASSERT_EQ(got.size(), expected.size());
    double moved = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      moved = std::max(moved, (expected[i] - initial[i]).abs().max().item<double>());
      const double scale = expected[i].abs().max().item<double>();
      EXPECT_LE((got[i] - expected[i]).abs().max().item<double>(), 1e-6 * scale)
          << "parameter #" << i;
    }
    EXPECT_GT(moved, 1e-4) << "the full-batch step did not move the weights";
  }
}

// A warm-up then cosine schedule (SequentialLR([LinearLR, CosineAnnealingLR])), the lr each step
// of a two-epoch run trains at, against the schedule's formula written out here: LinearLR's
// factor start + (1 - start) * s / W for the W warm-up steps, then CosineAnnealingLR's
// (1 + cos(pi * t / T)) / 2 counted from t = 0 after the warm-up, T the steps left.
TEST(Trainer, WarmupThenCosineLrAtEveryStep) {
  torch::set_num_threads(1);
  struct Recorder : Callback {
    std::vector<double> lrs;
    void on_train_batch_end(Trainer&, const StepInfo& step) override { lrs.push_back(step.lr); }
  };
  TrainOptions options = quick_options("mlp", 0);
  options.batch_size = 4;
  options.epochs = 2;
  options.lr = 0.2;
  options.lr_schedule = ::shoal::train::LrSchedule::kCosine;
  options.warmup_steps = 3;
  options.warmup_start_factor = 0.25;
  const TensorData data = synthetic(16, 0);  // 4 steps an epoch, 8 in all
  Trainer trainer(options, models::create("mlp", 0));
  auto recorder = std::make_shared<Recorder>();
  trainer.add_callback(recorder);
  trainer.fit(data, TensorData{});
  const int warmup = 3;
  const int total = 8;
  const double pi = std::acos(-1.0);
  std::vector<double> factors;
  for (int s = 0; s < total; ++s) {
    factors.push_back(s < warmup ? 0.25 + 0.75 * s / warmup
                                 : (1 + std::cos(pi * (s - warmup) / (total - warmup))) / 2);
  }
  // The formula's values, spelled out: a shifted boundary changes at least one of them.
  const double table[] = {0.25, 0.5, 0.75, 1.0, 0.904508, 0.654508, 0.345492, 0.095492};
  ASSERT_EQ(recorder->lrs.size(), static_cast<size_t>(total));
  for (int s = 0; s < total; ++s) {
    EXPECT_NEAR(factors[s], table[s], 1e-6) << "step " << s + 1;
    EXPECT_NEAR(recorder->lrs[s], 0.2 * factors[s], 1e-12) << "step " << s + 1;
  }
}

// A loss that becomes NaN (as with a learning rate far too high) stops training at that step
// with an error that says so, instead of finishing with NaN weights.
TEST(Trainer, NonFiniteLossStopsTraining) {
  torch::set_num_threads(1);
  auto net = torch::nn::Linear(4, 2);
  int calls = 0;
  const auto loss = [&calls](const at::Tensor& out, const at::Tensor& y) {
    const at::Tensor value = torch::nn::functional::cross_entropy(out, y);
    return ++calls == 3 ? value * std::numeric_limits<double>::quiet_NaN() : value;
  };
  TrainOptions options = quick_options("custom", 0);
  options.batch_size = 4;
  Trainer trainer(options, net,
                  std::make_unique<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.1)),
                  loss);
  const TensorData data{torch::randn({32, 4}), torch::randint(0, 2, {32}, torch::kLong)};
  try {
    trainer.fit(data, TensorData{});
    FAIL() << "a NaN loss did not stop training";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("diverged"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("step 3"), std::string::npos) << e.what();
  }
  EXPECT_EQ(trainer.state().step, 3);
}

// The tracer: spans and keyed intervals become Chrome "X" events with the rank as pid, and
// merge_files joins the parts of several ranks.
TEST(Tracer, RecordsSpansAndIntervalsAndMergesRanks) {
  const std::string dir = shoal::testing::temp_path("shoal-trace");
  std::filesystem::create_directories(dir);
  for (int rank = 0; rank < 2; ++rank) {
    trace::enable(rank);
    { trace::Span span("forward"); }
    trace::begin("allreduce", 7, 4096);
    trace::end("allreduce", 7);
    trace::end("allreduce", 8);  // never begun: ignored
    trace::disable();
    { trace::Span ignored("not recorded"); }
    trace::write_file(dir + "/part" + std::to_string(rank), trace::take_events());
  }
  trace::merge_files({dir + "/part0", dir + "/part1"}, dir + "/trace.json");
  EXPECT_FALSE(std::filesystem::exists(dir + "/part0"));
  std::ifstream in(dir + "/trace.json");
  std::stringstream text;
  text << in.rdbuf();
  const std::string json = text.str();
  std::filesystem::remove_all(dir);
  for (int rank = 0; rank < 2; ++rank) {
    const std::string pid = "\"pid\":" + std::to_string(rank);
    EXPECT_NE(json.find("{\"name\":\"forward\",\"cat\":\"train\",\"ph\":\"X\""), std::string::npos);
    EXPECT_NE(json.find("\"name\":\"rank " + std::to_string(rank) + "\""), std::string::npos);
    EXPECT_NE(json.find(pid), std::string::npos);
  }
  size_t buckets = 0;
  for (size_t at = json.find("allreduce bucket 7"); at != std::string::npos;
       at = json.find("allreduce bucket 7", at + 1)) {
    ++buckets;
  }
  EXPECT_EQ(buckets, 2u);
  EXPECT_NE(json.find("\"args\":{\"bucket\":7,\"bytes\":4096}"), std::string::npos);
  EXPECT_EQ(json.find("bucket 8"), std::string::npos);
  EXPECT_EQ(json.find("not recorded"), std::string::npos);
  EXPECT_EQ(json.rfind("{\"traceEvents\":[", 0), 0u);
}

// Two trainers tracing at once in one process (as worker threads do): each trace holds its own
// steps, and only them; a trainer with no trace path records nothing, into nobody's timeline.
TEST(Tracer, TrainersOnThreadsKeepTheirOwnTimelines) {
  const std::string dir = shoal::testing::temp_path("shoal-trace-threads");
  std::filesystem::create_directories(dir);
  const int64_t steps[3] = {8, 4, 6};
  shoal::testing::run_threads(3, [&](int which) {
    auto net = torch::nn::Linear(4, 2);
    TrainOptions options = quick_options("custom", 0);
    options.batch_size = 4;
    options.threads = 0;
    if (which < 2) options.trace_path = dir + "/trace" + std::to_string(which) + ".json";
    Trainer trainer(options, net,
                    std::make_unique<torch::optim::SGD>(net->parameters(),
                                                        torch::optim::SGDOptions(0.1)),
                    [](const at::Tensor& out, const at::Tensor& y) {
                      return torch::nn::functional::cross_entropy(out, y);
                    });
    const int64_t n = steps[which] * 4;
    trainer.fit(TensorData{torch::randn({n, 4}), torch::randint(0, 2, {n}, torch::kLong)},
                TensorData{});
  }, std::chrono::milliseconds(60000));
  for (int which = 0; which < 2; ++which) {
    std::ifstream in(dir + "/trace" + std::to_string(which) + ".json");
    std::stringstream text;
    text << in.rdbuf();
    const std::string json = text.str();
    int64_t forwards = 0;
    for (size_t at = json.find("\"name\":\"forward\""); at != std::string::npos;
         at = json.find("\"name\":\"forward\"", at + 1)) {
      ++forwards;
    }
    EXPECT_EQ(forwards, steps[which]) << "trace " << which << ":\n" << json.substr(0, 2000);
  }
  std::filesystem::remove_all(dir);
}

}  // namespace test_trainer
}  // namespace shoal::train
