#include "testing/python.h"

#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "testing/multi_rank.h"

namespace shoal::testing {
namespace {

std::string shell_quote(const std::string& text) {
  std::string quoted = "'";
  for (char c : text) {
    if (c == '\'') {
      quoted += "'\\''";
    } else {
      quoted += c;
    }
  }
  return quoted + "'";
}

std::string slurp_and_remove(const std::string& path) {
  std::string text;
  {
    std::ifstream in(path, std::ios::binary);
    std::stringstream buffer;
    buffer << in.rdbuf();
    text = buffer.str();
  }
  std::error_code ignored;
  std::filesystem::remove(path, ignored);
  return text;
}

}  // namespace

std::string PythonResult::describe() const {
  return "exit " + std::to_string(exit_code) + "; stderr:\n" + err;
}

PythonResult run_command(const std::string& command) {
  const std::string out_path = temp_path("command-out");
  const std::string err_path = temp_path("command-err");
  const std::string line = "( " + command + " ) >" + out_path + " 2>" + err_path + " </dev/null";
  const int status = std::system(line.c_str());
  PythonResult result;
  result.exit_code = (status != -1 && WIFEXITED(status)) ? WEXITSTATUS(status) : -1;
  result.out = slurp_and_remove(out_path);
  result.err = slurp_and_remove(err_path);
  return result;
}

PythonResult run_python(const std::vector<std::string>& args) {
  std::string command = "OMP_NUM_THREADS=1 /usr/bin/python3";
  for (const auto& arg : args) command += " " + shell_quote(arg);
  return run_command(command);
}

PythonResult run_python_code(const std::string& code) { return run_python({"-c", code}); }

::testing::AssertionResult oracle_succeeded(const PythonResult& result) {
  if (result.ok()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "the PyTorch oracle failed: " << result.describe();
}

}  // namespace shoal::testing
