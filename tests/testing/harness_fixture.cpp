// Not a test: the program test_harness runs to see which exit status each kind of outcome gives.
// Each test does one thing (pass, fail, skip, skip the program, run a broken oracle); test_harness
// picks them with --gtest_filter.
#include <gtest/gtest.h>

#include "testing/dependencies.h"
#include "testing/multi_rank.h"
#include "testing/python.h"

namespace {

TEST(Fixture, Passes) { EXPECT_EQ(1 + 1, 2); }

TEST(Fixture, Fails) { EXPECT_EQ(1 + 1, 3) << "deliberate failure"; }

TEST(Fixture, SkipsForMissingTorch) {
  SHOAL_SKIP_TEST(shoal::testing::Dependency::kPythonTorch, "pretending torch is missing");
}

TEST(Fixture, SkipsForOptionalDependency) {
  SHOAL_SKIP_TEST(shoal::testing::Dependency::kOptional, "pretending an optional tool is missing");
}

// Named to run after Fails under a filter (GoogleTest runs tests in the order they are defined).
TEST(Fixture, ZSkipsTheProgram) {
  shoal::testing::skip_program(shoal::testing::Dependency::kDataset, "pretending the dataset is missing");
}

TEST(Fixture, BrokenOracle) {
  const auto result = shoal::testing::run_python_code(
      "import sys\nsys.stderr.write('the oracle broke on purpose\\n')\nsys.exit(3)\n");
  EXPECT_TRUE(shoal::testing::oracle_succeeded(result));
}

// An interpreter that prints nothing and exits 0 (what a broken or replaced /usr/bin/python3 does).
TEST(Fixture, SilentOracle) {
  EXPECT_TRUE(shoal::testing::oracle_succeeded(shoal::testing::run_python_code("pass\n")));
}

TEST(Fixture, OracleWithItsClosingLine) {
  EXPECT_TRUE(shoal::testing::oracle_succeeded(
      shoal::testing::run_python_code("print('checked')\n" + shoal::testing::closing_line_code("1 case"))));
}

}  // namespace
