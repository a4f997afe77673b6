// A token file four times larger than a memory limit the test sets is read whole, one shuffled
// epoch of blocks through the DataLoader, under that limit, and every token read is the one
// written. The limit is a memory cgroup made for the test under the test's own cgroup (v1's
// memory.limit_in_bytes, or v2's memory.max): unlike RLIMIT_AS it leaves LibTorch's untouched
// address-space reservations alone, and unlike RLIMIT_DATA or RLIMIT_RSS it counts (and reclaims)
// the page cache a memory-mapped file fills, which is what must not grow with the file. The file's
// pages are dropped from the page cache first, so that the reads are charged to the test's cgroup
// and the limit is really reached (its fail count says so). A control child that holds the same
// tokens in memory instead is killed by the limit. Skipped where no memory cgroup is writable.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <csignal>
#include <fstream>
#include <sstream>

#include "shoal/data/data_loader.h"
#include "shoal/data/exactly_once_sampler.h"
#include "shoal/data/token_block_dataset.h"
#include "shoal/data/token_file.h"
#include "testing/child_process.h"
#include "testing/dependencies.h"
#include "testing/memory_cgroup.h"
#include "testing/multi_rank.h"

namespace shoal::data {
namespace test_token_memory {

constexpr int64_t kLimitBytes = int64_t{64} << 20;
constexpr int64_t kFileBytes = 4 * kLimitBytes;
constexpr int64_t kBlockSize = 1024;

/// The token written at position p of the file (uint16): positions differ in their tokens.
at::Tensor token_at(const at::Tensor& positions) { return (positions * 7 + positions.div(1021, "floor")) % 65521; }

/// Writes the token file and drops its pages from the page cache.
std::string write_token_file() {
  const std::string path = testing::temp_path("large.bin");
  {
    std::ofstream out(path, std::ios::binary);
    constexpr int64_t kChunk = int64_t{1} << 22;
    for (int64_t start = 0; start < kFileBytes / 2; start += kChunk) {
      const at::Tensor tokens = token_at(torch::arange(start, start + kChunk, torch::kLong)).to(torch::kInt);
      std::vector<uint16_t> chunk(static_cast<size_t>(kChunk));
      const int32_t* from = tokens.data_ptr<int32_t>();
      for (int64_t i = 0; i < kChunk; ++i) chunk[static_cast<size_t>(i)] = static_cast<uint16_t>(from[i]);
      out.write(reinterpret_cast<const char*>(chunk.data()), kChunk * 2);
    }
  }
  const int fd = ::open(path.c_str(), O_RDONLY);
  ::fsync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
  return path;
}

/// One shuffled epoch of the file's blocks; "" when every token was the one written.
std::string read_epoch(const std::string& path) {
  auto tokens = std::make_shared<TokenFile>(path);
  const TokenBlockDataset blocks(tokens, kBlockSize);
  ExactlyOnceSampler sampler(blocks.size(), 0, 1);
  sampler.set_epoch(1);
  DataLoaderOptions loading;
  loading.batch_size = 64;
  loading.num_workers = 1;
  const at::Tensor order = sampler.indices();
  DataLoader loader(blocks, order, loading);
  const at::Tensor offsets = torch::arange(kBlockSize, torch::kLong);
  int64_t seen = 0;
  while (std::optional<Batch> batch = loader.next()) {
    const at::Tensor starts = batch->data.select(1, 0);
    // Block ids from the sampler's order, positions from the ids: the content must match.
    const at::Tensor ids = order.slice(0, seen, seen + starts.numel());
    const at::Tensor positions = ids.unsqueeze(1) * kBlockSize + offsets;
    if (!torch::equal(batch->data, token_at(positions)) || !torch::equal(batch->target, token_at(positions + 1))) {
      return "batch at block " + std::to_string(seen) + " differs from what was written";
    }
    seen += starts.numel();
  }
  return seen == blocks.size() ? "" : "read " + std::to_string(seen) + " blocks of " + std::to_string(blocks.size());
}

TEST(TokenMemory, FileFourTimesTheMemoryLimitIsReadUnderIt) {
  testing::MemoryCgroup cgroup(kLimitBytes);
  SHOAL_SKIP_UNLESS(cgroup.made(), testing::Dependency::kOptional,
                    "no writable memory cgroup under this process's own (cgroup v1 memory or v2)");
  const std::string path = write_token_file();
  const testing::ChildOutcome reader = testing::run_in_child([&]() -> std::string {
    if (!cgroup.enter()) return "could not enter " + cgroup.dir();
    return read_epoch(path);
  });
  EXPECT_TRUE(reader.exited && reader.exit_code == 0 && reader.message.empty())
      << "signal " << reader.signal << ", exit " << reader.exit_code << ": " << reader.message;
  // The limit was reached (and the page cache reclaimed): the file did not fit under it.
  EXPECT_GT(cgroup.times_limit_reached(), 0);

  // The control: the same tokens held in memory (as an in-memory dataset would) do not fit.
  const testing::ChildOutcome holder = testing::run_in_child([&]() -> std::string {
    if (!cgroup.enter()) return "could not enter " + cgroup.dir();
    TokenFile tokens(path);
    at::Tensor all = at::empty({tokens.size()}, at::kShort);
    const int64_t chunk = int64_t{1} << 20;
    for (int64_t start = 0; start < tokens.size(); start += chunk) {
      all.slice(0, start, start + chunk).copy_(tokens.read(start, chunk));
    }
    return "held " + std::to_string(all.nbytes()) + " bytes";
  });
  EXPECT_FALSE(holder.exited) << holder.message;
  EXPECT_EQ(holder.signal, SIGKILL);
  std::remove(path.c_str());
}

}  // namespace test_token_memory
}  // namespace shoal::data
