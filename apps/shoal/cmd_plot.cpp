// `shoal plot`: the metrics of one or more runs (`shoal train --metrics FILE`, JSON lines) as one
// SVG picture a browser shows (or, with -o FILE.png, the same picture as PNG: plot_png.h), in four
// panels: training loss (per log interval, thin, and per epoch, with markers), test loss and test
// accuracy per epoch (lines with markers), and samples/s (y from zero: a rate). The x axis is
// optimizer steps, samples or epochs (--x), so that runs with different global batches line up
// by samples. Ticks fall on round values (1, 2 or 5 times a power of ten) and the axes end on
// ticks; a panel whose runs have one point each (a one-epoch run's test accuracy) shows the values
// as labelled numbers instead of an empty chart. The legend names each run by its strategy and
// world size (the metrics file's "run" line). --style light (colours) or print (black and greys,
// dashes and marker shapes tell the runs apart).
//
// Every series is an SVG <polyline class="series"> with data-run, data-metric and data-x
// attributes, every marker a <circle class="marker">, every tick a <g class="tick"> with data-axis
// and data-value, so that tools (and the tests) can find what was drawn.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <optional>
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
  std::vector<std::pair<double, double>> points;
  bool markers = false;  // per-epoch values: few points, each marked
};

/// What a panel plots: `field` of the lines whose "event" is `event`, under the name `metric`.
struct MetricSpec {
  const char* metric;
  const char* event;
  const char* field;
  bool markers;
};

struct PanelSpec {
  const char* title;
  std::vector<MetricSpec> metrics;
  bool y_from_zero;  // rates: a 15 % wobble must not look like a collapse
  const char* y_label;
};

const std::vector<PanelSpec>& panels() {
  static const std::vector<PanelSpec> specs = {
      {"training loss",
       {{"loss", "step", "loss", false}, {"train_loss", "epoch", "train_loss", true}},
       false,
       "loss"},
      {"test loss", {{"test_loss", "epoch", "test_loss", true}}, false, "loss"},
      {"test accuracy", {{"test_accuracy", "epoch", "test_accuracy", true}}, false, "accuracy"},
      {"training throughput", {{"samples_per_s", "step", "samples_per_s", false}}, true,
       "samples/s (all ranks)"},
  };
  return specs;
}

/// How runs are told apart in a style.
struct Style {
  const char* name;
  std::vector<const char*> colors;
  std::vector<const char*> dashes;  // stroke-dasharray per run ("" solid)
  const char* grid;
  const char* frame;
  double line_width;
};

const Style& style_named(const std::string& name) {
  static const Style light{"light",
                           {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
                            "#e377c2", "#17becf"},
                           {""},
                           "#e6e6e6",
                           "#999999",
                           1.8};
  static const Style print{"print",
                           {"#000000", "#555555", "#000000", "#555555", "#000000", "#555555",
                            "#000000", "#555555"},
                           {"", "6,3", "2,2", "8,3,2,3"},
                           "#d0d0d0",
                           "#000000",
                           2.2};
  SHOAL_CHECK_T(InvalidArgument, name == "light" || name == "print", "--style ", name,
                " is not a style: use light or print");
  return name == "light" ? light : print;
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

/// Round ticks over [lo, hi]: a step of 1, 2 or 5 times a power of ten giving 4 to 8 intervals,
/// and the axis widened to the ticks around the data.
struct Ticks {
  double lo = 0, hi = 1, step = 0.2;
  std::vector<double> values;
};

Ticks round_ticks(double lo, double hi) {
  if (!(hi > lo)) {  // one value: a range around it
    const double pad = lo == 0 ? 1 : std::fabs(lo) * 0.1;
    lo -= pad;
    hi += pad;
  }
  const double raw = (hi - lo) / 5;
  const double power = std::pow(10.0, std::floor(std::log10(raw)));
  double step = power;
  for (const double m : {1.0, 2.0, 5.0, 10.0}) {
    step = m * power;
    if (step >= raw) break;
  }
  Ticks t;
  t.step = step;
  t.lo = std::floor(lo / step + 1e-9) * step;
  t.hi = std::ceil(hi / step - 1e-9) * step;
  const auto n = static_cast<int64_t>(std::llround((t.hi - t.lo) / step));
  for (int64_t i = 0; i <= n; ++i) {
    double v = t.lo + static_cast<double>(i) * step;
    if (std::fabs(v) < step * 1e-9) v = 0;  // no "-0"
    t.values.push_back(v);
  }
  return t;
}

/// A tick value as text with as many decimals as the step needs ("0.25", "1500", "12k").
std::string tick_text(double value, double step) {
  char text[48];
  if (value == 0) return "0";
  if (step >= 1000 && std::fabs(std::fmod(value, 1000)) < 1e-6) {
    const double k = value / 1000;
    const int decimals = std::max(0, -static_cast<int>(std::floor(std::log10(step / 1000) + 1e-9)));
    std::snprintf(text, sizeof(text), "%.*fk", decimals, k);
  } else {
    const int decimals = std::max(0, -static_cast<int>(std::floor(std::log10(step) + 1e-9)));
    std::snprintf(text, sizeof(text), "%.*f", decimals, value);
  }
  return text;
}

/// A value for a data- attribute: 10 significant digits (the metrics keep 9).
std::string attribute_number(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.10g", value);
  return text;
}

std::string value_text(double value) {
  char text[32];
  if (std::fabs(value) >= 1000) {
    std::snprintf(text, sizeof(text), "%.0f", value);
  } else {
    std::snprintf(text, sizeof(text), "%.4g", value);
  }
  return text;
}

constexpr double kPanelW = 470, kPanelH = 250, kMarginL = 80, kMarginT = 110, kGapX = 110,
                 kGapY = 100;
/// The picture's size in pixels.
constexpr int kWidth = static_cast<int>(kMarginL + 2 * kPanelW + kGapX + 40);
constexpr int kHeight = static_cast<int>(kMarginT + 2 * kPanelH + kGapY + 70);

const char* x_title(const std::string& x) {
  if (x == "samples") return "training samples (all ranks)";
  if (x == "epochs") return "epoch";
  return "optimizer step";
}

void draw_marker(std::ostringstream& svg, const Style& style, size_t run, double x, double y,
                 const std::string& color) {
  // Print: the marker's shape tells the runs apart too (filled, hollow).
  const bool hollow = style.name == std::string("print") && run % 2 == 1;
  svg << "<circle class=\"marker\" cx=\"" << x << "\" cy=\"" << y << "\" r=\"3.5\" fill=\""
      << (hollow ? "white" : color) << "\" stroke=\"" << color << "\" stroke-width=\"1.5\"/>\n";
}

// The legend: one entry per run, its line (colour, dash) and marker.
void draw_legend(std::ostringstream& svg, const std::vector<std::string>& runs, const Style& style) {
  double legend_x = kMarginL;
  double legend_y = 30;
  for (size_t r = 0; r < runs.size(); ++r) {
    const std::string color = style.colors[r % style.colors.size()];
    const std::string dash = style.dashes[r % style.dashes.size()];
    const double width = 60 + 8.0 * static_cast<double>(runs[r].size());
    if (legend_x + width > kWidth - 20 && r > 0) {
      legend_x = kMarginL;
      legend_y += 24;
    }
    svg << "<g class=\"legend\" data-run=\"" << xml_escape(runs[r]) << "\"><line x1=\"" << legend_x
        << "\" y1=\"" << legend_y << "\" x2=\"" << legend_x + 34 << "\" y2=\"" << legend_y
        << "\" stroke=\"" << color << "\" stroke-width=\"" << style.line_width + 0.5 << "\""
        << (dash.empty() ? "" : " stroke-dasharray=\"" + dash + "\"") << "/>\n";
    draw_marker(svg, style, r, legend_x + 17, legend_y, color);
    svg << "<text x=\"" << legend_x + 42 << "\" y=\"" << legend_y + 5 << "\">"
        << xml_escape(runs[r]) << "</text></g>\n";
    legend_x += width + 30;
  }
}

/// One panel's place, what it draws and how it draws it.
struct Panel {
  const PanelSpec& spec;
  double left, top;
  std::vector<const Series*> here;  // the series of the panel's metrics
  std::vector<double> xs, ys;       // all their points
  size_t most_points = 0;
  const std::vector<std::string>& runs;
  const std::string& x_name;
  const Style& style;

  size_t run_index(const Series& s) const {
    return static_cast<size_t>(std::find(runs.begin(), runs.end(), s.run) - runs.begin());
  }
};

void draw_empty_panel(std::ostringstream& svg, const Panel& panel) {
  svg << "<rect x=\"" << panel.left << "\" y=\"" << panel.top << "\" width=\"" << kPanelW
      << "\" height=\"" << kPanelH << "\" fill=\"none\" stroke=\"" << panel.style.grid
      << "\"/>\n<text x=\"" << panel.left + kPanelW / 2 << "\" y=\"" << panel.top + kPanelH / 2
      << "\" text-anchor=\"middle\" fill=\"#888\">not in the metrics</text>\n";
}

// One point per run: the values, labelled, rather than dots on an invented axis.
void draw_values_panel(std::ostringstream& svg, const Panel& panel) {
  double y = panel.top + 50;
  for (const Series* s : panel.here) {
    const size_t r = panel.run_index(*s);
    const std::string color = panel.style.colors[r % panel.style.colors.size()];
    const auto [x_value, value] = s->points.front();
    svg << "<g class=\"value\" data-run=\"" << xml_escape(s->run) << "\" data-metric=\""
        << s->metric << "\" data-value=\"" << attribute_number(value) << "\">";
    draw_marker(svg, panel.style, r, panel.left + 12, y - 9, color);
    svg << "<text x=\"" << panel.left + 28 << "\" y=\"" << y << "\" font-size=\"28\" fill=\""
        << color << "\">" << value_text(value) << "</text><text x=\"" << panel.left + 28
        << "\" y=\"" << y + 22 << "\" fill=\"#444\">" << xml_escape(s->run) << ", at "
        << x_title(panel.x_name) << " " << value_text(x_value) << "</text></g>\n";
    y += 64;
  }
}

/// A chart's axes: round ticks around the data, and data to pixels.
struct Axes {
  Ticks x, y;
  double left, top;
  double px(double value) const { return left + (value - x.lo) / (x.hi - x.lo) * kPanelW; }
  double py(double value) const {
    return top + kPanelH - (value - y.lo) / (y.hi - y.lo) * kPanelH;
  }
};

Axes axes_of(const Panel& panel) {
  double y_lo = *std::min_element(panel.ys.begin(), panel.ys.end());
  double y_hi = *std::max_element(panel.ys.begin(), panel.ys.end());
  if (panel.spec.y_from_zero) y_lo = std::min(0.0, y_lo);
  const Ticks x_ticks =
      round_ticks(std::min(0.0, *std::min_element(panel.xs.begin(), panel.xs.end())),
                  *std::max_element(panel.xs.begin(), panel.xs.end()));
  return Axes{x_ticks, round_ticks(y_lo, y_hi), panel.left, panel.top};
}

// The ticks with their grid lines, the frame and the axis titles.
void draw_axes(std::ostringstream& svg, const Panel& panel, const Axes& axes) {
  const double left = panel.left, top = panel.top;
  for (const double v : axes.x.values) {
    svg << "<g class=\"tick\" data-axis=\"x\" data-value=\"" << attribute_number(v) << "\"><line x1=\"" << axes.px(v)
        << "\" y1=\"" << top << "\" x2=\"" << axes.px(v) << "\" y2=\"" << top + kPanelH
        << "\" stroke=\"" << panel.style.grid << "\"/><text x=\"" << axes.px(v) << "\" y=\""
        << top + kPanelH + 18 << "\" text-anchor=\"middle\">" << tick_text(v, axes.x.step)
        << "</text></g>\n";
  }
  for (const double v : axes.y.values) {
    svg << "<g class=\"tick\" data-axis=\"y\" data-value=\"" << attribute_number(v) << "\"><line x1=\"" << left
        << "\" y1=\"" << axes.py(v) << "\" x2=\"" << left + kPanelW << "\" y2=\"" << axes.py(v)
        << "\" stroke=\"" << panel.style.grid << "\"/><text x=\"" << left - 8 << "\" y=\""
        << axes.py(v) + 4 << "\" text-anchor=\"end\">" << tick_text(v, axes.y.step)
        << "</text></g>\n";
  }
  svg << "<rect x=\"" << left << "\" y=\"" << top << "\" width=\"" << kPanelW << "\" height=\""
      << kPanelH << "\" fill=\"none\" stroke=\"" << panel.style.frame << "\"/>\n"
      << "<text x=\"" << left + kPanelW / 2 << "\" y=\"" << top + kPanelH + 40
      << "\" text-anchor=\"middle\" fill=\"#444\">" << x_title(panel.x_name) << "</text>\n"
      << "<text transform=\"translate(" << left - 58 << "," << top + kPanelH / 2
      << ") rotate(-90)\" text-anchor=\"middle\" fill=\"#444\">" << panel.spec.y_label
      << "</text>\n";
}

// One series as a polyline (interval values thin and lighter, epoch values bold with markers).
void draw_series(std::ostringstream& svg, const Panel& panel, const Axes& axes, const Series& s) {
  const size_t r = panel.run_index(s);
  const Style& style = panel.style;
  const std::string color = style.colors[r % style.colors.size()];
  const std::string dash = style.dashes[r % style.dashes.size()];
  const double width = s.markers ? style.line_width : style.line_width * 0.6;
  svg << "<polyline class=\"series\" data-run=\"" << xml_escape(s.run) << "\" data-metric=\""
      << s.metric << "\" data-x=\"" << panel.x_name << "\" fill=\"none\" stroke-width=\"" << width
      << "\" stroke-linejoin=\"round\" stroke=\"" << color << "\""
      << (s.markers ? "" : " stroke-opacity=\"0.75\"")
      << (dash.empty() ? "" : " stroke-dasharray=\"" + dash + "\"") << " points=\"";
  for (size_t i = 0; i < s.points.size(); ++i) {
    char point[64];
    std::snprintf(point, sizeof(point), "%s%.3f,%.3f", i ? " " : "", axes.px(s.points[i].first),
                  axes.py(s.points[i].second));
    svg << point;
  }
  svg << "\"/>\n";
  if (s.markers) {
    for (const auto& [x, y] : s.points) draw_marker(svg, style, r, axes.px(x), axes.py(y), color);
  }
}

void draw_panel(std::ostringstream& svg, const Panel& panel) {
  svg << "<g class=\"panel\" data-title=\"" << panel.spec.title << "\">\n"
      << "<text x=\"" << panel.left << "\" y=\"" << panel.top - 14
      << "\" font-weight=\"bold\" font-size=\"15\">" << panel.spec.title << "</text>\n";
  if (panel.spec.metrics.size() > 1) {
    svg << "<text x=\"" << panel.left + kPanelW << "\" y=\"" << panel.top - 14
        << "\" text-anchor=\"end\" fill=\"#666\">thin: per log interval, dots: per epoch</text>\n";
  }
  if (panel.xs.empty()) {
    draw_empty_panel(svg, panel);
  } else if (panel.most_points == 1) {
    draw_values_panel(svg, panel);
  } else {
    const Axes axes = axes_of(panel);
    draw_axes(svg, panel, axes);
    for (const Series* s : panel.here) draw_series(svg, panel, axes, *s);
  }
  svg << "</g>\n";
}

std::string render_svg(const std::vector<Series>& series, const std::vector<std::string>& runs,
                       const std::string& x_name, const Style& style) {
  std::ostringstream svg;
  svg << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << kWidth << "\" height=\""
      << kHeight << "\" font-family=\"DejaVu Sans, sans-serif\" font-size=\"13\" data-style=\""
      << style.name << "\" data-x=\"" << x_name << "\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  draw_legend(svg, runs, style);
  const auto& specs = panels();
  for (size_t p = 0; p < specs.size(); ++p) {
    Panel panel{specs[p],
                kMarginL + static_cast<double>(p % 2) * (kPanelW + kGapX),
                kMarginT + static_cast<double>(p / 2) * (kPanelH + kGapY),
                {}, {}, {}, 0, runs, x_name, style};
    for (const Series& s : series) {
      const bool mine = std::any_of(panel.spec.metrics.begin(), panel.spec.metrics.end(),
                                    [&](const MetricSpec& m) { return s.metric == m.metric; });
      if (!mine) continue;
      panel.here.push_back(&s);
      panel.most_points = std::max(panel.most_points, s.points.size());
      for (const auto& [x, y] : s.points) {
        panel.xs.push_back(x);
        panel.ys.push_back(y);
      }
    }
    draw_panel(svg, panel);
  }
  svg << "</svg>\n";
  return svg.str();
}

/// The x of a metrics line on the axis `x_name`, or nullopt when the line cannot say (an older
/// metrics file without the fields).
std::optional<double> x_of(const Record& record, bool epoch_line, const std::string& x_name,
                           double samples_per_epoch) {
  const auto number = [&](const char* key) -> std::optional<double> {
    const auto found = record.numbers.find(key);
    if (found == record.numbers.end() || !std::isfinite(found->second)) return std::nullopt;
    return found->second;
  };
  if (x_name == "steps") return number("step");
  std::optional<double> samples = number("total_samples");
  if (!samples && samples_per_epoch > 0) {
    const std::optional<double> epoch = number("epoch");
    if (epoch_line && epoch) samples = *epoch * samples_per_epoch;
    if (!epoch_line && epoch && number("samples")) {
      samples = (*epoch - 1) * samples_per_epoch + *number("samples");
    }
  }
  if (x_name == "samples") return samples;
  if (epoch_line) return number("epoch");
  if (samples && samples_per_epoch > 0) return *samples / samples_per_epoch;
  return std::nullopt;
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
  std::string x = "steps";
  std::string style = "light";
};

/// A run's name for the legend: its strategy and world size from the run line (shoal train
/// writes it first), else the file's name; `samples_per_epoch` gets the run line's value, if any.
std::string run_name(const std::vector<Record>& records, const std::string& file_name,
                     double& samples_per_epoch) {
  std::string run = file_name;
  for (const Record& record : records) {
    const auto event = record.strings.find("event");
    if (event == record.strings.end() || event->second != "run") continue;
    const auto strategy = record.strings.find("strategy");
    const auto world = record.numbers.find("world_size");
    if (strategy != record.strings.end() && world != record.numbers.end()) {
      const auto ranks = static_cast<long long>(world->second);
      run = strategy->second + ", " + std::to_string(ranks) + (ranks == 1 ? " rank" : " ranks");
    }
    const auto epoch_samples = record.numbers.find("samples_per_epoch");
    if (epoch_samples != record.numbers.end()) samples_per_epoch = epoch_samples->second;
    break;
  }
  return run;
}

/// The points of `spec` in one run's records against the x axis `x_name`.
Series series_of(const std::vector<Record>& records, const std::string& run,
                 const MetricSpec& spec, const std::string& x_name, double samples_per_epoch) {
  Series s{run, spec.metric, {}, spec.markers};
  const bool epoch_line = std::string(spec.event) == "epoch";
  for (const Record& record : records) {
    const auto event = record.strings.find("event");
    if (event == record.strings.end() || event->second != spec.event) continue;
    const std::optional<double> x = x_of(record, epoch_line, x_name, samples_per_epoch);
    const auto y = record.numbers.find(spec.field);
    if (!x || y == record.numbers.end() || !std::isfinite(*x) || !std::isfinite(y->second)) {
      continue;
    }
    s.points.emplace_back(*x, y->second);
  }
  return s;
}

/// Reads one metrics file (the f-th) into `series` under a run name new to `runs`.
void add_run(const PlotArgs& args, size_t f, std::vector<Series>& series,
             std::vector<std::string>& runs) {
  const std::string& path = args.files[f];
  const std::string file_name = path.substr(path.find_last_of('/') + 1);
  const std::vector<Record> records = read_metrics(path);
  double samples_per_epoch = 0;
  std::string run = run_name(records, file_name, samples_per_epoch);
  if (!args.names.empty()) run = args.names[f];
  // Two runs of one strategy and size: the file names tell them apart.
  if (std::find(runs.begin(), runs.end(), run) != runs.end()) run += " (" + file_name + ")";
  while (std::find(runs.begin(), runs.end(), run) != runs.end()) run += "'";
  runs.push_back(run);
  size_t drawn = 0;
  for (const PanelSpec& panel : panels()) {
    for (const MetricSpec& spec : panel.metrics) {
      Series s = series_of(records, run, spec, args.x, samples_per_epoch);
      if (!s.points.empty()) {
        drawn += s.points.size();
        series.push_back(std::move(s));
      }
    }
  }
  SHOAL_CHECK_T(InvalidArgument, drawn > 0, path, " has no step or epoch metrics to draw",
                args.x == "steps" ? "" : " against " + args.x,
                " (written by shoal train --metrics?)");
}

int run_plot(const PlotArgs& args) {
  SHOAL_CHECK_T(InvalidArgument, args.names.empty() || args.names.size() == args.files.size(),
                "--name was given ", args.names.size(), " times for ", args.files.size(),
                " files; give one per file or none");
  const Style& style = style_named(args.style);
  std::vector<Series> series;
  std::vector<std::string> runs;
  for (size_t f = 0; f < args.files.size(); ++f) add_run(args, f, series, runs);
  const std::string svg = render_svg(series, runs, args.x, style);
  if (is_png(args.output)) {
    write_png(svg, kWidth, kHeight, args.output);
  } else {
    std::ofstream out(args.output, std::ios::trunc);
    SHOAL_CHECK(out.good(), "cannot write ", args.output);
    out << svg;
    out.flush();
    SHOAL_CHECK(out.good(), "writing ", args.output, " failed");
  }
  std::printf("wrote %s: %zu run%s, %zu series\n", args.output.c_str(), runs.size(),
              runs.size() == 1 ? "" : "s", series.size());
  return 0;
}

}  // namespace

void add_plot_command(CLI::App& root, std::vector<Command>& commands) {
  auto args = std::make_shared<PlotArgs>();
  auto* app = root.add_subcommand(
      "plot",
      "Draw the metrics of one or more runs (shoal train --metrics FILE) as an SVG or PNG\n"
      "picture: training loss (per interval and per epoch), test loss, test accuracy and\n"
      "samples/s against steps, samples or epochs, the runs overlaid for comparison and named by\n"
      "strategy and world size. Open the SVG in a browser.");
  app->add_option("FILE", args->files, "metrics files (JSON lines), one per run")->required();
  app->add_option("-o,--output", args->output,
                  std::string("the file to write: PNG when it ends in .png") +
                      (png_supported() ? "" : " (not built in)") + ", else SVG")
      ->capture_default_str();
  app->add_option("--name", args->names,
                  "a name per run for the legend (default: its strategy and world size), in FILE "
                  "order");
  app->add_option("--x", args->x,
                  "the x axis: steps, samples (compares runs with different global batches) or "
                  "epochs")
      ->check(CLI::IsMember({"steps", "samples", "epochs"}))
      ->capture_default_str();
  app->add_option("--style", args->style, "light (colours) or print (black and greys, dashes)")
      ->check(CLI::IsMember({"light", "print"}))
      ->capture_default_str();
  app->footer("Example: shoal plot one-rank.jsonl two-ranks.jsonl --x samples -o compare.png");

  commands.push_back({app, [args] { return run_plot(*args); }});
}

}  // namespace shoal::cli
