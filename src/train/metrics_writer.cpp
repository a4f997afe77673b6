#include "shoal/train/metrics_writer.h"

#include <nlohmann/json.hpp>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "shoal/error.h"

namespace shoal::train {
namespace {

// 9 significant digits round-trip a float exactly; enough for every metric here, and the lines
// stay short (the shortest text of the rounded double has at most 9 digits).
double nine_digits(double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%.9g", value);
  return std::strtod(text, nullptr);
}

}  // namespace

JsonLine& JsonLine::add(const std::string& key, double value) {
  fields_.emplace_back(key, std::isfinite(value) ? nine_digits(value) : value);
  return *this;
}

JsonLine& JsonLine::add(const std::string& key, int64_t value) {
  fields_.emplace_back(key, value);
  return *this;
}

JsonLine& JsonLine::add(const std::string& key, const std::string& value) {
  fields_.emplace_back(key, value);
  return *this;
}

std::string JsonLine::str() const {
  nlohmann::ordered_json object = nlohmann::ordered_json::object();
  for (const auto& [key, value] : fields_) {
    std::visit([&, &key = key](const auto& v) { object[key] = v; }, value);  // NaN, inf: null
  }
  // Bytes that are not UTF-8 (a path) become U+FFFD rather than an exception mid-training.
  return object.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

std::vector<std::pair<std::string, double>> JsonLine::numbers() const {
  std::vector<std::pair<std::string, double>> out;
  for (const auto& [key, value] : fields_) {
    if (const double* d = std::get_if<double>(&value)) out.emplace_back(key, *d);
    if (const int64_t* i = std::get_if<int64_t>(&value)) out.emplace_back(key, static_cast<double>(*i));
  }
  return out;
}

MetricsWriter::MetricsWriter(const std::string& path) : path_(path) {
  if (path.empty()) return;
  file_ = std::fopen(path.c_str(), "w");
  if (file_ == nullptr) {
    SHOAL_THROW(InvalidArgument, path, ": cannot open the metrics file for writing: ",
                std::strerror(errno));
  }
}

MetricsWriter::~MetricsWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

void MetricsWriter::write(const JsonLine& line) {
  if (file_ == nullptr) return;
  const std::string text = line.str() + '\n';
  if (std::fwrite(text.data(), 1, text.size(), file_) != text.size() || std::fflush(file_) != 0) {
    SHOAL_THROW(Error, path_, ": cannot write metrics: ", std::strerror(errno));
  }
}

}  // namespace shoal::train
