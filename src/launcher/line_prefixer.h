// LinePrefixer: copies a worker's output stream to one of the launcher's, a whole line at a time,
// each line preceded by a label ("[rank 3] ").
//
// Each line (prefix included) goes out in a single write() loop from the launcher's one thread,
// so lines of different workers never interleave mid-line. A line longer than kMaxLineBytes is
// cut there (memory stays bounded when a worker prints without newlines).
//
// Thread safety: not thread-safe; the launcher's monitoring loop owns it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace shoal::launcher {

/// What the stderr copies of one group's workers share about their error lines ("shoal: error:
/// ..."). When one rank fails, every rank usually prints one, most of them only about the first's
/// failure ("rank 0's store went away"): the console shows one, the others only at debug level
/// (SHOAL_LOG_LEVEL=debug); log files get them all. Which one: with `hold`, each stream keeps its
/// first error line back and the group shows the line of the worker that its summary names as
/// the first to fail (the stamps of the workers' error files tell, not the order lines arrive
/// in); without, the first line to arrive is shown at once (for groups that go on after a
/// failure).
struct SharedErrorLines {
  bool hold = false;
  bool shown = false;
  uint64_t held = 0;  ///< lines held so far: the arrival order of each stream's held line
};

class LinePrefixer {
 public:
  /// Why 1 MiB: far above any sensible log line, small enough to hold for hundreds of workers.
  static constexpr size_t kMaxLineBytes = size_t{1} << 20;
  /// Why 4 KiB: an error line is one sentence; hundreds of held lines stay small.
  static constexpr size_t kMaxHeldBytes = 4096;

  /// Writes to `out_fd` (not owned; -1 for nowhere); `prefix` is empty for no prefix.
  LinePrefixer(std::string prefix, int out_fd);
  /// Also writes every line, without the prefix, to `fd` (not owned; a log file).
  void set_copy(int fd) { copy_fd_ = fd; }
  /// Shows this stream's error lines as `errors` (not owned) says: see SharedErrorLines.
  void set_error_lines(SharedErrorLines* errors) { errors_ = errors; }
  /// When this stream holds an error line back: its arrival order among the group's (1 first),
  /// else 0.
  uint64_t held_error_order() const { return held_order_; }
  /// Writes the held error line out (once) and marks the group's line as shown.
  void show_held_error();

  /// Takes `size` more bytes of the stream; writes out every line completed by them.
  void feed(const char* data, size_t size);
  /// Writes out an unfinished last line, ending it with a newline.
  void flush();

 private:
  void write_line(const char* data, size_t size, bool add_newline);
  /// Writes one line to out_fd_, prefixed.
  void write_out(const char* data, size_t size, bool add_newline);

  std::string prefix_;
  int out_fd_;
  int copy_fd_ = -1;
  SharedErrorLines* errors_ = nullptr;
  /// The first error line, held back (SharedErrorLines::hold), cut at kMaxHeldBytes.
  std::string held_error_;
  uint64_t held_order_ = 0;
  std::string pending_;  ///< the unfinished line so far
  std::string line_;     ///< scratch buffer: prefix + line
};

/// Writes all of `size` bytes, retrying on EINTR/EAGAIN; gives up silently when the reader has
/// gone (EPIPE): the launcher keeps supervising its workers when nobody reads its output.
void write_all(int fd, const char* data, size_t size);

}  // namespace shoal::launcher
