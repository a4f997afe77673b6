// The Trainer's callbacks and early stopping, and a resumed AdamW run with a warm-up +
// cosine schedule and gradient accumulation: bit-identical to the uninterrupted one, its
// checkpoint's optimizer state loadable by Python's torch.optim.AdamW.load_state_dict.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "shoal/checkpoint/checkpoint_manager.h"
#include "shoal/comm/init.h"
#include "shoal/comm/store.h"
#include "shoal/data/synthetic_dataset.h"
#include "shoal/error.h"
#include "shoal/models/registry.h"
#include "shoal/train/ddp_strategy.h"
#include "shoal/train/trainer.h"
#include "testing/multi_rank.h"
#include "testing/python.h"

namespace shoal::train {
namespace test_train_callbacks {

TensorData synthetic(int64_t size, uint64_t seed) {
  data::SyntheticOptions o;
  o.size = size;
  o.seed = seed;
  const data::SyntheticDataset data(o);
  return {data.images(), data.targets()};
}

TrainOptions quiet_options() {
  TrainOptions o;
  o.model = "mlp";
  o.seed = 5;
  o.batch_size = 16;
  o.lr = 0.05;
  o.threads = 1;
  o.progress = ProgressMode::kNone;
  o.log_interval = 0;
  return o;
}

struct EpochRecorder : Callback {
  std::vector<EpochResult> epochs;
  int64_t steps = 0;
  void on_train_batch_end(Trainer&, const StepInfo&) override { ++steps; }
  void on_train_epoch_end(Trainer&, const EpochResult& epoch) override { epochs.push_back(epoch); }
};

// Lightning's rule, applied to the recorded test losses: the epoch after which `patience` epochs
// in a row have not improved on the best by more than min_delta (0: never).
int64_t lightning_stop_epoch(const std::vector<EpochResult>& epochs, int64_t patience, double min_delta) {
  double best = NAN;
  int64_t wait = 0;
  for (const auto& e : epochs) {
    if (std::isnan(best) || e.test_loss < best - min_delta) {
      best = e.test_loss;
      wait = 0;
    } else if (++wait >= patience) {
      return e.epoch;
    }
  }
  return 0;
}

TEST(TrainerCallbacks, EarlyStoppingStopsWhereLightningWould) {
  torch::set_num_threads(1);
  // The test set is labelled by another teacher (another data seed): as the model fits the
  // training set, the test loss stops improving within a few epochs.
  TrainOptions options = quiet_options();
  options.epochs = 12;
  const TensorData train = synthetic(128, 1), test = synthetic(64, 2);
  // The full run, recorded, gives the epoch where Lightning's rule stops.
  std::vector<EpochResult> full;
  {
    Trainer trainer(options, models::create("mlp", options.seed));
    auto recorder = std::make_shared<EpochRecorder>();
    trainer.add_callback(recorder);
    const TrainResult result = trainer.fit(train, test);
    EXPECT_FALSE(result.early_stopped);
    EXPECT_EQ(recorder->steps, 12 * 8);
    full = recorder->epochs;
  }
  const int64_t expected = lightning_stop_epoch(full, 2, 0.01);
  ASSERT_GT(expected, 0) << "the test loss kept improving for 12 epochs: raise the learning rate";
  ASSERT_LT(expected, 12);
  Trainer trainer(options, models::create("mlp", options.seed));
  EarlyStoppingOptions stop;
  stop.patience = 2;
  stop.min_delta = 0.01;
  auto early = std::make_shared<EarlyStopping>(stop);
  trainer.add_callback(early);
  const TrainResult result = trainer.fit(train, test);
  EXPECT_TRUE(result.early_stopped);
  EXPECT_EQ(early->stopped_epoch(), expected);
  ASSERT_EQ(static_cast<int64_t>(result.epochs.size()), expected);
  EXPECT_EQ(result.step, expected * 8);
  for (size_t i = 0; i < result.epochs.size(); ++i) {
    EXPECT_EQ(result.epochs[i].test_loss, full[i].test_loss) << "epoch " << i + 1;
  }
}

TEST(TrainerCallbacks, EarlyStoppingRefusesWhatCannotWork) {
  EarlyStoppingOptions bad;
  bad.monitor = "val_loss";
  EXPECT_THROW(EarlyStopping{bad}, InvalidArgument);
  bad = {};
  bad.mode = "lowest";
  EXPECT_THROW(EarlyStopping{bad}, InvalidArgument);
  // Monitoring the test loss without a test set: one clear error, not a silent never-stop.
  Trainer trainer(quiet_options(), models::create("mlp", 5));
  trainer.add_callback(std::make_shared<EarlyStopping>());
  EXPECT_THROW(trainer.fit(synthetic(32, 1), TensorData{}), InvalidArgument);
}

// A stop asked after a step by one rank's callback only: every DDP rank stops after that step.
struct StopAt : Callback {
  int64_t step;
  explicit StopAt(int64_t s) : step(s) {}
  void on_train_batch_end(Trainer& trainer, const StepInfo& info) override {
    if (info.step == step) trainer.request_stop();
  }
};

TEST(TrainerCallbacks, AStepStopAskedByOneRankStopsEveryRankThere) {
  torch::set_num_threads(1);
  TrainOptions options = quiet_options();
  options.epochs = 3;
  const TensorData train = synthetic(256, 1);
  std::vector<std::shared_ptr<models::Model>> nets{models::create("mlp", 5), models::create("mlp", 5)};
  std::vector<TrainResult> results(2);
  auto store = comm::make_hash_store(std::chrono::milliseconds(60'000));
  shoal::testing::run_threads(2, [&](int rank) {
    auto group = comm::new_process_group("shm", store, rank, 2, std::chrono::milliseconds(60'000));
    Trainer trainer(options, nets[rank], std::make_unique<DdpStrategy>(group));
    if (rank == 1) trainer.add_callback(std::make_shared<StopAt>(5));
    if (rank == 0) trainer.add_callback(std::make_shared<EpochRecorder>());  // callbacks on both
    results[rank] = trainer.fit(train, TensorData{});
  });
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_TRUE(results[rank].early_stopped) << "rank " << rank;
    EXPECT_EQ(results[rank].step, 5) << "rank " << rank;
  }
  for (size_t i = 0; i < nets[0]->parameters().size(); ++i) {
    EXPECT_TRUE(torch::equal(nets[0]->parameters()[i], nets[1]->parameters()[i]));
  }
}

// A preemption (options.stop_requested) seen by one rank only, with callbacks on every rank:
// one agreement per step stops both ranks after the same step, and the stop's checkpoint resumes
// after the samples both consumed.
TEST(TrainerCallbacks, APreemptionSeenByOneRankStopsEveryRankWithItsCheckpoint) {
  torch::set_num_threads(1);
  const std::string dir = shoal::testing::temp_path("shoal-preempt");
  TrainOptions options = quiet_options();
  options.epochs = 3;
  options.checkpoint_dir = dir;
  const TensorData train = synthetic(256, 1);  // 8 steps of 16 per rank and epoch
  std::vector<TrainResult> results(2);
  std::vector<int64_t> steps_seen(2);
  auto store = comm::make_hash_store(std::chrono::milliseconds(60'000));
  shoal::testing::run_threads(2, [&](int rank) {
    auto group = comm::new_process_group("shm", store, rank, 2, std::chrono::milliseconds(60'000));
    TrainOptions mine = options;
    auto polls = std::make_shared<int64_t>(0);  // the trainer asks once per step
    mine.stop_requested = [rank, polls] { return ++*polls >= 11 && rank == 1; };
    Trainer trainer(mine, models::create("mlp", 5), std::make_unique<DdpStrategy>(group));
    auto recorder = std::make_shared<EpochRecorder>();
    trainer.add_callback(recorder);
    results[rank] = trainer.fit(train, TensorData{});
    steps_seen[rank] = recorder->steps;
  });
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_TRUE(results[rank].preempted) << "rank " << rank;
    EXPECT_FALSE(results[rank].early_stopped) << "rank " << rank;
    EXPECT_EQ(results[rank].step, 11) << "rank " << rank;
    EXPECT_EQ(steps_seen[rank], 11) << "rank " << rank;
  }
  const std::optional<checkpoint::TrainingState> saved = checkpoint::CheckpointManager(dir).load_latest();
  ASSERT_TRUE(saved.has_value());
  EXPECT_EQ(saved->step, 11);
  EXPECT_EQ(saved->epoch, 1);
  EXPECT_EQ(saved->sampler.samples_seen, 3 * 16 * 2);  // step 11 is the third of epoch 2
  std::filesystem::remove_all(dir);
}

// Every hook, in the order the trainer calls them. on_fit_end also notes what it is promised:
// the result fit() returns, and the trace already written.
struct HookLog : Callback {
  std::vector<std::string> events;
  std::string trace_path;
  TrainResult at_end;
  bool trace_written_at_end = false;
  void on_fit_start(Trainer&) override { events.push_back("fit_start"); }
  void on_train_batch_end(Trainer&, const StepInfo& step) override {
    events.push_back("step " + std::to_string(step.step));
  }
  void on_train_epoch_end(Trainer&, const EpochResult& epoch) override {
    events.push_back("epoch " + std::to_string(epoch.epoch));
  }
  void on_fit_end(Trainer&, const TrainResult& result) override {
    events.push_back("fit_end");
    at_end = result;
    trace_written_at_end = std::filesystem::exists(trace_path);
  }
};

// "fit_start", the steps and epochs of a run of 4 steps per epoch from `step` + 1 to `last`
// (epochs ending on every fourth step up to `last_epoch`), then "fit_end".
std::vector<std::string> expected_hooks(int64_t last, int64_t last_epoch) {
  std::vector<std::string> events{"fit_start"};
  for (int64_t step = 1; step <= last; ++step) {
    events.push_back("step " + std::to_string(step));
    if (step % 4 == 0 && step / 4 <= last_epoch) events.push_back("epoch " + std::to_string(step / 4));
  }
  events.push_back("fit_end");
  return events;
}

TEST(TrainerCallbacks, FitStartAndEndFrameEveryRunOnceHoweverItStops) {
  torch::set_num_threads(1);
  const std::string dir = shoal::testing::temp_path("shoal-fit-hooks");
  std::filesystem::create_directories(dir);
  const TensorData train = synthetic(64, 1);  // 4 steps of 16 per epoch
  const auto run = [&](const std::string& name, TrainOptions options,
                       std::shared_ptr<Callback> stopper) {
    options.trace_path = dir + "/" + name + ".json";
    Trainer trainer(options, models::create("mlp", options.seed));
    auto log = std::make_shared<HookLog>();
    log->trace_path = options.trace_path;
    trainer.add_callback(log);
    if (stopper) trainer.add_callback(stopper);
    const TrainResult result = trainer.fit(train, TensorData{});
    EXPECT_EQ(log->at_end.step, result.step) << name;
    EXPECT_EQ(log->at_end.epochs.size(), result.epochs.size()) << name;
    EXPECT_EQ(log->at_end.stopped, result.stopped) << name;
    EXPECT_EQ(log->at_end.early_stopped, result.early_stopped) << name;
    EXPECT_TRUE(log->trace_written_at_end) << name << ": the trace is written before on_fit_end";
    const std::vector<std::string> events = log->events;
    // Another fit() of the finished trainer, with no epoch left: its own start and end.
    if (name == "whole") {
      log->events.clear();
      trainer.fit(train, TensorData{});
      EXPECT_EQ(log->events, (std::vector<std::string>{"fit_start", "fit_end"}));
    }
    return std::make_pair(result, events);
  };
  TrainOptions options = quiet_options();
  options.epochs = 2;
  const auto [whole, whole_hooks] = run("whole", options, nullptr);
  EXPECT_EQ(whole.step, 8);
  EXPECT_EQ(whole_hooks, expected_hooks(8, 2));

  TrainOptions steps = quiet_options();
  steps.epochs = 2;
  steps.stop_after_steps = 6;
  const auto [stopped, stopped_hooks] = run("steps", steps, nullptr);
  EXPECT_TRUE(stopped.stopped);
  EXPECT_EQ(stopped.step, 6);
  EXPECT_EQ(stopped_hooks, expected_hooks(6, 1));

  // No epoch improves on the first by min_delta: patience 1 stops after the second.
  EarlyStoppingOptions patience;
  patience.monitor = "train_loss";
  patience.patience = 1;
  patience.min_delta = 1e9;
  TrainOptions five = quiet_options();
  five.epochs = 5;
  const auto [early, early_hooks] = run("early", five, std::make_shared<EarlyStopping>(patience));
  EXPECT_TRUE(early.early_stopped);
  EXPECT_EQ(early.step, 8);
  EXPECT_EQ(early_hooks, expected_hooks(8, 2));

  const auto [asked, asked_hooks] = run("asked", five, std::make_shared<StopAt>(3));
  EXPECT_TRUE(asked.early_stopped);
  EXPECT_EQ(asked.step, 3);
  EXPECT_EQ(asked_hooks, expected_hooks(3, 0));
  std::filesystem::remove_all(dir);
}

// AdamW + LinearLR warm-up + cosine + accumulate 2, stopped mid-epoch and resumed from its
// checkpoint, ends bit-identical to the run that was never stopped; Python's AdamW loads the
// checkpoint's optimizer state (PyTorch's state_dict layout) and takes a step with it.
TEST(TrainerCallbacks, AdamWScheduledAccumulatedRunResumesBitIdentical) {
  torch::set_num_threads(1);
  const std::string dir = shoal::testing::temp_path("shoal-adamw-resume");
  TrainOptions options = quiet_options();
  options.optimizer = ::shoal::train::Optimizer::kAdamW;
  options.lr = 0.002;
  options.weight_decay = 0.05;
  options.warmup_steps = 3;
  options.lr_schedule = ::shoal::train::LrSchedule::kCosine;
  options.accumulate = 2;
  options.epochs = 2;
  const TensorData train = synthetic(256, 1);  // 8 steps of 2 x 16 per epoch
  auto whole = models::create("mlp", 5);
  {
    TrainOptions o = options;
    o.checkpoint_dir = dir + "/whole";
    Trainer(o, whole).fit(train, TensorData{});
  }
  auto cut = models::create("mlp", 5);
  TrainOptions o = options;
  o.checkpoint_dir = dir + "/cut";
  o.checkpoint_every = 5;
  o.stop_after_steps = 11;  // a checkpoint at step 10, in epoch 2
  EXPECT_TRUE(Trainer(o, cut).fit(train, TensorData{}).stopped);
  o.stop_after_steps = 0;
  auto resumed = models::create("mlp", 5);
  Trainer again(o, resumed);
  again.resume();
  EXPECT_EQ(again.state().step, 10);
  again.fit(train, TensorData{});
  for (size_t i = 0; i < whole->parameters().size(); ++i) {
    EXPECT_TRUE(torch::equal(whole->parameters()[i], resumed->parameters()[i])) << "parameter " << i;
  }
  const auto latest = checkpoint::find_latest(dir + "/whole");
  ASSERT_TRUE(latest.has_value());
  const std::string code = std::string(shoal::testing::kImportTorchOrExit) +
      "import os\nsys.path.insert(0, os.path.join(os.environ['SHOAL_SOURCE_DIR'], 'tests', 'models'))\n"
      "from pytorch_models import Mlp\n"
      "ckpt = torch.load('" + *latest + "')\n"
      "model = Mlp()\nmodel.load_state_dict(ckpt['model'])\n"
      "opt = torch.optim.AdamW(model.parameters())\nopt.load_state_dict(ckpt['optimizer'])\n"
      "group = opt.param_groups[0]\n"
      "assert abs(group['weight_decay'] - 0.05) < 1e-12 and group['betas'] == (0.9, 0.999), group\n"
      "state = opt.state[model.fc1.weight]\n"
      "assert float(state['step']) == 16, state['step']\n"
      "assert state['exp_avg'].shape == model.fc1.weight.shape\n"
      "model(torch.randn(4, 1, 28, 28)).sum().backward()\nopt.step()\n" +
      shoal::testing::closing_line_code("AdamW loaded the checkpoint's optimizer");
  if (std::getenv("SHOAL_SOURCE_DIR") == nullptr) {
    shoal::testing::skip_program(shoal::testing::Dependency::kOptional, "SHOAL_SOURCE_DIR is not set (run through ctest)");
  }
  const auto run = shoal::testing::run_python_code(code);
  if (run.exit_code == shoal::testing::kNoTorchExitCode) {
    shoal::testing::skip_program(shoal::testing::Dependency::kPythonTorch, "python3-torch is not installed");
  }
  EXPECT_TRUE(shoal::testing::oracle_succeeded(run));
  std::filesystem::remove_all(dir);
}

}  // namespace test_train_callbacks
}  // namespace shoal::train
