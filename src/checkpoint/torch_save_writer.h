// write_torch_save: a torch.save file's bytes (the zip archive with data.pkl, the storages and
// Shoal's checksum manifest) through a sink, for checkpoint::save (into an AtomicFile) and for
// the tensors of a DCP checkpoint (each one torch.save'd into the shared data file).
//
// Thread safety: a plain function.
#pragma once

#include <ATen/core/ivalue.h>

#include <string>

#include "compat/torch_archive.h"

namespace shoal::checkpoint::detail {

/// Writes `object` as torch.save does through `sink`; throws CheckpointError naming `where`.
void write_torch_save(const c10::IValue& object, const compat::TorchArchiveWriter::Sink& sink,
                      const std::string& where);

}  // namespace shoal::checkpoint::detail
