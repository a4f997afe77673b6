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
#include <string>

namespace shoal::launcher {

/// What the stderr copies of one group's workers share: whether a worker's error line
/// ("shoal: error: ...") has reached the console yet. When one rank fails, every rank usually
/// prints one, most of them only about the first's failure ("rank 0's store went away"): the
/// first is shown, the others only at debug level (SHOAL_LOG_LEVEL=debug). Log files get them all.
struct SharedErrorLines {
  bool shown = false;
};

class LinePrefixer {
 public:
  /// Why 1 MiB: far above any sensible log line, small enough to hold for hundreds of workers.
  static constexpr size_t kMaxLineBytes = size_t{1} << 20;

  /// Writes to `out_fd` (not owned; -1 for nowhere); `prefix` is empty for no prefix.
  LinePrefixer(std::string prefix, int out_fd);
  /// Also writes every line, without the prefix, to `fd` (not owned; a log file).
  void set_copy(int fd) { copy_fd_ = fd; }
  /// Shows this stream's error lines only while no other stream of `errors` (not owned) has.
  void set_error_lines(SharedErrorLines* errors) { errors_ = errors; }

  /// Takes `size` more bytes of the stream; writes out every line completed by them.
  void feed(const char* data, size_t size);
  /// Writes out an unfinished last line, ending it with a newline.
  void flush();

 private:
  void write_line(const char* data, size_t size, bool add_newline);

  std::string prefix_;
  int out_fd_;
  int copy_fd_ = -1;
  SharedErrorLines* errors_ = nullptr;
  std::string pending_;  ///< the unfinished line so far
  std::string line_;     ///< scratch buffer: prefix + line
};

/// Writes all of `size` bytes, retrying on EINTR/EAGAIN; gives up silently when the reader has
/// gone (EPIPE): the launcher keeps supervising its workers when nobody reads its output.
void write_all(int fd, const char* data, size_t size);

}  // namespace shoal::launcher
