// decode_image: PNG through libpng, JPEG through libjpeg-turbo, both from the file's bytes in
// memory.
//
// Both libraries report errors by calling a handler that must not return. Throwing a C++ exception
// through their C frames is undefined, so the handlers longjmp back to a setjmp in a function of
// this file whose locals are all trivially destructible (nothing is skipped); the C++ objects that
// own the libraries' state and the pixels live in the callers, above that frame, and clean up as
// usual when the failure is then thrown as a DataError.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <jpeglib.h>
#include <jerror.h>
#include <png.h>

#include <cerrno>
#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <vector>

#include "shoal/data/image_folder.h"
#include "shoal/error.h"

namespace shoal::data {
namespace {

/// The whole file, read after checking that it is a regular file of a sane size. Opened
/// non-blocking, so that a FIFO put in place of the file cannot block the open.
std::vector<uint8_t> read_image_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) SHOAL_THROW(DataError, path, ": cannot open: ", std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat info {};
  if (::fstat(fd, &info) != 0) SHOAL_THROW(DataError, path, ": cannot stat: ", std::strerror(errno));
  SHOAL_CHECK_T(DataError, S_ISREG(info.st_mode), path, ": not a regular file (an image must be a "
                "file; FIFOs, devices and sockets are refused)");
  SHOAL_CHECK_T(DataError, info.st_size <= ImageFolder::kMaxFileBytes, path, ": ", info.st_size,
                " bytes, more than the ", ImageFolder::kMaxFileBytes, " an image may have");
  std::vector<uint8_t> bytes(static_cast<size_t>(info.st_size));
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t got = ::read(fd, bytes.data() + done, bytes.size() - done);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) SHOAL_THROW(DataError, path, ": read failed: ", std::strerror(errno));
    if (got == 0) break;
    done += static_cast<size_t>(got);
  }
  bytes.resize(done);
  return bytes;
}

void check_image_dimensions(const std::string& path, int64_t width, int64_t height) {
  SHOAL_CHECK_T(DataError, width > 0 && height > 0 && width <= ImageFolder::kMaxSide &&
                               height <= ImageFolder::kMaxSide &&
                               width * height <= ImageFolder::kMaxPixels,
                path, ": image of ", width, "x", height, " pixels refused (at most ",
                ImageFolder::kMaxSide, " a side and ", ImageFolder::kMaxPixels, " pixels)");
}

// ---- PNG ---------------------------------------------------------------------------------------

struct PngSource {
  const uint8_t* data;
  size_t size;
  size_t position;
  char message[200];
};

void png_fail(png_structp png, png_const_charp message) {
  auto* source = static_cast<PngSource*>(png_get_error_ptr(png));
  std::snprintf(source->message, sizeof source->message, "%s", message);
  png_longjmp(png, 1);
}

void png_ignore_warning(png_structp, png_const_charp) {}

void png_read_bytes(png_structp png, png_bytep out, size_t count) {
  auto* source = static_cast<PngSource*>(png_get_io_ptr(png));
  if (count > source->size - source->position) png_error(png, "file ends inside the image");
  std::memcpy(out, source->data + source->position, count);
  source->position += count;
}

/// Owns libpng's structures.
struct PngReader {
  png_structp png = nullptr;
  png_infop info = nullptr;
  PngSource source{};
  ~PngReader() { png_destroy_read_struct(&png, info != nullptr ? &info : nullptr, nullptr); }
};

/// Reads the header and asks for 8-bit RGB rows; false with reader->source.message on failure.
bool png_read_header(PngReader* reader, uint32_t* width, uint32_t* height) {
  png_structp png = reader->png;
  png_infop info = reader->info;
  if (setjmp(png_jmpbuf(png))) return false;
  png_set_read_fn(png, &reader->source, png_read_bytes);
  // libpng refuses larger headers itself, before allocating anything for the rows.
  png_set_user_limits(png, ImageFolder::kMaxSide, ImageFolder::kMaxSide);
  png_read_info(png, info);
  // PIL's convert("RGB"): palette expanded, grey replicated, alpha dropped, 16 bits to their
  // high byte.
  png_set_expand(png);
  png_set_strip_16(png);
  png_set_strip_alpha(png);
  png_set_gray_to_rgb(png);
  png_set_interlace_handling(png);
  png_read_update_info(png, info);
  *width = png_get_image_width(png, info);
  *height = png_get_image_height(png, info);
  if (png_get_rowbytes(png, info) != static_cast<size_t>(*width) * 3) {
    png_error(png, "does not convert to 8-bit RGB");
  }
  return true;
}

bool png_read_rows(PngReader* reader, png_bytep* rows) {
  if (setjmp(png_jmpbuf(reader->png))) return false;
  png_read_image(reader->png, rows);
  return true;
}

at::Tensor decode_png(const std::string& path, const std::vector<uint8_t>& bytes) {
  PngReader reader;
  reader.source = {bytes.data(), bytes.size(), 0, {0}};
  reader.png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &reader.source, png_fail,
                                      png_ignore_warning);
  SHOAL_CHECK_T(DataError, reader.png != nullptr, path, ": libpng could not start (out of memory?)");
  reader.info = png_create_info_struct(reader.png);
  SHOAL_CHECK_T(DataError, reader.info != nullptr, path, ": libpng could not start (out of memory?)");
  uint32_t width = 0;
  uint32_t height = 0;
  if (!png_read_header(&reader, &width, &height)) {
    SHOAL_THROW(DataError, path, ": not a valid PNG: ", reader.source.message);
  }
  check_image_dimensions(path, width, height);
  at::Tensor image = at::empty({height, width, 3}, at::kByte);
  std::vector<png_bytep> rows(height);
  for (uint32_t y = 0; y < height; ++y) rows[y] = image.data_ptr<uint8_t>() + size_t{y} * width * 3;
  if (!png_read_rows(&reader, rows.data())) {
    SHOAL_THROW(DataError, path, ": not a valid PNG: ", reader.source.message);
  }
  return image;
}

// ---- JPEG --------------------------------------------------------------------------------------

struct JpegErrors {
  jpeg_error_mgr manager;  // first: libjpeg hands back a pointer to it
  jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
};

void jpeg_fail(j_common_ptr jpeg) {
  auto* errors = reinterpret_cast<JpegErrors*>(jpeg->err);
  (*jpeg->err->format_message)(jpeg, errors->message);
  std::longjmp(errors->jump, 1);
}

/// Warnings pass (PIL ignores them too: "extraneous bytes before marker" is common in real data
/// sets), except a file cut short, which libjpeg would fill with grey and PIL refuses.
void jpeg_message(j_common_ptr jpeg, int level) {
  if (level < 0 && jpeg->err->msg_code == JWRN_JPEG_EOF) jpeg_fail(jpeg);
}

/// Owns libjpeg's structures.
struct JpegReader {
  jpeg_decompress_struct jpeg{};
  JpegErrors errors{};
  ~JpegReader() { jpeg_destroy_decompress(&jpeg); }
};

bool jpeg_read_header_rgb(JpegReader* reader, const std::vector<uint8_t>* bytes, uint32_t* width,
                          uint32_t* height) {
  j_decompress_ptr jpeg = &reader->jpeg;
  jpeg->err = jpeg_std_error(&reader->errors.manager);
  reader->errors.manager.error_exit = jpeg_fail;
  reader->errors.manager.emit_message = jpeg_message;
  if (setjmp(reader->errors.jump)) return false;
  jpeg_create_decompress(jpeg);
  jpeg_mem_src(jpeg, bytes->data(), static_cast<unsigned long>(bytes->size()));
  jpeg_read_header(jpeg, TRUE);
  jpeg->out_color_space = JCS_RGB;
  *width = jpeg->image_width;
  *height = jpeg->image_height;
  return true;
}

bool jpeg_read_rows(JpegReader* reader, uint8_t* pixels, uint32_t width, uint32_t height) {
  j_decompress_ptr jpeg = &reader->jpeg;
  if (setjmp(reader->errors.jump)) return false;
  jpeg_start_decompress(jpeg);
  if (jpeg->output_width != width || jpeg->output_height != height ||
      jpeg->output_components != 3) {
    std::snprintf(reader->errors.message, sizeof reader->errors.message,
                  "decodes to %ux%u pixels of %d channels, not RGB", jpeg->output_width,
                  jpeg->output_height, jpeg->output_components);
    return false;
  }
  while (jpeg->output_scanline < height) {
    JSAMPROW row = pixels + static_cast<size_t>(jpeg->output_scanline) * width * 3;
    jpeg_read_scanlines(jpeg, &row, 1);
  }
  jpeg_finish_decompress(jpeg);
  return true;
}

at::Tensor decode_jpeg(const std::string& path, const std::vector<uint8_t>& bytes) {
  JpegReader reader;
  uint32_t width = 0;
  uint32_t height = 0;
  if (!jpeg_read_header_rgb(&reader, &bytes, &width, &height)) {
    SHOAL_THROW(DataError, path, ": not a valid JPEG: ", reader.errors.message);
  }
  check_image_dimensions(path, width, height);
  at::Tensor image = at::empty({height, width, 3}, at::kByte);
  if (!jpeg_read_rows(&reader, image.data_ptr<uint8_t>(), width, height)) {
    SHOAL_THROW(DataError, path, ": not a valid JPEG: ", reader.errors.message);
  }
  return image;
}

}  // namespace

at::Tensor decode_image(const std::string& path) {
  const std::vector<uint8_t> bytes = read_image_file(path);
  static constexpr uint8_t kPng[] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  static constexpr uint8_t kJpeg[] = {0xff, 0xd8, 0xff};
  if (bytes.size() >= sizeof kPng && std::memcmp(bytes.data(), kPng, sizeof kPng) == 0) {
    return decode_png(path, bytes);
  }
  if (bytes.size() >= sizeof kJpeg && std::memcmp(bytes.data(), kJpeg, sizeof kJpeg) == 0) {
    return decode_jpeg(path, bytes);
  }
  SHOAL_THROW(DataError, path, ": neither a PNG nor a JPEG file (", bytes.size(),
              " bytes; its first bytes are not either's signature)");
}

}  // namespace shoal::data
