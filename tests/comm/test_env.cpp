// SHOAL_TIMEOUT parsing and detect_rank_info over the launchers' variables (torchrun, OpenMPI,
// SLURM), with the environment saved and restored around each test.
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <optional>

#include "shoal/comm/init.h"
#include "shoal/error.h"

namespace shoal::comm {
namespace test_env {

const char* const kLauncherVariables[] = {
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
    "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NODEID", "SHOAL_TIMEOUT"};

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
  set({{"SLURM_PROCID", "4"}, {"SLURM_NTASKS", "7"}, {"SLURM_LOCALID", "0"},
       {"SLURM_NODEID", "2"}, {"SLURM_TASKS_PER_NODE", "2(x2),3"}});
  RankInfo info = detect_rank_info();
  EXPECT_EQ(info.source, "slurm");
  EXPECT_EQ(info.rank, 4);
  EXPECT_EQ(info.world_size, 7);
  EXPECT_EQ(info.local_rank, 0);
  EXPECT_EQ(info.local_world_size, 3);  // node 2 is the third entry of "2,2,3"

  set({{"SLURM_NODEID", "1"}});
  EXPECT_EQ(detect_rank_info().local_world_size, 2);
  set({{"SLURM_NTASKS_PER_NODE", "4"}});  // explicit --ntasks-per-node wins
  EXPECT_EQ(detect_rank_info().local_world_size, 4);
  unsetenv("SLURM_NTASKS_PER_NODE");
  set({{"SLURM_TASKS_PER_NODE", "two"}});
  EXPECT_THROW(detect_rank_info(), InvalidArgument);
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

}  // namespace test_env
}  // namespace shoal::comm
