#include "checkpoint/script_archive.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>

#include "checkpoint/unpickler.h"
#include "checkpoint/zip_directory.h"
#include "compat/torch_archive.h"
#include "data/regular_file.h"
#include "shoal/error.h"

namespace shoal::checkpoint::detail {
namespace {

std::string first_line_of(const std::string& text) { return text.substr(0, text.find('\n')); }

/// Reads `archive`.pkl ("data" or "constants"), whose storages are the records under `archive`/.
void check_pickle(const compat::TorchArchiveReader& reader, const std::string& archive,
                  const std::map<std::string, uint64_t>& record_sizes, const std::string& path) {
  const std::string name = archive + ".pkl";
  if (!reader.has_record(name)) return;
  std::string pickle;
  try {
    pickle = reader.read(name);
  } catch (const c10::Error& e) {
    SHOAL_THROW(CheckpointError, path, ": record '", name, "' cannot be read (truncated or corrupt: ",
                first_line_of(e.what_without_backtrace()), ")");
  }
  auto storage = [&](const std::string& key, c10::ScalarType dtype, int64_t numel) {
    const std::string record = archive + "/" + key;
    const auto it = record_sizes.find(record);
    SHOAL_CHECK_T(CheckpointError, it != record_sizes.end(), path, ": storage record '", record,
                  "' is missing: the file is corrupt");
    const uint64_t element_size = c10::elementSize(dtype);
    SHOAL_CHECK_T(CheckpointError, static_cast<uint64_t>(numel) <= it->second / element_size, path,
                  ": storage record '", record, "' holds ", it->second, " bytes, fewer than its ", numel,
                  " elements of ", c10::toString(dtype), " need: the file is corrupt");
    return at::empty({numel}, at::TensorOptions().dtype(dtype).device(c10::kMeta));
  };
  Unpickler::Limits limits;
  limits.script_objects = true;
  Unpickler(pickle, storage, path + ": " + name, limits).load();
}

}  // namespace

void check_script_archive(const std::string& path) {
  data::detail::require_regular_file<CheckpointError>(path);
  char magic[4] = {};
  std::ifstream(path, std::ios::binary).read(magic, sizeof(magic));
  SHOAL_CHECK_T(CheckpointError, std::memcmp(magic, "PK\x03\x04", 4) == 0, path,
                ": not a TorchScript model (it does not start like a zip archive; save one from Python "
                "with torch.jit.script(model).save(path))");
  const ZipDirectory directory(path);
  check_declared_sizes(directory, path);
  std::map<std::string, uint64_t> record_sizes;
  for (const auto& entry : directory.entries()) record_sizes[record_name(entry)] = entry.uncompressed_size;
  std::unique_ptr<compat::TorchArchiveReader> reader;
  try {
    reader = std::make_unique<compat::TorchArchiveReader>(path);
  } catch (const c10::Error& e) {
    SHOAL_THROW(CheckpointError, path, ": is truncated or corrupt (the zip archive cannot be read: ",
                first_line_of(e.what_without_backtrace()), ")");
  }
  for (const char* archive : {"data", "constants"}) check_pickle(*reader, archive, record_sizes, path);
}

}  // namespace shoal::checkpoint::detail
