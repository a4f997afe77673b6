#include "shoal/train/metrics_writer.h"

#include <cerrno>
#include <cmath>
#include <cstring>

#include "shoal/error.h"

namespace shoal::train {
namespace {

std::string quote(const std::string& text) {
  std::string out = "\"";
  for (const char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char escaped[8];
          std::snprintf(escaped, sizeof escaped, "\\u%04x", c);
          out += escaped;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

}  // namespace

JsonLine& JsonLine::add(const std::string& key, double value) {
  if (!std::isfinite(value)) {
    fields_.emplace_back(key, "null");  // JSON has no NaN or infinity
    return *this;
  }
  // 9 significant digits round-trip a float exactly; enough for every metric here.
  char text[32];
  std::snprintf(text, sizeof text, "%.9g", value);
  fields_.emplace_back(key, text);
  return *this;
}

JsonLine& JsonLine::add(const std::string& key, int64_t value) {
  fields_.emplace_back(key, std::to_string(value));
  return *this;
}

JsonLine& JsonLine::add(const std::string& key, const std::string& value) {
  fields_.emplace_back(key, quote(value));
  return *this;
}

std::string JsonLine::str() const {
  std::string out = "{";
  for (size_t i = 0; i < fields_.size(); ++i) {
    if (i > 0) out += ',';
    out += quote(fields_[i].first) + ':' + fields_[i].second;
  }
  return out + '}';
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
