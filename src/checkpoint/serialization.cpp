#include "shoal/checkpoint/serialization.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <map>

#include "checkpoint/atomic_file.h"
#include "checkpoint/checksum_manifest.h"
#include "checkpoint/pickler.h"
#include "checkpoint/torch_save_reader.h"
#include "checkpoint/torch_save_writer.h"
#include "checkpoint/unpickler.h"
#include "checkpoint/zip_directory.h"
#include "compat/torch_archive.h"
#include "data/regular_file.h"
#include "shoal/checkpoint/dcp.h"
#include "shoal/checkpoint/sharded_checkpoint.h"
#include "shoal/error.h"
#include "shoal/log.h"

namespace shoal::checkpoint {
namespace {

std::string first_line(const char* text) {
  std::string s(text);
  const size_t nl = s.find('\n');
  return nl == std::string::npos ? s : s.substr(0, nl);
}

using detail::Checksum;
using detail::crc32_of;
using detail::kChecksumRecord;

/// An opened archive whose records are checked against the saved checksums as they are read: a
/// whole file, or the bytes [offset, offset + length) of one (a DCP blob), named `where` in errors.
class CheckedArchive {
 public:
  explicit CheckedArchive(const std::string& path) : CheckedArchive(path, path, 0, UINT64_MAX) {}

  CheckedArchive(const std::string& path, const std::string& where, uint64_t offset, uint64_t length)
      : path_(where) {
    const uint64_t file_bytes = data::detail::require_regular_file<CheckpointError>(path);
    length = std::min(length, file_bytes - std::min(offset, file_bytes));
    char magic[4] = {};
    std::ifstream file(path, std::ios::binary);
    file.seekg(static_cast<std::streamoff>(offset));
    file.read(magic, static_cast<std::streamsize>(std::min<uint64_t>(sizeof(magic), length)));
    SHOAL_CHECK_T(CheckpointError, static_cast<uint8_t>(magic[0]) != 0x80, where,
                  ": is in the legacy torch.save format (PyTorch < 1.6); re-save it with a newer "
                  "PyTorch (torch.save(torch.load(f), f))");
    SHOAL_CHECK_T(CheckpointError, std::memcmp(magic, "PK\x03\x04", 4) == 0, where,
                  ": is not a torch.save file (it does not start like a zip archive)");
    detail::check_declared_sizes(detail::ZipDirectory(path, offset, length), where);
    try {
      reader_ = offset == 0 && length == file_bytes
                    ? std::make_unique<compat::TorchArchiveReader>(path)
                    : std::make_unique<compat::TorchArchiveReader>(path, offset, length);
    } catch (const c10::Error& e) {
      SHOAL_THROW(CheckpointError, where, ": is truncated or corrupt (", length,
                  " bytes; the zip archive cannot be read: ", first_line(e.what_without_backtrace()), ")");
    }
    SHOAL_CHECK_T(CheckpointError, !reader_->has_record("constants.pkl"), where,
                  ": is a TorchScript archive (torch.jit.save); Shoal loads torch.save files");
    SHOAL_CHECK_T(CheckpointError, reader_->has_record("data.pkl"), where,
                  ": is a zip archive without data.pkl: not a torch.save file");
    if (reader_->has_record(kChecksumRecord)) {
      parse_manifest(raw(kChecksumRecord));
      has_manifest_ = true;
    }
    if (reader_->has_record("byteorder")) {
      const std::string order = read("byteorder");
      SHOAL_CHECK_T(CheckpointError, order == "little", where, ": was written on a ", order,
                    "-endian machine; Shoal reads little-endian files only");
    }
  }

  std::string read(const std::string& name) {
    std::string data = raw(name);
    if (!has_manifest_) return data;
    // Every record Shoal writes is listed: one left out was added or edited after saving.
    auto it = checksums_.find(name);
    SHOAL_CHECK_T(CheckpointError, it != checksums_.end(), path_, ": record '", name,
                  "' is not in the file's checksum manifest (", kChecksumRecord,
                  "), which lists every record Shoal writes: the file was edited or is damaged");
    SHOAL_CHECK_T(CheckpointError,
                  data.size() == it->second.size && crc32_of(data.data(), data.size()) == it->second.crc,
                  path_, ": record '", name, "' fails its checksum: the file is corrupt");
    return data;
  }

  bool has(const std::string& name) const { return reader_->has_record(name); }
  bool has_manifest() const { return has_manifest_; }

 private:
  void parse_manifest(const std::string& text) {
    checksums_ = detail::parse_checksum_manifest(text, path_);
  }

  std::string raw(const std::string& name) {
    try {
      return reader_->read(name);
    } catch (const c10::Error& e) {
      SHOAL_THROW(CheckpointError, path_, ": record '", name, "' cannot be read (truncated or corrupt: ",
                  first_line(e.what_without_backtrace()), ")");
    }
  }

  std::string path_;
  std::unique_ptr<compat::TorchArchiveReader> reader_;
  std::map<std::string, Checksum> checksums_;
  bool has_manifest_ = false;
};

}  // namespace

namespace detail {

void write_torch_save(const c10::IValue& object, const compat::TorchArchiveWriter::Sink& sink,
                      const std::string& where) {
  Pickler pickler;
  const std::string pickle = pickler.dump(object);
  std::string manifest;
  try {
    compat::TorchArchiveWriter writer(sink);
    auto put = [&](const std::string& name, const void* data, size_t size) {
      writer.write(name, data, size);
      manifest += manifest_line(name, size, crc32_of(data, size));
    };
    put("data.pkl", pickle.data(), pickle.size());
    put("byteorder", "little", 6);
    for (size_t i = 0; i < pickler.tensors().size(); ++i) {
      const at::Tensor& t = pickler.tensors()[i];
      put("data/" + std::to_string(i), t.data_ptr(), t.nbytes());
    }
    writer.write(kChecksumRecord, manifest.data(), manifest.size());
    writer.finish();
  } catch (const c10::Error& e) {
    SHOAL_THROW(CheckpointError, "cannot write ", where, ": ", first_line(e.what_without_backtrace()));
  }
}

TorchSaveSequence::Place TorchSaveSequence::append(const c10::IValue& object) {
  const int64_t start = written_;
  write_torch_save(
      object,
      [this](const void* data, size_t size) {
        const size_t taken = file_.append(data, size);
        written_ += static_cast<int64_t>(taken);
        return taken;
      },
      path_);
  return {start, written_ - start};
}

}  // namespace detail

void save(const c10::IValue& object, const std::string& path) {
  detail::AtomicFile file(path);
  detail::write_torch_save(
      object, [&file](const void* data, size_t size) { return file.append(data, size); }, path);
  file.commit();
}

namespace {

c10::IValue load_archive(CheckedArchive& archive, const std::string& path, const LoadOptions& options) {
  const std::string pickle = archive.read("data.pkl");
  auto load_storage = [&](const std::string& key, c10::ScalarType dtype, int64_t numel) {
    const std::string name = "data/" + key;
    SHOAL_CHECK_T(CheckpointError, archive.has(name), path, ": storage record '", name,
                  "' is missing: the file is corrupt");
    const std::string bytes = archive.read(name);
    // Check the size before allocating: a corrupt element count must not allocate terabytes.
    const size_t element_size = c10::elementSize(dtype);
    SHOAL_CHECK_T(CheckpointError, static_cast<uint64_t>(numel) <= bytes.size() / element_size, path,
                  ": storage record '", name, "' holds ", bytes.size(), " bytes, fewer than its ", numel,
                  " elements of ", c10::toString(dtype), " need: the file is corrupt");
    at::Tensor storage = at::empty({numel}, at::TensorOptions().dtype(dtype));
    std::memcpy(storage.data_ptr(), bytes.data(), storage.nbytes());
    if (options.map_location.type() != c10::kCPU) storage = storage.to(options.map_location);
    return storage;
  };
  detail::Unpickler::Limits limits;
  limits.max_values = options.max_values;
  limits.max_container_bytes = options.max_container_bytes;
  limits.allow_expanded_views = options.allow_expanded_views;
  detail::Unpickler unpickler(pickle, load_storage, path + ": data.pkl", limits);
  c10::IValue object = unpickler.load();
  // Shoal writes a manifest into every file: one that says Shoal wrote it but has none lost it
  // after saving, and its tensors would load unchecked.
  if (!archive.has_manifest() && object.isGenericDict()) {
    const auto dict = object.toGenericDict();
    auto version = dict.find(c10::IValue(std::string("shoal_version")));
    SHOAL_CHECK_T(CheckpointError, version == dict.end(), path, ": says Shoal ",
                  version->value().isString() ? version->value().toStringRef() : std::string("?"),
                  " wrote it (shoal_version) but has no checksum manifest (", kChecksumRecord,
                  "), which Shoal writes into every file: it was edited or damaged after saving, and "
                  "its tensors cannot be checked");
  }
  return object;
}

}  // namespace

c10::IValue load(const std::string& path, const LoadOptions& options) {
  CheckedArchive archive(path);
  return load_archive(archive, path, options);
}

namespace detail {

c10::IValue load_torch_save_blob(const std::string& path, uint64_t offset, uint64_t length,
                                 const LoadOptions& options) {
  const std::string where = path + " (bytes " + std::to_string(offset) + "+" + std::to_string(length) + ")";
  CheckedArchive archive(path, where, offset, length);
  return load_archive(archive, where, options);
}

}  // namespace detail

c10::IValue state_dict_to_ivalue(const StateDict& state) {
  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& item : state) dict.insert(item.key(), item.value());
  return dict;
}

StateDict state_dict_from_ivalue(const c10::IValue& object, const std::string& where) {
  SHOAL_CHECK_T(CheckpointError, object.isGenericDict(), where, ": holds a ", object.tagKind(),
                " where a state dict (name -> tensor) was expected");
  const auto dict = object.toGenericDict();
  for (const char* key : {"model", "model_state_dict", "state_dict"}) {
    auto it = dict.find(c10::IValue(std::string(key)));
    if (it != dict.end() && it->value().isGenericDict()) return state_dict_from_ivalue(it->value(), where);
  }
  StateDict out;
  for (const auto& item : dict) {
    SHOAL_CHECK_T(CheckpointError, item.key().isString(), where,
                  ": a state dict key is not a string");
    SHOAL_CHECK_T(CheckpointError, item.value().isTensor(), where, ": state dict entry '",
                  item.key().toStringRef(), "' is a ", item.value().tagKind(), ", not a tensor");
    out.insert(item.key().toStringRef(), item.value().toTensor());
  }
  if (all_keys_have_prefix(out, kWrapperPrefix)) out = strip_prefix(out, kWrapperPrefix);
  return out;
}

void save_state_dict(const StateDict& state, const std::string& path) {
  save(state_dict_to_ivalue(state), path);
}

StateDict load_state_dict_file(const std::string& path, const LoadOptions& options) {
  if (is_sharded_dcp_folder(path, options)) return load_sharded_dcp(path, options).model;
  if (is_dcp_folder(path)) {
    DcpContents dcp = load_dcp(path, options);
    if (!dcp.skipped.empty()) {
      log::info("shoal: ", path, ": left out ", dcp.skipped.size(), " non-tensor entries of the DCP checkpoint (",
                dcp.skipped.front(), dcp.skipped.size() > 1 ? ", ..." : "", ")");
    }
    return dcp_model_entries(dcp);
  }
  if (is_directory(path)) return load_sharded_checkpoint(path, options).model;
  return state_dict_from_ivalue(load(path, options), path);
}

void save_training_state(const TrainingState& state, const std::string& path) {
  save(to_ivalue(state), path);
}

TrainingState load_training_state(const std::string& path, const LoadOptions& options) {
  if (is_directory(path)) return load_sharded_checkpoint(path, options);
  return training_state_from_ivalue(load(path, options), path);
}

}  // namespace shoal::checkpoint
