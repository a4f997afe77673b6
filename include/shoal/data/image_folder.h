// A folder of image files in torchvision's ImageFolder layout, decoded lazily, one sample at a
// time, in the DataLoader's workers: memory holds the batches the loader prefetches, never the
// dataset.
//
//   root/cat/0001.png
//   root/cat/more/0002.jpg      (files in subfolders of a class folder belong to the class)
//   root/dog/0003.jpeg
//
//   ImageFolderOptions options;
//   options.transforms.resize = {40, 40};
//   options.transforms.crop = 32;
//   options.transforms.crop_padding = 4;
//   options.transforms.hflip = true;
//   options.transforms.mean = {0.5, 0.5, 0.5};
//   options.transforms.std = {0.25, 0.25, 0.25};
//   ImageFolder images("root", options);
//   images.set_epoch(epoch);              // before each epoch's DataLoader
//   DataLoader loader(images, sampler_indices, loader_options);
//
// As torchvision: the classes are the sorted names of root's subfolders (index = position), a
// class's files are sorted (by folder, then name) and the classes' files follow each other in
// class order; a sample is its image converted to RGB (grey replicated, alpha dropped, palette
// expanded) as float [3, H, W] in [0, 1] (ToTensor), and its class index (int64). Files ending in
// .png, .jpg or .jpeg (any case) are images; other files are ignored. Symbolic links to files are
// followed, links to folders are not (a link cycle cannot make the scan endless).
//
// Transforms, in torchvision's order Resize, RandomCrop (or CenterCrop), RandomHorizontalFlip,
// ToTensor, Normalize. Resize is bilinear without antialiasing (torchvision's Resize on tensors with
// antialias=False, align_corners=False). The random ones draw from a generator seeded with
// (seed, epoch, sample index), so a sample's augmentation depends on neither the worker that
// decodes it nor the world size.
//
// Hostile files: the folder scan refuses entries that are neither files nor folders (a FIFO named
// x.png) and never opens them; a file is opened non-blocking and checked to be a regular file
// before it is read; dimensions are bounded before any pixel is allocated (kMaxSide, kMaxPixels);
// a file larger than kMaxFileBytes is refused unread. Every failure is a DataError of one line
// naming the file.
//
// Thread safety: get() and get_batch() may be called concurrently (the DataLoader's workers).
// set_epoch() must not race with them: call it between epochs, while no loader is running.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "shoal/data/batch_dataset.h"

namespace shoal::data {

/// What happens to each image after it is decoded, in this order; all off by default.
struct ImageTransforms {
  /// Resize to this {height, width} (torchvision's Resize((h, w))); {0, 0}: no fixed size.
  std::pair<int64_t, int64_t> resize{0, 0};
  /// Resize so that the shorter side is this long, keeping the aspect ratio (Resize(int)); 0: off.
  /// Not together with `resize`.
  int64_t resize_shorter = 0;
  /// A random crop of crop x crop pixels (RandomCrop(crop, padding=crop_padding)); 0: none.
  int64_t crop = 0;
  /// Zeros added on every side before the random crop.
  int64_t crop_padding = 0;
  /// Crop the centre instead of a random window (CenterCrop(crop), as evaluation does).
  bool center_crop = false;
  /// Mirror left-right with probability 1/2 (RandomHorizontalFlip()).
  bool hflip = false;
  /// Per-channel (x - mean[c]) / std[c] after scaling to [0, 1] (Normalize(mean, std)); empty: off.
  /// Three values each (or one, used for every channel).
  std::vector<double> mean;
  std::vector<double> std;

  /// These transforms without their random parts, for evaluation (torchvision's usual pair):
  /// the crop taken from the centre, without padding, and no flip.
  ImageTransforms evaluation() const;
};

struct ImageFolderOptions {
  ImageTransforms transforms;
  /// Seeds the random transforms, with the epoch and the sample's index.
  uint64_t seed = 0;
};

/// One image file and its class.
struct ImageSample {
  std::string path;
  int64_t target = 0;
};

class ImageFolder : public BatchDataset {
 public:
  /// Widest or tallest image decoded: a header claiming more is refused before allocating.
  static constexpr int64_t kMaxSide = 16384;
  /// Most pixels in one image (64 Mpixel: 192 MB of RGB), whatever its shape.
  static constexpr int64_t kMaxPixels = int64_t{64} << 20;
  /// Largest file read (compressed bytes); a PNG or JPEG this large is no training sample.
  static constexpr int64_t kMaxFileBytes = int64_t{256} << 20;

  /// Scans `root`. Throws DataError naming the folder when it is missing or has no class folders,
  /// or naming the class folder that holds no image; InvalidArgument for transforms that cannot
  /// work (e.g. a crop larger than the resized image is only known per image, and throws then).
  explicit ImageFolder(const std::string& root, ImageFolderOptions options = {});

  /// Whether `root` looks like an ImageFolder: a folder with a subfolder holding an image file.
  static bool looks_like(const std::string& root);

  int64_t size() const override { return static_cast<int64_t>(samples_.size()); }
  /// The transformed images [B, 3, H, W] float and their classes [B] int64; throws DataError when
  /// the images of one batch end up with different sizes (set a resize or a crop).
  Batch get_batch(const at::Tensor& indices) const override;
  /// One sample: the transformed image [3, H, W] float and its class (an int64 scalar).
  Batch get(int64_t index) const;

  /// Selects the epoch that seeds the random transforms.
  void set_epoch(int64_t epoch) const override { epoch_.store(epoch); }
  /// The class names, sorted; a class's index is its position.
  const std::vector<std::string>& classes() const { return classes_; }
  /// Every file and its class, in sample order.
  const std::vector<ImageSample>& samples() const { return samples_; }
  const std::string& root() const { return root_; }

 private:
  std::string root_;
  ImageFolderOptions options_;
  std::vector<std::string> classes_;
  std::vector<ImageSample> samples_;
  mutable std::atomic<int64_t> epoch_{0};  // see BatchDataset::set_epoch
};

/// The two splits of a folder of images.
struct ImageFolderSplits {
  std::unique_ptr<ImageFolder> train;
  std::unique_ptr<ImageFolder> test;  ///< null when the folder has no evaluation split
};

/// Whether `dir` holds image folders as open_image_folders() reads them.
bool image_folders_present(const std::string& dir);

/// DIR/train and DIR/val (or DIR/test) when DIR/train is an image folder (ImageNet's layout),
/// else DIR alone for training and no evaluation split. The evaluation split's transforms are
/// `options.transforms.evaluation()`. Throws DataError when the splits' classes differ.
ImageFolderSplits open_image_folders(const std::string& dir, const ImageFolderOptions& options);

/// The image in `path` (PNG or JPEG, told by its first bytes) as uint8 RGB [H, W, 3]. Throws
/// DataError naming the file when it is not a regular file, too large, or not a valid image.
at::Tensor decode_image(const std::string& path);

/// `image` (uint8 [H, W, 3]) through `transforms` as float [3, H', W'], its random choices drawn
/// from (seed, epoch, index).
at::Tensor transform_image(const at::Tensor& image, const ImageTransforms& transforms,
                           uint64_t seed, int64_t epoch, int64_t index);

}  // namespace shoal::data
