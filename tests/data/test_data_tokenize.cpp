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

#include "shoal/data/token_block_dataset.h"
#include "shoal/data/token_file.h"
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

TEST(DataTokenize, RealCorpusFortunesTokenizesAndReadsBackAsBlocks) {
  std::vector<std::string> databases;
  if (fs::is_directory(kFortunesDir)) {
    for (const auto& entry : fs::directory_iterator(kFortunesDir)) {
      // The databases are the files without an extension (.dat is strfile's index, .u8 a link).
      if (entry.is_regular_file() && !entry.path().has_extension()) databases.push_back(entry.path().string());
    }
  }
  SHOAL_SKIP_UNLESS(!databases.empty(), testing::Dependency::kDataset,
                    "the fortunes databases are not installed (apt-get install fortunes)");
  std::sort(databases.begin(), databases.end());
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
