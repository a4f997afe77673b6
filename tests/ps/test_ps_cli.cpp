// End to end: `shoal run --num-servers 2 --nproc-per-node 2 shoal train --strategy ps ...` with
// SHOAL_AUTH_TOKEN set starts two servers and two workers (roles in the environment, server
// endpoints through the rendezvous store, every connection authenticated), trains the MLP for two
// epochs on a slice of the real Fashion-MNIST under ssp(1) and exits 0; each server reports what
// it observed.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <regex>

#include "shoal/checkpoint/serialization.h"
#include "testing/multi_rank.h"
#include "testing/shoal_cli.h"
#include "testing/python.h"

namespace test_ps_cli {

namespace fs = std::filesystem;

TEST(PsCli, ShoalRunStartsServersAndWorkers) {
  const std::string shoal = shoal::testing::shoal_cli_with_dataset();
  const std::string out = shoal::testing::temp_path("ps-cli-out");
  const std::string err = shoal::testing::temp_path("ps-cli-err");
  const std::string command =
      "SHOAL_AUTH_TOKEN=test-token " + shoal + " run --master-port 0 --nproc-per-node 2 "
      "--num-servers 2 " + shoal + " train --strategy ps --consistency ssp --staleness 1 "
      "--model mlp --epochs 2 --train-samples 3000 --test-samples 1000 --batch-size 64 "
      "--lr 0.05 --momentum 0.9 --no-progress >" + out + " 2>" + err;
  const int status = std::system(command.c_str());
  const std::string stdout_text = shoal::testing::read_file(out);
  const std::string stderr_text = shoal::testing::read_file(err);
  fs::remove(out);
  fs::remove(err);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << stdout_text << stderr_text;

  std::smatch match;
  ASSERT_TRUE(std::regex_search(stdout_text, match,
                                std::regex("final test accuracy: ([0-9.]+)")))
      << stdout_text;
  // Measured: one epoch ends at 0.65-0.71 on a quiet machine and hit 0.600 once under CI's load;
  // two epochs end at 0.70-0.78 with four runs side by side, so 0.6 says "it learned" with margin.
  EXPECT_GT(std::stod(match[1]), 0.6) << stdout_text;
  int servers = 0;
  const std::regex server_line(
      "ps server ([01]): ([0-9]+) pushes, ([0-9]+) updates, max staleness ([0-9]+)");
  for (auto it = std::sregex_iterator(stderr_text.begin(), stderr_text.end(), server_line);
       it != std::sregex_iterator(); ++it) {
    ++servers;
    EXPECT_GT(std::stoll((*it)[2]), 0) << stderr_text;
    EXPECT_LE(std::stoll((*it)[4]), 1) << "ssp(1) bound:\n" << stderr_text;
  }
  EXPECT_EQ(servers, 2) << stderr_text;
}


// `shoal train --strategy ps --checkpoint-dir`: the servers save their shards (values and
// momentum, in PyTorch's format) whenever the workers save theirs; a run stopped after epoch 1
// and resumed with --resume ends with the very weights of an uninterrupted 2-epoch run (bsp is
// deterministic with 2 workers), with two servers splitting the tensors.
TEST(PsCli, CheckpointAndResumeEqualUninterruptedTraining) {
  const std::string shoal = shoal::testing::shoal_cli_with_dataset();
  const std::string work = shoal::testing::temp_path("ps-ckpt");
  fs::create_directories(work);
  const std::string common =
      shoal + " train --strategy ps --workers 2 --servers 2 --model mlp --train-samples 1200 "
      "--test-samples 300 --batch-size 50 --lr 0.05 --momentum 0.9 --threads 1 --no-progress ";
  auto run = [&](const std::string& args, const std::string& log) {
    const std::string command = common + args + " >" + log + " 2>&1";
    const int status = std::system(command.c_str());
    const std::string text = shoal::testing::read_file(log);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << command << "\n" << text;
    return text;
  };
  run("--epochs 2 --dump-parameters " + work + "/whole", work + "/whole.log");
  run("--epochs 1 --checkpoint-dir " + work + "/ckpt", work + "/first.log");
  for (int s = 0; s < 2; ++s) {
    // 1200 samples over 2 workers in batches of 50: the workers' checkpoint is of step 12.
    const std::string shard = work + "/ckpt/ps-server" + std::to_string(s) + ".step12.pt";
    ASSERT_TRUE(fs::exists(shard)) << shard;
    // PyTorch reads it: a dict of tensors with the momentum buffers.
    const std::string check =
        "/usr/bin/python3 -c \"import sys, torch; d = torch.load(sys.argv[1]); "
        "assert isinstance(d, dict) and any(k.endswith('.momentum_buffer') for k in d); "
        "print('ORACLE OK torch.load read the shard')\" " +
        shard;
    EXPECT_TRUE(shoal::testing::oracle_succeeded(shoal::testing::run_command(check))) << check;
  }
  const std::string resumed = run("--epochs 2 --checkpoint-dir " + work + "/ckpt --resume "
                                  "--dump-parameters " + work + "/resumed", work + "/resumed.log");
  EXPECT_NE(resumed.find("resumed from"), std::string::npos) << resumed;
  for (int rank = 0; rank < 2; ++rank) {
    const std::string suffix = ".rank" + std::to_string(rank) + ".pt";
    const auto whole = shoal::checkpoint::load_state_dict_file(work + "/whole" + suffix);
    const auto again = shoal::checkpoint::load_state_dict_file(work + "/resumed" + suffix);
    ASSERT_EQ(whole.size(), again.size());
    for (const auto& item : whole) {
      const at::Tensor& other = again[item.key()];
      EXPECT_LE((item.value() - other).abs().max().item<double>(), 1e-6)
          << "worker " << rank << " " << item.key() << ": the resumed run differs";
    }
  }
  fs::remove_all(work);
}


// `shoal run --tolerate-worker-failures` (what `shoal train --strategy ps` sets under asp/ssp):
// worker 1 is killed (SIGKILL, by timeout) in the middle of training; the server presumes it dead
// after --worker-timeout, worker 0 finishes its epoch and evaluates, and the job exits 0 with the
// failure reported, instead of being stopped as a whole.
TEST(PsCli, AspGoesOnWithoutAKilledWorker) {
  const std::string shoal = shoal::testing::shoal_cli_with_dataset();
  const std::string log = shoal::testing::temp_path("ps-kill-log");
  const std::string train = shoal + " train --strategy ps --consistency asp --worker-timeout 3 "
                            "--model mlp --epochs 1 --train-samples 20000 --test-samples 1000 "
                            "--batch-size 32 --lr 0.05 --threads 1 --no-progress";
  const std::string script =
      "if [ \"$ROLE_NAME\" = worker ] && [ \"$ROLE_RANK\" = 1 ]; then exec timeout -s KILL 3 " +
      train + "; fi; exec " + train;
  const std::string command = shoal + " run --master-port 0 --nproc-per-node 2 --num-servers 1 "
                              "--tolerate-worker-failures sh -c '" + script + "' >" + log + " 2>&1";
  const int status = std::system(command.c_str());
  const std::string text = shoal::testing::read_file(log);
  fs::remove(log);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << command << "\n" << text;
  EXPECT_NE(text.find("rank 1 (pid"), std::string::npos) << text;
  EXPECT_NE(text.find("the other workers go on without it"), std::string::npos) << text;
  EXPECT_NE(text.find("finished without 1 failed worker"), std::string::npos) << text;
  EXPECT_NE(text.find("final test accuracy"), std::string::npos) << text;
  EXPECT_NE(text.find("1 workers presumed dead"), std::string::npos) << text;
}

}  // namespace test_ps_cli
