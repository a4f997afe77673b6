// Tensor parallelism and the device mesh on threads-as-ranks over the shm backend: the GPT split
// over 2 and 4 TP ranks trains exactly like the whole GPT in one process (SGD and AdamW), holds
// about 1/tp of the split layers' bytes per rank, does so with sequence parallelism too (its
// activations between blocks 1/tp per rank), and composes with DDP on a dp=2, tp=2 mesh; the
// built-in transformer, split through the model interface (Model::parallelize), does the same.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "shoal/comm/device_mesh.h"
#include "shoal/comm/init.h"
#include "shoal/comm/process_group.h"
#include "shoal/error.h"
#include "shoal/models/gpt.h"
#include "shoal/models/transformer.h"
#include "shoal/parallel/distributed_data_parallel.h"
#include "shoal/parallel/tensor_parallel.h"
#include "shoal/train/tp_strategy.h"
#include "shoal/train/trainer.h"
#include "test_models.h"
#include "testing/dependencies.h"
#include "testing/multi_rank.h"
#include "testing/python.h"

namespace shoal::parallel {
namespace test_tensor_parallel {

using Milliseconds = std::chrono::milliseconds;
using Batch = std::pair<torch::Tensor, torch::Tensor>;
using State = std::map<std::string, torch::Tensor>;

constexpr Milliseconds kTimeout{60'000};
constexpr int kSteps = 20;
constexpr int64_t kBatch = 4, kTokens = 8;

models::GptConfig tiny_config() {
  models::GptConfig config;
  config.n_layer = 2;
  config.n_head = 4;
  config.n_embd = 32;
  config.block_size = 16;
  config.vocab_size = 64;
  config.dropout = 0;
  return config;
}

// Runs fn(rank, world group) on `world` threads over shm.
void with_groups(int world,
                 const std::function<void(int, std::shared_ptr<comm::ProcessGroup>)>& fn) {
  torch::set_num_threads(1);
  auto store = comm::make_hash_store(kTimeout);
  shoal::testing::run_threads(world, [&](int rank) {
    fn(rank, comm::new_process_group("shm", store, rank, world, kTimeout));
  });
}

// Global batches of token ids and next-token targets (some ignored), made before ranks start.
std::vector<Batch> batches() {
  torch::manual_seed(7);
  std::vector<Batch> out;
  for (int step = 0; step < kSteps; ++step) {
    torch::Tensor x = torch::randint(0, 64, {kBatch, kTokens}, torch::kLong);
    torch::Tensor y = torch::randint(0, 64, {kBatch, kTokens}, torch::kLong);
    // Ignored positions, as many in each half of the batch (DDP's ranks each average theirs).
    y.index_put_({0, 0}, -1);
    y.index_put_({2, 3}, -1);
    out.emplace_back(x, y);
  }
  return out;
}

// Each parameter once (the tied lm_head.weight is transformer.wte.weight).
std::vector<torch::Tensor> unique_parameters(torch::nn::Module& module) {
  std::set<const c10::TensorImpl*> seen;
  std::vector<torch::Tensor> params;
  for (const auto& p : module.parameters()) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) params.push_back(p);
  }
  return params;
}

std::shared_ptr<models::Gpt> copy_of(const models::Gpt& initial) {
  auto gpt = std::make_shared<models::Gpt>(initial.config());
  gpt->to(initial.parameters()[0].scalar_type());
  torch::NoGradGuard no_grad;
  const auto src = initial.named_parameters();
  for (auto& item : gpt->named_parameters()) item.value().copy_(src[item.key()]);
  return gpt;
}

std::unique_ptr<torch::optim::Optimizer> optimizer_for(std::vector<torch::Tensor> params,
                                                       bool adamw) {
  if (adamw) {
    return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(3e-3));
  }
  return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.5));
}

// One optimizer step on rows [first, first + rows) of `batch`.
void train_step(models::Gpt& gpt, torch::optim::Optimizer& optimizer, const Batch& batch,
                int64_t first, int64_t rows) {
  optimizer.zero_grad();
  gpt.forward_loss(batch.first.narrow(0, first, rows), batch.second.narrow(0, first, rows))
      .backward();
  optimizer.step();
}

State state_of(const torch::OrderedDict<std::string, torch::Tensor>& dict) {
  State state;
  for (const auto& item : dict) state[item.key()] = item.value().detach().clone();
  return state;
}

State train_single(const models::Gpt& initial, const std::vector<Batch>& data, bool adamw) {
  auto gpt = copy_of(initial);
  auto optimizer = optimizer_for(unique_parameters(*gpt), adamw);
  for (const Batch& batch : data) train_step(*gpt, *optimizer, batch, 0, kBatch);
  return state_of(gpt->named_parameters());
}

double max_relative_difference(const State& a, const State& b) {
  std::vector<torch::Tensor> left, right;
  EXPECT_EQ(a.size(), b.size());
  for (const auto& [name, tensor] : b) {
    const auto found = a.find(name);
    if (found == a.end()) {
      ADD_FAILURE() << "missing " << name;
      continue;
    }
    EXPECT_EQ(found->second.sizes(), tensor.sizes()) << name;
    if (found->second.sizes() != tensor.sizes()) continue;
    left.push_back(found->second);
    right.push_back(tensor);
  }
  return shoal::testing::max_relative_difference(left, right);
}

// AdamW divides each gradient by its running size, so float32 rounding in gradients that are
// zero but for rounding (the key biases': a query's softmax ignores the same q.b added to every
// score) becomes full steps of random sign; the AdamW runs are in float64, where it does not.
std::shared_ptr<models::Gpt> initial_gpt(bool float64 = false) {
  torch::manual_seed(1);
  auto gpt = std::make_shared<models::Gpt>(tiny_config());
  if (float64) gpt->to(torch::kDouble);
  return gpt;
}

class TensorParallelGpt : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(TensorParallelGpt, EqualsSingleProcessTraining) {
  const auto [tp, adamw] = GetParam();
  const auto initial = initial_gpt(adamw);
  const auto data = batches();
  const State expected = train_single(*initial, data, adamw);
  // The split layers: everything but the LayerNorms and the position embedding.
  int64_t whole_bytes = 0;
  for (const auto& item : initial->named_parameters()) {
    if (item.key().find("ln_") != std::string::npos ||
        item.key().find("wpe") != std::string::npos || item.key() == "lm_head.weight") {
      continue;
    }
    whole_bytes += item.value().numel() * static_cast<int64_t>(item.value().element_size());
  }
  torch::Tensor logits;
  {
    torch::NoGradGuard no_grad;
    logits = initial->forward(data[0].first);
  }
  std::vector<State> states(tp);
  std::vector<int64_t> split_bytes(tp);
  std::vector<double> logits_error(tp);
  with_groups(tp, [&](int rank, std::shared_ptr<comm::ProcessGroup> group) {
    auto gpt = copy_of(*initial);
    const TensorParallelLayout layout = parallelize_gpt(*gpt, group);
    split_bytes[rank] = layout.sharded_layer_bytes();
    {
      torch::NoGradGuard no_grad;  // forward() gathers the vocabulary-split logits
      logits_error[rank] =
          shoal::testing::max_relative_difference({gpt->forward(data[0].first)}, {logits});
    }
    auto optimizer = optimizer_for(unique_parameters(*gpt), adamw);
    for (const Batch& batch : data) train_step(*gpt, *optimizer, batch, 0, kBatch);
    states[rank] = state_of(layout.full_state_dict());
  });
  for (int rank = 0; rank < tp; ++rank) {
    EXPECT_LT(max_relative_difference(states[rank], expected), 1e-5) << "rank " << rank;
    EXPECT_LE(split_bytes[rank], whole_bytes / tp * 1.05) << "rank " << rank;
    EXPECT_LT(logits_error[rank], 1e-5) << "rank " << rank;
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, TensorParallelGpt,
                         ::testing::Values(std::make_tuple(2, false), std::make_tuple(4, false),
                                           std::make_tuple(2, true)));

// Sequence parallelism: the LayerNorms, the position embedding and the activations between the
// blocks on sequence shards ([B, T/tp, C] per rank), all-gathered before each column-split layer
// and reduce-scattered after each row-split one; 20 SGD steps equal the whole GPT's.
class SequenceParallelGpt : public ::testing::TestWithParam<int> {};

TEST_P(SequenceParallelGpt, EqualsSingleProcessTrainingOnSequenceShards) {
  const int tp = GetParam();
  const auto initial = initial_gpt();
  const auto data = batches();
  const State expected = train_single(*initial, data, false);
  std::vector<State> states(tp);
  std::vector<std::vector<int64_t>> between(tp);
  with_groups(tp, [&](int rank, std::shared_ptr<comm::ProcessGroup> group) {
    auto gpt = copy_of(*initial);
    const TensorParallelLayout layout = parallelize_gpt(*gpt, group, /*sequence_parallel=*/true);
    auto optimizer = optimizer_for(unique_parameters(*gpt), false);
    for (const Batch& batch : data) train_step(*gpt, *optimizer, batch, 0, kBatch);
    states[rank] = state_of(layout.full_state_dict());
    // Block 1's input (block 0's output), seen by its ln_1, in one more forward.
    auto& block = *gpt->h[1]->as<models::GptBlock>();
    block.set_layer_forward("ln_1", [&](torch::nn::Module&, const torch::Tensor& x) {
      between[rank] = x.sizes().vec();
      return torch::layer_norm(x, {x.size(-1)}, block.ln_1->weight, block.ln_1->bias);
    });
    torch::NoGradGuard no_grad;
    gpt->forward(data[0].first);
  });
  const std::vector<int64_t> shard = {kBatch, kTokens / tp, tiny_config().n_embd};
  for (int rank = 0; rank < tp; ++rank) {
    EXPECT_LT(max_relative_difference(states[rank], expected), 1e-5) << "rank " << rank;
    EXPECT_EQ(between[rank], shard) << "rank " << rank;
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, SequenceParallelGpt, ::testing::Values(2, 4));

TEST(TensorParallel, WithDdpOnDpTwoTpTwoMeshEqualsSingleProcess) {
  const auto initial = initial_gpt();
  const auto data = batches();
  const State expected = train_single(*initial, data, false);
  std::vector<State> states(4);
  with_groups(4, [&](int rank, std::shared_ptr<comm::ProcessGroup> world) {
    const comm::DeviceMesh mesh(world, {{"dp", 2}, {"tp", 2}});
    auto gpt = copy_of(*initial);
    const TensorParallelLayout layout = parallelize_gpt(*gpt, mesh.get_group("tp"));
    DistributedDataParallel ddp(gpt, mesh.get_group("dp"));
    auto optimizer = optimizer_for(unique_parameters(*gpt), false);
    const int64_t rows = kBatch / 2;
    for (const Batch& batch : data) {
      ddp.prepare_for_forward();
      train_step(*gpt, *optimizer, batch, mesh.get_local_rank("dp") * rows, rows);
    }
    states[rank] = state_of(layout.full_state_dict());
  });
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_LT(max_relative_difference(states[rank], expected), 1e-5) << "rank " << rank;
  }
}

void write_float64(const std::string& path, const std::vector<torch::Tensor>& tensors) {
  std::ofstream out(path, std::ios::binary);
  for (const auto& t : tensors) {
    const torch::Tensor flat = t.detach().to(torch::kDouble).contiguous().flatten();
    out.write(static_cast<const char*>(flat.data_ptr()), flat.numel() * 8);
  }
  ASSERT_TRUE(out.good()) << path;
}

torch::Tensor read_float64(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return {};
  const auto bytes = static_cast<int64_t>(in.tellg());
  torch::Tensor t = torch::empty({bytes / 8}, torch::kDouble);
  in.seekg(0);
  in.read(static_cast<char*>(t.data_ptr()), bytes);
  return t;
}

// The same plan, initial weights (float64) and batches in PyTorch 2.x's parallelize_module with
// loss_parallel (tests/parallel/tp_oracle.py, gloo, 2 processes) and in Shoal (2 threads over
// shm): 20 SGD steps end at the same weights.
TEST(TensorParallel, GptPlanEqualsPyTorchParallelizeModule) {
  const std::string python = shoal::testing::torch2_python();
  const char* source = std::getenv("SHOAL_SOURCE_DIR");
  SHOAL_SKIP_UNLESS(!python.empty() && source != nullptr, shoal::testing::Dependency::kOptional,
                    "PyTorch 2.x's Python is not installed (scripts/setup_torch_pypi.sh), or "
                    "SHOAL_SOURCE_DIR is not set (run through ctest)");
  constexpr int kTp = 2;
  constexpr double kLr = 0.5;
  const auto initial = initial_gpt(/*float64=*/true);
  const auto data = batches();
  const std::string dir = shoal::testing::temp_path("tp_vs_pytorch");
  std::filesystem::create_directories(dir);
  std::vector<std::string> names;
  std::vector<torch::Tensor> values;
  {
    std::ofstream list(dir + "/names.txt");
    for (const auto& item : initial->named_parameters()) {
      if (item.key() == "lm_head.weight") continue;  // transformer.wte.weight, tied
      names.push_back(item.key());
      values.push_back(item.value());
      list << item.key() << " " << item.value().numel() << "\n";
    }
  }
  write_float64(dir + "/init.f64", values);
  std::vector<torch::Tensor> tokens;
  for (const Batch& batch : data) tokens.insert(tokens.end(), {batch.first, batch.second});
  write_float64(dir + "/data.f64", tokens);
  const models::GptConfig c = tiny_config();
  std::ostringstream command;
  command << "timeout 300 env " << python << " " << source
          << "/tests/parallel/tp_oracle.py " << dir << " " << kTp << " " << kSteps << " " << kLr
          << " " << c.n_layer << " " << c.n_head << " " << c.n_embd << " " << c.block_size << " "
          << c.vocab_size << " " << kBatch << " " << kTokens;
  ASSERT_TRUE(shoal::testing::oracle_succeeded(shoal::testing::run_command(command.str())))
      << command.str();
  const torch::Tensor theirs = read_float64(dir + "/pytorch.f64");
  std::vector<State> states(kTp);
  with_groups(kTp, [&](int rank, std::shared_ptr<comm::ProcessGroup> group) {
    auto gpt = copy_of(*initial);
    const TensorParallelLayout layout = parallelize_gpt(*gpt, group);
    torch::optim::SGD optimizer(unique_parameters(*gpt), torch::optim::SGDOptions(kLr));
    for (const Batch& batch : data) train_step(*gpt, optimizer, batch, 0, kBatch);
    states[rank] = state_of(layout.full_state_dict());
  });
  std::filesystem::remove_all(dir);
  State expected;
  int64_t offset = 0;
  for (size_t i = 0; i < names.size(); ++i) {
    ASSERT_LE(offset + values[i].numel(), theirs.numel()) << "pytorch.f64 is short";
    expected[names[i]] = theirs.narrow(0, offset, values[i].numel()).view(values[i].sizes());
    offset += values[i].numel();
  }
  ASSERT_EQ(offset, theirs.numel());
  EXPECT_FALSE(torch::allclose(expected.at(names[0]), values[0])) << "PyTorch did not train";
  for (int rank = 0; rank < kTp; ++rank) {
    states[rank].erase("lm_head.weight");
    EXPECT_LT(max_relative_difference(states[rank], expected), 1e-5) << "rank " << rank;
  }
}

// One training-mode forward of `gpt` on every rank of a dp=2 x tp=2 mesh, dropout 0.5 drawn as
// tensor_parallel_dropout says: block 0's attention takes uniform probabilities and values of 1
// (c_attn zero but for the value bias), so the input of its c_proj (this rank's heads) is the
// attention dropout's kept fractions, which the test captures beside the input of the head (the
// residual stream after every embedding and residual dropout, whole on every TP rank).
struct DropoutDraws {
  std::vector<torch::Tensor> replicated{4}, attention{4};
};

DropoutDraws draw_dropout_on_a_mesh(uint64_t seed) {
  models::GptConfig config = tiny_config();
  config.dropout = 0.5;
  torch::manual_seed(1);
  models::Gpt initial(config);
  {
    torch::NoGradGuard no_grad;
    auto& attn = *initial.h[0]->as<models::GptBlock>()->attn;
    attn.c_attn->weight.zero_();
    attn.c_attn->bias.zero_();
    attn.c_attn->bias.narrow(0, 2 * config.n_embd, config.n_embd).fill_(1);
  }
  const torch::Tensor idx = batches()[0].first;
  DropoutDraws draws;
  with_groups(4, [&](int rank, std::shared_ptr<comm::ProcessGroup> world) {
    const comm::DeviceMesh mesh(world, {{"dp", 2}, {"tp", 2}});
    const auto group = mesh.get_group("tp");
    auto gpt = copy_of(initial);
    parallelize_gpt(*gpt, group);
    gpt->set_dropout_generators(
        tensor_parallel_dropout(seed, mesh.get_local_rank("tp"), mesh.get_local_rank("dp")));
    auto& attn = *gpt->h[0]->as<models::GptBlock>()->attn;
    attn.set_layer_forward("c_proj", [&, group](torch::nn::Module&, const torch::Tensor& y) {
      draws.attention[rank] = y.detach().clone();
      const torch::Tensor partial = torch::linear(y, attn.c_proj->weight);
      return reduce_from_tensor_parallel_region(partial, group) + attn.c_proj->bias;
    });
    gpt->set_layer_forward("lm_head", [&](torch::nn::Module&, const torch::Tensor& x) {
      draws.replicated[rank] = x.detach().clone();
      return torch::linear(x, gpt->wte->weight);  // the column-split head, forward only
    });
    torch::NoGradGuard no_grad;
    gpt->forward(idx);
  });
  return draws;
}

// Megatron's and PyTorch's rule: TP ranks of a replica draw the same embedding and residual masks
// (their replicated activations stay equal) and different attention masks
// (their own heads'); replicas draw different masks of both; a seed gives the same draws again.
TEST(TensorParallel, DropoutMasksAgreeInTheReplicatedRegionAndDifferInTheSplitOne) {
  const DropoutDraws draws = draw_dropout_on_a_mesh(11);
  // Ranks 0 and 1 are replica 0's TP ranks, 2 and 3 replica 1's.
  EXPECT_TRUE(torch::equal(draws.replicated[0], draws.replicated[1]));
  EXPECT_TRUE(torch::equal(draws.replicated[2], draws.replicated[3]));
  EXPECT_FALSE(torch::allclose(draws.replicated[0], draws.replicated[2]));
  // Kept fractions of uniform attention: dropped positions show (not all ones) ...
  EXPECT_FALSE(torch::allclose(draws.attention[0], torch::ones_like(draws.attention[0])));
  // ... and differ between the TP ranks' heads, and between the replicas.
  EXPECT_FALSE(torch::equal(draws.attention[0], draws.attention[1]));
  EXPECT_FALSE(torch::equal(draws.attention[2], draws.attention[3]));
  EXPECT_FALSE(torch::equal(draws.attention[0], draws.attention[2]));
  // Under sequence parallelism the replicated region's activations are sequence shards: each TP
  // rank draws its own masks there too.
  const auto first = tensor_parallel_dropout(11, 0, 0, true), second = tensor_parallel_dropout(11, 1, 0, true);
  EXPECT_FALSE(torch::equal(torch::rand({64}, first.replicated), torch::rand({64}, second.replicated)));
  const DropoutDraws again = draw_dropout_on_a_mesh(11);
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_TRUE(torch::equal(draws.replicated[rank], again.replicated[rank])) << "rank " << rank;
    EXPECT_TRUE(torch::equal(draws.attention[rank], again.attention[rank])) << "rank " << rank;
  }
}

// With dropout 0.1, 20 AdamW steps on one batch at tp=2 lower the loss, and a seed trains to the same
// weights twice.
TEST(TensorParallel, GptWithDropoutTrainsAndIsDeterministicForASeed) {
  models::GptConfig config = tiny_config();
  config.dropout = 0.1;
  torch::manual_seed(1);
  const models::Gpt initial(config);
  const Batch batch = batches()[0];
  const auto train = [&](std::vector<State>& states, std::vector<std::pair<double, double>>& losses) {
    with_groups(2, [&](int rank, std::shared_ptr<comm::ProcessGroup> group) {
      auto gpt = copy_of(initial);
      const TensorParallelLayout layout = parallelize_gpt(*gpt, group);
      gpt->set_dropout_generators(tensor_parallel_dropout(5, rank, 0));
      torch::optim::AdamW optimizer(unique_parameters(*gpt), torch::optim::AdamWOptions(1e-2));
      for (int step = 0; step < kSteps; ++step) {
        optimizer.zero_grad();
        const torch::Tensor loss = gpt->forward_loss(batch.first, batch.second);
        loss.backward();
        optimizer.step();
        if (step == 0) losses[rank].first = loss.item<double>();
        losses[rank].second = loss.item<double>();
      }
      states[rank] = state_of(layout.full_state_dict());
    });
  };
  std::vector<State> first(2), second(2);
  std::vector<std::pair<double, double>> losses(2), losses_again(2);
  train(first, losses);
  train(second, losses_again);
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_LT(losses[rank].second, 0.5 * losses[rank].first) << "rank " << rank;
    EXPECT_EQ(losses[rank], losses_again[rank]) << "rank " << rank;
    EXPECT_EQ(max_relative_difference(first[rank], second[rank]), 0) << "rank " << rank;
  }
  EXPECT_EQ(losses[0], losses[1]);
}

// Bytes of `module`'s parameters, each tensor once.
int64_t parameter_bytes(torch::nn::Module& module) {
  int64_t bytes = 0;
  for (const auto& p : unique_parameters(module)) bytes += p.numel() * static_cast<int64_t>(p.element_size());
  return bytes;
}

// The trainer's model under --mesh tp=2 (TpStrategy): after prepare() and after each training
// step it holds none of the split layers (the rank holds their shards only, in the strategy's
// copy); synchronize() gathers them back whole, with the step's weights.
TEST(TpStrategy, TheTrainersModelHoldsTheSplitLayersOnlyFromSynchronizeToTheNextStep) {
  const auto initial = initial_gpt();
  const Batch batch = batches()[0];
  const State expected = train_single(*initial, {batch}, false);
  int64_t replicated_bytes = 0;  // the LayerNorms, the position embedding, the row-split biases
  for (const auto& item : initial->named_parameters()) {
    const std::string& name = item.key();
    if (name.find("ln_") != std::string::npos || name.find("wpe") != std::string::npos ||
        name.find("c_proj.bias") != std::string::npos) {
      replicated_bytes += item.value().numel() * static_cast<int64_t>(item.value().element_size());
    }
  }
  std::vector<std::vector<int64_t>> held(2);  // after prepare, after synchronize, after a step
  std::vector<double> error(2);
  with_groups(2, [&](int rank, std::shared_ptr<comm::ProcessGroup> group) {
    train::TpStrategy strategy({{"tp", 2}}, group);
    auto gpt = copy_of(*initial);
    train::TrainState state;
    state.model = gpt;
    state.model_loss = [gpt](const torch::Tensor& x, const torch::Tensor& y) {
      return gpt->forward_loss(x, y);
    };
    state.optimizer = optimizer_for(unique_parameters(*gpt), false);
    strategy.prepare(state);
    held[rank].push_back(parameter_bytes(*gpt));
    state.optimizer->zero_grad();
    state.forward_loss(batch.first, batch.second).backward();
    state.optimizer->step();
    strategy.synchronize(state);
    held[rank].push_back(parameter_bytes(*gpt));
    error[rank] = max_relative_difference(state_of(gpt->named_parameters()), expected);
    state.forward_loss(batch.first, batch.second);
    held[rank].push_back(parameter_bytes(*gpt));
  });
  const int64_t whole = parameter_bytes(*initial);
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(held[rank], (std::vector<int64_t>{replicated_bytes, whole, replicated_bytes}))
        << "rank " << rank;
    EXPECT_LT(error[rank], 1e-5) << "rank " << rank;
  }
}

// A fit stopped inside an epoch (a step limit, a callback, preemption) leaves the trainer's model
// whole on every rank, not with the split layers freed by the last step.
TEST(TpStrategy, AFitStoppedInsideAnEpochLeavesTheTrainersModelWhole) {
  const auto initial = initial_gpt();
  std::vector<torch::Tensor> inputs, targets;
  for (const Batch& batch : batches()) {
    inputs.push_back(batch.first);
    targets.push_back(batch.second);
  }
  const train::TensorData data{torch::cat(inputs), torch::cat(targets)};
  std::vector<int64_t> held(2);
  with_groups(2, [&](int rank, std::shared_ptr<comm::ProcessGroup> group) {
    train::TrainOptions options;
    options.model = "gpt";
    options.batch_size = kBatch;
    options.lr = 0.1;
    options.threads = 1;
    options.progress = train::ProgressMode::kNone;
    options.log_interval = 0;
    options.stop_after_steps = 2;
    auto gpt = copy_of(*initial);
    train::Trainer trainer(options, gpt,
                           std::make_unique<train::TpStrategy>(
                               std::vector<comm::MeshDimension>{{"tp", 2}}, group));
    EXPECT_TRUE(trainer.fit(data, train::TensorData{}).stopped);
    held[rank] = parameter_bytes(*gpt);
  });
  EXPECT_EQ(held, (std::vector<int64_t>{parameter_bytes(*initial), parameter_bytes(*initial)}));
}

// The built-in image transformer split by its own plan through the model interface: 20 SGD steps
// of cross-entropy on image batches equal the whole model's, with about 1/tp of the blocks' bytes.
class TensorParallelTransformer : public ::testing::TestWithParam<int> {};

TEST_P(TensorParallelTransformer, EqualsSingleProcessTraining) {
  const int tp = GetParam();
  torch::manual_seed(5);
  models::Transformer initial;
  std::vector<Batch> data;
  for (int step = 0; step < kSteps; ++step) {
    data.emplace_back(torch::randn({kBatch, 1, 28, 28}), torch::randint(0, 10, {kBatch}, torch::kLong));
  }
  const auto train = [&](models::Model& model) {
    torch::optim::SGD optimizer(model.parameters(), torch::optim::SGDOptions(0.1));
    for (const Batch& batch : data) {
      optimizer.zero_grad();
      torch::nn::functional::cross_entropy(model.forward(batch.first), batch.second).backward();
      optimizer.step();
    }
  };
  const auto whole = initial.copy();
  train(*whole);
  const State expected = state_of(whole->named_parameters());
  int64_t block_bytes = 0;
  for (const auto& item : initial.named_parameters()) {
    const std::string& name = item.key();
    const bool split = name.find(".qkv.") != std::string::npos || name.find(".fc1.") != std::string::npos ||
                       name.find(".proj.weight") != std::string::npos || name.find(".fc2.weight") != std::string::npos;
    if (split) block_bytes += item.value().numel() * static_cast<int64_t>(item.value().element_size());
  }
  std::vector<State> states(tp);
  std::vector<int64_t> split_bytes(tp);
  with_groups(tp, [&](int rank, std::shared_ptr<comm::ProcessGroup> group) {
    const auto model = initial.copy();
    const TensorParallelLayout layout = model->parallelize(group);
    split_bytes[rank] = layout.sharded_layer_bytes();
    train(*model);
    states[rank] = state_of(layout.full_state_dict());
  });
  for (int rank = 0; rank < tp; ++rank) {
    EXPECT_LT(max_relative_difference(states[rank], expected), 1e-5) << "rank " << rank;
    EXPECT_LE(split_bytes[rank], block_bytes / tp * 1.05) << "rank " << rank;
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, TensorParallelTransformer, ::testing::Values(2, 4));

TEST(TensorParallel, TransformerRefusesADegreeThatDoesNotDivideItsHeads) {
  with_groups(3, [&](int, std::shared_ptr<comm::ProcessGroup> group) {
    models::Transformer model;
    try {
      model.parallelize(group);
      ADD_FAILURE() << "tp=3 was accepted";
    } catch (const InvalidArgument& error) {
      EXPECT_NE(std::string(error.what()).find("tp=3 does not divide"), std::string::npos) << error.what();
    }
  });
}

TEST(DeviceMesh, SlicesAreRowMajorAndRefusesBadShapes) {
  std::vector<std::vector<int64_t>> coordinates(4);
  std::vector<std::vector<float>> tp_sums(4), dp_sums(4);
  with_groups(4, [&](int rank, std::shared_ptr<comm::ProcessGroup> world) {
    EXPECT_THROW(comm::DeviceMesh(world, {{"dp", 2}, {"tp", 3}}), InvalidArgument);
    EXPECT_THROW(comm::DeviceMesh(world, {{"tp", 2}, {"tp", 2}}), InvalidArgument);
    const auto mesh = comm::init_device_mesh(world, {{"dp", 2}, {"tp", 2}});
    coordinates[rank] = mesh.get_coordinate();
    EXPECT_EQ(mesh.size("tp"), 2);
    EXPECT_EQ(mesh.get_local_rank("tp"), mesh.get_group("tp")->rank());
    EXPECT_THROW(mesh.get_group("pp"), InvalidArgument);
    at::Tensor mine = torch::full({1}, static_cast<float>(rank));
    mesh.get_group("tp")->allreduce(mine)->wait();
    tp_sums[rank] = {mine.item<float>()};
    at::Tensor again = torch::full({1}, static_cast<float>(rank));
    mesh.get_group("dp")->allreduce(again)->wait();
    dp_sums[rank] = {again.item<float>()};
  });
  // Row-major as PyTorch's: tp groups {0,1} {2,3}, dp groups {0,2} {1,3}.
  EXPECT_EQ(coordinates[3], (std::vector<int64_t>{1, 1}));
  EXPECT_EQ(coordinates[1], (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(tp_sums[0][0], 1);
  EXPECT_EQ(tp_sums[2][0], 5);
  EXPECT_EQ(dp_sums[0][0], 2);
  EXPECT_EQ(dp_sums[1][0], 4);
  EXPECT_EQ(comm::parse_mesh("dp=2,tp=2").size(), 2u);
  EXPECT_THROW(comm::parse_mesh("dp=2,tp"), InvalidArgument);
}

TEST(TensorParallel, RefusesADegreeThatDoesNotDivideTheHeads) {
  models::GptConfig config = tiny_config();
  config.n_head = 2;
  config.n_embd = 32;
  models::Gpt gpt(config);
  try {
    check_gpt_tensor_parallel(gpt.config(), 4);
    FAIL() << "tp=4 with 2 heads was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("--n-head"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(check_gpt_tensor_parallel(gpt.config(), 2));
}

// A Linear split column-wise then row-wise, called through a module with forward hooks.
struct TwoLayers : torch::nn::Module, models::LayerForwardHooks {
  TwoLayers() : LayerForwardHooks({"up", "down"}) {
    up = register_module("up", torch::nn::Linear(6, 8));
    down = register_module("down", torch::nn::Linear(8, 6));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto call = [](torch::nn::Linear& layer) {
      return [&layer](const torch::Tensor& in) { return layer->forward(in); };
    };
    const torch::Tensor hidden = call_layer(0, *up, x, call(up));
    return call_layer(1, *down, torch::relu(hidden), call(down));
  }
  torch::nn::Linear up{nullptr}, down{nullptr};
};

TEST(TensorParallel, PlanRefusesUnmatchedPatternsUnhookableLayersAndUnevenSplits) {
  with_groups(2, [&](int rank, std::shared_ptr<comm::ProcessGroup> group) {
    TwoLayers hooked;
    EXPECT_THROW(parallelize_module(hooked, group, {{"nothing.*", ColwiseParallel{}}}),
                 InvalidArgument);
    EXPECT_THROW(parallelize_module(hooked, group, {{"up", ColwiseParallel{3}}}), InvalidArgument);
    torch::nn::Sequential plain(torch::nn::Linear(4, 4));
    EXPECT_THROW(parallelize_module(*plain, group, {{"0", ColwiseParallel{}}}), InvalidArgument);
  });
}

TEST(TensorParallel, ColwiseThenRowwiseOnAnyHookedModuleEqualsTheWholeModule) {
  torch::manual_seed(3);
  TwoLayers whole;
  const torch::Tensor x = torch::randn({5, 6});
  const torch::Tensor expected = whole.forward(x).detach();
  std::vector<torch::Tensor> outputs(2);
  with_groups(2, [&](int rank, std::shared_ptr<comm::ProcessGroup> group) {
    TwoLayers split;
    {
      torch::NoGradGuard no_grad;
      for (auto& item : split.named_parameters())
        item.value().copy_(whole.named_parameters()[item.key()]);
    }
    const TensorParallelLayout layout =
        parallelize_module(split, group, {{"up", ColwiseParallel{}}, {"down", RowwiseParallel{}}});
    EXPECT_EQ(split.up->weight.sizes(), (std::vector<int64_t>{4, 6}));
    EXPECT_EQ(layout.sharded().size(), 3u);  // up.weight, up.bias, down.weight
    outputs[rank] = split.forward(x).detach();
  });
  for (const auto& out : outputs) EXPECT_TRUE(torch::allclose(out, expected, 1e-5, 1e-6));
}

// The loss crosses the ranks once (an all-gather of two numbers per row), in forward only, and
// equals cross_entropy of the whole logits, value and gradient; a GPT step adds one collective per
// split layer in forward and one per column-split layer in backward.
TEST(TensorParallel, VocabParallelLossTakesOneCollectiveAndEqualsCrossEntropy) {
  torch::manual_seed(5);
  const torch::Tensor logits = torch::randn({6, 8}) * 4;
  const torch::Tensor targets = torch::tensor({0, 7, -1, 3, 4, 1}, torch::kLong);
  const torch::Tensor whole = logits.clone().requires_grad_();
  const torch::Tensor expected = torch::nn::functional::cross_entropy(
      whole, targets, torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-1));
  expected.backward();
  std::vector<uint64_t> loss_collectives(2), step_collectives(2);
  std::vector<torch::Tensor> losses(2), grads(2);
  const auto initial = initial_gpt();
  const Batch batch = batches()[0];
  with_groups(2, [&](int rank, std::shared_ptr<comm::ProcessGroup> group) {
    const torch::Tensor local = logits.chunk(2, 1)[rank].clone().requires_grad_();
    const uint64_t before = group->sequence_number();
    losses[rank] = vocab_parallel_cross_entropy(local, targets, group);
    losses[rank].backward();
    loss_collectives[rank] = group->sequence_number() - before;
    grads[rank] = local.grad();
    auto gpt = copy_of(*initial);
    parallelize_gpt(*gpt, group);
    const uint64_t step_start = group->sequence_number();
    gpt->forward_loss(batch.first, batch.second).backward();
    step_collectives[rank] = group->sequence_number() - step_start;
  });
  // Forward: the embedding, two rowwise layers per block, the loss; backward: two colwise
  // layers per block and the head.
  const auto n_layer = static_cast<uint64_t>(tiny_config().n_layer);
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(loss_collectives[rank], 1u) << "rank " << rank;
    EXPECT_EQ(step_collectives[rank], (1 + 2 * n_layer + 1) + (2 * n_layer + 1)) << "rank " << rank;
    EXPECT_TRUE(torch::allclose(losses[rank], expected, 1e-6, 1e-6)) << "rank " << rank;
    EXPECT_TRUE(torch::allclose(grads[rank], whole.grad().chunk(2, 1)[rank], 1e-6, 1e-7))
        << "rank " << rank;
  }
}

// The public f and g leave their caller's tensors as they were (the layers' own forwards sum in
// place only tensors nothing else refers to).
TEST(TensorParallel, RegionFunctionsLeaveTheirInputsAlone) {
  std::vector<bool> intact(2, false);
  with_groups(2, [&](int rank, std::shared_ptr<comm::ProcessGroup> group) {
    const torch::Tensor x = torch::full({3, 4}, rank + 1.0).requires_grad_();
    const torch::Tensor y = x * 2;
    const torch::Tensor sum = reduce_from_tensor_parallel_region(y, group);
    const torch::Tensor copied = copy_to_tensor_parallel_region(y, group);
    const torch::Tensor grad = torch::ones({3, 4});
    torch::autograd::backward({copied, y}, {grad, grad});
    intact[rank] = torch::equal(y, torch::full({3, 4}, 2.0 * (rank + 1))) &&
                   torch::equal(sum, torch::full({3, 4}, 6.0)) &&
                   torch::equal(grad, torch::ones({3, 4})) &&
                   torch::equal(x.grad(), torch::full({3, 4}, 6.0));
  });
  EXPECT_TRUE(intact[0]);
  EXPECT_TRUE(intact[1]);
}

}  // namespace test_tensor_parallel
}  // namespace shoal::parallel
