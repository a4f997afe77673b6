// The shape the `shoal bench` subcommands that race contenders share: each contender's samples
// (one value per round and field) with their medians; rounds that interleave the contenders
// (A B, then B A) and run each beside a reference (R A R B R), so that the machine's drift hits
// every contender alike and each is read against the reference runs next to it; medians of
// per-round ratios; a temporary folder that removes itself; and the report's lines, as JSON
// objects or text.
//
// Thread safety: plain values and functions; use each object from one thread. A forked child
// (run_processes' function children) ends with _exit and so never removes its parent's TempDir.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "bench_util.h"
#include "checkpoint/temp_dir.h"

namespace shoal::cli {

/// One contender of a benchmark, a mode ("shoal_ddp", "pytorch_ddp"), and what its runs measured.
struct BenchMode {
  std::string name;
  /// field -> one value per round (or per run).
  std::map<std::string, std::vector<double>> samples;

  /// Adds one value of `field`.
  void add(const std::string& field, double value) { samples[field].push_back(value); }
  /// The values of `field`, in order; empty when there are none.
  const std::vector<double>& all(const std::string& field) const;
  /// The median of `field`; NaN when there are none.
  double get(const std::string& field) const;
  /// The last value of `field`; NaN when there are none.
  double last(const std::string& field) const;
};

/// The median over the rounds of a[r] / b[r] (the rounds both have); NaN when there are none.
double median_ratio(const std::vector<double>& a, const std::vector<double>& b);

/// The order in which `count` contenders run in `round`: in order in even rounds, reversed in odd
/// ones, so that no contender always runs right after the same other one and a spell of the
/// machine's noise at the same place of every round does not always fall on the same contender.
std::vector<size_t> round_order(size_t count, int round);

/// What run_beside_reference records on each contender.
struct BesideReference {
  /// The field of the rate compared (set by the runs).
  std::string rate = "samples_per_s";
  /// Where each contender gets its rate over the mean of the reference runs beside it.
  std::string ratio = "of_ceiling";
  /// Where each contender gets that mean ("": not recorded).
  std::string reference_rate;
  /// false: the reference runs once, first, and every contender is read against that run.
  bool between = true;
};

/// One round: `reference`, then each of `contenders` (in round_order) followed by `reference`
/// again (R A R B R ...); `run(c)` runs contender c once, adding its rate under `fields.rate`.
void run_beside_reference(const std::vector<BenchMode*>& contenders, BenchMode& reference,
                          int round, const std::function<void(BenchMode&)>& run,
                          const BesideReference& fields);

/// `rounds` rounds of run_beside_reference: the first of `modes` the reference, the others its
/// contenders, each contender's ratio to it under `ratio`; the reference's own ratio is 1.
void run_rounds_beside_first(const std::vector<BenchMode*>& modes, int rounds,
                             const std::function<void(BenchMode&)>& run, const std::string& ratio);

/// Runs `ranks` forked copies of this process at once, rank r calling rank_main(r, <stem>.rank<r>)
/// (its write_values file), and returns each field's largest value over the ranks: the slowest
/// rank's seconds, the largest rank's memory. Throws naming `options.run` when a rank fails or
/// writes nothing.
Values run_forked_ranks(int ranks, const std::string& label, const std::string& stem,
                        const std::function<void(int rank, const std::string& result)>& rank_main,
                        const RunProcessesOptions& options);

/// A new folder $TMPDIR/shoal_bench_<name>_XXXXXX, removed with everything in it when the object
/// goes (after an exception too).
class TempDir : public checkpoint::detail::TempDir {
 public:
  /// Throws shoal::Error naming `name`'s benchmark when the folder cannot be made.
  explicit TempDir(const std::string& name)
      : checkpoint::detail::TempDir("shoal_bench_" + name + "_", "bench " + name) {}
};

/// One JSON object of a benchmark's report, on one line: {"key": value, ...}, the keys in the
/// order added; a number with 6 significant digits (or the decimals given), null when it is not
/// finite (JSON has no NaN). The benches' lines keep this spaced form, which readers of their
/// output match on; train::JsonLine writes the metrics files' compact one.
class ReportLine {
 public:
  ReportLine& add(const std::string& key, double value);
  /// `value` with `decimals` digits after the point ("%.3f").
  ReportLine& add(const std::string& key, double value, int decimals);
  ReportLine& add(const std::string& key, int64_t value);
  ReportLine& add(const std::string& key, int value) { return add(key, int64_t{value}); }
  ReportLine& add(const std::string& key, const std::string& value);
  ReportLine& add(const std::string& key, const char* value) { return add(key, std::string(value)); }
  /// `value` as a string, or null where `has` is false.
  ReportLine& add_or_null(const std::string& key, bool has, const std::string& value);
  ReportLine& add_bool(const std::string& key, bool value);
  ReportLine& add_null(const std::string& key);
  /// `json`, already JSON text (an object, an array), as the value.
  ReportLine& add_json(const std::string& key, const std::string& json);
  /// The object as one line, without the newline.
  std::string str() const;
  /// Prints str() and a newline on stdout.
  void print() const;

 private:
  ReportLine& put(const std::string& key, std::string json);
  std::vector<std::pair<std::string, std::string>> fields_;  // key, its value's JSON text
};

/// printf into a string.
std::string text_format(const char* format, ...) __attribute__((format(printf, 1, 2)));

/// `value` printed with `format` ("%.2f"), or "-" when it is not finite: a table's cell.
std::string cell(double value, const char* format);

}  // namespace shoal::cli
