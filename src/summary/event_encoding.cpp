#include "summary/event_encoding.h"

#include <array>
#include <cstring>

namespace shoal::summary {
namespace {

/// The CRC-32C table for the reflected polynomial 0x82f63b78, built once.
const std::array<uint32_t, 256>& crc_table() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t crc = i;
      for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ ((crc & 1) ? 0x82f63b78u : 0);
      t[i] = crc;
    }
    return t;
  }();
  return table;
}

/// Protocol-buffer wire format, writing side: field keys, varints, fixed 32/64-bit values and
/// length-delimited bytes (strings and nested messages).
class Encoder {
 public:
  void varint(uint64_t value) {
    while (value >= 0x80) {
      out_ += static_cast<char>((value & 0x7f) | 0x80);
      value >>= 7;
    }
    out_ += static_cast<char>(value);
  }
  void key(int field, int wire_type) { varint(static_cast<uint64_t>(field) << 3 | wire_type); }
  void int64_field(int field, int64_t value) {
    key(field, 0);
    varint(static_cast<uint64_t>(value));  // negative int64: ten bytes, as protobuf does
  }
  void double_field(int field, double value) {
    key(field, 1);
    fixed(&value, 8);
  }
  void float_field(int field, float value) {
    key(field, 5);
    fixed(&value, 4);
  }
  void bytes_field(int field, const std::string& bytes) {
    key(field, 2);
    varint(bytes.size());
    out_ += bytes;
  }
  void packed_doubles(int field, const std::vector<double>& values) {
    key(field, 2);
    varint(values.size() * 8);
    for (const double v : values) fixed(&v, 8);
  }
  const std::string& str() const { return out_; }

 private:
  // Little-endian on the wire; x86-64 and AArch64 Linux are little-endian already.
  void fixed(const void* value, size_t size) { out_.append(static_cast<const char*>(value), size); }
  std::string out_;
};

std::string event(double wall_time, int64_t step, const std::string& summary) {
  Encoder e;
  e.double_field(1, wall_time);
  if (step != 0) e.int64_field(2, step);
  e.bytes_field(5, summary);
  return e.str();
}

/// A Summary holding one Value.
std::string summary_of(const std::string& value) {
  Encoder e;
  e.bytes_field(1, value);
  return e.str();
}

}  // namespace

uint32_t crc32c(const void* data, size_t size) {
  const auto& table = crc_table();
  const auto* bytes = static_cast<const unsigned char*>(data);
  uint32_t crc = 0xffffffffu;
  for (size_t i = 0; i < size; ++i) crc = table[(crc ^ bytes[i]) & 0xff] ^ (crc >> 8);
  return crc ^ 0xffffffffu;
}

uint32_t masked_crc32c(const void* data, size_t size) {
  const uint32_t crc = crc32c(data, size);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::string tfrecord(const std::string& payload) {
  const uint64_t length = payload.size();
  char header[8];
  std::memcpy(header, &length, 8);
  const uint32_t length_crc = masked_crc32c(header, 8);
  const uint32_t data_crc = masked_crc32c(payload.data(), payload.size());
  std::string record;
  record.reserve(payload.size() + 16);
  record.append(header, 8);
  record.append(reinterpret_cast<const char*>(&length_crc), 4);
  record += payload;
  record.append(reinterpret_cast<const char*>(&data_crc), 4);
  return record;
}

std::string file_version_event(double wall_time) {
  Encoder e;
  e.double_field(1, wall_time);
  e.bytes_field(3, "brain.Event:2");
  return e.str();
}

std::string scalar_event(const std::string& tag, float value, int64_t step, double wall_time) {
  Encoder v;
  v.bytes_field(1, tag);
  v.float_field(2, value);
  return event(wall_time, step, summary_of(v.str()));
}

std::string histogram_event(const std::string& tag, const Histogram& histogram, int64_t step,
                            double wall_time) {
  Encoder h;
  h.double_field(1, histogram.min);
  h.double_field(2, histogram.max);
  h.double_field(3, histogram.num);
  h.double_field(4, histogram.sum);
  h.double_field(5, histogram.sum_squares);
  h.packed_doubles(6, histogram.bucket_limit);
  h.packed_doubles(7, histogram.bucket);
  Encoder v;
  v.bytes_field(1, tag);
  v.bytes_field(5, h.str());
  return event(wall_time, step, summary_of(v.str()));
}

std::string text_event(const std::string& tag, const std::string& text, int64_t step,
                       double wall_time) {
  Encoder plugin;
  plugin.bytes_field(1, "text");
  Encoder metadata;
  metadata.bytes_field(1, plugin.str());
  Encoder dim;
  dim.int64_field(1, 1);
  Encoder shape;
  shape.bytes_field(2, dim.str());
  Encoder tensor;
  tensor.int64_field(1, 7);  // DT_STRING
  tensor.bytes_field(2, shape.str());
  tensor.bytes_field(8, text);
  Encoder v;
  v.bytes_field(1, tag);
  v.bytes_field(8, tensor.str());
  v.bytes_field(9, metadata.str());
  return event(wall_time, step, summary_of(v.str()));
}

}  // namespace shoal::summary
