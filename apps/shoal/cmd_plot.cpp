// `shoal plot`: the metrics of one or more runs (`shoal train --metrics FILE`, JSON lines) as one
// SVG picture a browser shows (or, with -o FILE.png, the same picture as PNG: plot_png.h): loss,
// test accuracy and samples/s, each against optimizer steps and against time, the runs overlaid
// in different colours.
//
// Every series is an SVG <polyline class="series"> with data-run, data-metric and data-x
// attributes, so that tools (and the tests) can find what was drawn.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "plot_png.h"
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

/// One metrics line (a flat JSON object, as MetricsWriter writes it) as a Record: its strings
/// and numbers; null is NaN (MetricsWriter writes NaN as null), booleans and nested values are
/// left out. Throws InvalidArgument naming `where` when the line is not a JSON object.
Record parse_record(const std::string& line, const std::string& where) {
  nlohmann::json object;
  try {
    object = nlohmann::json::parse(line);
  } catch (const nlohmann::json::parse_error& e) {
    // e.what() is "[json.exception.parse_error.101] parse error at line 1, column 7: ...".
    const std::string what = e.what();
    const size_t at = what.find("] ");
    SHOAL_THROW(InvalidArgument, where, ": not a metrics line (",
                at == std::string::npos ? what : what.substr(at + 2), ")");
  }
  SHOAL_CHECK_T(InvalidArgument, object.is_object(), where,
                ": not a metrics line (expected a JSON object, found ", object.type_name(), ")");
  Record record;
  for (const auto& [key, value] : object.items()) {
    if (value.is_string()) {
      record.strings[key] = value.get<std::string>();
    } else if (value.is_number()) {
      record.numbers[key] = value.get<double>();
    } else if (value.is_null()) {
      record.numbers[key] = NAN;
    }
  }
  return record;
}

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
    records.push_back(parse_record(line, path + ":" + std::to_string(number)));
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

constexpr double kPanelW = 520, kPanelH = 240, kMarginL = 70, kMarginT = 60, kGapX = 90,
                 kGapY = 70;
/// The picture's size in pixels (1230 x 970).
constexpr int kWidth = static_cast<int>(kMarginL + 2 * kPanelW + kGapX + 30);
constexpr int kHeight = static_cast<int>(kMarginT + 3 * kPanelH + 2 * kGapY + 50);

std::string render_svg(const std::vector<Series>& series, const std::vector<std::string>& runs) {
  const double width = kWidth;
  const double height = kHeight;
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

/// Whether `path` asks for PNG: it ends in ".png" (any case); anything else is written as SVG.
bool is_png(const std::string& path) {
  if (path.size() < 4) return false;
  std::string ending = path.substr(path.size() - 4);
  for (char& c : ending) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return ending == ".png";
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
      "Draw the metrics of one or more runs (shoal train --metrics FILE) as an SVG or PNG\n"
      "picture: loss, test accuracy and samples/s against optimizer steps and against time, the\n"
      "runs overlaid for comparison. Open the SVG in a browser.");
  app->add_option("FILE", args->files, "metrics files (JSON lines), one per run")->required();
  app->add_option("-o,--output", args->output,
                  std::string("the file to write: PNG when it ends in .png") +
                      (png_supported() ? "" : " (not built in)") + ", else SVG")
      ->capture_default_str();
  app->add_option("--name", args->names,
                  "a name per run for the legend (default: the file names), in FILE order");
  app->footer("Example: shoal plot base.jsonl big-batch.jsonl -o compare.svg (or compare.png)");

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
    if (is_png(args->output)) {
      write_png(svg, kWidth, kHeight, args->output);
    } else {
      std::ofstream out(args->output, std::ios::trunc);
      SHOAL_CHECK(out.good(), "cannot write ", args->output);
      out << svg;
      out.flush();
      SHOAL_CHECK(out.good(), "writing ", args->output, " failed");
    }
    std::printf("wrote %s: %zu run%s, %zu series\n", args->output.c_str(), runs.size(),
                runs.size() == 1 ? "" : "s", series.size());
    return 0;
  }});
}

}  // namespace shoal::cli
