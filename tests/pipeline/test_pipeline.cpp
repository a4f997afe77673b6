// Pipeline parallelism across ranks (threads-as-ranks over shm and gloo): schedules, partitions,
// GPipe and 1F1B with K = 2 and 3 stages and M = 1 and 4 micro-batches ending with the parameters
// of full-batch training in one process, activation recomputation, the K x R grid with DDP, and
// failures reported on every rank with the stage and rank where they began.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

#include <atomic>
#include <map>
#include <mutex>

#include "shoal/comm/init.h"
#include "shoal/error.h"
#include "shoal/parallel/distributed_data_parallel.h"
#include "shoal/pipeline/pipeline.h"
#include "shoal/pipeline/pipeline_grid.h"
#include "shoal/pipeline/pipeline_partition.h"
#include "shoal/pipeline/schedule.h"
#include "testing/multi_rank.h"

namespace shoal::pipeline {
namespace test_pipeline {

using Milliseconds = std::chrono::milliseconds;
constexpr Milliseconds kTimeout{60'000};
constexpr int kSteps = 20;
constexpr int64_t kBatch = 14;  // not a multiple of 4: micro-batches of 4, 4, 3, 3

// ---- schedules and partitions ---------------------------------------------------------------------

TEST(Schedule, EveryMicroBatchRunsForwardThenBackwardOnce) {
  for (Schedule schedule : {Schedule::kGPipe, Schedule::k1F1B}) {
    for (int k : {1, 2, 3, 4}) {
      for (int64_t m : {1, 2, 4, 7}) {
        for (int s = 0; s < k; ++s) {
          const auto actions = schedule_actions(schedule, k, s, m);
          ASSERT_EQ(actions.size(), static_cast<size_t>(2 * m));
          std::vector<int> forwards(m, 0), backwards(m, 0);
          int64_t next_backward = 0;
          for (const auto& a : actions) {
            if (a.kind == PipelineAction::kForward) {
              ++forwards[a.micro_batch];
            } else {
              EXPECT_EQ(forwards[a.micro_batch], 1) << "backward before forward";
              EXPECT_EQ(a.micro_batch, next_backward++) << "backwards run in micro-batch order";
              ++backwards[a.micro_batch];
            }
          }
          for (int64_t i = 0; i < m; ++i) EXPECT_EQ(forwards[i] + backwards[i], 2);
          const int64_t in_flight = max_in_flight(actions);
          if (schedule == Schedule::kGPipe) {
            EXPECT_EQ(in_flight, m);
          } else {
            EXPECT_EQ(in_flight, std::min<int64_t>(k - s, m)) << "k " << k << " s " << s;
          }
        }
      }
    }
  }
  EXPECT_EQ(schedule_from_string("GPipe"), Schedule::kGPipe);
  EXPECT_EQ(schedule_from_string("1f1b"), Schedule::k1F1B);
  EXPECT_THROW(schedule_from_string("zb"), InvalidArgument);
  EXPECT_DOUBLE_EQ(theoretical_bubble_fraction(3, 4), 2.0 / 6.0);
}

TEST(Partition, BalancesMinimiseTheLargestStage) {
  EXPECT_EQ(balance_by_cost({1, 1, 1, 1}, 2), (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(balance_by_cost({10, 1, 1, 1, 1, 10}, 3), (std::vector<int64_t>{1, 4, 1}));
  EXPECT_EQ(balance_by_cost({5, 1, 1, 1}, 2), (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(balance_by_cost({1, 2, 3}, 3), (std::vector<int64_t>{1, 1, 1}));
  EXPECT_THROW(balance_by_cost({1, 2}, 3), InvalidArgument);
  EXPECT_EQ(balance_from_split_points(5, {2, 4}), (std::vector<int64_t>{2, 2, 1}));
  EXPECT_THROW(balance_from_split_points(5, {3, 2}), InvalidArgument);
  EXPECT_THROW(balance_from_split_points(5, {5}), InvalidArgument);

  torch::nn::Sequential model(torch::nn::Linear(100, 100), torch::nn::ReLU(),
                              torch::nn::Linear(100, 2), torch::nn::ReLU(),
                              torch::nn::Linear(2, 2));
  // 10100 | 1 + 202 + 1 + 6: the big layer alone.
  EXPECT_EQ(balance_by_parameters(model, 2), (std::vector<int64_t>{1, 4}));
  const auto timed = balance_by_time(model, torch::randn({8, 100}), 2);
  EXPECT_EQ(timed.size(), 2u);
  EXPECT_EQ(timed[0] + timed[1], 5);

  // A stage's module shares the layers and keeps the whole model's names.
  auto second = stage_module(model, {1, 2, 2}, 1);
  ASSERT_EQ(second->size(), 2u);
  auto names = second->named_parameters().keys();
  EXPECT_EQ(names, (std::vector<std::string>{"2.weight", "2.bias"}));
  EXPECT_TRUE(second->named_parameters()["2.weight"].is_same(model->named_parameters()["2.weight"]));
  EXPECT_THROW(stage_module(model, {1, 2, 1}, 0), InvalidArgument);
}

// ---- equivalence with full-batch training in one process ------------------------------------------

torch::nn::Sequential make_mlp(uint64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(20, 32), torch::nn::ReLU(),
                               torch::nn::Linear(32, 32), torch::nn::Tanh(),
                               torch::nn::Linear(32, 10));
}

std::pair<at::Tensor, at::Tensor> make_batch(int64_t step, int64_t batch) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(500 + step);
  at::Tensor x = torch::randn({batch, 20}, generator);
  at::Tensor y = torch::randint(0, 10, {batch}, generator, torch::kLong);
  return {x, y};
}

at::Tensor cross_entropy(const at::Tensor& output, const at::Tensor& target) {
  return torch::nn::functional::cross_entropy(output, target);
}

torch::optim::SGDOptions sgd_options() { return torch::optim::SGDOptions(0.05).momentum(0.9); }

struct Reference {
  std::map<std::string, at::Tensor> parameters;
  std::vector<double> losses;
};

// The unpartitioned model, one process, the whole batch per step.
Reference train_reference(uint64_t seed) {
  auto model = make_mlp(seed);
  torch::optim::SGD sgd(model->parameters(), sgd_options());
  Reference ref;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = make_batch(step, kBatch);
    sgd.zero_grad();
    auto loss = cross_entropy(model->forward(x), y);
    loss.backward();
    sgd.step();
    ref.losses.push_back(loss.item<double>());
  }
  for (const auto& p : model->named_parameters()) ref.parameters[p.key()] = p.value().detach().clone();
  return ref;
}

double relative_difference(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(b.abs().max().item<double>(), 1e-12);
}

struct PipeSpec {
  Schedule schedule;
  int stages;
  int64_t micro_batches;
  bool recompute = false;
  std::string backend = "shm";
};

std::string describe(const PipeSpec& s) {
  return std::string(to_string(s.schedule)) + "_k" + std::to_string(s.stages) + "_m" +
         std::to_string(s.micro_batches) + (s.recompute ? "_recompute" : "") + "_" + s.backend;
}

std::string spec_name(const ::testing::TestParamInfo<PipeSpec>& info) { return describe(info.param); }

void PrintTo(const PipeSpec& spec, std::ostream* out) { *out << describe(spec); }

class PipelineEquivalence : public ::testing::TestWithParam<PipeSpec> {};

TEST_P(PipelineEquivalence, TrainsLikeTheWholeModelInOneProcess) {
  const PipeSpec spec = GetParam();
  torch::set_num_threads(1);
  const uint64_t seed = 11;
  const Reference ref = train_reference(seed);
  // Each rank's copy of the model is made here: manual_seed is process-wide.
  std::vector<torch::nn::Sequential> models;
  for (int r = 0; r < spec.stages; ++r) models.push_back(make_mlp(seed));
  const auto balance = balance_by_parameters(models[0], spec.stages);

  std::vector<std::map<std::string, at::Tensor>> trained(spec.stages);
  std::vector<std::vector<double>> losses(spec.stages);
  std::vector<PipelineStats> stats(spec.stages);
  auto store = comm::make_hash_store(kTimeout);
  std::vector<int> stage_ranks;
  for (int s = 0; s < spec.stages; ++s) stage_ranks.push_back(s);
  shoal::testing::run_threads(spec.stages, [&](int rank) {
    auto group = comm::new_process_group(spec.backend, store, rank, spec.stages, kTimeout);
    PipelineOptions options;
    options.micro_batches = spec.micro_batches;
    options.schedule = spec.schedule;
    options.recompute = spec.recompute;
    Pipeline pipe(stage_module(models[rank], balance, rank), group, stage_ranks, options);
    torch::optim::SGD sgd(pipe.module()->parameters(), sgd_options());
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = make_batch(step, kBatch);
      sgd.zero_grad();
      losses[rank].push_back(pipe.forward_backward(pipe.is_first_stage() ? x : at::Tensor(),
                                                   pipe.is_last_stage() ? y : at::Tensor(),
                                                   cross_entropy));
      sgd.step();
    }
    for (const auto& p : pipe.module()->named_parameters()) {
      trained[rank][p.key()] = p.value().detach().clone();
    }
    stats[rank] = pipe.stats();
  });

  size_t seen = 0;
  for (int s = 0; s < spec.stages; ++s) {
    for (const auto& [name, value] : trained[s]) {
      ++seen;
      ASSERT_TRUE(ref.parameters.count(name)) << name;
      EXPECT_LE(relative_difference(value, ref.parameters.at(name)), 1e-5)
          << name << " on stage " << s;
    }
    EXPECT_EQ(stats[s].steps, kSteps);
    const int64_t most = spec.schedule == Schedule::kGPipe
                             ? spec.micro_batches
                             : std::min<int64_t>(spec.stages - s, spec.micro_batches);
    EXPECT_EQ(stats[s].peak_in_flight, most) << "stage " << s;
    if (!spec.recompute || s > 0) EXPECT_GT(stats[s].peak_activation_bytes, 0);
  }
  EXPECT_EQ(seen, ref.parameters.size()) << "every parameter lives on exactly one stage";
  const auto& last = losses[spec.stages - 1];
  for (int step = 0; step < kSteps; ++step) {
    EXPECT_NEAR(last[step], ref.losses[step], 1e-5 * std::abs(ref.losses[step])) << step;
    EXPECT_TRUE(std::isnan(losses[0][step]));
  }
}

// Recompute with Dropout: the recomputation in backward replays the forward's masks (PyTorch's
// checkpoint() saves and restores the RNG state), so training equals training without recompute.
// The Dropout sits on stage 0 only: the ranks are threads sharing torch's generator, so only
// stage 0 draws and only it preserves the RNG state (stage 1's restore would rewind stage 0's
// stream in between: preserve_rng_state=False there, as checkpoint() offers).
std::map<std::string, at::Tensor> train_with_dropout(Schedule schedule, bool recompute) {
  torch::set_num_threads(1);
  const auto make = [] {
    torch::manual_seed(23);
    return torch::nn::Sequential(torch::nn::Linear(20, 32), torch::nn::Dropout(0.4),
                                 torch::nn::ReLU(), torch::nn::Linear(32, 32), torch::nn::Tanh(),
                                 torch::nn::Linear(32, 10));
  };
  std::vector<torch::nn::Sequential> models{make(), make()};
  const std::vector<int64_t> balance{3, 3};
  torch::manual_seed(99);  // the Dropout masks' stream, the same for both runs
  std::map<std::string, at::Tensor> trained;
  std::mutex mutex;
  auto store = comm::make_hash_store(kTimeout);
  shoal::testing::run_threads(2, [&](int rank) {
    auto group = comm::new_process_group("shm", store, rank, 2, kTimeout);
    PipelineOptions options;
    options.micro_batches = 4;
    options.schedule = schedule;
    options.recompute = recompute;
    options.preserve_rng_state = rank == 0;
    Pipeline pipe(stage_module(models[rank], balance, rank), group, {0, 1}, options);
    torch::optim::SGD sgd(pipe.module()->parameters(), sgd_options());
    for (int step = 0; step < 10; ++step) {
      auto [x, y] = make_batch(step, kBatch);
      sgd.zero_grad();
      pipe.forward_backward(pipe.is_first_stage() ? x : at::Tensor(),
                            pipe.is_last_stage() ? y : at::Tensor(), cross_entropy);
      sgd.step();
    }
    std::lock_guard<std::mutex> lock(mutex);
    for (const auto& p : pipe.module()->named_parameters()) {
      trained[p.key()] = p.value().detach().clone();
    }
  });
  return trained;
}

TEST(PipelineRecompute, DropoutMasksAreReplayedAsWithoutRecompute) {
  for (Schedule schedule : {Schedule::kGPipe, Schedule::k1F1B}) {
    const auto plain = train_with_dropout(schedule, false);
    const auto recomputed = train_with_dropout(schedule, true);
    ASSERT_EQ(plain.size(), recomputed.size());
    for (const auto& [name, value] : plain) {
      EXPECT_LE(relative_difference(recomputed.at(name), value), 1e-6)
          << name << " (" << to_string(schedule) << ")";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Pipeline, PipelineEquivalence,
    ::testing::Values(PipeSpec{Schedule::kGPipe, 2, 1}, PipeSpec{Schedule::kGPipe, 2, 4},
                      PipeSpec{Schedule::kGPipe, 3, 1}, PipeSpec{Schedule::kGPipe, 3, 4},
                      PipeSpec{Schedule::k1F1B, 2, 1}, PipeSpec{Schedule::k1F1B, 2, 4},
                      PipeSpec{Schedule::k1F1B, 3, 1}, PipeSpec{Schedule::k1F1B, 3, 4},
                      PipeSpec{Schedule::k1F1B, 3, 4, true}, PipeSpec{Schedule::kGPipe, 2, 4, true},
                      PipeSpec{Schedule::k1F1B, 3, 4, false, "gloo"}),
    spec_name);

TEST(PipelineMemory, RecomputeAnd1F1BHoldLessThanGPipe) {
  torch::set_num_threads(1);
  constexpr int kStages = 2;
  auto measure = [](Schedule schedule, bool recompute) {
    std::vector<torch::nn::Sequential> models;
    for (int r = 0; r < kStages; ++r) models.push_back(make_mlp(3));
    std::vector<int64_t> peak(kStages);
    auto store = comm::make_hash_store(kTimeout);
    shoal::testing::run_threads(kStages, [&](int rank) {
      auto group = comm::new_process_group("shm", store, rank, kStages, kTimeout);
      PipelineOptions options;
      options.micro_batches = 8;
      options.schedule = schedule;
      options.recompute = recompute;
      Pipeline pipe(stage_module(models[rank], {3, 2}, rank), group, {0, 1}, options);
      auto [x, y] = make_batch(0, 32);
      pipe.forward_backward(x, y, cross_entropy);
      peak[rank] = pipe.stats().peak_activation_bytes;
    });
    return peak;
  };
  const auto gpipe = measure(Schedule::kGPipe, false);
  const auto one_f_one_b = measure(Schedule::k1F1B, false);
  const auto recomputed = measure(Schedule::kGPipe, true);
  for (int s = 0; s < kStages; ++s) {
    EXPECT_LT(one_f_one_b[s], gpipe[s]) << "stage " << s;
    EXPECT_LT(recomputed[s], gpipe[s]) << "stage " << s;
  }
  // Stage 0 holds 2 of 8 micro-batches under 1F1B (K - s = 2), stage 1 one.
  EXPECT_EQ(one_f_one_b[0] * 4, gpipe[0]);
  EXPECT_EQ(one_f_one_b[1] * 8, gpipe[1]);
}


// ---- K x R grid: pipelines of 2 stages, 2 data-parallel replicas ----------------------------------

class GridEquivalence : public ::testing::TestWithParam<uint64_t> {};

// Two seeds: seed 0 once left the grid 9e-4 away from the reference (an older tree; 21 seeds
// pass at 1e-5 now), so it stays checked beside the original seed.
TEST_P(GridEquivalence, TwoStagesTimesTwoReplicasTrainLikeOneProcess) {
  torch::set_num_threads(1);
  constexpr int kStages = 2;
  constexpr int kReplicas = 2;
  constexpr int kWorld = kStages * kReplicas;
  const uint64_t seed = GetParam();
  const Reference ref = train_reference(seed);
  std::vector<torch::nn::Sequential> models;
  for (int r = 0; r < kWorld; ++r) {
    // Replicas other than 0 start elsewhere: DDP must give them replica 0's stage weights.
    models.push_back(make_mlp(r < kStages ? seed : seed + 1 + r));
  }
  const auto balance = balance_by_parameters(models[0], kStages);
  std::vector<std::map<std::string, at::Tensor>> trained(kWorld);
  std::vector<std::vector<double>> losses(kWorld);
  auto store = comm::make_hash_store(kTimeout);
  shoal::testing::run_threads(kWorld, [&](int rank) {
    auto group = comm::new_process_group("shm", store, rank, kWorld, kTimeout);
    PipelineGrid grid(group, kStages);
    EXPECT_EQ(grid.replicas(), kReplicas);
    EXPECT_EQ(grid.stage_ranks(), (std::vector<int>{grid.replica() * 2, grid.replica() * 2 + 1}));
    PipelineOptions options;
    options.micro_batches = 3;
    options.schedule = Schedule::k1F1B;
    Pipeline pipe(stage_module(models[rank], balance, grid.stage()), group, grid.stage_ranks(),
                  options);
    auto ddp = std::make_shared<parallel::DistributedDataParallel<torch::nn::SequentialImpl>>(
        pipe.module().ptr(), grid.stage_group());
    pipe.set_data_parallel(ddp);
    torch::optim::SGD sgd(pipe.module()->parameters(), sgd_options());
    const int64_t share = kBatch / kReplicas;
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = make_batch(step, kBatch);
      x = x.narrow(0, grid.replica() * share, share);
      y = y.narrow(0, grid.replica() * share, share);
      sgd.zero_grad();
      losses[rank].push_back(pipe.forward_backward(x, y, cross_entropy));
      sgd.step();
    }
    for (const auto& p : pipe.module()->named_parameters()) {
      trained[rank][p.key()] = p.value().detach().clone();
    }
  });
  size_t seen = 0;
  for (int rank = 0; rank < kWorld; ++rank) {
    for (const auto& [name, value] : trained[rank]) {
      ++seen;
      ASSERT_TRUE(ref.parameters.count(name)) << name;
      EXPECT_LE(relative_difference(value, ref.parameters.at(name)), 1e-5)
          << name << " on rank " << rank;
    }
  }
  EXPECT_EQ(seen, kReplicas * ref.parameters.size());
  for (int step = 0; step < kSteps; ++step) {
    // Each replica's last stage reports the mean loss of its half of the batch.
    const double mean = (losses[1][step] + losses[3][step]) / 2;
    EXPECT_NEAR(mean, ref.losses[step], 1e-5 * std::abs(ref.losses[step])) << step;
  }
}

INSTANTIATE_TEST_SUITE_P(Seeds, GridEquivalence, ::testing::Values(uint64_t{0}, uint64_t{21}));

// ---- failures -------------------------------------------------------------------------------------

// Passes its input through, and throws on the `fail_at`-th call.
struct ThrowOnCallImpl : torch::nn::Module {
  explicit ThrowOnCallImpl(int fail_at) : fail_at(fail_at) {}
  at::Tensor forward(at::Tensor x) {
    if (++calls == fail_at) throw std::runtime_error("injected layer failure");
    return x;
  }
  int calls = 0;
  int fail_at;
};
TORCH_MODULE(ThrowOnCall);

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

class FailingStage : public ::testing::TestWithParam<std::string> {};

// Long, so that a failure reported through the pipeline (within seconds even on a loaded
// machine) is far apart from one that waits for the time-out.
constexpr Milliseconds kFailingStageTimeout{30'000};

TEST_P(FailingStage, EveryRankNamesTheStageAndRankThatFailed) {
  torch::set_num_threads(1);
  constexpr int kStages = 3;
  const std::string backend = GetParam();
  std::vector<torch::nn::Sequential> models;
  for (int r = 0; r < kStages; ++r) models.push_back(make_mlp(5));
  std::vector<std::string> errors(kStages);
  std::vector<double> seconds(kStages);
  auto store = comm::make_hash_store(kTimeout);
  shoal::testing::run_threads(kStages, [&](int rank) {
    auto group = comm::new_process_group(backend, store, rank, kStages, kFailingStageTimeout);
    auto stage = stage_module(models[rank], {2, 2, 1}, rank);
    // Stage 1 fails in the forward of the third micro-batch of step 2.
    if (rank == 1) stage->push_back("fail", ThrowOnCall(4 + 3));
    PipelineOptions options;
    options.micro_batches = 4;
    Pipeline pipe(stage, group, {0, 1, 2}, options);
    const auto start = std::chrono::steady_clock::now();
    try {
      for (int step = 0; step < 3; ++step) {
        auto [x, y] = make_batch(step, 8);
        pipe.forward_backward(x, y, cross_entropy);
      }
    } catch (const shoal::Error& e) {
      errors[rank] = e.what();
    }
    seconds[rank] = seconds_since(start);
  });
  for (int rank = 0; rank < kStages; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank) + ": " + errors[rank]);
    EXPECT_NE(errors[rank].find("stage 1 (rank 1)"), std::string::npos);
    EXPECT_NE(errors[rank].find("injected layer failure"), std::string::npos);
    EXPECT_NE(errors[rank].find("micro-batch 2 (step 2)"), std::string::npos);
    EXPECT_LT(seconds[rank], 0.5 * kFailingStageTimeout.count() / 1000.0)
        << "the failure must not wait for the time-out";
  }
}

INSTANTIATE_TEST_SUITE_P(Pipeline, FailingStage, ::testing::Values("shm", "gloo"));

TEST(DeadNeighbour, TheOtherStagesNameTheDeadStage) {
  constexpr int kStages = 3;
  auto results = shoal::testing::run_processes(
      kStages,
      [](int rank, const std::string& path) {
        torch::set_num_threads(1);
        auto store = comm::make_file_store(path, kStages, kTimeout);
        auto group = comm::new_process_group("shm", store, rank, kStages, Milliseconds(20'000));
        auto stage = stage_module(make_mlp(5), {2, 2, 1}, rank);
        PipelineOptions options;
        options.micro_batches = 2;
        Pipeline pipe(stage, group, {0, 1, 2}, options);
        for (int step = 0; step < 3; ++step) {
          if (rank == 1 && step == 1) _exit(3);  // dies between steps, without a word
          auto [x, y] = make_batch(step, 8);
          try {
            pipe.forward_backward(x, y, cross_entropy);
          } catch (const shoal::Error& e) {
            const std::string what = e.what();
            if (what.find("stage 1 (rank 1)") == std::string::npos) {
              throw std::runtime_error("the error does not name stage 1 (rank 1): " + what);
            }
            std::printf("rank %d: %s\n", rank, what.c_str());
            return;
          }
        }
        throw std::runtime_error("no error although stage 1 died");
      },
      Milliseconds(60'000));
  ASSERT_EQ(results.size(), 3u);
  EXPECT_EQ(results[1].exit_code, 3);
  for (int rank : {0, 2}) {
    EXPECT_TRUE(results[rank].ok()) << "rank " << rank << ": " << results[rank].error;
    EXPECT_LT(results[rank].seconds, 15.0) << "rank " << rank;
  }
}

}  // namespace test_pipeline
}  // namespace shoal::pipeline
