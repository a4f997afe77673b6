#include "shoal/data/image_folder.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "shoal/error.h"

namespace shoal::data {
namespace {

namespace fs = std::filesystem;

/// Folders deeper than this under a class folder are not scanned: no real data set nests further,
/// and a bound keeps a hostile tree from exhausting the stack.
constexpr int kMaxDepth = 32;

bool has_image_extension(const std::string& name) {
  std::string lower = name;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  for (const char* extension : {".png", ".jpg", ".jpeg"}) {
    const size_t n = std::strlen(extension);
    if (lower.size() > n && lower.compare(lower.size() - n, n, extension) == 0) return true;
  }
  return false;
}

/// The entries of `folder`, sorted by name (Python's sorted() of str: code point order is UTF-8's
/// byte order).
std::vector<fs::directory_entry> sorted_entries(const fs::path& folder) {
  std::vector<fs::directory_entry> entries;
  try {
    for (const fs::directory_entry& entry : fs::directory_iterator(folder)) entries.push_back(entry);
  } catch (const fs::filesystem_error& e) {
    SHOAL_THROW(DataError, folder.string(), ": cannot list the folder: ", e.code().message());
  }
  std::sort(entries.begin(), entries.end(),
            [](const auto& a, const auto& b) { return a.path().filename() < b.path().filename(); });
  return entries;
}

/// The images under `folder` as (folder, name) pairs, not following links to folders.
void collect_images(const fs::path& folder, int depth,
                    std::vector<std::pair<std::string, std::string>>& found) {
  SHOAL_CHECK_T(DataError, depth <= kMaxDepth, folder.string(), ": folders nested more than ",
                kMaxDepth, " deep under a class folder");
  for (const fs::directory_entry& entry : sorted_entries(folder)) {
    std::error_code error;
    const fs::file_status own = entry.symlink_status(error);
    if (own.type() == fs::file_type::directory) {
      collect_images(entry.path(), depth + 1, found);
      continue;
    }
    const std::string name = entry.path().filename().string();
    if (!has_image_extension(name)) continue;
    const fs::file_status target = entry.status(error);
    if (target.type() == fs::file_type::directory) continue;  // a link to a folder: not followed
    SHOAL_CHECK_T(DataError, target.type() == fs::file_type::regular, entry.path().string(),
                  ": not a regular file (FIFOs, devices, sockets and dangling links are refused)");
    found.emplace_back(folder.string(), name);
  }
}

/// splitmix64: a well-mixed 64-bit sequence from any seed, cheap enough to seed per sample.
struct SplitMix64 {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  /// Uniform in [0, n) (the modulo bias is below 2^-40 for any image size).
  int64_t below(int64_t n) { return static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }
};

SplitMix64 sample_generator(uint64_t seed, int64_t epoch, int64_t index) {
  SplitMix64 mix{seed};
  mix.state = mix.next() ^ static_cast<uint64_t>(epoch);
  mix.state = mix.next() ^ static_cast<uint64_t>(index);
  return SplitMix64{mix.next()};
}

/// torchvision's Resize(int) output size: the shorter side to `size`, the longer one scaled and
/// truncated.
std::pair<int64_t, int64_t> shorter_side_size(int64_t height, int64_t width, int64_t size) {
  if (width <= height) {
    return {static_cast<int64_t>(static_cast<double>(size) * height / width), size};
  }
  return {size, static_cast<int64_t>(static_cast<double>(size) * width / height)};
}

/// Bilinear resize of float [3, H, W] holding 0..255, rounded back to whole values as torchvision
/// rounds a uint8 tensor's.
at::Tensor resize_bilinear(const at::Tensor& image, int64_t height, int64_t width) {
  if (image.size(1) == height && image.size(2) == width) return image;
  return at::upsample_bilinear2d(image.unsqueeze(0), {height, width}, /*align_corners=*/false)
      .squeeze(0)
      .round_()
      .clamp_(0, 255);
}

at::Tensor random_crop(const at::Tensor& image, int64_t size, int64_t padding, SplitMix64& random) {
  at::Tensor padded = image;
  if (padding > 0) padded = at::constant_pad_nd(image, {padding, padding, padding, padding}, 0);
  const int64_t height = padded.size(1);
  const int64_t width = padded.size(2);
  SHOAL_CHECK_T(InvalidArgument, height >= size && width >= size, "random crop of ", size, "x",
                size, " is larger than the image (", height, "x", width, " after padding)");
  const int64_t top = random.below(height - size + 1);
  const int64_t left = random.below(width - size + 1);
  return padded.slice(1, top, top + size).slice(2, left, left + size);
}

/// torchvision's CenterCrop: the offsets rounded half to even, as Python's round().
at::Tensor center_crop(const at::Tensor& image, int64_t size) {
  const int64_t height = image.size(1);
  const int64_t width = image.size(2);
  SHOAL_CHECK_T(InvalidArgument, height >= size && width >= size, "centre crop of ", size, "x",
                size, " is larger than the image (", height, "x", width, ")");
  const auto top = static_cast<int64_t>(std::nearbyint((height - size) / 2.0));
  const auto left = static_cast<int64_t>(std::nearbyint((width - size) / 2.0));
  return image.slice(1, top, top + size).slice(2, left, left + size);
}

at::Tensor per_channel(const std::vector<double>& values) {
  const std::vector<double> three = values.size() == 1 ? std::vector<double>(3, values[0]) : values;
  return at::tensor(three, at::kDouble).to(at::kFloat).view({3, 1, 1});
}

void check_transforms(const ImageTransforms& t) {
  SHOAL_CHECK_T(InvalidArgument, t.resize.first >= 0 && t.resize.second >= 0 &&
                                     (t.resize.first > 0) == (t.resize.second > 0),
                "ImageTransforms: resize must be two sizes > 0, or {0, 0} for none");
  SHOAL_CHECK_T(InvalidArgument, t.resize_shorter >= 0 && t.crop >= 0 && t.crop_padding >= 0,
                "ImageTransforms: resize_shorter, crop and crop_padding must be >= 0");
  SHOAL_CHECK_T(InvalidArgument, t.resize_shorter == 0 || t.resize.first == 0,
                "ImageTransforms: resize and resize_shorter are exclusive");
  SHOAL_CHECK_T(InvalidArgument, t.crop_padding == 0 || t.crop > 0,
                "ImageTransforms: crop_padding needs a crop");
  SHOAL_CHECK_T(InvalidArgument, t.mean.size() == t.std.size() &&
                                     (t.mean.empty() || t.mean.size() == 1 || t.mean.size() == 3),
                "ImageTransforms: mean and std need 1 or 3 values each, got ", t.mean.size(),
                " and ", t.std.size());
  for (const double s : t.std) {
    SHOAL_CHECK_T(InvalidArgument, s > 0, "ImageTransforms: std must be > 0, got ", s);
  }
}

}  // namespace

at::Tensor transform_image(const at::Tensor& image, const ImageTransforms& transforms,
                           uint64_t seed, int64_t epoch, int64_t index) {
  SplitMix64 random = sample_generator(seed, epoch, index);
  at::Tensor x = image.permute({2, 0, 1}).to(at::kFloat);  // [3, H, W], 0..255
  if (transforms.resize.first > 0) {
    x = resize_bilinear(x, transforms.resize.first, transforms.resize.second);
  } else if (transforms.resize_shorter > 0) {
    const auto [height, width] = shorter_side_size(x.size(1), x.size(2), transforms.resize_shorter);
    x = resize_bilinear(x, height, width);
  }
  if (transforms.crop > 0 && transforms.center_crop) {
    x = center_crop(x, transforms.crop);
  } else if (transforms.crop > 0) {
    x = random_crop(x, transforms.crop, transforms.crop_padding, random);
  }
  // Drawn whether or not it is used, so that turning the flip on or off changes no other draw.
  const bool flip = (random.next() >> 63) != 0;
  if (transforms.hflip && flip) x = x.flip({2});
  x = x.div(255.0);
  if (!transforms.mean.empty()) {
    x = x.sub_(per_channel(transforms.mean)).div_(per_channel(transforms.std));
  }
  return x.contiguous();
}

ImageTransforms ImageTransforms::evaluation() const {
  ImageTransforms fixed = *this;
  fixed.center_crop = true;
  fixed.crop_padding = 0;
  fixed.hflip = false;
  return fixed;
}

ImageFolder::ImageFolder(const std::string& root, ImageFolderOptions options)
    : root_(root), options_(std::move(options)) {
  check_transforms(options_.transforms);
  std::error_code error;
  SHOAL_CHECK_T(DataError, fs::is_directory(root, error), root, ": no such folder (an image folder "
                "holds one folder per class: ROOT/CLASS/*.png|jpg|jpeg)");
  // As torchvision, a class folder may be a link to a folder; below it, links to folders are not
  // followed, so no link cycle can make the scan endless.
  for (const fs::directory_entry& entry : sorted_entries(root)) {
    if (entry.is_directory(error)) classes_.push_back(entry.path().filename().string());
  }
  SHOAL_CHECK_T(DataError, !classes_.empty(), root, ": no class folders (an image folder holds one "
                "folder per class: ROOT/CLASS/*.png|jpg|jpeg)");
  for (size_t c = 0; c < classes_.size(); ++c) {
    const fs::path folder = fs::path(root) / classes_[c];
    std::vector<std::pair<std::string, std::string>> images;
    collect_images(folder, 0, images);
    SHOAL_CHECK_T(DataError, !images.empty(), folder.string(), ": class folder holds no .png, "
                  ".jpg or .jpeg file (remove it or add its images)");
    std::sort(images.begin(), images.end());  // torchvision: sorted(os.walk()), then sorted names
    for (const auto& [dir, name] : images) {
      samples_.push_back({(fs::path(dir) / name).string(), static_cast<int64_t>(c)});
    }
  }
}

bool ImageFolder::looks_like(const std::string& root) {
  std::error_code error;
  for (fs::directory_iterator it(root, error), end; !error && it != end; it.increment(error)) {
    if (!it->is_directory(error)) continue;
    for (fs::directory_iterator file(it->path(), error); !error && file != end;
         file.increment(error)) {
      if (has_image_extension(file->path().filename().string())) return true;
    }
    error.clear();
  }
  return false;
}

bool image_folders_present(const std::string& dir) {
  return ImageFolder::looks_like(dir) || ImageFolder::looks_like(dir + "/train");
}

ImageFolderSplits open_image_folders(const std::string& dir, const ImageFolderOptions& options) {
  ImageFolderSplits splits;
  if (!ImageFolder::looks_like(dir + "/train")) {
    splits.train = std::make_unique<ImageFolder>(dir, options);
    return splits;
  }
  splits.train = std::make_unique<ImageFolder>(dir + "/train", options);
  ImageFolderOptions evaluation = options;
  evaluation.transforms = options.transforms.evaluation();
  for (const char* name : {"/val", "/test"}) {
    std::error_code error;
    if (!fs::is_directory(dir + name, error)) continue;
    splits.test = std::make_unique<ImageFolder>(dir + name, evaluation);
    SHOAL_CHECK_T(DataError, splits.test->classes() == splits.train->classes(), dir, name,
                  ": its ", splits.test->classes().size(), " class folders are not the ",
                  splits.train->classes().size(), " of ", dir, "/train (the same names are "
                  "needed, so that a class has one index)");
    break;
  }
  return splits;
}

Batch ImageFolder::get(int64_t index) const {
  SHOAL_CHECK_T(InvalidArgument, index >= 0 && index < size(), root_, ": sample ", index,
                " out of range [0, ", size(), ")");
  const ImageSample& sample = samples_[static_cast<size_t>(index)];
  const at::Tensor image = decode_image(sample.path);
  at::Tensor x;
  try {
    x = transform_image(image, options_.transforms, options_.seed, epoch_.load(), index);
  } catch (const c10::Error& e) {
    SHOAL_THROW(DataError, sample.path, ": ", e.what_without_backtrace());  // one line
  } catch (const std::exception& e) {
    SHOAL_THROW(DataError, sample.path, ": ", e.what());
  }
  return {x, at::scalar_tensor(sample.target, at::kLong)};
}

Batch ImageFolder::get_batch(const at::Tensor& indices) const {
  const at::Tensor cpu = indices.to(at::kLong).contiguous();
  const int64_t* index = cpu.data_ptr<int64_t>();
  std::vector<at::Tensor> inputs;
  std::vector<at::Tensor> targets;
  for (int64_t i = 0; i < cpu.numel(); ++i) {
    Batch sample = get(index[i]);
    if (!inputs.empty() && sample.data.sizes() != inputs.front().sizes()) {
      SHOAL_THROW(DataError, samples_[static_cast<size_t>(index[i])].path, ": image of ",
                  sample.data.size(1), "x", sample.data.size(2), " in a batch with ",
                  samples_[static_cast<size_t>(index[0])].path, " of ", inputs.front().size(1),
                  "x", inputs.front().size(2), " (set a resize or a crop so that they match)");
    }
    inputs.push_back(std::move(sample.data));
    targets.push_back(std::move(sample.target));
  }
  return {at::stack(inputs), at::stack(targets)};
}

}  // namespace shoal::data
