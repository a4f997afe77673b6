// One run of train_features_oracle.py (the PyTorch side of the training-feature and loss-scaler
// oracle tests) for a list of cases, and what it wrote for each: shared by
// test_train_features_pytorch.cpp and test_grad_scaler_pytorch.cpp.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "testing/multi_rank.h"
#include "testing/python.h"

namespace shoal::testing {

/// What the oracle wrote for one case (see train_features_oracle.py's docstring).
struct FeaturesOracleRun {
  std::vector<float> parameters;  // every parameter, registration order
  std::vector<double> losses;     // per step, rank 0's mean loss (nan kept)
  std::vector<double> norms;      // per step, the gradient norm before clipping, or nan
  std::vector<double> scales;     // with a scaler: the scale after each step's update()
  std::vector<int> skipped;       // with a scaler: 1 where the step was skipped
};

/// Runs `python` (a command prefix, e.g. "/usr/bin/python3" or "PYTHONPATH=... python3") on
/// train_features_oracle.py once for `cases` ({name, "key=value ..."}), OMP_NUM_THREADS=1, and
/// reads back every case's files. Exits the program as skipped (`missing`) when the python's
/// torch does not import; a failed run is a test failure.
inline std::map<std::string, FeaturesOracleRun> run_features_oracle(
    const std::string& python, const std::vector<std::pair<std::string, std::string>>& cases,
    Dependency missing, const std::string& why_missing) {
  const char* source = std::getenv("SHOAL_SOURCE_DIR");
  if (source == nullptr) skip_program(Dependency::kOptional, "SHOAL_SOURCE_DIR is not set (run through ctest)");
  const std::string dir = temp_path("shoal-features-oracle");
  std::filesystem::create_directories(dir);
  {
    std::ofstream list(dir + "/cases.txt");
    for (const auto& [name, settings] : cases) list << name << " " << settings << "\n";
  }
  const PythonResult run = run_command("OMP_NUM_THREADS=1 " + python + " '" + source +
                                       "/tests/train/train_features_oracle.py' '" + dir +
                                       "/cases.txt' '" + dir + "'");
  if (run.exit_code == kNoTorchExitCode) skip_program(missing, why_missing);
  EXPECT_TRUE(oracle_succeeded(run));
  std::map<std::string, FeaturesOracleRun> results;
  for (const auto& [name, settings] : cases) {
    FeaturesOracleRun r;
    r.parameters = read_float32_file(dir + "/" + name + ".params");
    std::ifstream lines(dir + "/" + name + ".txt");
    for (std::string loss, norm; lines >> loss >> norm;) {
      r.losses.push_back(loss == "nan" ? NAN : std::stod(loss));
      r.norms.push_back(norm == "nan" ? NAN : std::stod(norm));
    }
    std::ifstream scales(dir + "/" + name + ".scale");
    double scale = 0;
    int skipped = 0;
    while (scales >> scale >> skipped) {
      r.scales.push_back(scale);
      r.skipped.push_back(skipped);
    }
    results[name] = std::move(r);
  }
  // Not std::filesystem::remove_all: PyTorch 2.11's libtorch_cpu exports one that interposes
  // libstdc++'s and jumped to address 0 on a GPU machine.
  run_command("rm -rf '" + dir + "'");
  return results;
}

}  // namespace shoal::testing
