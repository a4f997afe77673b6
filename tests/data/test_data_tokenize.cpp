// `shoal data tokenize` and `shoal data inspect`, run as a user runs them: byte-level token files
// that read back as the text's bytes, split train/validation at the text's end, written atomically;
// bad inputs and options are one line naming the file or flag; and the real corpus (the fortunes
// databases of Debian's `fortunes` package) tokenized and read back as blocks.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "data/gpt2_bpe.h"
#include "shoal/data/token_block_dataset.h"
#include "shoal/data/token_file.h"
#include "shoal/data/tokenize.h"
#include "testing/dependencies.h"
#include "testing/multi_rank.h"
#include "testing/python.h"

namespace shoal::data {
namespace test_data_tokenize {

namespace fs = std::filesystem;

// Where Debian's `fortunes` package puts its English databases (text, fortunes split by "%").
constexpr const char* kFortunesDir = "/usr/share/games/fortunes";

std::string shoal_cli() {
  const char* dir = std::getenv("SHOAL_BINARY_DIR");
  if (dir == nullptr) testing::skip_program("SHOAL_BINARY_DIR is not set (run through ctest)");
  return std::string(dir) + "/apps/shoal/shoal";
}

testing::PythonResult shoal(const std::string& arguments) {
  return testing::run_command(shoal_cli() + " " + arguments);
}

std::string write_text(const std::string& stem, const std::string& text) {
  const std::string path = testing::temp_path(stem);
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

/// The bytes of `text` as the int64 token ids a byte-level file holds.
at::Tensor byte_tokens(const std::string& text) {
  at::Tensor ids = at::empty({static_cast<int64_t>(text.size())}, at::kLong);
  for (size_t i = 0; i < text.size(); ++i) ids[static_cast<int64_t>(i)] = static_cast<unsigned char>(text[i]);
  return ids;
}

at::Tensor read_all(const std::string& path) {
  const TokenFile tokens(path);
  return tokens.read(0, tokens.size());
}

TEST(DataTokenize, ByteLevelFilesReadBackAsTheTextSplitAtItsEnd) {
  const std::string first = "First citizen:\nBefore we proceed any further, hear me speak.\n";
  const std::string second = std::string("caf\xc3\xa9 \xff\x00 end", 11);
  const std::string a = write_text("a.txt", first);
  const std::string b = write_text("b.txt", second);
  const std::string train = testing::temp_path("train.bin");
  const std::string val = testing::temp_path("val.bin");
  const auto run = shoal("data tokenize --input " + a + " --input " + b + " --output " + train +
                         " --val-output " + val + " --val-fraction 0.25");
  ASSERT_TRUE(run.ok()) << run.describe();
  const std::string text = first + second;
  const auto split = static_cast<int64_t>(static_cast<double>(text.size()) * 0.75);
  EXPECT_TRUE(torch::equal(read_all(train), byte_tokens(text.substr(0, static_cast<size_t>(split)))));
  EXPECT_TRUE(torch::equal(read_all(val), byte_tokens(text.substr(static_cast<size_t>(split)))));
  EXPECT_NE(run.out.find(train + ": " + std::to_string(split) + " tokens (uint16, byte encoding, vocabulary 256)"),
            std::string::npos) << run.out;
  EXPECT_EQ(fs::file_size(train), static_cast<uintmax_t>(split) * 2);
  // No temporary file is left beside the outputs.
  for (const auto& entry : fs::directory_iterator(fs::path(train).parent_path())) {
    EXPECT_EQ(entry.path().filename().string().find(".tmp."), std::string::npos) << entry.path();
  }
  const auto inspect = shoal("data inspect " + train + " --vocab-size 256 --block-size 8");
  ASSERT_TRUE(inspect.ok()) << inspect.describe();
  const int64_t largest = byte_tokens(text.substr(0, static_cast<size_t>(split))).max().item<int64_t>();
  EXPECT_NE(inspect.out.find(std::to_string(split) + " tokens (uint16), largest id " + std::to_string(largest)),
            std::string::npos) << inspect.out;
  EXPECT_NE(inspect.out.find("blocks of 8 (+1 target): " + std::to_string((split - 1) / 8)), std::string::npos);
  // Without --val-output the whole text trains.
  const auto whole = shoal("data tokenize --input " + a + " --output " + train);
  ASSERT_TRUE(whole.ok()) << whole.describe();
  EXPECT_TRUE(torch::equal(read_all(train), byte_tokens(first)));
}

/// Runs the command line and returns its stderr, asserting a failure with one error line.
std::string failure(const std::string& arguments, int exit_code) {
  const auto run = shoal(arguments);
  EXPECT_EQ(run.exit_code, exit_code) << arguments << ": " << run.describe();
  EXPECT_EQ(run.err.rfind("shoal: error: ", 0), 0u) << run.err;
  EXPECT_EQ(run.err.find('\n'), run.err.size() - 1) << run.err;
  return run.err;
}

TEST(DataTokenize, BadInputsAreOneLineNamingTheFileOrFlag) {
  const std::string text = write_text("text.txt", "some text\n");
  const std::string out = testing::temp_path("out.bin");
  const std::string missing = testing::temp_path("missing.txt");
  EXPECT_NE(failure("data tokenize --input " + missing + " --output " + out, 1)
                .find("input " + missing + ": cannot read: No such file"), std::string::npos);
  const std::string empty = write_text("empty.txt", "");
  EXPECT_NE(failure("data tokenize --input " + empty + " --output " + out, 1)
                .find("input " + empty + " is empty"), std::string::npos);
  const std::string folder = fs::path(text).parent_path().string();
  EXPECT_NE(failure("data tokenize --input " + folder + " --output " + out, 1)
                .find(folder + " is not a regular file"), std::string::npos);
  EXPECT_NE(failure("data tokenize --input " + text + " --output /nonexistent-dir/out.bin", 1)
                .find("cannot write /nonexistent-dir/out.bin"), std::string::npos);
  EXPECT_NE(failure("data tokenize --input " + text + " --output " + out + " --encoding gpt2", 2)
                .find("--encoding gpt2"), std::string::npos);
  EXPECT_NE(failure("data tokenize --input " + text + " --output " + out + " --val-output " + out, 2)
                .find("is also --output"), std::string::npos);
  EXPECT_NE(failure("data tokenize --input " + text + " --output " + out + " --val-fraction 0.5", 2)
                .find("--val-output"), std::string::npos);
  EXPECT_NE(failure("data tokenize --input " + text + " --output " + out + " --val-output " + out +
                        ".val --val-fraction 0.95", 2)
                .find("leaves the training or the validation file empty"), std::string::npos);
  EXPECT_FALSE(fs::exists(out));  // nothing written by a failed run

  // inspect: a size that is not a multiple of the width, and ids past the vocabulary.
  const std::string odd = write_text("odd.bin", "abc");
  EXPECT_NE(failure("data inspect " + odd, 1).find("token file " + odd + " has 3 bytes, not a multiple of 2"),
            std::string::npos);
  ASSERT_TRUE(shoal("data tokenize --input " + text + " --output " + out).ok());
  EXPECT_NE(failure("data inspect " + out + " --vocab-size 100", 1)
                .find("token file " + out + ": token 115 at offset 0 (byte 0) is not below the vocabulary size 100"),
            std::string::npos);
}

/// The fortunes databases, sorted; none when the package is not installed.
std::vector<std::string> fortunes_databases() {
  std::vector<std::string> databases;
  if (fs::is_directory(kFortunesDir)) {
    for (const auto& entry : fs::directory_iterator(kFortunesDir)) {
      // The databases are the files without an extension (.dat is strfile's index, .u8 a link).
      if (entry.is_regular_file() && !entry.path().has_extension()) databases.push_back(entry.path().string());
    }
  }
  std::sort(databases.begin(), databases.end());
  return databases;
}

/// The base64 of `bytes` (the token column of a tiktoken vocabulary).
std::string base64(const std::string& bytes) {
  static const char* digits = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  for (size_t i = 0; i < bytes.size(); i += 3) {
    uint32_t bits = static_cast<uint32_t>(static_cast<unsigned char>(bytes[i])) << 16;
    if (i + 1 < bytes.size()) bits |= static_cast<uint32_t>(static_cast<unsigned char>(bytes[i + 1])) << 8;
    if (i + 2 < bytes.size()) bits |= static_cast<unsigned char>(bytes[i + 2]);
    for (size_t k = 0; k < 4; ++k) {
      out += i + k <= bytes.size() ? digits[(bits >> (18 - 6 * k)) & 63] : '=';
    }
  }
  return out;
}

/// A tiktoken vocabulary of the 256 bytes (rank = byte), then `merges` (ranks 256, 257, ...).
std::string small_vocabulary(const std::vector<std::string>& merges) {
  std::string text;
  for (int byte = 0; byte < 256; ++byte) text += base64(std::string(1, static_cast<char>(byte))) + " " + std::to_string(byte) + "\n";
  for (size_t i = 0; i < merges.size(); ++i) text += base64(merges[i]) + " " + std::to_string(256 + i) + "\n";
  return text;
}

TEST(DataTokenize, Gpt2WithASmallVocabularyMergesLowestRankFirst) {
  // Ranks: bc 256, ab 257, aa 258, abab 259, xyz 260 (no merge makes it: only whole).
  const std::string vocab =
      write_text("small.tiktoken", small_vocabulary({"bc", "ab", "aa", "abab", "xyz"}));
  // GPT-2's pre-tokenizer keeps a word's leading space: "xyz", " abc", " aaa", " abab".
  const std::string text = write_text("small.txt", "xyz abc aaa abab");
  const std::string out = testing::temp_path("small.bin");
  const auto run = shoal("data tokenize --encoding gpt2 --vocab " + vocab + " --input " + text + " --output " + out);
  ASSERT_TRUE(run.ok()) << run.describe();
  EXPECT_NE(run.out.find("gpt2 encoding, vocabulary 262"), std::string::npos) << run.out;
  // "xyz" is a token whole; in " abc" bc (256) merges before ab (257) though ab is leftmost; in
  // " aaa" the leftmost aa of two; in " abab" ab twice, then the two into abab.
  EXPECT_TRUE(torch::equal(read_all(out), torch::tensor({260, 32, 97, 256, 32, 258, 97, 32, 259}, torch::kLong)))
      << read_all(out);
}

TEST(DataTokenize, Gpt2TokensTrainAGptThatGenerateSamplesAsText) {
  const std::string vocab =
      write_text("small.tiktoken", small_vocabulary({"bc", "ab", "aa", "abab", "xyz"}));
  std::string text;
  for (int i = 0; i < 20; ++i) text += "xyz abc aaa abab ";
  const std::string tokens = testing::temp_path("small") + ".bin";  // --data takes .bin as tokens
  ASSERT_TRUE(shoal("data tokenize --encoding gpt2 --vocab " + vocab + " --input " + write_text("small.txt", text) +
                    " --output " + tokens).ok());
  const std::string checkpoints = testing::temp_path("small_gpt");
  const auto train = shoal("train --model gpt --data " + tokens + " --vocab-size 262 --n-layer 1 --n-head 1 "
                           "--n-embd 8 --block-size 4 --batch-size 4 --epochs 1 --threads 1 --no-progress "
                           "--checkpoint-dir " + checkpoints);
  ASSERT_TRUE(train.ok()) << train.describe();
  // No new token: the prompt's GPT-2 tokens decode to the prompt.
  const std::string generate = "generate --checkpoint " + checkpoints + " --prompt 'abc aaa' ";
  const auto echo = shoal(generate + "--vocab " + vocab + " --max-new-tokens 0");
  ASSERT_TRUE(echo.ok()) << echo.describe();
  EXPECT_EQ(echo.out, "abc aaa\n");
  // Tokens drawn are written as their text (ids past 255 are merges, not bytes).
  const auto sample = shoal(generate + "--vocab " + vocab + " --max-new-tokens 6 --top-k 1");
  ASSERT_TRUE(sample.ok()) << sample.describe();
  EXPECT_EQ(sample.out.rfind("abc aaa", 0), 0u) << sample.out;
  EXPECT_GE(sample.out.size(), std::string("abc aaa").size() + 6 + 1) << sample.out;
  EXPECT_NE(failure(generate + "--max-new-tokens 1", 2).find("the model has 262 tokens; without --vocab"),
            std::string::npos);
  fs::remove_all(checkpoints);
}

/// The message of the DataError that `call` throws ("" and a failure when it throws none).
template <typename Call>
std::string data_error(Call&& call) {
  try {
    call();
  } catch (const DataError& error) {
    return error.what();
  }
  ADD_FAILURE() << "no DataError";
  return "";
}

std::string vocabulary_error(const std::string& text) {
  const std::string path = write_text("bad.tiktoken", text);
  return data_error([&] { detail::Gpt2Vocabulary::load(path); });
}

TEST(DataTokenize, Gpt2BadVocabularyOrTextIsOneLineNamingTheFileAndLine) {
  const std::string bytes = small_vocabulary({});
  EXPECT_NE(vocabulary_error(bytes + std::string(2000, 'A') + " 256\n").find("line 257: longer than 1024 bytes"),
            std::string::npos);
  EXPECT_NE(vocabulary_error(bytes + "@@@@ 256\n").find("line 257: the token is not base64"), std::string::npos);
  EXPECT_NE(vocabulary_error(bytes + "YWI 256\n").find("line 257: the token is not base64"), std::string::npos);
  EXPECT_NE(vocabulary_error(bytes + "YWI= 256\nYWI= 257\n").find("line 258: the token of line 257 again"),
            std::string::npos);
  EXPECT_NE(vocabulary_error(bytes + "YWI= 255\n").find("line 257: rank 255 is given twice"), std::string::npos);
  EXPECT_NE(vocabulary_error(bytes + "YWI= 257\n").find("no token has rank 256"), std::string::npos);
  EXPECT_NE(vocabulary_error(bytes + "YWI= 65535\n").find("line 257: the rank is not a number below 65535"),
            std::string::npos);
  EXPECT_NE(vocabulary_error(bytes + "YWI= -1\n").find("line 257: the rank is not a number"), std::string::npos);
  // A token past 256 bytes: indexing one costs its length squared.
  EXPECT_NE(vocabulary_error(bytes + base64(std::string(300, 'a')) + " 256\n").find("line 257: a token of 300 bytes"),
            std::string::npos);
  EXPECT_NE(vocabulary_error("{\"" + std::string(300, 'a') + "\": 0}").find("a token of 300 bytes"),
            std::string::npos);
  EXPECT_NE(vocabulary_error(bytes.substr(0, bytes.rfind('\n', bytes.size() - 2) + 1)).find("no token is byte 255"),
            std::string::npos);
  // encoder.json: JSON, the keys GPT-2's byte characters, the ids integers.
  EXPECT_NE(vocabulary_error("{\"a\": 1").find("not JSON"), std::string::npos);
  EXPECT_NE(vocabulary_error("{\"\\u3000\": 0}").find("key \"\u3000\": not GPT-2's byte characters"),
            std::string::npos);
  EXPECT_NE(vocabulary_error("{\"a\": \"1\"}").find("key \"a\": the id is not an integer"), std::string::npos);
  EXPECT_NE(vocabulary_error("{\"a\": 0, \"b\": 0}").find("key \"b\": rank 0 is given twice"), std::string::npos);
  const std::string huge = write_text("huge.tiktoken", "");
  fs::resize_file(huge, uintmax_t{17} << 20);  // sparse
  EXPECT_NE(data_error([&] { detail::Gpt2Vocabulary::load(huge); }).find("vocabulary " + huge + " has 17825792 bytes"),
            std::string::npos);

  // Text that is not UTF-8: an invalid byte, an overlong form, a surrogate, a character cut at the end.
  const std::string vocab = write_text("good.tiktoken", bytes);
  TokenizeOptions options;
  options.encoding = "gpt2";
  options.vocab = vocab;
  options.output = testing::temp_path("out.bin");
  const auto refused = [&](const std::string& bad) {
    options.inputs = {write_text("bad.txt", bad)};
    return data_error([&] { tokenize_text(options); });
  };
  EXPECT_NE(refused("ok \xc0\xaf").find("byte 3 is not UTF-8"), std::string::npos);
  EXPECT_NE(refused("ok \xed\xa0\x80").find("byte 3 is not UTF-8"), std::string::npos);
  EXPECT_NE(refused("ok \xf4\x90\x80\x80").find("byte 3 is not UTF-8"), std::string::npos);
  EXPECT_NE(refused("ok \xe6\x97").find("ends inside a UTF-8 character (at byte 3)"), std::string::npos);
  // A run with no break longer than a piece may be (1 MiB; a piece is held whole).
  EXPECT_NE(refused(std::string((size_t{1} << 20) + 4096, 'a')).find("a run of more than 1048576 bytes"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(options.output));

  // As a user sees it: one line naming the file and line, or the file and byte.
  const std::string text = write_text("text.txt", "some text\n");
  const std::string bad_vocab = write_text("bad.tiktoken", bytes + "YWI= 255\n");
  const std::string out = options.output;
  EXPECT_NE(failure("data tokenize --encoding gpt2 --vocab " + bad_vocab + " --input " + text + " --output " + out, 1)
                .find("vocabulary " + bad_vocab + " line 257: rank 255 is given twice"), std::string::npos);
  const std::string bad_text = write_text("bad.txt", "caf\xc3\xa9 \xff end");
  EXPECT_NE(failure("data tokenize --encoding gpt2 --vocab " + vocab + " --input " + bad_text + " --output " + out, 1)
                .find("input " + bad_text + ": byte 6 is not UTF-8"), std::string::npos);
  EXPECT_NE(failure("data tokenize --input " + text + " --output " + out + " --vocab " + vocab, 2).find("--vocab is for"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(out));
}

/// GPT-2's vocabulary: SHOAL_GPT2_VOCAB, else where scripts/setup.sh puts it.
std::string gpt2_vocabulary_path() {
  if (const char* path = std::getenv("SHOAL_GPT2_VOCAB")) return path;
  const char* home = std::getenv("HOME");
  return std::string(home != nullptr ? home : "") + "/.cache/shoal/gpt2.tiktoken";
}

// tiktoken's GPT-2 encoding over each text file given, its ids written as uint16 to <file>.ids;
// and the vocabulary as GPT-2's encoder.json (its bytes_to_unicode keys) to the second argument.
constexpr const char* kTiktokenOracle = R"(
import sys
try:
    from tiktoken import Encoding
    from tiktoken.load import load_tiktoken_bpe
except ImportError:
    sys.exit(77)
import array
pattern = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
gpt2 = Encoding(name="gpt2", pat_str=pattern, mergeable_ranks=load_tiktoken_bpe(sys.argv[1]),
                special_tokens={"<|endoftext|>": 50256})
import json
def bytes_to_unicode():  # GPT-2's encoder.py
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(2**8):
        if b not in bs:
            bs.append(b)
            cs.append(2**8 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))
characters = bytes_to_unicode()
encoder = {"".join(characters[b] for b in token): rank for token, rank in load_tiktoken_bpe(sys.argv[1]).items()}
encoder["<|endoftext|>"] = gpt2.eot_token
json.dump(encoder, open(sys.argv[2], "w"))
total = 0
for path in sys.argv[3:]:
    text = open(path, "rb").read()
    ids = gpt2.encode_ordinary(text.decode("utf-8"))
    assert gpt2.decode_bytes(ids) == text, path
    array.array("H", ids).tofile(open(path + ".ids", "wb"))
    total += len(ids)
print("ORACLE OK", total, "tokens", flush=True)
)";

/// The ids tiktoken's oracle wrote for `text_path`.
at::Tensor oracle_ids(const std::string& text_path) { return read_all(text_path + ".ids"); }

/// Text for the pre-tokenizer's corners: accents (composed and combining), CJK, emoji (with
/// modifiers and joiners), digits of several scripts, contractions, runs of spaces, tabs and
/// newlines, Unicode's other spaces (U+180E is not one), "<|endoftext|>" as text, long runs (the
/// heap merge), and "<0x85>" NEL.
std::string stress_text() {
  std::string text =
      "Hello world's  caf\xc3\xa9 cafe\xcc\x81 na\xc3\xafve \xe2\x80\x94 \xe2\x80\x9cquotes\xe2\x80\x9d "
      "\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e\xe3\x81\xae\xe3\x83\x86\xe3\x82\xad\xe3\x82\xb9\xe3\x83\x88 "
      "\xf0\x9f\x99\x82\xf0\x9f\x91\x8d\xf0\x9f\x8f\xbd \xf0\x9f\x91\xa9\xe2\x80\x8d\xf0\x9f\x92\xbb "
      "I'm you're we've they'll he'd it's don't 'S' ''s 'LL Y'ALL\n"
      "123456789 3.14159 1,000,000 \xd9\xa3\xd9\xa4\xd9\xa5 x\xc2\xb2\xc2\xb3 \xe2\x85\xab\n"
      "a     b   \n\n\n  c\t\td\r\nend  \n"
      "nbsp\xc2\xa0here ideo\xe3\x80\x80space nel\xc2\x85line mvs \xe1\xa0\x8e!ep \xe1\xa0\x8e ls\xe2\x80\xa8ps\xe2\x80\xa9\n"
      "\xd0\x9f\xd1\x80\xd0\xb8\xd0\xb2\xd0\xb5\xd1\x82 \xce\xba\xce\xb1\xce\xbb\xce\xb7\xce\xbc\xce\xad\xcf\x81\xce\xb1 "
      "\xd7\xa9\xd7\x9c\xd7\x95\xd7\x9d \xe0\xa4\xa8\xe0\xa4\xae\xe0\xa4\xb8\xe0\xa5\x8d\xe0\xa4\xa4\xe0\xa5\x87 "
      "\xec\x95\x88\xeb\x85\x95 <|endoftext|> $$$!!!??? ...\n";
  text += std::string(300, ' ') + "x" + std::string(700, 'a') + " " + std::string(400, '-') + "\n";
  return text;
}

TEST(DataTokenize, RealCorpusGpt2IdsEqualTiktokens) {
  const std::string vocab = gpt2_vocabulary_path();
  SHOAL_SKIP_UNLESS(fs::exists(vocab), testing::Dependency::kDataset,
                    "GPT-2's vocabulary " + vocab + " is missing (scripts/setup.sh fetches it)");
  const std::vector<std::string> databases = fortunes_databases();
  SHOAL_SKIP_UNLESS(!databases.empty(), testing::Dependency::kDataset,
                    "the fortunes databases are not installed (apt-get install fortunes)");
  // The fortunes as one text for the oracle, as several inputs for Shoal (pieces across files).
  std::string corpus, inputs;
  for (const std::string& database : databases) {
    std::ifstream in(database, std::ios::binary);
    corpus += std::string(std::istreambuf_iterator<char>(in), {});
    inputs += " --input " + database;
  }
  const std::string corpus_path = write_text("fortunes.txt", corpus);
  // The stress text past 1 MiB, so that reads cut characters and pieces; then split for
  // validation inside a character (the cut moves on to the next character's start).
  std::string stress;
  for (int i = 0; stress.size() < (size_t{1} << 20) + 5000; ++i) stress += stress_text() + std::to_string(i) + " ";
  const std::string stress_path = write_text("stress.txt", stress);
  double fraction = 0.3;
  auto cut = [&] { return static_cast<size_t>(std::floor(static_cast<double>(stress.size()) * (1 - fraction))); };
  while ((static_cast<unsigned char>(stress[cut()]) & 0xC0) != 0x80) fraction += 0.0001;
  size_t split = cut();
  while ((static_cast<unsigned char>(stress[split]) & 0xC0) == 0x80) ++split;
  const std::string head_path = write_text("stress_head.txt", stress.substr(0, split));
  const std::string tail_path = write_text("stress_tail.txt", stress.substr(split));

  const std::string script = write_text("tiktoken_oracle.py", kTiktokenOracle);
  const std::string encoder_json = testing::temp_path("encoder.json");
  const auto oracle =
      testing::run_python({script, vocab, encoder_json, corpus_path, stress_path, head_path, tail_path});
  if (oracle.exit_code == 77) {
    SHOAL_SKIP_TEST(testing::Dependency::kPythonTorch, "tiktoken is not installed (scripts/setup.sh installs it)");
  }
  ASSERT_TRUE(testing::oracle_succeeded(oracle));

  const std::string out = testing::temp_path("gpt2.bin");
  const auto run = shoal("data tokenize --encoding gpt2 --vocab " + vocab + inputs + " --output " + out);
  ASSERT_TRUE(run.ok()) << run.describe();
  EXPECT_NE(run.out.find("gpt2 encoding, vocabulary 50257"), std::string::npos) << run.out;
  const at::Tensor ids = read_all(out);
  EXPECT_TRUE(torch::equal(ids, oracle_ids(corpus_path))) << ids.numel() << " vs " << oracle_ids(corpus_path).numel();
  EXPECT_GT(ids.numel(), 500000);
  // Decoding Shoal's ids gives the text back, byte for byte.
  const auto vocabulary = detail::Gpt2Vocabulary::load(vocab);
  std::string decoded;
  for (const int64_t id : std::vector<int64_t>(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.numel())) {
    decoded += vocabulary.bytes(id);
  }
  EXPECT_TRUE(decoded == corpus);

  const std::string val = testing::temp_path("gpt2_val.bin");
  const auto stress_run = shoal("data tokenize --encoding gpt2 --vocab " + vocab + " --input " + stress_path +
                                " --output " + out);
  ASSERT_TRUE(stress_run.ok()) << stress_run.describe();
  EXPECT_TRUE(torch::equal(read_all(out), oracle_ids(stress_path)));
  // GPT-2's encoder.json gives the same ids.
  const auto json_run = shoal("data tokenize --encoding gpt2 --vocab " + encoder_json + " --input " + stress_path +
                              " --output " + out);
  ASSERT_TRUE(json_run.ok()) << json_run.describe();
  EXPECT_TRUE(torch::equal(read_all(out), oracle_ids(stress_path)));
  std::ostringstream fraction_text;
  fraction_text.precision(17);
  fraction_text << fraction;
  const auto split_run = shoal("data tokenize --encoding gpt2 --vocab " + vocab + " --input " + stress_path +
                               " --output " + out + " --val-output " + val + " --val-fraction " + fraction_text.str());
  ASSERT_TRUE(split_run.ok()) << split_run.describe();
  EXPECT_TRUE(torch::equal(read_all(out), oracle_ids(head_path)));
  EXPECT_TRUE(torch::equal(read_all(val), oracle_ids(tail_path)));
}

TEST(DataTokenize, RealCorpusFortunesTokenizesAndReadsBackAsBlocks) {
  const std::vector<std::string> databases = fortunes_databases();
  SHOAL_SKIP_UNLESS(!databases.empty(), testing::Dependency::kDataset,
                    "the fortunes databases are not installed (apt-get install fortunes)");
  std::string inputs;
  uintmax_t bytes = 0;
  for (const std::string& database : databases) {
    inputs += " --input " + database;
    bytes += fs::file_size(database);
  }
  const std::string train = testing::temp_path("fortunes_train.bin");
  const std::string val = testing::temp_path("fortunes_val.bin");
  const auto run = shoal("data tokenize" + inputs + " --output " + train + " --val-output " + val);
  ASSERT_TRUE(run.ok()) << run.describe();
  EXPECT_EQ(fs::file_size(train) + fs::file_size(val), 2 * bytes);
  EXPECT_GT(bytes, uintmax_t{500000}) << "an English corpus of some size";

  TokenFileOptions options;
  options.vocab_size = 256;
  auto tokens = std::make_shared<TokenFile>(train, options);
  const TokenBlockDataset blocks(tokens, 256);
  EXPECT_EQ(blocks.size(), (tokens->size() - 1) / 256);
  // The first block is the start of the first database, byte for byte.
  std::ifstream first(databases.front(), std::ios::binary);
  std::string head(257, '\0');
  first.read(head.data(), 257);
  const Batch batch = blocks.get_batch(torch::tensor({int64_t{0}, blocks.size() - 1}, torch::kLong));
  EXPECT_TRUE(torch::equal(batch.data[0], byte_tokens(head.substr(0, 256))));
  EXPECT_TRUE(torch::equal(batch.target[0], byte_tokens(head.substr(1, 256))));
  EXPECT_LT(batch.data.max().item<int64_t>(), 256);
  EXPECT_EQ(tokens->check_vocab() < 256, true);
}

}  // namespace test_data_tokenize
}  // namespace shoal::data
