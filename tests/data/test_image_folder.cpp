// ImageFolder: a folder of PNG and JPEG files of 3 classes that Python's PIL writes, read in
// torchvision's class and file order and decoded to PIL's pixels; the transforms (flip mirrors,
// crop windows, normalised values, the same augmentation for any number of workers); the ranks'
// exactly-once shares; hostile files (corrupt, truncated, huge headers, a FIFO, a link cycle, an
// empty folder, a class with no image) as one line naming the file; and an epoch read under a
// memory cgroup limit smaller than the decoded data set.
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "shoal/data/data_loader.h"
#include "shoal/data/distributed_sampler.h"
#include "shoal/data/image_folder.h"
#include "shoal/error.h"
#include "testing/child_process.h"
#include "testing/dependencies.h"
#include "testing/idx_files.h"
#include "testing/memory_cgroup.h"
#include "testing/multi_rank.h"
#include "testing/python.h"

namespace shoal::data {
namespace test_image_folder {

namespace fs = std::filesystem;

// Writes ROOT/{ant,bee,cat}/ (created out of order), PNG of every PIL mode and JPEG (RGB, grey),
// some in a subfolder, a .txt ignored, an upper-case .JPG; then ROOT.index: one line per image in
// torchvision's order (sorted classes; sorted(os.walk()) then sorted names), "path class h w",
// and ROOT.pixels: PIL's convert("RGB") bytes of each, one after the other.
constexpr const char* kWriter = R"(
import os, sys, random
try:
    from PIL import Image
except ImportError:
    sys.exit(77)
root, per_class, side = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(5)
for c in ["cat", "ant", "bee"]:
    os.makedirs(os.path.join(root, c, "more"))
    open(os.path.join(root, c, "notes.txt"), "w").write("not an image")
    for k in range(per_class):
        w, h = (side, side) if side else (rng.randint(17, 40), rng.randint(17, 40))
        px = rng.randbytes(w * h * 3)
        img = Image.frombytes("RGB", (w, h), px)
        mode = ["RGB", "L", "RGBA", "P", "LA"][k % 5]
        folder = os.path.join(root, c, "more" if k % 7 == 0 else "")
        if k % 2:
            ext = ".JPG" if k % 3 == 0 else ".jpg"
            img.convert("L" if mode == "L" else "RGB").save(os.path.join(folder, "%03d%s" % (k, ext)), quality=90)
        else:
            img.convert(mode).save(os.path.join(folder, "%03d.png" % k))
classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
with open(root + ".index", "w") as index, open(root + ".pixels", "wb") as pixels:
    for i, c in enumerate(classes):
        for dirpath, _, names in sorted(os.walk(os.path.join(root, c))):
            for name in sorted(names):
                if not name.lower().endswith((".png", ".jpg", ".jpeg")):
                    continue
                path = os.path.join(dirpath, name)
                rgb = Image.open(path).convert("RGB")
                index.write("%s %d %d %d\n" % (path, i, rgb.height, rgb.width))
                pixels.write(rgb.tobytes())
print("ORACLE OK wrote", root)
)";

struct Written {
  std::string root;
  std::vector<ImageSample> samples;
  std::vector<at::Tensor> pixels;  // uint8 [H, W, 3], PIL's
};

/// A folder written by kWriter: `per_class` images a class, of random sizes (side 0) or side x side.
Written write_folder(int per_class, int side = 0) {
  Written written;
  written.root = testing::make_temp_dir("shoal-images") + "/root";
  const std::string script = written.root + ".py";
  std::ofstream(script) << kWriter;
  const testing::PythonResult result = testing::run_python(
      {script, written.root, std::to_string(per_class), std::to_string(side)});
  if (result.exit_code == 77) return {};
  EXPECT_TRUE(testing::oracle_succeeded(result));
  std::ifstream index(written.root + ".index");
  std::ifstream pixels(written.root + ".pixels", std::ios::binary);
  std::string path;
  int64_t target = 0, height = 0, width = 0;
  while (index >> path >> target >> height >> width) {
    written.samples.push_back({path, target});
    at::Tensor image = at::empty({height, width, 3}, at::kByte);
    pixels.read(reinterpret_cast<char*>(image.data_ptr<uint8_t>()), image.numel());
    written.pixels.push_back(image);
  }
  return written;
}

bool pil_present() {
  return testing::run_python_code("import PIL").exit_code == 0;
}

#define SKIP_WITHOUT_PIL()                                                                     \
  SHOAL_SKIP_UNLESS(pil_present(), testing::Dependency::kPythonTorch,                          \
                    "/usr/bin/python3 has no PIL (Debian's python3-pil) to write the images")

/// What `fn` threw, "" when it did not throw.
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

bool one_line_naming(const std::string& message, const std::string& name) {
  return message.find(name) != std::string::npos && message.find('\n') == std::string::npos;
}

TEST(ImageFolder, ClassesFilesAndPixelsAreTorchvisionsAndPils) {
  SKIP_WITHOUT_PIL();
  const Written written = write_folder(70);
  ASSERT_EQ(written.samples.size(), 3u * 70u);
  const ImageFolder images(written.root);
  EXPECT_EQ(images.classes(), (std::vector<std::string>{"ant", "bee", "cat"}));
  ASSERT_EQ(images.size(), 210);
  int64_t jpeg_max_difference = 0;
  for (size_t i = 0; i < written.samples.size(); ++i) {
    const ImageSample& sample = images.samples()[i];
    EXPECT_EQ(fs::path(sample.path), fs::path(written.samples[i].path)) << i;
    EXPECT_EQ(sample.target, written.samples[i].target) << sample.path;
    const at::Tensor decoded = decode_image(sample.path);
    ASSERT_EQ(decoded.sizes(), written.pixels[i].sizes()) << sample.path;
    const int64_t difference =
        (decoded.to(at::kInt) - written.pixels[i].to(at::kInt)).abs().max().item<int64_t>();
    if (sample.path.find(".png") != std::string::npos) {
      EXPECT_EQ(difference, 0) << sample.path;
    } else {
      jpeg_max_difference = std::max(jpeg_max_difference, difference);
    }
    // The sample without transforms: ToTensor's [3, H, W] in [0, 1], and its class.
    const Batch got = images.get(static_cast<int64_t>(i));
    EXPECT_TRUE(torch::allclose(got.data, written.pixels[i].permute({2, 0, 1}).to(at::kFloat) / 255.0));
    EXPECT_EQ(got.target.item<int64_t>(), written.samples[i].target);
  }
  // PIL's wheel may carry another libjpeg-turbo than Debian's; the same IDCT gives the same pixels
  // up to rounding.
  EXPECT_LE(jpeg_max_difference, 1);
}

TEST(ImageFolder, TransformsFlipCropAndNormalise) {
  SKIP_WITHOUT_PIL();
  const Written written = write_folder(5, 24);
  const ImageFolder plain(written.root);
  const std::vector<double> mean{0.5, 0.4, 0.3};
  const std::vector<double> std{0.2, 0.25, 0.5};

  ImageFolderOptions flipping;
  flipping.transforms.hflip = true;
  const ImageFolder flipped(written.root, flipping);
  int mirrored = 0;
  for (int64_t i = 0; i < flipped.size(); ++i) {
    const at::Tensor x = plain.get(i).data;
    const at::Tensor y = flipped.get(i).data;
    const bool is_mirror = torch::equal(y, x.flip({2}));
    EXPECT_TRUE(is_mirror || torch::equal(y, x)) << i;
    mirrored += is_mirror;
  }
  EXPECT_GT(mirrored, 0);
  EXPECT_LT(mirrored, flipped.size());

  ImageFolderOptions cropping;
  cropping.transforms.crop = 20;
  cropping.transforms.crop_padding = 4;
  const ImageFolder cropped(written.root, cropping);
  std::set<std::pair<int64_t, int64_t>> corners;
  for (int64_t i = 0; i < cropped.size(); ++i) {
    const at::Tensor y = cropped.get(i).data;
    ASSERT_EQ(y.sizes(), (at::IntArrayRef{3, 20, 20}));
    const at::Tensor padded = at::constant_pad_nd(plain.get(i).data, {4, 4, 4, 4}, 0);
    bool found = false;
    for (int64_t top = 0; top <= 12 && !found; ++top) {
      for (int64_t left = 0; left <= 12 && !found; ++left) {
        if (torch::equal(y, padded.slice(1, top, top + 20).slice(2, left, left + 20))) {
          found = true;
          corners.insert({top, left});
        }
      }
    }
    EXPECT_TRUE(found) << "crop " << i << " is no window of the padded image";
  }
  EXPECT_GT(corners.size(), 3u);

  ImageFolderOptions normalising;
  normalising.transforms.mean = mean;
  normalising.transforms.std = std;
  const ImageFolder normalised(written.root, normalising);
  const at::Tensor m = torch::tensor(mean).to(at::kFloat).view({3, 1, 1});
  const at::Tensor s = torch::tensor(std).to(at::kFloat).view({3, 1, 1});
  for (int64_t i = 0; i < normalised.size(); ++i) {
    EXPECT_TRUE(torch::allclose(normalised.get(i).data, (plain.get(i).data - m) / s, 1e-6, 1e-6));
  }

  ImageFolderOptions resizing;
  resizing.transforms.resize = {12, 30};
  EXPECT_EQ(ImageFolder(written.root, resizing).get(0).data.sizes(), (at::IntArrayRef{3, 12, 30}));
  resizing.transforms.resize = {0, 0};
  resizing.transforms.resize_shorter = 16;
  EXPECT_EQ(ImageFolder(written.root, resizing).get(0).data.sizes(), (at::IntArrayRef{3, 16, 16}));
  // torchvision's Resize(int) of a 20 x 30 (h x w) image: 16 x int(16 * 30 / 20) = 16 x 24.
  const at::Tensor wide = at::zeros({20, 30, 3}, at::kByte);
  EXPECT_EQ(transform_image(wide, resizing.transforms, 0, 0, 0).sizes(),
            (at::IntArrayRef{3, 16, 24}));

  // CenterCrop of a 24 x 24 image to 15: offsets round(4.5) = 4 (half to even, as Python).
  ImageFolderOptions centred;
  centred.transforms.crop = 15;
  centred.transforms.crop_padding = 4;
  centred.transforms.hflip = true;
  centred.transforms = centred.transforms.evaluation();
  EXPECT_TRUE(torch::equal(ImageFolder(written.root, centred).get(1).data,
                           plain.get(1).data.slice(1, 4, 19).slice(2, 4, 19)));

  // A crop larger than an image: one line naming the image.
  ImageFolderOptions too_large;
  too_large.transforms.crop = 64;
  const std::string message = error_of([&] { ImageFolder(written.root, too_large).get(2); });
  EXPECT_TRUE(one_line_naming(message, written.samples[2].path) &&
              message.find("larger than the image") != std::string::npos)
      << message;

  ImageFolderOptions bad;
  bad.transforms.mean = {0.5};
  bad.transforms.std = {0};
  EXPECT_THROW(ImageFolder(written.root, bad), InvalidArgument);
}

TEST(ImageFolder, AugmentationIsTheSameForAnyWorkerCountAndChangesWithTheEpoch) {
  SKIP_WITHOUT_PIL();
  const Written written = write_folder(10, 24);
  ImageFolderOptions options;
  options.seed = 3;
  options.transforms.crop = 20;
  options.transforms.crop_padding = 2;
  options.transforms.hflip = true;
  options.transforms.mean = {0.5};
  options.transforms.std = {0.25};
  const ImageFolder folder(written.root, options);
  const BatchDataset& images = folder;  // the trainer's view: set_epoch through the interface
  const at::Tensor order = torch::randperm(images.size(), torch::kLong);
  auto epoch_of = [&](int workers, int64_t epoch) {
    images.set_epoch(epoch);
    DataLoaderOptions loading;
    loading.batch_size = 7;
    loading.num_workers = workers;
    DataLoader loader(images, order, loading);
    std::vector<at::Tensor> inputs;
    while (std::optional<Batch> batch = loader.next()) inputs.push_back(batch->data);
    return torch::cat(inputs);
  };
  const at::Tensor serial = epoch_of(0, 1);
  EXPECT_EQ(serial.sizes(), (at::IntArrayRef{30, 3, 20, 20}));
  EXPECT_TRUE(torch::equal(serial, epoch_of(3, 1)));
  EXPECT_FALSE(torch::equal(serial, epoch_of(2, 2)));
}

TEST(ImageFolder, RanksShareEveryImageExactlyOnce) {
  SKIP_WITHOUT_PIL();
  const Written written = write_folder(9, 24);
  const ImageFolder images(written.root);
  for (int world : {1, 2, 3}) {
    std::vector<int> seen(static_cast<size_t>(images.size()), 0);
    for (int rank = 0; rank < world; ++rank) {
      DistributedSamplerOptions sampling;
      sampling.seed = 11;
      DistributedSampler sampler(static_cast<size_t>(images.size()), rank, world, sampling);
      sampler.set_epoch(4);
      std::vector<int64_t> picked;
      for (size_t index : sampler.indices()) picked.push_back(static_cast<int64_t>(index));
      DataLoaderOptions loading;
      loading.batch_size = 4;
      loading.num_workers = 2;
      DataLoader loader(images, torch::tensor(picked, torch::kLong), loading);
      size_t at = 0;
      while (std::optional<Batch> batch = loader.next()) {
        for (int64_t k = 0; k < batch->data.size(0); ++k, ++at) {
          const int64_t index = picked[at];
          ++seen[static_cast<size_t>(index)];
          EXPECT_TRUE(torch::equal(batch->data[k], images.get(index).data)) << index;
          EXPECT_EQ(batch->target[k].item<int64_t>(), images.samples()[static_cast<size_t>(index)].target);
        }
      }
    }
    // 27 images: every one once over 1 and 3 ranks; 2 ranks pad one repeated image.
    int64_t total = 0;
    for (int count : seen) {
      EXPECT_GE(count, 1);
      total += count;
    }
    EXPECT_EQ(total, (images.size() + world - 1) / world * world) << world << " ranks";
  }
}

TEST(ImageFolder, CorruptTruncatedAndHugeImagesAreOneLineNamingTheFile) {
  SKIP_WITHOUT_PIL();
  const Written written = write_folder(3, 24);
  const std::string png = written.samples[0].path;  // 000.png of "ant"
  std::string jpeg;
  for (const ImageSample& s : written.samples) {
    if (s.path.find(".jpg") != std::string::npos) jpeg = s.path;
  }
  ASSERT_FALSE(jpeg.empty());
  // A PNG whose pixel data is garbage; a JPEG cut in half; a file that is neither.
  const std::string png_bytes = testing::read_file(png);
  std::string broken = png_bytes;
  for (size_t i = 60; i < broken.size(); ++i) broken[i] = static_cast<char>(i * 7);
  std::ofstream(png, std::ios::binary) << broken;
  const std::string jpeg_bytes = testing::read_file(jpeg);
  std::ofstream(jpeg, std::ios::binary) << jpeg_bytes.substr(0, jpeg_bytes.size() / 2);
  const std::string text = fs::path(png).parent_path().string() + "/text.png";
  std::ofstream(text) << "hello";
  for (const std::string& path : {png, jpeg, text}) {
    const std::string message = error_of([&] { decode_image(path); });
    EXPECT_TRUE(one_line_naming(message, path)) << message;
  }
  // Through the loader's workers: the batch's error, naming the file, from next().
  const ImageFolder images(written.root);
  DataLoaderOptions loading;
  loading.batch_size = 2;
  loading.num_workers = 2;
  DataLoader loader(images, torch::arange(images.size(), torch::kLong), loading);
  const std::string message = error_of([&] {
    while (loader.next()) {
    }
  });
  EXPECT_TRUE(one_line_naming(message, png)) << message;

  // Headers claiming 100000 x 100000 and 65000 x 65000 pixels: refused before any allocation.
  const std::string huge = testing::make_temp_dir("shoal-huge");
  const testing::PythonResult made = testing::run_python_code(
      "import struct, zlib, io\nfrom PIL import Image\n"
      "ihdr = struct.pack('>IIBBBBB', 100000, 100000, 8, 2, 0, 0, 0)\n"
      "chunk = lambda t, d: struct.pack('>I', len(d)) + t + d + struct.pack('>I', zlib.crc32(t + d))\n"
      "open('" + huge + "/big.png', 'wb').write(b'\\x89PNG\\r\\n\\x1a\\n' + chunk(b'IHDR', ihdr) + "
      "chunk(b'IDAT', zlib.compress(b'\\0' * 64)) + chunk(b'IEND', b''))\n"
      "out = io.BytesIO(); Image.new('RGB', (8, 8)).save(out, 'JPEG'); b = bytearray(out.getvalue())\n"
      "at = b.index(b'\\xff\\xc0'); b[at + 5:at + 9] = struct.pack('>HH', 65000, 65000)\n"
      "open('" + huge + "/big.jpg', 'wb').write(b)\n" + testing::closing_line_code("huge"));
  ASSERT_TRUE(testing::oracle_succeeded(made));
  for (const std::string name : {"/big.png", "/big.jpg"}) {
    const std::string big = error_of([&] { decode_image(huge + name); });
    EXPECT_TRUE(one_line_naming(big, huge + name)) << big;
  }
  EXPECT_NE(error_of([&] { decode_image(huge + "/big.jpg"); }).find("65000x65000"), std::string::npos);
}

TEST(ImageFolder, FifoLinkCycleEmptyFolderAndClassWithoutImages) {
  SKIP_WITHOUT_PIL();
  const Written written = write_folder(2, 20);
  // A link from a class folder to its parent: not followed, so the scan ends with the same files.
  fs::create_directory_symlink("..", written.root + "/bee/loop");
  EXPECT_EQ(ImageFolder(written.root).size(), 6);
  // A FIFO named like an image: refused by the scan, never opened (which would block).
  const std::string fifo = written.root + "/cat/fifo.png";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  std::string message = error_of([&] { ImageFolder images(written.root); });
  EXPECT_TRUE(one_line_naming(message, fifo)) << message;
  message = error_of([&] { decode_image(fifo); });
  EXPECT_TRUE(one_line_naming(message, fifo) && message.find("regular") != std::string::npos)
      << message;
  fs::remove(fifo);
  // A class folder holding no image (only its notes.txt).
  const std::string empty_class = written.root + "/dog";
  fs::create_directory(empty_class);
  std::ofstream(empty_class + "/notes.txt") << "none";
  message = error_of([&] { ImageFolder images(written.root); });
  EXPECT_TRUE(one_line_naming(message, empty_class)) << message;
  // A folder with no class folder at all; and one that does not exist.
  const std::string empty = testing::make_temp_dir("shoal-empty");
  message = error_of([&] { ImageFolder images(empty); });
  EXPECT_TRUE(one_line_naming(message, empty) && message.find("no class folders") != std::string::npos)
      << message;
  EXPECT_FALSE(ImageFolder::looks_like(empty));
  fs::remove_all(empty_class);
  EXPECT_TRUE(ImageFolder::looks_like(written.root));
}

TEST(ImageFolder, TrainAndValidationSplits) {
  SKIP_WITHOUT_PIL();
  const Written written = write_folder(2, 20);
  const std::string dir = fs::path(written.root).parent_path().string();
  // DIR itself is the image folder: train on it, no evaluation split.
  ImageFolderSplits splits = open_image_folders(written.root, {});
  EXPECT_EQ(splits.train->size(), 6);
  EXPECT_EQ(splits.test, nullptr);
  EXPECT_TRUE(image_folders_present(written.root));
  // DIR/train and DIR/val: the validation split without the random transforms.
  fs::rename(written.root, dir + "/train");
  fs::create_directories(dir + "/val");
  fs::copy(dir + "/train", dir + "/val", fs::copy_options::recursive);
  EXPECT_TRUE(image_folders_present(dir));
  ImageFolderOptions options;
  options.transforms.crop = 16;
  options.transforms.crop_padding = 2;
  options.transforms.hflip = true;
  splits = open_image_folders(dir, options);
  ASSERT_NE(splits.test, nullptr);
  EXPECT_EQ(splits.test->size(), 6);
  ImageFolderOptions centred;
  centred.transforms.crop = 16;
  centred.transforms.center_crop = true;
  EXPECT_TRUE(torch::equal(splits.test->get(0).data, ImageFolder(dir + "/val", centred).get(0).data));
  // A validation split with another class: one line naming it.
  fs::rename(dir + "/val/cat", dir + "/val/dog");
  const std::string message = error_of([&] { open_image_folders(dir, options); });
  EXPECT_TRUE(one_line_naming(message, dir + "/val")) << message;
}

// ---- memory ------------------------------------------------------------------------------------


TEST(ImageFolder, AnEpochLargerThanTheMemoryLimitIsReadUnderIt) {
  SKIP_WITHOUT_PIL();
  // 300 images of 256 x 256: 236 MB decoded as floats (180 MB cropped), 59 MB as bytes; the
  // limit is 64 MB.
  constexpr int64_t kLimitBytes = int64_t{64} << 20;
  testing::MemoryCgroup cgroup(kLimitBytes);
  SHOAL_SKIP_UNLESS(cgroup.made(), testing::Dependency::kOptional,
                    "no writable memory cgroup under this process's own (cgroup v1 memory or v2)");
  const Written written = write_folder(100, 256);
  ASSERT_EQ(written.samples.size(), 300u);
  ImageFolderOptions options;
  options.transforms.crop = 224;
  options.transforms.hflip = true;
  const ImageFolder images(written.root, options);
  const testing::ChildOutcome reader = testing::run_in_child([&]() -> std::string {
    if (!cgroup.enter()) return "could not enter the cgroup";
    at::set_num_threads(1);  // no OpenMP pool in a forked child
    DataLoaderOptions loading;
    loading.batch_size = 8;
    loading.num_workers = 2;
    DataLoader loader(images, torch::randperm(images.size(), torch::kLong), loading);
    int64_t seen = 0;
    while (std::optional<Batch> batch = loader.next()) {
      if (batch->data.sizes() != at::IntArrayRef{batch->data.size(0), 3, 224, 224}) return "bad batch";
      seen += batch->data.size(0);
    }
    return seen == images.size() ? "" : "read " + std::to_string(seen) + " images";
  });
  EXPECT_TRUE(reader.exited && reader.exit_code == 0 && reader.message.empty())
      << "signal " << reader.signal << ", exit " << reader.exit_code << ": " << reader.message;
  // The control: the decoded data set held in memory does not fit under the limit.
  const testing::ChildOutcome holder = testing::run_in_child([&]() -> std::string {
    if (!cgroup.enter()) return "could not enter the cgroup";
    at::set_num_threads(1);
    std::vector<at::Tensor> all;
    for (int64_t i = 0; i < images.size(); ++i) all.push_back(images.get(i).data);
    return "held " + std::to_string(all.size()) + " images";
  });
  EXPECT_FALSE(holder.exited) << holder.message;
  EXPECT_EQ(holder.signal, SIGKILL);
}

}  // namespace test_image_folder
}  // namespace shoal::data
