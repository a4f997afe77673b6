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
#include "testing/multi_rank.h"

namespace shoal::data {
namespace test_token_memory {

constexpr int64_t kLimitBytes = int64_t{64} << 20;
constexpr int64_t kFileBytes = 4 * kLimitBytes;
constexpr int64_t kBlockSize = 1024;

/// The token written at position p of the file (uint16): positions differ in their tokens.
at::Tensor token_at(const at::Tensor& positions) { return (positions * 7 + positions.div(1021, "floor")) % 65521; }

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

/// A memory cgroup made for this test under the process's own, removed on destruction.
class MemoryCgroup {
 public:
  explicit MemoryCgroup(int64_t limit) {
    for (const auto& [controller_file, limit_file] : {std::pair<std::string, std::string>{"memory", "memory.limit_in_bytes"},
                                                      {"", "memory.max"}}) {
      const std::string own = own_cgroup(controller_file);
      if (own.empty()) continue;
      const std::string root = controller_file.empty() ? "/sys/fs/cgroup" : "/sys/fs/cgroup/memory";
      const std::string dir = root + own + "/shoal-test-" + std::to_string(::getpid());
      if (::mkdir(dir.c_str(), 0755) != 0) continue;
      std::ofstream(dir + "/" + limit_file) << limit;
      if (slurp(dir + "/" + limit_file) == std::to_string(limit) + "\n") {
        dir_ = dir;
        v1_ = !controller_file.empty();
        return;
      }
      ::rmdir(dir.c_str());
    }
  }
  ~MemoryCgroup() {
    if (!dir_.empty()) ::rmdir(dir_.c_str());
  }
  bool made() const { return !dir_.empty(); }
  const std::string& dir() const { return dir_; }
  /// Moves the calling process into the cgroup.
  bool enter() const {
    std::ofstream(dir_ + "/cgroup.procs") << ::getpid() << std::endl;
    return slurp("/proc/self/cgroup").find(dir_.substr(dir_.rfind('/'))) != std::string::npos;
  }
  /// How often usage reached the limit.
  int64_t times_limit_reached() const {
    if (v1_) return std::stoll("0" + slurp(dir_ + "/memory.failcnt"));
    const std::string events = slurp(dir_ + "/memory.events");
    const size_t at = events.find("\nmax ");
    return at == std::string::npos ? 0 : std::stoll(events.substr(at + 5));
  }

 private:
  /// This process's cgroup path under the v1 `controller` ("" for the v2 hierarchy), or "".
  static std::string own_cgroup(const std::string& controller) {
    std::istringstream lines(slurp("/proc/self/cgroup"));
    for (std::string line; std::getline(lines, line);) {
      const size_t first = line.find(':');
      const size_t second = line.find(':', first + 1);
      if (first == std::string::npos || second == std::string::npos) continue;
      const std::string controllers = line.substr(first + 1, second - first - 1);
      if (controllers == controller || ("," + controllers + ",").find("," + controller + ",") != std::string::npos) {
        if (!controller.empty() || line.rfind("0::", 0) == 0) return line.substr(second + 1);
      }
    }
    return "";
  }
  std::string dir_;
  bool v1_ = false;
};

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
  MemoryCgroup cgroup(kLimitBytes);
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
