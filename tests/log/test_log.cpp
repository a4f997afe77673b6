// shoal::log: level names, filtering by level, and SHOAL_LOG_LEVEL read from the environment
// (in a child process, since the level is read once per process).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "shoal/log.h"

namespace test_log {

using shoal::log::Level;

TEST(Log, ParsesEveryLevelNameInAnyCase) {
  EXPECT_EQ(shoal::log::parse_level("debug"), Level::kDebug);
  EXPECT_EQ(shoal::log::parse_level("INFO"), Level::kInfo);
  EXPECT_EQ(shoal::log::parse_level("warn"), Level::kWarn);
  EXPECT_EQ(shoal::log::parse_level("Warning"), Level::kWarn);
  EXPECT_EQ(shoal::log::parse_level("error"), Level::kError);
  EXPECT_EQ(shoal::log::parse_level("off"), Level::kOff);
  EXPECT_FALSE(shoal::log::parse_level("verbose").has_value());
  EXPECT_FALSE(shoal::log::parse_level("").has_value());
  for (Level level : {Level::kDebug, Level::kInfo, Level::kWarn, Level::kError, Level::kOff}) {
    EXPECT_EQ(shoal::log::parse_level(shoal::log::level_name(level)), level);
  }
}

TEST(Log, WritesOnlyMessagesAtOrAboveTheLevel) {
  shoal::log::set_level(Level::kWarn);
  testing::internal::CaptureStderr();
  shoal::log::debug("shoal: hidden debug ", 1);
  shoal::log::info("shoal: hidden info ", 2);
  shoal::log::warn("shoal: shown warn ", 3, " ", 0.5);
  shoal::log::error("shoal: shown error ", std::string("four"));
  std::string text = testing::internal::GetCapturedStderr();
  EXPECT_EQ(text, "shoal: shown warn 3 0.5\nshoal: shown error four\n");

  shoal::log::set_level(Level::kOff);
  testing::internal::CaptureStderr();
  shoal::log::error("shoal: not even errors");
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
  EXPECT_FALSE(shoal::log::enabled(Level::kError));

  shoal::log::set_level(Level::kDebug);
  testing::internal::CaptureStderr();
  shoal::log::debug("shoal: debug now");
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "shoal: debug now\n");
  EXPECT_FALSE(shoal::log::enabled(Level::kOff));  // "off" is a level to set, not to write at
  shoal::log::set_level(Level::kInfo);
}

TEST(Log, LinesFromManyThreadsAreNeverInterleaved) {
  shoal::log::set_level(Level::kInfo);
  constexpr int kThreads = 4;
  constexpr int kLines = 200;
  const std::string payload(100, 'x');
  testing::internal::CaptureStderr();
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kLines; ++i) shoal::log::info("thread ", t, " ", payload);
    });
  }
  for (auto& thread : threads) thread.join();
  const std::string text = testing::internal::GetCapturedStderr();
  int lines = 0;
  size_t at = 0;
  while (at < text.size()) {
    const size_t end = text.find('\n', at);
    ASSERT_NE(end, std::string::npos);
    const std::string line = text.substr(at, end - at);
    ASSERT_EQ(line.size(), 9 + payload.size()) << line;
    EXPECT_EQ(line.compare(0, 7, "thread "), 0) << line;
    ++lines;
    at = end + 1;
  }
  EXPECT_EQ(lines, kThreads * kLines);
}

// What a fresh process with SHOAL_LOG_LEVEL=`value` writes for one message at each level.
std::string child_output(const char* value) {
  int fds[2];
  if (::pipe(fds) != 0) return "pipe failed";
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(fds[1], STDERR_FILENO);
    ::close(fds[0]);
    ::setenv("SHOAL_LOG_LEVEL", value, 1);
    shoal::log::reset_level();  // this test process has set its level before
    shoal::log::debug("d");
    shoal::log::info("i");
    shoal::log::warn("w");
    shoal::log::error("e");
    std::fflush(stderr);
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string text;
  char buffer[512];
  ssize_t n;
  while ((n = ::read(fds[0], buffer, sizeof buffer)) > 0) text.append(buffer, static_cast<size_t>(n));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return text;
}

TEST(Log, ReadsTheLevelFromShoalLogLevel) {
  EXPECT_EQ(child_output("debug"), "d\ni\nw\ne\n");
  EXPECT_EQ(child_output("info"), "i\nw\ne\n");
  EXPECT_EQ(child_output("WARN"), "w\ne\n");
  EXPECT_EQ(child_output("error"), "e\n");
  EXPECT_EQ(child_output("off"), "");
  EXPECT_EQ(child_output(""), "i\nw\ne\n");  // empty: the default
  const std::string unknown = child_output("loud");
  EXPECT_EQ(unknown,
            "shoal: warning: SHOAL_LOG_LEVEL=loud is not one of debug, info, warn, error, off; "
            "using info\ni\nw\ne\n");
}

}  // namespace test_log
