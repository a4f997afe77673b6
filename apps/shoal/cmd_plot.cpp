// `shoal plot`: the metrics of one or more runs (`shoal train --metrics FILE`, JSON lines) as one
// SVG picture a browser shows: loss, test accuracy and samples/s, each against optimizer steps and
// against time, the runs overlaid in different colours.
//
// Every series is an SVG <polyline class="series"> with data-run, data-metric and data-x
// attributes, so that tools (and the tests) can find what was drawn.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "commands.h"
#include "shoal/error.h"

namespace shoal::cli {
namespace {

constexpr size_t kMaxLineBytes = 1 << 20;
constexpr size_t kMaxRecords = 10'000'000;

/// One metrics line: its numbers and its strings.
struct Record {
  std::map<std::string, double> numbers;
  std::map<std::string, std::string> strings;
};

/// Parses one flat JSON object of strings, numbers, booleans and nulls (what MetricsWriter
/// writes). Throws InvalidArgument naming `where` on anything else.
class LineParser {
 public:
  LineParser(const std::string& text, std::string where) : text_(text), where_(std::move(where)) {}

  Record parse() {
    Record record;
    skip_space();
    expect('{');
    skip_space();
    if (peek() == '}') {
      ++pos_;
      return record;
    }
    while (true) {
      skip_space();
      const std::string key = parse_string();
      skip_space();
      expect(':');
      skip_space();
      const char c = peek();
      if (c == '"') {
        record.strings[key] = parse_string();
      } else if (c == 't' || c == 'f' || c == 'n') {
        const std::string word = text_.substr(pos_, c == 'f' ? 5 : 4);
        if (word != "true" && word != "false" && word != "null") fail("a value");
        pos_ += word.size();
        if (word == "null") record.numbers[key] = NAN;  // MetricsWriter writes NaN as null
      } else {
        const char* begin = text_.c_str() + pos_;
        char* end = nullptr;
        const double value = std::strtod(begin, &end);
        if (end == begin) fail("a number");
        pos_ += static_cast<size_t>(end - begin);
        record.numbers[key] = value;
      }
      skip_space();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      expect('}');
      return record;
    }
  }

 private:
  char peek() const { return pos_ < text_.size() ? text_[pos_] : '\0'; }
  void skip_space() {
    while (pos_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[pos_]))) ++pos_;
  }
  [[noreturn]] void fail(const char* wanted) const {
    SHOAL_THROW(InvalidArgument, where_, ": not a metrics line (expected ", wanted,
                " at column ", pos_ + 1, ")");
  }
  void expect(char c) {
    if (peek() != c) fail(std::string(1, c).c_str());
    ++pos_;
  }
  std::string parse_string() {
    expect('"');
    std::string out;
    while (pos_ < text_.size() && text_[pos_] != '"') {
      if (text_[pos_] == '\\' && pos_ + 1 < text_.size()) ++pos_;
      out += text_[pos_++];
    }
    expect('"');
    return out;
  }

  const std::string& text_;
  std::string where_;
  size_t pos_ = 0;
};

std::vector<Record> read_metrics(const std::string& path) {
  std::ifstream in(path);
  SHOAL_CHECK_T(InvalidArgument, in.good(), "cannot read metrics file ", path);
  std::vector<Record> records;
  std::string line;
  size_t number = 0;
  while (std::getline(in, line)) {
    ++number;
    SHOAL_CHECK_T(InvalidArgument, line.size() <= kMaxLineBytes, path, ":", number,
                  ": line longer than 1 MiB");
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    records.push_back(LineParser(line, path + ":" + std::to_string(number)).parse());
    SHOAL_CHECK_T(InvalidArgument, records.size() <= kMaxRecords, path, ": more than ",
                  kMaxRecords, " lines");
  }
  return records;
}

/// One curve: points (x, y) of one run.
struct Series {
  std::string run;
  std::string metric;
  std::string x_name;
  std::vector<std::pair<double, double>> points;
};

/// What a panel plots: `field` of the lines whose "event" is `event`.
struct MetricSpec {
  const char* metric;  // the name in the picture and in data-metric
  const char* event;
  const char* field;
};

constexpr MetricSpec kMetrics[] = {
    {"loss", "step", "loss"},
    {"test_accuracy", "epoch", "test_accuracy"},
    {"samples_per_s", "step", "samples_per_s"},
};
constexpr const char* kAxes[] = {"step", "time"};
constexpr const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e",
                                   "#9467bd", "#8c564b", "#e377c2", "#17becf"};

std::string format_number(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.4g", value);
  return text;
}

std::string xml_escape(const std::string& text) {
  std::string out;
  for (const char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

/// [lo, hi] around the values, never empty.
std::pair<double, double> range_of(const std::vector<double>& values) {
  double lo = *std::min_element(values.begin(), values.end());
  double hi = *std::max_element(values.begin(), values.end());
  if (hi - lo < 1e-12 * std::max(1.0, std::fabs(hi))) {
    const double pad = std::max(1e-6, std::fabs(hi) * 0.1);
    lo -= pad;
    hi += pad;
  }
  return {lo, hi};
}

std::string render_svg(const std::vector<Series>& series, const std::vector<std::string>& runs) {
  constexpr double kPanelW = 520, kPanelH = 240, kMarginL = 70, kMarginT = 60, kGapX = 90,
                   kGapY = 70;
  const double width = kMarginL + 2 * kPanelW + kGapX + 30;
  const double height = kMarginT + 3 * kPanelH + 2 * kGapY + 50;
  std::ostringstream svg;
  svg << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
      << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  // The legend: one colour per run.
  for (size_t r = 0; r < runs.size(); ++r) {
    const double x = kMarginL + static_cast<double>(r) * 220;
    svg << "<g class=\"legend\"><rect x=\"" << x << "\" y=\"16\" width=\"14\" height=\"14\" fill=\""
        << kColors[r % 8] << "\"/><text x=\"" << x + 20 << "\" y=\"28\">" << xml_escape(runs[r])
        << "</text></g>\n";
  }
  for (size_t m = 0; m < std::size(kMetrics); ++m) {
    for (size_t a = 0; a < std::size(kAxes); ++a) {
      const double left = kMarginL + static_cast<double>(a) * (kPanelW + kGapX);
      const double top = kMarginT + static_cast<double>(m) * (kPanelH + kGapY);
      std::vector<const Series*> here;
      std::vector<double> xs, ys;
      for (const Series& s : series) {
        if (s.metric != kMetrics[m].metric || s.x_name != kAxes[a]) continue;
        here.push_back(&s);
        for (const auto& [x, y] : s.points) {
          xs.push_back(x);
          ys.push_back(y);
        }
      }
      svg << "<g class=\"panel\" data-metric=\"" << kMetrics[m].metric << "\" data-x=\""
          << kAxes[a] << "\">\n"
          << "<rect x=\"" << left << "\" y=\"" << top << "\" width=\"" << kPanelW << "\" height=\""
          << kPanelH << "\" fill=\"none\" stroke=\"#888\"/>\n"
          << "<text x=\"" << left + kPanelW / 2 << "\" y=\"" << top - 8
          << "\" text-anchor=\"middle\" font-weight=\"bold\">" << kMetrics[m].metric << " vs "
          << (a == 0 ? "optimizer step" : "time (s)") << "</text>\n";
      if (xs.empty()) {
        svg << "<text x=\"" << left + kPanelW / 2 << "\" y=\"" << top + kPanelH / 2
            << "\" text-anchor=\"middle\" fill=\"#888\">no data</text>\n</g>\n";
        continue;
      }
      const auto [x_lo, x_hi] = range_of(xs);
      const auto [y_lo, y_hi] = range_of(ys);
      const auto px = [&, x_lo = x_lo, x_hi = x_hi](double x) {
        return left + (x - x_lo) / (x_hi - x_lo) * kPanelW;
      };
      const auto py = [&, y_lo = y_lo, y_hi = y_hi](double y) {
        return top + kPanelH - (y - y_lo) / (y_hi - y_lo) * kPanelH;
      };
      // Ticks: five on each axis, labelled with their values.
      for (int t = 0; t <= 4; ++t) {
        const double xv = x_lo + (x_hi - x_lo) * t / 4;
        const double yv = y_lo + (y_hi - y_lo) * t / 4;
        svg << "<line x1=\"" << px(xv) << "\" y1=\"" << top + kPanelH << "\" x2=\"" << px(xv)
            << "\" y2=\"" << top + kPanelH + 5 << "\" stroke=\"#888\"/><text x=\"" << px(xv)
            << "\" y=\"" << top + kPanelH + 18 << "\" text-anchor=\"middle\">"
            << format_number(xv) << "</text>\n"
            << "<line x1=\"" << left - 5 << "\" y1=\"" << py(yv) << "\" x2=\"" << left
            << "\" y2=\"" << py(yv) << "\" stroke=\"#888\"/><text x=\"" << left - 8 << "\" y=\""
            << py(yv) + 4 << "\" text-anchor=\"end\">" << format_number(yv) << "</text>\n";
      }
      for (const Series* s : here) {
        const size_t r = static_cast<size_t>(
            std::find(runs.begin(), runs.end(), s->run) - runs.begin());
        svg << "<polyline class=\"series\" data-run=\"" << xml_escape(s->run)
            << "\" data-metric=\"" << s->metric << "\" data-x=\"" << s->x_name
            << "\" fill=\"none\" stroke-width=\"1.5\" stroke=\"" << kColors[r % 8]
            << "\" points=\"";
        for (size_t i = 0; i < s->points.size(); ++i) {
          char point[64];
          std::snprintf(point, sizeof(point), "%s%.3f,%.3f", i ? " " : "", px(s->points[i].first),
                        py(s->points[i].second));
          svg << point;
        }
        svg << "\"/>\n";
        if (s->points.size() < 30) {  // few points (epochs): mark them
          for (const auto& [x, y] : s->points) {
            svg << "<circle cx=\"" << px(x) << "\" cy=\"" << py(y) << "\" r=\"3\" fill=\""
                << kColors[r % 8] << "\"/>\n";
          }
        }
      }
      svg << "</g>\n";
    }
  }
  svg << "</svg>\n";
  return svg.str();
}

struct PlotArgs {
  std::vector<std::string> files;
  std::vector<std::string> names;
  std::string output = "metrics.svg";
};

}  // namespace

void add_plot_command(CLI::App& root, std::vector<Command>& commands) {
  auto args = std::make_shared<PlotArgs>();
  auto* app = root.add_subcommand(
      "plot",
      "Draw the metrics of one or more runs (shoal train --metrics FILE) as an SVG picture:\n"
      "loss, test accuracy and samples/s against optimizer steps and against time, the runs\n"
      "overlaid for comparison. Open the SVG in a browser.");
  app->add_option("FILE", args->files, "metrics files (JSON lines), one per run")->required();
  app->add_option("-o,--output", args->output, "the SVG file to write")->capture_default_str();
  app->add_option("--name", args->names,
                  "a name per run for the legend (default: the file names), in FILE order");
  app->footer("Example: shoal plot base.jsonl big-batch.jsonl -o compare.svg");

  commands.push_back({app, [args] {
    SHOAL_CHECK_T(InvalidArgument, args->names.empty() || args->names.size() == args->files.size(),
                  "--name was given ", args->names.size(), " times for ", args->files.size(),
                  " files; give one per file or none");
    std::vector<Series> series;
    std::vector<std::string> runs;
    for (size_t f = 0; f < args->files.size(); ++f) {
      const std::string& path = args->files[f];
      std::string run = args->names.empty() ? path.substr(path.find_last_of('/') + 1)
                                            : args->names[f];
      while (std::find(runs.begin(), runs.end(), run) != runs.end()) run += "'";
      runs.push_back(run);
      const std::vector<Record> records = read_metrics(path);
      size_t drawn = 0;
      for (const MetricSpec& spec : kMetrics) {
        for (const char* axis : kAxes) {
          Series s{run, spec.metric, axis, {}};
          for (const Record& record : records) {
            const auto event = record.strings.find("event");
            if (event == record.strings.end() || event->second != spec.event) continue;
            const auto x = record.numbers.find(axis);
            const auto y = record.numbers.find(spec.field);
            if (x == record.numbers.end() || y == record.numbers.end()) continue;
            if (!std::isfinite(x->second) || !std::isfinite(y->second)) continue;
            s.points.emplace_back(x->second, y->second);
          }
          if (!s.points.empty()) {
            drawn += s.points.size();
            series.push_back(std::move(s));
          }
        }
      }
      SHOAL_CHECK_T(InvalidArgument, drawn > 0, path,
                    " has no step or epoch metrics to draw (written by shoal train --metrics?)");
    }
    const std::string svg = render_svg(series, runs);
    std::ofstream out(args->output, std::ios::trunc);
    SHOAL_CHECK(out.good(), "cannot write ", args->output);
    out << svg;
    out.flush();
    SHOAL_CHECK(out.good(), "writing ", args->output, " failed");
    std::printf("wrote %s: %zu run%s, %zu series\n", args->output.c_str(), runs.size(),
                runs.size() == 1 ? "" : "s", series.size());
    return 0;
  }});
}

}  // namespace shoal::cli
