#include "testing/python.h"

#include <sys/wait.h>

#include <algorithm>
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

// `text` as a Python string literal (no quotes or backslashes expected; they are escaped anyway).
std::string python_literal(const std::string& text) {
  std::string literal = "'";
  for (char c : text) {
    if (c == '\'' || c == '\\') literal += '\\';
    literal += c;
  }
  return literal + "'";
}

}  // namespace

std::string closing_line_code(const std::string& what) {
  return "print(" + python_literal(std::string(kOracleClosing) + " " + what) +
         ", flush=True)\n";
}

bool has_closing_line(const std::string& output) {
  size_t end = output.find_last_not_of(" \t\r\n");
  if (end == std::string::npos) return false;
  const size_t start = output.rfind('\n', end);
  const size_t begin = start == std::string::npos ? 0 : start + 1;
  return output.compare(begin, std::char_traits<char>::length(kOracleClosing), kOracleClosing) == 0;
}

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

std::string torch2_python() {
  if (const char* own = std::getenv("SHOAL_ORACLE_PYTHON"); own != nullptr && *own != '\0') return own;
  const char* source = std::getenv("SHOAL_SOURCE_DIR");
  if (source == nullptr) return "";
  const auto prefix = run_command("bash " + shell_quote(std::string(source) + "/scripts/setup_torch_pypi.sh") +
                                  " --prefix");
  const std::string torch_dir = prefix.out.substr(0, prefix.out.find_last_not_of('\n') + 1);
  const std::string site = std::filesystem::path(torch_dir).parent_path().string();
  if (!prefix.ok() || site.empty() || !std::filesystem::exists(site + "/.complete")) return "";
  return "PYTHONPATH=" + shell_quote(site) + " python3";
}

::testing::AssertionResult oracle_succeeded(const PythonResult& result) {
  if (!result.ok()) {
    return ::testing::AssertionFailure() << "the PyTorch oracle failed: " << result.describe();
  }
  if (!has_closing_line(result.out)) {
    return ::testing::AssertionFailure()
           << "the PyTorch oracle exited 0 without its closing line '" << kOracleClosing
           << " ...' (it did not run its checks to the end); stdout:\n"
           << result.out << "\nstderr:\n" << result.err;
  }
  return ::testing::AssertionSuccess();
}

std::vector<float> read_float32_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return {};
  std::vector<float> values(static_cast<size_t>(std::max<std::streamoff>(0, in.tellg())) / sizeof(float));
  in.seekg(0);
  in.read(reinterpret_cast<char*>(values.data()), static_cast<std::streamsize>(values.size() * sizeof(float)));
  return values;
}

}  // namespace shoal::testing
