#include "plot_png.h"

#include "shoal/error.h"

#if SHOAL_HAVE_PNG
#include <cairo.h>
#include <librsvg/rsvg.h>

#include <memory>
#endif

namespace shoal::cli {

#if SHOAL_HAVE_PNG

namespace {

struct SurfaceDeleter {
  void operator()(cairo_surface_t* surface) const { cairo_surface_destroy(surface); }
};
struct ContextDeleter {
  void operator()(cairo_t* context) const { cairo_destroy(context); }
};
struct HandleDeleter {
  void operator()(RsvgHandle* handle) const { g_object_unref(handle); }
};

/// GLib's error message, freeing the error.
std::string take_message(GError* error) {
  std::string message = error != nullptr ? error->message : "unknown error";
  if (error != nullptr) g_error_free(error);
  return message;
}

}  // namespace

bool png_supported() { return true; }

void write_png(const std::string& svg, int width, int height, const std::string& path) {
  SHOAL_CHECK_T(InvalidArgument, width > 0 && height > 0 && width <= 16384 && height <= 16384,
                "a PNG of ", width, "x", height, " pixels cannot be drawn");
  GError* error = nullptr;
  std::unique_ptr<RsvgHandle, HandleDeleter> handle(rsvg_handle_new_from_data(
      reinterpret_cast<const guint8*>(svg.data()), svg.size(), &error));
  if (!handle) SHOAL_THROW(Error, "librsvg cannot read the picture: ", take_message(error));
  std::unique_ptr<cairo_surface_t, SurfaceDeleter> surface(
      cairo_image_surface_create(CAIRO_FORMAT_ARGB32, width, height));
  SHOAL_CHECK(cairo_surface_status(surface.get()) == CAIRO_STATUS_SUCCESS,
              "cairo cannot make a ", width, "x", height, " image: ",
              cairo_status_to_string(cairo_surface_status(surface.get())));
  std::unique_ptr<cairo_t, ContextDeleter> context(cairo_create(surface.get()));
  const RsvgRectangle viewport{0, 0, static_cast<double>(width), static_cast<double>(height)};
  if (!rsvg_handle_render_document(handle.get(), context.get(), &viewport, &error)) {
    SHOAL_THROW(Error, "librsvg cannot draw the picture: ", take_message(error));
  }
  cairo_surface_flush(surface.get());
  const cairo_status_t written = cairo_surface_write_to_png(surface.get(), path.c_str());
  SHOAL_CHECK(written == CAIRO_STATUS_SUCCESS, "cannot write ", path, ": ",
              cairo_status_to_string(written));
}

#else

bool png_supported() { return false; }

void write_png(const std::string&, int, int, const std::string& path) {
  SHOAL_THROW(InvalidArgument, "cannot write ", path,
              ": PNG support is not built in (librsvg and cairo were not found when Shoal was "
              "built); install librsvg2-dev and libcairo2-dev and rebuild, or write SVG (-o ",
              "FILE.svg)");
}

#endif

}  // namespace shoal::cli
