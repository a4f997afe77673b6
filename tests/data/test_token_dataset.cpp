// Token streams: TokenFile reads uint16 and uint32 files as written (little-endian) and refuses
// bad ones in one line naming the file; TokenBlockDataset's blocks are non-overlapping, their
// targets the inputs shifted by one; ExactlyOnceSampler deals every block of an epoch exactly
// once over 1, 2 and 3 ranks, in the same order at any world size, and resumes mid-epoch with the
// next unseen block, also at another world size; and so does the trainer: a GPT checkpointed
// mid-epoch with 1, 2 or 3 ranks trains the rest of the epoch's blocks once with another number
// (and a classifier the rest of its in-memory samples, padded as DistributedSampler pads).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <ostream>
#include <set>

#include "shoal/checkpoint/checkpoint_manager.h"
#include "shoal/checkpoint/state_dict.h"
#include "shoal/comm/init.h"
#include "shoal/comm/store.h"
#include "shoal/data/data_loader.h"
#include "shoal/data/distributed_sampler.h"
#include "shoal/data/exactly_once_sampler.h"
#include "shoal/data/token_block_dataset.h"
#include "shoal/data/token_file.h"
#include "shoal/error.h"
#include "shoal/models/gpt.h"
#include "shoal/train/ddp_strategy.h"
#include "shoal/train/trainer.h"
#include "testing/multi_rank.h"

namespace shoal::data {
namespace test_token_dataset {

/// Writes `bytes` to a fresh file and returns its path.
std::string write_bytes(const std::string& stem, const std::string& bytes) {
  const std::string path = testing::temp_path(stem);
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return path;
}

/// A token file whose token at position p is p (uint32), so a block names itself.
std::string write_positions(int64_t count) {
  std::string bytes;
  for (int64_t p = 0; p < count; ++p) {
    const auto v = static_cast<uint32_t>(p);
    const unsigned char le[4] = {static_cast<unsigned char>(v), static_cast<unsigned char>(v >> 8),
                                 static_cast<unsigned char>(v >> 16), static_cast<unsigned char>(v >> 24)};
    bytes.append(reinterpret_cast<const char*>(le), 4);
  }
  return write_bytes("positions.bin", bytes);
}

/// The message of the DataError `fn` throws ("" when it throws none).
template <typename Fn>
std::string data_error(Fn fn) {
  try {
    fn();
  } catch (const DataError& e) {
    return e.what();
  }
  return "";
}

TEST(TokenFile, ReadsLittleEndianUint16AndUint32) {
  const std::string u16 = write_bytes("u16.bin", std::string("\x01\x00\xff\xff\x34\x12", 6));
  TokenFile small(u16);
  EXPECT_EQ(small.size(), 3);
  EXPECT_TRUE(torch::equal(small.read(0, 3), torch::tensor({1, 65535, 0x1234}, torch::kLong)));
  EXPECT_TRUE(torch::equal(small.read(1, 1), torch::tensor({65535}, torch::kLong)));
  EXPECT_EQ(small.read(3, 0).numel(), 0);
  EXPECT_THROW(small.read(2, 2), InvalidArgument);
  EXPECT_THROW(small.read(-1, 1), InvalidArgument);

  TokenFileOptions wide;
  wide.dtype = TokenDtype::kUInt32;
  const std::string u32 = write_bytes("u32.bin", std::string("\x01\x00\x00\x00\x00\x00\x01\x80", 8));
  TokenFile large(u32, wide);
  EXPECT_EQ(large.size(), 2);
  EXPECT_TRUE(torch::equal(large.read(0, 2), torch::tensor({int64_t{1}, int64_t{0x80010000}}, torch::kLong)));
  EXPECT_EQ(large.check_vocab(), 0x80010000);
  EXPECT_EQ(parse_token_dtype("uint32"), TokenDtype::kUInt32);
  for (TokenDtype dtype : {TokenDtype::kUInt16, TokenDtype::kUInt32}) {
    EXPECT_EQ(parse_token_dtype(token_dtype_name(dtype)), dtype);
  }
  EXPECT_THROW(parse_token_dtype("int8"), InvalidArgument);
}

TEST(TokenFile, BadFilesAreOneLineNamingTheFile) {
  const std::string missing = testing::temp_path("missing.bin");
  {
    const std::string message = data_error([&] { TokenFile file(missing); });
    EXPECT_NE(message.find("token file " + missing + ": cannot open: No such file"), std::string::npos) << message;
  }
  const std::string folder = testing::temp_path("folder");
  std::filesystem::create_directory(folder);
  EXPECT_NE(data_error([&] { TokenFile file(folder); }).find(folder + " is not a regular file"),
            std::string::npos);
  const std::string empty = write_bytes("empty.bin", "");
  EXPECT_NE(data_error([&] { TokenFile file(empty); }).find(empty + " is empty"), std::string::npos);
  const std::string odd = write_bytes("odd.bin", "abc");
  const std::string odd_message = data_error([&] { TokenFile file(odd); });
  EXPECT_NE(odd_message.find(odd + " has 3 bytes, not a multiple of 2 (the width of uint16"),
            std::string::npos) << odd_message;
  TokenFileOptions wide;
  wide.dtype = TokenDtype::kUInt32;
  const std::string six = write_bytes("six.bin", "abcdef");
  EXPECT_NE(data_error([&] { TokenFile file(six, wide); }).find("not a multiple of 4"), std::string::npos);
  for (const std::string& message :
       {data_error([&] { TokenFile file(odd); }), data_error([&] { TokenFile file(empty); })}) {
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
}

TEST(TokenFile, TokensOutsideTheVocabularyNameFileAndOffset) {
  // Tokens 0..9, then 300 at offset 10: a byte-level vocabulary (256) refuses the block holding it.
  std::string bytes;
  for (int t : {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 300, 11}) {
    bytes += static_cast<char>(t & 0xff);
    bytes += static_cast<char>(t >> 8);
  }
  const std::string path = write_bytes("vocab.bin", bytes);
  TokenFileOptions options;
  options.vocab_size = 256;
  auto tokens = std::make_shared<TokenFile>(path, options);
  TokenBlockDataset blocks(tokens, 5);  // blocks [0, 5], [5, 10], the second holds offset 10
  EXPECT_NO_THROW(blocks.get_batch(torch::tensor({0}, torch::kLong)));
  const std::string message = data_error([&] { blocks.get_batch(torch::tensor({1}, torch::kLong)); });
  EXPECT_NE(message.find("token file " + path + ": token 300 at offset 10 (byte 20) is not below the "
                         "vocabulary size 256"), std::string::npos) << message;
  EXPECT_EQ(message.find('\n'), std::string::npos);
  EXPECT_NE(data_error([&] { tokens->check_vocab(); }).find("at offset 10"), std::string::npos);
  options.vocab_size = 301;
  EXPECT_EQ(TokenFile(path, options).check_vocab(), 300);
}

TEST(TokenBlockDataset, NonOverlappingBlocksWithTargetsShiftedByOne) {
  auto tokens = std::make_shared<TokenFile>(write_positions(23), TokenFileOptions{TokenDtype::kUInt32});
  TokenBlockDataset blocks(tokens, 4);
  EXPECT_EQ(blocks.size(), 5);  // (23 - 1) / 4: tokens 21 and 22 are in no block
  const Batch batch = blocks.get_batch(torch::tensor({3, 0, 4}, torch::kLong));
  EXPECT_TRUE(torch::equal(batch.data, torch::tensor({{12, 13, 14, 15}, {0, 1, 2, 3}, {16, 17, 18, 19}},
                                                     torch::kLong)));
  EXPECT_TRUE(torch::equal(batch.target, batch.data + 1));
  EXPECT_TRUE(batch.data.is_contiguous() && batch.target.is_contiguous());
  EXPECT_THROW(blocks.get_batch(torch::tensor({5}, torch::kLong)), InvalidArgument);
  EXPECT_EQ(TokenBlockDataset::block_count(21, 4), 5);  // exactly 5 blocks of 4 + 1
  EXPECT_EQ(TokenBlockDataset::block_count(4, 4), 0);
  EXPECT_THROW(TokenBlockDataset(tokens, 0), InvalidArgument);
  const std::string message = data_error([&] { TokenBlockDataset too_long(tokens, 23); });
  EXPECT_NE(message.find("has 23 tokens, fewer than one block of 23 + 1"), std::string::npos) << message;
}

/// Block ids (first input token / block_size) of every batch `rank` of `world` loads in `epoch`.
std::vector<int64_t> dealt_blocks(const TokenBlockDataset& blocks, int rank, int world,
                                  uint64_t seed, uint64_t epoch, int64_t consumed = 0) {
  ExactlyOnceSamplerOptions options;
  options.seed = seed;
  ExactlyOnceSampler sampler(blocks.size(), rank, world, options);
  sampler.set_epoch(epoch, consumed);
  DataLoaderOptions loading;
  loading.batch_size = 4;
  loading.num_workers = 2;
  DataLoader loader(blocks, sampler.indices(), loading);
  std::vector<int64_t> ids;
  while (std::optional<Batch> batch = loader.next()) {
    const at::Tensor first = batch->data.select(1, 0).div(blocks.block_size(), "floor");
    for (int64_t i = 0; i < first.numel(); ++i) ids.push_back(first[i].item<int64_t>());
  }
  return ids;
}

TEST(ExactlyOnceSampler, EveryBlockOnceOverOneTwoAndThreeRanks) {
  auto tokens = std::make_shared<TokenFile>(write_positions(8 * 101 + 1), TokenFileOptions{TokenDtype::kUInt32});
  const TokenBlockDataset blocks(tokens, 8);  // 101 blocks: uneven over 2 and 3 ranks
  std::vector<int64_t> single = dealt_blocks(blocks, 0, 1, 7, 3);
  for (int world : {1, 2, 3}) {
    std::vector<int64_t> count(101, 0);
    std::vector<int64_t> interleaved(101, -1);
    for (int rank = 0; rank < world; ++rank) {
      const std::vector<int64_t> ids = dealt_blocks(blocks, rank, world, 7, 3);
      EXPECT_LE(std::abs(static_cast<int64_t>(ids.size()) - 101 / world), 1);
      for (size_t j = 0; j < ids.size(); ++j) {
        ++count[static_cast<size_t>(ids[j])];
        interleaved[j * static_cast<size_t>(world) + static_cast<size_t>(rank)] = ids[j];
      }
    }
    EXPECT_EQ(count, std::vector<int64_t>(101, 1)) << world << " ranks";
    // The same order at any world size: the ranks' blocks, interleaved, are one rank's epoch.
    EXPECT_EQ(interleaved, single) << world << " ranks";
  }
}

TEST(ExactlyOnceSampler, SameSeedSameDealingOtherSeedOrEpochAnother) {
  ExactlyOnceSamplerOptions options;
  options.seed = 11;
  ExactlyOnceSampler a(1000, 1, 3, options);
  ExactlyOnceSampler b(1000, 1, 3, options);
  a.set_epoch(2);
  b.set_epoch(2);
  EXPECT_TRUE(torch::equal(a.indices(), b.indices()));
  b.set_epoch(3);
  EXPECT_FALSE(torch::equal(a.indices(), b.indices()));
  options.seed = 12;
  ExactlyOnceSampler c(1000, 1, 3, options);
  c.set_epoch(2);
  EXPECT_FALSE(torch::equal(a.indices(), c.indices()));
  // DistributedSampler's (and PyTorch's) order: its ranks take the same indices while none is padding.
  DistributedSamplerOptions distributed;
  distributed.seed = 11;
  DistributedSampler pytorch(999, 1, 3, distributed);
  pytorch.set_epoch(2);
  ExactlyOnceSampler same(999, 1, 3, options = ExactlyOnceSamplerOptions{true, 11, false});
  same.set_epoch(2);
  const std::vector<size_t> expected = pytorch.indices();
  ASSERT_EQ(same.size(), static_cast<int64_t>(expected.size()));
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(same.indices()[static_cast<int64_t>(i)].item<int64_t>(), static_cast<int64_t>(expected[i]));
  }
}

TEST(ExactlyOnceSampler, MidEpochResumeContinuesWithTheNextUnseenBlock) {
  auto tokens = std::make_shared<TokenFile>(write_positions(4 * 50 + 1), TokenFileOptions{TokenDtype::kUInt32});
  const TokenBlockDataset blocks(tokens, 4);  // 50 blocks
  ExactlyOnceSamplerOptions options;
  options.seed = 5;
  // Two ranks take 3 batches of 4 blocks each, then the job stops.
  std::vector<int64_t> count(50, 0);
  ExactlyOnceSampler first(blocks.size(), 0, 2, options);
  first.set_epoch(1);
  for (int rank = 0; rank < 2; ++rank) {
    const std::vector<int64_t> ids = dealt_blocks(blocks, rank, 2, 5, 1);
    for (size_t j = 0; j < 12; ++j) ++count[static_cast<size_t>(ids[j])];
  }
  const int64_t consumed = first.consumed_after(12);
  EXPECT_EQ(consumed, 24);
  // Resumed on three ranks: the first block each rank takes is the next unseen one of the order.
  for (int rank = 0; rank < 3; ++rank) {
    const std::vector<int64_t> ids = dealt_blocks(blocks, rank, 3, 5, 1, consumed);
    ASSERT_FALSE(ids.empty());
    EXPECT_EQ(ids[0], first.order()[consumed + rank].item<int64_t>());
    for (int64_t id : ids) ++count[static_cast<size_t>(id)];
  }
  EXPECT_EQ(count, std::vector<int64_t>(50, 1));
  ExactlyOnceSampler done(50, 0, 2, options);
  done.set_epoch(1, 50);
  EXPECT_EQ(done.indices().numel(), 0);
  EXPECT_THROW(done.set_epoch(1, 51), InvalidArgument);
}

TEST(ExactlyOnceSampler, DropLastGivesEqualCountsEachBlockAtMostOnce) {
  ExactlyOnceSamplerOptions options;
  options.drop_last = true;
  std::set<int64_t> seen;
  for (int rank = 0; rank < 3; ++rank) {
    ExactlyOnceSampler sampler(101, rank, 3, options);
    sampler.set_epoch(4, 1);
    const at::Tensor ids = sampler.indices();
    EXPECT_EQ(ids.numel(), 33);  // (101 - 1) / 3; the order's last index is left out
    for (int64_t i = 0; i < ids.numel(); ++i) EXPECT_TRUE(seen.insert(ids[i].item<int64_t>()).second);
  }
  EXPECT_EQ(seen.size(), 99u);
  EXPECT_THROW(ExactlyOnceSampler(10, 3, 3), InvalidArgument);
  EXPECT_THROW(ExactlyOnceSampler(-1, 0, 1), InvalidArgument);
}

// ---- Resume at another world size, through the trainer -------------------------------------------

/// A GPT that notes the blocks it trains on, by id: on the positions file, a block's first input
/// token is its id times the block size.
class BlockNotingGpt : public models::Gpt {
 public:
  explicit BlockNotingGpt(const models::GptConfig& config) : Gpt(config) {}
  at::Tensor forward_loss(const at::Tensor& idx, const at::Tensor& targets) override {
    const at::Tensor first = idx.select(1, 0).contiguous();
    for (int64_t i = 0; i < first.numel(); ++i) {
      trained.push_back(first[i].item<int64_t>() / config().block_size);
    }
    return Gpt::forward_loss(idx, targets);
  }
  std::vector<int64_t> trained;
};

/// The ids a rank trained on, in order.
using RankRun = std::function<std::vector<int64_t>(int rank, std::unique_ptr<train::Strategy>)>;

/// Runs `run` on `world` ranks (threads; DDP over shm, or none alone): what each trained.
std::vector<std::vector<int64_t>> on_ranks(int world, const RankRun& run) {
  std::vector<std::vector<int64_t>> trained(static_cast<size_t>(world));
  auto store = comm::make_hash_store(std::chrono::milliseconds(60'000));
  testing::run_threads(world, [&](int rank) {
    std::unique_ptr<train::Strategy> strategy;
    if (world > 1) {
      strategy = std::make_unique<train::DdpStrategy>(
          comm::new_process_group("shm", store, rank, world, std::chrono::milliseconds(60'000)));
    }
    trained[static_cast<size_t>(rank)] = run(rank, std::move(strategy));
  });
  return trained;
}

/// Resumes `trainer` when its options say so, and checks that its model then holds the
/// checkpoint's weights.
void resume_from_checkpoint(train::Trainer& trainer, const torch::nn::Module& model) {
  if (!trainer.options().resume) return;
  trainer.resume();
  const auto saved = checkpoint::CheckpointManager(trainer.options().checkpoint_dir).load_latest();
  ASSERT_TRUE(saved.has_value());
  const checkpoint::StateDict now = checkpoint::state_dict(model);
  for (const auto& item : saved->model) {
    EXPECT_TRUE(torch::equal(now[item.key()], item.value())) << item.key();
  }
}

/// A tiny GPT trained on `blocks` through the trainer on `world` ranks.
std::vector<std::vector<int64_t>> train_gpt(const TokenBlockDataset& blocks, int world,
                                            const train::TrainOptions& options) {
  models::GptConfig config;
  config.n_layer = 1;
  config.n_head = 1;
  config.n_embd = 8;
  config.block_size = blocks.block_size();
  config.vocab_size = blocks.tokens().size();
  return on_ranks(world, [&](int, std::unique_ptr<train::Strategy> strategy) {
    auto gpt = std::make_shared<BlockNotingGpt>(config);
    train::Trainer trainer(options, gpt, std::move(strategy));
    resume_from_checkpoint(trainer, *gpt);
    trainer.fit(blocks, nullptr);
    return gpt->trained;
  });
}

/// A linear classifier trained through the trainer on `world` ranks on in-memory samples whose
/// input is their id.
std::vector<std::vector<int64_t>> train_classifier(int64_t samples, int world,
                                                   const train::TrainOptions& options) {
  const at::Tensor ids = torch::arange(samples, torch::kLong);
  const train::TensorData data{ids.to(torch::kFloat).unsqueeze(1), ids.remainder(2)};
  return on_ranks(world, [&](int, std::unique_ptr<train::Strategy> strategy) {
    const std::shared_ptr<torch::nn::LinearImpl> linear = torch::nn::Linear(1, 2).ptr();
    auto trained = std::make_shared<std::vector<int64_t>>();
    const auto forward = [linear, trained](const at::Tensor& x) {
      for (int64_t i = 0; i < x.size(0); ++i) trained->push_back(x[i][0].item<int64_t>());
      return linear->forward(x);
    };
    train::Trainer trainer(options, linear, forward,
                           std::make_unique<torch::optim::SGD>(linear->parameters(),
                                                               torch::optim::SGDOptions(0.01)),
                           train::cross_entropy_loss, std::move(strategy));
    resume_from_checkpoint(trainer, *linear);
    trainer.fit(data, train::TensorData{});
    return *trained;
  });
}

struct WorldChange {
  int from;
  int to;
  int64_t batch;
  int64_t steps;  // trained with `from` ranks before the stop
};

std::ostream& operator<<(std::ostream& out, const WorldChange& change) {
  return out << change.from << " -> " << change.to << " ranks, batch " << change.batch << ", "
             << change.steps << " steps before the stop";
}

train::TrainOptions stopping_options(const std::string& model, const WorldChange& change) {
  train::TrainOptions options;
  options.model = model;
  options.seed = 3;
  options.batch_size = change.batch;
  options.lr = 0.01;
  options.epochs = 1;
  options.threads = 1;
  options.progress = train::ProgressMode::kNone;
  options.log_interval = 0;
  options.checkpoint_dir = testing::temp_path("shoal-resume-world");
  options.checkpoint_every = change.steps;
  options.stop_after_steps = change.steps;
  return options;
}

/// How often each id was trained over both runs.
std::vector<int64_t> counts(int64_t size, const std::vector<std::vector<int64_t>>& first,
                            const std::vector<std::vector<int64_t>>& second) {
  std::vector<int64_t> count(static_cast<size_t>(size), 0);
  for (const auto* run : {&first, &second}) {
    for (const auto& ids : *run) {
      for (int64_t id : ids) ++count.at(static_cast<size_t>(id));
    }
  }
  return count;
}

class ResumeAtAnotherWorldSize : public ::testing::TestWithParam<WorldChange> {};

// A GPT run stopped mid-epoch with `from` ranks resumes with `to`: the blocks the job consumed
// are the epoch's order up to the checkpoint, and the resumed ranks deal the rest of the order
// among them (rank r the r-th of each `to`), so over both runs each block of the epoch is trained
// once (drop_last leaves out the last (blocks - consumed) % to), from the checkpoint's weights.
TEST_P(ResumeAtAnotherWorldSize, TrainsTheRestOfTheEpochsBlocksExactlyOnce) {
  torch::set_num_threads(1);
  const WorldChange change = GetParam();
  constexpr int64_t kBlocks = 37;  // uneven over 2 and 3 ranks
  auto tokens = std::make_shared<TokenFile>(write_positions(4 * kBlocks + 1),
                                            TokenFileOptions{TokenDtype::kUInt32});
  const TokenBlockDataset blocks(tokens, 4);
  train::TrainOptions options = stopping_options("gpt", change);
  const auto first = train_gpt(blocks, change.from, options);
  const int64_t consumed = change.steps * change.batch * change.from;
  const auto saved = checkpoint::CheckpointManager(options.checkpoint_dir).load_latest();
  ASSERT_TRUE(saved.has_value());
  ASSERT_EQ(saved->sampler.samples_seen, consumed);
  options.stop_after_steps = 0;
  options.resume = true;
  const auto second = train_gpt(blocks, change.to, options);
  const at::Tensor order = epoch_permutation(kBlocks, true, options.seed, 0);
  const int64_t rest = (kBlocks - consumed) / change.to;
  for (int rank = 0; rank < change.to; ++rank) {
    std::vector<int64_t> expected;
    for (int64_t k = 0; k < rest; ++k) {
      expected.push_back(order[consumed + rank + k * change.to].item<int64_t>());
    }
    EXPECT_EQ(second[static_cast<size_t>(rank)], expected) << "resumed rank " << rank;
  }
  std::vector<int64_t> expected_count(kBlocks, 0);
  for (int64_t j = 0; j < consumed + rest * change.to; ++j) {
    expected_count[static_cast<size_t>(order[j].item<int64_t>())] = 1;
  }
  EXPECT_EQ(counts(kBlocks, first, second), expected_count);
  std::filesystem::remove_all(options.checkpoint_dir);
}

// In-memory samples are dealt as DistributedSampler deals them, padded to equal shares: resumed
// at another world size, the rest of the epoch's order is dealt over the new ranks, padded from
// the start of the order, so each sample of the rest is trained once (and only the padding twice).
TEST_P(ResumeAtAnotherWorldSize, TrainsTheRestOfTheEpochsSamplesOnceWithPadding) {
  torch::set_num_threads(1);
  const WorldChange change = GetParam();
  constexpr int64_t kSamples = 37;
  train::TrainOptions options = stopping_options("linear", change);
  const auto first = train_classifier(kSamples, change.from, options);
  const int64_t consumed = change.steps * change.batch * change.from;
  options.stop_after_steps = 0;
  options.resume = true;
  const auto second = train_classifier(kSamples, change.to, options);
  const at::Tensor order = epoch_permutation(kSamples, true, options.seed, 0);
  const int64_t padding = (change.to - (kSamples - consumed) % change.to) % change.to;
  std::vector<int64_t> expected_count(kSamples, 1);
  for (int64_t j = 0; j < padding; ++j) ++expected_count[static_cast<size_t>(order[j].item<int64_t>())];
  EXPECT_EQ(counts(kSamples, first, second), expected_count);
  for (int rank = 0; rank < change.to; ++rank) {
    ASSERT_FALSE(second[static_cast<size_t>(rank)].empty());
    EXPECT_EQ(second[static_cast<size_t>(rank)][0], order[consumed + rank].item<int64_t>());
  }
  std::filesystem::remove_all(options.checkpoint_dir);
}

// Checkpoints whose position is not a multiple of the new world size (2 -> 3: 4 samples; 1 -> 2
// and 3 -> 2: 9), and one that is (2 -> 1).
INSTANTIATE_TEST_SUITE_P(Trainer, ResumeAtAnotherWorldSize,
                         ::testing::Values(WorldChange{2, 3, 2, 1}, WorldChange{2, 1, 2, 2},
                                           WorldChange{1, 2, 3, 3}, WorldChange{3, 2, 3, 1}),
                         [](const ::testing::TestParamInfo<WorldChange>& info) {
                           return "From" + std::to_string(info.param.from) + "To" +
                                  std::to_string(info.param.to);
                         });

}  // namespace test_token_dataset
}  // namespace shoal::data
