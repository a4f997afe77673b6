#include "launcher/line_prefixer.h"

#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <cstring>
#include <string_view>

#include "shoal/log.h"

namespace shoal::launcher {
namespace {

// The line every Shoal program ends a failure with (apps/shoal/main.cpp's report()).
constexpr std::string_view kErrorLineStart = "shoal: error: ";

bool is_error_line(const char* data, size_t size) {
  return std::string_view(data, size).substr(0, kErrorLineStart.size()) == kErrorLineStart;
}

}  // namespace

void write_all(int fd, const char* data, size_t size) {
  while (size > 0) {
    const ssize_t n = ::write(fd, data, size);
    if (n > 0) {
      data += n;
      size -= static_cast<size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && errno == EAGAIN) {
      // A non-blocking output: wait (bounded) until it drains, then retry.
      pollfd pfd{fd, POLLOUT, 0};
      if (::poll(&pfd, 1, 1000) <= 0) return;
    } else {
      return;  // EPIPE, EBADF...: nobody is reading; drop the output
    }
  }
}

LinePrefixer::LinePrefixer(std::string prefix, int out_fd)
    : prefix_(std::move(prefix)), out_fd_(out_fd) {}

void LinePrefixer::feed(const char* data, size_t size) {
  while (size > 0) {
    const void* newline = std::memchr(data, '\n', size);
    if (newline == nullptr) {
      pending_.append(data, size);
      if (pending_.size() >= kMaxLineBytes) {
        write_line(pending_.data(), pending_.size(), /*add_newline=*/true);
        pending_.clear();
      }
      return;
    }
    const size_t length = static_cast<const char*>(newline) - data + 1;
    if (pending_.empty()) {
      write_line(data, length, false);
    } else {
      pending_.append(data, length);
      write_line(pending_.data(), pending_.size(), false);
      pending_.clear();
    }
    data += length;
    size -= length;
  }
}

void LinePrefixer::flush() {
  if (pending_.empty()) return;
  write_line(pending_.data(), pending_.size(), /*add_newline=*/true);
  pending_.clear();
}

void LinePrefixer::write_line(const char* data, size_t size, bool add_newline) {
  if (copy_fd_ >= 0) {
    write_all(copy_fd_, data, size);
    if (add_newline) write_all(copy_fd_, "\n", 1);
  }
  if (out_fd_ < 0) return;
  if (errors_ != nullptr && is_error_line(data, size) && !log::enabled(log::Level::kDebug)) {
    if (errors_->hold) {
      if (held_order_ == 0) {
        held_order_ = ++errors_->held;
        held_error_.assign(data, std::min(size, kMaxHeldBytes));
        if (held_error_.back() != '\n') held_error_.push_back('\n');
      }
      return;
    }
    if (errors_->shown) return;
    errors_->shown = true;
  }
  write_out(data, size, add_newline);
}

void LinePrefixer::show_held_error() {
  if (held_error_.empty() || out_fd_ < 0) return;
  write_out(held_error_.data(), held_error_.size(), false);
  held_error_.clear();
  if (errors_ != nullptr) errors_->shown = true;
}

void LinePrefixer::write_out(const char* data, size_t size, bool add_newline) {
  line_.assign(prefix_);
  line_.append(data, size);
  if (add_newline) line_.push_back('\n');
  write_all(out_fd_, line_.data(), line_.size());
}

}  // namespace shoal::launcher
