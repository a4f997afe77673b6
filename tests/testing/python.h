// Running a PyTorch oracle: /usr/bin/python3 (Debian's, with python3-torch) on a script or a file,
// with stdout and stderr kept apart so a failing oracle shows why instead of looking like "no torch".
//
// Thread safety: any thread (each call runs its own process).
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace shoal::testing {

/// The exit status an oracle script gives when torch cannot be imported (see kImportTorchOrExit):
/// the one failure that is a skip (CTest's skip code, too).
constexpr int kNoTorchExitCode = 77;

/// Python lines that import torch, or exit kNoTorchExitCode when it is not installed. Importing
/// torch is the slow part of an oracle: do it once, in the oracle script itself.
constexpr const char* kImportTorchOrExit =
    "import sys\ntry:\n    import torch\nexcept ImportError:\n    sys.exit(77)\n";

/// The start of the line an oracle script prints last, once every check of it has passed:
/// "ORACLE OK <what it did>" (e.g. "ORACLE OK 14 cases"). An oracle that exits 0 without it has not
/// run (an interpreter that does nothing, a script cut short, a check that returned early): the
/// tests fail then, never pass. Scripts run by CTest itself are checked for it by
/// tests/testing/require_closing_line.sh.
constexpr const char* kOracleClosing = "ORACLE OK";

/// A Python statement that prints the closing line "ORACLE OK <what>" (flushed).
std::string closing_line_code(const std::string& what);

/// True when the last non-empty line of `output` starts with kOracleClosing.
bool has_closing_line(const std::string& output);

/// How one run of /usr/bin/python3 ended.
struct PythonResult {
  int exit_code = -1;  ///< exit status, or -1 when it did not exit normally
  std::string out;     ///< everything it wrote to stdout
  std::string err;     ///< everything it wrote to stderr
  bool ok() const { return exit_code == 0; }
  /// "exit N; stderr: ..." for a failure message.
  std::string describe() const;
};

/// Runs the shell command line `command` with stdout and stderr captured apart (any program, not
/// only Python: the result type is the same).
PythonResult run_command(const std::string& command);

/// Runs `/usr/bin/python3 ARGS...` (each argument shell-quoted) with OMP_NUM_THREADS=1.
PythonResult run_python(const std::vector<std::string>& args);

/// Runs the program text `code` (`/usr/bin/python3 -c code`).
PythonResult run_python_code(const std::string& code);

/// A shell command prefix that runs a python3 whose torch is PyTorch 2.x: SHOAL_ORACLE_PYTHON when
/// set (a GPU machine's own, scripts/gpu_check.sh), else `PYTHONPATH=<site> python3` for the PyPI
/// wheel that scripts/setup_torch_pypi.sh installs (under $SHOAL_SOURCE_DIR). Empty when neither
/// is there.
std::string torch2_python();

/// Success when the oracle exited 0 and printed its closing line last (kOracleClosing); else a
/// failure naming the exit status, its stderr and, without the closing line, its stdout.
::testing::AssertionResult oracle_succeeded(const PythonResult& result);

/// The little-endian float32 values an oracle wrote to `path` (numpy's astype("<f4").tofile);
/// empty when the file is missing.
std::vector<float> read_float32_file(const std::string& path);

}  // namespace shoal::testing
