// write_torch_save: a torch.save file's bytes (the zip archive with data.pkl, the storages and
// Shoal's checksum manifest) through a sink, for checkpoint::save (into an AtomicFile) and for
// the tensors of a DCP checkpoint (each one torch.save'd into the shared data file, through a
// TorchSaveSequence).
//
// Thread safety: a plain function; a TorchSaveSequence from one thread.
#pragma once

#include <ATen/core/ivalue.h>

#include <cstdint>
#include <string>

#include "checkpoint/atomic_file.h"
#include "compat/torch_archive.h"

namespace shoal::checkpoint::detail {

/// Writes `object` as torch.save does through `sink`; throws CheckpointError naming `where`.
void write_torch_save(const c10::IValue& object, const compat::TorchArchiveWriter::Sink& sink,
                      const std::string& where);

/// A file of torch.save archives one after another (a DCP data file), written atomically: nothing
/// is at `path` until commit().
class TorchSaveSequence {
 public:
  /// Where an archive lies in the file.
  struct Place {
    int64_t offset = 0;
    int64_t length = 0;
  };
  explicit TorchSaveSequence(std::string path) : path_(path), file_(std::move(path)) {}
  /// Writes `object` as torch.save does after what the file holds.
  Place append(const c10::IValue& object);
  void commit() { file_.commit(); }

 private:
  std::string path_;
  AtomicFile file_;
  int64_t written_ = 0;
};

}  // namespace shoal::checkpoint::detail
