// The benches' contenders, rounds and report lines (bench_harness.h).
#include "bench_harness.h"

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>

#include <nlohmann/json.hpp>

#include "bench_util.h"
#include "shoal/error.h"

namespace shoal::cli {

const std::vector<double>& BenchMode::all(const std::string& field) const {
  static const std::vector<double> kNone;
  auto it = samples.find(field);
  return it == samples.end() ? kNone : it->second;
}

double BenchMode::get(const std::string& field) const { return median(all(field)); }

double BenchMode::last(const std::string& field) const {
  const auto& values = all(field);
  return values.empty() ? std::nan("") : values.back();
}

double median_ratio(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> ratios;
  for (size_t r = 0; r < a.size() && r < b.size(); ++r) ratios.push_back(a[r] / b[r]);
  return median(ratios);
}

std::vector<size_t> round_order(size_t count, int round) {
  std::vector<size_t> order;
  for (size_t i = 0; i < count; ++i) order.push_back(i);
  if (round % 2 == 1) std::reverse(order.begin(), order.end());
  return order;
}

void run_beside_reference(const std::vector<BenchMode*>& contenders, BenchMode& reference,
                          int round, const std::function<void(BenchMode&)>& run,
                          const BesideReference& fields) {
  run(reference);
  double before = reference.last(fields.rate);
  for (size_t i : round_order(contenders.size(), round)) {
    BenchMode& contender = *contenders[i];
    run(contender);
    if (fields.between) run(reference);
    const double after = reference.last(fields.rate);
    const double mean = (before + after) / 2;
    if (!fields.reference_rate.empty()) contender.add(fields.reference_rate, mean);
    contender.add(fields.ratio, contender.last(fields.rate) / mean);
    before = after;
  }
}

void run_rounds_beside_first(const std::vector<BenchMode*>& modes, int rounds,
                             const std::function<void(BenchMode&)>& run, const std::string& ratio) {
  const std::vector<BenchMode*> contenders(modes.begin() + 1, modes.end());
  BesideReference fields;
  fields.ratio = ratio;
  for (int round = 0; round < rounds; ++round) {
    run_beside_reference(contenders, *modes.front(), round, run, fields);
  }
  modes.front()->samples[ratio].assign(1, 1.0);
}

Values run_forked_ranks(int ranks, const std::string& label, const std::string& stem,
                        const std::function<void(int rank, const std::string& result)>& rank_main,
                        const RunProcessesOptions& options) {
  std::vector<ChildProcess> children;
  for (int rank = 0; rank < ranks; ++rank) {
    ChildProcess child;
    child.function = [&, rank] {
      rank_main(rank, stem + ".rank" + std::to_string(rank));
      return 0;
    };
    child.label = label + " rank " + std::to_string(rank);
    children.push_back(child);
  }
  SHOAL_CHECK(run_processes(children, options) == 0, options.benchmark, ": ", options.run, " failed");
  Values largest;
  for (int rank = 0; rank < ranks; ++rank) {
    const Values values = read_values(stem + ".rank" + std::to_string(rank));
    SHOAL_CHECK(!values.empty(), options.benchmark, ": rank ", rank, " of ", options.run,
                " reported nothing");
    for (const auto& [field, value] : values) {
      auto [at, fresh] = largest.emplace(field, value);
      if (!fresh) at->second = std::max(at->second, value);
    }
  }
  return largest;
}

ReportLine& ReportLine::put(const std::string& key, std::string json) {
  fields_.emplace_back(key, std::move(json));
  return *this;
}

ReportLine& ReportLine::add(const std::string& key, double value) {
  return put(key, json_number(value));
}

ReportLine& ReportLine::add(const std::string& key, double value, int decimals) {
  return put(key, std::isfinite(value) ? text_format("%.*f", decimals, value) : "null");
}

ReportLine& ReportLine::add(const std::string& key, int64_t value) {
  return put(key, std::to_string(value));
}

ReportLine& ReportLine::add(const std::string& key, const std::string& value) {
  // Bytes that are not UTF-8 (a path) become U+FFFD rather than an exception.
  return put(key, nlohmann::json(value).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
}

ReportLine& ReportLine::add_or_null(const std::string& key, bool has, const std::string& value) {
  return has ? add(key, value) : add_null(key);
}

ReportLine& ReportLine::add_bool(const std::string& key, bool value) {
  return put(key, value ? "true" : "false");
}

ReportLine& ReportLine::add_null(const std::string& key) {
  return put(key, "null");
}

ReportLine& ReportLine::add_json(const std::string& key, const std::string& json) {
  return put(key, json);
}

std::string ReportLine::str() const {
  std::string text = "{";
  for (const auto& [key, value] : fields_) {
    text += (text.size() > 1 ? ", " : "") + nlohmann::json(key).dump() + ": " + value;
  }
  return text + "}";
}

void ReportLine::print() const {
  std::printf("%s\n", str().c_str());
  std::fflush(stdout);
}

std::string text_format(const char* format, ...) {
  va_list args;
  va_start(args, format);
  va_list again;
  va_copy(again, args);
  const int size = std::vsnprintf(nullptr, 0, format, args);
  va_end(args);
  std::string text(size > 0 ? size : 0, '\0');
  if (size > 0) std::vsnprintf(text.data(), text.size() + 1, format, again);
  va_end(again);
  return text;
}

std::string cell(double value, const char* format) {
  if (!std::isfinite(value)) return "-";
  char text[64];
  std::snprintf(text, sizeof text, format, value);
  return text;
}

}  // namespace shoal::cli
