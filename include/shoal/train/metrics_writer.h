// Training metrics as JSON lines: one object per line, flushed as it is written, so that a run
// that dies still leaves every line it reached and `tail -f` shows progress.
//
//   {"event":"step","epoch":1,"step":100,"samples":6400,"loss":0.61,"samples_per_s":2210.5,"seconds":2.9}
//   {"event":"epoch","epoch":1,"train_loss":0.45,"test_loss":0.37,"test_accuracy":0.866,...}
//
// Thread safety: not thread-safe; one writer per file, used from one thread.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace shoal::train {

/// One JSON object under construction: keys in insertion order, numbers and strings. Written
/// with nlohmann-json; a double keeps 9 significant digits (a float round-trips exactly), a
/// non-finite one is written as null (JSON has no NaN).
class JsonLine {
 public:
  JsonLine& add(const std::string& key, double value);
  JsonLine& add(const std::string& key, int64_t value);
  JsonLine& add(const std::string& key, int value) { return add(key, static_cast<int64_t>(value)); }
  JsonLine& add(const std::string& key, const std::string& value);
  JsonLine& add(const std::string& key, const char* value) { return add(key, std::string(value)); }
  /// The object as one line, without the newline.
  std::string str() const;
  /// The numeric fields in order, as written (rounded to 9 significant digits): what
  /// TensorBoard's scalars of the line are.
  std::vector<std::pair<std::string, double>> numbers() const;

 private:
  std::vector<std::pair<std::string, std::variant<double, int64_t, std::string>>> fields_;
};

/// Appends JSON lines to a file; a writer built with an empty path is disabled and writes nothing.
class MetricsWriter {
 public:
  /// Creates (truncates) `path`; throws shoal::InvalidArgument when it cannot be opened.
  explicit MetricsWriter(const std::string& path);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  bool enabled() const { return file_ != nullptr; }
  /// Writes the line and flushes it. Throws shoal::Error when the write fails (disk full).
  void write(const JsonLine& line);

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace shoal::train
