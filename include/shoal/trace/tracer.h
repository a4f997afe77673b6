// A timeline of what each rank did, in the Chrome trace event format (chrome://tracing, Perfetto):
// the trainer records each step (data, forward, backward, optimizer step), evaluation and
// checkpoint save/load as spans, with the epoch and step in their args; DistributedDataParallel's
// reducer records every bucket's reduction from launch to completion with its size in bytes, on
// communication tracks of its own ("communication", "communication 2", ...: a bucket goes to the
// first track free at its launch, so slices on every track nest), with a flow arrow from the
// moment the bucket was ready (inside backward) to its reduction. So overlap of communication
// with backward, and stragglers, are visible (as Horovod's timeline), and every thread's slices
// nest as Chrome-trace viewers require.
//
//   shoal::trace::enable(rank);            // recording starts; off by default (one atomic load)
//   (or: trace::Recorder mine(rank); trace::ScopedRecorder scope(&mine); for this thread only)
//   { shoal::trace::Span span("forward"); ... }
//   shoal::trace::begin("allreduce", bucket, bytes); ...; shoal::trace::end("allreduce", bucket);
//   shoal::trace::write_file("trace.json", shoal::trace::take_events());
//
// Times are microseconds of the system clock, so that the events of ranks on one host line up
// when their files are merged (merge_files).
//
// Thread safety: every function may be called from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace shoal::trace {

/// One timeline: the events of one rank. A Trainer with a trace path records into its own, so
/// that several trainers in one process (worker threads) keep their timelines apart.
class Recorder {
 public:
  explicit Recorder(int rank);
  ~Recorder();
  Recorder(const Recorder&) = delete;
  Recorder& operator=(const Recorder&) = delete;
  int rank() const;
  void complete(const std::string& name, const char* category, int64_t start_us, int64_t end_us,
                const std::vector<std::pair<std::string, int64_t>>& args = {});
  void begin(const char* name, int64_t key, int64_t bytes = -1);
  void end(const char* name, int64_t key);
  /// From now on, events carry "epoch" and "step" args with these values (negative: none).
  void set_step(int64_t epoch, int64_t step);
  /// The events recorded so far, each one JSON object, and forgets them.
  std::vector<std::string> take_events();
  /// Forgets every event and records as `rank` from now on.
  void restart(int rank);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// While alive, what this thread records (Span, begin/end, complete) goes to `recorder` (null:
/// to nothing), whatever enable() says; the previous choice comes back on destruction.
class ScopedRecorder {
 public:
  explicit ScopedRecorder(Recorder* recorder);
  ~ScopedRecorder();
  ScopedRecorder(const ScopedRecorder&) = delete;
  ScopedRecorder& operator=(const ScopedRecorder&) = delete;

 private:
  Recorder* previous_;
  bool previous_set_;
};

/// Where this thread's events go now: its ScopedRecorder's, else the process's while enabled,
/// else null (nothing is recorded; the check is one thread-local read and one atomic load).
Recorder* current();

/// Starts recording this process's events as `rank` (the trace's process id), in threads without
/// a ScopedRecorder. Clears old events.
void enable(int rank);
/// Stops recording (events recorded so far stay until take_events).
void disable();
/// True while recording.
bool enabled();

/// Microseconds since the epoch of the system clock.
int64_t now_us();

/// A complete event into current(): `name` from start_us to end_us, with integer arguments.
void complete(const std::string& name, const char* category, int64_t start_us, int64_t end_us,
              const std::vector<std::pair<std::string, int64_t>>& args = {});

/// The epoch (1-based) and optimizer step (1-based) that current()'s events belong to from now on.
void set_step(int64_t epoch, int64_t step);

/// Starts an interval named `name` keyed by `key` (a bucket's index), `bytes` long (-1: none);
/// end(name, key) records it on a communication track, with a flow arrow from the thread that
/// called begin. Both do nothing while not recording.
void begin(const char* name, int64_t key, int64_t bytes = -1);
void end(const char* name, int64_t key);

/// Records a span from construction to destruction into the recorder current() at construction.
class Span {
 public:
  explicit Span(const char* name, const char* category = "train");
  ~Span();
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  const char* name_;
  const char* category_;
  Recorder* recorder_;
  int64_t start_us_ = -1;
};

/// The process recorder's events so far (see enable), and forgets them.
std::vector<std::string> take_events();

/// Writes {"traceEvents": [events...]} to `path` (atomically: a temporary file, then renamed).
/// Throws shoal::Error when it cannot be written.
void write_file(const std::string& path, const std::vector<std::string>& events);

/// Reads back the events of files written by write_file (per-rank parts), writes them all to
/// `path` as one trace and deletes the parts. Throws shoal::Error on a file that is not one of
/// write_file's (or is larger than 1 GiB).
void merge_files(const std::vector<std::string>& parts, const std::string& path);

}  // namespace shoal::trace
