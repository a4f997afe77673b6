// TensorBoard event files from C++: torch.utils.tensorboard.SummaryWriter's names and layout.
//
//   shoal::SummaryWriter writer("runs/ddp-2");            // runs/ddp-2/events.out.tfevents.<time>.<host>.<pid>.<n>
//   writer.add_scalar("train/loss", 0.61, /*global_step=*/100);
//   writer.add_scalars("loss", {{"train", 0.6}, {"test", 0.7}}, 100);  // runs/ddp-2/loss_train/, ...
//   writer.add_histogram("weights/fc1.weight", model->fc1->weight, 100);
//   writer.add_text("config", "lr 0.05, batch 64", 0);
//   writer.flush();                                      // on disk now (also every flush_secs)
//
// `tensorboard --logdir runs` shows the run. The add_ calls encode the event and queue it; a
// background thread appends the queue to the file and flushes it every flush_secs, so a training
// step pays for the encoding only (microseconds; docs/PERFORMANCE.md). The file is TFRecord framed
// with masked CRC-32C, records of tensorflow.Event messages (see src/summary/event_encoding.h).
// When the disk refuses a write (full, a file-size limit), the file is cut back to its last whole
// record, so that it always reads as whole records, and the next call throws saying so.
//
// Thread safety: every method may be called from any thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>

namespace shoal::summary {

/// SummaryWriter's options, with PyTorch's defaults where it has them.
struct SummaryWriterOptions {
  /// Seconds between flushes of the queued events to the file (PyTorch's flush_secs).
  double flush_secs = 120;
  /// Queued bytes at which an add_ call waits for the writer thread (a slow disk then slows
  /// training rather than filling memory).
  size_t max_queue_bytes = size_t(64) << 20;
  /// Appended to the event file's name (PyTorch's filename_suffix).
  std::string filename_suffix;
  /// How long flush(), close() and a full queue wait for the disk before throwing.
  double timeout_secs = 60;
};

/// Writes TensorBoard event files into `log_dir` (created with its parents).
class SummaryWriter {
 public:
  /// Throws shoal::InvalidArgument when `log_dir` cannot be created or written.
  explicit SummaryWriter(const std::string& log_dir, SummaryWriterOptions options = {});
  /// Flushes and closes (errors are logged, not thrown).
  ~SummaryWriter();
  SummaryWriter(const SummaryWriter&) = delete;
  SummaryWriter& operator=(const SummaryWriter&) = delete;

  /// One scalar (stored as float32, as TensorBoard does) at `global_step`. `walltime` is seconds
  /// since the epoch; negative: now.
  void add_scalar(const std::string& tag, double scalar_value, int64_t global_step = 0,
                  double walltime = -1);
  /// Several scalars in one chart: each key goes to its own run folder
  /// `log_dir/<main_tag>_<key>` under the tag `main_tag` (PyTorch's layout).
  void add_scalars(const std::string& main_tag, const std::map<std::string, double>& values,
                   int64_t global_step = 0, double walltime = -1);
  /// The distribution of `values` (any shape, any floating or integer dtype) in `bins`
  /// equal-width buckets between its min and max (empty end buckets dropped, as PyTorch does).
  /// A non-finite value is an InvalidArgument (TensorBoard cannot draw it).
  void add_histogram(const std::string& tag, const at::Tensor& values, int64_t global_step = 0,
                     int bins = 64, double walltime = -1);
  /// A text (markdown) for TensorBoard's text plugin.
  void add_text(const std::string& tag, const std::string& text_string, int64_t global_step = 0,
                double walltime = -1);
  /// Writes every queued event and flushes the files. Throws shoal::Error when the disk refused
  /// them or did not take them within options.timeout_secs.
  void flush();
  /// flush(), then stops the writer thread; later add_ calls throw.
  void close();

  /// The run folder.
  const std::string& log_dir() const;
  /// The event file of the main run.
  std::string file_name() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace shoal::summary

namespace shoal {
using summary::SummaryWriter;
using summary::SummaryWriterOptions;
}  // namespace shoal
