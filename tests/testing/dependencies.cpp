#include "testing/dependencies.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace shoal::testing {

bool oracles_required() {
  const char* value = std::getenv("SHOAL_REQUIRE_ORACLES");
  return value != nullptr && std::strcmp(value, "1") == 0;
}

bool skip_is_failure(Dependency dependency) {
  return dependency != Dependency::kOptional && oracles_required();
}

std::string forbidden_skip_message(const std::string& reason) {
  return "SHOAL_REQUIRE_ORACLES=1 forbids this skip: " + reason;
}

bool python_has_torch() {
  static const bool has =
      std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") == 0;
  return has;
}

int test_program_exit_code(int run_all_tests_status) {
  const ::testing::UnitTest& unit = *::testing::UnitTest::GetInstance();
  if (run_all_tests_status != 0 || unit.failed_test_count() > 0 || unit.Failed()) return 1;
  if (unit.skipped_test_count() == 0) return 0;
  std::printf("%d test(s) skipped; the program reports Skipped (exit 77):\n",
              unit.skipped_test_count());
  for (int s = 0; s < unit.total_test_suite_count(); ++s) {
    const ::testing::TestSuite& suite = *unit.GetTestSuite(s);
    for (int t = 0; t < suite.total_test_count(); ++t) {
      const ::testing::TestInfo& info = *suite.GetTestInfo(t);
      if (info.result() != nullptr && info.result()->Skipped()) {
        std::printf("  %s.%s\n", suite.name(), info.name());
      }
    }
  }
  std::fflush(stdout);
  return 77;
}

}  // namespace shoal::testing
