// The table of environment variables (shoal/env.h) and its readers, SHOAL_TIMEOUT parsing and
// detect_rank_info over the launchers' variables (torchrun, OpenMPI,
// SLURM), with the environment saved and restored around each test.
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <cstdlib>
#include <map>
#include <optional>
#include <set>
#include <string>

#include "shoal/comm/init.h"
#include "shoal/comm/process_group.h"
#include "shoal/env.h"
#include "shoal/error.h"
#include "testing/scoped_env.h"

namespace shoal::comm {
namespace test_env {

const char* const kLauncherVariables[] = {
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
    "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NODEID", "SHOAL_TIMEOUT",
    "SLURM_STEP_ID", "SLURM_STEPID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_JOB_ID", "SLURM_JOBID",
    "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"};

// Clears the launcher variables for the test and restores them afterwards.
class Environment : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* name : kLauncherVariables) {
      const char* value = std::getenv(name);
      if (value != nullptr) saved_[name] = value;
      unsetenv(name);
    }
  }
  void TearDown() override {
    for (const char* name : kLauncherVariables) unsetenv(name);
    for (const auto& [name, value] : saved_) setenv(name.c_str(), value.c_str(), 1);
  }
  static void set(const std::map<std::string, std::string>& vars) {
    for (const auto& [name, value] : vars) setenv(name.c_str(), value.c_str(), 1);
  }

 private:
  std::map<std::string, std::string> saved_;
};

TEST_F(Environment, TimeoutFromEnv) {
  EXPECT_EQ(timeout_from_env(Milliseconds(1234)).count(), 1234);
  const std::pair<const char*, int64_t> good[] = {
      {"30000", 30000}, {"30s", 30000}, {"500ms", 500}, {"1.5s", 1500}, {"250", 250}};
  for (const auto& [text, ms] : good) {
    setenv("SHOAL_TIMEOUT", text, 1);
    EXPECT_EQ(timeout_from_env().count(), ms) << text;
  }
  for (const char* bad : {"abc", "-5", "0", "10x", "s", "ms", "5 s"}) {
    setenv("SHOAL_TIMEOUT", bad, 1);
    try {
      timeout_from_env();
      ADD_FAILURE() << "SHOAL_TIMEOUT=" << bad << " was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("SHOAL_TIMEOUT"), std::string::npos) << e.what();
    }
  }
}

TEST_F(Environment, LoneProcess) {
  const RankInfo info = detect_rank_info();
  EXPECT_EQ(info.source, "default");
  EXPECT_EQ(info.rank, 0);
  EXPECT_EQ(info.world_size, 1);
}

TEST_F(Environment, Torchrun) {
  set({{"RANK", "3"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"},
       {"MASTER_ADDR", "10.0.0.7"}, {"MASTER_PORT", "29600"}});
  const RankInfo info = detect_rank_info();
  EXPECT_EQ(info.source, "torchrun");
  EXPECT_EQ(info.rank, 3);
  EXPECT_EQ(info.world_size, 8);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world_size, 2);
  EXPECT_EQ(info.master_addr, "10.0.0.7");
  EXPECT_EQ(info.master_port, 29600);
}

TEST_F(Environment, TorchrunWinsOverOpenMpi) {
  set({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "0"},
       {"OMPI_COMM_WORLD_SIZE", "4"}});
  const RankInfo info = detect_rank_info();
  EXPECT_EQ(info.source, "torchrun");
  EXPECT_EQ(info.rank, 1);
  EXPECT_EQ(info.world_size, 2);
}

TEST_F(Environment, OpenMpi) {
  set({{"OMPI_COMM_WORLD_RANK", "5"}, {"OMPI_COMM_WORLD_SIZE", "6"},
       {"OMPI_COMM_WORLD_LOCAL_RANK", "2"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "3"}});
  const RankInfo info = detect_rank_info();
  EXPECT_EQ(info.source, "openmpi");
  EXPECT_EQ(info.rank, 5);
  EXPECT_EQ(info.world_size, 6);
  EXPECT_EQ(info.local_rank, 2);
  EXPECT_EQ(info.local_world_size, 3);
}

TEST_F(Environment, Slurm) {
  set({{"SLURM_PROCID", "4"}, {"SLURM_NTASKS", "7"}, {"SLURM_LOCALID", "0"}, {"SLURM_STEP_ID", "0"},
       {"SLURM_NODEID", "2"}, {"SLURM_TASKS_PER_NODE", "2(x2),3"}});
  RankInfo info = detect_rank_info();
  EXPECT_EQ(info.source, "slurm");
  EXPECT_EQ(info.rank, 4);
  EXPECT_EQ(info.world_size, 7);
  EXPECT_EQ(info.local_rank, 0);
  EXPECT_EQ(info.local_world_size, 3);  // node 2 is the third entry of "2,2,3"
  EXPECT_EQ(info.endpoint_source, "");   // no node list, no job id: nothing to derive from

  set({{"SLURM_NODEID", "1"}});
  EXPECT_EQ(detect_rank_info().local_world_size, 2);
  set({{"SLURM_NTASKS_PER_NODE", "4"}});  // explicit --ntasks-per-node wins
  EXPECT_EQ(detect_rank_info().local_world_size, 4);
  unsetenv("SLURM_NTASKS_PER_NODE");
  set({{"SLURM_TASKS_PER_NODE", "two"}});
  EXPECT_THROW(detect_rank_info(), InvalidArgument);
}

void set_srun_task(int procid);

TEST_F(Environment, AWorldSizeBeyondAnyJobIsOneLine) {
  set({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1000000000"}, {"SLURM_STEP_ID", "0"}});
  try {
    detect_rank_info();
    ADD_FAILURE() << "a world of 10^9 ranks was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("SLURM_NTASKS"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("1000000000"), std::string::npos) << e.what();
  }
  set({{"SLURM_NTASKS", "1048576"}});  // 2^20: the largest accepted
  EXPECT_EQ(detect_rank_info().world_size, 1 << 20);
}

TEST_F(Environment, OnlyTheFirstHostOfAHugeNodeListIsWrittenOut) {
  // 10 KB of brackets naming a million hosts each: refused in one line, counted, not expanded.
  std::string brackets;
  while (brackets.size() < 10'000) brackets += (brackets.empty() ? "" : ",") + std::string("n[0-1048574]");
  set_srun_task(0);
  set({{"SLURM_STEP_NODELIST", brackets}});
  const auto start = std::chrono::steady_clock::now();
  try {
    detect_rank_info();
    ADD_FAILURE() << "accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("SLURM_STEP_NODELIST names more than 1048576 hosts"),
              std::string::npos) << e.what();
    EXPECT_LT(std::string(e.what()).size(), 300u);
  }
  // A list of 2^20 hosts, the most accepted: only rank 0's host, the first, is written out.
  set({{"SLURM_STEP_NODELIST", "n[0-1048574],m"}});
  EXPECT_EQ(detect_rank_info().master_addr, "n0");
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
}

TEST_F(Environment, LoneProcessIsNotLaunched) {
  EXPECT_FALSE(detect_rank_info().launched);
  EXPECT_EQ(detect_rank_info().endpoint_source, "");
}

TEST_F(Environment, TorchrunOpenMpiAndPmiAreLaunched) {
  set({{"RANK", "0"}, {"WORLD_SIZE", "1"}});
  EXPECT_TRUE(detect_rank_info().launched);  // shoal run --nproc-per-node 1: still a rank
  unsetenv("RANK");
  unsetenv("WORLD_SIZE");
  set({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "1"}});
  EXPECT_TRUE(detect_rank_info().launched);
  unsetenv("OMPI_COMM_WORLD_RANK");
  unsetenv("OMPI_COMM_WORLD_SIZE");
  set({{"PMI_RANK", "3"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "1"}, {"MPI_LOCALNRANKS", "2"}});
  const RankInfo info = detect_rank_info();
  EXPECT_EQ(info.source, "pmi");
  EXPECT_TRUE(info.launched);
  EXPECT_EQ(info.rank, 3);
  EXPECT_EQ(info.world_size, 4);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world_size, 2);
}

// The environment srun gives task PROCID of `srun -N1 -n2` (as a real srun printed it: job 1, step 0).
void set_srun_task(int procid) {
  setenv("SLURM_PROCID", std::to_string(procid).c_str(), 1);
  setenv("SLURM_LOCALID", std::to_string(procid).c_str(), 1);
  setenv("SLURM_NODEID", "0", 1);
  setenv("SLURM_NTASKS", "2", 1);
  setenv("SLURM_STEP_NUM_TASKS", "2", 1);
  setenv("SLURM_STEP_TASKS_PER_NODE", "2", 1);
  setenv("SLURM_TASKS_PER_NODE", "2", 1);
  setenv("SLURM_STEP_ID", "0", 1);
  setenv("SLURM_STEPID", "0", 1);
  setenv("SLURM_JOB_ID", "1", 1);
  setenv("SLURM_JOBID", "1", 1);
  setenv("SLURM_STEP_NODELIST", "vm", 1);
  setenv("SLURM_JOB_NODELIST", "vm", 1);
}

TEST_F(Environment, SrunStepIsOneJob) {
  set_srun_task(1);
  const RankInfo info = detect_rank_info();
  EXPECT_EQ(info.source, "slurm");
  EXPECT_TRUE(info.launched);
  EXPECT_EQ(info.rank, 1);
  EXPECT_EQ(info.world_size, 2);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world_size, 2);
  EXPECT_EQ(info.master_addr, "vm");
  EXPECT_EQ(info.master_port, slurm_master_port(1, 0));
  EXPECT_EQ(info.endpoint_source, "slurm");
}

TEST_F(Environment, SlurmStepCountsOverTheJob) {
  // `srun -n2` inside `sbatch -n4 -N2`: the step's 2 tasks are the world, not the job's 4.
  set_srun_task(0);
  set({{"SLURM_NTASKS", "4"}, {"SLURM_TASKS_PER_NODE", "2(x2)"}, {"SLURM_STEP_TASKS_PER_NODE", "1(x2)"},
       {"SLURM_STEP_NODELIST", "gpu[07-08]"}, {"SLURM_JOB_NODELIST", "gpu[01-02,07-08]"},
       {"SLURM_STEP_ID", "3"}});
  const RankInfo info = detect_rank_info();
  EXPECT_EQ(info.world_size, 2);
  EXPECT_EQ(info.local_world_size, 1);
  EXPECT_EQ(info.master_addr, "gpu07");
  EXPECT_EQ(info.master_port, slurm_master_port(1, 3));
  // Without the step's list (older SLURM), the job's first host.
  unsetenv("SLURM_STEP_NODELIST");
  EXPECT_EQ(detect_rank_info().master_addr, "gpu01");
}

TEST_F(Environment, SlurmBatchScriptIsNotARank) {
  // sbatch -n2 runs its script with SLURM_PROCID=0 and SLURM_NTASKS=2 but no step: not a rank.
  set({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}, {"SLURM_NODEID", "0"},
       {"SLURM_TASKS_PER_NODE", "2"}, {"SLURM_JOB_ID", "7"}, {"SLURM_JOB_NODELIST", "vm"}});
  const RankInfo info = detect_rank_info();
  EXPECT_EQ(info.source, "default");
  EXPECT_FALSE(info.launched);
  EXPECT_EQ(info.world_size, 1);
}

TEST_F(Environment, SrunOfOneTaskMayLaunch) {
  set_srun_task(0);
  set({{"SLURM_NTASKS", "1"}, {"SLURM_STEP_NUM_TASKS", "1"}, {"SLURM_STEP_TASKS_PER_NODE", "1"}});
  const RankInfo info = detect_rank_info();
  EXPECT_EQ(info.source, "slurm");
  EXPECT_EQ(info.world_size, 1);
  EXPECT_FALSE(info.launched);
}

TEST_F(Environment, MasterVariablesWinOverSlurm) {
  set_srun_task(1);
  set({{"MASTER_ADDR", "10.1.2.3"}});
  RankInfo info = detect_rank_info();
  EXPECT_EQ(info.master_addr, "10.1.2.3");
  EXPECT_EQ(info.master_port, slurm_master_port(1, 0));  // only the port derived
  set({{"MASTER_PORT", "29999"}});
  info = detect_rank_info();
  EXPECT_EQ(info.master_port, 29999);
  EXPECT_EQ(info.endpoint_source, "env");
  // Torchrun inside srun: torchrun's variables are this process's identity.
  set({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"}});
  info = detect_rank_info();
  EXPECT_EQ(info.source, "torchrun");
  EXPECT_EQ(info.rank, 3);
}

TEST_F(Environment, SlurmErrorsNameTheVariable) {
  set_srun_task(0);
  set({{"SLURM_STEP_NODELIST", "gpu[3-1]"}});
  try {
    detect_rank_info();
    ADD_FAILURE() << "a backwards range was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("SLURM_STEP_NODELIST='gpu[3-1]'"), std::string::npos)
        << e.what();
  }
  set({{"SLURM_STEP_NODELIST", "vm"}, {"SLURM_STEP_TASKS_PER_NODE", "2(x"}});
  try {
    detect_rank_info();
    ADD_FAILURE() << "a bad SLURM_STEP_TASKS_PER_NODE was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("SLURM_STEP_TASKS_PER_NODE"), std::string::npos)
        << e.what();
  }
}

TEST_F(Environment, SlurmMasterPortFormula) {
  EXPECT_EQ(slurm_master_port(0, 0), 15000);
  EXPECT_EQ(slurm_master_port(1, 0), 15016);
  EXPECT_EQ(slurm_master_port(1, 1), 15017);
  EXPECT_EQ(slurm_master_port(1, 17), 15017);  // steps wrap after 16
  for (long long job : {1LL, 936LL, 937LL, 123456789LL, 4294967295LL}) {
    for (long long step = 0; step < 20; ++step) {
      const int port = slurm_master_port(job, step);
      EXPECT_GE(port, 15000);
      EXPECT_LT(port, 30000);
    }
  }
  // Consecutive jobs and concurrent steps of one job get different ports.
  std::set<int> ports;
  for (long long job = 100; job < 200; ++job) {
    for (long long step = 0; step < 16; ++step) ports.insert(slurm_master_port(job, step));
  }
  EXPECT_EQ(ports.size(), 1600u);
}

TEST_F(Environment, OptionsOverrideTheEnvironment) {
  set({{"RANK", "1"}, {"WORLD_SIZE", "2"}});
  InitOptions options;
  options.rank = 2;
  options.world_size = 4;
  const RankInfo info = detect_rank_info(options);
  EXPECT_EQ(info.source, "options");
  EXPECT_EQ(info.rank, 2);
  EXPECT_EQ(info.world_size, 4);
}

TEST_F(Environment, InconsistentSettingsAreInvalidArguments) {
  set({{"RANK", "2"}, {"WORLD_SIZE", "2"}});
  try {
    detect_rank_info();
    ADD_FAILURE() << "rank 2 of 2 was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("not below the world size"), std::string::npos)
        << e.what();
  }
  set({{"RANK", "x"}});
  EXPECT_THROW(detect_rank_info(), InvalidArgument);
  set({{"RANK", "0"}, {"WORLD_SIZE", "0"}});
  EXPECT_THROW(detect_rank_info(), InvalidArgument);
  set({{"WORLD_SIZE", "2"}, {"LOCAL_RANK", "3"}, {"LOCAL_WORLD_SIZE", "2"}});
  EXPECT_THROW(detect_rank_info(), InvalidArgument);
}

// Each row is found by its Var, every name once.
TEST(EnvTable, RowsFollowVarAndNamesAreUnique) {
  std::set<std::string> names;
  for (const env::Variable& row : env::variables()) {
    EXPECT_EQ(&env::describe(row.var), &row) << row.name;
    EXPECT_TRUE(names.insert(row.name).second) << row.name << " twice";
    EXPECT_NE(std::string(row.meaning), "") << row.name;
    EXPECT_NE(std::string(row.default_value), "") << row.name;
  }
  EXPECT_GE(names.size(), 20u);
}

// The one-line error of a value out of range: the variable, the value, what it accepts.
void expect_rejected(const std::function<void()>& read, const char* name, const char* value,
                     const std::string& accepted) {
  shoal::testing::ScopedEnv set(name, value);
  try {
    read();
    ADD_FAILURE() << name << "=" << value << " was accepted";
  } catch (const InvalidArgument& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(std::string(name) + "='" + value + "'"), std::string::npos) << message;
    EXPECT_NE(message.find(accepted), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
}

TEST(EnvTable, FlagsTakeZeroOrOneAndDefaultFromTheTable) {
  using env::Var;
  {
    shoal::testing::ScopedEnv unset("SHOAL_TUNE_MALLOC", nullptr);
    EXPECT_TRUE(env::flag(Var::kTuneMalloc));
    EXPECT_FALSE(env::flag_if_set(Var::kTuneMalloc).has_value());
  }
  const std::pair<const char*, bool> cases[] = {
      {"0", false}, {"1", true}, {"true", true}, {"FALSE", false}};
  for (const auto& [value, expected] : cases) {
    shoal::testing::ScopedEnv set("SHOAL_LAUNCH_EXEC", value);
    EXPECT_EQ(env::flag(Var::kLaunchExec), expected) << value;
  }
  expect_rejected([] { env::flag(Var::kSigusr1); }, "SHOAL_SIGUSR1", "yes", "0 or 1");
}

// SHOAL_SHM_SPIN_US was read with an unchecked atoi ("abc" spun 0 us): now it is range-checked.
TEST(EnvTable, IntegersAreCheckedAgainstTheirRange) {
  using env::Var;
  {
    shoal::testing::ScopedEnv set("SHOAL_SHM_SPIN_US", "50");
    EXPECT_EQ(env::integer(Var::kShmSpinUs), 50);
  }
  for (const char* bad : {"abc", "-1", "2000000", "5x", "99999999999999999999"}) {
    expect_rejected([] { env::integer(Var::kShmSpinUs); }, "SHOAL_SHM_SPIN_US", bad,
                    "0 to 1000000 microseconds");
  }
  expect_rejected([] { env::integer(Var::kShmChunkBytes); }, "SHOAL_SHM_CHUNK_BYTES", "100",
                  "4096 to 67108864 bytes");
  expect_rejected([] { env::integer(Var::kPsNumServers); }, "SHOAL_PS_NUM_SERVERS", "0", "1 to");
  expect_rejected([] { env::integer(Var::kRestartCount); }, "TORCHELASTIC_RESTART_COUNT", "two",
                  "0 to");
}

// SHOAL_DEBUG takes PyTorch's TORCH_DISTRIBUTED_DEBUG levels in any case; anything else was
// read as off without a word.
TEST(EnvTable, ChoicesAreOneOfTheirValuesInAnyCase) {
  const std::pair<const char*, bool> cases[] = {
      {"detail", true}, {"DETAIL", true}, {"info", false}, {"Off", false}};
  for (const auto& [value, detail] : cases) {
    shoal::testing::ScopedEnv set("SHOAL_DEBUG", value);
    EXPECT_EQ(debug_detail_from_env(), detail) << value;
  }
  expect_rejected([] { debug_detail_from_env(); }, "SHOAL_DEBUG", "1", "off, info, detail");
  expect_rejected([] { env::choice(env::Var::kGlooReduceScatter); }, "SHOAL_GLOO_REDUCE_SCATTER",
                  "tree", "ring, allreduce");
  shoal::testing::ScopedEnv unset("SHOAL_DEBUG", nullptr);
  EXPECT_EQ(env::choice(env::Var::kDebug), "off");
}

// The listing and the Markdown table carry every row.
TEST(EnvTable, ListingAndMarkdownNameEveryVariable) {
  const std::string listing = env::listing();
  const std::string markdown = env::markdown_table();
  for (const env::Variable& row : env::variables()) {
    EXPECT_NE(listing.find(std::string(row.name) + "\n"), std::string::npos) << row.name;
    EXPECT_NE(markdown.find("| `" + std::string(row.name) + "` |"), std::string::npos) << row.name;
  }
}

}  // namespace test_env
}  // namespace shoal::comm
