// TensorBoard's event files, written without a protobuf library: the TFRecord framing (length,
// masked CRC-32C of the length, data, masked CRC-32C of the data) around serialized
// tensorflow.Event messages, of which only the few fields a SummaryWriter uses are encoded:
//
//   Event          wall_time=1 (double), step=2 (int64), file_version=3 (string), summary=5
//   Summary        value=1 (repeated Summary.Value)
//   Summary.Value  tag=1, simple_value=2 (float), histo=5 (HistogramProto), tensor=8, metadata=9
//   HistogramProto min=1 max=2 num=3 sum=4 sum_squares=5 (double), bucket_limit=6 bucket=7 (packed)
//   SummaryMetadata plugin_data=1 (PluginData: plugin_name=1, content=2)
//   TensorProto    dtype=1 (DT_STRING = 7), tensor_shape=2 (dim=2: size=1), string_val=8
//
// Why not libprotobuf and protoc (Debian's libprotobuf-dev 3.21 is there, protoc is not): the
// files need nine small message types and only the writing side, whose wire format is the ~100
// lines of event_encoding.cpp; protoc-generated code would add the compiler to the build,
// TensorBoard's .proto files to the tree, and a second libprotobuf beside the one PyTorch's
// wheels carry inside LibTorch 2.x (a symbol clash waiting on that leg). TensorBoard's own reader
// checks what this writes (tests/summary/tensorboard_ddp.py).
//
// Thread safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shoal::summary {

/// CRC-32C (Castagnoli) of `size` bytes, as TFRecord and LevelDB use it.
uint32_t crc32c(const void* data, size_t size);
/// TFRecord's masked CRC: the CRC rotated right by 15 bits plus 0xa282ead8 (so that a CRC of data
/// holding CRCs stays strong).
uint32_t masked_crc32c(const void* data, size_t size);

/// One TFRecord: 8-byte little-endian length, its masked CRC, the bytes, their masked CRC.
std::string tfrecord(const std::string& payload);

/// A histogram as TensorBoard's HistogramProto holds it: `bucket[i]` values in
/// (bucket_limit[i-1], bucket_limit[i]].
struct Histogram {
  double min = 0, max = 0, num = 0, sum = 0, sum_squares = 0;
  std::vector<double> bucket_limit;
  std::vector<double> bucket;
};

/// Serialized Event messages.
std::string file_version_event(double wall_time);
std::string scalar_event(const std::string& tag, float value, int64_t step, double wall_time);
std::string histogram_event(const std::string& tag, const Histogram& histogram, int64_t step,
                            double wall_time);
/// A string tensor of shape [1] for TensorBoard's text plugin (what add_text writes).
std::string text_event(const std::string& tag, const std::string& text, int64_t step,
                       double wall_time);

}  // namespace shoal::summary
