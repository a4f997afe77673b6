// main() of every test program: GoogleTest's, with the exit status of test_program_exit_code (a
// skipped test makes the program Skipped for CTest unless something failed).
#include <gtest/gtest.h>

#include "testing/dependencies.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  return shoal::testing::test_program_exit_code(RUN_ALL_TESTS());
}
