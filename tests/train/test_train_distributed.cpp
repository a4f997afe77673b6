// `shoal train` end to end: checkpoints, bit-identical resume (one process and two DDP ranks),
// resume at another world size (2 -> 1, 1 -> 2), DDP ranks ending with identical weights, and the
// refusals of a hopeless --resume. Runs the built binary on a small subset of Fashion-MNIST.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "shoal/checkpoint/checkpoint_manager.h"
#include "shoal/checkpoint/serialization.h"
#include "shoal/checkpoint/training_state.h"
#include "testing/multi_rank.h"

namespace test_train_distributed {

namespace fs = std::filesystem;
using shoal::checkpoint::StateDict;
using shoal::checkpoint::TrainingState;

// 320 training images, batch 32: 10 steps per epoch alone, 5 per rank with two ranks; small
// enough that each run takes seconds, large enough that two epochs learn something.
const std::string kCommon =
    " train --model cnn --train-samples 320 --test-samples 100 --batch-size 32 --epochs 2"
    " --lr 0.05 --momentum 0.9 --seed 3 --threads 1 --no-progress";

struct Outcome {
  int status = -1;
  std::string output;
};

std::string shoal_binary() {
  const char* dir = std::getenv("SHOAL_BINARY_DIR");
  if (dir == nullptr) shoal::testing::skip_program(shoal::testing::Dependency::kOptional, "SHOAL_BINARY_DIR is not set (run under ctest)");
  if (!fs::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")) {
    shoal::testing::skip_program(shoal::testing::Dependency::kDataset, "Fashion-MNIST is not installed (dataset-fashion-mnist)");
  }
  return std::string(dir) + "/apps/shoal/shoal";
}

Outcome shoal(const std::string& arguments) {
  // A launcher's environment would make `--strategy ddp` run as a rank instead of launching.
  const std::string command = "env -u RANK -u WORLD_SIZE -u OMPI_COMM_WORLD_RANK -u PMI_RANK " +
                              shoal_binary() + arguments + " 2>&1";
  Outcome outcome;
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return outcome;
  char buffer[4096];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof buffer, pipe)) > 0) outcome.output.append(buffer, n);
  const int status = ::pclose(pipe);
  outcome.status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return outcome;
}

class TempDir {
 public:
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "shoal_train_XXXXXX").string();
    path_ = ::mkdtemp(pattern.data());
  }
  ~TempDir() {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  std::string sub(const std::string& name) const { return (fs::path(path_) / name).string(); }

 private:
  std::string path_;
};

TrainingState latest(const std::string& dir) {
  const auto path = shoal::checkpoint::find_latest(dir);
  EXPECT_TRUE(path.has_value()) << "no checkpoint in " << dir;
  return shoal::checkpoint::load_training_state(path.value_or(dir + "/missing"));
}

void expect_bit_identical(const StateDict& a, const StateDict& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& item : a) {
    const at::Tensor* other = b.find(item.key());
    ASSERT_NE(other, nullptr) << item.key();
    EXPECT_TRUE(at::equal(item.value(), *other)) << item.key() << " differs";
  }
}

double final_accuracy(const std::string& output) {
  const auto at = output.rfind("final test accuracy: ");
  if (at == std::string::npos) return -1;
  return std::atof(output.c_str() + at + std::string("final test accuracy: ").size());
}

TEST(TrainDistributed, SingleProcessResumeIsBitIdentical) {
  TempDir tmp;
  const Outcome whole = shoal(kCommon + " --checkpoint-dir " + tmp.sub("whole"));
  ASSERT_EQ(whole.status, 0) << whole.output;
  // Checkpoints at steps 3, 6, 9, 10 (epoch end), 12, 15; stopped at 16: resumes from step 15,
  // in the middle of epoch 2, and trains step 16 again.
  const std::string cut = kCommon + " --checkpoint-dir " + tmp.sub("cut") + " --checkpoint-every 3";
  const Outcome first = shoal(cut + " --stop-after-steps 16");
  ASSERT_EQ(first.status, 0) << first.output;
  EXPECT_EQ(latest(tmp.sub("cut")).step, 15);
  EXPECT_EQ(latest(tmp.sub("cut")).sampler.samples_seen, 5 * 32);
  const Outcome second = shoal(cut + " --resume");
  ASSERT_EQ(second.status, 0) << second.output;
  EXPECT_NE(second.output.find("resumed from"), std::string::npos) << second.output;

  const TrainingState expected = latest(tmp.sub("whole"));
  const TrainingState resumed = latest(tmp.sub("cut"));
  EXPECT_EQ(expected.step, 20);
  EXPECT_EQ(resumed.step, 20);
  EXPECT_EQ(resumed.epoch, 2);
  expect_bit_identical(expected.model, resumed.model);
  EXPECT_EQ(resumed.config.at("model").toStringRef(), "cnn");
  ASSERT_TRUE(resumed.config.at("batch_size").isInt());  // a number, not the text "32"
  EXPECT_EQ(resumed.config.at("batch_size").toInt(), 32);
}

TEST(TrainDistributed, DdpResumeIsBitIdenticalAndRanksAgree) {
  TempDir tmp;
  const std::string ddp = kCommon + " --strategy ddp --nproc-per-node 2";
  const Outcome whole = shoal(ddp + " --checkpoint-dir " + tmp.sub("whole") +
                              " --dump-parameters " + tmp.sub("final"));
  ASSERT_EQ(whole.status, 0) << whole.output;
  const double accuracy = final_accuracy(whole.output);
  EXPECT_GT(accuracy, 0.2) << whole.output;  // 10 classes: chance is 0.1
  EXPECT_LE(accuracy, 1.0);
  // Both ranks end with the same weights, and rank 0's checkpoint holds them.
  const StateDict rank0 = shoal::checkpoint::load_state_dict_file(tmp.sub("final") + ".rank0.pt");
  const StateDict rank1 = shoal::checkpoint::load_state_dict_file(tmp.sub("final") + ".rank1.pt");
  expect_bit_identical(rank0, rank1);
  const TrainingState expected = latest(tmp.sub("whole"));
  expect_bit_identical(expected.model, rank0);
  EXPECT_EQ(expected.world_size, 2);
  EXPECT_EQ(expected.step, 10);  // 5 steps per rank and epoch

  // Checkpoints at steps 2, 4, 5 (epoch end), 6, 8; stopped at 9; resumed from 8 (3 steps of
  // epoch 2 on 2 ranks: 192 samples).
  const std::string cut = ddp + " --checkpoint-dir " + tmp.sub("cut") + " --checkpoint-every 2";
  const Outcome first = shoal(cut + " --stop-after-steps 9");
  ASSERT_EQ(first.status, 0) << first.output;
  const TrainingState partial = latest(tmp.sub("cut"));
  EXPECT_EQ(partial.step, 8);
  EXPECT_EQ(partial.sampler.epoch, 1);
  EXPECT_EQ(partial.sampler.samples_seen, 3 * 2 * 32);
  const Outcome second = shoal(cut + " --resume");
  ASSERT_EQ(second.status, 0) << second.output;
  expect_bit_identical(expected.model, latest(tmp.sub("cut")).model);
}

TEST(TrainDistributed, ResumesAtAnotherWorldSize) {
  TempDir tmp;
  // Two ranks stop after step 3 (checkpoint at step 2: 2 x 2 x 32 = 128 samples of epoch 1); one
  // process resumes: (320 - 128) / 32 = 6 more steps in epoch 1, then 10 in epoch 2.
  const std::string two = tmp.sub("two");
  ASSERT_EQ(shoal(kCommon + " --strategy ddp --nproc-per-node 2 --checkpoint-dir " + two +
                  " --checkpoint-every 2 --stop-after-steps 3")
                .status,
            0);
  EXPECT_EQ(latest(two).sampler.samples_seen, 128);
  const Outcome by_one = shoal(kCommon + " --checkpoint-dir " + two + " --resume");
  ASSERT_EQ(by_one.status, 0) << by_one.output;
  EXPECT_GT(final_accuracy(by_one.output), 0.2) << by_one.output;
  const TrainingState after_one = latest(two);
  EXPECT_EQ(after_one.step, 2 + 6 + 10);
  EXPECT_EQ(after_one.world_size, 1);

  // One process stops after step 4 (checkpoint at step 3: 96 samples); two ranks resume: each
  // skips 48 of its 160, (160 - 48) / 32 -> 4 steps, then 5 in epoch 2.
  const std::string one = tmp.sub("one");
  ASSERT_EQ(shoal(kCommon + " --checkpoint-dir " + one + " --checkpoint-every 3 --stop-after-steps 4")
                .status,
            0);
  const Outcome by_two =
      shoal(kCommon + " --strategy ddp --nproc-per-node 2 --checkpoint-dir " + one + " --resume");
  ASSERT_EQ(by_two.status, 0) << by_two.output;
  EXPECT_GT(final_accuracy(by_two.output), 0.2) << by_two.output;
  const TrainingState after_two = latest(one);
  EXPECT_EQ(after_two.step, 3 + 4 + 5);
  EXPECT_EQ(after_two.world_size, 2);
  for (const auto& item : after_two.model) {
    EXPECT_TRUE(item.value().isfinite().all().item<bool>()) << item.key();
  }
}

TEST(TrainDistributed, RefusesHopelessResume) {
  TempDir tmp;
  const Outcome empty =
      shoal(kCommon + " --strategy ddp --nproc-per-node 2 --checkpoint-dir " + tmp.sub("none") +
            " --resume");
  EXPECT_NE(empty.status, 0);
  EXPECT_NE(empty.output.find("no checkpoint in"), std::string::npos) << empty.output;
  EXPECT_EQ(empty.output.find("[rank"), std::string::npos) << "refused before launching\n"
                                                           << empty.output;

  const std::string dir = tmp.sub("cnn");
  ASSERT_EQ(shoal(" train --model cnn --train-samples 32 --test-samples 10 --no-progress"
                  " --threads 1 --checkpoint-dir " + dir).status,
            0);
  const Outcome other = shoal(
      " train --model mlp --train-samples 64 --test-samples 10 --no-progress --checkpoint-dir " +
      dir + " --resume");
  EXPECT_NE(other.status, 0);
  EXPECT_NE(other.output.find("checkpoint of model 'cnn'"), std::string::npos) << other.output;
}

}  // namespace test_train_distributed
