// Data read a batch at a time: the DataLoader's order, prefetch bound, errors and time-out;
// CIFAR-10's binary files read lazily and in memory (bit-identical batches, the dataset's
// normalisation, one-line errors); and a lazily read dataset through the Trainer with worker
// threads ending with the same weights as the in-memory tensors.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <mutex>

#include "shoal/data/batch_dataset.h"
#include "shoal/data/cifar10.h"
#include "shoal/data/data_loader.h"
#include "shoal/data/synthetic_dataset.h"
#include "shoal/error.h"
#include "shoal/models/registry.h"
#include "shoal/train/trainer.h"

namespace shoal::data {
namespace test_data_loader {

namespace fs = std::filesystem;

/// Every batch of `loader`, concatenated.
Batch drain(DataLoader& loader) {
  std::vector<at::Tensor> inputs;
  std::vector<at::Tensor> targets;
  while (std::optional<Batch> batch = loader.next()) {
    inputs.push_back(batch->data);
    targets.push_back(batch->target);
  }
  return {torch::cat(inputs), torch::cat(targets)};
}

TEST(DataLoader, BatchesInSamplerOrderForAnyWorkerCount) {
  const TensorDataset dataset(torch::arange(206, torch::kFloat).reshape({103, 2}),
                              torch::arange(103, torch::kLong));
  const at::Tensor order = torch::randperm(103, torch::kLong);
  for (int workers : {0, 1, 3}) {
    for (int prefetch : {1, 2}) {
      DataLoaderOptions options;
      options.batch_size = 20;
      options.num_workers = workers;
      options.prefetch_factor = prefetch;
      DataLoader loader(dataset, order, options);
      EXPECT_EQ(loader.num_batches(), 6);
      const Batch all = drain(loader);
      EXPECT_TRUE(torch::equal(all.target, order)) << workers << " workers";
      EXPECT_TRUE(torch::equal(all.data, dataset.inputs().index_select(0, order)));
      EXPECT_FALSE(loader.next().has_value());
    }
  }
  DataLoaderOptions options;
  options.batch_size = 20;
  options.drop_last = true;
  options.num_workers = 2;
  DataLoader loader(dataset, order, options);
  EXPECT_EQ(loader.num_batches(), 5);
  EXPECT_EQ(drain(loader).target.size(0), 100);
}

/// Records the highest batch any worker started (indices are 0..N-1 in order, batches of 10).
class Recording : public BatchDataset {
 public:
  int64_t size() const override { return 200; }
  Batch get_batch(const at::Tensor& indices) const override {
    const int64_t batch = indices[0].item<int64_t>() / 10;
    int64_t seen = highest.load();
    while (batch > seen && !highest.compare_exchange_weak(seen, batch)) {
    }
    return {indices.to(torch::kFloat), indices};
  }
  mutable std::atomic<int64_t> highest{-1};
};

TEST(DataLoader, LoadsAtMostWorkersTimesPrefetchFactorAhead) {
  Recording dataset;
  DataLoaderOptions options;
  options.batch_size = 10;
  options.num_workers = 3;
  options.prefetch_factor = 2;
  DataLoader loader(dataset, torch::arange(200, torch::kLong), options);
  const int64_t ahead = 3 * 2;
  for (int64_t k = 0; k < 20; ++k) {
    const std::optional<Batch> batch = loader.next();
    ASSERT_TRUE(batch.has_value());
    EXPECT_EQ(batch->target[0].item<int64_t>(), k * 10);
    // Taken k + 1 batches: no worker may have started batch k + 1 + ahead or later.
    EXPECT_LE(dataset.highest.load(), k + ahead) << "after batch " << k;
  }
  EXPECT_EQ(dataset.highest.load(), 19);
}

/// Throws on the batch that holds sample `bad`.
class Failing : public BatchDataset {
 public:
  int64_t size() const override { return 100; }
  Batch get_batch(const at::Tensor& indices) const override {
    SHOAL_CHECK_T(DataError, !indices.eq(37).any().item<bool>(), "sample 37 is unreadable");
    return {indices.to(torch::kFloat), indices};
  }
};

TEST(DataLoader, AWorkersErrorReachesTheStepThatNeedsTheBatch) {
  for (int workers : {0, 2}) {
    Failing dataset;
    DataLoaderOptions options;
    options.batch_size = 10;
    options.num_workers = workers;
    DataLoader loader(dataset, torch::arange(100, torch::kLong), options);
    for (int k = 0; k < 3; ++k) ASSERT_TRUE(loader.next().has_value());
    try {
      loader.next();
      ADD_FAILURE() << "batch 3 (sample 37) did not throw";
    } catch (const DataError& e) {
      EXPECT_NE(std::string(e.what()).find("sample 37 is unreadable"), std::string::npos);
    }
  }
}

/// get_batch blocks until released (a file system that stopped answering).
class Stuck : public BatchDataset {
 public:
  int64_t size() const override { return 10; }
  Batch get_batch(const at::Tensor& indices) const override {
    std::unique_lock<std::mutex> lock(mutex);
    released_cv.wait(lock, [&] { return released; });
    return {indices.to(torch::kFloat), indices};
  }
  void release() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      released = true;
    }
    released_cv.notify_all();
  }
  mutable std::mutex mutex;
  mutable std::condition_variable released_cv;
  bool released = false;
};

TEST(DataLoader, AStuckWorkerIsATimeoutNamingTheBatch) {
  Stuck dataset;
  DataLoaderOptions options;
  options.batch_size = 5;
  options.num_workers = 1;
  options.timeout = std::chrono::milliseconds(1000);
  {
    DataLoader loader(dataset, torch::arange(10, torch::kLong), options);
    try {
      loader.next();
      ADD_FAILURE() << "no time-out";
    } catch (const TimeoutError& e) {
      EXPECT_NE(std::string(e.what()).find("batch 0 of 2 not loaded after 1000 ms"),
                std::string::npos)
          << e.what();
    }
    dataset.release();  // the destructor joins the worker
  }
}

TEST(DataLoader, MapDatasetAdapterStacksTorchDataSamples) {
  SyntheticOptions synthetic;
  synthetic.size = 50;
  auto dataset = std::make_shared<SyntheticDataset>(synthetic);
  const MapDatasetAdapter<SyntheticDataset> adapter(dataset);
  const at::Tensor order = torch::randperm(50, torch::kLong);
  DataLoaderOptions options;
  options.batch_size = 8;
  options.num_workers = 2;
  DataLoader loader(adapter, order, options);
  const Batch all = drain(loader);
  EXPECT_TRUE(torch::equal(all.data, dataset->images().index_select(0, order)));
  EXPECT_TRUE(torch::equal(all.target, dataset->targets().index_select(0, order)));
}

/// CIFAR-10 files in a fresh folder: `records` per file, labels i % 10, pixels from a seeded
/// generator; returns the raw images [N, 3072] uint8 of the files in order.
struct CifarFolder {
  fs::path root;
  at::Tensor images;  // [N, 3, 32, 32] uint8, training files in order
  at::Tensor labels;  // [N] int64
  CifarFolder(const std::string& name, std::vector<int64_t> train_records, int64_t test_records) {
    root = fs::temp_directory_path() / ("shoal_" + name + "_" + std::to_string(::getpid()));
    fs::remove_all(root);
    fs::create_directories(root);
    at::Generator g = at::make_generator<at::CPUGeneratorImpl>(1234);
    std::vector<at::Tensor> all_images;
    std::vector<at::Tensor> all_labels;
    auto write = [&](const std::string& file, int64_t n, bool keep) {
      const at::Tensor pixels = torch::randint(0, 256, {n, 3072}, g, torch::kByte);
      const at::Tensor label = torch::randint(0, 10, {n, 1}, g, torch::kByte);
      const at::Tensor records = torch::cat({label, pixels}, 1).contiguous();
      std::ofstream out(root / file, std::ios::binary);
      out.write(reinterpret_cast<const char*>(records.data_ptr<uint8_t>()), records.numel());
      if (keep) {
        all_images.push_back(pixels.reshape({n, 3, 32, 32}));
        all_labels.push_back(label.reshape({n}).to(torch::kLong));
      }
    };
    for (size_t k = 0; k < train_records.size(); ++k) {
      write("data_batch_" + std::to_string(k + 1) + ".bin", train_records[k], true);
    }
    write("test_batch.bin", test_records, false);
    images = torch::cat(all_images);
    labels = torch::cat(all_labels);
  }
  ~CifarFolder() { fs::remove_all(root); }
};

TEST(Cifar10, LazyAndInMemoryBatchesAreTheNormalisedRecords) {
  CifarFolder folder("cifar_read", {7, 5, 9}, 4);
  const Cifar10 lazy(folder.root.string(), /*train=*/true);
  const Cifar10 in_memory(folder.root.string(), /*train=*/true, /*in_memory=*/true);
  ASSERT_EQ(lazy.size(), 21);
  EXPECT_EQ(Cifar10(folder.root.string(), /*train=*/false).size(), 4);
  EXPECT_TRUE(torch::equal(lazy.targets(), folder.labels));
  const at::Tensor order = torch::randperm(21, torch::kLong);
  const Batch a = lazy.get_batch(order);
  const Batch b = in_memory.get_batch(order);
  EXPECT_TRUE(torch::equal(a.data, b.data));
  EXPECT_TRUE(torch::equal(a.target, b.target));
  const at::Tensor mean = torch::tensor({0.4914, 0.4822, 0.4465}, torch::kDouble).to(torch::kFloat).view({1, 3, 1, 1});
  const at::Tensor std = torch::tensor({0.2470, 0.2435, 0.2616}, torch::kDouble).to(torch::kFloat).view({1, 3, 1, 1});
  const at::Tensor expected =
      folder.images.index_select(0, order).to(torch::kFloat).div(255.0).sub(mean).div(std);
  EXPECT_TRUE(torch::equal(a.data, expected));
  EXPECT_EQ(a.data.sizes(), (std::vector<int64_t>{21, 3, 32, 32}));
  EXPECT_TRUE(torch::equal(a.target, folder.labels.index_select(0, order)));
  EXPECT_THROW(lazy.get_batch(torch::tensor({21}, torch::kLong)), InvalidArgument);
}

/// The DataError message of reading `root`, or "" when it reads.
std::string error_of(const fs::path& root) {
  try {
    Cifar10 dataset(root.string(), /*train=*/true);
  } catch (const DataError& e) {
    return e.what();
  }
  return "";
}

TEST(Cifar10, MalformedFilesGetOneLineNamingTheFile) {
  CifarFolder folder("cifar_bad", {3, 3}, 2);
  const fs::path second = folder.root / "data_batch_2.bin";
  fs::resize_file(second, 3 * 3073 - 1);
  std::string message = error_of(folder.root);
  EXPECT_NE(message.find(second.string() + ": 9218 bytes is not a whole number of 3073-byte "
                                           "records (record 2 is cut short after 3072 bytes)"),
            std::string::npos)
      << message;
  EXPECT_EQ(message.find('\n'), std::string::npos);
  fs::resize_file(second, 0);
  EXPECT_NE(error_of(folder.root).find("is empty"), std::string::npos);
  fs::remove(second);
  EXPECT_EQ(error_of(folder.root), "");  // data_batch_1 alone is a training split
  {
    std::fstream file(folder.root / "data_batch_1.bin", std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(2 * 3073);
    file.put(static_cast<char>(200));
  }
  message = error_of(folder.root);
  EXPECT_NE(message.find("record 2 has label 200, outside 0-9"), std::string::npos) << message;
  EXPECT_NE(error_of(folder.root / "missing").find("no CIFAR-10 training files"), std::string::npos);
  EXPECT_FALSE(Cifar10::present((folder.root / "missing").string()));
  EXPECT_TRUE(Cifar10::present(folder.root.string()));
}

TEST(Cifar10, ALazyDatasetThroughTheTrainerGivesTheInMemoryWeights) {
  CifarFolder folder("cifar_train", {40, 24}, 16);
  const Cifar10 lazy(folder.root.string(), /*train=*/true);
  const Cifar10 lazy_test(folder.root.string(), /*train=*/false);
  // The in-memory path: the whole split as two tensors, fit(TensorData).
  const Batch all = lazy.get_batch(torch::arange(lazy.size(), torch::kLong));
  const Batch test_all = lazy_test.get_batch(torch::arange(lazy_test.size(), torch::kLong));
  train::TrainOptions options;
  options.model = "cnn";
  options.seed = 9;
  options.batch_size = 8;
  options.epochs = 2;
  options.lr = 0.01;
  options.momentum = 0.9;
  options.threads = 1;
  options.progress = train::ProgressMode::kNone;
  options.log_interval = 0;
  const models::InputShape shape{3, 32, 32, 10};
  auto reference = models::create("cnn", options.seed, shape);
  train::Trainer in_memory(options, reference);
  const train::TrainResult expected =
      in_memory.fit(train::TensorData{all.data, all.target}, train::TensorData{test_all.data, test_all.target});

  options.num_workers = 2;
  options.prefetch_factor = 3;
  auto model = models::create("cnn", options.seed, shape);
  train::Trainer lazily(options, model);
  const train::TrainResult got = lazily.fit(lazy, &lazy_test);
  const auto a = reference->named_parameters();
  const auto b = model->named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(torch::equal(a[i].value(), b[i].value())) << a[i].key();
  }
  ASSERT_EQ(got.epochs.size(), 2u);
  EXPECT_EQ(got.epochs[1].test_loss, expected.epochs[1].test_loss);
  EXPECT_EQ(got.epochs[1].test_accuracy, expected.epochs[1].test_accuracy);
}

}  // namespace test_data_loader
}  // namespace shoal::data
