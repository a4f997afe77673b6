// The harness never lets a skip hide a failure: runs harness_fixture's deliberately failing,
// skipping and passing tests and asserts the exit status CTest would see (0 passed, 1 failed,
// 77 skipped), with and without SHOAL_REQUIRE_ORACLES=1.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "testing/multi_rank.h"
#include "testing/python.h"

namespace test_harness {

struct Outcome {
  int exit_code = -1;
  std::string output;
};

// Runs the fixture on `filter` with SHOAL_REQUIRE_ORACLES set to `require` ("" leaves it unset).
Outcome run_fixture(const std::string& filter, const std::string& require = "") {
  const std::string log = shoal::testing::temp_path("harness-log");
  std::string command = require.empty() ? "env -u SHOAL_REQUIRE_ORACLES "
                                        : "env SHOAL_REQUIRE_ORACLES=" + require + " ";
  command += std::string(SHOAL_HARNESS_FIXTURE) + " --gtest_filter='" + filter + "' >" + log + " 2>&1";
  const int status = std::system(command.c_str());
  Outcome outcome;
  outcome.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream in(log);
  std::stringstream text;
  text << in.rdbuf();
  outcome.output = text.str();
  std::remove(log.c_str());
  return outcome;
}

TEST(Harness, PassingProgramExitsZero) {
  const auto o = run_fixture("Fixture.Passes");
  EXPECT_EQ(o.exit_code, 0) << o.output;
}

TEST(Harness, FailingTestFailsTheProgram) {
  const auto o = run_fixture("Fixture.Fails");
  EXPECT_EQ(o.exit_code, 1) << o.output;
}

TEST(Harness, SkippedTestReportsTheProgramSkipped) {
  const auto o = run_fixture("Fixture.Passes:Fixture.SkipsForMissingTorch");
  EXPECT_EQ(o.exit_code, 77) << o.output;
  EXPECT_NE(o.output.find("Fixture.SkipsForMissingTorch"), std::string::npos) << o.output;
}

TEST(Harness, SkipAfterAFailureStillFails) {
  // A per-test skip after a failure, and a whole-program skip after a failure.
  auto o = run_fixture("Fixture.Fails:Fixture.SkipsForMissingTorch");
  EXPECT_EQ(o.exit_code, 1) << o.output;
  o = run_fixture("Fixture.Fails:Fixture.ZSkipsTheProgram");
  EXPECT_EQ(o.exit_code, 1) << o.output;
  EXPECT_NE(o.output.find("a test has already failed"), std::string::npos) << o.output;
}

TEST(Harness, ProgramSkipWithoutFailureIsASkip) {
  const auto o = run_fixture("Fixture.Passes:Fixture.ZSkipsTheProgram");
  EXPECT_EQ(o.exit_code, 77) << o.output;
}

TEST(Harness, RequireOraclesTurnsRequiredSkipsIntoFailures) {
  auto o = run_fixture("Fixture.SkipsForMissingTorch", "1");
  EXPECT_EQ(o.exit_code, 1) << o.output;
  EXPECT_NE(o.output.find("SHOAL_REQUIRE_ORACLES=1"), std::string::npos) << o.output;
  o = run_fixture("Fixture.ZSkipsTheProgram", "1");
  EXPECT_EQ(o.exit_code, 1) << o.output;
  // An optional dependency may still skip; "0" is not "1".
  o = run_fixture("Fixture.SkipsForOptionalDependency", "1");
  EXPECT_EQ(o.exit_code, 77) << o.output;
  o = run_fixture("Fixture.SkipsForMissingTorch", "0");
  EXPECT_EQ(o.exit_code, 77) << o.output;
}

TEST(Harness, BrokenOracleFailsAndShowsItsStderr) {
  const auto o = run_fixture("Fixture.BrokenOracle");
  EXPECT_EQ(o.exit_code, 1) << o.output;
  EXPECT_NE(o.output.find("exit 3"), std::string::npos) << o.output;
  EXPECT_NE(o.output.find("the oracle broke on purpose"), std::string::npos) << o.output;
}

// An oracle that exits 0 but never printed its closing line did not run its checks: a failure.
TEST(Harness, SilentOracleFails) {
  const auto silent = run_fixture("Fixture.SilentOracle");
  EXPECT_EQ(silent.exit_code, 1) << silent.output;
  EXPECT_NE(silent.output.find("without its closing line 'ORACLE OK"), std::string::npos)
      << silent.output;
  const auto closed = run_fixture("Fixture.OracleWithItsClosingLine");
  EXPECT_EQ(closed.exit_code, 0) << closed.output;
}

// The CTest wrapper of script tests: the script's status when it printed its closing line last;
// a failure (1) when it exited 0 without it; a skip (77) stays a skip.
TEST(Harness, ScriptTestsRequireTheirClosingLine) {
  const char* source = std::getenv("SHOAL_SOURCE_DIR");
  const std::string wrapper =
      std::string(source ? source : "..") + "/tests/testing/require_closing_line.sh";
  const auto run = [&](const std::string& script) {
    return shoal::testing::run_command("bash " + wrapper + " sh -c '" + script + "'");
  };
  EXPECT_EQ(run("echo checked; echo ORACLE OK 3 checks").exit_code, 0);
  const auto silent = run("exit 0");
  EXPECT_EQ(silent.exit_code, 1);
  EXPECT_NE(silent.err.find("closing line"), std::string::npos) << silent.err;
  EXPECT_EQ(run("echo ORACLE OK; echo more output").exit_code, 1);
  EXPECT_EQ(run("echo ORACLE OK early; exit 3").exit_code, 3);
  EXPECT_EQ(run("exit 77").exit_code, 77);
}

}  // namespace test_harness
