// PNG output of `shoal plot`: the SVG picture it draws, rendered by librsvg onto a cairo image.
// One drawing path for both formats: the PNG shows exactly what the SVG does.
//
// Built in when CMake finds librsvg and cairo (SHOAL_WITH_PNG, on by default; Debian:
// librsvg2-dev, libcairo2-dev); otherwise write_png throws InvalidArgument saying so.
//
// Thread safety: write_png may run on several threads at once (each call has its own handle and
// surface).
#pragma once

#include <string>

namespace shoal::cli {

/// Whether this build can write PNG.
bool png_supported();

/// Renders `svg` (a whole document) at `width` x `height` pixels and writes it to `path` as PNG.
/// Throws InvalidArgument when PNG support is not built in, shoal::Error when librsvg cannot read
/// the SVG or the file cannot be written.
void write_png(const std::string& svg, int width, int height, const std::string& path);

}  // namespace shoal::cli
