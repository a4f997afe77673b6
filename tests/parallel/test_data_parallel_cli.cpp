// `shoal train --strategy dp --replicas K`, `--strategy ddp --model-parallel 2` and `--comm-hook
// powersgd` as a user runs them: on the same Fashion-MNIST samples the first two end with the
// parameters of single-process training (dp) and of plain DDP (model parallel x DDP), to float
// tolerance; PowerSGD's accuracy stays close to DDP's with fewer bytes.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <set>

#include "shoal/checkpoint/serialization.h"
#include "shoal/launcher/launch.h"
#include "testing/multi_rank.h"
#include "testing/shoal_cli.h"

namespace test_data_parallel_cli {

namespace fs = std::filesystem;

std::string shoal_binary() { return shoal::testing::shoal_cli_with_dataset(); }

// Trains the MLP on 256 samples with `strategy_args`; returns rank 0's final parameters.
shoal::checkpoint::StateDict train(const std::string& strategy_args) {
  const std::string prefix = shoal::testing::temp_path("shoal-dp-cli");
  const std::string command = shoal_binary() + " train " + strategy_args +
                              " --model mlp --train-samples 256 --test-samples 32 --epochs 1"
                              " --batch-size 32 --no-progress --dump-parameters " + prefix +
                              " >/dev/null 2>" + prefix + ".err";
  const int status = std::system(command.c_str());
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << command;
  auto state = shoal::checkpoint::load_state_dict_file(prefix + ".rank0.pt");
  for (const auto& suffix : {".rank0.pt", ".rank1.pt", ".err"}) fs::remove(prefix + suffix);
  return state;
}

using shoal::testing::max_relative_difference;

TEST(DataParallelCli, DpReplicasTrainLikeOneProcess) {
  const auto single = train("--strategy single --threads 1");
  EXPECT_LT(max_relative_difference(train("--strategy dp --replicas 2"), single), 1e-5);
  // 3 replicas split each batch of 32 unevenly (11, 11, 10): still one process's result.
  EXPECT_LT(max_relative_difference(train("--strategy dp --replicas 3"), single), 1e-5);
}

TEST(DataParallelCli, ModelParallelDdpTrainsLikeDdp) {
  const auto ddp = train("--strategy ddp --nproc-per-node 2");
  EXPECT_LT(max_relative_difference(train("--strategy ddp --nproc-per-node 2 --model-parallel 2"), ddp),
            1e-5);
}


// `shoal train --strategy ddp --comm-hook powersgd` (PyTorch's powerSGD_hook, error feedback and
// warm start) on the CNN and 12000 real Fashion-MNIST images: test accuracy within 5 points of
// plain DDP's after the same epoch, sending under a quarter of the dense gradient's bytes.
// So short a run leaves the compressed gradient behind in PyTorch too, by an amount that moves
// with rounding; PyTorch's own hook on this setting (bench/powersgd_torch.py --rank 8
// --start-iter 10 --batch 32 --lr 0.05 --momentum 0.9 --train-samples 12000 --test-samples 2000):
//   PyTorch 1.13: DDP 0.8420, PowerSGD 0.8220   Shoal on LibTorch 1.13: 0.8405, 0.8140
//   PyTorch 2.15: DDP 0.8525, PowerSGD 0.8125   Shoal on LibTorch 2.15: 0.8525, 0.8125
// (556 KB/step against 4.8 MB dense). The bound is for a broken hook, not for that gap; the
// hook's numbers are compared with PyTorch's bit for bit in test_ddp_vs_pytorch.
TEST(DdpCli, PowerSgdOnTheCnnStaysCloseToDdpWithFewerBytes) {
  auto run = [](const std::string& hook) {
    const std::string log = shoal::testing::temp_path("shoal-powersgd");
    const std::string command =
        shoal_binary() + " train --strategy ddp --nproc-per-node 2 --model cnn --epochs 1 "
        "--train-samples 12000 --test-samples 2000 --batch-size 32 --lr 0.05 --threads 1 "
        "--no-progress --comm-hook " + hook + " >" + log + " 2>&1";
    const int status = std::system(command.c_str());
    const std::string text = shoal::testing::read_file(log);
    fs::remove(log);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << command << "\n" << text;
    return text;
  };
  auto number_after = [](const std::string& text, const std::string& label) {
    const size_t at = text.find(label);
    EXPECT_NE(at, std::string::npos) << label << " in:\n" << text;
    return at == std::string::npos ? -1.0 : std::stod(text.substr(at + label.size()));
  };
  const std::string plain = run("allreduce");
  const std::string power = run("powersgd --powersgd-rank 8 --powersgd-start-iter 10");
  const double plain_accuracy = number_after(plain, "final test accuracy: ");
  const double power_accuracy = number_after(power, "final test accuracy: ");
  const double bytes = number_after(power, "powersgd: ");
  std::printf("test accuracy: ddp %.4f, powersgd %.4f (%.0f bytes per step)\n", plain_accuracy,
              power_accuracy, bytes);
  EXPECT_GT(plain_accuracy, 0.8) << plain;
  EXPECT_GT(power_accuracy, plain_accuracy - 0.05) << power;
  // The CNN has 1,199,882 parameters: 4.8 MB of float32 gradient per step when dense.
  EXPECT_GT(bytes, 0);
  EXPECT_LT(bytes, 1199882 * 4 / 4.0) << power;
}

// `shoal train --strategy ddp --bucket-cap-mb auto`: the first steps try the candidate caps and keep
// one; the header says auto, the log names the choice, every --metrics step line carries the cap
// in use and whether it is still tuning (1 for the first steps, then 0 to the end), and the run
// ends with the parameters of the default fixed cap (on 2 ranks the average of two gradients
// does not depend on where the buckets split, so to float rounding at most).
TEST(DdpCli, BucketCapAutoTrainsLikeAFixedCapAndSaysWhatItChose) {
  auto run = [](const std::string& cap, const std::string& prefix) {
    const std::string command =
        shoal_binary() + " train --strategy ddp --nproc-per-node 2 --model mlp --epochs 1 "
        "--train-samples 2400 --test-samples 32 --batch-size 8 --threads 1 "
        "--log-interval 1 --metrics " + prefix + ".jsonl --dump-parameters " + prefix +
        " --bucket-cap-mb " + cap + " >" + prefix + ".log 2>&1";
    const int status = std::system(command.c_str());
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << command << "\n" << shoal::testing::read_file(prefix + ".log");
  };
  const std::string fixed = shoal::testing::temp_path("shoal-cap-fixed");
  const std::string tuned = shoal::testing::temp_path("shoal-cap-auto");
  run("25", fixed);
  run("auto", tuned);
  const std::string log = shoal::testing::read_file(tuned + ".log");
  EXPECT_NE(log.find("bucket_cap_mb auto"), std::string::npos) << "the header:\n" << log;
  // The header says how the buckets are reduced: inline where the two ranks' one thread each
  // leave no core spare, else overlapped; a registered comm hook runs as it is written.
  EXPECT_NE(log.find(shoal::launcher::available_cores() <= 2
                         ? "buckets reduced inline"
                         : "buckets reduced overlapped with backward"),
            std::string::npos)
      << log;
  const std::string hooked = shoal::testing::temp_path("shoal-cap-hook");
  const std::string command =
      shoal_binary() + " train --strategy ddp --nproc-per-node 2 --model mlp --epochs 1 "
      "--train-samples 256 --test-samples 32 --batch-size 32 --threads 1 --comm-hook fp16 >" +
      hooked + " 2>&1";
  const int status = std::system(command.c_str());
  const std::string hooked_log = shoal::testing::read_file(hooked);
  fs::remove(hooked);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << command << "\n" << hooked_log;
  EXPECT_NE(hooked_log.find("buckets reduced by the fp16 comm hook"), std::string::npos)
      << hooked_log;
  EXPECT_NE(log.find("bucket_cap_mb=auto chose "), std::string::npos) << log;
  const auto caps = shoal::testing::step_metrics(tuned + ".jsonl", "bucket_cap_mb");
  const auto tuning = shoal::testing::step_metrics(tuned + ".jsonl", "bucket_cap_tuning");
  ASSERT_EQ(caps.size(), 150u);  // 2400 samples / (2 ranks x 8)
  ASSERT_EQ(tuning.size(), caps.size());
  EXPECT_EQ(tuning.front(), 1);
  EXPECT_EQ(tuning.back(), 0) << "still tuning after 150 steps";
  const size_t decided = std::find(tuning.begin(), tuning.end(), 0.0) - tuning.begin();
  std::set<double> tried(caps.begin() + 1, caps.begin() + static_cast<long>(decided));
  EXPECT_GE(tried.size(), 2u) << "the MLP's candidates give several bucket sets";
  for (size_t k = decided; k < caps.size(); ++k) {
    EXPECT_EQ(tuning[k], 0) << "step " << k + 1;
    EXPECT_EQ(caps[k], caps.back()) << "step " << k + 1 << ": the choice changed";
  }
  EXPECT_TRUE(tried.count(caps.back())) << "kept " << caps.back() << ", a cap it never tried";
  for (double cap : shoal::testing::step_metrics(fixed + ".jsonl", "bucket_cap_mb")) {
    EXPECT_EQ(cap, 25);
  }
  for (int rank = 0; rank < 2; ++rank) {
    const std::string suffix = ".rank" + std::to_string(rank) + ".pt";
    EXPECT_LE(max_relative_difference(shoal::checkpoint::load_state_dict_file(tuned + suffix),
                                      shoal::checkpoint::load_state_dict_file(fixed + suffix)),
              1e-6)
        << "rank " << rank;
  }
  for (const auto& prefix : {fixed, tuned}) {
    for (const auto& suffix : {".rank0.pt", ".rank1.pt", ".log", ".jsonl"}) fs::remove(prefix + suffix);
  }
}

TEST(DdpCli, BucketCapMbIsCheckedBeforeAnythingStarts) {
  auto fails_with = [](const std::string& args, const std::string& message) {
    const std::string log = shoal::testing::temp_path("shoal-cap-bad");
    const std::string command = shoal_binary() + " train " + args + " >" + log + " 2>&1";
    const int status = std::system(command.c_str());
    const std::string text = shoal::testing::read_file(log);
    fs::remove(log);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << command << "\n" << text;
    EXPECT_NE(text.find(message), std::string::npos) << command << "\n" << text;
  };
  fails_with("--strategy ddp --bucket-cap-mb 0", "--bucket-cap-mb takes a positive number");
  fails_with("--strategy ddp --bucket-cap-mb fast", "not 'fast'");
  fails_with("--strategy fsdp --bucket-cap-mb auto", "--bucket-cap-mb applies to --strategy ddp");
  // Given at all, even at DDP's default: it would be ignored, not applied.
  fails_with("--strategy fsdp --bucket-cap-mb 25", "--bucket-cap-mb applies to --strategy ddp");
}

}  // namespace test_data_parallel_cli
