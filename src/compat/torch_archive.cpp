#include "compat/torch_archive.h"

#include <caffe2/serialize/inline_container.h>

namespace shoal::compat {

TorchArchiveReader::TorchArchiveReader(const std::string& path)
    : reader_(std::make_unique<caffe2::serialize::PyTorchStreamReader>(path)) {}

TorchArchiveReader::~TorchArchiveReader() = default;

bool TorchArchiveReader::has_record(const std::string& name) const {
  return reader_->hasRecord(name);
}

std::vector<std::string> TorchArchiveReader::records() const { return reader_->getAllRecords(); }

std::string TorchArchiveReader::read(const std::string& name) const {
  auto [data, size] = reader_->getRecord(name);
  return std::string(static_cast<const char*>(data.get()), size);
}

TorchArchiveWriter::TorchArchiveWriter(Sink sink)
    : writer_(std::make_unique<caffe2::serialize::PyTorchStreamWriter>(std::move(sink))) {}

TorchArchiveWriter::~TorchArchiveWriter() = default;

void TorchArchiveWriter::write(const std::string& name, const void* data, size_t size) {
  writer_->writeRecord(name, data, size);
}

void TorchArchiveWriter::finish() { writer_->writeEndOfFile(); }

}  // namespace shoal::compat
