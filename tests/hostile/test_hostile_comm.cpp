// Hostile peers, end to end through the `shoal` command: a rank stopped with SIGSTOP
// under gloo and shm is named and the job ends within SHOAL_HEARTBEAT_TIMEOUT + 20 s; a parameter
// server under asp goes on without a killed worker when started by `shoal train`; the launcher's
// last line says when --max-restarts ran out. Real processes and signals; each bound asserted.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "testing/multi_rank.h"
#include "testing/shoal_cli.h"

namespace test_hostile_comm {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using shoal::testing::Milliseconds;

// `command` under /bin/sh (exec'd, so the child is the command itself), output to `log`.
std::unique_ptr<shoal::testing::ChildProcess> start(const std::string& command, const std::string& log) {
  const std::string line = "exec " + command + " >" + log + " 2>&1";
  return std::make_unique<shoal::testing::ChildProcess>([line] {
    ::execl("/bin/sh", "sh", "-c", line.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  });
}

// The environment variable `name` of process `pid`, or "" (gone, or not set).
std::string environment_of(pid_t pid, const std::string& name) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/environ", std::ios::binary);
  std::string entry;
  while (std::getline(in, entry, '\0')) {
    if (entry.rfind(name + "=", 0) == 0) return entry.substr(name.size() + 1);
  }
  return "";
}

// The children of `parent` (from /proc/PID/stat's fourth field).
std::vector<pid_t> children_of(pid_t parent) {
  std::vector<pid_t> out;
  for (const auto& entry : fs::directory_iterator("/proc")) {
    const std::string name = entry.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream in(entry.path() / "stat");
    std::string stat;
    std::getline(in, stat);
    const size_t close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream fields(stat.substr(close + 2));
    char state = 0;
    long ppid = 0;
    fields >> state >> ppid;
    if (ppid == parent) out.push_back(static_cast<pid_t>(std::stol(name)));
  }
  return out;
}

// The launcher's child whose environment has `name`=`value`, or -1.
pid_t worker_with(pid_t launcher, const std::string& name, const std::string& value) {
  for (pid_t pid : children_of(launcher)) {
    if (environment_of(pid, name) == value) return pid;
  }
  return -1;
}

size_t count_lines(const std::string& path) {
  const std::string text = shoal::testing::read_file(path);
  return static_cast<size_t>(std::count(text.begin(), text.end(), '\n'));
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// 2-rank DDP on `backend`; rank 1 is stopped once training runs (rank 0 has written two metrics
// lines); the launcher must exit non-zero within SHOAL_HEARTBEAT_TIMEOUT + 20 s of the stop (the
// time-out is 60 s), rank 0's error naming rank 1, the operation and the stop.
void stopped_rank_is_named_within_the_heartbeat(const std::string& backend) {
  const std::string shoal = shoal::testing::shoal_cli_with_dataset();
  const std::string log = shoal::testing::temp_path("stop-log");
  const std::string metrics = shoal::testing::temp_path("stop-metrics");
  constexpr double kHeartbeatSeconds = 3;
  // Beyond the heartbeat: the hang report's gathering (up to 2 s) and a loaded machine's
  // scheduling (8.2 s was seen with the suite beside three builds); far below the 60 s time-out.
  constexpr double kLimitSeconds = kHeartbeatSeconds + 20;
  auto job = start("env SHOAL_HEARTBEAT_TIMEOUT=3s SHOAL_TIMEOUT=60s " + shoal +
                       " train --strategy ddp --nproc-per-node 2 --backend " + backend +
                       " --model mlp --epochs 100 --train-samples 2000 --test-samples 100"
                       " --batch-size 32 --no-progress --log-interval 5 --metrics " + metrics,
                   log);
  ASSERT_TRUE(shoal::testing::wait_until([&] { return count_lines(metrics) >= 2; }, Milliseconds(90'000)))
      << shoal::testing::read_file(log);
  const pid_t rank1 = worker_with(job->pid(), "RANK", "1");
  ASSERT_GT(rank1, 0) << "rank 1 of the launcher " << job->pid() << " not found";
  ASSERT_EQ(::kill(rank1, SIGSTOP), 0);
  const auto stopped = Clock::now();
  const bool ended = job->wait(Milliseconds(60'000));
  const double took = seconds_since(stopped);
  ::kill(rank1, SIGKILL);  // in case the launcher did not
  ::kill(rank1, SIGCONT);
  const std::string text = shoal::testing::read_file(log);
  fs::remove(log);
  fs::remove(metrics);
  ASSERT_TRUE(ended) << "the job did not end within 60 s of the stop\n" << text;
  EXPECT_NE(job->result().exit_code, 0) << text;
  EXPECT_LE(took, kLimitSeconds) << text;
  EXPECT_NE(text.find("[rank 0/2] allreduce #"), std::string::npos) << text;
  EXPECT_NE(text.find("waiting for rank 1"), std::string::npos) << text;
  EXPECT_NE(text.find("stopped"), std::string::npos) << text;
  std::printf("%s: job ended %.1f s after rank 1 was stopped (limit %.0f s)\n", backend.c_str(), took,
              kLimitSeconds);
}

TEST(HostileComm, StoppedGlooRankIsNamedWithinTheHeartbeat) { stopped_rank_is_named_within_the_heartbeat("gloo"); }

TEST(HostileComm, StoppedShmRankIsNamedWithinTheHeartbeat) { stopped_rank_is_named_within_the_heartbeat("shm"); }

// `shoal train --strategy ps` under asp or ssp with 2 workers and 1 server: worker 1 is killed
// (SIGKILL) once training runs (worker 0 has written two metrics lines); the server presumes it
// dead after --worker-timeout 3, worker 0 finishes and evaluates, and the job exits 0 saying so.
void parameter_server_goes_on_without_a_killed_worker(const std::string& consistency) {
  const std::string shoal = shoal::testing::shoal_cli_with_dataset();
  const std::string log = shoal::testing::temp_path("ps-kill-log");
  const std::string metrics = shoal::testing::temp_path("ps-kill-metrics");
  auto job = start(shoal + " train --strategy ps --consistency " + consistency +
                       " --worker-timeout 3 --workers 2 --servers 1 --model mlp --epochs 1"
                       " --train-samples 6000 --test-samples 500 --batch-size 32 --lr 0.05"
                       " --threads 1 --no-progress --log-interval 5 --metrics " + metrics,
                   log);
  ASSERT_TRUE(shoal::testing::wait_until([&] { return count_lines(metrics) >= 2; }, Milliseconds(90'000)))
      << shoal::testing::read_file(log);
  const pid_t worker1 = worker_with(job->pid(), "ROLE_RANK", "1");
  ASSERT_GT(worker1, 0) << "worker 1 of the launcher " << job->pid() << " not found";
  ASSERT_EQ(environment_of(worker1, "ROLE_NAME"), "worker");
  ASSERT_EQ(::kill(worker1, SIGKILL), 0);
  const auto killed = Clock::now();
  const bool ended = job->wait(Milliseconds(120'000));
  const double took = seconds_since(killed);
  const std::string text = shoal::testing::read_file(log);
  fs::remove(log);
  fs::remove(metrics);
  ASSERT_TRUE(ended) << text;
  EXPECT_EQ(job->result().exit_code, 0) << text;
  EXPECT_NE(text.find("the other workers go on without it"), std::string::npos) << text;
  EXPECT_NE(text.find("worker 1 presumed dead"), std::string::npos) << text;
  EXPECT_NE(text.find("final test accuracy"), std::string::npos) << text;
  EXPECT_NE(text.find("finished without 1 failed worker"), std::string::npos) << text;
  std::printf("%s: the job finished %.1f s after worker 1 was killed\n", consistency.c_str(), took);
}

TEST(HostileComm, ParameterServerAspGoesOnWithoutAKilledWorker) {
  parameter_server_goes_on_without_a_killed_worker("asp");
}

TEST(HostileComm, ParameterServerSspGoesOnWithoutAKilledWorker) {
  parameter_server_goes_on_without_a_killed_worker("ssp");
}

// The shoal executable, for the cases that need no dataset.
std::string shoal_path() {
  const char* dir = std::getenv("SHOAL_BINARY_DIR");
  if (dir == nullptr) shoal::testing::skip_program("SHOAL_BINARY_DIR is not set (run through ctest)");
  return std::string(dir) + "/apps/shoal/shoal";
}

// The last line of `text` that is not empty.
std::string last_line(const std::string& text) {
  size_t end = text.find_last_not_of('\n');
  if (end == std::string::npos) return "";
  const size_t begin = text.rfind('\n', end);
  return text.substr(begin == std::string::npos ? 0 : begin + 1, end - (begin == std::string::npos ? 0 : begin + 1) + 1);
}

// Rank 0 fails in every attempt: after the last of --max-restarts 2 the launcher's final line
// says that the restarts ran out, how many attempts failed, and the status it exits with.
TEST(HostileComm, LastRestartSaysRestartsRanOut) {
  const std::string log = shoal::testing::temp_path("restarts-log");
  const std::string command = shoal_path() +
                              " run --master-port 0 --nproc-per-node 2 --max-restarts 2 sh -c "
                              "'if [ \"$RANK\" = 0 ]; then exit 3; fi; exec sleep 60' >" + log + " 2>&1";
  const auto start = Clock::now();
  const int status = std::system(command.c_str());
  const double took = seconds_since(start);
  const std::string text = shoal::testing::read_file(log);
  fs::remove(log);
  ASSERT_TRUE(WIFEXITED(status)) << text;
  EXPECT_EQ(WEXITSTATUS(status), 3) << text;
  const std::string last = last_line(text);
  EXPECT_NE(last.find("restarts ran out"), std::string::npos) << text;
  EXPECT_NE(last.find("all 3 attempts"), std::string::npos) << last;
  EXPECT_NE(last.find("--max-restarts 2"), std::string::npos) << last;
  EXPECT_NE(last.find("status 3"), std::string::npos) << last;
  EXPECT_LT(took, 30) << text;
}

}  // namespace test_hostile_comm
