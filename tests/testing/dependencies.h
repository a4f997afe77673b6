// Skips that never hide a failure. A test that cannot run here for want of a dependency skips
// itself (not the whole program); a program ends with exit 77 (CTest: Skipped) only when nothing
// failed, and under SHOAL_REQUIRE_ORACLES=1 (set by .ci/run, where the set-up installs every
// dependency) a skip for a required dependency is a failure.
//
// Thread safety: call from the test's main thread.
#pragma once

#include <gtest/gtest.h>

#include <string>

namespace shoal::testing {

/// What a test may be missing.
enum class Dependency {
  kPythonTorch,  ///< /usr/bin/python3 with torch (Debian's python3-torch): required in CI
  kMpi,          ///< the mpi backend built in and mpirun: required in CI
  kDataset,      ///< Fashion-MNIST under /usr/share/datasets (dataset-fashion-mnist): required in CI
  kSlurm,        ///< SLURM's clients and daemons (slurm-wlm, munge): required in CI
  kOptional,     ///< anything a CI run may lack (e.g. not running under ctest): never a failure
};

/// Whether SHOAL_REQUIRE_ORACLES=1 is set in the environment.
bool oracles_required();

/// Whether a missing `dependency` must fail rather than skip here.
bool skip_is_failure(Dependency dependency);

/// "SHOAL_REQUIRE_ORACLES=1: <reason>" — the failure message for a forbidden skip.
std::string forbidden_skip_message(const std::string& reason);

/// Whether /usr/bin/python3 imports torch (asked once per process).
bool python_has_torch();

/// The exit status for a finished test program: 1 when anything failed, else 77 when a test
/// skipped (listing which), else 0. main() returns it after RUN_ALL_TESTS().
int test_program_exit_code(int run_all_tests_status);

}  // namespace shoal::testing

/// Ends the current test as skipped because `dependency` is missing (a failure when the
/// dependency is required here). Use in the test body (it returns from it).
#define SHOAL_SKIP_TEST(dependency, reason)                                          \
  do {                                                                               \
    if (::shoal::testing::skip_is_failure(dependency)) {                             \
      FAIL() << ::shoal::testing::forbidden_skip_message(reason);                    \
    }                                                                                \
    GTEST_SKIP() << (reason);                                                        \
  } while (0)

/// Skips (see SHOAL_SKIP_TEST) unless `available`.
#define SHOAL_SKIP_UNLESS(available, dependency, reason)                             \
  do {                                                                               \
    if (!(available)) SHOAL_SKIP_TEST(dependency, reason);                           \
  } while (0)
