// `shoal bench tokens FILE`: how fast one core reads a token file's blocks, from a cold page cache
// (the file's pages are dropped first), through the DataLoader in the training loop's own thread
// (no workers): blocks/s and tokens/s, to set against a training step's consumption (batch_size
// blocks per step). The loader must never be the bottleneck: the aim is 10x the step's rate.
#include <fcntl.h>
#include <unistd.h>

#include <ATen/Parallel.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

#include "bench_harness.h"
#include "bench_util.h"
#include "commands.h"
#include "compat/thread_parallelism.h"
#include "shoal/data/data_loader.h"
#include "shoal/data/exactly_once_sampler.h"
#include "shoal/data/token_block_dataset.h"
#include "shoal/data/token_file.h"
#include "shoal/error.h"

namespace shoal::cli {
namespace {

struct TokenBenchArgs {
  std::string file;
  std::string dtype = "uint16";
  int64_t block_size = 1024;
  int64_t batch_size = 12;
  int64_t batches = 0;  // 0: the whole epoch
  bool warm = false;
};

/// Asks the kernel to forget the file's cached pages, so that the reads come from the disk.
void drop_page_cache(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  SHOAL_CHECK_T(DataError, fd >= 0, "token file ", path, ": cannot open");
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

int bench_tokens(const TokenBenchArgs& args) {
  compat::set_compute_threads(1);  // LibTorch's and OpenBLAS's pools: idle BLAS threads spin
  data::TokenFileOptions options;
  options.dtype = data::parse_token_dtype(args.dtype);
  if (!args.warm) drop_page_cache(args.file);
  const auto start = std::chrono::steady_clock::now();
  auto tokens = std::make_shared<data::TokenFile>(args.file, options);
  const data::TokenBlockDataset blocks(tokens, args.block_size);
  data::ExactlyOnceSampler sampler(blocks.size(), 0, 1);
  sampler.set_epoch(0);
  at::Tensor order = sampler.indices();
  if (args.batches > 0) order = order.slice(0, 0, std::min(order.numel(), args.batches * args.batch_size));
  data::DataLoaderOptions loading;
  loading.batch_size = args.batch_size;
  data::DataLoader loader(blocks, order, loading);
  int64_t read = 0;
  while (std::optional<data::Batch> batch = loader.next()) read += batch->data.size(0);
  const double seconds = seconds_since(start);
  ReportLine()
      .add("bench", "tokens").add("file", args.file).add_bool("cold", !args.warm)
      .add("block_size", args.block_size).add("batch_size", args.batch_size).add("blocks", read)
      .add("seconds", seconds).add("blocks_per_s", read / seconds)
      .add("tokens_per_s", read * args.block_size / seconds)
      .add("batches_per_s", read / seconds / args.batch_size)
      .print();
  return 0;
}

}  // namespace

void add_bench_tokens_command(CLI::App& bench, std::vector<Command>& commands) {
  auto args = std::make_shared<TokenBenchArgs>();
  auto* app = bench.add_subcommand(
      "tokens", "One core reading a token file's shuffled blocks from a cold page cache (blocks/s)");
  app->add_option("FILE", args->file, "the token file (e.g. from `shoal data tokenize`)")->required();
  app->add_option("--dtype", args->dtype, "uint16 (default) or uint32")
      ->check(CLI::IsMember({"uint16", "uint32"}));
  app->add_option("--block-size", args->block_size, "tokens per block (default 1024)")
      ->check(CLI::PositiveNumber);
  app->add_option("--batch-size", args->batch_size, "blocks per batch (default 12)")
      ->check(CLI::PositiveNumber);
  app->add_option("--batches", args->batches, "batches to read (default 0: the whole epoch)")
      ->check(CLI::NonNegativeNumber);
  app->add_flag("--warm", args->warm, "keep the file's cached pages (default: drop them first)");
  commands.push_back({app, [args] { return bench_tokens(*args); }});
}

}  // namespace shoal::cli
