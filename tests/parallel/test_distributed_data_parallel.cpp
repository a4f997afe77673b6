// DistributedDataParallel on threads-as-ranks (Gloo over an in-memory store): N ranks with batch b
// train exactly like one process with batch N*b; bucketing, no_sync, gradient_as_bucket_view,
// unused parameters, buffers, join, comm hooks and error messages.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <map>
#include <set>
#include <thread>

#include "comm/shm/process_group_shm.h"
#include "shoal/comm/init.h"
#include "shoal/error.h"
#include "shoal/launcher/launch.h"
#include "shoal/parallel/comm_hooks.h"
#include "shoal/parallel/distributed_data_parallel.h"
#include "shoal/parallel/local_sgd.h"
#include "test_models.h"
#include "testing/multi_rank.h"

namespace shoal::parallel {
namespace test_distributed_data_parallel {

using shoal::testing::clone_all;
using shoal::testing::make_batch;
using shoal::testing::max_relative_difference;
using shoal::testing::SmallCnn;
using shoal::testing::SmallMlp;
using Milliseconds = std::chrono::milliseconds;

constexpr Milliseconds kTimeout{60'000};

// Runs fn(rank, group) on `world` threads, each with its own group of `backend`.
void with_groups(int world,
                 const std::function<void(int, std::shared_ptr<comm::ProcessGroup>)>& fn,
                 const std::string& backend = "gloo") {
  torch::set_num_threads(1);
  auto store = comm::make_hash_store(kTimeout);
  shoal::testing::run_threads(world, [&](int rank) {
    auto group = comm::new_process_group(backend, store, rank, world, kTimeout);
    fn(rank, group);
  });
}

// `world` replicas of SmallMlp(width, width), each with `initial`'s weights.
std::vector<SmallMlp> replicas_of(const SmallMlp& initial, int world, int64_t width) {
  std::vector<SmallMlp> models;
  for (int rank = 0; rank < world; ++rank) {
    models.emplace_back(width, width);
    torch::NoGradGuard no_grad;
    auto src = initial->parameters();
    auto dst = models.back()->parameters();
    for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
  }
  return models;
}

// Per rank, `steps` batches of 8 samples of `width` features and their labels (made before the
// ranks start: the global generator is not per thread).
std::vector<std::vector<std::pair<torch::Tensor, torch::Tensor>>> batches_of(int world, int steps,
                                                                             int64_t width) {
  std::vector<std::vector<std::pair<torch::Tensor, torch::Tensor>>> batches(world);
  for (int rank = 0; rank < world; ++rank) {
    for (int step = 0; step < steps; ++step) {
      batches[rank].emplace_back(torch::randn({8, width}), torch::randint(0, 10, {8}, torch::kLong));
    }
  }
  return batches;
}

// Bucket caps small enough to split these small models into several buckets.
DistributedDataParallelOptions small_buckets() {
  DistributedDataParallelOptions options;
  options.first_bucket_cap_mb = 0.0005;  // ~500 bytes
  options.bucket_cap_mb = 0.004;         // ~4 KB
  return options;
}

struct Spec {
  std::string model;
  int world;
  int accumulate = 1;  // micro-batches per step; all but the last under no_sync()
  bool bucket_view = false;
  std::string backend = "gloo";  // shm: the buckets are symmetric memory, reduced in place
  bool auto_cap = false;         // bucket_cap_mb = auto: the buckets change in the first steps
  std::string reduction = "overlapped";  // bucket_reduction: overlapped, inline or auto
};

// bucket_cap_mb = auto over caps that split the small models in several ways, decided within a
// few steps (2 rounds of 1 warm-up + 1 timed step per distinct cap).
void use_auto_cap(DistributedDataParallelOptions& options) {
  options.bucket_cap_mb = DistributedDataParallelOptions::kBucketCapAuto;
  options.bucket_cap_candidates_mb = {0.0001, 0.001, 0.004, 0.005, 1.0};
  options.bucket_cap_tuning_rounds = 2;
  options.bucket_cap_tuning_steps = 1;
}

std::string spec_name(const ::testing::TestParamInfo<Spec>& info) {
  const Spec& s = info.param;
  return s.model + "_w" + std::to_string(s.world) + (s.accumulate > 1 ? "_nosync" : "") +
         (s.bucket_view ? "_view" : "") + "_" + s.backend + (s.auto_cap ? "_autocap" : "") +
         (s.reduction != "overlapped" ? "_" + s.reduction : "");
}

constexpr int kSteps = 50;
constexpr int64_t kBatchPerRank = 4;

template <typename Holder>
void check_equivalence(const Spec& spec) {
  std::vector<Holder> models;
  for (int r = 0; r < spec.world; ++r) {
    torch::manual_seed(100 + r);  // different on every rank: DDP must broadcast rank 0's
    models.emplace_back();
  }
  Holder reference;
  {
    torch::NoGradGuard no_grad;
    auto src = models[0]->parameters();
    auto dst = reference->parameters();
    for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
  }
  const int64_t global_batch = kBatchPerRank * spec.world;
  auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);

  // One process, the whole batch.
  {
    torch::optim::SGD optimizer(reference->parameters(), sgd);
    for (int step = 0; step < kSteps; ++step) {
      optimizer.zero_grad();
      for (int micro = 0; micro < spec.accumulate; ++micro) {
        auto [x, y] = make_batch(spec.model, step * spec.accumulate + micro, global_batch);
        torch::nll_loss(reference->forward(x), y).backward();
      }
      optimizer.step();
    }
  }

  std::vector<std::vector<torch::Tensor>> results(spec.world);
  std::vector<size_t> bucket_counts(spec.world);
  std::vector<ReducerStats> final_stats(spec.world);
  with_groups(spec.world, [&](int rank, std::shared_ptr<comm::ProcessGroup> group) {
    auto options = small_buckets();
    options.gradient_as_bucket_view = spec.bucket_view;
    options.bucket_reduction = parse_bucket_reduction(spec.reduction);
    if (spec.auto_cap) use_auto_cap(options);
    DistributedDataParallel ddp(models[rank], group, options);
    torch::optim::SGD optimizer(ddp.module()->parameters(), sgd);
    for (int step = 0; step < kSteps; ++step) {
      optimizer.zero_grad();
      for (int micro = 0; micro < spec.accumulate; ++micro) {
        auto [x, y] = make_batch(spec.model, step * spec.accumulate + micro, global_batch);
        auto xr = x.narrow(0, rank * kBatchPerRank, kBatchPerRank);
        auto yr = y.narrow(0, rank * kBatchPerRank, kBatchPerRank);
        if (micro + 1 < spec.accumulate) {
          auto guard = ddp.no_sync();
          torch::nll_loss(ddp.forward(xr), yr).backward();
        } else {
          torch::nll_loss(ddp.forward(xr), yr).backward();
        }
      }
      optimizer.step();
    }
    const auto params = ddp.module()->parameters();
    if (spec.bucket_view) {
      // Gradients live in the buckets: fewer distinct storages than parameters.
      std::set<const void*> storages;
      for (const auto& p : params) storages.insert(p.grad().storage().data());
      EXPECT_EQ(storages.size(), ddp.stats().bucket_bytes.size());
    } else {
      // Plain gradients: each a storage of its own (reduced inline, over its bucket slot).
      std::set<const void*> storages;
      for (const auto& p : params) storages.insert(p.grad().storage().unsafeGetStorageImpl());
      EXPECT_EQ(storages.size(), params.size());
    }
    const bool inline_reduction = ddp.stats().inline_reduction;
    for (const auto& p : params) {
      // On shm the buckets (and with views, or reduced inline, the gradients) are the group's
      // symmetric memory.
      EXPECT_EQ(group->is_symmetric(p.grad()),
                spec.backend == "shm" && (spec.bucket_view || inline_reduction));
    }
    results[rank] = clone_all(ddp.module()->parameters());
    bucket_counts[rank] = ddp.stats().bucket_bytes.size();
    final_stats[rank] = ddp.stats();
  }, spec.backend);

  if (spec.auto_cap) {
    // The tuning ran its course within the steps and every rank kept the same cap.
    for (int r = 0; r < spec.world; ++r) {
      EXPECT_FALSE(final_stats[r].bucket_cap_tuning) << "rank " << r;
      EXPECT_GE(final_stats[r].bucket_cap_trials.size(), 2u) << "rank " << r;
      EXPECT_EQ(final_stats[r].bucket_cap_mb, final_stats[0].bucket_cap_mb) << "rank " << r;
      EXPECT_EQ(final_stats[r].bucket_bytes, final_stats[0].bucket_bytes) << "rank " << r;
    }
  } else {
    EXPECT_GE(bucket_counts[0], 3u) << "the test should exercise several buckets";
  }
  const auto expected = reference->parameters();
  for (int r = 0; r < spec.world; ++r) {
    EXPECT_LE(max_relative_difference(results[r], clone_all(expected)), 1e-5) << "rank " << r;
    for (size_t i = 0; i < results[r].size(); ++i) {
      EXPECT_TRUE(torch::equal(results[r][i], results[0][i])) << "ranks 0 and " << r << " differ";
    }
  }
}

class Equivalence : public ::testing::TestWithParam<Spec> {};

TEST_P(Equivalence, MatchesSingleProcessLargeBatch) {
  const Spec spec = GetParam();
  if (spec.model == "cnn") {
    check_equivalence<SmallCnn>(spec);
  } else {
    check_equivalence<SmallMlp>(spec);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Ddp, Equivalence,
    ::testing::Values(Spec{"cnn", 2}, Spec{"mlp", 2}, Spec{"cnn", 3}, Spec{"mlp", 3},
                      Spec{"cnn", 2, 2}, Spec{"mlp", 3, 2}, Spec{"cnn", 2, 1, true},
                      Spec{"mlp", 3, 2, true}, Spec{"cnn", 2, 1, false, "shm"},
                      Spec{"mlp", 2, 2, true, "shm"}, Spec{"mlp", 3, 1, true, "shm"},
                      Spec{"cnn", 2, 1, false, "gloo", true}, Spec{"mlp", 3, 2, true, "shm", true},
                      // Buckets reduced by the hook that fills them (bucket_reduction = inline).
                      Spec{"cnn", 2, 1, false, "shm", false, "inline"},
                      Spec{"mlp", 3, 2, true, "shm", false, "inline"},
                      Spec{"mlp", 2, 1, false, "gloo", false, "inline"},
                      Spec{"cnn", 3, 2, false, "shm", true, "inline"}),
    spec_name);

// ---- unused parameters ---------------------------------------------------------------------------

struct BranchyImpl : torch::nn::Module {
  BranchyImpl()
      : trunk(register_module("trunk", torch::nn::Linear(6, 8))),
        branch(register_module("branch", torch::nn::Linear(8, 8))),
        head(register_module("head", torch::nn::Linear(8, 3))) {}
  torch::Tensor forward(torch::Tensor x, bool use_branch) {
    x = torch::relu(trunk(x));
    if (use_branch) x = torch::relu(branch(x));
    return head(x);
  }
  torch::nn::Linear trunk, branch, head;
};
TORCH_MODULE(Branchy);

TEST(DdpUnused, FindUnusedParametersTrainsLikeOneProcess) {
  constexpr int kWorld = 2;
  constexpr int kBranchySteps = 12;
  std::vector<Branchy> models;
  for (int r = 0; r < kWorld; ++r) {
    torch::manual_seed(7 + r);
    models.emplace_back();
  }
  Branchy reference;
  {
    torch::NoGradGuard no_grad;
    auto src = models[0]->parameters();
    auto dst = reference->parameters();
    for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
  }
  auto batch = [](int step) {
    auto g = at::make_generator<at::CPUGeneratorImpl>(50 + step);
    return std::make_pair(torch::randn({8, 6}, g), torch::randn({8, 3}, g));
  };
  torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < kBranchySteps; ++step) {
    ref_opt.zero_grad();
    auto [x, y] = batch(step);
    torch::mse_loss(reference->forward(x, step % 3 != 0), y).backward();
    ref_opt.step();
  }
  std::vector<std::vector<torch::Tensor>> results(kWorld);
  with_groups(kWorld, [&](int rank, std::shared_ptr<comm::ProcessGroup> group) {
    auto options = small_buckets();
    options.find_unused_parameters = true;
    DistributedDataParallel ddp(models[rank], group, options);
    torch::optim::SGD opt(ddp.module()->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    for (int step = 0; step < kBranchySteps; ++step) {
      opt.zero_grad();
      auto [x, y] = batch(step);
      torch::mse_loss(ddp.forward(x.narrow(0, rank * 4, 4), step % 3 != 0),
                      y.narrow(0, rank * 4, 4))
          .backward();
      opt.step();
    }
    results[rank] = clone_all(ddp.module()->parameters());
  });
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_LE(max_relative_difference(results[r], clone_all(reference->parameters())), 1e-5);
  }
}

TEST(DdpUnused, WithoutTheFlagAnUnusedParameterIsAClearErrorNotAHang) {
  with_groups(2, [&](int rank, std::shared_ptr<comm::ProcessGroup> group) {
    torch::manual_seed(3);
    Branchy model;
    DistributedDataParallel ddp(model, group, small_buckets());
    auto x = torch::randn({4, 6});
    try {
      ddp.forward(x, /*use_branch=*/false).sum().backward();
      ADD_FAILURE() << "expected an error";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("'branch.weight'"), std::string::npos) << what;
      EXPECT_NE(what.find("'branch.bias'"), std::string::npos) << what;
      EXPECT_NE(what.find("find_unused_parameters"), std::string::npos) << what;
    }
    // The next, complete step works again.
    ddp.forward(x, /*use_branch=*/true).sum().backward();
  });
}

// SHOAL_DEBUG=detail (debug_detail): a parameter used on rank 0 and not on rank 1 fails on both
// ranks, naming the parameter and the ranks on each side (without it, rank 0 would wait for a
// reduction rank 1 never starts); and when every rank uses every parameter, training is exactly
// what it is without the mode.
TEST(DdpUnused, DebugDetailNamesTheRanksWhereTheUsedSetDiffers) {
  std::vector<std::vector<torch::Tensor>> trained[2];
  for (int detail = 0; detail < 2; ++detail) {
    trained[detail].resize(2);
    with_groups(2, [&](int rank, std::shared_ptr<comm::ProcessGroup> group) {
      // Ranks are threads: the weights and data come from generators of their own, not from
      // the process's (which the other rank's thread may be drawing from).
      auto g = at::make_generator<at::CPUGeneratorImpl>(3);
      Branchy model;
      {
        torch::NoGradGuard no_grad;
        for (auto& p : model->parameters()) p.copy_(torch::randn(p.sizes(), g) * 0.3);
      }
      auto options = small_buckets();
      options.debug_detail = detail == 1;
      DistributedDataParallel ddp(model, group, options);
      torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
      auto x = torch::randn({4, 6}, g) + rank;
      if (detail == 1) {
        try {
          ddp.forward(x, /*use_branch=*/rank == 0).sum().backward();
          ADD_FAILURE() << "expected an error on rank " << rank;
        } catch (const Error& e) {
          const std::string what = e.what();
          EXPECT_NE(what.find("'branch.weight' got no gradient on rank(s) 1 (a gradient on "
                              "rank(s) 0)"), std::string::npos) << what;
          EXPECT_NE(what.find("'branch.bias'"), std::string::npos) << what;
          EXPECT_EQ(what.find("'trunk.weight'"), std::string::npos) << what;
        }
        opt.zero_grad();
      }
      for (int step = 0; step < 3; ++step) {
        opt.zero_grad();
        ddp.forward(x, /*use_branch=*/true).sum().backward();
        opt.step();
      }
      trained[detail][rank] = clone_all(model->parameters());
    });
  }
  for (int rank = 0; rank < 2; ++rank) {
    for (size_t i = 0; i < trained[0][rank].size(); ++i) {
      EXPECT_TRUE(torch::equal(trained[0][rank][i], trained[1][rank][i])) << "rank " << rank;
    }
  }
}

// ---- buffers -------------------------------------------------------------------------------------

struct WithBatchNormImpl : torch::nn::Module {
  WithBatchNormImpl()
      : fc(register_module("fc", torch::nn::Linear(5, 6))),
        bn(register_module("bn", torch::nn::BatchNorm1d(6))) {}
  torch::Tensor forward(torch::Tensor x) { return bn(fc(x)); }
  torch::nn::Linear fc;
  torch::nn::BatchNorm1d bn;
};
TORCH_MODULE(WithBatchNorm);

TEST(DdpBuffers, BroadcastBuffersKeepsRankZerosRunningStatistics) {
  std::vector<std::vector<torch::Tensor>> buffers(2);
  with_groups(2, [&](int rank, std::shared_ptr<comm::ProcessGroup> group) {
    WithBatchNorm model;
    DistributedDataParallel ddp(model, group);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      auto x = torch::randn({4, 5}) * (rank + 1) + rank;  // different statistics on every rank
      ddp.forward(x).pow(2).mean().backward();
      opt.step();
    }
    auto local = clone_all(model->buffers());
    ddp.prepare_for_forward();  // what the next forward starts with
    buffers[rank] = clone_all(model->buffers());
    if (rank == 0) {
      for (size_t i = 0; i < local.size(); ++i) EXPECT_TRUE(torch::equal(local[i], buffers[0][i]));
    } else {
      EXPECT_FALSE(torch::equal(local[0], buffers[rank][0])) << "rank 1's own stats should differ";
    }
  });
  for (size_t i = 0; i < buffers[0].size(); ++i) {
    EXPECT_TRUE(torch::equal(buffers[0][i], buffers[1][i])) << "buffer " << i;
  }
}

// broadcast_buffers = false: every rank keeps its own running statistics (PyTorch's option).
TEST(DdpBuffers, WithoutBroadcastEveryRankKeepsItsOwnStatistics) {
  std::vector<std::vector<torch::Tensor>> buffers(2), expected(2);
  // Per rank: the module under DDP, and the same module run on this rank's data alone (no DDP).
  torch::manual_seed(3);
  WithBatchNorm original;
  std::vector<WithBatchNorm> models(2), alones(2);
  for (int r = 0; r < 2; ++r) {
    torch::NoGradGuard no_grad;
    for (auto* copy : {&models[r], &alones[r]}) {
      for (size_t i = 0; i < original->parameters().size(); ++i) {
        (*copy)->parameters()[i].copy_(original->parameters()[i]);
      }
    }
  }
  with_groups(2, [&](int rank, std::shared_ptr<comm::ProcessGroup> group) {
    WithBatchNorm model = models[rank];
    WithBatchNorm alone = alones[rank];
    DistributedDataParallelOptions options;
    options.broadcast_buffers = false;
    DistributedDataParallel ddp(model, group, options);
    EXPECT_FALSE(ddp.options().broadcast_buffers);
    for (int step = 0; step < 3; ++step) {
      auto x = torch::full({4, 5}, 1.0) * torch::arange(20).reshape({4, 5}) * (rank + 1) + rank;
      ddp.forward(x).pow(2).mean().backward();
      alone->forward(x);
    }
    ddp.prepare_for_forward();
    buffers[rank] = clone_all(model->buffers());
    expected[rank] = clone_all(alone->buffers());
  });
  for (int r = 0; r < 2; ++r) {
    for (size_t i = 0; i < buffers[r].size(); ++i) {
      EXPECT_TRUE(torch::allclose(buffers[r][i], expected[r][i], 1e-5, 1e-6)) << "rank " << r << " buffer " << i;
    }
  }
  EXPECT_FALSE(torch::equal(buffers[0][0], buffers[1][0])) << "rank 0's statistics were broadcast";
}

// named_buffers() and named_parameters() are the module's own, names and tensors.
TEST(DdpState, NamedBuffersAreTheModulesOwn) {
  with_groups(1, [&](int, std::shared_ptr<comm::ProcessGroup> group) {
    WithBatchNorm model;
    DistributedDataParallel ddp(model, group);
    const auto named = ddp.named_buffers();
    const auto own = model->named_buffers();
    ASSERT_EQ(named.size(), own.size());
    ASSERT_EQ(named.size(), 3u);  // bn.running_mean, bn.running_var, bn.num_batches_tracked
    for (size_t i = 0; i < own.size(); ++i) {
      EXPECT_EQ(named[i].key(), own[i].key());
      EXPECT_TRUE(named[i].value().is_same(own[i].value())) << own[i].key();
    }
    EXPECT_EQ(named[0].key(), "bn.running_mean");
  });
}

// A module called directly, with several outputs: prepare_for_backward(vector) tells DDP all of
// them, so find_unused_parameters sees that a parameter used by only the second output is used,
// and the averaged gradients equal one process's over both ranks' data.
struct TwoHeadsImpl : torch::nn::Module {
  TwoHeadsImpl()
      : trunk(register_module("trunk", torch::nn::Linear(4, 6))),
        left(register_module("left", torch::nn::Linear(6, 2))),
        right(register_module("right", torch::nn::Linear(6, 3))),
        unused(register_module("unused", torch::nn::Linear(6, 1))) {}
  std::vector<torch::Tensor> forward(torch::Tensor x) {
    auto h = torch::relu(trunk(x));
    return {left(h), right(h)};
  }
  torch::nn::Linear trunk, left, right, unused;
};
TORCH_MODULE(TwoHeads);

TEST(DdpUnused, PrepareForBackwardWithSeveralOutputs) {
  constexpr int kWorld = 2;
  torch::manual_seed(9);
  TwoHeads reference;
  std::vector<TwoHeads> models;
  for (int r = 0; r < kWorld; ++r) {
    models.emplace_back();
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < reference->parameters().size(); ++i) {
      models[r]->parameters()[i].copy_(reference->parameters()[i]);
    }
  }
  torch::manual_seed(10);
  const auto x = torch::randn({2 * kWorld, 4});
  auto loss_of = [](const std::vector<torch::Tensor>& outs) {
    return outs[0].pow(2).mean() + outs[1].abs().mean();
  };
  // Equal halves: the loss over the whole batch is the mean of the ranks' losses.
  loss_of(reference->forward(x)).backward();
  std::vector<std::vector<torch::Tensor>> grads(kWorld);
  with_groups(kWorld, [&](int rank, std::shared_ptr<comm::ProcessGroup> group) {
    DistributedDataParallelOptions options;
    options.find_unused_parameters = true;
    DistributedDataParallel ddp(models[rank], group, options);
    ddp.prepare_for_forward();
    auto outs = models[rank]->forward(x.narrow(0, rank * 2, 2));
    ddp.prepare_for_backward(outs);
    loss_of(outs).backward();
    for (const auto& p : models[rank]->parameters()) {
      grads[rank].push_back(p.grad().defined() ? p.grad().clone() : torch::zeros_like(p));
    }
  });
  auto ref = reference->parameters();
  for (int r = 0; r < kWorld; ++r) {
    for (size_t i = 0; i < ref.size(); ++i) {
      const auto want = ref[i].grad().defined() ? ref[i].grad() : torch::zeros_like(ref[i]);
      EXPECT_TRUE(torch::allclose(grads[r][i], want, 1e-5, 1e-6))
          << "rank " << r << " parameter " << i;
    }
  }
  // The right head, used only by the second output, got a gradient; the unused layer none.
  EXPECT_GT(grads[0][4].abs().sum().item<double>(), 0);
  EXPECT_EQ(grads[0][6].abs().sum().item<double>(), 0);
}

// Two branches that the ranks use differently in the same step, a shared trunk and a layer no
// rank uses: with find_unused_parameters each rank's used set differs, and only the union over
// the ranks (the allreduced used map) says which gradients to write.
struct TwoBranchesImpl : torch::nn::Module {
  TwoBranchesImpl()
      : trunk(register_module("trunk", torch::nn::Linear(5, 4))),
        a(register_module("a", torch::nn::Linear(4, 3))),
        b(register_module("b", torch::nn::Linear(4, 3))),
        never(register_module("never", torch::nn::Linear(4, 3))) {}
  torch::Tensor forward(torch::Tensor x, bool use_a, bool use_b) {
    auto h = torch::tanh(trunk(x));
    auto out = torch::zeros({x.size(0), 3}, x.options());
    if (use_a) out = out + a(h);
    if (use_b) out = out + b(h).pow(2);
    return out;
  }
  torch::nn::Linear trunk, a, b, never;
};
TORCH_MODULE(TwoBranches);

// Ranks that use different parameters in the same step: every rank ends with the average over
// the ranks of each rank's own gradient (zero where a rank did not use the parameter), as
// PyTorch's DDP gives; a parameter no rank used keeps no gradient. The reference runs the same
// model on each rank's data in one thread and averages, all in float64, so agreement is to 1e-12.
TEST(DdpUnused, RanksUsingDifferentBranchesGetTheAverageOfEveryRanksGradients) {
  for (int world : {2, 3}) {
    SCOPED_TRACE("world " + std::to_string(world));
    // Step 0: rank 0 uses a, rank 1 uses b, rank 2 both. Step 1: the other way round.
    auto uses = [](int step, int rank) {
      const bool first = rank % 2 == step % 2;
      return std::make_pair(rank == 2 || first, rank == 2 || !first);
    };
    auto data = [](int step, int rank) {
      auto g = at::make_generator<at::CPUGeneratorImpl>(40 + 10 * step + rank);
      return std::make_pair(torch::randn({3, 5}, g, torch::kDouble),
                            torch::randn({3, 3}, g, torch::kDouble));
    };
    auto initial = [](TwoBranches& model) {
      torch::NoGradGuard no_grad;
      auto g = at::make_generator<at::CPUGeneratorImpl>(8);
      model->to(torch::kDouble);
      for (auto& p : model->parameters()) p.copy_(torch::randn(p.sizes(), g, torch::kDouble));
    };
    constexpr int kSteps = 2;
    constexpr double kLr = 0.1;
    // The reference: each rank's gradient alone, averaged over the ranks; plain SGD.
    TwoBranches reference;
    initial(reference);
    std::vector<std::vector<torch::Tensor>> expected(kSteps);  // per step, per parameter
    std::vector<std::vector<bool>> expected_defined(kSteps);
    for (int step = 0; step < kSteps; ++step) {
      const auto params = reference->parameters();
      std::vector<torch::Tensor> sum;
      std::vector<bool> any(params.size(), false);
      for (const auto& p : params) sum.push_back(torch::zeros_like(p));
      for (int rank = 0; rank < world; ++rank) {
        for (auto& p : params) p.mutable_grad().reset();
        auto [x, y] = data(step, rank);
        auto [use_a, use_b] = uses(step, rank);
        torch::mse_loss(reference->forward(x, use_a, use_b), y).backward();
        for (size_t i = 0; i < params.size(); ++i) {
          if (!params[i].grad().defined()) continue;
          sum[i] += params[i].grad();
          any[i] = true;
        }
      }
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < params.size(); ++i) {
        sum[i] /= world;
        if (any[i]) params[i].sub_(kLr * sum[i]);
      }
      expected[step] = sum;
      expected_defined[step] = any;
    }
    ASSERT_FALSE(expected_defined[0][6]) << "the layer 'never' is used by no rank";
    ASSERT_TRUE(expected_defined[0][2] && expected_defined[0][4]);

    std::vector<std::vector<std::vector<torch::Tensor>>> grads(world);  // rank, step, parameter
    with_groups(world, [&](int rank, std::shared_ptr<comm::ProcessGroup> group) {
      TwoBranches model;
      initial(model);
      auto options = small_buckets();
      options.find_unused_parameters = true;
      DistributedDataParallel ddp(model, group, options);
      for (int step = 0; step < kSteps; ++step) {
        for (auto& p : model->parameters()) p.mutable_grad().reset();
        auto [x, y] = data(step, rank);
        auto [use_a, use_b] = uses(step, rank);
        torch::mse_loss(ddp.forward(x, use_a, use_b), y).backward();
        std::vector<torch::Tensor> step_grads;
        torch::NoGradGuard no_grad;
        for (auto& p : model->parameters()) {
          step_grads.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
          if (p.grad().defined()) p.sub_(kLr * p.grad());
        }
        grads[rank].push_back(step_grads);
      }
    });
    const auto names = TwoBranches()->named_parameters().keys();
    for (int rank = 0; rank < world; ++rank) {
      for (int step = 0; step < kSteps; ++step) {
        for (size_t i = 0; i < names.size(); ++i) {
          const auto& got = grads[rank][step][i];
          const std::string where = "rank " + std::to_string(rank) + " step " +
                                    std::to_string(step) + " " + names[i];
          ASSERT_EQ(got.defined(), static_cast<bool>(expected_defined[step][i]))
              << where << ": gradient defined differently from PyTorch's DDP";
          if (!got.defined()) continue;
          const double error = (got - expected[step][i]).abs().max().item<double>();
          EXPECT_LE(error, 1e-12 * std::max(1.0, expected[step][i].abs().max().item<double>()))
              << where;
        }
      }
    }
  }
}

// ---- bucket order --------------------------------------------------------------------------------

// Records, for each call of the communication hook, the bucket's index and its parameters as
// positions in the module's registration order, then reduces as the default hook does.
struct BucketLog {
  std::vector<size_t> calls;                        // bucket indices, in the order reduced
  std::map<size_t, std::vector<size_t>> contents;  // bucket index -> parameter positions
};

CommHook recording_hook(std::shared_ptr<comm::ProcessGroup> group,
                        std::vector<torch::Tensor> registered, BucketLog* log) {
  auto inner = allreduce_hook(group);
  return [inner, registered, log](GradBucket& bucket) {
    log->calls.push_back(bucket.index());
    std::vector<size_t> positions;
    for (const auto& p : bucket.parameters()) {
      size_t k = 0;
      while (k < registered.size() && !registered[k].is_same(p)) ++k;
      positions.push_back(k);
    }
    log->contents[bucket.index()] = positions;
    return inner(bucket);
  };
}

// The initial buckets hold the parameters in reverse registration order (gradients arrive roughly
// in that order, so the first bucket is ready first): bucket 0 holds the last registered
// parameters, and reading the buckets in index order gives the parameters last to first. Observed
// through a comm hook in the first backward (before any rebuild from the arrival order), with one
// parameter per bucket and with several.
template <typename Holder>
void expect_reverse_registration_buckets(const std::string& model_name, double first_cap_mb,
                                         double cap_mb) {
  SCOPED_TRACE(model_name + " caps " + std::to_string(first_cap_mb) + "/" + std::to_string(cap_mb) +
               " MB");
  const size_t n = Holder()->parameters().size();
  std::vector<BucketLog> logs(2);
  with_groups(2, [&](int rank, std::shared_ptr<comm::ProcessGroup> group) {
    Holder model;
    DistributedDataParallelOptions options;
    options.first_bucket_cap_mb = first_cap_mb;
    options.bucket_cap_mb = cap_mb;
    DistributedDataParallel ddp(model, group, options);
    ddp.register_comm_hook(recording_hook(group, model->parameters(), &logs[rank]));
    auto [x, y] = make_batch(model_name, 0, 2);
    torch::nll_loss(ddp.forward(x), y).backward();
  });
  std::vector<size_t> reversed;
  for (size_t k = n; k-- > 0;) reversed.push_back(k);
  for (int rank = 0; rank < 2; ++rank) {
    const BucketLog& log = logs[rank];
    ASSERT_GE(log.calls.size(), 2u) << "rank " << rank << ": the test needs several buckets";
    for (size_t i = 0; i < log.calls.size(); ++i) {
      EXPECT_EQ(log.calls[i], i) << "rank " << rank << ": buckets reduced out of order";
    }
    std::vector<size_t> read;
    for (const auto& [index, positions] : log.contents) {
      read.insert(read.end(), positions.begin(), positions.end());
    }
    EXPECT_EQ(read, reversed) << "rank " << rank
                              << ": the buckets, read in index order, are not the parameters in "
                                 "reverse registration order";
    if (first_cap_mb < 1e-6) EXPECT_EQ(log.calls.size(), n) << "one parameter per bucket";
  }
}

TEST(DdpBuckets, InitialBucketsFollowReverseRegistrationOrder) {
  constexpr double kOneParameter = 1e-9;  // every bucket is full after one parameter
  expect_reverse_registration_buckets<SmallMlp>("mlp", kOneParameter, kOneParameter);
  expect_reverse_registration_buckets<SmallMlp>("mlp", 0.0005, 0.004);
  expect_reverse_registration_buckets<SmallCnn>("cnn", kOneParameter, kOneParameter);
  expect_reverse_registration_buckets<SmallCnn>("cnn", 0.0005, 0.004);
}

// ---- join ----------------------------------------------------------------------------------------

void join_uneven_inputs(const std::string& backend, bool bucket_view, bool auto_cap = false) {
  constexpr int kWorld = 3;
  const int batches[kWorld] = {5, 2, 0};  // rank 2 has no data at all
  std::vector<SmallMlp> models;
  for (int r = 0; r < kWorld; ++r) {
    torch::manual_seed(11 + r);
    models.emplace_back();
  }
  SmallMlp reference;
  {
    torch::NoGradGuard no_grad;
    auto src = models[0]->parameters();
    auto dst = reference->parameters();
    for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
  }
  // Expected: each step averages the active ranks' gradients over the full world size.
  torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < 5; ++step) {
    ref_opt.zero_grad();
    auto [x, y] = make_batch("mlp", step, kBatchPerRank * kWorld);
    for (int r = 0; r < kWorld; ++r) {
      if (step >= batches[r]) continue;
      auto xr = x.narrow(0, r * kBatchPerRank, kBatchPerRank);
      auto yr = y.narrow(0, r * kBatchPerRank, kBatchPerRank);
      (torch::nll_loss(reference->forward(xr), yr) / kWorld).backward();
    }
    ref_opt.step();
  }
  std::vector<std::vector<torch::Tensor>> results(kWorld);
  std::vector<int64_t> shadowed(kWorld);
  with_groups(
      kWorld,
      [&](int rank, std::shared_ptr<comm::ProcessGroup> group) {
        auto options = small_buckets();
        options.gradient_as_bucket_view = bucket_view;
        if (auto_cap) {
          // Switches of cap at steps 2 and 4, while ranks 1 and 2 shadow the others' steps.
          use_auto_cap(options);
          options.bucket_cap_candidates_mb = {0.0001, 1.0};
          options.bucket_cap_tuning_rounds = 1;
        }
        DistributedDataParallel ddp(models[rank], group, options);
        torch::optim::SGD opt(ddp.module()->parameters(),
                              torch::optim::SGDOptions(0.1).momentum(0.9));
        auto join = ddp.join();
        for (int step = 0; step < batches[rank]; ++step) {
          opt.zero_grad();
          auto [x, y] = make_batch("mlp", step, kBatchPerRank * kWorld);
          auto xr = x.narrow(0, rank * kBatchPerRank, kBatchPerRank);
          auto yr = y.narrow(0, rank * kBatchPerRank, kBatchPerRank);
          torch::nll_loss(ddp.forward(xr), yr).backward();
          opt.step();
        }
        shadowed[rank] = join.finish();
        results[rank] = clone_all(ddp.module()->parameters());
      },
      backend);
  EXPECT_EQ(shadowed[0], 0);
  EXPECT_EQ(shadowed[1], 3);
  EXPECT_EQ(shadowed[2], 5);
  EXPECT_LE(max_relative_difference(results[0], clone_all(reference->parameters())), 1e-5);
  // Join ends by giving every rank the model of the last rank to finish (rank 0 here).
  for (int r = 1; r < kWorld; ++r) {
    for (size_t i = 0; i < results[0].size(); ++i) {
      EXPECT_TRUE(torch::equal(results[r][i], results[0][i])) << "rank " << r << " tensor " << i;
    }
  }
}

TEST(DdpJoin, UnevenInputsFinishWithTheExpectedGradients) { join_uneven_inputs("gloo", false); }

// On shm the buckets live in symmetric memory, which the joined ranks' reductions must use too.
TEST(DdpJoin, UnevenInputsOnSharedMemoryWithBucketViews) { join_uneven_inputs("shm", true); }

// bucket_cap_mb = auto changes the buckets at the same steps on the joined ranks, which shadow the
// active ranks' reductions with buckets of the same sizes.
TEST(DdpJoin, UnevenInputsWhileBucketCapAutoTunes) { join_uneven_inputs("shm", false, true); }

// ---- bucket_cap_mb = auto -------------------------------------------------------------------------

// A communication hook that takes `delay` per bucket before reducing: the more buckets a cap gives,
// the slower its steps, by at least `delay` per extra bucket, whatever the machine is doing.
CommHook slow_hook(std::shared_ptr<comm::ProcessGroup> group, Milliseconds delay) {
  auto inner = allreduce_hook(group);
  return [inner, delay](GradBucket& bucket) {
    std::this_thread::sleep_for(delay);
    return inner(bucket);
  };
}

// The tuning tries every cap that gives different buckets, interleaved over the rounds (each for
// one warm-up step and the timed ones), then keeps the one with the least median step time on
// every rank: with a cost per bucket, the cap with the fewest buckets.
TEST(DdpBucketCapAuto, TriesEachDistinctCapInTurnThenKeepsTheFastest) {
  constexpr int kRounds = 3, kTimed = 2, kSteps = 60;
  // Per rank: the (first, other) bucket caps of each step's buckets.
  std::vector<std::vector<std::pair<double, double>>> caps(2);
  std::vector<std::vector<size_t>> buckets(2);       // per rank: how many buckets each step had
  std::vector<std::vector<bool>> tuning(2);
  std::vector<ReducerStats> last(2);
  with_groups(2, [&](int rank, std::shared_ptr<comm::ProcessGroup> group) {
    SmallMlp model;
    auto options = small_buckets();
    use_auto_cap(options);
    options.bucket_cap_tuning_rounds = kRounds;
    options.bucket_cap_tuning_steps = kTimed;
    DistributedDataParallel ddp(model, group, options);
    ddp.register_comm_hook(slow_hook(group, Milliseconds(20)));
    torch::optim::SGD optimizer(ddp.module()->parameters(), torch::optim::SGDOptions(0.01));
    for (int step = 0; step < kSteps; ++step) {
      optimizer.zero_grad();
      auto [x, y] = make_batch("mlp", step, 4);
      auto loss = torch::nll_loss(ddp.forward(x), y);
      const ReducerStats now = ddp.stats();  // the buckets this step's backward uses
      caps[rank].emplace_back(now.first_bucket_cap_mb, now.bucket_cap_mb);
      buckets[rank].push_back(now.bucket_bytes.size());
      tuning[rank].push_back(now.bucket_cap_tuning);
      loss.backward();
      optimizer.step();
    }
    last[rank] = ddp.stats();
  });
  EXPECT_EQ(caps[0], caps[1]);
  EXPECT_EQ(buckets[0], buckets[1]);
  const auto& trials = last[0].bucket_cap_trials;
  ASSERT_GE(trials.size(), 2u) << "the candidates should give at least two different bucket sets";
  ASSERT_FALSE(last[0].bucket_cap_tuning);
  // Step 0 runs with the initial buckets; from step 1 (after the rebuild) each distinct cap runs
  // 1 + kTimed steps in turn, the round over every cap kRounds times; then the choice stays.
  const size_t n = trials.size();
  const size_t tuned = n * kRounds * (1 + kTimed);
  ASSERT_LT(1 + tuned, static_cast<size_t>(kSteps));
  auto pair_of = [](const ReducerStats::BucketCapTrial& trial) {
    return std::make_pair(trial.first_bucket_cap_mb, trial.bucket_cap_mb);
  };
  std::map<std::pair<double, double>, size_t> buckets_of;
  for (size_t k = 0; k < tuned; ++k) {
    const auto expected = pair_of(trials[(k / (1 + kTimed)) % n]);
    EXPECT_EQ(caps[0][1 + k], expected) << "step " << 1 + k;
    EXPECT_TRUE(tuning[0][1 + k]) << "step " << 1 + k;
    buckets_of[expected] = buckets[0][1 + k];
  }
  size_t best = 0;
  for (size_t c = 0; c < n; ++c) {
    EXPECT_TRUE(std::isfinite(trials[c].seconds) && trials[c].seconds > 0) << c;
    if (trials[c].seconds < trials[best].seconds) best = c;
  }
  for (size_t k = 1 + tuned; k < caps[0].size(); ++k) {
    EXPECT_EQ(caps[0][k], pair_of(trials[best])) << "step " << k;
    EXPECT_FALSE(tuning[0][k]) << "step " << k;
  }
  EXPECT_EQ(last[1].bucket_cap_trials, trials) << "every rank decides on the same times";
  // 20 ms per bucket: the candidate with the fewest buckets wins.
  size_t fewest = buckets_of.begin()->second;
  for (const auto& [cap, count] : buckets_of) fewest = std::min(fewest, count);
  EXPECT_EQ(buckets_of[pair_of(trials[best])], fewest)
      << "kept " << trials[best].first_bucket_cap_mb << "/" << trials[best].bucket_cap_mb
      << " MiB with " << buckets_of[pair_of(trials[best])] << " buckets";
}

TEST(DdpBucketCapAuto, BadOptionsAreRefusedAtConstruction) {
  with_groups(1, [&](int, std::shared_ptr<comm::ProcessGroup> group) {
    auto make = [&](const DistributedDataParallelOptions& options) {
      SmallMlp model;
      DistributedDataParallel ddp(model, group, options);
    };
    DistributedDataParallelOptions options;
    options.bucket_cap_mb = -5;  // not kBucketCapAuto
    EXPECT_THROW(make(options), InvalidArgument);
    use_auto_cap(options);
    options.bucket_cap_candidates_mb = {};
    EXPECT_THROW(make(options), InvalidArgument);
    options.bucket_cap_candidates_mb = {1.0, 0.0};
    EXPECT_THROW(make(options), InvalidArgument);
    options.bucket_cap_candidates_mb = {1.0};
    options.bucket_cap_tuning_steps = 0;
    EXPECT_THROW(make(options), InvalidArgument);
    options.bucket_cap_tuning_steps = 1;
    EXPECT_NO_THROW(make(options));
  });
}

// ---- communication hooks -------------------------------------------------------------------------

std::vector<torch::Tensor> train_with_hook(const std::string& which, std::atomic<int>* calls,
                                           size_t* buckets) {
  constexpr int kWorld = 2;
  torch::manual_seed(5);  // the same initial model for every hook
  std::vector<SmallMlp> models(kWorld);
  std::vector<torch::Tensor> result;
  with_groups(kWorld, [&](int rank, std::shared_ptr<comm::ProcessGroup> group) {
    DistributedDataParallel ddp(models[rank], group, small_buckets());
    if (which == "fp16") ddp.register_comm_hook(fp16_compress_hook(group));
    if (which == "bf16") ddp.register_comm_hook(bf16_compress_hook(group));
    if (which == "fp16_wrapper") {
      ddp.register_comm_hook(fp16_compress_wrapper(allreduce_hook(group)));
    }
    if (which == "new_tensor") {
      // The result is a new tensor (PyTorch's hook returning a future of another tensor).
      ddp.register_comm_hook([group](GradBucket& bucket) {
        auto copy = bucket.buffer().clone();
        comm::AllreduceOptions options;
        options.op = comm::ReduceOp::kSum;
        auto work = group->allreduce(copy, options);
        return then(std::move(work), [&bucket, copy, group]() mutable {
          bucket.buffer() = copy.div_(group->size());
        });
      });
    }
    if (which == "custom") {
      auto inner = allreduce_hook(group);
      ddp.register_comm_hook([inner, calls](GradBucket& bucket) {
        ++*calls;
        return inner(bucket);
      });
    }
    torch::optim::SGD opt(ddp.module()->parameters(), torch::optim::SGDOptions(0.05));
    for (int step = 0; step < 10; ++step) {
      opt.zero_grad();
      auto [x, y] = make_batch("mlp", step, 2 * kBatchPerRank);
      torch::nll_loss(ddp.forward(x.narrow(0, rank * kBatchPerRank, kBatchPerRank)),
                      y.narrow(0, rank * kBatchPerRank, kBatchPerRank))
          .backward();
      opt.step();
    }
    if (rank == 0) {
      result = clone_all(ddp.module()->parameters());
      if (buckets) *buckets = ddp.stats().bucket_bytes.size();
    }
  });
  return result;
}

TEST(DdpCommHooks, CompressionStaysCloseAndCustomHooksRunOncePerBucket) {
  std::atomic<int> calls{0};
  size_t buckets = 0;
  auto fp32 = train_with_hook("default", nullptr, nullptr);
  auto fp16 = train_with_hook("fp16", nullptr, nullptr);
  auto bf16 = train_with_hook("bf16", nullptr, nullptr);
  auto custom = train_with_hook("custom", &calls, &buckets);
  auto new_tensor = train_with_hook("new_tensor", nullptr, nullptr);
  auto fp16_wrapper = train_with_hook("fp16_wrapper", nullptr, nullptr);
  EXPECT_LE(max_relative_difference(fp16_wrapper, fp32), 5e-3);
  EXPECT_GT(max_relative_difference(fp16_wrapper, fp32), 0) << "fp16 compression should round";
  EXPECT_LE(max_relative_difference(new_tensor, fp32), 1e-6);
  EXPECT_LE(max_relative_difference(fp16, fp32), 5e-3);
  EXPECT_GT(max_relative_difference(fp16, fp32), 0) << "fp16 compression should round";
  EXPECT_LE(max_relative_difference(bf16, fp32), 3e-2);
  EXPECT_GT(max_relative_difference(bf16, fp32), 0) << "bf16 compression should round";
  EXPECT_EQ(max_relative_difference(custom, fp32), 0);
  EXPECT_EQ(calls.load(), static_cast<int>(2 * 10 * buckets));  // 2 ranks x 10 steps x buckets
}

// The compressing hooks, bucket by bucket, give exactly what rounding to the wire type implies:
// rank r holds 1 + r + d with d below the wire type's resolution at 1 and 2 but above float's,
// so a hook that does not round (or rounds to the wrong type) gives a different, exact answer.
void expect_hook_rounds(const std::string& which, double d, double expected) {
  constexpr int kWorld = 2;
  std::vector<at::Tensor> buffers(kWorld);
  with_groups(kWorld, [&](int rank, std::shared_ptr<comm::ProcessGroup> group) {
    CommHook hook = which == "fp16" ? fp16_compress_hook(group) : bf16_compress_hook(group);
    at::Tensor buffer = torch::full({7}, 1.0 + rank + d, torch::kFloat);
    GradBucket bucket(0, true, buffer, {buffer}, {buffer});
    hook(bucket)->wait();
    EXPECT_EQ(bucket.buffer().scalar_type(), torch::kFloat);
    buffers[rank] = bucket.buffer().clone();
  });
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_TRUE(torch::equal(buffers[r], torch::full({7}, expected, torch::kFloat)))
        << which << " rank " << r << ": " << buffers[r][0].item<double>() << " want " << expected;
  }
}

TEST(DdpCommHooks, CompressionRoundsToTheWireTypeExactly) {
  // 2^-13 is below fp16's step at 1 (2^-10) but not float's: (1 + 2) / 2 after rounding, while
  // a float32 average would be 1.5 + 2^-13.
  expect_hook_rounds("fp16", std::ldexp(1.0, -13), 1.5);
  // 2^-9 survives fp16 (exact at 1, 2 and their halves) but not bf16 (step 2^-7 at 1): bf16 gives
  // exactly 1.5, fp16 exactly 1.5 + 2^-9.
  expect_hook_rounds("bf16", std::ldexp(1.0, -9), 1.5);
  expect_hook_rounds("fp16", std::ldexp(1.0, -9), 1.5 + std::ldexp(1.0, -9));
}

// ---- PowerSGD ------------------------------------------------------------------------------------

// Trains SmallMlp for `steps` on a learnable task (labels from a fixed random teacher), 2 ranks;
// returns rank 0's final training loss over the whole data and each rank's parameters.
struct PowerSgdRun {
  double initial_loss = 0;
  double loss = 0;
  double bytes_per_step = 0;  // after compression started
  std::vector<std::vector<torch::Tensor>> params;
};

PowerSgdRun train_power_sgd(int64_t rank_r, bool wrap_bf16) {
  constexpr int kWorld = 2, kSteps = 80, kStart = 10;
  torch::manual_seed(3);
  auto teacher = torch::randn({20, 10});
  auto x = torch::randn({256, 20});
  auto y = x.matmul(teacher).argmax(1);
  std::vector<SmallMlp> models(kWorld);
  PowerSgdRun run;
  run.params.resize(kWorld);
  with_groups(kWorld, [&](int rank, std::shared_ptr<comm::ProcessGroup> group) {
    DistributedDataParallel ddp(models[rank], group, small_buckets());
    auto state = std::make_shared<PowerSGDState>();
    state->matrix_approximation_rank = rank_r;
    state->start_powerSGD_iter = kStart;
    if (rank_r > 0) {
      auto hook = powerSGD_hook(group, state);
      // (CPU matmul has no float16 kernel in LibTorch 1.13: bfloat16 around PowerSGD.)
      ddp.register_comm_hook(wrap_bf16 ? bf16_compress_wrapper(hook) : hook);
    }
    torch::optim::SGD opt(ddp.module()->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    double bytes_at_start = 0;
    if (rank == 0) {
      torch::NoGradGuard no_grad;
      run.initial_loss = torch::nll_loss(ddp.module()->forward(x), y).item<double>();
    }
    for (int step = 0; step < kSteps; ++step) {
      if (step == kStart) bytes_at_start = state->bytes_sent;
      opt.zero_grad();
      auto xr = x.narrow(0, (step * 16 + rank * 8) % 256, 8);
      auto yr = y.narrow(0, (step * 16 + rank * 8) % 256, 8);
      torch::nll_loss(ddp.forward(xr), yr).backward();
      opt.step();
    }
    run.params[rank] = clone_all(ddp.module()->parameters());
    if (rank == 0) {
      torch::NoGradGuard no_grad;
      run.loss = torch::nll_loss(ddp.module()->forward(x), y).item<double>();
      run.bytes_per_step = (state->bytes_sent - bytes_at_start) / (kSteps - kStart);
    }
  });
  return run;
}

TEST(DdpCommHooks, PowerSgdConvergesLikeAllreduceWithFewerBytes) {
  auto plain = train_power_sgd(0, false);
  auto rank2 = train_power_sgd(2, false);
  auto rank2_bf16 = train_power_sgd(2, true);
  std::printf("loss from %.4f to: allreduce %.4f, PowerSGD rank 2 %.4f (bf16 wrapped %.4f); "
              "PowerSGD sends %.0f bytes per step\n", plain.initial_loss, plain.loss, rank2.loss,
              rank2_bf16.loss, rank2.bytes_per_step);
  // Progress = drop of the loss over the whole data; compression may cost a little of it.
  const double progress = plain.initial_loss - plain.loss;
  EXPECT_GT(progress, 0.5 * plain.initial_loss) << "the task is learnable";
  // (The hook's numbers are PyTorch's own, Cases.PowerSgd*; here rank 2 keeps 77% of the progress.)
  EXPECT_GT(rank2.initial_loss - rank2.loss, 0.7 * progress);
  EXPECT_GT(rank2_bf16.initial_loss - rank2_bf16.loss, 0.6 * progress) << "bfloat16 P and Q";
  int64_t dense_bytes = 0;
  for (const auto& p : plain.params[0]) dense_bytes += p.numel() * 4;
  EXPECT_GT(rank2.bytes_per_step, 0);
  EXPECT_LT(rank2.bytes_per_step, dense_bytes / 3.0);
  // Every rank applies the same averaged approximation: replicas stay equal.
  for (size_t i = 0; i < rank2.params[0].size(); ++i) {
    EXPECT_TRUE(torch::equal(rank2.params[0][i], rank2.params[1][i])) << "tensor " << i;
  }
  EXPECT_GT(max_relative_difference(rank2.params[0], plain.params[0]), 0) << "compression ran";
}

// A Work that fails like a broken connection.
class FailedWork : public comm::Work {
 public:
  FailedWork() : comm::Work(0, "allreduce") {}
  bool is_completed() override { return true; }
  void wait(comm::Milliseconds) override {
    throw PeerError("peer rank 1 closed the connection");
  }
  std::exception_ptr exception() override { return nullptr; }
};

// ---- bucket_reduction ---------------------------------------------------------------------------

// inline: every bucket is reduced by the autograd hook that fills it, on the training thread
// (the shm group counts each such collective), and the result is what overlapped gives, bit for
// bit; overlapped: the backend's thread reduces them.
TEST(DdpBucketReduction, InlineReducesEachBucketOnTheTrainingThread) {
  constexpr int kStepsHere = 4;
  // Weights and batches made before the ranks start (the global generator is not per thread).
  // Buckets of 256 KiB and more, far above what shm runs on the calling thread by itself (32 KiB).
  torch::manual_seed(7);
  SmallMlp initial(256, 256);
  const auto batches = batches_of(2, kStepsHere + 2, 256);
  std::map<std::string, std::vector<std::vector<torch::Tensor>>> results;
  for (const std::string reduction : {"overlapped", "inline"}) {
    std::vector<SmallMlp> models = replicas_of(initial, 2, 256);
    std::vector<std::vector<torch::Tensor>> params(2);
    // fc3's .grad while fc1's gradient is computed, before backward ends.
    std::vector<torch::Tensor> fc3_grad_during(2);
    with_groups(2, [&](int rank, std::shared_ptr<comm::ProcessGroup> group) {
      auto* shm = dynamic_cast<comm::shm::ProcessGroupShm*>(group.get());
      ASSERT_NE(shm, nullptr);
      DistributedDataParallelOptions options;
      options.first_bucket_cap_mb = 0.2;
      options.bucket_cap_mb = 0.2;
      options.bucket_reduction = parse_bucket_reduction(reduction);
      DistributedDataParallel ddp(models[rank], group, options);
      models[rank]->fc1->weight.register_hook([&, rank](const torch::Tensor&) {
        fc3_grad_during[rank] = models[rank]->fc3->weight.grad().clone();
      });
      EXPECT_EQ(ddp.stats().inline_reduction, reduction == "inline");
      torch::optim::SGD optimizer(ddp.module()->parameters(), torch::optim::SGDOptions(0.1));
      auto step = [&](int index) {
        optimizer.zero_grad();
        const auto& [x, y] = batches[rank][index];
        torch::nll_loss(ddp.forward(x), y).backward();
        optimizer.step();
      };
      // The buckets are rebuilt at the second forward (with a small collective of their own).
      step(0);
      step(1);
      uint64_t ran_inline = 0;  // collectives the steps ran on this thread
      const double waited_before = ddp.stats().wait_seconds;
      for (int index = 2; index < kStepsHere + 2; ++index) {
        // Rank 1 late by 100 ms: rank 0 waits for it in its reductions, inline in the hooks,
        // overlapped at the end of backward; either way that is waiting.
        group->barrier()->wait();
        if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(100));
        const uint64_t before = shm->collectives_run_inline();
        step(index);
        ran_inline += shm->collectives_run_inline() - before;
      }
      const double waited = ddp.stats().wait_seconds - waited_before;
      // A lenient bound (a quarter of the lateness): rank 0 reaches its first reduction within
      // 75 ms of the barrier even on a loaded machine.
      if (rank == 0) EXPECT_GE(waited, kStepsHere * 0.025) << reduction;
      const auto buckets = ddp.stats().bucket_bytes;
      ASSERT_GE(buckets.size(), 2u);
      for (int64_t bytes : buckets) EXPECT_GT(bytes, 32 << 10);
      const ReducerStats stats = ddp.stats();
      EXPECT_GT(stats.reduced_bytes, 0);
      if (reduction == "inline") {
        EXPECT_EQ(ran_inline, kStepsHere * buckets.size()) << "rank " << rank;
        // Waited for where each bucket filled: nothing was hidden.
        EXPECT_EQ(stats.hidden_bytes, 0) << "rank " << rank;
      } else {
        EXPECT_EQ(ran_inline, 0u) << "rank " << rank;
      }
      params[rank] = clone_all(ddp.module()->parameters());
    }, "shm");
    for (size_t i = 0; i < params[0].size(); ++i) {
      EXPECT_TRUE(torch::equal(params[0][i], params[1][i])) << reduction << ": ranks differ";
    }
    // Plain gradients: inline, fc3's bucket (reduced before fc1's gradient exists) has written
    // its .grads already, the same average on both ranks; overlapped, they are still each
    // rank's own until the end of backward.
    ASSERT_TRUE(fc3_grad_during[0].defined() && fc3_grad_during[1].defined());
    EXPECT_EQ(torch::equal(fc3_grad_during[0], fc3_grad_during[1]), reduction == "inline")
        << reduction;
    results[reduction] = params;
  }
  for (size_t i = 0; i < results["inline"][0].size(); ++i) {
    EXPECT_TRUE(torch::equal(results["inline"][0][i], results["overlapped"][0][i])) << "tensor " << i;
  }
}

// Plain gradients reduced inline live in the buckets' memory as tensors of their own: after the
// first step autograd accumulates into them and nothing is copied in or out. What LibTorch's plain
// gradients promise still holds: each .grad is its own storage, not a view; a .grad (or a view of
// it) kept across zero_grad(set_to_none) keeps its values while the next step writes the slot; a
// .grad kept across an in-place zero_grad is the one that receives the next average; a .grad the
// caller assigned and still holds receives the average by a copy; the gradients outlive DDP.
TEST(DdpBucketReduction, InlinePlainGradientsLiveInTheBucketsAsTensorsOfTheirOwn) {
  torch::manual_seed(11);
  SmallMlp initial(64, 64);
  const auto batches = batches_of(2, 8, 64);
  std::vector<SmallMlp> models = replicas_of(initial, 2, 64);
  std::vector<std::vector<torch::Tensor>> averaged(2);  // step 5's gradients, per rank
  // Step 3 (after set_to_none) reduces gradients autograd has just allocated: its result against
  // each rank's own gradient alone.
  std::vector<std::vector<torch::Tensor>> local(2), step3(2);
  for (int rank = 0; rank < 2; ++rank) {
    auto alone = replicas_of(initial, 1, 64)[0];
    const auto& [x, y] = batches[rank][3];
    torch::nll_loss(alone->forward(x), y).backward();
    for (const auto& p : alone->parameters()) local[rank].push_back(p.grad().clone());
  }
  with_groups(2, [&](int rank, std::shared_ptr<comm::ProcessGroup> group) {
    DistributedDataParallelOptions options;
    options.first_bucket_cap_mb = 0.01;
    options.bucket_cap_mb = 0.01;
    options.bucket_reduction = parse_bucket_reduction("inline");
    auto ddp = std::make_unique<DistributedDataParallel<shoal::testing::SmallMlpImpl>>(models[rank], group, options);
    const auto params = models[rank]->parameters();
    auto zero_in_place = [&] {
      for (const auto& p : params) {
        if (p.grad().defined()) p.mutable_grad().zero_();
      }
    };
    auto set_to_none = [&] {
      for (const auto& p : params) p.mutable_grad().reset();
    };
    auto backward = [&](int index) {
      const auto& [x, y] = batches[rank][index];
      torch::nll_loss(ddp->forward(x), y).backward();
    };
    backward(0);  // private gradients from autograd, become slot gradients when backward ends
    zero_in_place();
    backward(1);  // buckets rebuilt at this forward: the gradients move with them
    std::vector<const void*> addresses;
    for (const auto& p : params) {
      const auto& g = p.grad();
      EXPECT_TRUE(group->is_symmetric(g)) << "a gradient outside the buckets";
      EXPECT_FALSE(g.is_view());
      EXPECT_EQ(g.storage_offset(), 0);
      EXPECT_EQ(g.storage().nbytes(), static_cast<size_t>(g.numel()) * g.element_size());
      addresses.push_back(g.data_ptr());
    }
    double copied = ddp->stats().copied_bytes;
    zero_in_place();
    backward(2);
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_EQ(params[i].grad().data_ptr(), addresses[i]) << "accumulated in place, not moved";
    }
    EXPECT_EQ(ddp->stats().copied_bytes, copied) << "a step copied gradients";
    int64_t all_bytes = 0;
    for (const auto& p : params) all_bytes += p.numel() * p.element_size();

    // Kept across set_to_none: the kept tensor and a kept view keep their values.
    auto kept = params[0].grad();
    const auto kept_values = kept.clone();
    auto kept_view = params[2].grad().view({-1});
    const auto kept_view_values = kept_view.clone();
    set_to_none();
    copied = ddp->stats().copied_bytes;
    backward(3);
    // Autograd's new gradients copied in, none out (they became the slots' tensors when backward
    // ended), and the two kept gradients moved out.
    EXPECT_EQ(ddp->stats().copied_bytes - copied,
              static_cast<double>(all_bytes + kept.nbytes() + params[2].nbytes()));
    for (const auto& p : params) step3[rank].push_back(p.grad().clone());
    EXPECT_TRUE(torch::equal(kept, kept_values)) << "a kept .grad changed under the next step";
    EXPECT_TRUE(torch::equal(kept_view, kept_view_values)) << "a kept view changed";
    EXPECT_FALSE(group->is_symmetric(kept)) << "a kept .grad should have moved out of the slot";
    EXPECT_FALSE(kept.is_same(params[0].grad()));
    for (const auto& p : params) EXPECT_TRUE(group->is_symmetric(p.grad()));

    // Kept across an in-place zero: it is the .grad, and receives step 4's average.
    auto same = params[1].grad();
    zero_in_place();
    backward(4);
    EXPECT_TRUE(same.is_same(params[1].grad()));

    // Assigned by the caller and still held by it: the average is copied into it.
    auto mine = torch::zeros_like(params[3]);
    params[3].mutable_grad() = mine;
    zero_in_place();
    backward(5);
    EXPECT_TRUE(mine.is_same(params[3].grad()));
    EXPECT_FALSE(group->is_symmetric(mine));
    for (const auto& p : params) averaged[rank].push_back(p.grad().clone());
    params[0].grad().detach_();  // a plain tensor, not a view: LibTorch's zero_grad() calls this

    // DDP and its group gone: the gradients stay readable and accumulate without DDP.
    std::vector<torch::Tensor> before;
    for (const auto& p : params) before.push_back(p.grad().clone());
    ddp.reset();
    group.reset();
    const auto& [x, y] = batches[rank][6];
    torch::nll_loss(models[rank]->forward(x), y).backward();
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_FALSE(torch::equal(params[i].grad(), before[i])) << "parameter " << i;
    }
  }, "shm");
  for (size_t i = 0; i < averaged[0].size(); ++i) {
    EXPECT_TRUE(torch::equal(averaged[0][i], averaged[1][i])) << "ranks differ at parameter " << i;
  }
  for (size_t i = 0; i < local[0].size(); ++i) {
    const auto expected = (local[0][i] + local[1][i]) / 2;
    EXPECT_TRUE(torch::equal(step3[0][i], step3[1][i])) << "ranks differ at parameter " << i;
    EXPECT_TRUE(torch::allclose(step3[0][i], expected, 1e-6, 1e-7))
        << "parameter " << i << ": max difference "
        << (step3[0][i] - expected).abs().max().item<float>();
  }
}

// With zero_grad(set_to_none) each backward gives every parameter a new gradient: DDP's CPU
// allocator places the allocations that became them in the last step in their bucket slots, so
// autograd computes them where they are reduced and nothing is copied in (plain gradients and
// bucket views alike). A tensor of the same size allocated in between (the guess goes wrong: here
// on rank 0 only) keeps its memory and values, and the gradients still get the right averages.
TEST(DdpBucketReduction, NewGradientsAreComputedInTheirBucketSlots) {
  constexpr int64_t kWidth = 256;  // fc1 and fc2's weights: 256 KiB each, over SlotLender's floor
  constexpr int kSteps = 7;
  torch::manual_seed(13);
  SmallMlp initial(kWidth, kWidth);
  const auto batches = batches_of(2, kSteps, kWidth);
  for (const bool as_view : {false, true}) {
    std::vector<SmallMlp> models = replicas_of(initial, 2, kWidth);
    // Per rank and step: the gradients DDP left, and each rank's own computed alone first.
    std::vector<std::vector<std::vector<torch::Tensor>>> reduced(2), alone(2);
    std::vector<double> in_slots(2, 0), copied_late(2, 0);
    with_groups(2, [&](int rank, std::shared_ptr<comm::ProcessGroup> group) {
      DistributedDataParallelOptions options;
      options.bucket_cap_mb = 0.3;  // fc3 and fc2 in one bucket, fc1 in another
      options.first_bucket_cap_mb = 0.3;
      options.bucket_reduction = parse_bucket_reduction("inline");
      options.gradient_as_bucket_view = as_view;
      DistributedDataParallel ddp(models[rank], group, options);
      const auto params = models[rank]->parameters();
      int64_t large_bytes = 0;
      for (const auto& p : params) {
        if (p.nbytes() >= (64 << 10)) large_bytes += p.numel() * p.element_size();
      }
      EXPECT_EQ(large_bytes, 2 * kWidth * kWidth * 4);
      torch::Tensor held;  // rank 0, step 4 on: a tensor of fc2.weight's size, allocated in between
      for (int step = 0; step < kSteps; ++step) {
        const auto& [x, y] = batches[rank][step];
        {
          auto copy = replicas_of(models[rank], 1, kWidth)[0];
          torch::nll_loss(copy->forward(x), y).backward();
          std::vector<torch::Tensor> grads;
          for (const auto& p : copy->parameters()) grads.push_back(p.grad().clone());
          alone[rank].push_back(grads);
        }
        for (const auto& p : params) p.mutable_grad().reset();  // zero_grad(set_to_none)
        const ReducerStats before = ddp.stats();
        auto loss = torch::nll_loss(ddp.forward(x), y);
        if (rank == 0 && step == 4) held = torch::full({kWidth, kWidth}, 7.0f);
        loss.backward();
        const ReducerStats after = ddp.stats();
        std::vector<torch::Tensor> grads;
        for (const auto& p : params) grads.push_back(p.grad().clone());
        reduced[rank].push_back(grads);
        if (step >= 2 && step < 4) {
          // Learnt (step 0) and rebuilt (step 1): the two large gradients computed in their slots.
          EXPECT_EQ(after.computed_in_bucket_bytes - before.computed_in_bucket_bytes,
                    static_cast<double>(large_bytes)) << "step " << step;
          for (size_t i : {0, 2}) {  // fc1.weight, fc2.weight
            const auto& grad = params[i].grad();
            EXPECT_TRUE(group->is_symmetric(grad)) << "parameter " << i;
            // A plain .grad has a storage of its own; a bucket view shares the bucket's.
            if (as_view) {
              EXPECT_GT(grad.storage().nbytes(), params[i].nbytes()) << "parameter " << i;
            } else {
              EXPECT_EQ(grad.storage().nbytes(), params[i].nbytes()) << "parameter " << i;
            }
          }
        }
        if (step == 3) in_slots[rank] = after.computed_in_bucket_bytes;
        if (step >= 4) copied_late[rank] += after.copied_bytes - before.copied_bytes;
        if (held.defined()) {
          EXPECT_TRUE(torch::all(held == 7.0f).item<bool>()) << "step " << step << ": the tensor "
              "allocated in between changed";
        }
        torch::NoGradGuard no_grad;
        for (const auto& p : params) p.sub_(0.1 * p.grad());
      }
    }, "shm");
    for (int rank = 0; rank < 2; ++rank) {
      EXPECT_GE(in_slots[rank], 2.0 * 2 * kWidth * kWidth * 4) << "rank " << rank;
    }
    // Rank 0's guesses went wrong from step 4: its gradients went through the slots by copies.
    EXPECT_GT(copied_late[0], copied_late[1]);
    for (int step = 0; step < kSteps; ++step) {
      for (size_t i = 0; i < reduced[0][step].size(); ++i) {
        const auto& mine = reduced[0][step][i];
        EXPECT_TRUE(torch::equal(mine, reduced[1][step][i]))
            << "view " << as_view << ", step " << step << ": ranks differ at parameter " << i;
        const auto expected = (alone[0][step][i] + alone[1][step][i]) / 2;
        EXPECT_TRUE(torch::allclose(mine, expected, 1e-5, 1e-6))
            << "view " << as_view << ", step " << step << ", parameter " << i
            << ": max difference " << (mine - expected).abs().max().item<float>();
      }
    }
  }
}

// DDP's counting allocator stands in front of LibTorch's CPU allocator only while a DDP that
// lends slots is alive (both ranks' here, one after the other gone): afterwards CPU allocations
// go straight to LibTorch's allocator again.
TEST(DdpBucketReduction, TheCpuAllocatorIsLibTorchsAgainOnceDdpIsGone) {
  if (const char* env = std::getenv("SHOAL_DDP_GRADIENTS_IN_BUCKETS"); env && env == std::string("0")) {
    GTEST_SKIP() << "SHOAL_DDP_GRADIENTS_IN_BUCKETS=0: DDP lends no slots";
  }
  c10::Allocator* const before = c10::GetCPUAllocator();
  torch::manual_seed(3);
  SmallMlp initial(16, 16);
  std::vector<SmallMlp> models = replicas_of(initial, 2, 16);
  std::vector<c10::Allocator*> during(2, nullptr);
  with_groups(2, [&](int rank, std::shared_ptr<comm::ProcessGroup> group) {
    DistributedDataParallelOptions options;
    options.bucket_reduction = parse_bucket_reduction("inline");
    DistributedDataParallel ddp(models[rank], group, options);
    during[rank] = c10::GetCPUAllocator();
    group->barrier()->wait();  // both alive at once
  }, "shm");
  EXPECT_NE(during[0], before);
  EXPECT_NE(during[1], before);
  EXPECT_EQ(c10::GetCPUAllocator(), before);
}

// .grads a module already has when DDP (inline, plain) is built move into the buckets; a comm
// hook registered afterwards (nothing is then reduced inline) moves them out again, values intact,
// and the hook's training averages them as the allreduce does.
TEST(DdpBucketReduction, ARegisteredHookTakesThePlainGradientsOutOfTheBuckets) {
  torch::manual_seed(12);
  SmallMlp initial(32, 32);
  const auto batches = batches_of(2, 2, 32);
  std::vector<SmallMlp> models = replicas_of(initial, 2, 32);
  with_groups(2, [&](int rank, std::shared_ptr<comm::ProcessGroup> group) {
    const auto params = models[rank]->parameters();
    for (const auto& p : params) p.mutable_grad() = torch::full_like(p, 1.0 + rank);
    DistributedDataParallelOptions options;
    options.bucket_reduction = parse_bucket_reduction("inline");
    DistributedDataParallel ddp(models[rank], group, options);
    for (const auto& p : params) EXPECT_TRUE(group->is_symmetric(p.grad()));
    ddp.register_comm_hook(fp16_compress_hook(group));
    EXPECT_FALSE(ddp.stats().inline_reduction);
    for (const auto& p : params) {
      EXPECT_FALSE(group->is_symmetric(p.grad())) << "a .grad left in a bucket under a hook";
      EXPECT_TRUE(torch::equal(p.grad(), torch::full_like(p, 1.0 + rank))) << "values lost";
      p.mutable_grad().zero_();
    }
    const auto& [x, y] = batches[rank][0];
    torch::nll_loss(ddp.forward(x), y).backward();
    for (const auto& p : params) EXPECT_FALSE(group->is_symmetric(p.grad()));
  }, "shm");
}

// auto: inline exactly when the ranks on this host (the launcher's word, as comm::detect_rank_info
// reads it; else a shm group's size, else 1) times the intra-op threads leave none of this
// process's cores spare.
TEST(DdpBucketReduction, AutoIsInlineWhenNoCoreIsSpare) {
  const int cores = launcher::available_cores();
  struct Saved {
    const char* name;
    bool set;
    std::string value;
  };
  std::vector<Saved> saved;
  for (const char* name : {"WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK"}) {
    const char* value = std::getenv(name);
    saved.push_back({name, value != nullptr, value ? value : ""});
  }
  struct Case {
    const char* local_world_size;  // nullptr: not started by a launcher
    std::string backend;
    bool expect_inline;
  };
  const std::vector<Case> cases{
      {"4096", "gloo", true},
      {"1", "gloo", 1 >= cores},
      {"1", "shm", 1 >= cores},  // the launcher's word over the group's size
      {nullptr, "gloo", 1 >= cores},
      {nullptr, "shm", 2 >= cores},
  };
  for (const Case& c : cases) {
    unsetenv("RANK");
    if (c.local_world_size) {
      setenv("WORLD_SIZE", "4096", 1);  // a torchrun-style environment: a launched process
      setenv("LOCAL_WORLD_SIZE", c.local_world_size, 1);
    } else {
      unsetenv("WORLD_SIZE");
      unsetenv("LOCAL_WORLD_SIZE");
    }
    with_groups(2, [&](int, std::shared_ptr<comm::ProcessGroup> group) {
      SmallMlp model;
      DistributedDataParallelOptions options;
      options.bucket_reduction = DistributedDataParallelOptions::BucketReduction::kAuto;
      DistributedDataParallel ddp(model, group, options);
      EXPECT_EQ(ddp.stats().inline_reduction, c.expect_inline)
          << "LOCAL_WORLD_SIZE=" << (c.local_world_size ? c.local_world_size : "(unset)") << ", "
          << c.backend << ", " << cores << " cores";
    }, c.backend);
  }
  for (const Saved& s : saved) {
    if (s.set) {
      setenv(s.name, s.value.c_str(), 1);
    } else {
      unsetenv(s.name);
    }
  }
  // A registered comm hook runs as it is written: nothing is reduced inline on its behalf.
  with_groups(2, [&](int, std::shared_ptr<comm::ProcessGroup> group) {
    SmallMlp model;
    DistributedDataParallelOptions options;
    options.bucket_reduction = DistributedDataParallelOptions::BucketReduction::kInline;
    DistributedDataParallel ddp(model, group, options);
    EXPECT_TRUE(ddp.stats().inline_reduction);
    ddp.register_comm_hook(fp16_compress_hook(group));
    EXPECT_FALSE(ddp.stats().inline_reduction);
  }, "shm");
  EXPECT_THROW(parse_bucket_reduction("sideways"), InvalidArgument);
  try {
    parse_bucket_reduction("sideways");
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("auto, overlapped or inline"), std::string::npos) << e.what();
  }
}

TEST(DdpErrors, AFailedReductionNamesTheBucket) {
  with_groups(2, [&](int rank, std::shared_ptr<comm::ProcessGroup> group) {
    SmallMlp model;
    DistributedDataParallel ddp(model, group, small_buckets());
    ddp.register_comm_hook([](GradBucket&) { return std::make_shared<FailedWork>(); });
    auto x = torch::randn({2, 20});
    try {
      ddp.forward(x).sum().backward();
      ADD_FAILURE() << "expected an error";
    } catch (const PeerError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("allreduce of bucket 0 ("), std::string::npos) << what;
      EXPECT_NE(what.find("closed the connection"), std::string::npos) << what;
    }
  });
}

TEST(DdpErrors, DifferentModelsAreNamedAtConstruction) {
  struct NetImpl : torch::nn::Module {
    explicit NetImpl(int hidden)
        : fc1(register_module("fc1", torch::nn::Linear(9, hidden))),
          fc2(register_module("fc2", torch::nn::Linear(hidden, 2))) {}
    torch::nn::Linear fc1, fc2;
  };
  with_groups(2, [&](int rank, std::shared_ptr<comm::ProcessGroup> group) {
    auto net = std::make_shared<NetImpl>(rank == 0 ? 16 : 8);
    try {
      DistributedDataParallel ddp(net, group);
      ADD_FAILURE() << "expected an error";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(
                    "parameter 'fc1.weight' has shape [16, 9] on rank 0 but [8, 9] on rank 1"),
                std::string::npos)
          << e.what();
    }
  });
}

TEST(DdpErrors, ModuleToAfterWrappingIsNamedAtTheNextForward) {
  with_groups(1, [&](int, std::shared_ptr<comm::ProcessGroup> group) {
    SmallMlp model;
    DistributedDataParallel ddp(model, group);
    model->to(torch::kDouble);  // LibTorch drops the gradient hooks DDP placed
    try {
      ddp.forward(torch::randn({2, 20}, torch::kDouble));
      ADD_FAILURE() << "expected an error";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("parameter 'fc1.weight' changed from Float on cpu to "
                                           "Double on cpu after DDP was constructed"),
                std::string::npos)
          << e.what();
    }
  });
}

TEST(DdpState, NamesAreTheModulesOwn) {
  with_groups(1, [&](int, std::shared_ptr<comm::ProcessGroup> group) {
    SmallCnn model;
    DistributedDataParallel ddp(model, group);
    EXPECT_EQ(ddp.named_parameters().keys(), model->named_parameters().keys());
    EXPECT_EQ(ddp.named_parameters().keys()[0], "conv1.weight");
    EXPECT_EQ(ddp.module().get(), model.ptr().get());
  });
}

// ---- LocalSGD ------------------------------------------------------------------------------------

SmallMlp copy_of(const SmallMlp& initial) {
  SmallMlp model;
  torch::NoGradGuard no_grad;
  auto src = initial->parameters();
  auto dst = model->parameters();
  for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
  return model;
}

// LocalSGD with sync_every 1 and plain SGD (lr, no momentum) is DDP: the average of the replicas'
// p - lr * g_r is p - lr * mean(g_r). Only the rounding differs (DDP averages the gradients and
// steps once; LocalSGD steps and averages the parameters), so after 8 steps the two agree to
// float32 rounding, not bit for bit: relative 1e-5.
TEST(LocalSgd, SyncEveryStepWithPlainSgdEqualsDdp) {
  constexpr int kWorld = 2;
  constexpr int kSteps = 8;
  constexpr int64_t kBatch = 4;
  torch::manual_seed(7);
  SmallMlp initial;
  std::vector<std::vector<torch::Tensor>> ddp_params(kWorld), local_params(kWorld);
  std::vector<int64_t> syncs(kWorld);
  for (bool local : {false, true}) {
    with_groups(kWorld, [&](int rank, std::shared_ptr<comm::ProcessGroup> group) {
      SmallMlp model = copy_of(initial);
      torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
      std::unique_ptr<LocalSGD> local_sgd;
      std::unique_ptr<DistributedDataParallel<shoal::testing::SmallMlpImpl>> ddp;
      if (local) {
        local_sgd = std::make_unique<LocalSGD>(model.ptr(), group, 1);
      } else {
        ddp = std::make_unique<DistributedDataParallel<shoal::testing::SmallMlpImpl>>(model, group);
      }
      for (int step = 0; step < kSteps; ++step) {
        auto [x, y] = make_batch("mlp", step, kBatch * kWorld);
        x = x.narrow(0, rank * kBatch, kBatch);
        y = y.narrow(0, rank * kBatch, kBatch);
        sgd.zero_grad();
        torch::nll_loss(local ? model->forward(x) : ddp->forward(x), y).backward();
        sgd.step();
        if (local_sgd) local_sgd->step();
      }
      (local ? local_params : ddp_params)[rank] = clone_all(model->parameters());
      if (local_sgd) syncs[rank] = local_sgd->syncs();
    });
  }
  EXPECT_EQ(syncs[0], kSteps);
  EXPECT_EQ(max_relative_difference(local_params[1], local_params[0]), 0) << "replicas differ";
  EXPECT_GT(max_relative_difference(ddp_params[0], clone_all(initial->parameters())), 1e-3)
      << "nothing trained";
  const double relative = max_relative_difference(local_params[0], ddp_params[0]);
  std::printf("LocalSGD H=1 vs DDP after %d steps: max relative difference %.3g\n", kSteps, relative);
  EXPECT_LE(relative, 1e-5);
}

// Between syncs the replicas train apart; the sync_every-th step averages them.
TEST(LocalSgd, ReplicasDivergeBetweenSyncsAndMeetAtEach) {
  constexpr int kWorld = 2;
  torch::manual_seed(8);
  SmallMlp initial;
  with_groups(kWorld, [&](int rank, std::shared_ptr<comm::ProcessGroup> group) {
    SmallMlp model = copy_of(initial);
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
    LocalSGD local_sgd(model.ptr(), group, 3);
    for (int step = 0; step < 6; ++step) {
      auto [x, y] = make_batch("mlp", step * kWorld + rank, 4);
      sgd.zero_grad();
      torch::nll_loss(model->forward(x), y).backward();
      sgd.step();
      EXPECT_EQ(local_sgd.step(), step % 3 == 2);
      auto flat = torch::cat({model->fc1->weight.flatten(), model->fc3->bias.flatten()});
      auto gathered = flat.clone();
      group->allreduce(gathered, {comm::ReduceOp::kMax})->wait();
      EXPECT_EQ(torch::equal(gathered, flat), step % 3 == 2) << "rank " << rank << " step " << step;
    }
    EXPECT_EQ(local_sgd.syncs(), 2);
  });
}

}  // namespace test_distributed_data_parallel
}  // namespace shoal::parallel
