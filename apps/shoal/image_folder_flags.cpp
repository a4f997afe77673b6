// `shoal train`'s flags for a folder of images (--data-dir DIR holding class folders): the
// torchvision transforms of data::ImageTransforms. Each flag's text is parsed by one function that
// both checks it (CLI11's check: an error names the flag) and fills the options (each()).
#include <cmath>
#include <cstdlib>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "commands.h"
#include "shoal/data/image_folder.h"

namespace shoal::cli {
namespace {

/// A whole decimal number > 0, or nullopt.
std::optional<int64_t> positive(const std::string& text) {
  if (text.empty() || text.size() > 9 || text.find_first_not_of("0123456789") != std::string::npos)
    return std::nullopt;
  const int64_t value = std::stoll(text);
  if (value <= 0) return std::nullopt;
  return value;
}

/// "N" or "HxW" into {H, W}.
std::optional<std::pair<int64_t, int64_t>> parse_size(const std::string& text) {
  const size_t x = text.find('x');
  const std::optional<int64_t> h = positive(text.substr(0, x));
  const std::optional<int64_t> w = x == std::string::npos ? h : positive(text.substr(x + 1));
  if (!h || !w) return std::nullopt;
  return std::make_pair(*h, *w);
}

/// "N" or "N:PAD" into {N, PAD}.
std::optional<std::pair<int64_t, int64_t>> parse_crop(const std::string& text) {
  const size_t colon = text.find(':');
  const std::optional<int64_t> size = positive(text.substr(0, colon));
  if (!size) return std::nullopt;
  if (colon == std::string::npos) return std::make_pair(*size, int64_t{0});
  const std::string pad = text.substr(colon + 1);
  if (pad == "0") return std::make_pair(*size, int64_t{0});
  const std::optional<int64_t> padding = positive(pad);
  if (!padding) return std::nullopt;
  return std::make_pair(*size, *padding);
}

/// Six comma-separated numbers: three means, then three standard deviations (> 0).
std::optional<std::vector<double>> parse_normalize(const std::string& text) {
  std::vector<double> values;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ',')) {
    char* end = nullptr;
    const double value = std::strtod(item.c_str(), &end);
    if (item.empty() || *end != '\0' || !std::isfinite(value)) return std::nullopt;
    values.push_back(value);
  }
  if (values.size() != 6 || values[3] <= 0 || values[4] <= 0 || values[5] <= 0) return std::nullopt;
  return values;
}

}  // namespace

void add_image_folder_options(CLI::App& app, data::ImageFolderOptions& options) {
  data::ImageTransforms& t = options.transforms;
  app.add_option_function<std::string>(
         "--image-size",
         [&t](const std::string& text) { t.resize = *parse_size(text); },
         "Folder of images: resize every image to N x N, or H x W (torchvision's Resize,\n"
         "bilinear)")
      ->type_name("N|HxW")
      ->check([](const std::string& text) {
        return parse_size(text) ? "" : "takes N or HxW (positive integers), got " + text;
      });
  app.add_option_function<std::string>(
         "--random-crop",
         [&t](const std::string& text) {
           const std::pair<int64_t, int64_t> crop = *parse_crop(text);
           t.crop = crop.first;
           t.crop_padding = crop.second;
         },
         "Folder of images: a random N x N crop after padding PAD zeros on every side\n"
         "(RandomCrop(N, padding=PAD)); the evaluation split takes the centre N x N")
      ->type_name("N[:PAD]")
      ->check([](const std::string& text) {
        return parse_crop(text) ? ""
                                : "takes N or N:PAD (N > 0, PAD >= 0), got " + text;
      });
  app.add_flag("--hflip", t.hflip,
               "Folder of images: mirror each training image left-right with probability 1/2");
  app.add_option_function<std::string>(
         "--normalize",
         [&t](const std::string& text) {
           const std::vector<double> values = *parse_normalize(text);
           t.mean.assign(values.begin(), values.begin() + 3);
           t.std.assign(values.begin() + 3, values.end());
         },
         "Folder of images: (x - mean) / std per channel, after scaling to [0, 1]\n"
         "(e.g. ImageNet's 0.485,0.456,0.406,0.229,0.224,0.225)")
      ->type_name("M1,M2,M3,S1,S2,S3")
      ->check([](const std::string& text) {
        return parse_normalize(text)
                   ? ""
                   : "takes six numbers m1,m2,m3,s1,s2,s3 (s > 0), got " + text;
      });
}

}  // namespace shoal::cli
