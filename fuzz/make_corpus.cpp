// Writes the seed corpora of the fuzz targets (fuzz/corpus/<target>/) with Shoal's own encoders,
// so that every target starts from valid inputs and mutates from there:
//
//   build-fuzz/make_corpus fuzz/corpus      (scripts/fuzz.sh --make-corpus)
//
// The files are committed; rerun this when a wire or file format changes.
#include <sys/stat.h>
#include <zlib.h>

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>
#include <zmq.hpp>

#include "checkpoint/checksum_manifest.h"
#include "checkpoint/pickler.h"
#include "comm/tcp_store_wire.h"
#include "compat/torch_archive.h"
#include "pipeline/stage_header.h"
#include "ps/auth.h"
#include "ps/message.h"

namespace {

std::string g_root;

void write_file(const std::string& target, const std::string& name, const void* data, size_t size) {
  const std::string dir = g_root + "/" + target;
  ::mkdir(dir.c_str(), 0755);
  std::ofstream(dir + "/" + name, std::ios::binary).write(static_cast<const char*>(data), size);
}
void write_file(const std::string& target, const std::string& name, const std::string& bytes) {
  write_file(target, name, bytes.data(), bytes.size());
}

std::string frame(const std::vector<uint8_t>& body) {
  std::vector<uint8_t> out;
  shoal::comm::wire::put_u32(out, static_cast<uint32_t>(body.size()));
  out.insert(out.end(), body.begin(), body.end());
  return std::string(out.begin(), out.end());
}

void store_wire() {
  namespace wire = shoal::comm::wire;
  std::vector<uint8_t> set{wire::kSet};
  wire::put_string(set, "shoal/gloo/peer/0");
  wire::put_bytes(set, "node1 4242", 10);
  std::vector<uint8_t> get{wire::kGet};
  wire::put_string(get, "shoal/gloo/peer/0");
  std::vector<uint8_t> add{wire::kAdd};
  wire::put_string(add, "barrier");
  wire::put_i64(add, 1);
  std::vector<uint8_t> check{wire::kCheck};
  wire::put_u32(check, 2);
  wire::put_string(check, "a");
  wire::put_string(check, "b");
  std::vector<uint8_t> del{wire::kDelete};
  wire::put_string(del, "a");
  write_file("fuzz_store_wire", "set_get", frame(set) + frame(get));
  write_file("fuzz_store_wire", "add_check_delete", frame(add) + frame(check) + frame(del));
}

// Sends `message` through a PAIR socket and writes what arrives in fuzz_ps_message's framing.
void ps_message(const std::string& name, shoal::ps::OutMessage message, bool router) {
  zmq::context_t context;
  zmq::socket_t in(context, zmq::socket_type::pair), out(context, zmq::socket_type::pair);
  in.bind("inproc://corpus");
  out.connect("inproc://corpus");
  if (!shoal::ps::send_message(out, router ? "worker-1" : "", message)) std::abort();
  std::string bytes(1, router ? '\1' : '\0');
  zmq::message_t part;
  do {
    if (!in.recv(part)) std::abort();
    const uint16_t length = static_cast<uint16_t>(part.size());
    bytes.append(reinterpret_cast<const char*>(&length), 2);
    bytes.append(static_cast<const char*>(part.data()), part.size());
  } while (part.more());
  write_file("fuzz_ps_message", name, bytes);
}

void ps_messages() {
  using shoal::ps::MessageType;
  using shoal::ps::OutMessage;
  ps_message("hello", OutMessage(MessageType::kHello, 1, 1), true);
  OutMessage auth(MessageType::kAuth, 1, 2);
  const auto answer = shoal::ps::auth_response("token", shoal::ps::Challenge{});
  auth.blob.assign(reinterpret_cast<const char*>(answer.data()), answer.size());
  ps_message("auth", auth, true);
  OutMessage push(MessageType::kPush, 1, 3);
  push.header.clock = 7;
  push.keys = {{0, 0, 0, 4}, {1, 0, 4, 2}};
  push.tensors = {at::arange(4, at::kFloat), at::ones({2}, at::kFloat)};
  ps_message("push", push, true);
  OutMessage params(MessageType::kParams, 0, 3);
  params.header.version = 5;
  params.keys = {{2, 0, 0, 3}};
  params.tensors = {at::full({3}, 0.5, at::kFloat)};
  ps_message("params", params, false);
  OutMessage sum(MessageType::kSum, 1, 4);
  const double values[2] = {1.5, 2.0};
  sum.blob.assign(reinterpret_cast<const char*>(values), sizeof values);
  ps_message("sum", sum, true);
  OutMessage error(MessageType::kError, 0, 4);
  error.blob = "worker 1: unknown key 9";
  ps_message("error", error, false);
}

void stage_headers() {
  using shoal::pipeline::StageHeader;
  int64_t words[StageHeader::kWords];
  StageHeader activation;
  activation.step = 3;
  activation.micro_batch = 1;
  activation.sizes = {8, 16};
  activation.encode(words);
  write_file("fuzz_stage_header", "activation", words, sizeof words);
  StageHeader gradient = activation;
  gradient.kind = StageHeader::Kind::kGradient;
  gradient.dtype = at::kBFloat16;
  gradient.sizes = {2, 3, 4, 5};
  gradient.encode(words);
  write_file("fuzz_stage_header", "gradient", words, sizeof words);
  StageHeader error;
  error.kind = StageHeader::Kind::kError;
  error.error_bytes = 42;
  error.encode(words);
  write_file("fuzz_stage_header", "error", words, sizeof words);
}

// A small torch.save-like archive as shoal::checkpoint::save writes it.
std::string checkpoint_archive(std::string* pickle_out, std::string* manifest_out) {
  auto dict = c10::impl::GenericDict(c10::StringType::get(), c10::TensorType::get());
  dict.insert("fc.weight", at::arange(6, at::kFloat).reshape({2, 3}));
  dict.insert("fc.bias", at::zeros({2}, at::kFloat));
  shoal::checkpoint::detail::Pickler pickler;
  const std::string pickle = pickler.dump(c10::IValue(dict));
  std::string bytes, manifest;
  {
    shoal::compat::TorchArchiveWriter writer([&bytes](const void* data, size_t size) {
      bytes.append(static_cast<const char*>(data), size);
      return size;
    });
    auto put = [&](const std::string& name, const void* data, size_t size) {
      writer.write(name, data, size);
      manifest += shoal::checkpoint::detail::manifest_line(
          name, size, shoal::checkpoint::detail::crc32_of(data, size));
    };
    put("data.pkl", pickle.data(), pickle.size());
    put("byteorder", "little", 6);
    for (size_t i = 0; i < pickler.tensors().size(); ++i) {
      const at::Tensor& t = pickler.tensors()[i];
      put("data/" + std::to_string(i), t.data_ptr(), t.nbytes());
    }
    writer.write(shoal::checkpoint::detail::kChecksumRecord, manifest.data(), manifest.size());
    writer.finish();
  }
  *pickle_out = pickle;
  *manifest_out = manifest;
  return bytes;
}

void checkpoints() {
  std::string pickle, manifest;
  write_file("fuzz_zip_directory", "state_dict.pt", checkpoint_archive(&pickle, &manifest));
  write_file("fuzz_unpickler", "state_dict.pkl", pickle);
  write_file("fuzz_checksum_manifest", "state_dict", manifest);
  // A training state: nested containers, strings, numbers.
  auto inner = c10::impl::GenericList(c10::AnyType::get());
  inner.push_back(c10::IValue(int64_t{3}));
  inner.push_back(c10::IValue(0.25));
  inner.push_back(c10::IValue(std::string("sgd")));
  auto state = c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get());
  state.insert("epoch", c10::IValue(int64_t{2}));
  state.insert("optimizer", c10::IValue(inner));
  state.insert("momentum", c10::IValue(at::ones({3}, at::kFloat)));
  shoal::checkpoint::detail::Pickler pickler;
  write_file("fuzz_unpickler", "training_state.pkl", pickler.dump(c10::IValue(state)));
}

std::string idx(uint32_t magic, const std::vector<uint32_t>& dims, const std::vector<uint8_t>& body) {
  std::string out;
  auto be32 = [&](uint32_t v) {
    for (int s = 24; s >= 0; s -= 8) out.push_back(static_cast<char>(v >> s));
  };
  be32(magic);
  for (uint32_t d : dims) be32(d);
  out.append(body.begin(), body.end());
  return out;
}

std::string gzip(const std::string& raw) {
  z_stream z{};
  if (deflateInit2(&z, 9, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) != Z_OK) std::abort();
  std::string out(compressBound(raw.size()) + 64, '\0');
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(raw.data()));
  z.avail_in = static_cast<uInt>(raw.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  if (deflate(&z, Z_FINISH) != Z_STREAM_END) std::abort();
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

void idx_files() {
  std::vector<uint8_t> pixels(2 * 28 * 28);
  for (size_t i = 0; i < pixels.size(); ++i) pixels[i] = static_cast<uint8_t>(i * 7);
  const std::string images = idx(2051, {2, 28, 28}, pixels);
  const std::string labels = idx(2049, {3}, {1, 9, 0});
  write_file("fuzz_idx_reader", "images.idx", images);
  write_file("fuzz_idx_reader", "images.idx.gz", gzip(images));
  write_file("fuzz_idx_reader", "labels.idx", labels);
  write_file("fuzz_idx_reader", "labels.idx.gz", gzip(labels));
}

std::string base64(const std::string& bytes) {
  static const char kDigits[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  for (size_t i = 0; i < bytes.size(); i += 3) {
    uint32_t bits = static_cast<uint8_t>(bytes[i]) << 16;
    if (i + 1 < bytes.size()) bits |= static_cast<uint8_t>(bytes[i + 1]) << 8;
    if (i + 2 < bytes.size()) bits |= static_cast<uint8_t>(bytes[i + 2]);
    for (size_t k = 0; k < 4; ++k) {
      out.push_back(i + k <= bytes.size() ? kDigits[(bits >> (18 - 6 * k)) & 0x3F] : '=');
    }
  }
  return out;
}

/// GPT-2's bytes_to_unicode() character of each byte, as UTF-8 (encoder.json's keys).
std::string gpt2_key(const std::string& token) {
  std::string out;
  for (const char c : token) {
    const auto byte = static_cast<uint8_t>(c);
    uint32_t character = byte;
    if (!((byte >= '!' && byte <= '~') || (byte >= 0xA1 && byte <= 0xAC) || byte >= 0xAE)) {
      character = 256;
      for (uint32_t b = 0; b < byte; ++b) {
        if (!((b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE)) ++character;
      }
    }
    if (character < 0x80) {
      out.push_back(static_cast<char>(character));
    } else {
      out.push_back(static_cast<char>(0xC0 | character >> 6));
      out.push_back(static_cast<char>(0x80 | (character & 0x3F)));
    }
  }
  return out;
}

/// A small consistent GPT-2 vocabulary (every byte, then a few merges whose parts come first)
/// in both formats, and the same spoiled the ways a hostile file could be.
void gpt2_vocabularies() {
  std::vector<std::string> tokens;
  for (int byte = 0; byte < 256; ++byte) tokens.emplace_back(1, static_cast<char>(byte));
  for (const char* merged : {"he", "th", "the", " t", " the", "in", "er", " a", "ll", "aa", "aaaa", "'s", "12"}) {
    tokens.emplace_back(merged);
  }
  const auto lines = [&](const std::vector<std::string>& list) {
    std::string out;
    for (size_t rank = 0; rank < list.size(); ++rank) out += base64(list[rank]) + " " + std::to_string(rank) + "\n";
    return out;
  };
  std::string json = "{";
  for (size_t rank = 0; rank < tokens.size(); ++rank) {
    std::string key = gpt2_key(tokens[rank]);
    std::string escaped;
    for (const char c : key) escaped += c == '"' || c == '\\' ? std::string("\\") + c : std::string(1, c);
    json += "\"" + escaped + "\": " + std::to_string(rank) + ", ";
  }
  json += "\"<|endoftext|>\": " + std::to_string(tokens.size()) + "}";
  const std::string valid = lines(tokens);
  write_file("fuzz_gpt2_vocab", "small.tiktoken", valid);
  write_file("fuzz_gpt2_vocab", "small_encoder.json", json);
  write_file("fuzz_gpt2_vocab", "bad_base64.tiktoken", valid + "aGU*bA== 269\n");
  write_file("fuzz_gpt2_vocab", "duplicate_rank.tiktoken", valid + base64("ing") + " 260\n");
  write_file("fuzz_gpt2_vocab", "huge_rank.tiktoken", valid + base64("ing") + " 99999\n");
  write_file("fuzz_gpt2_vocab", "long_token.tiktoken", valid + base64(std::string(300, 'a')) + " 269\n");
  std::vector<std::string> reversed = tokens;  // merges ranked before their parts
  std::reverse(reversed.begin(), reversed.end());
  write_file("fuzz_gpt2_vocab", "reversed.tiktoken", lines(reversed));
  write_file("fuzz_gpt2_vocab", "deep.json", "{\"a\": " + std::string(5000, '[') + std::string(5000, ']') + "}");
  write_file("fuzz_gpt2_vocab", "unterminated.json", json.substr(0, json.size() / 2));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_corpus DIR\n");
    return 2;
  }
  g_root = argv[1];
  ::mkdir(g_root.c_str(), 0755);
  store_wire();
  ps_messages();
  stage_headers();
  checkpoints();
  idx_files();
  gpt2_vocabularies();
  return 0;
}
