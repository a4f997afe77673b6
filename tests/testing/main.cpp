// main() of every test program: GoogleTest's, with the exit status of test_program_exit_code (a
// skipped test makes the program Skipped for CTest unless something failed).
//
// The tests of one folder share one program (tests/CMakeLists.txt, shoal_add_test); each CTest
// entry runs it with --shoal_sources=a.cpp,b.cpp: only the cases defined in those files run, and
// of those only the ones --gtest_filter (or GTEST_FILTER) also selects. A program run without
// --shoal_sources runs what --gtest_filter selects, as any GoogleTest program.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "testing/dependencies.h"

namespace {

constexpr const char* kSourcesFlag = "--shoal_sources=";

std::vector<std::string> split(const std::string& text, char separator) {
  std::vector<std::string> parts;
  std::string::size_type begin = 0;
  while (begin <= text.size()) {
    const auto end = std::min(text.find(separator, begin), text.size());
    if (end > begin) parts.push_back(text.substr(begin, end - begin));
    begin = end + 1;
  }
  return parts;
}

// GoogleTest's wildcard match: '*' any run of characters, '?' one character.
bool matches(const char* pattern, const char* name) {
  if (*pattern == '\0') return *name == '\0';
  if (*pattern == '*') return matches(pattern + 1, name) || (*name != '\0' && matches(pattern, name + 1));
  return *name != '\0' && (*pattern == '?' || *pattern == *name) && matches(pattern + 1, name + 1);
}

bool matches_any(const std::vector<std::string>& patterns, const std::string& name) {
  for (const auto& p : patterns) {
    if (matches(p.c_str(), name.c_str())) return true;
  }
  return false;
}

// Whether GoogleTest's filter "POSITIVE[-NEGATIVE]" selects `name` (Suite.Case).
bool filter_selects(const std::string& filter, const std::string& name) {
  const auto dash = filter.find('-');
  const std::string positive = dash == std::string::npos ? filter : filter.substr(0, dash);
  const std::string negative = dash == std::string::npos ? "" : filter.substr(dash + 1);
  const auto positives = split(positive, ':');
  if (!positives.empty() && !matches_any(positives, name)) return false;
  return !matches_any(split(negative, ':'), name);
}

std::string base_name(const char* path) {
  const char* slash = std::strrchr(path, '/');
  return slash ? slash + 1 : path;
}

// Removes --shoal_sources=... from argv; returns its file names (empty when absent).
std::set<std::string> take_sources_flag(int& argc, char** argv) {
  std::set<std::string> sources;
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], kSourcesFlag, std::strlen(kSourcesFlag)) == 0) {
      for (auto& name : split(argv[i] + std::strlen(kSourcesFlag), ',')) sources.insert(name);
    } else {
      argv[out++] = argv[i];
    }
  }
  argc = out;
  argv[argc] = nullptr;
  return sources;
}

}  // namespace

int main(int argc, char** argv) {
  const std::set<std::string> sources = take_sources_flag(argc, argv);
  ::testing::InitGoogleTest(&argc, argv);
  if (!sources.empty()) {
    // The cases of these files that the user's filter selects, named one by one.
    const std::string user_filter = ::testing::GTEST_FLAG(filter);
    std::string selected;
    const auto* unit = ::testing::UnitTest::GetInstance();
    for (int s = 0; s < unit->total_test_suite_count(); ++s) {
      const auto* suite = unit->GetTestSuite(s);
      for (int t = 0; t < suite->total_test_count(); ++t) {
        const auto* info = suite->GetTestInfo(t);
        const std::string name = std::string(info->test_suite_name()) + "." + info->name();
        if (sources.count(base_name(info->file())) != 0 && filter_selects(user_filter, name)) {
          selected += (selected.empty() ? "" : ":") + name;
        }
      }
    }
    if (selected.empty()) {
      std::string list;
      for (const auto& name : sources) list += (list.empty() ? "" : ",") + name;
      std::fprintf(stderr,
                   "test main: no test case of %s matches the filter '%s'; check the test's "
                   "SOURCES in its CMakeLists.txt and its --gtest_filter\n",
                   list.c_str(), user_filter.c_str());
      return 1;
    }
    ::testing::GTEST_FLAG(filter) = selected;
  }
  return shoal::testing::test_program_exit_code(RUN_ALL_TESTS());
}
