#include "shoal/data/tokenize.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <algorithm>
#include <cstring>
#include <memory>

#include "checkpoint/atomic_file.h"
#include "data/gpt2_bpe.h"
#include "shoal/error.h"

namespace shoal::data {
namespace {

using checkpoint::detail::AtomicFile;

// Bytes read from the text at a time: large enough that a read costs little per byte, small
// enough that the tokenizer's memory does not depend on the text.
constexpr size_t kReadBytes = size_t{1} << 20;
constexpr int64_t kByteVocabulary = 256;

/// The size of the regular file `path`; throws DataError naming it otherwise.
int64_t text_size(const std::string& path) {
  struct stat info {};
  SHOAL_CHECK_T(DataError, ::stat(path.c_str(), &info) == 0, "input ", path, ": cannot read: ",
                std::strerror(errno));
  SHOAL_CHECK_T(DataError, S_ISREG(info.st_mode), "input ", path, " is not a regular file");
  return static_cast<int64_t>(info.st_size);
}

void check_options(const TokenizeOptions& options) {
  SHOAL_CHECK_T(InvalidArgument, options.encoding == "byte" || options.encoding == "gpt2",
                "--encoding ", options.encoding, " is not byte or gpt2");
  SHOAL_CHECK_T(InvalidArgument, options.encoding == "byte" || !options.vocab.empty(),
                "--encoding gpt2 needs --vocab FILE, GPT-2's vocabulary in tiktoken's format "
                "(gpt2.tiktoken; scripts/setup.sh puts it in ~/.cache/shoal)");
  SHOAL_CHECK_T(InvalidArgument, options.encoding == "gpt2" || options.vocab.empty(),
                "--vocab is for --encoding gpt2; byte encoding has no vocabulary file");
  SHOAL_CHECK_T(InvalidArgument, !options.inputs.empty(), "no --input text to tokenize");
  SHOAL_CHECK_T(InvalidArgument, !options.output.empty(), "no --output token file");
  if (options.val_output.empty()) return;
  SHOAL_CHECK_T(InvalidArgument, options.val_output != options.output, "--val-output ",
                options.val_output, " is also --output; name two files");
  SHOAL_CHECK_T(InvalidArgument, options.val_fraction > 0 && options.val_fraction < 1,
                "--val-fraction ", options.val_fraction, " is outside (0, 1)");
}

/// Streams byte tokens into the training file, then, past `train_tokens`, the validation file.
class ByteTokenWriter {
 public:
  ByteTokenWriter(AtomicFile& train, AtomicFile* val, int64_t train_tokens)
      : train_(train), val_(val), train_left_(train_tokens) {}
  void write(const unsigned char* bytes, size_t count) {
    tokens_.resize(count * 2);
    for (size_t i = 0; i < count; ++i) {  // uint16 little-endian: the byte, then 0
      tokens_[2 * i] = bytes[i];
      tokens_[2 * i + 1] = 0;
    }
    const size_t to_train = std::min(count, static_cast<size_t>(train_left_));
    train_.append(tokens_.data(), to_train * 2);
    train_left_ -= static_cast<int64_t>(to_train);
    if (to_train < count) val_->append(tokens_.data() + to_train * 2, (count - to_train) * 2);
  }

 private:
  AtomicFile& train_;
  AtomicFile* val_;
  int64_t train_left_;
  std::vector<unsigned char> tokens_;
};

/// Feeds exactly `size` bytes of `path` to `consume(bytes, count)`; throws DataError naming the file.
template <typename Consume>
void stream_text(const std::string& path, int64_t size, Consume&& consume) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  SHOAL_CHECK_T(DataError, fd >= 0, "input ", path, ": cannot open: ", std::strerror(errno));
  std::unique_ptr<int, void (*)(int*)> closer(new int(fd), [](int* f) { ::close(*f); delete f; });
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  std::vector<unsigned char> buffer(kReadBytes);
  for (int64_t left = size; left > 0;) {
    const ssize_t n = ::read(fd, buffer.data(), std::min(buffer.size(), static_cast<size_t>(left)));
    if (n < 0 && errno == EINTR) continue;
    SHOAL_CHECK_T(DataError, n >= 0, "input ", path, ": read failed: ", std::strerror(errno));
    SHOAL_CHECK_T(DataError, n > 0, "input ", path, " shrank from ", size, " bytes while it was read");
    consume(buffer.data(), static_cast<size_t>(n));
    left -= n;
  }
}

/// Writes uint16 ids little-endian to a file, a buffer at a time, and counts them.
class IdWriter {
 public:
  explicit IdWriter(AtomicFile* file) : file_(file) {}
  void write(const uint16_t* ids, size_t count) {
    for (size_t i = 0; i < count; ++i) {
      buffer_.push_back(static_cast<unsigned char>(ids[i] & 0xFF));
      buffer_.push_back(static_cast<unsigned char>(ids[i] >> 8));
    }
    written_ += static_cast<int64_t>(count);
    if (buffer_.size() >= kReadBytes) flush();
  }
  void flush() {
    if (file_ != nullptr) file_->append(buffer_.data(), buffer_.size());
    buffer_.clear();
  }
  int64_t written() const { return written_; }

 private:
  AtomicFile* file_;
  std::vector<unsigned char> buffer_;
  int64_t written_ = 0;
};

/// GPT-2's BPE over the text, cut for validation at byte `split` (moved on to the start of the
/// next character), each side encoded on its own as nanoGPT's prepare.py splits text.
class Gpt2Split {
 public:
  Gpt2Split(const detail::Gpt2Vocabulary& vocabulary, IdWriter& train, IdWriter& val, int64_t split)
      : train_(vocabulary, [&train](const uint16_t* ids, size_t n) { train.write(ids, n); }),
        val_(vocabulary, [&val](const uint16_t* ids, size_t n) { val.write(ids, n); }),
        split_(split) {}

  void feed(const unsigned char* bytes, size_t count, const std::string& source) {
    size_t cut = count;
    if (!in_val_ && offset_ + static_cast<int64_t>(count) > split_) {
      cut = static_cast<size_t>(std::max<int64_t>(split_ - offset_, 0));
      while (cut < count && (bytes[cut] & 0xC0) == 0x80) ++cut;  // a continuation byte
    }
    offset_ += static_cast<int64_t>(count);
    const auto* text = reinterpret_cast<const char*>(bytes);
    if (in_val_) return val_.feed(text, count, source);
    train_.feed(text, cut, source);
    if (cut == count) return;
    train_.finish(source);
    in_val_ = true;
    val_.feed(text + cut, count - cut, source);
  }

  void finish(const std::string& source) {
    if (in_val_) return val_.finish(source);
    train_.finish(source);
  }

 private:
  detail::Gpt2Encoder train_, val_;
  int64_t split_;
  int64_t offset_ = 0;
  bool in_val_ = false;
};

TokenizeSummary tokenize_gpt2(const TokenizeOptions& options, const std::vector<int64_t>& sizes, int64_t total) {
  const detail::Gpt2Vocabulary vocabulary = detail::Gpt2Vocabulary::load(options.vocab);
  AtomicFile train(options.output);
  std::unique_ptr<AtomicFile> val;
  if (!options.val_output.empty()) val = std::make_unique<AtomicFile>(options.val_output);
  IdWriter train_ids(&train);
  IdWriter val_ids(val.get());
  const int64_t split = val ? static_cast<int64_t>(std::floor(static_cast<double>(total) * (1 - options.val_fraction)))
                            : total;
  Gpt2Split encoder(vocabulary, train_ids, val_ids, split);
  for (size_t i = 0; i < options.inputs.size(); ++i) {
    const std::string& input = options.inputs[i];
    detail::Utf8Checker utf8;  // each file is UTF-8 on its own
    stream_text(input, sizes[i], [&](const unsigned char* bytes, size_t count) {
      utf8.check(bytes, count, input);
      encoder.feed(bytes, count, input);
    });
    utf8.finish(input);
  }
  encoder.finish(options.inputs.back());
  TokenizeSummary summary;
  summary.vocab_size = vocabulary.size();
  summary.train_tokens = train_ids.written();
  summary.val_tokens = val_ids.written();
  if (val) {
    SHOAL_CHECK_T(InvalidArgument, summary.train_tokens > 0 && summary.val_tokens > 0, "--val-fraction ",
                  options.val_fraction, " of ", summary.train_tokens + summary.val_tokens,
                  " tokens leaves the training or the validation file empty");
  }
  train_ids.flush();
  val_ids.flush();
  train.commit();
  if (val) val->commit();
  return summary;
}

}  // namespace

TokenizeSummary tokenize_text(const TokenizeOptions& options) {
  check_options(options);
  std::vector<int64_t> sizes;
  int64_t total = 0;
  for (const std::string& input : options.inputs) total += sizes.emplace_back(text_size(input));
  SHOAL_CHECK_T(DataError, total > 0, "input ", options.inputs.front(),
                options.inputs.size() > 1 ? " and the others are" : " is", " empty: no text to tokenize");
  if (options.encoding == "gpt2") return tokenize_gpt2(options, sizes, total);
  TokenizeSummary summary;
  summary.vocab_size = kByteVocabulary;
  summary.train_tokens = options.val_output.empty()
                             ? total
                             : static_cast<int64_t>(std::floor(static_cast<double>(total) * (1 - options.val_fraction)));
  summary.val_tokens = total - summary.train_tokens;
  if (!options.val_output.empty()) {
    SHOAL_CHECK_T(InvalidArgument, summary.train_tokens > 0 && summary.val_tokens > 0,
                  "--val-fraction ", options.val_fraction, " of ", total,
                  " tokens leaves the training or the validation file empty");
  }
  AtomicFile train(options.output);
  std::unique_ptr<AtomicFile> val;
  if (!options.val_output.empty()) val = std::make_unique<AtomicFile>(options.val_output);
  ByteTokenWriter writer(train, val.get(), summary.train_tokens);
  for (size_t i = 0; i < options.inputs.size(); ++i) {
    stream_text(options.inputs[i], sizes[i],
                [&writer](const unsigned char* bytes, size_t count) { writer.write(bytes, count); });
  }
  train.commit();
  if (val) val->commit();
  return summary;
}

}  // namespace shoal::data
